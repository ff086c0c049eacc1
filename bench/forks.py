"""``python -m MODULE ARGS`` in a process of its own, forked from a server that imported torch
once.

A trainer process of the tests (``tests.mpi._trainer``, one per rank) spends about 2 s of CPU
importing torch before it does anything (a Lightning run 5.5 s); a run of the suite starts
hundreds of them on two cores. Here each is forked from multiprocessing's fork server, which
imported torch, numpy, ``storage`` and Lightning (:data:`PRELOAD`, those installed) before its
first fork: the child is still a process of its own (its own pid, memory, descriptors and exit
status, killable alone), it runs the module as ``__main__`` with the given arguments,
environment and working directory, under Python's default warning filters (not the test run's
``-W error``: a plain ``python -m`` has none), its output in files read back at the end, and
its ``atexit`` handlers run as an interpreter's would at exit.

    run = start("tests.mpi._trainer", [json.dumps(spec)])
    code = run.wait(120)            # the exit status: negative for a signal, as Popen says
    out, err = run.output()
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

__all__ = ["Forked", "run", "start"]

REPO = Path(__file__).resolve().parent.parent
# lightning takes 3.5 s more of CPU to import than torch: once here, not in each Lightning run
PRELOAD = ["torch", "numpy", "storage", "bench.harness", "lightning"]
_context: ForkServerContext | None = None


def _server() -> ForkServerContext:
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _main(module: str, argv: list[str], out: str, err: str, env: dict[str, str], cwd: str) -> None:
    """The child: what ``python -m module *argv`` does, from the forked server's imports."""
    import atexit
    import runpy
    import sys
    import warnings

    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # a plain interpreter's filters (release build), not the ones the test run passes down
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


class Forked:
    """One ``python -m`` run, forked: :meth:`wait`, :meth:`kill`, :meth:`output`."""

    def __init__(
        self, module: str, argv: Sequence[str], env: Mapping[str, str] | None, cwd: Path
    ) -> None:
        self.module = module
        self._dir = Path(tempfile.mkdtemp(prefix="ecsnap-fork-"))
        self._out, self._err = self._dir / "stdout", self._dir / "stderr"
        self._code: int | None = None
        self._texts: tuple[str, str] | None = None
        self.proc: Any = _server().Process(
            target=_main,
            args=(
                module,
                list(argv),
                str(self._out),
                str(self._err),
                dict(os.environ if env is None else env),
                str(cwd),
            ),
        )
        self.proc.start()
        pid = self.proc.pid
        assert pid is not None  # started
        self.pid: int = pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: the signal that ended it), None while it runs."""
        return self.wait(0)

    def poll(self) -> int | None:
        return self.wait(0)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status once the child ended, or None if it still runs after ``timeout``."""
        if self._code is None:
            self.proc.join(timeout)
            code = self.proc.exitcode
            if code is not None:
                self._code = int(code)
                self.proc.close()
        return self._code

    def kill(self) -> None:
        if self.wait(0) is None:
            self.proc.kill()
            self.wait(30)

    def output(self) -> tuple[str, str]:
        """What the child wrote to stdout and stderr (read once: its files are then removed)."""
        if self._texts is None:
            texts = []
            for path in (self._out, self._err):
                try:
                    texts.append(path.read_text(errors="replace"))
                except OSError:
                    texts.append("")
            shutil.rmtree(self._dir, ignore_errors=True)
            self._texts = (texts[0], texts[1])
        return self._texts


def start(
    module: str,
    argv: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Forked:
    """Fork ``python -m module *argv`` from the preloaded server (``env``: this process's
    environment now unless given; ``cwd``: the repository)."""
    return Forked(module, argv, env, cwd or REPO)


def run(module: str, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``start``, then wait as ``subprocess.run(..., capture_output=True, text=True)`` would: the
    exit status and output; a run still going after ``timeout`` is killed and raises
    ``subprocess.TimeoutExpired`` with what it wrote."""
    child = start(module, argv)
    code = child.wait(timeout)
    child.kill()
    out, err = child.output()
    if code is None:
        raise subprocess.TimeoutExpired([module, *argv], timeout, out, err)
    return subprocess.CompletedProcess([module, *argv], code, out, err)
