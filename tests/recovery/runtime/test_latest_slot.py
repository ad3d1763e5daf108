"""The background writers' slot: the newest request wins, back-pressure is bounded, flush waits for
the handler, and nothing offered before `stop` is lost."""

from __future__ import annotations

import threading
import time

from gpuguard.recovery.runtime.latest_slot import LatestSlot


def test_every_offer_is_handled_when_the_worker_keeps_up() -> None:
    seen: list[int] = []
    slot: LatestSlot[int] = LatestSlot("t", seen.append)
    for i in range(50):
        assert slot.offer(i, max_wait=5.0) is False  # back-pressure: nothing replaced
    assert slot.flush(5.0)
    assert seen == list(range(50))


def test_a_blocked_worker_keeps_only_the_newest_and_flush_is_bounded() -> None:
    gate, seen = threading.Event(), []

    def handle(item: int) -> None:
        gate.wait(10.0)
        seen.append(item)

    slot: LatestSlot[int] = LatestSlot("t", handle)
    slot.offer(0)
    deadline = time.monotonic() + 5.0
    while not slot._busy and time.monotonic() < deadline:  # noqa: SLF001 - wait until 0 is being handled
        time.sleep(0.005)
    assert slot.offer(1) is False
    assert slot.offer(2) is True  # replaced 1, which is never handled
    t0 = time.monotonic()
    assert slot.flush(0.1) is False  # 0 is still being handled
    assert time.monotonic() - t0 < 2.0
    gate.set()
    assert slot.flush(5.0)
    assert seen == [0, 2]


def test_a_falsy_item_is_handled_and_stop_drains_first() -> None:
    seen: list[object] = []
    slot: LatestSlot[object] = LatestSlot("t", seen.append)
    slot.offer(None)
    slot.offer(0, max_wait=5.0)
    slot.stop()
    assert slot.flush(5.0)
    assert seen == [None, 0]
