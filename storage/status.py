"""``ecsnap status --job JOB [--root DIR] [--json]``: the job at a glance.

Asks each host's daemon when it runs; when it does not, reads the host directory alone (health
file and manifests), so it works while the storage job is down. Every slot of the job's layout
is listed: where this machine holds every host's directory (virtual hosts), a slot whose
directory is gone as ``missing`` (a lost host, until a replacement takes the slot); on a cluster
the other slots are on their own machines. A daemon that gave up on a silent peer names it
(``UNREACHABLE``). Many steps are shown as a count, a range and the newest few; ``--json`` gives
everything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from storage import discovery, recovery
from storage.config import DEFAULT_ROOT, check_name
from storage.errors import ConfigError
from transport import control

__all__ = ["gather", "main", "render", "steps_text"]


ANSWER_TIMEOUT = 2.0  # seconds a daemon has to answer ``info`` before it counts as silent


def _from_daemon(host_dir: Path) -> dict[str, Any] | None:
    """The daemon's own ``info``; None if nobody listens; ``{"silent": reason}`` if somebody
    accepts but does not answer within :data:`ANSWER_TIMEOUT` (a stopped or wedged daemon)."""
    sock = host_dir / "ctl.sock"
    if not sock.exists():
        return None
    try:
        conn = control.connect(sock, timeout=ANSWER_TIMEOUT)
    except OSError:
        return None
    try:
        reply = conn.request({"op": "info"})
    except TimeoutError:
        return {"silent": f"accepted but did not answer within {ANSWER_TIMEOUT:.0f} s"}
    except OSError as exc:
        return {"silent": f"closed the connection ({exc})"}
    finally:
        conn.close()
    if not reply:
        return {"silent": "closed the connection without answering"}
    if not reply.get("ok"):
        return None
    reply.pop("ok", None)
    reply["running"] = True
    reply["daemon"] = "up"
    return reply


def _host(host_dir: Path) -> dict[str, Any]:
    """One host directory's record: from its daemon when it answers, else from its files, with
    ``daemon`` "up", "not answering" (its process alive, its socket silent) or "gone"."""
    answer = _from_daemon(host_dir)
    if answer is not None and answer.get("running"):
        return answer
    out = _from_files(host_dir)
    alive = discovery.alive(out.pop("_health", {}))
    out["daemon"] = "not answering" if alive or answer is not None else "gone"
    if out["daemon"] == "not answering":
        why = (answer or {}).get("silent") or "its socket does not answer"
        if out.get("reason"):
            why += f"; health.json: {out['reason']}"
        out["silent"] = why
    return out


def _from_files(host_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"host": host_dir.name, "running": False}
    try:
        health = json.loads((host_dir / "health.json").read_text())
        if not isinstance(health, dict):
            health = {}
    except (OSError, ValueError):
        health = {}
    out["_health"] = health
    out["health"] = health.get("health", "unknown")
    out["reason"] = health.get("reason")
    out["slot"] = health.get("slot")
    valid, bad = recovery.scan(host_dir)
    out["protected"] = sorted(valid)
    out["bad_manifests"] = bad
    out["lost"] = {str(s): {} for s in health.get("lost_steps", [])}
    out["unreachable"] = health.get("unreachable", [])
    sizes = {}
    for sub in ("data", "parity"):
        d = host_dir / sub
        sizes[sub] = sum(p.stat().st_size for p in d.iterdir()) if d.is_dir() else 0
    out["data_bytes"], out["parity_bytes"] = sizes["data"], sizes["parity"]
    out["pool_bytes"] = sizes["data"] + sizes["parity"]
    if valid:
        m = valid[max(valid)]
        out["hosts"] = m["hosts"]
        g = m["groups"][m["group"]]
        out["k"], out["m"] = g["k"], g["m"]
    elif isinstance(health.get("hosts"), list):
        out["hosts"] = health["hosts"]
    return out


def gather(job: str, root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One record per slot of ``job``'s layout (from its daemon if running, else its files; a
    slot with no host directory is ``{"host", "slot", "missing": True}``), then any host
    directory the layout does not name."""
    job_dir = Path(root) / check_name("job", job)
    if not job_dir.is_dir():
        jobs = sorted(p.name for p in Path(root).iterdir()) if Path(root).is_dir() else []
        there = f"; jobs there: {', '.join(jobs)}" if jobs else ""
        raise ConfigError(f"no job {job!r} under {root} (no directory {job_dir}){there}")
    dirs = [p for p in sorted(job_dir.iterdir()) if p.is_dir()]
    with ThreadPoolExecutor(min(16, max(1, len(dirs)))) as ask:  # a silent daemon costs 2 s
        records = list(ask.map(_host, dirs))
    found: dict[str, dict[str, Any]] = {p.name: r for p, r in zip(dirs, records, strict=True)}
    layout: list[str] = []
    for rec in sorted(found.values(), key=lambda r: not r.get("running")):
        if rec.get("hosts"):
            layout = list(rec["hosts"])
            break
    # With virtual hosts this machine holds every host's directory, and one gone is a lost host.
    # On a cluster it holds its own: the other slots are on their machines, not missing.
    here_all = len(found) > 1
    out = []
    for slot, name in enumerate(layout):
        absent = {"host": name, "slot": slot, "running": False}
        absent["missing" if here_all else "elsewhere"] = True
        out.append(found.pop(name, absent))
    out += found.values()  # not in the layout (a host of no slot yet)
    return out


def steps_text(steps: list[int], newest: int = 3) -> str:
    """A list of steps for one cell: all of a few, else the count, the range and the newest."""
    if not steps:
        return "none"
    if len(steps) <= newest + 1:
        return ", ".join(map(str, steps))
    tail = ", ".join(map(str, steps[-newest:]))
    return f"{len(steps)} ({steps[0]}-{steps[-1]}; newest {tail})"


def _gb(n: Any) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _skew(hosts: list[dict[str, Any]]) -> list[str]:
    """The job's parity against its data, and the hosts that hold none of the data: parity
    costs m/k of the data only when every host of a group holds shards (a group whose data sits
    on few hosts pays a whole chunk of parity per stripe for each of them)."""
    up = [h for h in hosts if not h.get("missing") and not h.get("elsewhere")]
    data = sum(int(h.get("data_bytes") or 0) for h in up)
    parity = sum(int(h.get("parity_bytes") or 0) for h in up)
    km = next(((h["k"], h["m"]) for h in up if h.get("k") and h.get("m")), None)
    if not data or km is None:
        return []
    k, m = km
    out = [f"job: parity {parity / data:.2f}x the data (m/k = {m / k:.2f})"]
    empty = [h["host"] for h in up if not h.get("data_bytes")]
    if empty:
        out.append(
            f"hosts holding no data: {', '.join(empty)}: every rank should put its own shard "
            "(a save from rank 0 alone, or ranks on few hosts, leaves the others' parity to a "
            "few shards, at more than m/k); data-parallel replicas that all hold the same state "
            "can put one shard each"
        )
    return out


def render(job: str, hosts: list[dict[str, Any]]) -> str:
    header = [
        "slot",
        "host",
        "daemon",
        "health",
        "protected steps (memory)",
        "data GB",
        "parity GB",
        "shm GB / budget",
        "ahead GB",
        "degraded",
        "missing chunks",
        "checksum fails",
        "last error",
    ]
    rows = []
    notes = []
    for h in hosts:
        if h.get("elsewhere"):
            rows.append([str(h["slot"]), h["host"], "-", "on its machine", "-", *["-"] * 8])
            continue
        if h.get("missing"):
            rows.append([str(h["slot"]), h["host"], "-", "MISSING", "-", *["-"] * 8])
            notes.append(
                f"slot {h['slot']} ({h['host']}): no host directory; relaunch with a "
                "replacement host (it takes the free slot and is rebuilt from its group)"
            )
            continue
        stats = h.get("stats", {})
        budget = h.get("memory_budget")
        rows.append(
            [
                str(h.get("slot", "-")),
                h["host"],
                h.get("daemon", "up" if h["running"] else "gone"),
                str(h.get("health", "-")),
                steps_text(h.get("protected", [])),
                _gb(h.get("data_bytes")),
                _gb(h.get("parity_bytes")),
                f"{_gb(h.get('pool_bytes'))} / {_gb(budget) if budget else 'none'}",
                _gb(stats.get("pool_ahead_free_bytes")) if stats else "-",
                str(h.get("degraded_stripes", "-")),
                str(int(stats.get("missing_chunks", 0))) if stats else "-",
                str(int(stats.get("checksum_failures", 0))) if stats else "-",
                (h.get("last_error") or "")[:60],
            ]
        )
        if h.get("daemon") == "not answering":
            notes.append(
                f"{h['host']}: its daemon process runs but does not answer ({h.get('silent')}): "
                "stopped (SIGSTOP), wedged or failing; its log says why"
            )
        k, m = h.get("k"), h.get("m")
        data, parity = h.get("data_bytes") or 0, h.get("parity_bytes") or 0
        if k and m and data and parity / data > 1.05 * m / k:
            notes.append(
                f"{h['host']}: parity is {parity / data:.2f}x its data, more than m/k = "
                f"{m / k:.2f}: its shards are small against the chunk size (whole chunks of "
                "parity per stripe); a smaller --chunk-bytes brings it closer"
            )
    notes += _skew(hosts)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    missing = sum(1 for h in hosts if h.get("missing"))
    lines = [f"job {job}: {len(hosts)} slot(s)" + (f", {missing} MISSING" if missing else "")]
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    lost = sorted({s for h in hosts for s in h.get("lost", {})}, key=int)
    if lost:
        lines.append(
            f"lost steps (more than m chunks of a stripe gone): {steps_text(list(map(int, lost)))}"
        )
    latest = [int(h["latest"]) for h in hosts if h.get("latest") is not None]
    if latest:
        lines.append(f"newest protected step: {max(latest)}")
    for h in hosts:
        for f in h.get("in_flight") or []:
            if isinstance(f, dict):
                lines.append(
                    f"in flight on {h['host']}: step {f['step']} {f['state']} for "
                    f"{f['age_s']:.1f} s, waiting on {f['waiting_on']}"
                )
    disk = sorted({int(x) for h in hosts for x in h.get("persisted") or []})
    where = next((h["persist_dir"] for h in hosts if h.get("persist_dir")), None)
    if where:
        lines.append(f"persistent tier {where}: steps {steps_text(disk)}")
    silent: dict[str, list[str]] = {}
    for h in hosts:
        for other in h.get("unreachable") or []:
            silent.setdefault(other, []).append(h["host"])
    for other, seen in sorted(silent.items()):
        lines.append(
            f"UNREACHABLE: {other} did not answer {', '.join(seen)} within --peer-timeout "
            "(a link down, its daemon stopped); the storage job went down, relaunch it"
        )
    lines += notes
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ecsnap status",
        description=(
            "The job at a glance: every slot of its layout, its host, whether its daemon runs, "
            "health, protected steps, memory held, degraded stripes and the last error. Asks "
            "each running daemon; reads the host directories when the daemons are down."
        ),
    )
    p.add_argument(
        "--job", default=os.environ.get("ECSNAP_JOB"), help="the job (default: $ECSNAP_JOB)"
    )
    p.add_argument(
        "--root",
        default=os.environ.get("ECSNAP_ROOT", DEFAULT_ROOT),
        help=f"the daemons' --root (default: $ECSNAP_ROOT, else {DEFAULT_ROOT})",
    )
    p.add_argument("--json", action="store_true", help="everything, machine-readable")
    a = p.parse_args(argv)
    if not a.job:
        p.error("give the job's name: --job NAME, or set ECSNAP_JOB")
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
