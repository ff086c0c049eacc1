"""Metrics and status end to end: real daemons, real HTTP scrapes, prometheus_client's parser."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.harness import REPO, Cluster
from storage.cpu import PHASES

from ._trainer import trainers
from .test_recovery import _data_file, _flip


def scrape(root: Path, job: str, host: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    port = int((root / job / host / "metrics.port").read_text())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("job", "host")))
            out[(s.name, labels)] = s.value
            assert s.labels.get("host") == host and s.labels.get("job") == job
            assert "step" not in s.labels  # never the step number
    return out


def _status_text(root: Path, job: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "storage.cli", "status", "--job", job, "--root", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def status(root: Path, job: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "storage.cli",
            "status",
            "--job",
            job,
            "--root",
            str(root),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_metrics_move_with_puts_corruption_and_rebuild(shm_root: Path) -> None:
    args = ["--metrics-port", "0", "--metrics-addr", "127.0.0.1"]
    c = Cluster(shm_root, hosts=4, k=3, m=1, extra=args)
    try:
        m = scrape(shm_root, c.job, "host0")
        assert m[("ecsnap_steps_held", ())] == 0
        assert math.isnan(m[("ecsnap_latest_protected_step", ())])
        assert m[("ecsnap_health", (("state", "healthy"),))] == 1
        trainers(c, "put", world=4, per_host=1, params={"steps": [1, 2]})
        held = {"data": 0.0, "parity": 0.0, "encoded": 0.0, "sent": 0.0}
        cpu: dict[str, float] = {}
        for h in range(4):
            m = scrape(shm_root, c.job, f"host{h}")
            for (name, labels), value in m.items():
                if name == "ecsnap_cpu_seconds_total":
                    cpu[dict(labels)["phase"]] = cpu.get(dict(labels)["phase"], 0.0) + value
            assert m[("ecsnap_latest_protected_step", ())] == 2
            assert m[("ecsnap_steps_held", ())] == 2
            assert m[("ecsnap_steps_protected_total", ())] == 2
            for kind in ("data", "parity"):
                held[kind] += m[("ecsnap_stored_bytes", (("kind", kind),))]
            held["encoded"] += m[("ecsnap_encode_bytes_total", ())]
            held["sent"] += m[("ecsnap_network_sent_bytes_total", ())]
            assert m[("ecsnap_stage_seconds_count", ())] == 2
            assert m[("ecsnap_protect_seconds_count", ())] == 2
            assert m[("ecsnap_hosts", (("state", "up"),))] == 4
            # the first put made its files; what shared memory it holds was faulted in once
            faulted = sum(
                m[("ecsnap_shm_faulted_bytes_total", (("when", w),))] for w in ("in_put", "ahead")
            )
            assert m[("ecsnap_shm_faulted_bytes_total", (("when", "in_put"),))] > 0
            assert m[("ecsnap_shm_bytes", ())] <= faulted
            assert m[("ecsnap_reserve_free_bytes", ())] == 0  # no --reserve
            assert m[("ecsnap_put_bytes_total", (("how", "copied"),))] > 0
            assert ("ecsnap_put_bytes_total", (("how", "referenced"),)) in m
            assert m[("ecsnap_pinned_steps", ())] == 0
        # about m/k = 1/3 of the data, rounded up to whole chunks on a tiny state
        assert held["data"] > 0 and 0 < held["parity"] < held["data"]
        assert held["encoded"] > 0 and held["sent"] > 0
        # CPU by phase: every phase the puts went through took some, the trainers' copies too
        assert set(cpu) == set(PHASES)
        for phase in ("stage", "checksum", "encode", "receive", "send", "exchange", "polling"):
            assert cpu[phase] > 0, (phase, cpu)
        for phase in ("rounds", "serve", "memory", "other"):
            assert cpu[phase] > 0, (phase, cpu)
        assert cpu["repair"] == 0 and cpu["fetch"] == 0  # nothing was rebuilt or fetched yet
        # a corrupted chunk found by a read: counted, repaired
        _flip(_data_file(shm_root, c.job, "host3", 2, 3))
        [r] = trainers(
            c,
            "check",
            world=4,
            per_host=1,
            only=[0],
            params={"steps": [2, 99], "ranks": [3]},
            hosts=["host3"] * 4,
        )
        assert list(r["errors"]) == ["99/3"]
        m = scrape(shm_root, c.job, "host3")
        assert m[("ecsnap_checksum_failures_total", ())] >= 1
        assert m[("ecsnap_missing_chunks_total", ())] == 0  # corrupted, not missing
        assert m[("ecsnap_rebuilds_total", ())] >= 1
        assert m[("ecsnap_errors_total", (("kind", "StepNotFoundError"),))] >= 1
        st = status(shm_root, c.job)
        assert [h["running"] for h in st["hosts"]] == [True] * 4
        assert all(h["protected"] == [1, 2] for h in st["hosts"])
        # a lost host, rebuilt at start-up: the replacement reports it
        c.kill()
        shutil.rmtree(shm_root / c.job / "host1")
        down = status(shm_root, c.job)
        # every slot of the layout, the lost one named as missing
        assert [h["host"] for h in down["hosts"]] == ["host0", "host1", "host2", "host3"]
        assert [h.get("missing", False) for h in down["hosts"]] == [False, True, False, False]
        assert all(
            not h["running"] and h["protected"] == [1, 2]
            for h in down["hosts"]
            if not h.get("missing")
        )
        text = _status_text(shm_root, c.job)
        assert "1 MISSING" in text and "no host directory" in text, text
        c = Cluster(shm_root, hosts=4, k=3, m=1, extra=args, job=c.job)
        # the newest step is rebuilt before the daemons serve, the older one right after
        deadline = time.monotonic() + 60
        while True:
            m = scrape(shm_root, c.job, "host1")
            if m[("ecsnap_health", (("state", "healthy"),))] == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert m[("ecsnap_rebuilt_chunks_total", ())] > 0
        assert m[("ecsnap_cpu_seconds_total", (("phase", "repair"),))] > 0
        # its chunks were missing, not corrupted: a replacement is no checksum failure
        assert m[("ecsnap_missing_chunks_total", ())] > 0
        assert m[("ecsnap_checksum_failures_total", ())] == 0
        assert m[("ecsnap_rebuilds_total", ())] == 2  # steps 1 and 2
        assert m[("ecsnap_rebuild_seconds_count", ())] == 2
        assert m[("ecsnap_degraded_stripes", ())] == 0
        assert m[("ecsnap_health", (("state", "healthy"),))] == 1
        text = _status_text(shm_root, c.job)
        assert "MISSING" not in text
        assert "host1" in text and "healthy" in text and "newest protected step: 2" in text
    finally:
        c.stop()
