from __future__ import annotations

import shutil
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
