from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A fresh root in real shared memory, removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"ecsnap-test-{uuid.uuid4().hex[:10]}"
    root.mkdir(mode=0o700)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def huge_root() -> Iterator[Path]:
    """A fresh tmpfs mounted with ``huge=within_size`` (2 MiB pages as far as each file's size
    allows), unmounted afterwards. Mounting needs root: without it the test fails, saying so."""
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs with huge pages needs root: run the tests as root")
    point = Path(tempfile.mkdtemp(prefix="ecsnap-test-huge-"))
    opts = "size=1g,mode=0700,huge=within_size"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        point.rmdir()
        pytest.fail(f"cannot mount a tmpfs with {opts}: {done.stderr.strip()}")
    try:
        yield point
    finally:
        # lazily: a mapping still open elsewhere keeps its pages, not the mount point
        subprocess.run(["umount", "-l", str(point)], check=True)
        point.rmdir()


def _mpich_segments() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("mpich_shm_*")} if shm.is_dir() else set()


@pytest.fixture(autouse=True, scope="session")
def no_leaked_mpi_segments() -> Iterator[None]:
    """MPICH's shared-memory segment files outlive ranks that were SIGKILLed before they unlinked
    them (the tests kill daemons on purpose). Remove those this session left and nobody maps; the
    same for the topology files of Hydra proxies SIGKILLed with their jobs."""
    from bench.faults import _mapped_shm, mpich_pid
    from storage.launch import sweeping_hydra_files

    before = _mpich_segments()
    with sweeping_hydra_files():
        yield
    # a segment of a live process is left alone, mapped yet or not (the tests may run in
    # several processes side by side: pytest -n)
    left = _mpich_segments() - before - _mapped_shm()
    for name in left:
        pid = mpich_pid(name)
        if pid is not None and Path(f"/proc/{pid}").exists():
            continue
        (Path("/dev/shm") / name).unlink(missing_ok=True)


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    """Debian's prometheus and promtool, fetched by tests/tools/fetch-prometheus.sh if missing."""
    repo = Path(__file__).resolve().parents[1]
    bin_dir = repo / ".cache" / "prometheus" / "usr" / "bin"
    if not (bin_dir / "prometheus").exists():
        out = subprocess.run(
            [str(repo / "tests" / "tools" / "fetch-prometheus.sh")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, (
            "the Prometheus server is not here and could not be fetched (apt-get download "
            f"prometheus): {out.stderr}; run tests/tools/fetch-prometheus.sh where Debian's "
            "package archive is reachable"
        )
    return bin_dir
