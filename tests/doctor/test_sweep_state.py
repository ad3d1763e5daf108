"""The sweep's state between cron runs (`doctor.sweep`): load/save, retention, history cap, the lock.

Plain functions on real files in tmp_path; the end-to-end sweep is tests/cli/test_sweep.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from gpuguard.collectors import kernel_log
from gpuguard.doctor import sweep
from gpuguard.foundation.errors import EXIT_IOERR, EXIT_TEMPFAIL, GpuguardError, UnavailableError
from gpuguard.foundation.events import Event
from tests.support.node import SAMPLE_LOG

DAY = 86400.0


def _xid(code: int, pci: str = "0000:61:00.0", line: int = 1) -> Event:
    return Event(kind="xid", line=line, text=f"NVRM: Xid (PCI:{pci}): {code}", fields={"pci_bus_id": pci, "xid": code})


def test_a_missing_state_file_is_a_first_run(tmp_path):
    state, notes = sweep.load_state(tmp_path / sweep.STATE_FILE)
    assert state == sweep.empty_state() and notes == []
    assert state["schema"] == sweep.STATE_SCHEMA


def test_saved_state_loads_back_with_its_cursor(tmp_path):
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE_LOG, log)
    read = kernel_log.read_file(str(log))
    kept = sweep.retain(sweep.empty_state(), read.events, cursor=read.cursor, now=1000.0, retain_s=DAY)
    path = tmp_path / "state" / sweep.STATE_FILE
    sweep.save_state(path, {**kept.state, "last_verdict": "drain"})
    assert path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text())["schema"] == sweep.STATE_SCHEMA
    state, notes = sweep.load_state(path)
    assert notes == []
    assert state["cursor"] == read.cursor and state["last_verdict"] == "drain"
    assert state["events"] == kept.state["events"] and state["xid_totals"] == kept.state["xid_totals"]
    again = kernel_log.read_file(str(log), cursor=state["cursor"])
    assert again.lines_read == 0  # the next sweep reads only what was appended


def test_a_damaged_state_file_starts_over_with_a_note(tmp_path):
    path = tmp_path / sweep.STATE_FILE
    for raw in (
        b"\x00garbage",
        b'{"schema": "something-else/1"}',
        b'{"schema": "gpuguard.sweep-state/1", "cursor": 7}',
    ):
        path.write_bytes(raw)
        state, notes = sweep.load_state(path)
        assert state == sweep.empty_state()
        assert len(notes) == 1 and "unreadable" in notes[0] and str(path) in notes[0]


def test_damaged_records_are_dropped_and_the_rest_kept(tmp_path):
    path = tmp_path / sweep.STATE_FILE
    good = sweep.event_record(_xid(48), seen_at=5.0)
    path.write_text(
        json.dumps(
            {"schema": sweep.STATE_SCHEMA, "events": [good, "nonsense", {"kind": 3}, {"kind": "xid", "line": -1}]}
        )
    )
    state, notes = sweep.load_state(path)
    assert notes == [] and [r["kind"] for r in state["events"]] == ["xid", "xid"]
    assert state["events"][0] == good and state["events"][1]["line"] == 0


def test_an_unreadable_state_file_is_an_error_not_a_fresh_start(tmp_path):
    path = tmp_path / sweep.STATE_FILE
    path.mkdir()  # read_bytes() fails with EISDIR: not something to silently start over from
    with pytest.raises(GpuguardError) as err:
        sweep.load_state(path)
    assert err.value.exit_code == EXIT_IOERR and "sweep state" in str(err.value)


def test_retention_forgets_old_events_counts_new_ones_and_keeps_the_cursor(tmp_path):
    log = tmp_path / "kern.log"
    shutil.copy(SAMPLE_LOG, log)
    cursor = kernel_log.read_file(str(log)).cursor
    old = {**sweep.empty_state(), "cursor": cursor, "xid_totals": {"0000:61:00.0|48": 2}}
    old["events"] = [sweep.event_record(_xid(48), seen_at=1.0), sweep.event_record(_xid(79), seen_at=9000.0)]
    noise = Event(kind="nccl_warn", line=3, text="NCCL WARN")
    kept = sweep.retain(old, [_xid(48, line=9), noise], cursor=None, now=10000.0, retain_s=5000.0)
    assert kept.new_events == 1  # only the kernel-log kinds the verdict counts
    assert [(e.fields["xid"], e.line) for e in kept.events] == [(79, 1), (48, 9)]  # the old Xid 48 is forgotten
    assert kept.state["xid_totals"] == {"0000:61:00.0|48": 3}  # totals outlive retention
    assert kept.state["cursor"] == cursor  # a source without a cursor keeps the old one
    assert len(old["events"]) == 2 and old["xid_totals"] == {"0000:61:00.0|48": 2}  # the input is not changed


def test_records_round_trip_to_events():
    event = Event(
        kind="xid",
        line=17,
        text="x" * 1000,
        fields={"pci_bus_id": "0000:2b:00.0", "xid": 79, "nested": {"no": 1}},
        timestamp=1.5,
        source="kern.log",
        severity="critical",
        diagnosis="fell off the bus",
    )
    back = sweep.event_from_record(sweep.event_record(event, seen_at=2.0))
    assert back.kind == "xid" and back.line == 17 and len(back.text) == 400
    assert dict(back.fields) == {"pci_bus_id": "0000:2b:00.0", "xid": 79}  # only scalar fields are kept
    assert (back.timestamp, back.source, back.severity, back.diagnosis) == (
        1.5,
        "kern.log",
        "critical",
        "fell off the bus",
    )


def test_history_is_capped_per_gpu_and_code_and_in_total():
    storm = [{"kind": "xid", "line": i, "fields": {"pci_bus_id": "0000:10:00.0", "xid": 13}} for i in range(100)]
    rare = {"kind": "xid", "line": -1, "fields": {"pci_bus_id": "0000:10:00.0", "xid": 79}}
    kept = sweep.cap_history([rare, *storm])
    assert kept[0] is rare and len(kept) == 1 + sweep.PER_CODE_HISTORY
    many = [{"kind": "xid", "line": i, "fields": {"pci_bus_id": f"0000:{i:04x}:00.0", "xid": 13}} for i in range(3000)]
    capped = sweep.cap_history(many)
    assert len(capped) == sweep.MAX_HISTORY and capped[-1]["line"] == 2999  # the newest survive


def test_one_sweep_per_state_directory(tmp_path):
    state_dir = tmp_path / "state"
    with sweep.SweepLock(state_dir, wait=0.0):
        assert (state_dir / sweep.LOCK_FILE).exists()
        with pytest.raises(UnavailableError) as err:
            with sweep.SweepLock(state_dir, wait=0.2):
                pass
        assert err.value.exit_code == EXIT_TEMPFAIL and "another sweep holds" in str(err.value)
    with sweep.SweepLock(state_dir, wait=0.0) as lock:  # released on exit: the next sweep gets it at once
        assert lock.fd is not None
    assert lock.fd is None


def test_default_state_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUGUARD_STATE_DIR", str(tmp_path / "here"))
    assert sweep.default_state_dir() == tmp_path / "here"
    monkeypatch.delenv("GPUGUARD_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    expected = "/var/lib/gpuguard" if os.geteuid() == 0 else str(tmp_path / "xdg" / "gpuguard")
    assert str(sweep.default_state_dir()) == expected
