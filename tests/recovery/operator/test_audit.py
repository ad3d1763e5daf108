"""The audit log: one O_APPEND write per record, readable after a crash, never truncated."""

from __future__ import annotations

import json
import multiprocessing
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.recovery.operator import audit


def _writer(job_dir: str, who: int, n: int) -> None:
    for i in range(n):
        audit.append(
            job_dir,
            audit.new_record("abort", "done", 0, args={"writer": who, "i": i}, detail={"pad": "x" * (i * 37 % 3000)}),
        )


def test_concurrent_writers_never_interleave(tmp_path):
    procs = [multiprocessing.get_context("fork").Process(target=_writer, args=(str(tmp_path), w, 40)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    log = audit.read(tmp_path)
    assert log.skipped_lines == 0 and len(log.records) == 160
    for w in range(4):
        assert [r.args["i"] for r in log.records if r.args["writer"] == w] == list(range(40))
    rec = log.records[0]
    assert rec.user and rec.host and rec.pid > 0 and rec.time > 0


def test_torn_last_line_after_a_crash_is_skipped_and_appending_continues(tmp_path):
    audit.append(tmp_path, audit.new_record("restore", "done", 0, args={"step": 3}))
    path = tmp_path / "audit.log"
    with open(path, "ab") as fh:  # a writer killed mid-line
        fh.write(b'{"schema":"gpuguard.audit/1","action":"ab')
    size = path.stat().st_size
    log = audit.read(tmp_path)
    assert [r.action for r in log.records] == ["restore"] and log.skipped_lines == 1
    audit.append(tmp_path, audit.new_record("verify", "done", 0))
    assert path.stat().st_size > size  # appended, nothing rewritten
    assert [r.action for r in audit.read(tmp_path).records] == ["restore", "verify"]
    assert path.read_bytes().startswith(b'{"action":"restore"')


def test_oversized_detail_is_cut_not_the_record(tmp_path):
    audit.append(tmp_path, audit.new_record("abort", "done", 0, detail={"evidence": ["y" * 100] * 2000}))
    (rec,) = audit.read(tmp_path).records
    assert rec.action == "abort" and rec.detail["truncated"] is True


def test_missing_log_is_empty(tmp_path):
    assert audit.read(tmp_path).records == ()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=200),
            st.builds(lambda d: json.dumps(d).encode(), st.dictionaries(st.text(max_size=5), st.integers())),
        ),
        max_size=10,
    )
)
def test_reader_never_crashes_on_garbage(tmp_path_factory, lines):
    d = tmp_path_factory.mktemp("audit")
    (d / "audit.log").write_bytes(b"\n".join(lines))
    audit.append(d, audit.new_record("verify", "done", 0))
    log = audit.read(d)
    assert log.records[-1].action == "verify"
    assert all(isinstance(r, audit.AuditRecord) for r in log.records)
    assert os.path.getsize(d / "audit.log") > 0
