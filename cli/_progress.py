"""The one progress bar of the CLI: transient, on stderr, only on a terminal, started at the first tick.

Why one: every long read (a kernel log, log files, Flight Recorder dumps, 100,000 step logs) wants the
same behaviour: nothing when piped (a cron sweep's output stays clean), nothing for work too small to
wait for (the caller's threshold), drawn only once work has begun (a reader pool forks first: the
refresh thread must not exist in the children), and gone before the verdict prints.

    with ProgressBar(in_bytes=True) as bar:
        scan(path, on_progress=bar.ticker(path, size))   # None when no bar is drawn
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class ProgressBar:
    """Tasks keyed by label; `ticker` advances one by n, `update` sets how much is done."""

    def __init__(self, *, in_bytes: bool = False, enabled: bool = True) -> None:
        self.in_bytes = in_bytes
        self.shown = enabled and sys.stderr.isatty()
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def ticker(self, label: str, total: int | None) -> Callable[[int], None] | None:
        """A callback advancing `label`'s task by n (units done since the last call), or None when no bar
        is drawn (not a terminal, disabled, or nothing to measure against)."""
        if not self.shown or not total:
            return None

        def tick(n: int) -> None:
            self._bar_for(label, total).advance(self._tasks[label], n)

        return tick

    def update(self, label: str, done: int, total: int) -> None:
        """`done` of `total` units of `label` are done (a reader that counts, not one that reports deltas)."""
        if self.shown:
            self._bar_for(label, total).update(self._tasks[label], completed=done)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _bar_for(self, label: str, total: int) -> Any:
        """The bar, started at the first tick, with a task for `label`."""
        if self._bar is None:
            self._bar = self._make()
            self._bar.start()
        if label not in self._tasks:
            self._tasks[label] = self._bar.add_task(label, total=total)
        return self._bar

    def _make(self) -> Any:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        from gpuguard.cli._app import console

        counts = (DownloadColumn(), TransferSpeedColumn()) if self.in_bytes else (MofNCompleteColumn(),)
        return Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            *counts,
            TimeRemainingColumn(),
            console=console(stderr=True),
            transient=True,
        )
