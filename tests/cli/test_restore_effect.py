"""`gpu-recover restore` says what its pin changes: the step the next generation starts from, against
the frontier limit when there is one, and that a pin is used once and never moves the frontier
forward (issue 15, item 6). Real snapshots written by the snapshot code, real CLI."""

from __future__ import annotations

import json

from gpuguard.foundation.jobdir import ensure_job
from tests.support.cli import run_cli


def test_restore_says_what_the_pin_changes(tmp_path) -> None:
    import torch

    from gpuguard.recovery.snapshots.store import save_snapshot

    ensure_job(tmp_path)
    for step in (3, 6):
        save_snapshot(tmp_path, step, {"w": torch.full((4,), float(step))}, generation=0, owner="test")
    r = run_cli("gpu-recover", "restore", "--job-dir", str(tmp_path), "--step", "5", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    effect = doc["details"]["effect"]
    assert effect.startswith("the next generation starts from step 3 (no frontier limit to compare with: none")
    assert effect.endswith("(used by the next activation only; a pin never moves the frontier forward)")
    assert doc["summary"].startswith("would pin step 3 (") and effect in doc["summary"]
    human = run_cli("gpu-recover", "restore", "--job-dir", str(tmp_path), "--yes")
    assert human.returncode == 0 and "the next generation starts from step 6" in human.stdout, human.stdout
