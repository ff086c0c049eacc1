"""``ecsnap serve``'s options: sizes with units, and values that name what is wrong."""

from __future__ import annotations

import pytest

from storage.config import CHUNK_BYTES, NET_CHUNK_BYTES
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


def test_the_chunk_defaults_to_the_transports_and_an_explicit_one_stays() -> None:
    # over a network a smaller chunk: RS(2,2) puts with 4 MiB chunks were a quarter slower there;
    # 0 says none was given (a relaunch then takes what its files were written with)
    net, virtual = parse_args(["--job", "j"]), parse_args(["--job", "j", "--virtual-hosts"])
    assert (net.chunk_bytes, net.largest_chunk) == (0, NET_CHUNK_BYTES)
    assert (virtual.chunk_bytes, virtual.largest_chunk) == (0, CHUNK_BYTES)
    given = parse_args(["--job", "j", "--virtual-hosts", "--chunk-bytes", "1M"])
    assert (given.chunk_bytes, given.largest_chunk) == (1 << 20, 1 << 20)
    assert parse_args(["--job", "j", "--chunk-bytes", "8M"]).largest_chunk == 8 << 20
    with pytest.raises(ConfigError, match=r"--chunk-bytes must be in 4 KiB\.\.1 GiB"):
        parse_args(["--job", "j", "--chunk-bytes", "1K"])
