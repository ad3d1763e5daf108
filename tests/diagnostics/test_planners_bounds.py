"""Issue 28 finding 8: planners bound their inputs. `plan layout --tp 99999999999999999999` grew to 23 GB
until the OOM killer ended it; any count past its bound is now one usage line, exit 64, at once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.diagnostics.planners import (
    MAX_RANKS,
    checkpoint_plan,
    collective_plan,
    failure_rate_per_hour,
    layout_plan,
)
from gpuguard.foundation.errors import UsageError
from tests.support.cli import BIN, REPO

HUGE = 99999999999999999999


@pytest.mark.parametrize(
    ("call", "option"),
    [
        (lambda: layout_plan(HUGE, 1, 1, 0), "--tp"),
        (lambda: layout_plan(1, HUGE, 1, 0), "--pp"),
        (lambda: layout_plan(1, 1, HUGE, 0), "--dp"),
        (lambda: layout_plan(1000, 1000, 1000, 0), "--tp × --pp × --dp"),
        (lambda: layout_plan(8, 4, 2, 0, global_batch=HUGE**20), "--global-batch"),
        (lambda: collective_plan(HUGE, 1.0, 1.0, 0.0), "--ranks"),
        (lambda: failure_rate_per_hour(None, 1.0, HUGE**20), "--gpus"),
        (lambda: checkpoint_plan(1e300, 1.0), "--cost"),
    ],
)
def test_a_count_past_its_bound_is_a_usage_error_naming_the_option(call, option):
    with pytest.raises(UsageError, match=option.replace("×", ".")) as err:
        call()
    assert err.value.exit_code == 64 and "\n" not in str(err.value)


@given(st.integers(1, 100), st.integers(1, 100), st.integers(1, 100))
@settings(max_examples=50, deadline=None)
def test_every_layout_within_the_bounds_is_planned(tp, pp, dp):
    plan = layout_plan(tp, pp, dp, tp * pp * dp - 1)
    assert plan.world == tp * pp * dp <= MAX_RANKS


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "layout", "--tp", str(HUGE), "--pp", "1", "--dp", "1", "--failed-rank", "0"],
        ["plan", "layout", "--tp", "1000000", "--pp", "1000000", "--dp", "1", "--failed-rank", "0", "--json"],
        ["plan", "collective", "--ranks", str(HUGE), "--bytes", "1GB", "--bandwidth", "10GB/s"],
        ["plan", "checkpoint", "--cost", "60", "--mtbf-hours", "1000", "--gpus", str(HUGE)],
    ],
)
def test_the_command_answers_at_once_with_64(tmp_path, argv):
    cost = tmp_path / "cost.json"
    subprocess.run(
        [sys.executable, "-m", "tests.support.measure", str(cost), "30", str(BIN / "gpu-doctor"), *argv],
        cwd=REPO,
        check=True,
        timeout=60,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    doc = json.loads(cost.read_text())
    assert doc["code"] == 64 and not doc["killed"]
    assert doc["seconds"] < 5 and doc["maxrss_kib"] < 200 * 1024
