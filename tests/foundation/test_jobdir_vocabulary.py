"""foundation.jobdir's vocabulary: one snapshot-root rule, the restore pin and state.json records
(writer beside reader, property-tested), the unrestorable marks, every name defined once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation import jobdir
from gpuguard.foundation.env import SNAPSHOT_ROOT_ENV
from gpuguard.foundation.errors import DataError

REPO = Path(__file__).resolve().parents[2]
hexes = st.text(alphabet="0123456789abcdef", min_size=1, max_size=64)
texts = st.text(max_size=30)


def test_snapshot_root_is_the_override_else_the_environment_else_the_job_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(SNAPSHOT_ROOT_ENV, raising=False)
    assert jobdir.snapshot_root(tmp_path) == tmp_path
    monkeypatch.setenv(SNAPSHOT_ROOT_ENV, "")
    assert jobdir.snapshot_root(tmp_path) == tmp_path  # an empty variable is unset
    monkeypatch.setenv(SNAPSHOT_ROOT_ENV, str(tmp_path / "shared"))
    assert jobdir.snapshot_root(tmp_path) == tmp_path / "shared"
    assert jobdir.snapshot_root(tmp_path, tmp_path / "given") == tmp_path / "given"
    assert jobdir.snapshot_root(tmp_path, None) == tmp_path / "shared"


@given(
    step=st.integers(0, 10**15),
    gen=st.none() | st.integers(0, 10**6),
    digest=st.none() | hexes,
    kind=st.sampled_from(["snapshots", "checkpoints"]),
    at=st.floats(0, 2e9, allow_nan=False),
)
@settings(max_examples=60, deadline=None)
def test_restore_pin_round_trips(tmp_path_factory, step, gen, digest, kind, at):
    d = tmp_path_factory.mktemp("j")
    pin = jobdir.RestorePin(step, f"/x/{kind}/step-{step}", kind, gen, digest, digest, at)
    path = jobdir.write_restore_pin(d, pin)
    assert path == d / "restore.json"
    assert jobdir.read_restore_pin(d) == pin
    assert json.loads(path.read_text())["schema"] == "gpuguard.restore/1"
    used = jobdir.consume_restore_pin(d, 7)
    assert used == d / "coord" / "restore-used-g7.json" and jobdir.read_restore_pin(d) is None


@given(st.one_of(st.none(), st.booleans(), st.integers(max_value=-1), texts, st.floats(allow_nan=True)))
@settings(max_examples=40, deadline=None)
def test_a_pin_without_a_valid_step_is_refused(tmp_path_factory, step):
    d = tmp_path_factory.mktemp("j")
    (d / "restore.json").write_text(json.dumps({"step": step}))
    with pytest.raises(DataError):
        jobdir.read_restore_pin(d)


def test_a_pin_naming_only_a_step_is_a_pin(tmp_path):
    """The runtime acts on `step` alone (docs/formats/snapshots.md): a hand-written pin is honoured."""
    (tmp_path / "restore.json").write_text('{"step": 5}')
    assert jobdir.read_restore_pin(tmp_path).step == 5


@given(
    step=st.integers(0, 10**15),
    gen=st.none() | st.integers(0, 10**6),
    digest=st.none() | hexes,
    owner=texts,
    keys=st.lists(st.text(min_size=1, max_size=10), max_size=6, unique=True),
    sharded=st.booleans(),
    world=st.integers(1, 4096),
)
@settings(max_examples=60, deadline=None)
def test_snapshot_state_round_trips(tmp_path_factory, step, gen, digest, owner, keys, sharded, world):
    d = tmp_path_factory.mktemp("s")
    state = jobdir.SnapshotState(
        step,
        gen,
        digest,
        owner,
        12.5,
        tuple(sorted(keys)),
        "gpuguard.sharded/1" if sharded else None,
        world if sharded else None,
    )
    assert jobdir.write_snapshot_state(d, state) == d / "state.json"
    assert jobdir.read_snapshot_state(d) == state
    doc = json.loads((d / "state.json").read_text())
    assert ("layout" in doc) == sharded  # a replicated record keeps today's fields exactly


@given(st.dictionaries(st.sampled_from(["schema", "step", "generation", "keys", "world_size"]), st.integers() | texts))
@settings(max_examples=60, deadline=None)
def test_a_malformed_state_record_is_one_data_error(tmp_path_factory, doc):
    d = tmp_path_factory.mktemp("s")
    (d / "state.json").write_text(json.dumps(doc))
    with pytest.raises(DataError):
        jobdir.read_snapshot_state(d)


def test_unrestorable_marks_live_under_the_snapshot_root(tmp_path):
    digest = "ab" * 32
    assert not jobdir.is_unrestorable(tmp_path, digest)
    assert jobdir.mark_unrestorable(tmp_path, step=3, path=tmp_path / "x", manifest_digest=digest, reason="r" * 900)
    assert jobdir.is_unrestorable(tmp_path, digest)
    mark = json.loads(jobdir.unrestorable_path(tmp_path, digest).read_text())
    assert mark["step"] == 3 and len(mark["reason"]) == 500
    assert jobdir.unrestorable_path(tmp_path, digest).name == f"unrestorable-{digest[:32]}.json"


def test_the_job_dir_file_names_are_written_once():
    """Each name of docs/formats/job-dir.md appears as a string literal in one product module only."""
    names = ["restore.json", "state.json", "audit.log", "ledger.url", "generation.key", "job.json"]
    patterns = [r"switch-g\{", r"unrestorable-\{", r"restore-used-g\{"]
    layers = ("foundation", "collectors", "diagnostics", "generation", "plugins", "doctor", "recovery", "cli")
    product = [p for layer in layers for p in (REPO / layer).rglob("*.py")]
    for needle in [re.escape(f'"{n}"') for n in names] + patterns:
        where = sorted(str(p.relative_to(REPO)) for p in product if re.search(needle, p.read_text()))
        assert where == ["foundation/jobdir.py"], f"{needle} written in {where}"


def test_every_job_dir_file_is_in_the_format_page():
    page = (REPO / "docs" / "formats" / "job-dir.md").read_text()
    for name in [
        jobdir.JOB_JSON,
        jobdir.LEDGER_URL_FILE,
        jobdir.KEY_FILE,
        jobdir.AUDIT_LOG,
        jobdir.RESTORE_PIN,
        jobdir.STATE_FILE,
        "switch-g<G>-r<R>.json",
        "unrestorable-",
        "restore-used-g<G>.json",
        "activation-g<G>.json",
    ]:
        assert name in page, name
