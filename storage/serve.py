"""``ecsnap serve``: its options, and the daemon's life as a process (signals, exit codes).

    mpiexec -n HOSTS ecsnap serve --job NAME [options]

Exit codes: 0 stopped by SIGTERM/SIGINT (every daemon together), 2 options, files or limits that
cannot work (:class:`ConfigError`), 3 a peer daemon dead or stuck (the job is aborted; relaunch
it, the state stays on disk), 4 a thread the daemon needs failed (its log and ``health.json`` say
why; the job is aborted, the state stays on disk). A daemon never lives on without its round
engine or its accept loop.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from storage import limits, watch
from storage.config import DEFAULT_ROOT, ServeConfig
from storage.daemon import Daemon
from storage.errors import ConfigError, DaemonFailedError
from storage.faults import FaultSpecError, Hooks
from storage.host import log
from transport.errors import PeerTimeoutError
from transport.mpi import halt

__all__ = ["main", "parse_args"]


def _parse_size(text: str) -> int:
    """Bytes: ``1500000000``, or a number with a binary unit (``512M``, ``1.5GiB``, ``2tb``)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            value = float(t[:-1])
            if not math.isfinite(value):
                raise ValueError(text)
            return int(value * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no size: give bytes (1500000000) or a number with K, M, G or T "
            "(512M, 1.5GiB)"
        ) from None


def parse_args(argv: Iterable[str] | None) -> ServeConfig:
    p = argparse.ArgumentParser(
        prog="ecsnap serve",
        description=(
            "Run one ecsnap daemon per MPI rank, one rank per host: "
            "mpiexec -n HOSTS ecsnap serve --job NAME. Each daemon keeps its host's shards in "
            "shared memory under ROOT/JOB/HOST/ and protects them with Reed-Solomon parity on "
            "the other hosts of its group. SIGTERM or SIGINT stops them all; the files stay."
        ),
    )
    env_job = os.environ.get("ECSNAP_JOB")
    p.add_argument(
        "--job",
        default=env_job,
        help="the training run's name, the same for the trainers (default: $ECSNAP_JOB"
        + (f", now {env_job!r})" if env_job else ", unset)"),
    )
    p.add_argument(
        "--root",
        default=os.environ.get("ECSNAP_ROOT", DEFAULT_ROOT),
        help="where state lives, ROOT/JOB/HOST/ (default: $ECSNAP_ROOT, else "
        + DEFAULT_ROOT
        + "); "
        "keep it in RAM (/dev/shm)",
    )
    p.add_argument(
        "--k", type=int, help="data chunks per stripe (with --m; default: from the host count)"
    )
    p.add_argument("--m", type=int, help="parity chunks per stripe: hosts a group may lose")
    p.add_argument(
        "--shrink-last-group",
        action="store_true",
        help="with --k/--m: let a last group of fewer than k+m hosts run with a smaller k "
        "(more parity per byte); without it that layout is refused",
    )
    p.add_argument(
        "--virtual-hosts",
        nargs="?",
        const="",
        default=None,
        metavar="H0,H1,...",
        help="a whole cluster on one machine: rank i acts as host<i> (or the i-th name given); "
        "trainers here then talk to virtual host RANK %% HOSTS",
    )
    p.add_argument(
        "--chunk-bytes",
        type=_parse_size,
        default=0,
        help="the largest chunk (default 4M between virtual hosts, 2M over a network); a small "
        "state is cut finer, so that its parity stays near m/k of it",
    )
    p.add_argument(
        "--keep",
        type=int,
        default=2,
        help="protected steps kept (default 2; the newest always stays while one is written)",
    )
    p.add_argument(
        "--memory-budget",
        type=_parse_size,
        default=None,
        help="shared memory per host (e.g. 40G); a put over it fails with CapacityError and "
        "nothing stored is touched (default: what /dev/shm holds)",
    )
    p.add_argument(
        "--reserve",
        type=_parse_size,
        default=0,
        help="shared memory to pre-fault at start, per host (e.g. 12G: (keep+1) x (this host's "
        "shards + m/k of them)), while training still loads, so that the first puts find it "
        "ready; without it the files of later puts are still made ahead, once sizes are known",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics here (virtual host i: PORT+i; 0: a free port)",
    )
    p.add_argument(
        "--metrics-host",
        "--metrics-addr",
        dest="metrics_addr",
        default="127.0.0.1",
        help="address /metrics listens on (default 127.0.0.1, this machine only; give the "
        "node's private address, or 0.0.0.0 for every interface, for a Prometheus elsewhere)",
    )
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=120.0,
        help="seconds any wait on a peer daemon may take before the job is aborted (exit 3; "
        "default 120)",
    )
    p.add_argument(
        "--repair",
        choices=("chain", "star"),
        default="chain",
        help="how a lost chunk is rebuilt: chain (default; the helpers add their scaled chunks "
        "along a chain and the rebuilding host receives one chunk per lost chunk) or star "
        "(k chunks sent to the rebuilding host, which decodes)",
    )
    p.add_argument(
        "--persist-dir",
        default=None,
        help="the persistent tier, a directory every host sees: protected steps also go to "
        "DIR/JOB/step-STEP/ (safetensors + manifest), written in the background",
    )
    p.add_argument(
        "--persist-every", type=int, default=0, help="persist the steps that are multiples of N"
    )
    p.add_argument(
        "--persist-keep", type=int, default=2, help="persisted steps kept on disk (default 2)"
    )
    a = p.parse_args(list(argv) if argv is not None else None)
    if not a.job:
        p.error("give the job's name: --job NAME, or set ECSNAP_JOB")
    vh: tuple[str, ...] | None = None
    if a.virtual_hosts is not None:
        vh = tuple(h for h in a.virtual_hosts.split(",") if h) if a.virtual_hosts else ()
    return ServeConfig(
        job=a.job,
        root=Path(a.root),
        k=a.k,
        m=a.m,
        shrink_last_group=a.shrink_last_group,
        chunk_bytes=a.chunk_bytes,
        keep=a.keep,
        memory_budget=a.memory_budget,
        reserve=a.reserve,
        virtual_hosts=vh,
        metrics_port=a.metrics_port,
        metrics_addr=a.metrics_addr,
        peer_timeout=a.peer_timeout,
        repair=a.repair,
        persist_dir=Path(a.persist_dir).resolve() if a.persist_dir else None,
        persist_every=a.persist_every,
        persist_keep=a.persist_keep,
    )


def launch_check(size: int, environ: Mapping[str, str]) -> str | None:
    """Why an MPI world of ``size`` daemons is not what the launcher started, or None: a world
    of 1 where Slurm or a process manager says the step has more tasks means the daemons were
    started without a way to find each other (srun's default ``--mpi=none`` gives them no PMI),
    and each would run alone."""
    if size != 1:
        return None
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        value = environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            break
    else:
        return None
    if var.startswith("SLURM_"):
        return (
            f"MPI sees 1 daemon, but Slurm started {value} tasks ({var}): srun gave the daemons "
            "no PMI to find each other (Slurm's default --mpi=none), so each would run alone. "
            "Launch them with mpirun inside the allocation, one per node: `SLURM_OVERLAP=1 "
            'mpirun -ppn 1 -n $SLURM_NNODES ecsnap serve ...` (README, "On a cluster")'
        )
    return (
        f"MPI sees 1 daemon, but the launcher started {value} processes ({var}): this MPI "
        "library is not the one the launcher speaks to; launch with the mpiexec of ecsnap's "
        "environment (the mpich wheel: `which mpiexec` in its virtual environment)"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        print(f"ecsnap serve: {exc}", file=sys.stderr)
        return 2
    try:
        hooks = Hooks.from_spec(os.environ.get("ECSNAP_FAULTS"))
    except FaultSpecError as exc:
        print(f"ecsnap serve: ECSNAP_FAULTS: {exc}", file=sys.stderr)
        return 2
    raised = limits.raise_soft()  # before MPI opens its connections
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    why = launch_check(comm.Get_size(), os.environ)
    if why is not None:
        print(f"ecsnap serve: {why}", file=sys.stderr)
        return 2
    try:
        limits.check(raised, comm.Get_size(), socket.gethostname())
    except ConfigError as exc:  # this host's limit: the others may differ, so end the job
        print(f"ecsnap serve: {exc}", file=sys.stderr)
        comm.Abort(2)
        return 2
    try:
        daemon = Daemon(config, comm, hooks)
    except ConfigError as exc:
        if comm.Get_rank() == 0:
            print(f"ecsnap serve: {exc}", file=sys.stderr)
        return 2
    daemon.host.log(raised.text(comm.Get_size()))

    def stop(signum: int, frame: Any) -> None:
        daemon.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ring: watch.Watch | None = None
    try:
        daemon.start()
        if watch.wanted(os.environ):
            ring = watch.Watch(
                daemon.host.name,
                lambda host: _peer_gone(daemon, host),
                config.peer_timeout,
                daemon.host.log,
            )
            ring.start(daemon.host.links, config.virtual_hosts is not None)
        code = daemon.run()
        if ring is not None:
            ring.bye()
        log(daemon.host.name, f"stopped; state stays in {daemon.host.dir}")
        return code
    except ConfigError as exc:
        print(f"ecsnap serve: {exc}", file=sys.stderr)
        comm.Abort(2)
        return 2
    except PeerTimeoutError as exc:
        if ring is not None:
            ring.bye()  # going down, not dead: the neighbours hear of the silent hosts by MPI
        told = daemon.host.going_down(exc)
        log(daemon.host.name, f"{exc}; {told}")
        time.sleep(0.5)  # the trainers' waits hear why before the job goes
        return _abort(comm, 3)
    except DaemonFailedError:
        return _abort(comm, 4)  # Host.fail said why
    except Exception as exc:  # the round engine itself: never a daemon that lives on without it
        daemon.host.fail("the round engine", exc)
        return _abort(comm, 4)
    finally:
        daemon.close()


def _peer_gone(daemon: Any, host: str) -> None:
    """The peer watch heard ``host``'s daemon go (storage.watch): no more MPI calls here (one
    touching the dead peer may crash inside MPI), every waiting trainer and ``health.json`` are
    told, and the daemon exits 3, as after a peer timeout. The telling runs on a thread of its
    own with a deadline: a lock held by a thread parked in MPI must not keep the daemon alive."""
    halt()
    told: list[Any] = []
    t = threading.Thread(target=lambda: told.append(daemon.host.lost_peer(host)), daemon=True)
    t.start()
    t.join(2.0)
    log(daemon.host.name, f"{told[0] if told else f'host {host} is gone'}; exiting (3)")
    time.sleep(0.5)  # the trainers' waits hear why before the daemon goes
    os._exit(3)


def _abort(comm: Any, code: int) -> int:
    """End the whole storage job with ``code`` (MPI_Abort)."""
    # MPI_Abort asks the process manager to end the job; with a host cut off, that request can
    # spin for good inside MPI, holding the GIL (seen on the lab). The kernel's default action for
    # SIGALRM ends the process then, with no Python needed.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(5)
    comm.Abort(code)
    return code
