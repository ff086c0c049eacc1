"""A real Slurm cluster whose nodes are lab hosts (root only): Debian's ``slurmctld``, ``slurmd``
and ``munge``, one ``slurmd`` inside each host of an :class:`bench.lab.Lab`.

Everything it makes is its own: a ``munged`` on a socket in its directory with a key of its
own, a ``slurm.conf`` there (every command is pointed at it by ``SLURM_CONF``), ``slurmctld`` in
the root namespace on the lab's bridge address and a free port, and per host an ``/etc/netns/``
directory (``ip netns exec`` binds its files over ``/etc``: the node names in ``hosts``, and a
``resolv.conf`` with no server, so no lookup leaves the machine). ``down`` removes all of it.

What ``slurmd`` needs inside a lab host (found by trial, slurm-wlm 22.05): a cgroup plugin that
initialises, here cgroup/v1 on a small tmpfs of its own that every host sees (``ip netns exec``
mounts a fresh ``/sys``); ``proctrack/linuxproc`` and ``task/none``; spool, pid and log paths
per node (``%n``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.lab import Lab, LabError

__all__ = ["SlurmCluster", "missing_tools"]

TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scontrol", "sinfo", "munged")


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """``up()`` starts munge, the controller and one ``slurmd`` per lab host; ``down()`` stops
    them and removes their files. Commands: :meth:`run` (``sbatch``, ``squeue``, ...) with this
    cluster's ``SLURM_CONF``."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        # under the lab's directory: the lab's down (or the janitor's, after a killed run)
        # unmounts and removes it, and kills the daemons started here (the lab's pids)
        self.dir = lab.workdir / "slurm"
        self.gw = lab.addrs[0].rsplit(".", 1)[0] + ".1"
        self.nodes = list(lab.hosts)
        self.conf = self.dir / "slurm.conf"
        self.cgroup = self.dir / "cgroup"
        self.procs: list[subprocess.Popen[Any]] = []  # munged, slurmctld, the slurmds
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- making and unmaking ------------------------------------------------------------------

    def up(self, timeout: float = 60.0) -> SlurmCluster:
        missing = missing_tools()
        if missing:
            raise LabError(
                f"the Slurm tests need {missing}: apt-get install slurmctld slurmd slurm-client "
                "munge (.ci/run installs them)"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self._munge()
            self._config()
            self._netns_files()
            self._start(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
            for i, node in enumerate(self.nodes):
                log = open(self.dir / f"slurmd-{node}.out", "wb")  # noqa: SIM115 (the child's)
                slurmd = self.lab.exec(
                    i,
                    ["slurmd", "-D", "-N", node, "-f", str(self.conf)],
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                log.close()
                self.procs.append(slurmd)
            self._wait_idle(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _start(self, cmd: list[str], name: str) -> None:
        with open(self.dir / f"{name}.out", "wb") as log:
            proc = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        self.lab.pids.append(proc.pid)
        self.lab.save()

    def _munge(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.socket = self.dir / "munge.sock"
        self._start(
            [
                "munged", "-F", "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={self.dir / 'munged.pid'}",
                f"--log-file={self.dir / 'munged.log'}",
                f"--seed-file={self.dir / 'munged.seed'}",
            ],
            "munged",
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not self.socket.exists():
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise LabError(f"munged did not start: {(self.dir / 'munged.out').read_text()}")
            time.sleep(0.05)

    def _config(self) -> None:
        self.cgroup.mkdir(exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "ecsnap-slurm-cgroup", str(self.cgroup)],
            check=True,
        )
        port = _free_port(self.gw)
        spool = self.dir / "spool"
        state = self.dir / "state"
        for d in (spool, state, *(spool / n for n in self.nodes)):
            d.mkdir(exist_ok=True)
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs=2 State=UNKNOWN"
            for n, a in zip(self.nodes, self.lab.addrs, strict=True)
        )
        self.conf.write_text(
            f"""ClusterName=ecsnaplab{self.lab.id}
SlurmctldHost={socket.gethostname()}({self.gw})
MailProg=/bin/true
SlurmctldPort={port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={state}
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={self.dir}/slurmctld.pid
SlurmdPidFile={self.dir}/slurmd-%n.pid
SlurmctldLogFile={self.dir}/slurmctld.log
SlurmdLogFile={self.dir}/slurmd-%n.log
TmpFS={self.dir}/tmp
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
JobRequeue=1
{nodes}
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        )
        (self.dir / "tmp").mkdir(exist_ok=True)
        (self.dir / "cgroup.conf").write_text(
            f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={self.cgroup}\nCgroupAutomount=no\n"
        )

    def _netns_files(self) -> None:
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for n, a in zip(self.nodes, self.lab.addrs, strict=True)
        )
        for ns in self.nodes:
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(hosts)
            (d / "resolv.conf").write_text("# no name server: lab names are in hosts\n")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
            out = r.stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        raise LabError(f"the Slurm nodes did not come up idle: {out!r}\n{self.logs()}")

    def down(self) -> None:
        """Stop every daemon this cluster started (the lab's own ``down`` kills what runs in its
        hosts) and remove its files."""
        for p in reversed(self.procs):  # the slurmds, the controller, then munge
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(10)
        subprocess.run(["umount", "-l", str(self.cgroup)], capture_output=True)
        for ns in self.nodes:
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    # -- using it -----------------------------------------------------------------------------

    def run(
        self, *cmd: str, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            list(cmd), env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60
        )
        if check and out.returncode != 0:
            raise LabError(f"{' '.join(cmd)} failed: {out.stderr.strip()}\n{self.logs()}")
        return out

    def logs(self, tail: int = 2000) -> str:
        parts = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            try:
                parts.append(f"== {f.name}\n{f.read_text(errors='replace')[-tail:]}")
            except OSError:
                continue
        return "\n".join(parts)

    def job_state(self, job_id: str) -> str:
        r = self.run("scontrol", "show", "job", job_id, "-o", check=False)
        for word in r.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout: float) -> str:
        """Wait until the job ends; returns its final state (COMPLETED, FAILED, ...)."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
                return state
            time.sleep(0.5)
        raise LabError(f"job {job_id} still {state} after {timeout} s\n{self.logs()}")
