"""A real storage job for tests: ``mpiexec -n H ecsnap serve --virtual-hosts`` on this machine,
and trainer ranks as separate Python processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import storage
from storage import launch

REPO = Path(__file__).resolve().parents[2]


class Cluster:
    """Daemons of one job under ``root``; ``stop()`` sends SIGTERM and checks a clean exit."""

    def __init__(
        self,
        root: Path,
        hosts: int = 4,
        k: int | None = None,
        m: int | None = None,
        extra: list[str] | None = None,
        job: str | None = None,
        host_names: list[str] | None = None,
    ) -> None:
        self.root = root
        self.job = job or f"t{uuid.uuid4().hex[:8]}"
        self.hosts = hosts
        self.host_names = host_names or [f"host{i}" for i in range(hosts)]
        self.log = root / f"{self.job}.log"
        self.proc = launch.start(
            hosts,
            self.job,
            root,
            self.log,
            virtual_hosts=host_names,
            k=k,
            m=m,
            extra=["--peer-timeout", "60", *(extra or [])],
            cwd=REPO,
            timeout=60,
        )

    def trainers(
        self,
        scenario: str,
        world: int,
        per_host: int,
        params: dict[str, Any],
        timeout: float = 120.0,
        hosts: list[str] | None = None,
        only: list[int] | None = None,
    ) -> list[dict[str, Any]]:
        """Run ``world`` trainer processes (rank r on host r // per_host); return their results."""
        names = hosts or self.host_names
        procs = []
        for rank in only if only is not None else range(world):
            spec = {
                "scenario": scenario,
                "job": self.job,
                "root": str(self.root),
                "rank": rank,
                "world": world,
                "host": names[rank // per_host],
                "params": params,
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.mpi._trainer", json.dumps(spec)],
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = []
        deadline = time.monotonic() + timeout
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _reap(procs)
                raise AssertionError(
                    f"trainer {rank} hung; daemon log:\n{self.log.read_text()}"
                ) from None
            if p.returncode != 0:
                _reap(procs)
                raise AssertionError(
                    f"trainer {rank} failed ({p.returncode}):\n{err}\n--- daemons:\n"
                    f"{self.log.read_text()}"
                )
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results

    def stores(self, world: int) -> list[storage.Store]:
        """One Store in this process per rank, rank r on the r-th host."""
        return [
            storage.connect(
                self.job, rank=r, world_size=world, host=self.host_names[r], root=self.root
            )
            for r in range(world)
        ]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _reap(procs: list[subprocess.Popen[str]]) -> None:
    for q in procs:
        if q.poll() is None:
            q.kill()
        q.communicate()
