"""The CPU floor of moving bytes between two daemons: one send and one receive, nothing else.

Run under ``mpiexec -n 2`` (:func:`measure` does): both ranks swap ``nbytes`` at once with
blocking ``Sendrecv`` calls in pieces of ``piece`` bytes, between pre-faulted buffers, as each host
of an exchange both sends and receives; each rank times its own process CPU. Rank 0 prints one
JSON line per run: the CPU seconds of both ranks together and the wall time of each repeat. Each
rank sent ``nbytes`` and received ``nbytes``, so a host that must send S bytes and receive S
bytes costs ``cpu * S / (2 * nbytes)`` at the floor.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SOURCES", "measure"]

SOURCES = ("private", "shm", "shm-copied")


def _swap(
    comm: Any,
    out: np.ndarray[Any, Any],
    into: np.ndarray[Any, Any],
    piece: int,
    row: np.ndarray[Any, Any] | None = None,
) -> None:
    """Send ``out`` to the peer while receiving its ``into``, piece by piece; with ``row``, each
    piece is first copied into that private row and sent from there (how the exchange sent
    between virtual hosts until 1da3062)."""
    from mpi4py import MPI

    peer = 1 - comm.Get_rank()
    for o in range(0, out.nbytes, piece):
        n = min(piece, out.nbytes - o)
        src = out[o : o + n]
        if row is not None:
            row[:n] = src
            src = row[:n]
        comm.Sendrecv([src, n, MPI.BYTE], peer, 7, [into[o : o + n], n, MPI.BYTE], peer, 7)


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    from storage.cpu import process_seconds

    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--piece", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--source",
        choices=SOURCES,
        default="private",
        help="send from private memory (the floor), from a /dev/shm file's mapping (a shard "
        "buffer), or from such a mapping copied piece by piece into a private row first",
    )
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("run under mpiexec -n 2")
    mapped = None
    if args.source == "private":
        out = np.full(args.bytes, comm.Get_rank() + 1, dtype=np.uint8)  # pre-faulted, both
    else:
        from transport import shm

        path = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        mapped = shm.create(path / "out", args.bytes)
        (path / "out").unlink()  # the mapping stays; nothing is left behind
        path.rmdir()
        out = mapped.array
        out[:] = comm.Get_rank() + 1
    row = np.ones(args.piece, dtype=np.uint8) if args.source == "shm-copied" else None
    into = np.ones(args.bytes, dtype=np.uint8)
    _swap(comm, out, into, args.piece, row)  # warm-up: MPI's own buffers and connections
    samples = []
    for _ in range(args.repeats):
        comm.Barrier()
        c0, t0 = process_seconds(), time.perf_counter()
        _swap(comm, out, into, args.piece, row)
        cpu, wall = process_seconds() - c0, time.perf_counter() - t0
        both = comm.gather(cpu, root=0)
        walls = comm.gather(wall, root=0)
        if both is not None and walls is not None:  # rank 0
            samples.append({"cpu": sum(both), "wall": max(walls)})
    if int(into[0]) != 2 - comm.Get_rank():
        raise AssertionError("the swap did not move the peer's bytes")
    if comm.Get_rank() == 0:
        print(json.dumps({"nbytes": args.bytes, "piece": args.piece, "samples": samples}))
    del out
    if mapped is not None:
        mapped.close()
    return 0


def measure(
    nbytes: int, piece: int = 1 << 20, repeats: int = 5, source: str = "private"
) -> list[dict[str, float]]:
    """Launch the swap under the venv's mpiexec; one sample per repeat: ``cpu`` (both ranks'
    CPU seconds for ``nbytes`` each way) and ``wall``. ``source``: see ``--source``."""
    from storage.launch import mpiexec

    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "bench.transfer_floor"]
    cmd += ["--bytes", str(nbytes), "--piece", str(piece), "--repeats", str(repeats)]
    cmd += ["--source", source]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"transfer floor failed ({done.returncode}):\n{done.stderr[-4000:]}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    samples: list[dict[str, float]] = json.loads(line)["samples"]
    return samples


if __name__ == "__main__":
    sys.exit(main())
