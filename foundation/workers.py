"""Forked worker processes, each item under a deadline of its own: the one way to bound a load of
untrusted input in time when the slow part is a C loop (a pickle whose dict key is a shared-reference
tuple DAG is hashed inside the C unpickler: no signal handler, thread or hook interrupts it; only
killing the process that runs it does). See `foundation.unpickle` for the bound on size.

Not for the pure judges (diagnostics import foundation.unpickle, never this: clock and processes).
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from gpuguard.foundation.unpickle import Refused, load_deadline, restricted_loads

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import ForkProcess

R = TypeVar("R")

_IN_FLIGHT = 2
"""Items queued to a worker at once (the next one is there when it finishes; the deadline of the
second starts when the first's result arrives)."""


@dataclass(frozen=True)
class Overdue:
    """An item whose worker passed the item's deadline (and was killed) or died while on it."""

    seconds: float
    """The deadline that applied."""
    reason: str
    """In words: "took more than 1.0 s" or "its reader process died (signal 9)"."""


@dataclass(frozen=True)
class Done(Generic[R]):
    """One item's result: `value` is what `fn` returned, or `Overdue`; `worker` names the worker
    process that ran it (a new number for each one started), for state a worker builds up."""

    index: int
    worker: int
    value: R | Overdue


@dataclass
class _Worker:
    serial: int
    proc: ForkProcess
    conn: Connection
    queued: deque[int] = field(default_factory=deque)
    since: float = 0.0


def map_with_deadlines(
    fn: Callable[[int], R], deadlines: Sequence[float], *, jobs: int = 1
) -> Generator[Done[R], None, None]:
    """`fn(i)` for every index of `deadlines`, in `jobs` forked worker processes, in completion order.

    An item still running `deadlines[i]` seconds after it started gets its worker killed (SIGKILL:
    nothing else stops a C loop) and is `Overdue`; so is an item whose worker died; the items
    queued behind it go to a new worker. `fn` runs in the child (a closure is fine: fork copies it),
    so what it returns crosses a pipe (picklable); an exception in it is raised here as a
    RuntimeError naming the item. Workers ignore SIGINT (the parent's Ctrl-C ends them) and none
    outlives the generator.
    """
    import multiprocessing  # noqa: PLC0415 - start-up time: only readers of many files fork
    from multiprocessing.connection import wait  # noqa: PLC0415

    ctx = multiprocessing.get_context("fork")
    todo = deque(range(len(deadlines)))
    live: dict[Any, _Worker] = {}
    serials = iter(range(1 << 62))

    def start() -> None:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(fn, child), daemon=True)
        proc.start()
        child.close()
        w = _Worker(next(serials), proc, parent, since=time.monotonic())
        live[parent] = w
        feed(w)

    def feed(w: _Worker) -> None:
        while todo and len(w.queued) < _IN_FLIGHT:
            i = todo.popleft()
            w.queued.append(i)
            try:
                w.conn.send(i)
            except OSError:  # it died: its end of the pipe reads EOF next, and its items go back
                return

    def drop(w: _Worker, why: str) -> Done[R]:
        i = w.queued.popleft()
        todo.extendleft(reversed(w.queued))
        del live[w.conn]
        _stop(w)
        return Done(i, w.serial, Overdue(deadlines[i], why))

    try:
        while todo or live:
            while todo and len(live) < jobs:
                start()
            now = time.monotonic()
            due = min(w.since + deadlines[w.queued[0]] for w in live.values())
            for conn in wait(list(live), timeout=max(0.0, due - now)):
                w = live[conn]
                try:
                    i, ok, value = w.conn.recv()
                except (EOFError, OSError):
                    w.proc.join(5)
                    code = w.proc.exitcode
                    what = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
                    yield drop(w, f"its reader process died ({what})")
                    continue
                w.queued.popleft()
                w.since = time.monotonic()
                if not ok:
                    raise RuntimeError(f"a reader process failed on item {i}: {value}")
                feed(w)
                if not w.queued:
                    del live[w.conn]
                    _stop(w, kill=False)
                yield Done(int(i), w.serial, value)
            now = time.monotonic()
            late = [w for w in live.values() if now >= w.since + deadlines[w.queued[0]] and not w.conn.poll(0)]
            for w in late:  # (a result already in the pipe is read at the next wait, never killed)
                yield drop(w, f"took more than {deadlines[w.queued[0]]:.1f} s")
    finally:
        for w in list(live.values()):
            _stop(w)


def _serve(fn: Callable[[int], Any], conn: Connection) -> None:
    """A worker: run `fn` on each index received until None or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            i = conn.recv()
        except (EOFError, OSError):
            return
        if i is None:
            return
        try:
            out = (i, True, fn(i))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            out = (i, False, f"{type(exc).__name__}: {str(exc)[:200]}")
        try:
            conn.send(out)
        except OSError:  # the parent is gone
            return
        except Exception as exc:  # noqa: BLE001 - a result that does not pickle: say so, do not die
            conn.send((i, False, f"its result cannot be sent back: {type(exc).__name__}: {str(exc)[:200]}"))


def _stop(w: _Worker, *, kill: bool = True) -> None:
    if kill:
        w.proc.kill()
    else:
        try:
            w.conn.send(None)
        except OSError:
            w.proc.kill()
    w.proc.join(5)
    if w.proc.exitcode is None:  # pragma: no cover - a worker that ignores its exit request
        w.proc.kill()
        w.proc.join()
    w.conn.close()
    w.proc.close()


LOAD_WALL_FACTOR = 30
"""`restricted_loads_within` gives up on a child that has not finished within this many times its CPU
deadline of wall time (stopped, or starved of CPU), however little CPU it used."""
_CPU_POLL_S = 0.02


def _cpu_seconds(proc: Any) -> float:
    try:
        t = proc.cpu_times()
    except Exception:  # noqa: BLE001 - psutil.Error: gone or a zombie; its result is in the pipe
        return 0.0
    return float(t.user + t.system)


def restricted_loads_within(
    data: bytes, resolve: Callable[[str, str], Any] | None = None, *, what: str = "this pickle"
) -> Any:
    """`unpickle.restricted_loads` in a forked child, killed once it has used
    `unpickle.load_deadline(len(data))` seconds of CPU (or `LOAD_WALL_FACTOR` times that of wall time).

    For an untrusted pickle read one at a time (DCP metadata, rendezvous state): the load's own
    refusals and errors are raised here as they are (`unpickle.Refused`, `pickle.UnpicklingError`,
    ...); a load that does not finish in time (a dict key built from shared references, hashed
    without end inside the C load) is `unpickle.Refused` too. The loaded object comes back through
    a pipe, so it must pickle (the admitted classes do).

    CPU time, not wall time: the attack burns CPU, a real state needs milliseconds of it, and on a
    loaded host (16 rendezvous agents forking at once on 2 cores) a wall-clock second refused real
    states. A bare `os.fork`, not `multiprocessing`: a daemonic process (a forked rendezvous agent)
    may not start multiprocessing children, and a torch-sized process forks in 10-30 ms, which the
    multiprocessing machinery would add to. The parent waits in `select`, so a Ctrl-C ends the
    wait at once (the child is killed in the `finally`)."""
    import pickle  # noqa: PLC0415 - start-up time: only readers of untrusted pickles fork
    import select  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    deadline = load_deadline(len(data))
    r, w = os.pipe()
    with warnings.catch_warnings():  # 3.12+ warns on fork with threads: the child only loads and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: load, send (ok, value), exit without running any of the parent's cleanup
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.close(r)
            try:
                out: tuple[bool, Any] = (True, restricted_loads(data, resolve, what=what))
            except Exception as exc:  # noqa: BLE001 - raised again in the parent
                out = (False, exc)
            try:
                payload = pickle.dumps(out)
            except Exception as exc:  # noqa: BLE001 - a result or error that does not pickle
                payload = pickle.dumps((False, RuntimeError(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")))
            view = memoryview(payload)
            while view:
                view = view[os.write(w, view) :]
        finally:
            os._exit(0)
    os.close(w)
    chunks: list[bytes] = []
    wall_end = time.monotonic() + LOAD_WALL_FACTOR * deadline
    try:
        try:
            child: Any = psutil.Process(pid)
        except psutil.Error:
            child = None
        while True:
            if select.select([r], [], [], _CPU_POLL_S)[0]:
                chunk = os.read(r, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                continue
            if child is not None and _cpu_seconds(child) > deadline:
                raise Refused(
                    f"{what}: loading it took more than {deadline:.1f} s of CPU (a shared-reference dict key or set member?)"
                )
            if time.monotonic() > wall_end:
                raise Refused(f"{what}: loading it did not finish within {LOAD_WALL_FACTOR * deadline:.0f} s")
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    if not chunks:
        raise Refused(f"{what}: its reader process died")
    ok, value = pickle.loads(b"".join(chunks))  # written by our own child from admitted objects only
    if not ok:
        raise value
    return value
