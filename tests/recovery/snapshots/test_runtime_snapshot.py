"""recovery.snapshots.store with real DCP files: publish atomically, select the newest verified one, fence."""

from __future__ import annotations

import os

import pytest
import torch

from gpuguard.examples.demo_train import build
from gpuguard.recovery.snapshots import store as snap


def state(seed: int = 0) -> dict:
    model, opt = build(seed)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    x = torch.ones(2, 16)
    model(x).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "rng": {"torch": torch.get_rng_state()}}


@pytest.fixture
def job(tmp_path):
    for step in (1, 2, 3):
        info = snap.save_snapshot(tmp_path, step, snap.clone_state(state(step)), generation=1, owner="inc")
        assert info is not None and info.path.name == f"step-{step}"
    return tmp_path


def test_newest_verified_snapshot_is_chosen_and_loads_to_the_same_digest(job):
    sel = snap.select_restorable(job)
    assert sel.chosen.step == 3 and not sel.rejected
    fresh = state(99)
    loaded = snap.load_snapshot(sel.chosen, fresh)
    assert snap.state_digest(loaded) == sel.chosen.state_digest == snap.state_digest(state(3))
    assert snap.select_restorable(job, 2).chosen.step == 2


def test_corrupt_and_incomplete_snapshots_are_rejected_with_reasons(job):
    shard = next((job / "snapshots" / "step-3").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-20] ^= 1
    shard.write_bytes(bytes(data))
    os.unlink(next((job / "snapshots" / "step-2").glob("gpuguard.manifest.json")))
    sel = snap.select_restorable(job)
    assert sel.chosen.step == 1
    reasons = {r.step: r.reason for r in sel.rejected}
    assert "corrupt" in reasons[3] and "incomplete" in reasons[2]
    assert snap.select_restorable(job, max_tries=2).chosen is None  # bounded: never an endless search


def test_expected_manifest_digest_pins_the_exact_state(job):
    two = snap.select_restorable(job, 2).chosen
    sel = snap.select_restorable(job, 3, expected_manifest_digest=two.manifest_digest)
    assert sel.chosen.step == 2
    assert [(r.step, "not the certified" in r.reason) for r in sel.rejected] == [(3, True)]
    assert snap.select_restorable(job, 1, expected_manifest_digest=two.manifest_digest).chosen is None


def test_a_fenced_writer_publishes_nothing_and_a_killed_one_leaves_no_snapshot(job):
    assert snap.save_snapshot(job, 4, state(4), generation=1, owner="old", still_current=lambda: False) is None

    def die(_path):
        raise KeyboardInterrupt  # stands in for the process dying before the rename

    with pytest.raises(KeyboardInterrupt):
        snap.save_snapshot(job, 5, state(5), generation=1, owner="x", before_publish=die)
    assert [s.step for s in snap.list_snapshots(job)] == [3, 2, 1]
    assert not [n for n in os.listdir(job / "snapshots") if n.startswith(".")]


def test_replayed_step_replaces_and_prune_keeps_the_newest(job):
    again = snap.save_snapshot(job, 3, state(33), generation=2, owner="new")
    assert snap.select_restorable(job).chosen.generation == 2 == again.generation
    assert snap.prune(job, keep=2) == [1]
    ck = snap.copy_to_checkpoint(job, snap.select_restorable(job).chosen)
    assert ck.kind == "checkpoints"
    assert {(s.step, s.kind) for s in snap.list_snapshots(job)} == {
        (3, "snapshots"),
        (2, "snapshots"),
        (3, "checkpoints"),
    }


def test_prune_never_deletes_a_protected_frontier(job):
    assert snap.prune(job, keep=1, protect=frozenset({1})) == [2]
    assert sorted(s.step for s in snap.list_snapshots(job)) == [1, 3]
