"""The ``ecsnap`` command: ``serve`` and ``status`` here; every other command (``demo``,
``bench``) is an ``ecsnap.commands`` entry point of an installed package (``bench`` in this
repository's ``pyproject.toml``), so the service never imports what is built on it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

__all__ = ["main"]


def _builtin(name: str) -> Callable[[list[str]], int] | None:
    if name == "serve":
        from storage.serve import main as serve_main

        return serve_main
    if name == "status":
        from storage.status import main as status_main

        return status_main
    return None


def _plugins() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group="ecsnap.commands")}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = ["serve", "status", *sorted(_plugins())]
    usage = f"usage: ecsnap {{{','.join(names)}}} [options]  (ecsnap COMMAND --help for more)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    run = _builtin(command)
    if run is None:
        ep = _plugins().get(command)
        if ep is None:
            print(f"ecsnap: unknown command {command!r}\n{usage}", file=sys.stderr)
            return 2
        run = ep.load()
    return int(run(rest))


if __name__ == "__main__":
    sys.exit(main())
