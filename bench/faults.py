"""``ecsnap bench faults`` (the fault matrix) and ``ecsnap bench soak`` (random faults, N minutes).

Both run real storage jobs (4 virtual hosts under ``mpiexec``) and four trainer ranks in this
process (one :class:`storage.Store` each, on its own host), and check after every fault:

- each step ever reported protected is read back bit-exact from every rank, or reported
  unrecoverable, and the latter only when more than m hosts of a group were wiped;
- a step is never half visible: every rank of it reads, or none does;
- no call returns later than the configured timeouts allow (a hang);
- no process of the job outlives it, and no file appears in /dev/shm outside the job's root.

Matrix: each fault x ``--trials`` randomized trials (host, occurrence, k/m). Faults: SIGKILL at
each named phase (``transport.faults``), a dropped and a delayed MPI message, a failed shared
memory allocation, wiping 1..m hosts of a group and m+1, a corrupted data chunk, parity chunk and
manifest, a truncated chunk file; on jobs of several groups (``--hosts 8`` or ``12``), one
group's daemons or the whole job's killed at each phase of a round (``kill-group@PHASE``,
``kill-job@PHASE``: staging, encoding, sending, committing, retiring). Results: JSON lines in
``bench/results/faults.jsonl``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench import lab_faults
from bench._common import RESULTS, Recorder, exit_on_sigterm, table
from bench.harness import Cluster, close_all, make_state, same
from bench.lab import Lab
from bench.lab_faults import NET_FAULTS
from storage.errors import StorageError

HOSTS = 4
PEER_TIMEOUT = 6.0  # seconds: a dead peer ends the job this fast
CLIENT_TIMEOUT = 5.0
HANG = PEER_TIMEOUT + CLIENT_TIMEOUT + 30.0  # no single call may take longer than this
LOGS = Path(tempfile.gettempdir()) / "ecsnap-fault-logs"
FROZEN = 3 << 20  # bytes of each rank's state that never change (see _state)
KEEP = 4  # retention: a protected step may be evicted once KEEP newer ones are protected
FAULTS = [
    "kill@staging",
    "kill@encoding",
    "kill@sending",
    "kill@committing",
    "kill@rebuilding",
    "drop@send",
    "delay@send",
    "enospc@alloc",
    "wipe-1..m",
    "wipe-m+1",
    "corrupt-data",
    "corrupt-parity",
    "truncate-data",
    "corrupt-manifest",
]

# The crash points of a round, on jobs of several groups (--hosts 8 or 12): one group's daemons
# killed at a phase, or the whole job's (each daemon at the same hit of it)
PHASES = ["staging", "encoding", "sending", "committing", "retiring"]
GROUP_FAULTS = [f"kill-group@{p}" for p in PHASES] + [f"kill-job@{p}" for p in PHASES]
CRASHES = ("kill-group@", "kill-job@")
INJECTED = ("kill@", "drop@", "delay@", "enospc@")  # one daemon's fault, by ECSNAP_FAULTS


def _state(rank: int, step: int) -> dict[str, Any]:
    """What a rank puts at ``step``: 750 kB that change every step beside 3 MB that never do
    (a frozen tower), so every fault also meets puts that refer to an earlier step's bytes."""
    return make_state(rank, step, frozen=FROZEN)


def timed(fn: Callable[[], Any], what: str, problems: list[str]) -> Any:
    """Run ``fn`` in a thread; a call that outlives HANG is a hang (recorded, not waited for)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG)
    if t.is_alive():
        problems.append(f"hang: {what} still running after {HANG:.0f}s")
        raise TimeoutError(what)
    if "error" in box:
        raise box["error"]
    return box.get("value")


@dataclass
class Job:
    """One storage job and the trainer ranks connected to it."""

    root: Path
    k: int
    m: int
    hosts: int = HOSTS
    job: str = field(default_factory=lambda: f"f{uuid.uuid4().hex[:8]}")
    proc: Any = None
    cluster: Cluster | None = None
    stores: list[Any] = field(default_factory=list)
    protected: set[int] = field(default_factory=set)
    attempted: set[int] = field(default_factory=set)
    fired: int = 0
    _seen: int = 0  # how much of the (appended) log earlier launches wrote
    pids: set[int] = field(default_factory=set)  # every process of the job seen (see trial)

    @property
    def log(self) -> Path:
        return self.root / f"{self.job}.log"

    def start(self, fault: str | None = None) -> bool:
        """Launch the daemons (with ``fault`` injected); False if they died before serving."""
        try:
            self.cluster = Cluster(
                self.root,
                hosts=self.hosts,
                k=self.k,
                m=self.m,
                extra=["--chunk-bytes", "65536", "--keep", str(KEEP)],
                job=self.job,
                env={"ECSNAP_FAULTS": fault} if fault else None,
                peer_timeout=PEER_TIMEOUT,
                log=self.log,
            )
        except RuntimeError:  # the daemons died before serving (a fault at start-up, say)
            self.cluster = None
            self._count_fired()
            return False
        self.proc = self.cluster.proc
        self.pids |= set(_job_pids(self.job))
        return True

    def _count_fired(self) -> None:
        """Count the injected-fault lines the launches since the last count logged."""
        if self.log.exists():
            text = self.log.read_text()
            self.fired += text.count("injected fault", self._seen)
            self._seen = len(text)

    def connect(self) -> None:
        self.close_stores()
        assert self.cluster is not None
        self.stores = self.cluster.stores(self.hosts, timeout=CLIENT_TIMEOUT)

    def close_stores(self) -> None:
        close_all(self.stores)

    def put(self, step: int, problems: list[str]) -> bool:
        """All ranks put ``step``; True if every rank saw it protected."""
        self.attempted.add(step)
        handles = []
        try:
            for r, s in enumerate(self.stores):
                handles.append(timed(partial(s.put, step, _state(r, step)), "put", problems))
            # all at once, and the first failure ends the wait (a rank whose daemon died fails
            # fast; the others' step can then never complete)
            futures = [h.protected for h in handles]
            done, pending = timed(
                partial(cf.wait, futures, PEER_TIMEOUT + CLIENT_TIMEOUT, cf.FIRST_EXCEPTION),
                "wait",
                problems,
            )
            if pending:
                return False
            for f in done:
                exc = f.exception()
                if exc is not None and not isinstance(exc, (StorageError, TimeoutError)):
                    raise exc
            if any(f.exception() is not None for f in done):
                return False
        except (TimeoutError, StorageError):
            return False  # what a fault does to a put; anything else is a bug and propagates
        self.protected.add(step)
        return True

    def stop(self, how: str = "term") -> None:
        """End the job: SIGTERM (clean) or SIGKILL; wait for it either way."""
        self.close_stores()
        if self.proc is None:
            return
        self.pids |= set(_job_pids(self.job))
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM if how == "term" else signal.SIGKILL)
        try:
            self.proc.wait(PEER_TIMEOUT + 30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._count_fired()  # this launch's lines only
        self.proc = None

    def died(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def wait_exit(self) -> None:
        """The job died of a fault: mpiexec (or the peer timeout) must end it by itself."""
        if self.proc is None:
            return
        try:
            self.proc.wait(PEER_TIMEOUT * 3 + 30)
        except subprocess.TimeoutExpired:
            pass
        self.stop("kill")

    def verify(self, problems: list[str], wiped_beyond: bool) -> dict[str, int]:
        """Read every attempted step from every rank; check the invariants."""
        import storage

        counts = {"checked": 0, "unrecoverable": 0}
        for step in sorted(self.attempted):
            readable = []
            for r, s in enumerate(self.stores):
                try:
                    got = timed(partial(s.get, step), f"get {step}", problems)
                except storage.SnapshotUnrecoverableError as exc:
                    if not wiped_beyond:
                        problems.append(f"step {step} rank {r} unrecoverable without cause: {exc}")
                    counts["unrecoverable"] += 1
                    readable.append(False)
                    continue
                except storage.StepNotFoundError:
                    if step in self.protected and not self._evicted(step):
                        problems.append(f"protected step {step} rank {r} is gone")
                    readable.append(False)
                    continue
                except TimeoutError:
                    readable.append(False)
                    continue
                except storage.StorageError as exc:
                    problems.append(f"step {step} rank {r}: {type(exc).__name__}: {exc}")
                    readable.append(False)
                    continue
                ok = same(got, _state(r, step))
                del got
                if not ok:
                    problems.append(f"step {step} rank {r}: WRONG BYTES")
                readable.append(ok)
                counts["checked"] += 1
            if any(readable) and not all(readable) and not wiped_beyond:
                problems.append(f"step {step} half visible: {readable}")
        return counts

    def _evicted(self, step: int) -> bool:
        """Retention may have dropped ``step``: KEEP newer steps are protected (some maybe
        without their trainers hearing of it, when a fault struck right after)."""
        try:
            held = self.stores[0].steps()
        except Exception:
            return False
        return len([s for s in held if s > step]) >= KEEP

    def rebuilds(self) -> int:
        n = 0
        for s in self.stores:
            try:
                n += int(s.info()["stats"]["rebuilds"])
            except Exception:
                pass
        return n


def _shm_files(root: Path) -> set[str]:
    base = Path("/dev/shm")
    return {p.name for p in base.iterdir() if p != root} if base.is_dir() else set()


def _mapped_shm() -> set[str]:
    """Names of /dev/shm files some live process has mapped (not leaked, in use)."""
    names = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            maps = (p / "maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            i = line.find("/dev/shm/")
            if i >= 0:
                names.add(line[i + len("/dev/shm/") :].split("/")[0].removesuffix(" (deleted)"))
    return names


def mpich_pid(name: str) -> int | None:
    """The PID an MPICH shared-memory segment file is named after (``mpich_shm_<hex pid>_<n>``,
    the node's first rank), or None for another name."""
    parts = name.split("_")
    if len(parts) == 4 and name.startswith("mpich_shm_"):
        try:
            return int(parts[2], 16)
        except ValueError:
            return None
    return None


def _made_by_others(name: str, pids: set[int]) -> bool:
    """An MPICH segment named after a process that is not one of the job's: another job's on
    this machine (tests run side by side), not this trial's leak."""
    pid = mpich_pid(name)
    return pid is not None and pid not in pids


def _leaked(root: Path, before: set[str], pids: set[int]) -> set[str]:
    """Files in /dev/shm outside the job root that were not there ``before`` and no live
    process maps (tests run side by side: another job's, in use, are not this trial's)."""
    new = {n for n in _shm_files(root) - before if not n.startswith("ecsnap-")}
    new -= _mapped_shm()
    return {n for n in new if not _made_by_others(n, pids)}


def _job_pids(job: str, daemons_only: bool = False) -> list[int]:
    """Processes whose command line names ``job`` (the daemons; with mpiexec unless
    ``daemons_only``)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{job}".encode() not in argv or b"serve" not in argv:
            continue
        if daemons_only and any(b"mpiexec" in a or b"hydra" in a for a in argv[:1]):
            continue
        out.append(int(p.name))
    return out


def _files(job: Job, host: int) -> dict[str, list[tuple[Path, int]]]:
    """The files of ``host`` that hold kept steps, each with the bytes of it in use: the shard
    buffers and parity files its manifests name (the pool's free files, made ahead of need, hold
    nothing: a fault there would test nothing), and the manifests."""
    d = job.root / job.job / f"host{host}"
    out: dict[str, list[tuple[Path, int]]] = {"data": [], "parity": [], "manifest": []}
    for path in sorted((d / "steps").glob("*.json")):
        out["manifest"].append((path, path.stat().st_size))
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        cb = int(m["step_chunk_bytes"])
        for shard in m["shards"]:
            f = d / "data" / shard["buffer"]
            if f.exists() and shard["nbytes"]:
                out["data"].append((f, int(shard["nbytes"])))
        for slot, name in m["parity"].items():
            f = d / "parity" / name
            used = len(m["crc"].get(slot, {}).get("parity", [])) * cb
            if name and f.exists() and used:
                out["parity"].append((f, used))
    return {kind: sorted(set(files)) for kind, files in out.items()}


def _found(job: Job) -> int:
    """Chunks and manifests the daemons found bad (checksum failures) or gone, summed."""
    n = 0
    for s in job.stores:
        stats = s.info()["stats"]
        n += int(stats["checksum_failures"]) + int(stats["missing_chunks"])
    return n


def _crash_spec(fault: str, hosts: int, k: int, m: int, rng: random.Random) -> str:
    """``kill-group@P``: every daemon of a random group killed at its Nth hit of phase P (the
    first death makes mpiexec end the rest wherever they are); ``kill-job@P``: every daemon of
    the job at its Nth hit of P, the groups at different points of the same round."""
    what, point = fault.split("@")
    # past the first step, so that an acknowledged one is at stake (a daemon retires a step's
    # files three times in a trial: steps 2-4, once steps 6-8 are protected)
    nth = rng.randint(1, 3) if point == "retiring" else rng.randint(2, 6)
    if what == "kill-job":
        return f"kill@{point}:nth={nth}"
    g = rng.randrange(hosts // (k + m))
    return ",".join(
        f"kill@{point}:host=host{i}:nth={nth}" for i in range(g * (k + m), (g + 1) * (k + m))
    )


def trial(fault: str, root: Path, rng: random.Random, hosts: int = HOSTS) -> dict[str, Any]:
    """One randomized trial of ``fault`` on ``hosts`` virtual hosts; returns its outcome."""
    km = rng.choice([(3, 1), (2, 2)])
    job = Job(root, *km, hosts=hosts)
    problems: list[str] = []
    before = _shm_files(root)
    host = rng.randrange(hosts)
    wiped: list[int] = []
    beyond = False
    damaged = False  # a file of a kept step was corrupted or cut
    steps = 4
    try:
        if fault.startswith(("kill-group@", "kill-job@")):
            steps = KEEP + 4  # retention (KEEP) retires steps 2-4 (1 is the frozen base)
            if not job.start(_crash_spec(fault, hosts, *km, rng)):
                problems.append("daemons did not start")
                return _result(fault, job, problems, {}, km)
            job.connect()
            for step in range(1, steps + 1):
                if not job.put(step, problems):
                    break  # the job is going down
            job.wait_exit()
        elif (
            fault.startswith(("kill@", "drop@", "delay@", "enospc@")) and fault != "kill@rebuilding"
        ):
            kind, point = fault.split("@")
            nth = rng.randint(1, 3) if point != "send" else rng.randint(1, 30)
            spec = f"{fault}:host=host{host}:nth={nth}"
            if kind == "delay":
                spec += f":seconds={rng.uniform(0.2, 2.0):.2f}"
            if not job.start(spec):
                problems.append("daemons did not start")
                return _result(fault, job, problems, {}, km)
            job.connect()
            for step in range(1, steps + 1):
                if not job.put(step, problems) and kind in ("kill", "drop"):
                    break  # the job is going down: its daemons end it within the peer timeout
            if kind in ("delay", "enospc"):
                for step in range(steps + 1, steps + 3):  # the job goes on after the fault
                    if not job.put(step, problems):
                        problems.append(f"put of step {step} failed after a {kind} fault")
                job.stop("term")
            else:
                job.wait_exit()
        else:
            if not job.start():
                problems.append("daemons did not start")
                return _result(fault, job, problems, {}, km)
            job.connect()
            for step in range(1, steps + 1):
                if not job.put(step, problems):
                    problems.append(f"put of step {step} failed with no fault")
            job.stop("kill")
            if fault == "kill@rebuilding":
                wiped = [host]
                shutil.rmtree(root / job.job / f"host{host}")
                other = rng.choice([h for h in range(hosts) if h != host])
                spec = f"kill@rebuilding:host=host{other}:nth=1"
                if job.start(spec):  # died during the rebuild, or the rebuild finished first
                    job.connect()
                    job.stop("kill")
                else:
                    job.stop("kill")
            elif fault.startswith("wipe"):
                group_m = km[1]
                n = rng.randint(1, group_m) if fault == "wipe-1..m" else group_m + 1
                wiped = rng.sample(range(hosts // sum(km) * sum(km)), n)
                beyond = n > group_m
                for h in wiped:
                    shutil.rmtree(root / job.job / f"host{h}")
            else:
                kind = {
                    "corrupt-data": "data",
                    "corrupt-parity": "parity",
                    "truncate-data": "data",
                    "corrupt-manifest": "manifest",
                }[fault]
                files = _files(job, host)[kind]
                if not files:
                    problems.append(f"{fault}: host{host} holds no {kind} file of a kept step")
                else:
                    f, used = rng.choice(files)
                    raw = bytearray(f.read_bytes())
                    if fault == "truncate-data":
                        f.write_bytes(bytes(raw[: rng.randrange(used)]))
                    else:
                        raw[rng.randrange(used)] ^= 1 << rng.randrange(8)
                        f.write_bytes(bytes(raw))
                    damaged = True
        # an injected fault is counted from the lines each launch logged: one that never fired
        # tested nothing
        if fault.startswith((*CRASHES, *INJECTED)) and not job.fired:
            problems.append(f"the fault {fault} did not fire: the trial tested nothing")
        # relaunch without faults and check every step ever attempted
        if not job.start():
            problems.append("relaunch without faults failed")
            return _result(fault, job, problems, {}, km)
        job.connect()
        counts = job.verify(problems, beyond)
        counts["rebuilds"] = job.rebuilds()
        if damaged and not _found(job):
            problems.append(
                f"{fault}: the daemons never found the damage: the trial tested nothing"
            )
        counts["wiped"] = len(wiped)
        job.stop("term")
        if job.proc is not None:
            problems.append("the job did not stop")
        left = _job_pids(job.job)
        if left:
            problems.append(f"leftover processes: {left}")
        new = _leaked(root, before, job.pids)
        if new:  # another run's file between its creation and its mapping (or unlink)?
            time.sleep(2.0)
            new &= _leaked(root, before, job.pids)
        if new:
            problems.append(f"files left in /dev/shm outside the job root: {sorted(new)}")
        return _result(fault, job, problems, counts, km)
    finally:
        if job.proc is not None:
            job.stop("kill")
        if problems and job.log.exists():
            keep = LOGS / f"{fault}-{job.job}.log"
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(job.log, keep)
            problems.append(f"daemon log: {keep}")
        shutil.rmtree(root / job.job, ignore_errors=True)
        job.log.unlink(missing_ok=True)


def _result(
    fault: str, job: Job, problems: list[str], counts: dict[str, int], km: tuple[int, int]
) -> dict[str, Any]:
    return {
        "fault": fault,
        "k": km[0],
        "m": km[1],
        "protected": len(job.protected),
        "attempted": len(job.attempted),
        "fired": job.fired,
        "problems": problems,
        **counts,
    }


def run_matrix(
    trials: int,
    seed: int,
    only: list[str] | None = None,
    record: bool = True,
    hosts: int = HOSTS,
) -> int:
    rng = random.Random(seed)
    root = Path("/dev/shm") / f"ecsnap-faults-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    rec = Recorder(
        "faults", {"trials": trials, "seed": seed, "hosts": hosts, "peer_timeout": PEER_TIMEOUT}
    )
    rows = []
    failed = 0
    net = [f for f in only or FAULTS + GROUP_FAULTS + NET_FAULTS if f in NET_FAULTS]
    lab = Lab.up(lab_faults.HOSTS, link_gbit=lab_faults.LINK_GBIT) if net else None
    try:
        for fault in only or FAULTS + GROUP_FAULTS + NET_FAULTS:
            outcomes = []
            for i in range(trials):
                t0 = time.monotonic()
                if lab is not None and fault in NET_FAULTS:
                    out = lab_faults.trial(lab, fault, rng)
                else:
                    out = trial(fault, root, rng, hosts)
                out["seconds"] = time.monotonic() - t0
                outcomes.append(out)
                mark = "ok" if not out["problems"] else f"PROBLEMS {out['problems']}"
                print(
                    f"{fault} trial {i + 1}/{trials} RS({out['k']},{out['m']}): protected "
                    f"{out['protected']}/{out['attempted']}, fired {out['fired']}, "
                    f"{out['seconds']:.1f}s: {mark}",
                    file=sys.stderr,
                )
            lost = sum(len(o["problems"]) for o in outcomes)
            failed += lost
            summary = {
                "trials": len(outcomes),
                "faults_fired": sum(o["fired"] for o in outcomes),
                "steps_protected": sum(o["protected"] for o in outcomes),
                "steps_checked": sum(o.get("checked", 0) for o in outcomes),
                "unrecoverable_reads": sum(o.get("unrecoverable", 0) for o in outcomes),
                "rebuilds": sum(o.get("rebuilds", 0) for o in outcomes),
                "lost": lost,
            }
            rec.records = []  # one line per fault, written as it completes
            rec.add(
                kind="fault",
                name=fault,
                unit="count",
                **summary,
                problems=[p for o in outcomes for p in o["problems"]][:20],
            )
            rows.append((fault, *summary.values()))
            if record:
                rec.write()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if lab is not None:
            lab.down()
    print(
        table(
            rows,
            [
                "fault",
                "trials",
                "fired",
                "protected",
                "checked",
                "unrecoverable",
                "rebuilds",
                "lost",
            ],
        )
    )
    if record:
        print(f"\nwrote {len(rows)} records to {RESULTS / 'faults.jsonl'}")
    return 1 if failed else 0


def run_soak(minutes: float, seed: int) -> int:
    """Continuous puts; every few steps a random fault: a daemon SIGKILLed, a host wiped (and
    rebuilt), the whole job killed; every protected step checked after each relaunch."""
    rng = random.Random(seed)
    root = Path("/dev/shm") / f"ecsnap-soak-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    km = (3, 1)
    job = Job(root, *km)
    problems: list[str] = []
    puts = kills = wipes = rebuilds = checked = 0
    deadline = time.monotonic() + minutes * 60
    step = 0
    plan: list[str] = []
    t_start = time.monotonic()
    try:
        if not job.start():
            raise RuntimeError("daemons did not start")
        job.connect()
        while time.monotonic() < deadline:
            for _ in range(rng.randint(2, 6)):
                step += 1
                if job.put(step, problems):
                    puts += 1
            held = set(job.stores[0].steps())  # retention's choice, before the fault strikes
            job.protected &= held
            job.attempted = {s for s in job.attempted if s in held or s > max(held, default=0)}
            if not plan:  # every kind of fault in each round of four, in a random order
                plan = ["kill-daemon", "kill-daemon", "wipe-host", "kill-job"]
                rng.shuffle(plan)
            action = plan.pop()
            if action == "kill-daemon":
                pids = _job_pids(job.job, daemons_only=True)
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                job.wait_exit()
                kills += 1
            else:
                job.stop("kill")
                kills += 1
                if action == "wipe-host":
                    shutil.rmtree(
                        root / job.job / f"host{rng.randrange(job.hosts)}", ignore_errors=True
                    )
                    wipes += 1
            if not job.start():
                problems.append(f"relaunch after {action} failed")
                break
            job.connect()
            counts = job.verify(problems, wiped_beyond=False)
            checked += counts["checked"]
            rebuilds += job.rebuilds()
            elapsed = (time.monotonic() - t_start) / 60
            print(
                f"soak {elapsed:.1f} min: step {step}, puts {puts}, kills {kills}, wipes "
                f"{wipes}, rebuilds {rebuilds}, checked {checked}, lost {len(problems)}",
                file=sys.stderr,
            )
            if problems:
                print(f"  problems: {problems[-3:]}", file=sys.stderr)
    finally:
        job.stop("term")
        shutil.rmtree(root, ignore_errors=True)
    rec = Recorder(
        "soak",
        {
            "minutes": minutes,
            "seed": seed,
            "hosts": HOSTS,
            "k": km[0],
            "m": km[1],
            "peer_timeout": PEER_TIMEOUT,
        },
    )
    rec.add(
        kind="soak",
        name="soak",
        unit="count",
        minutes_run=(time.monotonic() - t_start) / 60,
        puts=puts,
        steps=step,
        kills=kills,
        wipes=wipes,
        rebuilds=rebuilds,
        reads_checked=checked,
        lost=len(problems),
        problems=problems[:20],
    )
    path = rec.write()
    print(
        f"puts {puts}, kills {kills}, wipes {wipes}, rebuilds {rebuilds}, reads checked "
        f"{checked}, lost {len(problems)}; wrote {path}"
    )
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(
        prog="ecsnap bench faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trials", type=int, default=20, help="randomized trials per fault")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only",
        nargs="*",
        choices=FAULTS + GROUP_FAULTS + NET_FAULTS,
        help="just these faults (the network faults run on a lab: root only)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=HOSTS,
        help="virtual hosts of each job (8 or 12: two or three groups, for the group faults)",
    )
    a = p.parse_args(argv)
    return run_matrix(a.trials, a.seed, a.only, hosts=a.hosts)


def soak_main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(prog="ecsnap bench soak", description=run_soak.__doc__)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    return run_soak(a.minutes, a.seed)


if __name__ == "__main__":
    sys.exit(main())
