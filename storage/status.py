"""``ecsnap status --job JOB [--root DIR] [--json]``: the job at a glance.

Asks each host's daemon when it runs; when it does not, reads the host directory alone (health
file and manifests), so it works while the storage job is down.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from storage import recovery
from storage.config import DEFAULT_ROOT, check_name
from storage.errors import ConfigError
from transport import control

__all__ = ["gather", "main"]


def _from_daemon(host_dir: Path) -> dict[str, Any] | None:
    sock = host_dir / "ctl.sock"
    if not sock.exists():
        return None
    try:
        conn = control.connect(sock, timeout=2.0)
    except OSError:
        return None
    try:
        reply = conn.request({"op": "info"})
    except OSError:
        return None
    finally:
        conn.close()
    if not reply or not reply.get("ok"):
        return None
    reply.pop("ok", None)
    reply["running"] = True
    return reply


def _from_files(host_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"host": host_dir.name, "running": False}
    try:
        health = json.loads((host_dir / "health.json").read_text())
    except (OSError, ValueError):
        health = {}
    out["health"] = health.get("health", "unknown")
    out["slot"] = health.get("slot")
    valid, bad = recovery.scan(host_dir)
    out["protected"] = sorted(valid)
    out["bad_manifests"] = bad
    out["lost"] = {str(s): {} for s in health.get("lost_steps", [])}
    data = parity = 0
    for sub, kind in (("data", "data"), ("parity", "parity")):
        d = host_dir / sub
        total = sum(p.stat().st_size for p in d.iterdir()) if d.is_dir() else 0
        if kind == "data":
            data = total
        else:
            parity = total
    out["pool_bytes"] = data + parity
    out["data_bytes"], out["parity_bytes"] = data, parity
    if valid:
        m = valid[max(valid)]
        out["hosts"] = m["hosts"]
    return out


def gather(job: str, root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One record per host directory of ``job``: from its daemon if running, else its files."""
    job_dir = Path(root) / check_name("job", job)
    if not job_dir.is_dir():
        raise ConfigError(f"no job {job!r} under {root} (no directory {job_dir})")
    hosts = []
    for host_dir in sorted(p for p in job_dir.iterdir() if p.is_dir()):
        hosts.append(_from_daemon(host_dir) or _from_files(host_dir))
    return hosts


def _gb(n: Any) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def render(job: str, hosts: list[dict[str, Any]]) -> str:
    header = [
        "host",
        "slot",
        "daemon",
        "health",
        "protected steps (memory)",
        "data GB",
        "parity GB",
        "shm GB / budget",
        "degraded",
        "checksum fails",
        "last error",
    ]
    rows = []
    for h in hosts:
        stats = h.get("stats", {})
        budget = h.get("memory_budget")
        rows.append(
            [
                h["host"],
                str(h.get("slot", "-")),
                "up" if h["running"] else "down",
                str(h.get("health", "-")),
                ",".join(map(str, h.get("protected", []))) or "none",
                _gb(h.get("data_bytes")),
                _gb(h.get("parity_bytes")),
                f"{_gb(h.get('pool_bytes'))} / {_gb(budget) if budget else 'none'}",
                str(h.get("degraded_stripes", "-")),
                str(int(stats.get("checksum_failures", 0))),
                (h.get("last_error") or "")[:60],
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"job {job}: {len(hosts)} host(s)"]
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    lost = sorted({s for h in hosts for s in h.get("lost", {})}, key=int)
    if lost:
        lines.append(f"lost steps (more than m chunks of a stripe gone): {', '.join(lost)}")
    latest = [int(h["latest"]) for h in hosts if h.get("latest") is not None]
    if latest:
        lines.append(f"newest protected step: {max(latest)}")
    disk = sorted({int(x) for h in hosts for x in h.get("persisted") or []})
    where = next((h["persist_dir"] for h in hosts if h.get("persist_dir")), None)
    if where:
        lines.append(f"persistent tier {where}: steps {', '.join(map(str, disk)) or 'none yet'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ecsnap status", description=__doc__)
    p.add_argument(
        "--job", default=os.environ.get("ECSNAP_JOB"), required="ECSNAP_JOB" not in os.environ
    )
    p.add_argument("--root", default=os.environ.get("ECSNAP_ROOT", DEFAULT_ROOT))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    try:
        hosts = gather(a.job, a.root)
    except ConfigError as exc:
        print(f"ecsnap status: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"job": a.job, "hosts": hosts}, indent=2, default=str))
    else:
        print(render(a.job, hosts))
    return 0
