"""``ecsnap bench persist``: the persistent tier and the DCP front door against their alternatives.

One run, 4 virtual hosts, one trainer process per host holding a quarter of the state:

1. daemons without a persistent tier: ``put`` blocking time (the baseline for 2); then, in this
   process (one rank, no process group), ``dcp.save`` / ``dcp.load`` of the whole state through
   ``SnapshotWriter`` / ``SnapshotReader`` against DCP's ``FileSystemWriter`` / ``Reader`` to
   /dev/shm and to disk;
2. daemons with ``--persist-dir`` on disk (every step): ``put`` blocking while the previous
   step is being written against ``put`` blocking with the disk idle (the ratio must stay within
   noise of 1), and time from protected to published
   (manifest renamed into place) against ``torch.save`` + fsync of the same state to disk;
3. every host's memory wiped, daemons relaunched: the newest persisted step read back and
   protected again, then read by every rank (checked bit-exact), against ``torch.load`` from disk.

Disk reads come from a warm page cache on both sides (the files were just written). Results:
JSON lines in ``bench/results/persist.jsonl``, medians and spreads, ratios of medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from bench._common import Recorder, exit_on_sigterm, table
from bench._ranks import Workers
from bench.baselines import DISK, torch_disk
from bench.harness import Cluster, make_state, nbytes_of, same

HOSTS = 4


def _daemons(job: str, root: Path, extra: list[str]) -> Cluster:
    return Cluster(
        root,
        hosts=HOSTS,
        k=3,
        m=1,
        job=job,
        extra=extra,
        peer_timeout=120.0,
        log=root / "daemons.log",
    )


def _published(disk: Path, job: str, step: int, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while not (disk / job / f"step-{step}" / "manifest.json").exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} was not published in {disk / job}")
        time.sleep(0.002)
    return time.perf_counter()


def _dcp_times(state: dict[str, torch.Tensor], store: Any, step: int) -> dict[str, float]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from storage.dcp import SnapshotReader, SnapshotWriter

    out = {}
    target = {k: torch.empty_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", category=UserWarning, message=".*process group.*")
        for where, base in (("shm", Path("/dev/shm")), ("disk", DISK)):
            d = base / f"ecsnap-dcp-{uuid.uuid4().hex[:8]}"
            t0 = time.perf_counter()
            dcp_save(state, storage_writer=FileSystemWriter(str(d)), no_dist=True)
            out[f"dcp_fs_save_{where}"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            dcp_load(target, storage_reader=FileSystemReader(str(d)), no_dist=True)
            out[f"dcp_fs_load_{where}"] = time.perf_counter() - t0
            shutil.rmtree(d)
        t0 = time.perf_counter()
        dcp_save(state, storage_writer=SnapshotWriter(store, step), no_dist=True)
        out["dcp_ecsnap_save"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp_load(target, storage_reader=SnapshotReader(store, step), no_dist=True)
        out["dcp_ecsnap_load"] = time.perf_counter() - t0
    if not same(target, state):
        raise AssertionError("DCP through ecsnap loaded different bytes")
    store.delete(step)
    return out


def run(quick: bool = False, nbytes: int | None = None, repeats: int | None = None) -> None:
    import storage

    nbytes = nbytes or ((256 << 20) if quick else 1_500_000_000)
    repeats = repeats or (2 if quick else 3)
    root = Path("/dev/shm") / f"ecsnap-bench-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    disk = DISK / f"ecsnap-persist-{uuid.uuid4().hex[:8]}"
    job = "bench"
    rec = Recorder(
        "persist",
        {
            "quick": quick,
            "hosts": HOSTS,
            "k": 3,
            "m": 1,
            "state_bytes": nbytes,
            "repeats": repeats,
            "disk": str(DISK),
        },
    )
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    state = make_state(7, 0, nbytes=nbytes, tensors=200)
    actual = nbytes_of(state)
    workers = None
    daemons = _daemons(job, root, [])
    try:
        workers = Workers(job, root, nbytes, 200, HOSTS)
        with storage.connect(job, rank=0, world_size=1, host="host0", root=root) as store:
            step = 0
            for r in range(1 + repeats):
                step += 1
                puts = workers.all({"op": "put", "step": step})
                dcp_t = _dcp_times(state, store, 10_000 + step)
                t_save, t_load = torch_disk(state)
                if r == 0:
                    continue  # warm-up
                add("put_blocking_no_persist", max(p["staged"] for p in puts))
                for name, value in dcp_t.items():
                    add(name, value)
                add("torch_save_disk_fsync", t_save)
                add("torch_load_disk", t_load)
                print(
                    f"repeat {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in dcp_t.items()),
                    file=sys.stderr,
                )
        daemons.stop(60)
        shutil.rmtree(root / job)
        extra = ["--persist-dir", str(disk), "--persist-every", "1", "--persist-keep", "2"]
        daemons = _daemons(job, root, extra)
        step = 0
        for r in range(1 + repeats):
            step += 2
            a = workers.all({"op": "put", "step": step - 1})
            t_protected = time.perf_counter()  # the last rank's put returned: step protected
            b = workers.all({"op": "put", "step": step})  # while step - 1 is being written
            t_pub = _published(disk, job, step - 1) - t_protected
            _published(disk, job, step)
            if r == 0:
                continue
            add("put_blocking_disk_idle", max(p["staged"] for p in a))
            add("put_blocking_during_persist", max(p["staged"] for p in b))
            add("persist_after_protected", t_pub)
        # every host's memory wiped: the newest persisted step comes back from disk
        last = step
        for _ in range(repeats):
            daemons.stop(60)
            for h in range(HOSTS):
                shutil.rmtree(root / job / f"host{h}", ignore_errors=True)
            daemons = _daemons(job, root, extra)
            t0 = time.perf_counter()
            got = workers.all({"op": "get", "step": None, "verify": True})
            t_get = time.perf_counter() - t0
            if not all(g.get("exact") for g in got):
                raise AssertionError("the step put back from disk differs from what was put")
            infos = workers.all({"op": "info"})
            read = max(i["stats"]["restore_read_seconds"] for i in infos)
            if not all(i["latest"] == last for i in infos):
                raise AssertionError(f"restored {[i['latest'] for i in infos]}, wanted {last}")
            add("restore_read", read)
            add("restore_read_protect_get", read + t_get)
    finally:
        if workers is not None:
            workers.close()
        daemons.stop(60)
        if os.environ.get("ECSNAP_TRACE"):
            print((root / "daemons.log").read_text(), file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    rows, med = rec.times(samples, state_bytes=actual)
    ratios = [
        (
            "torch.save+fsync to disk / ecsnap persist (protected -> published)",
            med["torch_save_disk_fsync"] / med["persist_after_protected"],
            None,
        ),
        (
            "put blocking while a step is persisted / put blocking, disk idle (same daemons)",
            med["put_blocking_during_persist"] / med["put_blocking_disk_idle"],
            "<= 1.1",
        ),
        (
            "torch.load from disk / restore from disk (read + protect + get)",
            med["torch_load_disk"] / med["restore_read_protect_get"],
            None,
        ),
        (
            "DCP FileSystemWriter /dev/shm / DCP through ecsnap (save)",
            med["dcp_fs_save_shm"] / med["dcp_ecsnap_save"],
            None,
        ),
        (
            "DCP FileSystemWriter disk / DCP through ecsnap (save)",
            med["dcp_fs_save_disk"] / med["dcp_ecsnap_save"],
            None,
        ),
        (
            "DCP FileSystemReader /dev/shm / DCP through ecsnap (load)",
            med["dcp_fs_load_shm"] / med["dcp_ecsnap_load"],
            None,
        ),
        (
            "DCP FileSystemReader disk / DCP through ecsnap (load)",
            med["dcp_fs_load_disk"] / med["dcp_ecsnap_load"],
            None,
        ),
    ]
    out = rec.ratios(ratios)
    path = rec.write()
    print(table(rows, ["contender", "median s", "p10 s", "p90 s"]))
    print()
    print(table(out, ["ratio (this run)", "value", "target", "met"]))
    print(f"\nwrote {len(rec.records)} records to {path}")


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(
        prog="ecsnap bench persist",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="256 MB state, 2 repeats")
    parser.add_argument("--bytes", type=int, default=None, help="state size (default 1.5 GB)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    run(quick=args.quick, nbytes=args.bytes, repeats=args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
