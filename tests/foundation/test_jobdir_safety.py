"""Job-dir reads and writes that neither follow links nor hang, on real files: a record scan
survives entries that vanish or cannot be read, reads are capped, FIFOs do not block."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import DataError, NoInputError


def _record(job: Path, rank: int) -> jobdir.IncarnationRecord:
    rec = jobdir.IncarnationRecord(
        incarnation={"id": f"inc{rank}", "host": "h", "pid": 1000 + rank, "start_time": 1.0},
        rank=rank,
        local_rank=rank,
        world_size=8,
        generation=None,
        agent_pid=1,
        run_id="r",
        master_addr="127.0.0.1",
        master_port=1,
        restart_count=0,
        uid=0,
    )
    jobdir.write_incarnation(job, rec)
    return rec


def test_read_json_refuses_links_fifos_and_huge_files(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text('{"a": 1}')
    (tmp_path / "link.json").symlink_to(target)
    with pytest.raises(DataError, match="symbolic link"):
        jobdir.read_json(tmp_path / "link.json")
    os.mkfifo(tmp_path / "fifo.json")
    t0 = time.monotonic()
    with pytest.raises(DataError, match="not a regular file"):
        jobdir.read_json(tmp_path / "fifo.json")  # no writer: a plain open would block forever
    assert time.monotonic() - t0 < 1.0
    (tmp_path / "big.json").write_bytes(b" " * 2048)
    with pytest.raises(DataError, match="more than the 1 KiB a record may have"):
        jobdir.read_json(tmp_path / "big.json", max_bytes=1024)
    with pytest.raises(NoInputError):
        jobdir.read_json(tmp_path / "missing.json")
    assert jobdir.read_json(target) == {"a": 1}


def test_a_write_never_goes_through_a_linked_folder(tmp_path: Path) -> None:
    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    job.mkdir()
    elsewhere.mkdir()
    (job / "coord").symlink_to(elsewhere)
    with pytest.raises(DataError, match="refusing to write through it"):
        jobdir.atomic_write_json(jobdir.activation_path(job, 3), {"x": 1})
    assert list(elsewhere.iterdir()) == []


def test_unreadable_records_are_reported_and_never_hide_the_others(tmp_path: Path) -> None:
    good = [_record(tmp_path, r) for r in range(3)]
    folder = jobdir.incarnations_dir(tmp_path)
    (folder / "dangling.json").symlink_to(tmp_path / "nowhere")
    (folder / "torn.json").write_text('{"schema": "gpuguard.incarnation/1", "rank": ')
    os.mkfifo(folder / "fifo.json")
    found = list(jobdir.iter_incarnations(tmp_path))
    records = [r for r in found if isinstance(r, jobdir.IncarnationRecord)]
    errors = [str(r) for r in found if isinstance(r, DataError)]
    assert sorted(r.incarnation_id for r in records) == sorted(r.incarnation_id for r in good)
    assert len(errors) == 3 and any("symbolic link" in e for e in errors)


def test_records_appearing_and_vanishing_mid_scan_never_empty_the_scan(tmp_path: Path) -> None:
    """Writers renaming temp files into place and removing records while a reader scans: every scan
    still sees the records that stayed (the bug: one vanished entry dropped all of them)."""
    stable = {_record(tmp_path, r).incarnation_id for r in range(4)}
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set() and i < 2000:
            rec = _record(tmp_path, 100 + i % 7)
            os.unlink(jobdir.incarnation_path(tmp_path, rec.incarnation_id))
            i += 1

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        deadline = time.monotonic() + 3
        scans = 0
        while time.monotonic() < deadline and scans < 300:
            seen = {r.incarnation_id for r in jobdir.read_incarnations(tmp_path)}
            assert stable <= seen
            scans += 1
    finally:
        stop.set()
        writer.join(10)
    assert scans > 10


@given(st.binary(max_size=512))
@settings(max_examples=200, deadline=None)
def test_any_bytes_in_a_record_are_a_clear_error_or_a_record(tmp_path_factory, data: bytes) -> None:
    job = tmp_path_factory.mktemp("job")
    folder = jobdir.incarnations_dir(job)
    folder.mkdir(parents=True)
    (folder / "x.json").write_bytes(data)
    for item in jobdir.iter_incarnations(job):
        assert isinstance(item, (jobdir.IncarnationRecord, DataError))
