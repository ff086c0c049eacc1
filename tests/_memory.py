"""What this process maps, read from ``/proc/self/smaps``."""

from __future__ import annotations

from pathlib import Path


def mapped_kib(under: Path, field: str) -> int:
    """The sum of smaps ``field`` (``Rss``, ``ShmemPmdMapped``: bytes in 2 MiB page-table
    entries) over this process's mappings of files under ``under``, in KiB."""
    total, inside = 0, False
    prefix = str(under).rstrip("/") + "/"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            inside = len(head) >= 6 and " ".join(head[5:]).startswith(prefix)
        elif inside and head and head[0] == f"{field}:":
            total += int(head[1])
    return total
