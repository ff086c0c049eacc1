"""``ecsnap bench NAME``: the benchmarks, one module each (reached through the ``ecsnap.commands``
entry point, so that :mod:`storage` never imports :mod:`bench`)."""

from __future__ import annotations

import importlib
import sys

__all__ = ["main"]

# benchmark name -> (module, function taking the remaining arguments)
BENCHMARKS = {
    "codec": ("bench.codec", "main"),
    "control": ("bench.control", "main"),
    "store": ("bench.store", "main"),
    "cold": ("bench.cold", "main"),
    "persist": ("bench.persist", "main"),
    "incremental": ("bench.incremental", "main"),
    "train": ("bench.train", "main"),
    "scale": ("bench.scale", "main"),
    "faults": ("bench.faults", "main"),
    "descriptors": ("bench.descriptors", "main"),
    "frameworks": ("bench.frameworks", "main"),
    "memory": ("bench.memory", "main"),
    "soak": ("bench.faults", "soak_main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = ",".join(BENCHMARKS)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: ecsnap bench {{{names}}} [options]  (ecsnap bench NAME --help for more)")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"ecsnap bench: unknown benchmark {name!r}; choose one of {names}", file=sys.stderr)
        return 2
    module, function = BENCHMARKS[name]
    from storage.launch import sweeping_hydra_files

    with sweeping_hydra_files():  # the jobs a benchmark SIGKILLed on purpose left them
        return int(getattr(importlib.import_module(module), function)(rest))
