"""The append-only audit log of operator actions: `<job-dir>/audit.log`, one JSON object per line.

Why: recovery actions kill processes and change what a job resumes from; the operator on call next
must be able to read who did what, when, with which outcome, even after a crash mid-action. Each
record is ONE `os.write` on an `O_APPEND` descriptor (never a read-modify-write, never truncated), so
concurrent writers never interleave inside a line and a crash can only leave a torn *last* line,
which readers skip and count. Runbook resumption reads the same log.
"""

from __future__ import annotations

import errno
import getpass
import json
import os
import socket
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.foundation.boundedread import AUDIT_LOG_BYTES, parse_json, read_lines
from gpuguard.foundation.errors import EXIT_CANTCREAT, GpuguardError, NoInputError, from_os_error
from gpuguard.foundation.jobdir import audit_log_path, refuse_linked_dir

SCHEMA = "gpuguard.audit/1"
MAX_RECORD_BYTES = 64 * 1024  # one line; details beyond this are cut, never the record


@dataclass(frozen=True)
class AuditRecord:
    action: str
    outcome: str
    exit_code: int
    time: float
    user: str
    host: str
    pid: int
    args: Mapping[str, Any] = field(default_factory=dict)
    dry_run: bool = False
    run_id: str | None = None  # a runbook run this action belongs to
    step: str | None = None  # the runbook step name
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "time": self.time,
            "user": self.user,
            "host": self.host,
            "pid": self.pid,
            "action": self.action,
            "args": dict(self.args),
            "dry_run": self.dry_run,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "run_id": self.run_id,
            "step": self.step,
            "detail": dict(self.detail),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> AuditRecord:
        return cls(
            action=str(doc["action"]),
            outcome=str(doc["outcome"]),
            exit_code=int(doc["exit_code"]),
            time=float(doc["time"]),
            user=str(doc.get("user", "")),
            host=str(doc.get("host", "")),
            pid=int(doc.get("pid", 0)),
            args=dict(doc.get("args") or {}),
            dry_run=bool(doc.get("dry_run")),
            run_id=doc.get("run_id"),
            step=doc.get("step"),
            detail=dict(doc.get("detail") or {}),
        )


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def new_record(
    action: str,
    outcome: str,
    exit_code: int,
    *,
    args: Mapping[str, Any] | None = None,
    dry_run: bool = False,
    run_id: str | None = None,
    step: str | None = None,
    detail: Mapping[str, Any] | None = None,
) -> AuditRecord:
    return AuditRecord(
        action,
        outcome,
        int(exit_code),
        time.time(),
        _who(),
        socket.gethostname(),
        os.getpid(),
        dict(args or {}),
        dry_run,
        run_id,
        step,
        dict(detail or {}),
    )


def encode(record: AuditRecord) -> bytes:
    """One line; an oversized detail is replaced by a note (the record itself is never dropped)."""
    line = json.dumps(record.to_dict(), sort_keys=True, default=str, separators=(",", ":"))
    if len(line) >= MAX_RECORD_BYTES:
        doc = record.to_dict()
        doc["detail"] = {"truncated": True, "bytes": len(line)}
        line = json.dumps(doc, sort_keys=True, default=str, separators=(",", ":"))
    return (line + "\n").encode()


def append(job_dir: str | Path, record: AuditRecord) -> None:
    """Append one record with one write (O_APPEND); fsync so it survives a crash right after."""
    data = encode(record)
    with _opened(job_dir) as (fd, path):
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a crash left a torn last line: never glue a record onto it
            os.write(fd, data)
            os.fsync(fd)
        except OSError as exc:
            raise from_os_error(exc, str(path)) from exc


def check_writable(job_dir: str | Path) -> None:
    """Raise now (73) if `append` could not write the record: a mutating action checks this before it
    changes anything, so it never acts and then fails to say so (a linked audit.log used to let
    `restore --yes` pin first, then exit 74). Creates the log if it is missing; writes nothing."""
    with _opened(job_dir):
        pass


@contextmanager
def _opened(job_dir: str | Path) -> Iterator[tuple[int, Path]]:
    """The audit log opened for appending: never through a link (the file or its folder), never a
    FIFO or device (a write could block for ever or go anywhere)."""
    path = audit_log_path(job_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        refuse_linked_dir(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise GpuguardError(
                f"{path}: is a symbolic link: refusing to write the audit record through it", exit_code=EXIT_CANTCREAT
            ) from None
        raise from_os_error(exc, str(path)) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise GpuguardError(
                f"{path}: not a regular file: refusing to write the audit record into it", exit_code=EXIT_CANTCREAT
            )
        yield fd, path
    finally:
        os.close(fd)


@dataclass(frozen=True)
class AuditLog:
    records: tuple[AuditRecord, ...]
    skipped_lines: int = 0  # torn or foreign lines (a crash mid-write leaves at most the last one)


def read(job_dir: str | Path) -> AuditLog:
    """Every well-formed record, oldest first; a missing log is an empty one."""
    try:  # bounded: no link, no FIFO, at most AUDIT_LOG_BYTES, an overlong line one skipped line
        data = read_lines(audit_log_path(job_dir), max_bytes=AUDIT_LOG_BYTES, what="an audit log")
    except NoInputError:
        return AuditLog(())
    records, skipped = [], 0
    for line in _lines(data):
        try:
            doc = parse_json(line)
            if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
                raise ValueError("not an audit record")
            records.append(AuditRecord.from_dict(doc))
        except (ValueError, KeyError, TypeError):
            skipped += 1
    return AuditLog(tuple(records), skipped)


def _lines(data: bytes) -> Iterator[str]:
    for raw in data.split(b"\n"):
        if raw.strip():
            yield raw.decode("utf-8", "replace")
