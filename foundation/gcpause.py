"""Python's cycle collector held off while a coordinator computes a decision at scale.

At 100,000 members a decision allocates a few hundred thousand small containers (records, rows,
evidence lines) and keeps them. Each allocation burst triggers the collector, and its oldest
generation walks the whole heap, certificates of 100,000 members included: measured on
`bench/scale.py`'s restart decision at 100,000 ranks, 0.2-0.3 s of its ~0.5 s decision. Nothing a
decision allocates is cyclic garbage for long (reference counting frees what it drops), so the
collector can wait a second and a half: it runs again as soon as the section ends. The Flight
Recorder reader holds it off for the same reason while it unpickles dumps.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cycle collection inside; the collector's state as it was after (nested: the outermost decides)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
