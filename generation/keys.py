"""The job's signing key: 32 random bytes in `<job-dir>/generation.key`, mode 0600, never overwritten.

HMAC-SHA256 with this key signs every certificate. Whoever can read the key can issue
certificates, so it is created owner-only and exclusively (O_EXCL): a second `init` can never
replace the key that signed the existing chain. It is read the same way it is trusted: never
through a link, refused when others can read or write it, and refused as root when another user
owns it (a key planted by someone else would let them forge the job's history).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat

from gpuguard.foundation.errors import (
    EXIT_CANTCREAT,
    DataError,
    GpuguardError,
    NoInputError,
    PermissionDeniedError,
    from_os_error,
)
from gpuguard.foundation.jobdir import KEY_FILE, check_root_safe_dir, key_path

__all__ = [
    "KEY_BYTES",
    "KEY_FILE",
    "create_key",
    "create_key_file",
    "key_path",
    "load_key",
    "read_key_file",
    "sign",
    "signature_ok",
]
KEY_BYTES = 32


def create_key(job_dir: str | os.PathLike[str]) -> bytes:
    """Create the job key (0600, exclusive). Refuses if a key already exists."""
    check_root_safe_dir(job_dir, "job dir")  # as root, never create a key in a directory another user controls
    return create_key_file(key_path(job_dir), "a signing key")


def create_key_file(path: str | os.PathLike[str], what: str = "a key") -> bytes:
    """32 random bytes, hex, in a new file `path` (0600, exclusive, never through a link)."""
    key = secrets.token_bytes(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except FileExistsError:
        raise GpuguardError(
            f"{path}: {what} already exists (refusing to overwrite it)", exit_code=EXIT_CANTCREAT
        ) from None
    except OSError as exc:
        raise from_os_error(exc, str(path)) from None
    try:
        os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
        os.write(fd, key.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def load_key(job_dir: str | os.PathLike[str]) -> bytes:
    """Read the job key; a missing, unreadable or malformed key is a one-line error; run as root, a
    key in a directory another user controls (or group/others may write) is refused (77)."""
    path = key_path(job_dir)
    if os.path.isdir(job_dir):
        check_root_safe_dir(job_dir, "job dir")
    return read_key_file(
        path, "the signing key", "whoever can read it can issue certificates", "run `gpu-generation init`"
    )


def read_key_file(path: str | os.PathLike[str], what: str, why_private: str, missing_hint: str) -> bytes:
    """32 bytes, hex, from a file trusted as a secret: never through a link, a regular file only,
    owner-only (mode 0600) and owned by the user reading it (as root: by root). Each refusal is one
    line naming `what`; `why_private` says what a reader of the secret could do."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NoInputError(f"{path}: no {what.removeprefix('the ')} ({missing_hint})") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataError(f"{path}: {what} is a symbolic link: refusing to follow it") from None
        raise from_os_error(exc, str(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{path}: {what} is not a regular file")
        if st.st_mode & 0o077:
            raise PermissionDeniedError(
                f"{path}: {what} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"{why_private}; fix with `chmod 600 {path}`"
            )
        if st.st_uid != os.geteuid():
            root = " while running as root" if os.geteuid() == 0 else ""
            raise PermissionDeniedError(
                f"{path}: owned by uid {st.st_uid}{root}: refusing another user's key "
                f"(run as that user, or `chown {'root' if root else os.geteuid()} {path}` if it is yours)"
            )
        text = os.read(fd, 4096).decode("ascii", "replace").strip()
    except OSError as exc:
        raise from_os_error(exc, str(path)) from None
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise DataError(f"{path}: {what} is not hex") from None
    if len(key) != KEY_BYTES:
        raise DataError(f"{path}: {what} has {len(key)} bytes, expected {KEY_BYTES}")
    return key


def sign(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def signature_ok(key: bytes, message: bytes, signature: str) -> bool:
    """Constant-time comparison (hmac.compare_digest)."""
    return hmac.compare_digest(sign(key, message), signature)
