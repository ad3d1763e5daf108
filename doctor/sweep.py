"""What `gpu-doctor sweep` keeps between cron runs: the state directory, retained events, the lock.

A sweep runs every few minutes on every node and must judge more than the lines it read this time:
a GPU that fell off the bus an hour ago is still gone. So each sweep keeps, in one state file
(`gpuguard.sweep-state/1`, written atomically, mode 0600), the kernel-log cursor, the recent
kernel-log events (each remembered for `retain_s` after the sweep that saw it, bounded per GPU and
code so an Xid storm cannot grow it), the running Xid totals and the last verdict. One sweep per
state directory at a time (`SweepLock`): an overlapping cron run must not read the same lines twice
or overwrite the other's cursor. It writes state, so it is an actor; the CLI only calls it.

The state directory is never a link, is created one level at most (mode 0700; its parent must
exist, unless it is the default location), and, run as root, must be root's and not writable by
group or others (`prepare_state_dir`); the state file and the lock are opened without following a
link, and the state file is read only if it is a regular file of at most `MAX_STATE_BYTES`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, TypedDict

from gpuguard.collectors.kernel_log import Cursor, parse_cursor
from gpuguard.foundation.env import STATE_DIR_ENV
from gpuguard.foundation.errors import (
    EXIT_CANTCREAT,
    EXIT_IOERR,
    DataError,
    GpuguardError,
    NoInputError,
    UnavailableError,
    from_os_error,
)
from gpuguard.foundation.events import Event
from gpuguard.foundation.jobdir import atomic_write_bytes, check_root_safe_dir

STATE_SCHEMA = "gpuguard.sweep-state/1"
STATE_FILE = "sweep-state.json"
LOCK_FILE = "sweep.lock"
RETAINED_KINDS = ("xid", "sxid", "gpu_lost", "gpu_fault")  # the kernel-log events the node verdict counts
MAX_HISTORY = 2000
MAX_STATE_BYTES = 16 << 20  # MAX_HISTORY records of at most ~1 KB each, with room to spare
PER_CODE_HISTORY = 20  # per GPU and Xid code: enough for every repeat rule, bounded under an Xid storm


class SweepState(TypedDict):
    """The state file's document, as loaded (the cursor parsed) and as saved."""

    schema: str
    cursor: Cursor | None
    events: list[dict[str, Any]]  # retained event records, oldest first (see `event_record`)
    xid_totals: dict[str, int]  # "<pci_bus_id>|<xid>" -> every Xid ever seen, beyond the retained ones
    last_verdict: str | None
    last_identity: dict[str, Any] | None  # the boot and evidence range of the last verdict (None: unknown)


@dataclass(frozen=True)
class Retained:
    """The outcome of one sweep's retention step."""

    state: SweepState  # the state to save: events kept, totals counted, cursor moved on
    events: tuple[Event, ...]  # every retained event, for the judge
    new_events: int  # how many of them this sweep's read added


def default_state_dir() -> Path:
    """$GPUGUARD_STATE_DIR, else /var/lib/gpuguard as root, else $XDG_STATE_HOME/gpuguard (~/.local/state/gpuguard)."""
    env = os.environ.get(STATE_DIR_ENV)
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/gpuguard")
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "gpuguard"


def prepare_state_dir(path: Path, *, create_parents: bool = False) -> Path:
    """The state directory, made safe to write: 65 a link, 66 its parent missing (never created,
    unless `create_parents`: the default location), 73 not a directory, 77 as root another user's or
    group/world-writable. Created with mode 0700 when missing."""
    if os.path.islink(path):
        raise DataError(f"state dir {path}: is a symbolic link: refusing to write through it")
    if not os.path.lexists(path):
        if not create_parents and not path.parent.is_dir():
            raise NoInputError(f"state dir {path}: no directory {path.parent} (it is not created for you)")
        try:
            path.mkdir(mode=0o700, parents=create_parents, exist_ok=True)
        except OSError as exc:
            raise from_os_error(exc, f"state dir {path}") from None
    if not path.is_dir() or os.path.islink(path):
        raise GpuguardError(f"state dir {path}: not a directory", exit_code=EXIT_CANTCREAT)
    check_root_safe_dir(path, "state dir")
    return path


def empty_state() -> SweepState:
    return {
        "schema": STATE_SCHEMA,
        "cursor": None,
        "events": [],
        "xid_totals": {},
        "last_verdict": None,
        "last_identity": None,
    }


def load_state(path: Path) -> tuple[SweepState, list[str]]:
    """The saved state and notes for the user; a missing file is a first run, a damaged one starts over.

    Only an unreadable file (permissions, I/O) raises, as the matching GpuguardError.
    """
    notes: list[str] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return empty_state(), notes
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataError(f"sweep state {path}: is a symbolic link: refusing to follow it") from None
        raise from_os_error(exc, f"sweep state {path}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise GpuguardError(f"sweep state {path}: is a directory", exit_code=EXIT_IOERR)
        if not stat.S_ISREG(mode):
            raise DataError(f"sweep state {path}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read(MAX_STATE_BYTES + 1)
    except OSError as exc:
        raise from_os_error(exc, f"sweep state {path}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_STATE_BYTES:
        notes.append(f"sweep state {path} is over {MAX_STATE_BYTES >> 20} MiB: starting over from the start of the log")
        return empty_state(), notes
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("schema") != STATE_SCHEMA:
            raise DataError("not a gpuguard.sweep-state/1 document")
        cursor = parse_cursor(json.dumps(doc["cursor"]), "cursor") if doc.get("cursor") else None
        events = [r for r in map(clean_record, doc.get("events") or []) if r is not None]
        totals = {str(k): int(v) for k, v in (doc.get("xid_totals") or {}).items()}
    except (ValueError, TypeError, AttributeError, OverflowError, DataError) as exc:
        notes.append(f"sweep state {path} unreadable ({str(exc)[:80]}): starting over from the start of the log")
        return empty_state(), notes
    last = doc.get("last_verdict")
    identity = doc.get("last_identity")
    return {
        "schema": STATE_SCHEMA,
        "cursor": cursor,
        "events": events,
        "xid_totals": totals,
        "last_verdict": last,
        "last_identity": _scalar_fields(identity) if isinstance(identity, dict) else None,
    }, notes


def save_state(path: Path, state: SweepState) -> None:
    """Write the state file atomically (mode 0600): a crash leaves the old state or the new one."""
    cursor = state.get("cursor")
    doc = {
        "schema": STATE_SCHEMA,
        "cursor": cursor.to_json() if cursor else None,
        "events": state["events"],
        "xid_totals": state["xid_totals"],
        "last_verdict": state.get("last_verdict"),
        "last_identity": state.get("last_identity"),
    }
    try:
        atomic_write_bytes(path, (json.dumps(doc, default=str) + "\n").encode(), mode=0o600)
    except OSError as exc:
        raise from_os_error(exc, f"sweep state {path}") from None


def retain(
    state: SweepState,
    read: Iterable[Event],
    *,
    cursor: Cursor | None,
    now: float,
    retain_s: float,
    identity: Callable[[Event], Mapping[str, str]] | None = None,
) -> Retained:
    """Forget events older than `retain_s`, add the ones this sweep read, count their Xids, move the cursor.

    `read` is everything the kernel-log read returned; only `RETAINED_KINDS` are kept. `cursor` None
    (a source without one) keeps the old cursor. `identity`: the fields that say whom a new event was
    seen with (the boot, its GPU's UUID and serial: `diagnostics.node_identity.seen_with`), kept with it
    so a later sweep can tell it stale. `state` is not changed.
    """
    kept = [r for r in state["events"] if (r.get("seen_at") or now) >= now - retain_s]
    fresh = [e for e in read if e.kind in RETAINED_KINDS]
    if identity is not None:
        fresh = [replace(e, fields={**e.fields, **identity(e)}) for e in fresh]
    totals = dict(state["xid_totals"])
    for e in fresh:
        if e.kind == "xid" and isinstance(e.fields.get("xid"), int):
            key = f"{e.fields.get('pci_bus_id') or ''}|{e.fields['xid']}"
            totals[key] = totals.get(key, 0) + 1
    kept.extend(event_record(e, now) for e in fresh)
    records = cap_history(kept)
    new_state: SweepState = {
        **state,
        "events": records,
        "xid_totals": totals,
        "cursor": cursor if cursor is not None else state["cursor"],
    }
    return Retained(new_state, tuple(event_from_record(r) for r in records), len(fresh))


def cap_history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest PER_CODE_HISTORY records per (GPU, kind, code), at most MAX_HISTORY, in log order.

    An Xid storm (thousands of Xid 13 a day) must not make every later sweep slower; the exact
    counts live on in `xid_totals`.
    """
    seen: dict[tuple[Any, ...], int] = {}
    keep: list[dict[str, Any]] = []
    for rec in reversed(records):
        fields = rec.get("fields") or {}
        key = (fields.get("pci_bus_id"), rec.get("kind"), fields.get("xid"), fields.get("sxid"))
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= PER_CODE_HISTORY:
            keep.append(rec)
            if len(keep) >= MAX_HISTORY:
                break
    keep.reverse()
    return keep


def _scalar_fields(fields: Any) -> dict[str, Any]:
    return {str(k): v for k, v in dict(fields).items() if isinstance(v, (str, int, float, bool, type(None)))}


def event_record(event: Event, seen_at: float) -> dict[str, Any]:
    """An event as the state file keeps it (text and diagnosis cut short, scalar fields only)."""
    return {
        "kind": event.kind,
        "line": event.line,
        "text": (event.text or "")[:400],
        "fields": _scalar_fields(event.fields),
        "timestamp": event.timestamp,
        "source": event.source,
        "severity": event.severity,
        "diagnosis": (event.diagnosis or "")[:200],
        "seen_at": seen_at,
    }


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    return float(value) if ok else None


def clean_record(rec: Any) -> dict[str, Any] | None:
    """A retained event as the state file holds it, or None when it is not one (a damaged file)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
        return None
    line = rec.get("line")
    fields = rec.get("fields") if isinstance(rec.get("fields"), dict) else {}
    return {
        "kind": rec["kind"],
        "line": line if isinstance(line, int) and not isinstance(line, bool) and line >= 0 else 0,
        "text": str(rec.get("text") or "")[:400],
        "fields": _scalar_fields(fields),
        "timestamp": _number(rec.get("timestamp")),
        "source": rec.get("source") if isinstance(rec.get("source"), str) else None,
        "severity": str(rec.get("severity") or "info"),
        "diagnosis": str(rec.get("diagnosis") or "")[:200],
        "seen_at": _number(rec.get("seen_at")),
    }


def event_from_record(rec: dict[str, Any]) -> Event:
    """The event a retained record stands for, for the judge."""
    return Event(
        kind=rec["kind"],
        line=int(rec.get("line") or 0),
        text=str(rec.get("text") or ""),
        fields=dict(rec.get("fields") or {}),
        timestamp=rec.get("timestamp"),
        source=rec.get("source"),
        severity=str(rec.get("severity") or "info"),
        diagnosis=str(rec.get("diagnosis") or ""),
    )


class SweepLock:
    """One sweep per state directory at a time: an exclusive flock on `<state-dir>/sweep.lock`.

    Waits up to `wait` seconds for another sweep to finish, then raises UnavailableError (exit 75);
    the lock is released when the file is closed, so a killed sweep never leaves it held.
    """

    def __init__(self, state_dir: Path, wait: float, *, create_parents: bool = False) -> None:
        self.path = state_dir / LOCK_FILE
        self.wait = wait
        self.create_parents = create_parents
        self.fd: int | None = None

    def __enter__(self) -> SweepLock:
        prepare_state_dir(self.path.parent, create_parents=self.create_parents)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise DataError(f"sweep lock {self.path}: is a symbolic link: refusing to follow it") from None
            raise from_os_error(exc, f"sweep lock {self.path}") from None
        deadline = time.monotonic() + self.wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.fd = fd
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise UnavailableError(f"another sweep holds {self.path} (waited {self.wait:g} s)") from None
                time.sleep(0.05)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None
