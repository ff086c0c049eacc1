"""Daemon configuration: one frozen dataclass, validated once."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from storage.errors import ConfigError

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_ROOT",
    "NET_CHUNK_BYTES",
    "ServeConfig",
    "check_name",
    "host_dir",
]


def _user() -> str:
    """This user's name for the default root (the uid where the password database has none)."""
    try:
        import pwd

        name = pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())
    return name if _NAME.match(name) else str(os.getuid())


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# One root per user: a root shared by every user lets whoever makes it first own it (and pose
# as the daemon, or read the trainers' state). The daemon checks its owner and mode at start.
DEFAULT_ROOT = f"/dev/shm/ecsnap-{_user()}"


def check_name(kind: str, name: str) -> str:
    """A job or host name is a path component: letters, digits, ``_.-``, at most 64 characters."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"{kind} name {name!r} is not allowed: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


def host_dir(root: str | os.PathLike[str], job: str, host: str) -> Path:
    return Path(root) / check_name("job", job) / check_name("host", host)


# The largest chunk (--chunk-bytes). Per chunk the exchange has Python to run, messages to post
# and a parity CRC to take; 4 MiB chunks against 1 MiB, four alternated pairs of 8 puts (4 virtual
# hosts on 2 cores, RS(3,1), 1.5 GB): CPU s per protected GB 0.611-0.649 against 0.633-0.680
# (exchange 0.027-0.036 against 0.047-0.050; checksum 0.080-0.087 against 0.062-0.064: a 4 MiB
# chunk is read back from beyond L2). A blob under 32 chunks of it (128 MiB) is cut finer
# (placement.chunk_size), so small states keep their parity near m/k.
CHUNK_BYTES = 4 << 20
# ... between virtual hosts. Over a network the default is 2 MiB: 4 MiB chunks cost the least CPU
# there too, but made RS(2,2)'s puts a quarter slower; 2 MiB gave the fastest RS(3,1) puts and
# about the fastest of the others. bench store --lab (4 lab hosts, 2 Gbit/s links, 1.5 GB, one
# run each), put->protected and CPU s per protected GB with 4, 2 and 1 MiB chunks: RS(3,1)
# 2.08 s / 1.33, 1.81 / 1.52, 1.98 / 1.67; RS(2,2) 3.57 / 1.86, 2.86 / 2.24, 2.81 / 2.42; 2-way
# 2.26 / 1.16, 2.44 / 1.64, 2.52 / 1.61; 3-way 3.78 / 2.13, 3.55 / 2.28, 3.53 / 2.27 (RS(2,2) put
# / 3-way put 0.944, 0.807, 0.795).
NET_CHUNK_BYTES = 2 << 20


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    job: str
    root: Path = Path(DEFAULT_ROOT)
    k: int | None = None
    m: int | None = None
    shrink_last_group: bool = False  # with --k/--m: a last group of fewer than k+m hosts
    chunk_bytes: int = 0  # 0: CHUNK_BYTES between virtual hosts, NET_CHUNK_BYTES over a network
    keep: int = 2
    memory_budget: int | None = None
    reserve: int = 0  # shared memory pre-faulted at start, before any size is known (per host)
    virtual_hosts: tuple[str, ...] | None = None  # () means host0..host{H-1}
    metrics_port: int | None = None  # virtual host i serves on port + i; 0 picks a free port
    metrics_addr: str = "127.0.0.1"  # loopback unless --metrics-host says otherwise
    peer_timeout: float = 120.0
    window: int = 64  # stripes a repair window holds at most (see storage.repair)
    exchange_rows: int = 12 << 20  # data bytes of a half exchange window's rows (storage.exchange)
    repair: str = "chain"  # "chain": helpers add along a chain; "star": the rebuilder decodes
    encode_threads: int = 2
    persist_dir: Path | None = None  # the persistent tier: DIR/<job>/step-<step>/
    persist_every: int = 0  # persist the protected steps that are multiples of this
    persist_keep: int = 2  # published steps kept on disk

    @property
    def largest_chunk(self) -> int:
        """``--chunk-bytes``, else the transport's default. A relaunch that does not give it
        takes what the host's files were written with (:mod:`storage.adoption`)."""
        if self.chunk_bytes:
            return self.chunk_bytes
        return CHUNK_BYTES if self.virtual_hosts is not None else NET_CHUNK_BYTES

    def __post_init__(self) -> None:
        check_name("job", self.job)
        if (self.k is None) != (self.m is None):
            raise ConfigError("give both --k and --m, or neither for defaults from the host count")
        if self.chunk_bytes and not 4096 <= self.chunk_bytes <= (1 << 30):
            raise ConfigError(f"--chunk-bytes must be in 4 KiB..1 GiB, got {self.chunk_bytes}")
        if self.keep < 1:
            raise ConfigError(f"--keep must be >= 1 (the newest protected step), got {self.keep}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConfigError(f"--memory-budget must be positive, got {self.memory_budget}")
        if self.reserve < 0:
            raise ConfigError(f"--reserve must be >= 0 bytes, got {self.reserve}")
        if self.memory_budget is not None and self.reserve > self.memory_budget:
            raise ConfigError(
                f"--reserve {self.reserve} is more than --memory-budget {self.memory_budget}: "
                "reserve at most what the host may hold"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.repair not in ("chain", "star"):
            raise ConfigError(f"--repair must be chain or star, got {self.repair!r}")
        if not 0 < self.peer_timeout < math.inf:  # (NaN too)
            raise ConfigError(
                f"--peer-timeout must be a positive number of seconds, got {self.peer_timeout}"
            )
        if self.persist_dir is not None and self.persist_every < 1:
            raise ConfigError(
                "--persist-dir needs --persist-every N >= 1 (persist steps N, 2N, ...)"
            )
        if self.persist_dir is None and self.persist_every:
            raise ConfigError("--persist-every needs --persist-dir")
        if self.persist_keep < 1:
            raise ConfigError(f"--persist-keep must be >= 1, got {self.persist_keep}")
        for name in self.virtual_hosts or ():
            check_name("host", name)
        if self.virtual_hosts and len(set(self.virtual_hosts)) != len(self.virtual_hosts):
            raise ConfigError(f"--virtual-hosts names a host twice: {','.join(self.virtual_hosts)}")
