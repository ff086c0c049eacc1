"""The daemon's descriptor limit: the soft limit raised to the hard one at start, and a hard
limit below what the layout needs refused by name."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from storage import limits
from storage.errors import ConfigError

RAISE = (
    "import json, resource; from storage import limits; r = limits.raise_soft(); "
    "print(json.dumps([r.before, r.soft, r.hard, resource.getrlimit(resource.RLIMIT_NOFILE)[0]]))"
)


def _under(soft: int, hard: int, code: str) -> subprocess.CompletedProcess[str]:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run(
        [sys.executable, "-c", code], preexec_fn=cap, capture_output=True, text=True, timeout=60
    )


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 1024:
        pytest.skip(f"needs a finite hard limit of 1024 or more (here {hard})")
    out = _under(256, hard, RAISE)
    assert out.returncode == 0, out.stderr
    before, soft, reported_hard, now = json.loads(out.stdout)
    assert (before, soft, reported_hard, now) == (256, hard, hard, hard)
    text = limits.Raised(before, soft, reported_hard).text(8)
    assert f"raised from 256 to {hard}" in text and str(limits.needed(8)) in text


def test_a_hard_limit_below_the_need_is_refused_naming_ulimit() -> None:
    raised = limits.Raised(before=256, soft=256, hard=256)
    need = limits.needed(12)
    assert need == limits.BASE + 11 * limits.PER_PEER + limits.TRAINERS > 256
    with pytest.raises(ConfigError, match=rf"`ulimit -n {need}` or more") as err:
        limits.check(raised, 12, "node7")
    assert "node7" in str(err.value) and "hard limit 256" in str(err.value)
    limits.check(limits.Raised(before=256, soft=need, hard=need), 12, "node7")  # enough
    # the need grows with the peers, never with the steps kept
    assert limits.needed(1000) - limits.needed(500) == 500 * limits.PER_PEER
