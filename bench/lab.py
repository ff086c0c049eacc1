"""``ecsnap lab``: hosts that are really apart, on one machine (root only).

A lab host is a network namespace with its own hostname (a UTS namespace) and its own
``/dev/shm`` (a mount namespace with a private tmpfs, sized when ``--memory`` says so, bound over
``/dev/shm``). The hosts meet on a bridge of their own, each through a veth pair, on a /24 the
lab picks for itself (``10.213.X.0/24`` not used by any interface here); nothing else is ever a
target. The storage job runs across them through the real ``mpiexec`` (hydra's ssh launcher with
a stand-in that runs the command inside the named host, MPI over TCP only: ``UCX_TLS=tcp,self``),
so every byte between daemons crosses a link, and host names come from the hostname.

    ecsnap lab up --hosts 4 --link-gbit 2          # prints the lab's name and its state file
    ecsnap lab serve --name L -- --job J --k 3 --m 1
    ecsnap lab exec --name L ecl1a2b-h1 -- python train.py
    ecsnap lab link --name L ecl1a2b-h1 down|up|rate 0.02
    ecsnap lab down --name L                        # or: ecsnap lab down --all (the janitor)

A host's ``/dev/shm`` is a directory here too (``Lab.shm(i)``): a trainer outside the namespaces
reaches its daemon through the Unix socket and shared-memory files there, which know nothing of
network namespaces; only the daemons' MPI traffic needs the links.

Every name the lab makes starts with ``ecl`` plus its id (namespaces, interfaces, the directory
``/dev/shm/ecsnap-lab-ID``, the state file): ``down`` removes what one lab made, processes first,
and :func:`janitor` every lab's, also what a killed test left behind.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from storage.discovery import process_stat

__all__ = ["Lab", "LabError", "LabJob", "janitor", "main"]

PREFIX = "ecl"
STATE_DIR = Path("/run/ecsnap-lab") if Path("/run").is_dir() else Path("/tmp/ecsnap-lab")
SHM_BASE = Path("/dev/shm")


class LabError(RuntimeError):
    """The lab cannot be made or used here (not root, a missing tool); says what to do."""


def _run(*cmd: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess[str]:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    out = subprocess.run(full, capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise LabError(f"{shlex.join(full)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _require_root() -> None:
    if os.geteuid() != 0:
        raise LabError(
            "the lab makes network namespaces, veth links and a bridge, which needs root: run "
            "the lab (and its tests) as root"
        )
    for tool in ("ip", "unshare", "tc", "mount"):
        if shutil.which(tool) is None:
            raise LabError(f"the lab needs {tool!r} (iproute2 / util-linux): install it")


def _free_subnet() -> ipaddress.IPv4Network:
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    for x in range(1, 255):
        net = ipaddress.IPv4Network(f"10.213.{x}.0/24")
        if f" 10.213.{x}." not in used:
            return net
    raise LabError("no free 10.213.X.0/24 subnet for the lab's bridge")


@dataclass
class Lab:
    """One lab: its hosts (namespace names), their addresses, links and directories."""

    id: str
    hosts: list[str]
    bridge: str
    subnet: str
    addrs: list[str]
    veths: list[str]  # the bridge side of each host's link
    root: str  # /dev/shm/ecsnap-lab-ID: a directory per host, bound over its /dev/shm
    link_gbit: float | None = None
    memory: int | None = None
    pids: list[int] = field(default_factory=list)  # processes started in the hosts
    # the process that made it, and that process's start time (a test run, a benchmark): the
    # lab is in use while it lives; 0 for one made by `ecsnap lab up` (in use while anything
    # runs in its hosts)
    owner: int = 0
    owner_start: int | None = None

    # -- making and unmaking ---------------------------------------------------------------------

    @classmethod
    def up(
        cls,
        hosts: int = 4,
        link_gbit: float | None = None,
        memory: int | None = None,
        owned: bool = True,
    ) -> Lab:
        """Make ``hosts`` hosts on a bridge; ``link_gbit`` shapes each link (tbf, both ways);
        ``memory`` sizes each host's /dev/shm (a tmpfs). ``owned``: the lab belongs to this
        process (the janitor of another run leaves it alone while this process lives); the
        command line's labs are not (they are in use while anything runs in them)."""
        _require_root()
        lab_id = secrets.token_hex(2)
        p = f"{PREFIX}{lab_id}"
        net = _free_subnet()
        addrs = [str(net.network_address + 10 + i) for i in range(hosts)]
        lab = cls(
            id=lab_id,
            hosts=[f"{p}-h{i}" for i in range(hosts)],
            bridge=f"{p}br",
            subnet=str(net),
            addrs=addrs,
            veths=[f"{p}v{i}" for i in range(hosts)],
            root=str(SHM_BASE / f"ecsnap-lab-{lab_id}"),
            link_gbit=link_gbit,
            memory=memory,
            owner=os.getpid() if owned else 0,
            owner_start=_start_time(os.getpid()) if owned else None,
        )
        lab.save()
        try:
            gw = str(net.network_address + 1)
            # nothing sent to a lab address ever leaves the machine, even once the bridge (and
            # its connected route) is gone: the subnet is unreachable but through the bridge
            _run("ip", "route", "add", "unreachable", str(net), "metric", "4000")
            _run("ip", "link", "add", lab.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{gw}/{net.prefixlen}", "dev", lab.bridge)
            _run("ip", "link", "set", lab.bridge, "up")
            for i, (ns, veth, addr) in enumerate(zip(lab.hosts, lab.veths, addrs, strict=True)):
                peer = f"{p}p{i}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
                _run("ip", "link", "set", peer, "netns", ns)
                _run("ip", "link", "set", peer, "name", "eth0", ns=ns)
                _run("ip", "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0", ns=ns)
                _run("ip", "link", "set", "eth0", "up", ns=ns)
                _run("ip", "link", "set", "lo", "up", ns=ns)
                _run("ip", "route", "add", "default", "via", gw, ns=ns)
                _run("ip", "link", "set", veth, "master", lab.bridge)
                _run("ip", "link", "set", veth, "up")
                shm = lab.shm(i)
                shm.mkdir(parents=True, mode=0o700)
                if memory:
                    _run("mount", "-t", "tmpfs", "-o", f"size={memory},mode=700", "tmpfs", str(shm))
                if link_gbit:
                    lab.rate(i, link_gbit)
        except BaseException:
            lab.down()
            raise
        return lab

    @staticmethod
    def load(lab_id: str) -> Lab:
        path = STATE_DIR / f"{PREFIX}{lab_id}.json"
        try:
            return Lab(**json.loads(path.read_text()))
        except OSError as exc:
            raise LabError(f"no lab {lab_id!r} here ({path}): `ecsnap lab up` makes one") from exc

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{PREFIX}{self.id}.json").write_text(json.dumps(asdict(self)))

    def down(self) -> None:
        """Remove everything this lab made: processes in its hosts, mounts, namespaces, links,
        directories, its state file. Safe to call twice, and on a half-made lab."""
        for ns in self.hosts:
            for pid in _ns_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in self.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
        # every mount under the lab's directory: the hosts' /dev/shm, and what tools that run
        # in the lab mounted there (the Slurm tests' cgroup tmpfs)
        prefixes = (self.root.rstrip("/") + "/", f"{self.workdir}/")
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for where in sorted((m for m in mounts if m.startswith(prefixes)), reverse=True):
            _run("umount", "-l", where, check=False)
        for i in range(len(self.hosts)):
            _run("umount", "-l", str(self.shm(i)), check=False)
        for veth in self.veths:
            _run("ip", "link", "del", veth, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        for ns in self.hosts:
            _run("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)  # files ip netns binds
        _run("ip", "route", "del", "unreachable", self.subnet, "metric", "4000", check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
        (STATE_DIR / f"{PREFIX}{self.id}.json").unlink(missing_ok=True)

    def in_use(self) -> bool:
        """Whether another run still uses this lab: its owner lives (a test run, a benchmark:
        what runs in its hosts is that run's), or, for a lab without one (`ecsnap lab up`),
        some process runs in its hosts. The janitor leaves a lab in use alone."""
        if self.owner == os.getpid():
            return False  # this run's own
        if self.owner:
            return _start_time(self.owner) == self.owner_start is not None
        return any(_ns_pids(ns) for ns in self.hosts) or any(_alive(p) for p in self.pids)

    # -- using it ----------------------------------------------------------------------------------

    @property
    def workdir(self) -> Path:
        """A directory for what tools run with the lab keep (the Slurm tests' configuration,
        logs and spool): seen alike from every host (not under /dev/shm, which each host has
        of its own), removed with the lab."""
        return STATE_DIR / f"{PREFIX}{self.id}"

    def shm(self, i: int) -> Path:
        """Host i's /dev/shm, as a directory here."""
        return Path(self.root) / self.hosts[i]

    def host_command(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` run inside host i: its network, its hostname, its /dev/shm."""
        inner = (
            f"hostname {shlex.quote(self.hosts[i])} && "
            f'mount --bind {shlex.quote(str(self.shm(i)))} /dev/shm && exec "$@"'
        )
        return [
            "ip", "netns", "exec", self.hosts[i],
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", inner, "sh", *cmd,
        ]  # fmt: skip

    def exec(self, i: int, cmd: list[str], **popen: Any) -> subprocess.Popen[str]:
        proc: subprocess.Popen[str] = subprocess.Popen(
            self.host_command(i, cmd), text=True, start_new_session=True, **popen
        )
        self.pids.append(proc.pid)
        self.save()
        return proc

    def standin(self) -> Path:
        """The ssh stand-in hydra launches proxies with: drops ssh options, takes the host, runs
        the rest of the command inside that host, joined into one shell line as ssh does (hydra
        quotes its words for that remote shell)."""
        path = Path(self.root) / "ssh-standin"
        if not path.exists():
            hosts = {h: i for i, h in enumerate(self.hosts)}
            path.write_text(
                "#!" + sys.executable + "\n"
                "import os, sys\n"
                f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
                "from bench.lab import Lab\n"
                f"lab, hosts = Lab.load({self.id!r}), {hosts!r}\n"
                "args = sys.argv[1:]\n"
                "while args and args[0].startswith('-'):\n"
                "    args = args[1:]\n"
                "host, cmd = args[0], args[1:]\n"
                "cmd = ['sh', '-c', ' '.join(cmd)]  # as ssh does: one line for the remote shell\n"
                "full = lab.host_command(hosts[host], cmd)\n"
                "os.execvp(full[0], full)\n"
            )
            path.chmod(0o700)
        return path

    def serve_command(
        self,
        job: str,
        extra: Sequence[str] = (),
        python: str | None = None,
        env: dict[str, str] | None = None,
    ) -> list[str]:
        """``mpiexec`` across the lab's hosts, one ``ecsnap serve`` each (host names from their
        hostnames), MPI over TCP only."""
        from storage.launch import mpiexec

        py = python or sys.executable
        return [
            mpiexec(),
            "-launcher", "ssh",
            "-launcher-exec", str(self.standin()),
            "-hosts", ",".join(self.hosts),
            "-iface", self.bridge,
            "-genv", "UCX_TLS", "tcp,self",
            "-genv", "PYTHONPATH", str(Path(__file__).resolve().parent.parent),
            *(x for k, v in (env or {}).items() for x in ("-genv", k, v)),
            "-n", str(len(self.hosts)),
            "-ppn", "1",
            py, "-m", "storage.cli", "serve", "--job", job, "--root", "/dev/shm/ecsnap",
            *extra,
        ]  # fmt: skip

    def link(self, i: int, state: str) -> None:
        """Host i's link ``down`` or ``up`` (``up`` returns once the host reaches the bridge)."""
        _run("ip", "link", "set", self.veths[i], state)
        if state == "up":
            self.wait_reachable(i)

    def wait_reachable(self, i: int, timeout: float = 20.0) -> None:
        """Until host i reaches the bridge's address: a connection to a closed port there is
        refused (the route works), not unreachable."""
        gw = str(ipaddress.IPv4Network(self.subnet).network_address + 1)
        probe = (
            "import socket,sys\n"
            "s=socket.socket(); s.settimeout(1)\n"
            f"try: s.connect(('{gw}', 9))\n"
            "except ConnectionRefusedError: sys.exit(0)\n"
            "except OSError: sys.exit(1)\n"
        )
        deadline = time.monotonic() + timeout
        while _run("ip", "netns", "exec", self.hosts[i], sys.executable, "-c", probe,
                   check=False).returncode:  # fmt: skip
            if time.monotonic() > deadline:
                raise LabError(f"{self.hosts[i]} cannot reach the bridge {timeout:.0f}s after up")
            time.sleep(0.2)

    def rate(self, i: int, gbit: float) -> None:
        """Shape host i's link to ``gbit`` Gbit/s both ways (tbf; netem is not available)."""
        burst = max(int(gbit * 1e9 / 8 / 250), 16 << 10)  # about 4 ms of the rate
        rate = f"{int(gbit * 1e6)}kbit"
        for dev, ns in ((self.veths[i], None), ("eth0", self.hosts[i])):
            _run("tc", "qdisc", "del", "dev", dev, "root", check=False, ns=ns)
            _run(
                "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                "burst", str(burst), "latency", "50ms", ns=ns,
            )  # fmt: skip

    def link_bytes(self) -> list[dict[str, int]]:
        """Bytes each host's link carried, as the veth counts them (tx: into the host)."""
        out = []
        for veth in self.veths:
            base = Path("/sys/class/net") / veth / "statistics"
            out.append(
                {
                    "to_host": int((base / "tx_bytes").read_text()),
                    "from_host": int((base / "rx_bytes").read_text()),
                }
            )
        return out


class LabJob:
    """A storage job across a lab's hosts (the lab's :class:`bench.harness.Cluster`): started
    by the constructor, ready once every daemon logged ``ready:``; trainers connect from here
    through each host's /dev/shm (:meth:`stores`)."""

    def __init__(
        self,
        lab: Lab,
        job: str,
        extra: Sequence[str] = (),
        peer_timeout: float = 20.0,
        timeout: float = 120.0,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        ready: bool = True,
    ) -> None:
        self.lab, self.job = lab, job
        self.extra = [*extra, "--peer-timeout", str(peer_timeout)]
        self.log = log or Path(lab.root) / f"{job}.log"
        self.log.touch()
        mark = self.log.stat().st_size
        with self.log.open("a") as out:
            self.proc: subprocess.Popen[str] = subprocess.Popen(
                lab.serve_command(job, self.extra, env=env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
                cwd=str(Path(__file__).resolve().parent.parent),
            )
        lab.pids.append(self.proc.pid)
        lab.save()
        self.mark = mark
        deadline = time.monotonic() + timeout
        while ready:
            text = self.log.read_text()[mark:]
            if text.count("ready:") >= len(lab.hosts):
                return
            if self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"the daemons exited with {self.proc.returncode}:\n{text}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the daemons were not ready in {timeout:.0f}s:\n{text}")
            time.sleep(0.1)

    def root(self, i: int) -> Path:
        """The daemons' --root of host i, as seen from here."""
        return self.lab.shm(i) / "ecsnap"

    def stores(self, world: int, timeout: float = 60.0) -> list[Any]:
        """One Store per rank, rank r on host r % hosts, connected from this process."""
        import storage

        n = len(self.lab.hosts)
        return [
            storage.connect(
                self.job,
                rank=r,
                world_size=world,
                host=self.lab.hosts[r % n],
                root=self.root(r % n),
                timeout=timeout,
            )
            for r in range(world)
        ]

    def logged(self, text: str, timeout: float) -> bool:
        """Whether this launch's log shows ``text`` within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log.read_text()[self.mark :]:
                return True
            time.sleep(0.02)
        return False

    def gone(self, i: int, timeout: float) -> bool:
        """Whether host i's daemon is gone within ``timeout`` seconds (its hydra proxy may
        linger while mpiexec cannot reach another host's)."""
        deadline = time.monotonic() + timeout
        while any(_is_daemon(p) for p in _ns_pids(self.lab.hosts[i])):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def processes(self, i: int) -> list[str]:
        """What runs in host i (pid, state and command line), for a failure's message."""
        out = []
        for pid in _ns_pids(self.lab.hosts[i]):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            state = process_state(pid)
            if state is None:
                continue
            out.append(f"{pid} {state} {cmd[:200]}")
        return out

    def wait(self, timeout: float) -> int | None:
        """The job's exit status once it ends by itself within ``timeout``, else None."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 30.0) -> int:
        from bench.harness import terminate

        if not terminate(self.proc, timeout):
            self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        from bench.harness import kill_group

        kill_group(self.proc)
        for ns in self.lab.hosts:  # daemons left inside the hosts (mpiexec's proxies died)
            for pid in _ns_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def daemon_pid(self, i: int) -> int:
        """The pid of host i's daemon (from its health file)."""
        health = json.loads(
            (self.root(i) / self.job / self.lab.hosts[i] / "health.json").read_text()
        )
        return int(health["pid"])


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process ``pid`` (``T``: stopped), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def stop(pid: int, timeout: float = 5.0) -> bool:
    """SIGSTOP ``pid`` and wait until the kernel shows it stopped: ``kill`` returns while a
    thread of it may still be running (answering a request sent right after the signal).
    Whether it stopped within ``timeout``."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while process_state(pid) != "T":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _ns_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def _is_daemon(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in cmd and any(c.endswith((b"storage.cli", b"ecsnap")) for c in cmd)


def _start_time(pid: int) -> int | None:
    fields = process_stat(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def _alive(pid: int) -> bool:
    return _start_time(pid) is not None


def janitor() -> list[str]:
    """Remove the leftovers of labs no run uses any more (a failed or killed run's): by state
    file, then anything still named with the lab prefix that no lab in use owns. A lab in use
    (:meth:`Lab.in_use`) is never touched. Returns what it removed."""
    removed = []
    keep: set[str] = set()  # names of the labs in use: their namespaces, links, directories
    if STATE_DIR.is_dir():
        for path in STATE_DIR.glob(f"{PREFIX}*.json"):
            try:
                lab = Lab(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                path.unlink(missing_ok=True)
                continue
            if lab.in_use():
                keep.add(f"{PREFIX}{lab.id}")
                continue
            lab.down()
            removed.append(lab.id)

    def kept(name: str) -> bool:
        return any(name.startswith(k) for k in keep)

    for ns in _run("ip", "netns", "list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(PREFIX) and not kept(name):
            for pid in _ns_pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(": ")
        if len(parts) > 1:
            name = parts[1].split("@")[0]
            if name.startswith(PREFIX) and not kept(name):
                _run("ip", "link", "del", name, check=False)
                removed.append(name)
    for d in SHM_BASE.glob("ecsnap-lab-*"):
        if kept(f"{PREFIX}{d.name.removeprefix('ecsnap-lab-')}"):
            continue
        for sub in d.iterdir() if d.is_dir() else []:
            _run("umount", "-l", str(sub), check=False)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ecsnap lab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make a lab")
    up.add_argument("--hosts", type=int, default=4)
    up.add_argument("--link-gbit", type=float, default=None, help="shape every link (tbf)")
    up.add_argument("--memory", type=int, default=None, help="bytes of /dev/shm per host")
    for name in ("serve", "exec", "link", "down"):
        sp = sub.add_parser(name)
        sp.add_argument("--name", help="the lab's id (as `up` printed)")
        if name == "down":
            sp.add_argument("--all", action="store_true", help="every lab's leftovers")
        if name in ("exec", "link"):
            sp.add_argument("host")
        if name == "link":
            sp.add_argument("state", choices=["down", "up", "rate"])
            sp.add_argument("gbit", nargs="?", type=float)
        if name in ("serve", "exec"):
            sp.add_argument("rest", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    try:
        if a.cmd == "up":
            lab = Lab.up(a.hosts, a.link_gbit, a.memory, owned=False)
            print(f"lab {lab.id}: hosts {', '.join(lab.hosts)} on {lab.subnet}")
            return 0
        if a.cmd == "down" and a.all:
            print("removed:", ", ".join(janitor()) or "nothing")
            return 0
        if not a.name:
            p.error("give --name (the id `ecsnap lab up` printed)")
        lab = Lab.load(a.name)
        if a.cmd == "down":
            lab.down()
            return 0
        if a.cmd == "link":
            i = lab.hosts.index(a.host)
            if a.state == "rate":
                lab.rate(i, a.gbit)
            else:
                lab.link(i, a.state)
            return 0
        rest = [x for x in a.rest if x != "--"]
        if a.cmd == "serve":
            if "--job" not in rest[:-1]:
                p.error("ecsnap lab serve -- --job NAME [serve options]")
            at = rest.index("--job")
            job, extra = rest[at + 1], rest[:at] + rest[at + 2 :]
            return subprocess.call(lab.serve_command(job, extra))
        return subprocess.call(lab.host_command(lab.hosts.index(a.host), rest))
    except LabError as exc:
        print(f"ecsnap lab: {exc}", file=sys.stderr)
        return 2
