"""Where a benchmark runs: /dev/shm by default, or ``--root`` (a tmpfs with huge pages)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench._common import run_dir
from transport import shm


def test_a_run_goes_under_its_root_and_says_what_memory_that_is(huge_root: Path) -> None:
    made, huge = run_dir(huge_root, "ecsnap-test")
    assert made.parent == huge_root and made.name.startswith("ecsnap-test-")
    assert huge == "within_size"
    assert made.stat().st_mode & 0o777 == 0o700
    made.rmdir()
    default, huge = run_dir(None, "ecsnap-test")
    try:
        assert default.parent == Path("/dev/shm")
        assert huge == shm.huge_pages("/dev/shm")
    finally:
        shutil.rmtree(default)


def test_a_root_that_is_not_there_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--root .*gone: no such directory"):
        run_dir(tmp_path / "gone", "ecsnap-test")
