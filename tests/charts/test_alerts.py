"""The alert rules in charts/: valid for Prometheus (``promtool check rules``), loaded by the
shipped config, and firing on the series they are for (``promtool test rules`` over
tests/charts/alerts_test.yml), with Debian's promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _promtool(bin_dir: Path, *args: str) -> str:
    done = subprocess.run(
        [str(bin_dir / "promtool"), *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_rules_are_valid_and_the_config_loads_them(prometheus_bin: Path) -> None:
    out = _promtool(prometheus_bin, "check", "rules", "charts/alerts.yml")
    assert "SUCCESS: 4 rules found" in out
    config = yaml.safe_load((REPO / "charts" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]  # beside the config
    _promtool(prometheus_bin, "check", "config", "--syntax-only", "charts/prometheus.yml")


def test_the_alerts_fire_on_what_they_are_for_and_only_then(prometheus_bin: Path) -> None:
    assert "SUCCESS" in _promtool(prometheus_bin, "test", "rules", "tests/charts/alerts_test.yml")
