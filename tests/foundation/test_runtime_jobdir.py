"""recovery.jobdir: the job directory layout and its small atomic JSON records."""

from __future__ import annotations

import json
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import DataError, NoInputError

ids = st.text(alphabet="0123456789abcdef", min_size=1, max_size=32)


def _record(inc_id: str = "abc", rank: int = 0, **kw) -> jobdir.IncarnationRecord:
    base = dict(
        incarnation={"id": inc_id, "host": "h", "pid": 123, "start_time": 1.5},
        rank=rank,
        local_rank=rank,
        world_size=4,
        generation=None,
        agent_pid=1,
        run_id="job",
        master_addr="localhost",
        master_port=29500,
        restart_count=0,
    )
    base.update(kw)
    return jobdir.IncarnationRecord(**base)


@given(
    inc_id=ids,
    rank=st.integers(0, 4096),
    gen=st.none() | st.integers(0, 10**6),
    port=st.integers(1, 65535),
    attempt=st.text(max_size=20),
)
@settings(max_examples=50, deadline=None)
def test_incarnation_record_round_trips(tmp_path_factory, inc_id, rank, gen, port, attempt):
    d = tmp_path_factory.mktemp("j")
    rec = _record(inc_id, rank, generation=gen, master_port=port, attempt=attempt)
    path = jobdir.write_incarnation(d, rec)
    assert path == d / "incarnations" / f"{inc_id}.json"
    assert jobdir.read_incarnations(d) == [rec]
    assert rec.pid == 123 and rec.start_time == 1.5


@given(st.binary(max_size=200))
@settings(max_examples=60, deadline=None)
def test_malformed_incarnation_is_reported_not_dropped(tmp_path_factory, blob):
    d = tmp_path_factory.mktemp("j")
    (d / "incarnations").mkdir()
    (d / "incarnations" / "bad.json").write_bytes(blob)
    out = list(jobdir.iter_incarnations(d))
    assert len(out) == 1
    try:
        doc = json.loads(blob)
        good = isinstance(doc, dict) and isinstance(out[0], jobdir.IncarnationRecord)
    except Exception:
        good = False
    assert good or isinstance(out[0], DataError)


def test_step_dirs_ignores_temp_and_files(tmp_path):
    snaps = tmp_path / "snapshots"
    for name in ("step-3", "step-10", ".tmp-step-11-x", "step-x"):
        (snaps / name).mkdir(parents=True)
    (snaps / "step-12").write_text("not a dir")
    assert [s for s, _ in jobdir.step_dirs(snaps)] == [3, 10]
    assert jobdir.snapshot_dir(tmp_path, 7) == snaps / "step-7"
    assert jobdir.step_dirs(tmp_path / "missing") == []


@given(st.integers(0, 10**12))
def test_step_dir_name_round_trips(step):
    assert jobdir.parse_step_dir(jobdir.step_dir_name(step)) == step


def test_ensure_job_first_writer_wins(tmp_path):
    results = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(jobdir.ensure_job(tmp_path, f"job{i}"))) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.job_id for r in results}) == 1
    assert jobdir.read_job(tmp_path) == results[0]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_read_json_errors(tmp_path):
    with pytest.raises(NoInputError):
        jobdir.read_json(tmp_path / "none.json")
    (tmp_path / "a.json").write_text("[1, 2]")
    with pytest.raises(DataError):
        jobdir.read_json(tmp_path / "a.json")
    with pytest.raises(DataError):
        jobdir.incarnation_path(tmp_path, "../evil")


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "x" / "r.json"
    jobdir.atomic_write_json(p, {"a": 1})
    jobdir.atomic_write_json(p, {"b": 2})
    assert jobdir.read_json(p) == {"b": 2}
    assert os.listdir(p.parent) == ["r.json"]
