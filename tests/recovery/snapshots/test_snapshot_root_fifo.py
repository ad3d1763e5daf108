"""Issue 28 finding 4: one FIFO in the snapshot root used to hang every restart (the coordinator blocked in
`open()` on a FIFO `.distcp`). Now the coordinator's selection refuses that snapshot in one line and
falls back to the next verified one, within a second; so do a FIFO manifest and a FIFO state.json."""

from __future__ import annotations

import os

import pytest

from gpuguard.foundation.deadline import call_with_deadline
from gpuguard.recovery.snapshots.store import save_snapshot, select_restorable


@pytest.mark.parametrize("planted", ["__0_0.distcp", "gpuguard.manifest.json", "state.json"])
def test_a_fifo_in_the_newest_snapshot_is_refused_and_the_older_one_chosen(tmp_path, planted):
    import torch

    for step in (1, 2):
        save_snapshot(tmp_path, step, {"w": torch.full((4,), float(step))}, generation=0, owner="t")
    target = tmp_path / "snapshots" / "step-2" / planted
    target.unlink()
    os.mkfifo(target)  # nobody ever opens its other end
    selection = call_with_deadline(lambda: select_restorable(tmp_path, 2), 5.0)
    assert selection.chosen is not None and selection.chosen.step == 1
    (rejected,) = selection.rejected
    assert rejected.step == 2 and "not a regular file" in rejected.reason and "\n" not in rejected.reason
