"""`read_job` on step logs it cannot use: a rank whose newest log is a directory or garbage is reported as
unusable with the reason, never dropped (issue 15: the vote called such a rank hung, or never saw it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors.step_records import read_job
from tests.support.step_jobs import live_step_job


def test_a_directory_in_place_of_the_newest_segment_is_unusable_with_the_reason(tmp_path: Path) -> None:
    segs = live_step_job(tmp_path)
    segs[2].unlink()
    segs[2].mkdir()  # rank 2 is the highest: without WORLD_SIZE from it, it used to vanish from the report
    rec = read_job(tmp_path)
    assert sorted(rec.ranks) == [0, 1]
    assert list(rec.unusable) == [2] and "is a directory" in rec.unusable[2].lower() and segs[2].name in rec.unusable[2]
    assert rec.silent_ranks == ()  # not also reported as a rank that never wrote


def test_garbage_or_an_empty_segment_is_unusable_with_the_reason(tmp_path: Path) -> None:
    segs = live_step_job(tmp_path)
    segs[1].write_bytes(b"\x00\xff garbage\nnot a record\n")
    rec = read_job(tmp_path)
    assert 1 not in rec.ranks and "2 line(s), none a step record" in rec.unusable[1]
    segs[1].write_bytes(b"")  # nothing written yet: its age is not "since 1970" (it was hung at 1.8e9 s)
    rec = read_job(tmp_path)
    assert 1 not in rec.ranks and "no complete record yet" in rec.unusable[1] and rec.silent_ranks == ()


def test_an_unusable_older_incarnation_does_not_hide_the_newer_one(tmp_path: Path) -> None:
    segs = live_step_job(tmp_path)
    old = segs[0].with_name("0.i0old.000000.steplog")
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))  # before the readable incarnation started
    rec = read_job(tmp_path)
    assert rec.unusable == {} and rec.ranks[0].incarnation == "i0" and old.name in rec.skipped_files
    os.utime(old, None)  # touched after it started: it may be the rank's newest, so nothing is known
    rec = read_job(tmp_path)
    assert 0 not in rec.ranks and "is a directory" in rec.unusable[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=2000))
def test_any_bytes_in_a_segment_never_drop_the_rank(tmp_path: Path, junk: bytes) -> None:
    root = tmp_path / f"j{abs(hash(junk))}"
    segs = live_step_job(root, ranks=2)
    segs[1].write_bytes(junk)
    rec = read_job(root)
    # the rank is either read (a record survived, so it has a time) or unusable with a reason: never dropped
    assert (1 in rec.ranks) != (1 in rec.unusable)
    assert 1 in rec.unusable or rec.ranks[1].last_wall > 0
