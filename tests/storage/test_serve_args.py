"""``ecsnap serve``'s options: sizes with units, and values that name what is wrong."""

from __future__ import annotations

import pytest

from storage.errors import ConfigError
from storage.serve import parse_args


def test_sizes_take_bytes_or_binary_units() -> None:
    cfg = parse_args(["--job", "j", "--reserve", "1.5GiB", "--memory-budget", "2g"])
    assert cfg.reserve == int(1.5 * (1 << 30)) and cfg.memory_budget == 2 << 30
    assert parse_args(["--job", "j", "--reserve", "1500000000"]).reserve == 1_500_000_000


@pytest.mark.parametrize("size", ["1XB", "infG", "nanM", "", "G"])
def test_a_size_that_is_no_size_says_what_is_accepted(
    size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--job", "j", "--reserve", size])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --reserve: {size!r} is no size" in err and "512M, 1.5GiB" in err, err


@pytest.mark.parametrize("seconds", ["nan", "inf", "0", "-1"])
def test_the_peer_timeout_is_a_positive_number_of_seconds(seconds: str) -> None:
    with pytest.raises(ConfigError, match="--peer-timeout must be a positive number of seconds"):
        parse_args(["--job", "j", "--peer-timeout", seconds])
