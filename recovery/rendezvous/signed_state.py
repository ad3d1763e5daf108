"""The signed rendezvous state: the only bytes under `<prefix>/<run id>/state` that reach torch.

Why: torch's `_BackendRendezvousStateHolder.sync` hands what the backend's `get_state` returns to
plain `pickle.loads`, inside every agent. A value planted under the run's key ran `os.system` in
every agent, and a 572-byte shared-reference DAG hung them all. So every state the `gpuguard`
backend writes is sealed with a MAC under the job's rendezvous secret, and `get_state` refuses a
value that is not validly sealed before torch sees it (never unpickled). A sealed value is loaded
once more by the restricted unpickler in a forked worker with a deadline
(`recovery.rendezvous.state.load_state`) before torch gets it, so not even a holder of the secret
can hand torch code or a DAG. docs/rendezvous-etcd.md has the wire format.

    value = MAGIC SP hex(MAC) SP body                             (ASCII, no newline)
    body  = base64(pickle)          (torch's own c10d store value, so every reader decodes it alike)
    MAGIC = "gpuguard-rdzv-state/1"
    MAC   = HMAC-SHA256(K, MAGIC || 0x00 || etcd key || 0x00 || body)
    K     = HMAC-SHA256(secret, "gpuguard rendezvous state key/1")

The etcd key (`<prefix>/<run id>/state`) is under the MAC, so a state sealed for one run cannot be
replayed into another run of the same job. K is derived, so the secret may be the job's signing
key without one key ever signing two kinds of message.

Where the secret comes from (`rendezvous_secret`), first found wins:
  1. `--rdzv-conf secret_file=PATH`: 32 bytes as 64 hex characters (the format of the job's
     `generation.key`), read as a secret is (never through a link, mode 0600, our own file);
  2. the job dir's `generation.key`: `job_dir` given (the operator's `--job-dir`), else
     `$GPUGUARD_JOB_DIR` (a deployment hands the key to every host already: README "Across hosts").
Without one, the backend refuses to start, in one line: there is no unsigned mode.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from gpuguard.foundation.env import JOB_DIR_ENV
from gpuguard.foundation.errors import DataError, UsageError
from gpuguard.generation.keys import create_key_file, key_path, load_key, read_key_file

MAGIC = b"gpuguard-rdzv-state/1"
KEY_LABEL = b"gpuguard rendezvous state key/1"
MAX_VALUE_BYTES = 4 << 20
"""No sealed state is larger (etcd refuses requests over 1.5 MiB by default): a bigger value is refused unread."""
SECRET_FILE_CONF = "secret_file"
NO_SECRET = (
    "the gpuguard rendezvous needs the job's rendezvous secret to sign its state: "
    f"--rdzv-conf {SECRET_FILE_CONF}=PATH (a 0600 file of 64 hex characters, e.g. the job's generation.key) "
    f"or {JOB_DIR_ENV} naming a job dir with its generation.key"
)


class ForeignState(DataError):
    """A value under the state key that was not sealed with this job's rendezvous secret."""


def derive_key(secret: bytes) -> bytes:
    """The MAC key K: derived, so the job's signing key can be the secret without signing states itself."""
    return hmac.new(secret, KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, etcd_key: bytes, body: bytes) -> bytes:
    return hmac.new(key, MAGIC + b"\0" + etcd_key + b"\0" + body, hashlib.sha256).digest()


def seal(key: bytes, etcd_key: bytes, body: bytes) -> bytes:
    """The value to store under `etcd_key` for `body` (the state as `base64(pickle)`; K from `derive_key`)."""
    return MAGIC + b" " + _mac(key, etcd_key, body).hex().encode() + b" " + body


def unseal(key: bytes, etcd_key: bytes, value: bytes) -> bytes:
    """The body a sealed `value` holds, exactly as sealed; `ForeignState` (one line, nothing of the
    body decoded) when it is not sealed under `key` for `etcd_key`."""
    if len(value) > MAX_VALUE_BYTES:
        raise ForeignState(f"a value of {len(value):,} bytes, over the {MAX_VALUE_BYTES:,}-byte cap of a state")
    magic, _, rest = value.partition(b" ")
    if magic != MAGIC:
        raise ForeignState(f"not a signed state (it does not start with {MAGIC.decode()})")
    mac_hex, _, body = rest.partition(b" ")
    try:
        mac = bytes.fromhex(mac_hex.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        raise ForeignState("a malformed signed state") from None
    if not hmac.compare_digest(mac, _mac(key, etcd_key, body)):
        raise ForeignState("its signature does not verify with this job's rendezvous secret")
    return body


def unseal_state(key: bytes, etcd_key: bytes, value: bytes) -> bytes:
    """The pickled state of a sealed value (`unseal`, then the body's base64), or `ForeignState`."""
    try:
        state = base64.b64decode(unseal(key, etcd_key, value), validate=True)
    except (ValueError, binascii.Error):
        raise ForeignState("a signed state whose body is not base64") from None
    if not state:
        raise ForeignState("an empty state")
    return state


def mac_of(value: bytes) -> bytes:
    """The MAC field of a sealed value (what a cache of already validated states is keyed on)."""
    return value.split(b" ", 2)[1] if value.count(b" ") >= 2 else b""


def create_secret_file(path: str | os.PathLike[str]) -> Path:
    """A new rendezvous secret in `path` (32 random bytes as hex, 0600, exclusive): what
    `--rdzv-conf secret_file=PATH` names when the agents have no job dir of their own."""
    create_key_file(path, "a rendezvous secret")
    return Path(path)


def rendezvous_secret(
    secret_file: str | None = None, job_dir: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> bytes | None:
    """The MAC key K from the first secret found (module docstring), or None when none is configured.
    A configured secret that cannot be trusted (a link, group-readable, another user's, not 32 hex
    bytes) is its one-line error, never a silent fallback."""
    if secret_file:
        return derive_key(
            read_key_file(
                Path(secret_file),
                "the rendezvous secret",
                "whoever can read it can forge the rendezvous state every agent unpickles",
                f"--rdzv-conf {SECRET_FILE_CONF}=PATH names no file",
            )
        )
    env = os.environ if env is None else env
    where = job_dir if job_dir else env.get(JOB_DIR_ENV)
    if where and key_path(where).exists():
        return derive_key(load_key(where))
    return None


def require_secret(
    secret_file: str | None = None, job_dir: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> bytes:
    """`rendezvous_secret`, or the one-line `UsageError` that says how to configure it."""
    key = rendezvous_secret(secret_file, job_dir, env)
    if key is None:
        raise UsageError(NO_SECRET)
    return key
