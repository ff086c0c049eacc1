"""The alert rules in charts/: valid for Prometheus (``promtool check rules``), loaded by the
shipped config, and firing on the series they are for (``promtool test rules`` over
tests/charts/alerts_test.yml), with Debian's promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PROMTOOL = REPO / ".cache" / "prometheus" / "usr" / "bin" / "promtool"


def _promtool(*args: str) -> str:
    if not PROMTOOL.exists():
        out = subprocess.run(
            [str(REPO / "tests" / "tools" / "fetch-prometheus.sh")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, (
            "promtool is not here and could not be fetched (apt-get download prometheus): "
            f"{out.stderr}; run tests/tools/fetch-prometheus.sh where Debian's archive is reachable"
        )
    done = subprocess.run(
        [str(PROMTOOL), *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_rules_are_valid_and_the_config_loads_them() -> None:
    assert "SUCCESS: 3 rules found" in _promtool("check", "rules", "charts/alerts.yml")
    config = yaml.safe_load((REPO / "charts" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]  # beside the config
    _promtool("check", "config", "--syntax-only", "charts/prometheus.yml")


def test_the_alerts_fire_on_what_they_are_for_and_only_then() -> None:
    assert "SUCCESS" in _promtool("test", "rules", "tests/charts/alerts_test.yml")
