"""Run under ``mpiexec -n 2`` by test_links: how much CPU a waiting rank's waits take.

Rank 1 joins late (``late`` seconds, sleeping); rank 0 waits for it with
:meth:`transport.mpi.Links.wait` as a round does (``busy``: a control wait) and as a bulk
receive does (``busy``, ``transfer``), and prints its CPU and wall seconds for each, as one JSON
line. Then both swap bytes with ``transfer`` waits under a clock, to show which phases got them,
and once more in pieces, to show that ``arrived`` sees each receive as it completes.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def main() -> int:
    from mpi4py import MPI

    from storage.cpu import Clock
    from transport.mpi import Links

    late = float(sys.argv[1])
    comm = MPI.COMM_WORLD
    links = Links(comm, timeout=30.0)
    rank = comm.Get_rank()
    out: dict[str, object] = {}
    for kind in ("control", "transfer"):
        comm.Barrier()
        if rank == 1:
            time.sleep(late)
        buf = np.zeros(1, dtype=np.uint8)
        c0, t0 = time.thread_time(), time.perf_counter()
        if kind == "control":
            links.wait([comm.Ibarrier()], "late barrier", busy=True)
        elif rank == 0:
            links.wait(links.irecv(buf, 1, 5), "late byte", busy=True, transfer=True)
        else:
            links.wait(links.isend(buf, 0, 5), "late byte", busy=True, transfer=True)
        out[kind] = {"cpu": time.thread_time() - c0, "wall": time.perf_counter() - t0}
    clock = Clock()
    links.clock = clock
    data = np.full(8 << 20, rank + 1, dtype=np.uint8)
    into = np.zeros_like(data)
    peer = 1 - rank
    reqs = links.isend(data, peer, 6) + links.irecv(into, peer, 6)
    links.wait(reqs, "swap", busy=True, transfer=True)
    links.wait([comm.Ibarrier()], "after the swap")
    assert int(into[0]) == peer + 1
    out["phases"] = clock.totals()
    # a swap in 1 MiB pieces: ``arrived`` sees each receive piece once, done, and no send
    pieces = Links(comm, timeout=30.0, piece_bytes=1 << 20)
    into[:] = 0
    sends, receives = pieces.isend(data, peer, 7), pieces.irecv(into, peer, 7)
    seen: list[int] = []

    def arrived(req: object) -> None:
        assert req in receives and id(req) not in seen
        seen.append(id(req))

    pieces.wait(sends + receives, "swap in pieces", busy=True, transfer=True, arrived=arrived)
    comm.Barrier()
    assert int(into.min()) == int(into.max()) == peer + 1
    out["arrived"] = {"calls": len(seen), "receives": len(receives)}
    if rank == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
