"""The host lease's files (recovery.runtime.host_lease): the state format, the directory's rules, joining."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.foundation.errors import DataError, UnavailableError
from gpuguard.foundation.identity import own_start_time
from gpuguard.recovery.runtime.host_lease import HostDir, HostHeartbeat, HostState, Member, boot_id, fresh, join
from gpuguard.recovery.runtime.lease import LeaseFenced, LeaseTiming, now

TIMING = LeaseTiming(3.0)


@given(st.binary(max_size=300))
def test_any_bytes_parse_to_a_state_or_to_none_never_an_exception(raw):
    out = HostState.from_json(raw)
    assert out is None or isinstance(out, HostState)


@given(
    st.integers(min_value=0, max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=1, max_value=3600),
    st.text(max_size=40),
    st.integers(min_value=1, max_value=2**22),
)
def test_a_state_round_trips(lease, last_ok, ttl, boot, by):
    s = HostState(lease, last_ok, ttl, boot, by)
    assert HostState.from_json(s.to_json()) == s


@pytest.mark.parametrize(
    "raw",
    [
        b'{"version": 2, "lease": 1, "last_ok": 1.0, "ttl_s": 3.0, "boot_id": "b", "by": 1}',
        b'{"version": 1, "lease": "1", "last_ok": 1.0, "ttl_s": 3.0, "boot_id": "b", "by": 1}',
        b'{"version": 1, "lease": 1, "last_ok": true, "ttl_s": 3.0, "boot_id": "b", "by": 1}',
        b'{"version": 1, "lease": 1, "ttl_s": 3.0, "boot_id": "b", "by": 1}',
        b"[]",
        b"",
    ],
)
def test_a_state_of_another_version_type_or_shape_is_none(raw):
    assert HostState.from_json(raw) is None


def test_freshness_needs_this_boot_this_ttl_and_a_keepalive_within_the_margin():
    s = HostState(7, 100.0, 3.0, "boot-a", 1)
    assert fresh(s, "boot-a", TIMING, 101.5)
    assert not fresh(s, "boot-a", TIMING, 101.51)  # past the margin: its ranks have fenced
    assert not fresh(s, "boot-b", TIMING, 100.5)  # another boot: its clock started again
    assert not fresh(s, "boot-a", LeaseTiming(6.0), 100.5)
    assert not fresh(s, "boot-a", TIMING, 99.0)  # a time in the future is not trusted


def test_the_directory_and_its_files_are_private(tmp_path):
    d = HostDir.for_lease("scope", tmp_path)
    d.write_state(HostState(1, 2.0, 3.0, boot_id(), os.getpid()))
    d.register("inc/../x", Member("P/lease/x", os.getpid(), 1.0, 2.0))  # an odd id becomes a safe name
    fd = d.try_lock("renewer.lock")
    assert fd is not None and d.try_lock("renewer.lock") is None  # flock: one holder
    os.close(fd)
    assert stat.S_IMODE(d.path.stat().st_mode) == 0o700
    for f in [*d.path.iterdir(), *(d.path / "members").iterdir()]:
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert [m.key for _, m in d.members()] == ["P/lease/x"]
    d.close()


def test_a_link_or_a_shared_directory_at_the_host_path_is_refused(tmp_path):
    d = HostDir.for_lease("scope", tmp_path)
    path = d.path
    d.close()
    (path / "members").rename(tmp_path / "m")
    os.rename(path, tmp_path / "elsewhere")
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="not a directory of its own"):
        HostDir(path)
    path.unlink()
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    with pytest.raises(DataError, match="open to others"):
        HostDir(path)


def test_a_link_planted_at_the_state_file_is_replaced_never_written_through(tmp_path):
    d = HostDir.for_lease("scope", tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (d.path / "lease.json").symlink_to(victim)
    assert d.read_state() is None  # not followed
    d.write_state(HostState(1, 2.0, 3.0, "b", 1))
    assert victim.read_text() == "keep" and not (d.path / "lease.json").is_symlink()
    d.close()


def test_the_first_rank_grants_and_the_next_joins_the_same_lease(tmp_path):
    t = [100.0]
    grants: list[int] = []

    def grant() -> int:
        grants.append(len(grants) + 41)
        return grants[-1]

    a = HostDir.for_lease("scope", tmp_path)
    b = HostDir.for_lease("scope", tmp_path)
    lease_a, fd_a = join(a, grant, TIMING, clock=lambda: t[0])
    lease_b, fd_b = join(b, grant, TIMING, clock=lambda: t[0])
    assert (lease_a, lease_b, grants) == (41, 41, [41]) and fd_a is not None and fd_b is None
    os.close(fd_a)
    t[0] += 2.0  # nobody renewed within the margin: the lease is stale, a new one is granted
    lease_c, fd_c = join(b, grant, TIMING, clock=lambda: t[0])
    assert lease_c == 42 and fd_c is not None
    ticks = iter(range(1000))
    with pytest.raises(UnavailableError, match="holds renewer.lock but no lease"):  # a renewer that never renews
        join(a, grant, LeaseTiming(0.3), clock=lambda: t[0] + 0.1 * next(ticks))
    os.close(fd_c)
    a.close()
    b.close()


def _heartbeat(d: HostDir, timing: LeaseTiming, fenced: list[str], forget=lambda key: None) -> HostHeartbeat:
    lease, fd = join(d, lambda: 7, timing)
    me = Member("P/lease/me", os.getpid(), own_start_time(), now())
    d.register("me", me)
    return HostHeartbeat(d, lease, lambda: True, timing, fenced.append, renewer_fd=fd, forget=forget, member=("me", me))


def test_a_renewer_that_cannot_write_the_state_counts_failures_and_its_ranks_fence(tmp_path):
    d = HostDir.for_lease("scope", tmp_path)
    fenced: list[str] = []
    hb = _heartbeat(d, LeaseTiming(0.6), fenced).start()
    # the beat thread's temp file name taken by a directory: the renewal cannot be recorded
    (d.path / f".lease.json.{os.getpid()}.{hb._threads[0].ident}.tmp").mkdir()
    try:
        deadline = time.monotonic() + 5.0
        while not fenced and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fenced and hb.failures >= 1, (fenced, hb.failures)
    finally:
        hb.stop()
        d.close()


def test_a_renewer_keeps_the_host_state_fresh_and_prunes_a_gone_or_stalled_rank(tmp_path):
    d = HostDir.for_lease("scope", tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    d.register("dead", Member("P/lease/dead", gone.pid, time.time() - 5, now()))
    d.register("stalled", Member("P/lease/stalled", os.getpid(), own_start_time(), now() - 0.31))  # past the margin
    d.register("running", Member("P/lease/running", os.getpid(), own_start_time(), now() + 60))
    forgotten: list[str] = []
    timing = LeaseTiming(0.6)
    hb = _heartbeat(d, timing, [], forget=forgotten.append).start()
    try:
        time.sleep(1.0)
        assert hb.valid() and hb.beats >= 3 and hb.age() <= timing.margin_s
        assert forgotten.count("P/lease/dead") == 1 and "P/lease/stalled" in forgotten, forgotten
        assert "P/lease/running" not in forgotten and "P/lease/me" not in forgotten  # it ticks: it runs
        assert sorted(name for name, _ in d.members()) == ["me", "running", "stalled"]  # a live process's file stays
    finally:
        hb.stop()
        d.close()


def test_a_rank_that_did_not_run_for_the_margin_fences_though_its_host_renews(tmp_path):
    d = HostDir.for_lease("scope", tmp_path)
    fenced: list[str] = []
    hb = _heartbeat(d, LeaseTiming(0.6), fenced)  # threads not started: as if frozen since it joined
    time.sleep(0.35)
    d.write_state(replace(d.read_state(), last_ok=now()))  # a host-mate renewed just now
    assert hb.age() < 0.1 and not hb.valid()
    with pytest.raises(LeaseFenced, match="did not run for"):
        hb.require("commit of step 3")
    assert len(fenced) == 1
    d.close()


def _counting_reads(d: HostDir) -> list[float]:
    """Instrument `d.read_state` (the real file read, counted): when each read of the host's state happened."""
    reads: list[float] = []
    read = d.read_state

    def counted() -> HostState | None:
        reads.append(now())
        return read()

    d.read_state = counted  # type: ignore[method-assign]
    return reads


def test_the_commit_path_and_the_watchdog_read_no_file_while_a_keepalive_proves_the_lease(tmp_path):
    """The lease check before every commit costs no I/O (issue 29's step overhead): the host's state is
    read when a renewal may be due (about twice an interval), not per commit nor every WATCH_PERIOD_S."""
    d = HostDir.for_lease("scope", tmp_path)
    reads = _counting_reads(d)
    fenced: list[str] = []
    timing = LeaseTiming(3.0)  # a renewal every 1 s
    hb = _heartbeat(d, timing, fenced).start()
    try:
        commits, end = 0, now() + 2.0
        while now() < end:
            hb.require(f"commit of step {commits}")
            commits += 1
            time.sleep(0.005)
        assert hb.beats >= 1 and not fenced and hb.valid()
        # before: one read per commit, and two every WATCH_PERIOD_S (the watchdog's and the beat's)
        assert commits >= 100 and len(reads) <= 20, (commits, len(reads))
    finally:
        hb.stop()
        d.close()


def test_a_rank_that_remembers_the_keepalive_still_fences_when_renewals_stop(tmp_path):
    """No check that passes is later than the margin after the host's last keepalive in the file."""
    d = HostDir.for_lease("scope", tmp_path)
    timing = LeaseTiming(0.6)  # interval 0.2 s, margin 0.3 s
    lease, fd = join(d, lambda: 7, timing)
    me = Member("P/lease/me", os.getpid(), own_start_time(), now())
    d.register("me", me)
    ok, fenced = [True], []
    hb = HostHeartbeat(
        d, lease, lambda: ok[0], timing, fenced.append, renewer_fd=fd, forget=lambda key: None, member=("me", me)
    ).start()
    try:
        time.sleep(0.5)
        ok[0] = False  # etcd stops confirming: no renewal is recorded from now on
        passed: list[float] = []
        deadline = now() + 5.0
        with pytest.raises(LeaseFenced):
            while now() < deadline:
                t0 = now()
                hb.require("commit")
                passed.append(t0)
                time.sleep(0.002)
        last_ok = d.read_state().last_ok
        assert passed and max(passed) - last_ok <= timing.margin_s and fenced
    finally:
        hb.stop()
        d.close()
