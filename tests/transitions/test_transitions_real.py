"""One real schedule: torchrun/gloo workers, a real SIGKILL mid optimizer write, certified recovery.

The rest of the real subset is a benchmark (`gpu-generation bench transitions --real`), not a test.
"""

from __future__ import annotations

import pytest

from gpuguard.transitions.real import FAULT_STEP, run_real_one


@pytest.mark.slow
def test_gpuguard_recovers_a_real_death_mid_optimizer_write_exactly():
    row = run_real_one("gpuguard", "process-death", "mid-optimizer-write", timeout_s=150, workers=2)
    assert not row.semantic_failure, (row.detail, row.findings)
    assert row.mode == "real" and row.latency == "measured"
    assert row.recovery_s is not None and row.recovery_s > 0
    # the frontier is the last step every rank committed: the half-written step is redone, none is lost
    assert row.steps_lost == 0
    assert row.sync_ops_per_step == 0  # a commit is local (the step log): no ledger record per rank-step
    assert FAULT_STEP > 0
