"""A training process that dies of an uncaught exception leaves as soon as its exit work is done.

Why: after a peer is lost, a survivor's collective raises and the worker dies; torchrun (or any
supervisor) restarts the job only once the process is gone. Python's finalization after a dead gloo
group is seconds of CPU (tearing down torch's modules and objects; measured 1.5-6.6 s between the
last exit handler and the exit on a loaded 2-core host, 0.05-0.2 s with this hook), time every
survivor adds to the restart while doing nothing useful.

`install()` wraps `sys.excepthook`. On an uncaught exception in the main thread (not
KeyboardInterrupt: Python reports that by its own signal exit) it prints the traceback as before,
then does what finalization does that anyone can rely on, in the same order: waits for the
non-daemon threads (`threading._shutdown`), runs the `atexit` handlers (the runtime's last-snapshot
flush, `weakref.finalize`, multiprocessing's child clean-up), flushes every open Python file and the
standard streams, and leaves with status 1, as Python would. What it skips: destructors of objects
still alive (`__del__`, C++ ones: gloo, NCCL, CUDA), which the dying process does not need.
`GPUGUARD_FAST_EXIT=0` keeps Python's own exit.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading
from types import TracebackType

from gpuguard.foundation.env import FAST_EXIT_ENV

EXIT_STATUS = 1  # what Python exits with after an uncaught exception

# the buffered file types Python flushes when it frees them (concrete types: an isinstance against
# the io.IOBase ABC over every object of a torch process costs 3 x more)
BUFFERED = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)

_installed = False
_leaving = False


def enabled() -> bool:
    return os.environ.get(FAST_EXIT_ENV, "1").strip() != "0"


def install() -> bool:
    """Wrap `sys.excepthook` once per process (see the module docstring); False when disabled."""
    global _installed
    if _installed or not enabled():
        return _installed
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(kind, exc, tb)
        if issubclass(kind, KeyboardInterrupt) or threading.current_thread() is not threading.main_thread():
            return
        leave(EXIT_STATUS)

    sys.excepthook = hook
    _installed = True
    return True


def leaving() -> bool:
    """True once `leave` started: an exit handler that only prepares finalization (a `gc.collect` that
    frees objects while the interpreter is whole) has nothing to prepare."""
    return _leaving


def leave(status: int) -> None:
    """Python's exit work that others rely on (threads joined, exit handlers run, files flushed), then `_exit`."""
    global _leaving
    _leaving = True
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        try:
            shutdown()  # joins the non-daemon threads, as finalization does first
        except Exception:  # noqa: BLE001 - never trade the exit for an error here
            pass
    atexit._run_exitfuncs()  # noqa: SLF001 - what finalization runs; no public name for it
    flush_open_files()
    os._exit(status)


def flush_open_files() -> None:
    """Flush every writable Python file object still open (finalization would, when it frees them)."""
    for obj in gc.get_objects():
        try:
            if isinstance(obj, BUFFERED) and not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001, S112 - a broken file must not keep the process alive
            continue
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001, S112
            continue
