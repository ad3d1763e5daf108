"""The registry that owes teardown: every cluster this process owns is torn down at exit, on
SIGTERM/SIGHUP (then the process dies of the same signal), and teardown itself runs with those
signals held, so an interrupt never leaves half a cluster."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any, Protocol


class _Owned(Protocol):
    def down(self) -> None: ...


_LIVE: dict[int, _Owned] = {}
_LIVE_LOCK = threading.Lock()
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def register(cluster: _Owned) -> None:
    with _LIVE_LOCK:
        _LIVE[id(cluster)] = cluster
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in _TEARDOWN_SIGNALS:
            if sig not in _PREVIOUS_HANDLERS and signal.getsignal(sig) in (signal.SIG_DFL, None):
                _PREVIOUS_HANDLERS[sig] = signal.signal(sig, _on_signal)


def unregister(cluster: _Owned) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(id(cluster), None)
        if _LIVE or threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in list(_PREVIOUS_HANDLERS.items()):
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, previous)
            del _PREVIOUS_HANDLERS[sig]


def _close_all() -> None:
    for cluster in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            cluster.down()


def _on_signal(signum: int, _frame: object) -> None:
    """Tear every owned cluster down, then die of the same signal (exit status as without us)."""
    _close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


atexit.register(_close_all)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while tearing down: an interrupt must not leave half a cluster."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = {signal.SIGINT, *_TEARDOWN_SIGNALS}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
