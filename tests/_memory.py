"""What this process maps, read from ``/proc/self/smaps``."""

from __future__ import annotations

from pathlib import Path


def mapped_kib(where: Path, field: str) -> int:
    """The sum of smaps ``field`` (``Rss``: bytes with page-table entries; ``ShmemPmdMapped``:
    in 2 MiB ones) over this process's mappings of the file ``where`` or of files under the
    directory ``where``, in KiB."""
    total, inside = 0, False
    exact, prefix = str(where).rstrip("/"), str(where).rstrip("/") + "/"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            name = " ".join(head[5:])
            inside = name == exact or name.startswith(prefix)
        elif inside and head and head[0] == f"{field}:":
            total += int(head[1])
    return total
