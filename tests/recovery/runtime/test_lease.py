"""The lease heartbeat and its self-fence (recovery.runtime.lease), on a fake clock and a fake keepalive."""

from __future__ import annotations

import threading
import time

import pytest

from gpuguard.recovery.runtime.lease import Heartbeat, LeaseFenced, LeaseTiming, now


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_timing_is_derived_from_the_ttl():
    t = LeaseTiming(6.0)
    assert (t.interval_s, t.margin_s, t.call_timeout_s) == (2.0, 3.0, 1.0)
    assert t.margin_s < t.ttl_s  # the fence always comes before etcd can expire the lease


def test_require_fences_once_past_the_margin_and_never_before():
    clock, fenced = Clock(), []
    hb = Heartbeat(lambda: True, LeaseTiming(3.0), fenced.append, clock=clock)  # threads not started
    clock.t += 1.5
    hb.require("commit")  # exactly at the margin: still provably alive
    assert hb.valid() and not fenced
    clock.t += 0.01
    with pytest.raises(LeaseFenced):
        hb.require("commit of step 7")
    with pytest.raises(LeaseFenced):
        hb.require("report")
    assert len(fenced) == 1 and "commit of step 7" in fenced[0] and not hb.valid()


def test_a_failing_keepalive_fences_within_the_margin_on_the_real_clock():
    fenced: list[str] = []
    done = threading.Event()
    hb = Heartbeat(lambda: False, LeaseTiming(0.6), lambda why: (fenced.append(why), done.set()))
    t0 = now()
    hb.start()
    assert done.wait(5.0)
    took = now() - t0
    assert 0.3 <= took < 0.6, took  # margin TTL/2 = 0.3 s, always before the TTL
    assert hb.failures >= 1 and "no lease keepalive" in fenced[0]


def test_a_working_keepalive_keeps_the_lease_valid():
    fenced: list[str] = []
    hb = Heartbeat(lambda: True, LeaseTiming(0.6), fenced.append).start()
    try:
        time.sleep(1.0)
        assert hb.valid() and not fenced and hb.beats >= 3
    finally:
        hb.stop()


def test_a_keepalive_that_says_the_lease_is_gone_is_a_missed_beat():
    fenced: list[str] = []
    answers = iter([True, True] + [False] * 1000)
    hb = Heartbeat(lambda: next(answers), LeaseTiming(0.6), fenced.append).start()
    deadline = time.monotonic() + 5
    while not fenced and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fenced and not hb.valid()
