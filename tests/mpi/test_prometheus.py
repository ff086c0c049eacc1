"""A real Prometheus server (Debian's package) scrapes 4 daemons while steps are put and a host is
rebuilt; every PromQL expression of the Grafana dashboard returns data through its HTTP API, and
``promtool check metrics`` finds nothing to say about any daemon's ``/metrics``."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import storage
from bench.harness import REPO, Cluster, make_state

DASHBOARD = REPO / "charts" / "grafana" / "ecsnap.json"


def _free_run(n: int) -> int:
    """A base port p with p..p+n-1 free on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise AssertionError("no run of free ports")


def _get(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _query(port: int, expr: str) -> list[Any]:
    q = urllib.parse.urlencode({"query": expr})
    body = json.loads(_get(f"http://127.0.0.1:{port}/api/v1/query?{q}"))
    assert body["status"] == "success", body
    result: list[Any] = body["data"]["result"]
    return result


def _exprs(job: str) -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"job", "host"} <= names  # a job and a host/instance variable
    out = []
    for panel in d["panels"]:
        for target in panel.get("targets", []):
            e = target["expr"]
            assert "[$__rate_interval]" in e or "[" not in e, e  # Grafana picks the window
            out.append(
                e.replace("$job", re.escape(job))
                .replace("$host", ".*")
                .replace("$__rate_interval", "1m")
            )
    return out


def test_a_real_prometheus_scrapes_the_daemons_and_the_dashboard_has_data(
    shm_root: Path, tmp_path: Path, prometheus_bin: Path
) -> None:
    base = _free_run(4)
    extra = ["--metrics-port", str(base), "--metrics-addr", "127.0.0.1"]
    c = Cluster(shm_root, hosts=4, k=3, m=1, extra=extra)
    targets = ", ".join(f'"127.0.0.1:{base + i}"' for i in range(4))
    config = (REPO / "charts" / "prometheus.yml").read_text()
    config = re.sub(r"targets: \[.*\]", f"targets: [{targets}]", config)
    config = config.replace("scrape_interval: 10s", "scrape_interval: 1s")
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(REPO / "charts" / "alerts.yml", tmp_path / "alerts.yml")  # its rule_files
    web = _free_run(1)
    prom = subprocess.Popen(
        [
            str(prometheus_bin / "prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    stores: list[storage.Store] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if "Ready" in _get(f"http://127.0.0.1:{web}/-/ready", timeout=2):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and prom.poll() is None, prom.stderr
            time.sleep(0.2)

        def put_for(seconds: float, first: int) -> int:
            step = first
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                hs = [s.put(step, make_state(r, step)) for r, s in enumerate(stores)]
                for h in hs:
                    h.wait(60)
                step += 1
                time.sleep(0.2)
            return step

        stores = c.stores(4)
        step = put_for(8, 1)
        # a host lost and rebuilt while Prometheus watches (the same ports after the relaunch)
        for s in stores:
            s.close()
        c.kill()
        shutil.rmtree(shm_root / c.job / "host1")
        c = c.relaunch()
        stores = c.stores(4)
        with pytest.raises(storage.StepNotFoundError):
            stores[0].get(10_000)  # an error, counted by kind
        put_for(8, step + 100)
        time.sleep(3)  # a few more scrapes
        up = _query(web, 'up{job="ecsnap"}')
        assert len(up) == 4 and all(r["value"][1] == "1" for r in up), up
        empty = [e for e in _exprs(c.job) if not _query(web, e)]
        assert not empty, f"dashboard expressions without data: {empty}"
        # the alert rules shipped beside the config are loaded and evaluate without error
        groups = json.loads(_get(f"http://127.0.0.1:{web}/api/v1/rules"))["data"]["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        assert set(rules) == {
            "EcsnapDescriptorsNearLimit",
            "EcsnapAcceptFailing",
            "EcsnapDaemonFailed",
            "EcsnapStepStuck",
        }, rules
        assert all(r["health"] in ("ok", "unknown") for r in rules.values()), rules
        fds = _query(web, f'process_open_fds{{job="{c.job}"}} / process_max_fds')
        assert len(fds) == 4 and all(0 < float(r["value"][1]) < 0.8 for r in fds), fds
        budget = _query(web, f'ecsnap_memory_budget_bytes{{job="{c.job}"}}')
        assert len(budget) == 4 and all(float(r["value"][1]) > 0 for r in budget), budget
        # promtool finds nothing to say about what any daemon exports
        for i in range(4):
            text = _get(f"http://127.0.0.1:{base + i}/metrics")
            lint = subprocess.run(
                [str(prometheus_bin / "promtool"), "check", "metrics"],
                input=text,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), (
                lint.stdout + lint.stderr
            )
    finally:
        for s in stores:
            s.close()
        prom.terminate()
        prom.communicate(timeout=30)  # reaps it and closes its stderr pipe
        assert c.stop() == 0
