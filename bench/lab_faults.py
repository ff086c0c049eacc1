"""Network faults for ``ecsnap bench faults``, on hosts that are really apart (:mod:`bench.lab`).

- ``link-down@put``: a host's link goes down while a put's exchange is in flight. Every rank's
  put fails with a :class:`StorageError`, the others' naming the cut-off host; ``ecsnap status``
  names it; the daemons that saw it end the job (MPI cannot lose a rank and go on); with the link
  back, a relaunch serves every protected step unchanged.
- ``link-down@rebuild``: a helper's link goes down while the relaunched job rebuilds a wiped host
  (held open by an injected delay of a bulk send). The job goes down; with the link back, the next
  relaunch rebuilds.
- ``slow-link@put``: a host's link slowed to 1/100 of its rate for a put: the put completes,
  later; the job carries on.
- ``sigstop``: a daemon stopped with SIGSTOP (alive, silent) during a put and continued after a
  random time, in half the trials shorter than the peer timeout (the job carries on: the put
  completes) and in half longer (the job goes down; a relaunch recovers).

Each trial proves its fault fired (the link was down and a put failed naming its host; the
injected delay's log line; the shaper's overlimit counter; the daemon seen stopped) and checks
every step ever protected bit-exact afterwards, and that no call hung past its timeout.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.harness import REPO, close_all, make_state, same
from bench.lab import Lab, LabJob, process_state

NET_FAULTS = ["link-down@put", "link-down@rebuild", "slow-link@put", "sigstop"]
HOSTS = 4
PEER_TIMEOUT = 8.0
CLIENT_TIMEOUT = 10.0
LINK_GBIT = 2.0


def _status(job: LabJob, i: int) -> str:
    cmd = [sys.executable, "-m", "storage.cli", "status", "--job", job.job]
    return subprocess.run(
        [*cmd, "--root", str(job.root(i))], cwd=REPO, capture_output=True, text=True, timeout=60
    ).stdout


def _overlimits(lab: Lab, i: int) -> int:
    """Packets host i's shaper held back (tbf's overlimits, both ends of its link)."""
    n = 0
    for dev, ns in ((lab.veths[i], None), ("eth0", lab.hosts[i])):
        cmd = ["tc", "-s", "qdisc", "show", "dev", dev]
        out = subprocess.run(
            ["ip", "netns", "exec", ns, *cmd] if ns else cmd, capture_output=True, text=True
        ).stdout
        words = out.replace(",", " ").split()
        n += sum(int(words[j + 1]) for j, w in enumerate(words[:-1]) if w == "overlimits")
    return n


class Trial:
    def __init__(self, lab: Lab, fault: str, rng: random.Random) -> None:
        self.lab, self.fault, self.rng = lab, fault, rng
        self.k, self.m = rng.choice([(3, 1), (2, 2)])
        self.name = f"n{uuid.uuid4().hex[:7]}"
        self.problems: list[str] = []
        self.protected: set[int] = set()
        self.fired = 0
        self.job: LabJob | None = None
        self.stores: list[Any] = []

    def start(self, env: dict[str, str] | None = None, ready: bool = True) -> LabJob:
        self.job = LabJob(
            self.lab,
            self.name,
            ["--k", str(self.k), "--m", str(self.m), "--chunk-bytes", "65536", "--keep", "8"],
            peer_timeout=PEER_TIMEOUT,
            env=env,
            ready=ready,
        )
        return self.job

    def connect(self) -> None:
        assert self.job is not None
        self.close()
        self.stores = self.job.stores(HOSTS, timeout=CLIENT_TIMEOUT)

    def close(self) -> None:
        close_all(self.stores)

    def put(self, step: int) -> list[BaseException | None]:
        """Every rank puts ``step`` (each from its own thread: a stopped daemon holds its rank's
        call); returns each rank's outcome, None for protected. No call may hang."""
        limit = 2 * PEER_TIMEOUT + CLIENT_TIMEOUT + 10

        def one(r: int) -> BaseException | None:
            try:
                self.stores[r].put(step, make_state(r, step, nbytes=2 << 20)).wait(limit)
                return None
            except Exception as exc:
                return exc

        t0 = time.monotonic()
        with ThreadPoolExecutor(HOSTS) as pool:
            out = list(pool.map(one, range(HOSTS)))
        if time.monotonic() - t0 > limit + 5:
            self.problems.append(f"a put of step {step} took {time.monotonic() - t0:.0f}s")
        if all(o is None for o in out):
            self.protected.add(step)
        return out

    def verify(self) -> int:
        """Relaunch if needed, then read every protected step from every rank, bit-exact."""
        checked = 0
        for step in sorted(self.protected):
            for r in range(HOSTS):
                try:
                    got = self.stores[0].get(step, rank=r)
                except Exception as exc:
                    self.problems.append(f"protected step {step} rank {r}: {exc!r}")
                    continue
                if not same(got, make_state(r, step, nbytes=2 << 20)):
                    self.problems.append(f"step {step} rank {r}: WRONG BYTES")
                checked += 1
        return checked

    def went_down(self, cut: int) -> None:
        """The daemons that lost ``cut`` end the job by themselves; then it is killed."""
        assert self.job is not None
        for i in range(HOSTS):
            if i != cut and not self.job.gone(i, PEER_TIMEOUT * 3):
                self.problems.append(f"{self.lab.hosts[i]}'s daemon did not go down")
        self.close()
        self.job.kill()

    def failed_naming(self, outcomes: list[BaseException | None], cut: int) -> bool:
        import storage

        host = self.lab.hosts[cut]
        for r, exc in enumerate(outcomes):
            if exc is None:
                self.problems.append(f"rank {r}'s put succeeded with {host} cut off")
            elif not isinstance(exc, storage.StorageError):
                self.problems.append(f"rank {r}'s put failed with {exc!r}, not a StorageError")
            elif r != cut and not (
                isinstance(exc, storage.PeerUnreachableError) and exc.hosts == [host]
            ):
                self.problems.append(f"rank {r}'s error does not name {host}: {exc!r}")
        return not self.problems

    def run(self) -> dict[str, Any]:
        lab, rng = self.lab, self.rng
        h = rng.randrange(HOSTS)
        self.start()
        self.connect()
        for step in (1, 2):
            if any(self.put(step)):
                self.problems.append(f"put of step {step} failed with no fault")
        if self.fault == "link-down@put":
            assert self.job is not None
            lab.link(h, "down")
            try:
                out = self.put(3)
                if self.failed_naming(out, h):
                    self.fired += 1
                text = _status(self.job, (h + 1) % HOSTS)
                if f"UNREACHABLE: {lab.hosts[h]}" not in text:
                    self.problems.append(f"ecsnap status does not name {lab.hosts[h]}: {text}")
                self.went_down(h)
            finally:
                lab.link(h, "up")
        elif self.fault == "slow-link@put":
            lab.rate(h, LINK_GBIT / 100)  # a new shaper: its counters start at 0
            try:
                if any(self.put(3)):
                    self.problems.append("a put over a slowed link failed")
                if _overlimits(lab, h) > 0:  # the slowed shaper held packets back
                    self.fired += 1
            finally:
                lab.rate(h, LINK_GBIT)
            if any(self.put(4)):  # the job carries on
                self.problems.append("a put after the link came back failed")
        elif self.fault == "sigstop":
            assert self.job is not None
            pid = self.job.daemon_pid(h)
            long = rng.random() < 0.5
            pause = (
                rng.uniform(PEER_TIMEOUT + 4, PEER_TIMEOUT + 8)
                if long
                else rng.uniform(0.5, PEER_TIMEOUT / 2)
            )
            os.kill(pid, signal.SIGSTOP)
            try:
                with ThreadPoolExecutor(1) as pool:
                    outcome = pool.submit(self.put, 3)
                    time.sleep(min(pause, 0.3))
                    self.fired += process_state(pid) == "T"
                    time.sleep(max(pause - 0.3, 0))
                    os.kill(pid, signal.SIGCONT)
                    out = outcome.result()
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            if long:
                if all(o is None for o in out):
                    self.problems.append("a put succeeded with a daemon stopped past the timeout")
                self.went_down(h)
            elif any(out):
                self.problems.append(f"a put failed with a daemon stopped {pause:.1f}s: {out}")
            elif any(self.put(4)):
                self.problems.append("a put after the daemon continued failed")
        elif self.fault == "link-down@rebuild":
            assert self.job is not None
            self.close()
            self.job.kill()
            for p in lab.shm(h).iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            # a helper's link goes down while another helper's first bulk send of the rebuild
            # is held (whose line reaches the log: the cut-off host's output cannot)
            helper, sender = rng.sample([i for i in range(HOSTS) if i != h], 2)
            spec = f"delay@send:host={lab.hosts[sender]}:nth=1:seconds=3"
            job = self.start(env={"ECSNAP_FAULTS": spec}, ready=False)
            if not job.logged("adoption: rebuilding step", 60):
                self.problems.append("the relaunch did not start rebuilding")
            if not job.logged("injected fault", 30):
                self.problems.append("the rebuild's send was not held")
            lab.link(helper, "down")
            try:
                down = all(job.gone(i, PEER_TIMEOUT * 4) for i in range(HOSTS) if i != helper)
                if not down:
                    self.problems.append("the daemons did not go down with a helper cut off")
                if "injected fault" in job.log.read_text()[job.mark :] and down:
                    self.fired += 1
                if job.log.read_text()[job.mark :].count("ready:") == HOSTS:
                    self.problems.append("the rebuild finished before the link went down")
                job.kill()
            finally:
                lab.link(helper, "up")
        # the job either carried on, or it is relaunched now, and serves everything protected
        assert self.job is not None
        if self.job.proc.poll() is not None or not self.stores:
            self.job.kill()
            self.start()
            self.connect()
        checked = self.verify()
        self.close()
        self.job.stop()
        self.job.kill()
        for i in range(HOSTS):
            shutil.rmtree(self.job.root(i) / self.name, ignore_errors=True)
        if not self.fired:
            self.problems.append(f"the fault {self.fault} did not fire: the trial tested nothing")
        return {
            "fault": self.fault,
            "k": self.k,
            "m": self.m,
            "protected": len(self.protected),
            "attempted": len(self.protected) + 1,
            "fired": self.fired,
            "checked": checked,
            "problems": self.problems,
        }


def trial(lab: Lab, fault: str, rng: random.Random) -> dict[str, Any]:
    t = Trial(lab, fault, rng)
    try:
        return t.run()
    except Exception as exc:  # a trial that breaks is a finding, not the end of the matrix
        t.problems.append(f"the trial raised {exc!r}")
        return {
            "fault": fault,
            "k": t.k,
            "m": t.m,
            "protected": len(t.protected),
            "attempted": len(t.protected),
            "fired": t.fired,
            "problems": t.problems,
        }
    finally:
        t.close()
        if t.job is not None:
            t.job.kill()
