"""A wall-clock deadline over one blocking call that has only per-read timeouts (HTTP clients).

`call_with_deadline(fn, seconds)` runs `fn` in a daemon thread and waits at most `seconds`. When the
deadline passes first, it raises `DeadlineExceeded` and abandons the thread: a server that trickles
its answer one byte at a time resets every per-read timeout, so only a total deadline bounds the
caller. The abandoned thread ends on its own when the peer answers or stalls past its per-read
timeout, and never keeps the process alive (daemon). Its result, if any, is discarded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


class DeadlineExceeded(TimeoutError):
    """The call did not finish within its total deadline (it may still finish, unobserved)."""


def call_with_deadline(fn: Callable[[], _T], seconds: float, *, name: str = "gpuguard-deadline") -> _T:
    """fn() within `seconds` of wall-clock time; its exception re-raised; `DeadlineExceeded` if late."""
    values: list[_T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            values.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            errors.append(exc)

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(max(0.0, seconds))
    if worker.is_alive():
        raise DeadlineExceeded(f"not finished within {seconds:g} s")
    if errors:
        raise errors[0]
    return values[0]
