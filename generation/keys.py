"""The job's signing key: 32 random bytes in `<job-dir>/generation.key`, mode 0600, never overwritten.

HMAC-SHA256 with this key signs every certificate. Whoever can read the key can issue
certificates, so it is created owner-only and exclusively (O_EXCL): a second `init` can never
replace the key that signed the existing chain.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from gpuguard.foundation.errors import EXIT_CANTCREAT, DataError, GpuguardError, NoInputError, from_os_error

KEY_FILE = "generation.key"
KEY_BYTES = 32


def key_path(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / KEY_FILE


def create_key(job_dir: str | os.PathLike[str]) -> bytes:
    """Create the job key (0600, exclusive). Refuses if a key already exists."""
    path = key_path(job_dir)
    key = secrets.token_bytes(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise GpuguardError(
            f"{path}: a signing key already exists (refusing to overwrite it)", exit_code=EXIT_CANTCREAT
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
    """Read the job key; a missing, unreadable or malformed key is a one-line error."""
    path = key_path(job_dir)
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise NoInputError(f"{path}: no signing key (run `gpu-generation init`)") from None
    except OSError as exc:
        raise from_os_error(exc, str(path)) from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise DataError(f"{path}: signing key is not hex") from None
    if len(key) != KEY_BYTES:
        raise DataError(f"{path}: signing key has {len(key)} bytes, expected {KEY_BYTES}")
    return key


def sign(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def signature_ok(key: bytes, message: bytes, signature: str) -> bool:
    """Constant-time comparison (hmac.compare_digest)."""
    return hmac.compare_digest(sign(key, message), signature)
