"""The alert rules checked and unit-tested by the real tool: promtool (Debian's `prometheus` package,
installed by `make test` through ops/install-test-tools.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES = Path(__file__).resolve().parent.parent / "ops" / "prometheus"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed: `sh ops/install-test-tools.sh` or apt-get install prometheus"
)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_accepts_the_alert_rules() -> None:
    done = _promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_each_alert_fires_when_it_should_stays_quiet_when_it_should_not_and_says_what_to_do() -> None:
    done = _promtool("test", "rules", "alerts.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_unit_test_that_makes_it_fire_and_one_that_keeps_it_quiet() -> None:
    alerts = {r["alert"] for g in yaml.safe_load((RULES / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    cases = [c for t in yaml.safe_load((RULES / "alerts.test.yml").read_text())["tests"] for c in t["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert alerts - fired == set(), "alerts no unit test makes fire"
    # Certificates fire at once by design (their threshold is a date, not a duration).
    assert alerts - quiet - {"CertificateExpiresSoon", "CertificateExpiresVerySoon"} == set(), (
        "alerts never tested quiet"
    )
