"""Trainer ranks for the benchmarks, each in a process of its own, driven over JSON lines.

:class:`Workers` starts one long-lived rank per host that holds its part of a state and puts,
gets or reports its daemon's counters on command; :func:`run_fresh` starts new processes (as
after a crash) that each time one ``get`` or one ``torch.load`` and exit. Both run
``python -m bench._ranks --worker|--fresh SPEC``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import torch

import storage
from bench.harness import REPO, make_state, nbytes_of, same
from storage.cpu import process_seconds

__all__ = ["Workers", "fresh", "run_fresh", "worker"]


def _state(spec: dict[str, Any]) -> dict[str, Any]:
    return make_state(
        spec["rank"],
        0,
        nbytes=spec["nbytes"],
        tensors=spec["ntensors"],
        model=spec.get("model", 0),
    )


def _connect(spec: dict[str, Any]) -> Any:
    return storage.connect(
        spec["job"],
        rank=spec["rank"],
        world_size=spec["world"],
        host=spec["host"],
        root=spec["root"],
        timeout=60,
        # the same state is put at every step here, standing for one whose every byte changes
        # (pre-training): whole puts, as such a state costs (bench incremental measures the rest)
        incremental=False,
    )


def _touch(state: dict[str, torch.Tensor]) -> None:
    """Read one byte per page: every byte of a mapped state is then mapped in."""
    for t in state.values():
        int(t.reshape(-1).view(torch.uint8)[::4096].sum())


def worker(spec: dict[str, Any]) -> None:
    state = _state(spec)
    store = _connect(spec)
    print(json.dumps({"ready": True, "nbytes": nbytes_of(state)}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict[str, Any] = {}
        if cmd["op"] == "put":
            cpu0 = process_seconds()  # nothing else runs in this process meanwhile
            t0 = time.perf_counter()
            h = store.put(cmd["step"], state)
            t_return = time.perf_counter() - t0
            h.staged.result()
            t_staged = time.perf_counter() - t0
            at_staged = time.time()
            h.wait()
            out = {
                "return": t_return,
                "staged": t_staged,
                "protected": time.perf_counter() - t0,
                "at_staged": at_staged,  # wall clock: compared across the ranks' processes
                "at_protected": time.time(),
                "cpu": process_seconds() - cpu0,
                "first_map": bool(h.first_map),  # the put mapped its file itself
            }
        elif cmd["op"] == "get":
            t0 = time.perf_counter()
            got = store.get(cmd["step"])
            t_get = time.perf_counter() - t0
            _touch(got)
            out = {"get": t_get, "get_touched": time.perf_counter() - t0}
            if cmd.get("verify"):
                out["exact"] = same(got, state)
            del got
        elif cmd["op"] == "info":
            out = store.info()
        elif cmd["op"] == "quit":
            break
        print(json.dumps(out), flush=True)
    store.close()


def fresh(spec: dict[str, Any]) -> None:
    """A new process, as after a crash: a restarted trainer's ``get`` or a ``torch.load``.

    It imports what it needs (this module imports torch and storage), says ready, and starts
    on the next line of stdin, so that several start together and no import is timed. ``get``
    times connect + get + touching every page, then (with ``verify``) compares with the state
    its rank put; ``load`` times torch.load.
    """
    expected = None
    if spec.get("verify"):
        expected = _state(spec)
    print(json.dumps({"ready": True}), flush=True)
    if not sys.stdin.readline():
        return  # the benchmark gave up before the start (another process failed)
    t0 = time.perf_counter()
    if spec["op"] == "load":
        loaded = torch.load(spec["path"], weights_only=True)
        print(json.dumps({"load": time.perf_counter() - t0}), flush=True)
        del loaded
        return
    store = _connect(spec)
    got = store.get(spec["step"])
    _touch(got)
    out: dict[str, Any] = {"get_touched": time.perf_counter() - t0}
    if expected is not None:
        out["exact"] = same(got, expected)
    del got
    store.close()
    print(json.dumps(out), flush=True)


def _spawn(role: str, spec: dict[str, Any]) -> subprocess.Popen[str]:
    """``python -m bench.store --<role> SPEC``, talking JSON lines over its stdin and stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", "bench._ranks", f"--{role}", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def _read(p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"bench worker exited with {p.wait()}")
    result: dict[str, Any] = json.loads(line)
    return result


def _end(p: subprocess.Popen[str], timeout: float) -> None:
    """Close its pipes (a process still waiting for a line reads EOF) and reap it."""
    for pipe in (p.stdin, p.stdout):
        if pipe is not None:
            pipe.close()
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def run_fresh(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Start one :func:`fresh` process per spec, let them all go at once, return their results."""
    procs = [_spawn("fresh", spec) for spec in specs]
    try:
        for p in procs:
            _read(p)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        return [_read(p) for p in procs]
    finally:
        for p in procs:
            _end(p, 60)


class Workers:
    """One worker rank per host (rank r on host r), ``nbytes`` of state split among them."""

    def __init__(
        self,
        job: str,
        root: Any,
        nbytes: int,
        ntensors: int,
        hosts: int,
        model: int = 0,
        places: list[tuple[str, Any]] | None = None,
    ) -> None:
        """``places``: (host, root) of each rank where the hosts are not virtual hosts under one
        root (a lab's hosts, each with its own /dev/shm)."""
        where = places or [(f"host{r}", root) for r in range(hosts)]
        self.specs = [
            {
                "job": job,
                "root": str(where[rank][1]),
                "rank": rank,
                "world": hosts,
                "host": where[rank][0],
                "nbytes": nbytes // hosts,
                "ntensors": max(ntensors // hosts, 1),
                "model": model,
            }
            for rank in range(hosts)
        ]
        self.procs = [_spawn("worker", spec) for spec in self.specs]
        self.ready = [_read(p) for p in self.procs]

    def all(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        return [_read(p) for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None and p.stdin is not None:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
        for p in self.procs:
            _end(p, 30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._ranks")
    p.add_argument("--worker")
    p.add_argument("--fresh")
    a = p.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
    elif a.fresh:
        fresh(json.loads(a.fresh))
    return 0


if __name__ == "__main__":
    sys.exit(main())
