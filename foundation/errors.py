"""One error type and one exit-code table shared by all three commands.

Every failure the user can cause or meet (bad input, missing files, unreachable stores, refused
rules) is a `GpuguardError` carrying the exit code documented in README.md, so the CLI prints one
line on stderr and exits with that code instead of a traceback.
"""

from __future__ import annotations

import errno

# Health results (Nagios / node-problem-detector conventions).
EXIT_OK = 0
EXIT_WARNING = 1  # also: a finding (contract broken, verification failed on a non-fatal rule)
EXIT_CRITICAL = 2
EXIT_UNKNOWN = 3
# Decisions.
EXIT_REFUSED = 4  # a rule refused the action (activation refused, not confirmed, fenced)
# Failures, from sysexits.h so they never collide with the health codes above.
EXIT_USAGE = 64  # bad command line
EXIT_DATAERR = 65  # input present but malformed, truncated, tampered
EXIT_NOINPUT = 66  # input file / job dir / ledger missing
EXIT_UNAVAILABLE = 69  # a feature's optional dependency is not installed (torch: gpuguard[runtime])
EXIT_SOFTWARE = 70  # a bug in gpuguard (an exception nobody expected)
EXIT_CANTCREAT = 73  # output cannot be created
EXIT_IOERR = 74  # read/write failed
EXIT_TEMPFAIL = 75  # timeout, service unreachable: try again later
EXIT_NOPERM = 77  # permission denied
EXIT_INTERRUPTED = 130

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "ok / healthy / contract holds / verified",
    EXIT_WARNING: "warning (degraded) or a finding (contract broken)",
    EXIT_CRITICAL: "critical (drain/reset/dead) or verification failed",
    EXIT_UNKNOWN: "unknown: state could not be determined (no driver, no records)",
    EXIT_REFUSED: "refused by a rule (activation, fencing, confirmation missing)",
    EXIT_USAGE: "usage error (bad command line or config)",
    EXIT_DATAERR: "input malformed, truncated or tampered",
    EXIT_NOINPUT: "input missing (file, job dir, ledger, key)",
    EXIT_UNAVAILABLE: "a needed optional dependency is not installed (torch: pip install 'gpuguard[runtime]')",
    EXIT_SOFTWARE: "internal error in gpuguard (a bug: please report)",
    EXIT_CANTCREAT: "output cannot be created",
    EXIT_IOERR: "I/O error",
    EXIT_TEMPFAIL: "timed out or service unreachable (etcd, store, probe)",
    EXIT_NOPERM: "permission denied",
    EXIT_INTERRUPTED: "interrupted",
}


class GpuguardError(Exception):
    """An expected failure: one line for the user, one documented exit code."""

    exit_code = EXIT_SOFTWARE

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(GpuguardError):
    exit_code = EXIT_USAGE


class DataError(GpuguardError):
    """Malformed, truncated or tampered input."""

    exit_code = EXIT_DATAERR


class NoInputError(GpuguardError):
    exit_code = EXIT_NOINPUT


class UnavailableError(GpuguardError):
    """A service or probe did not answer within its timeout."""

    exit_code = EXIT_TEMPFAIL


class MissingDependencyError(GpuguardError):
    """A feature needs an optional dependency that is not installed (torch for the runtime)."""

    exit_code = EXIT_UNAVAILABLE


class RefusedError(GpuguardError):
    """A rule refused the action (e.g. certificate activation)."""

    exit_code = EXIT_REFUSED


class PermissionDeniedError(GpuguardError):
    exit_code = EXIT_NOPERM


def from_os_error(exc: OSError, what: str) -> GpuguardError:
    """Translate an OSError into a one-line GpuguardError with the matching exit code."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDeniedError(f"{what}: permission denied")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return NoInputError(f"{what}: no such file or directory")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return GpuguardError(f"{what}: no space left", exit_code=EXIT_CANTCREAT)
    return GpuguardError(f"{what}: {reason}", exit_code=EXIT_IOERR)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, the one way a caught exception is shortened for a log or a record.

    A message that carries a whole traceback (DCP's CheckpointException does) is summed up by its
    last line, which says what went wrong; any other message by its first (gloo's, for one, puts the
    cause first and the C++ frames after it)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    line = lines[-1] if "Traceback (most recent call last)" in str(exc) else lines[0]
    return f"{type(exc).__name__}: {line[:limit]}"
