"""When MPICH moves bytes between the processes of one machine in two copies: the reasons the
daemons warn of (``transport.mpi.single_copy_off``)."""

from __future__ import annotations

from pathlib import Path

from transport.mpi import single_copy_off

MPICH = "MPICH Version:      5.0.2\nMPICH Release date: unreleased development copy"


def _yama(tmp_path: Path, name: str, scope: str | None) -> Path:
    """A stand-in for /proc/sys/kernel/yama/ptrace_scope holding ``scope`` (None: no file)."""
    path = tmp_path / name
    if scope is not None:
        path.write_text(scope + "\n")
    return path


def test_the_reasons_mpich_turns_its_single_copy_path_off(tmp_path: Path) -> None:
    none, zero, one = (_yama(tmp_path, n, s) for n, s in (("a", None), ("b", "0"), ("c", "1")))
    # no Yama, or Yama allowing any same-user ptrace: nothing says it is off
    assert single_copy_off(MPICH, {}, none) is None
    assert single_copy_off(MPICH, {}, zero) is None
    # Ubuntu's default: MPICH turns CMA off
    off = single_copy_off(MPICH, {}, one)
    assert off is not None and off[0] == "kernel.yama.ptrace_scope is 1"
    assert "sysctl kernel.yama.ptrace_scope=0" in off[1]
    # the user turned it off, by any of MPICH's spellings of the variable
    for name in ("MPIR_CVAR_CH4_CMA_ENABLE", "MPICH_CH4_CMA_ENABLE"):
        for value in ("0", "no", "False"):
            assert single_copy_off(MPICH, {name: value}, zero) == (
                f"{name}={value} is set",
                f"unset {name} to use it",
            )
    # turned on by the user, yet Yama forbids it: still off
    assert single_copy_off(MPICH, {"MPIR_CVAR_CH4_CMA_ENABLE": "1"}, one) is not None
    assert single_copy_off(MPICH, {"MPIR_CVAR_CH4_CMA_ENABLE": "1"}, zero) is None
    # another MPI library: none of MPICH's rules apply
    assert single_copy_off("Open MPI v5.0.3", {"MPIR_CVAR_CH4_CMA_ENABLE": "0"}, one) is None
