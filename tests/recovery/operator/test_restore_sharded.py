"""Issue 28 finding 8: `gpu-recover restore` checks what the runtime will check. A sharded snapshot whose
part is missing or swapped used to be pinned, then refused by the runtime, which resumed a step
earlier than the pin said: now restore refuses it in one line and pins the previous one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpuguard.foundation import jobdir
from gpuguard.generation import manifest as m
from gpuguard.recovery.snapshots import parts as ss
from gpuguard.recovery.snapshots.store import save_snapshot, select_restorable
from tests.support.cli import run_cli


def _sharded(root: Path, step: int) -> Path:
    """A one-member sharded snapshot of `step`: the replicated writer's files, its one part, the
    sharded manifest and state record (what `sharded._complete` writes for a world of 1)."""
    import torch

    info = save_snapshot(root, step, {"w": torch.full((4,), float(step))}, generation=0, owner="rank0/inc")
    manifest = m.load_manifest(info.path)
    part = ss.Part(step, 0, 0, 1, "inc", manifest.entries)
    ss.write_part(part, info.path)
    extra = {"layout": ss.LAYOUT, "world_size": 1, "parts": {"0": part.digest}}
    m.write_manifest(m.Manifest(0, step, manifest.entries, 0, extra, manifest.metadata), info.path)
    state = jobdir.read_snapshot_state(info.path)
    jobdir.write_snapshot_state(
        info.path, jobdir.SnapshotState(step, 0, state.state_digest, state.owner, state.time, state.keys, ss.LAYOUT, 1)
    )
    assert ss.parts_problem(select_restorable(root, step).chosen) is None
    return info.path


@pytest.mark.parametrize("damage", ["missing", "swapped"])
def test_restore_refuses_a_sharded_snapshot_the_runtime_would_refuse(tmp_path, damage):
    job = tmp_path / "job"
    jobdir.ensure_job(job)
    _sharded(job, 1)
    newest = _sharded(job, 2)
    part = newest / ss.part_name(0)
    if damage == "missing":
        part.unlink()
    else:
        shutil.copy(job / "snapshots" / "step-1" / ss.part_name(0), part)  # intact, but step 1's
    runtime = ss.select_sharded(job)  # what the runtime's coordinator takes
    r = run_cli("gpu-recover", "restore", "--job-dir", str(job), "--yes", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)["details"]
    assert doc["chosen"]["step"] == runtime.chosen.step == 1
    (rejected,) = doc["rejected"]
    assert rejected["step"] == 2 and rejected["reason"] == runtime.rejected[0].reason
    assert "\n" not in rejected["reason"] and "part of rank 0" in rejected["reason"]
    assert jobdir.read_restore_pin(job).step == 1
