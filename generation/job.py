"""Create a job's generation home: the ledger, the 0600 signing key and the signed genesis certificate."""

from __future__ import annotations

import getpass
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from gpuguard.foundation.boundedread import URL_BYTES, read_bytes
from gpuguard.foundation.env import LEDGER_ENV
from gpuguard.foundation.errors import EXIT_CANTCREAT, DataError, GpuguardError, NoInputError, from_os_error
from gpuguard.foundation.jobdir import ledger_url_path
from gpuguard.generation.certificate import issue
from gpuguard.generation.keys import create_key, key_path
from gpuguard.generation.ledger import Ledger
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.records import Certificate, Frontier


def ledger_url(job_dir: str | Path, url: str | None = None) -> str | None:
    """Where a job's ledger lives: the given URL, else $GPUGUARD_LEDGER, else what `init` recorded
    in `<job_dir>/ledger.url`, else None (the directory ledger `<job_dir>/ledger/`)."""
    if url:
        return url
    if os.environ.get(LEDGER_ENV):
        return os.environ[LEDGER_ENV]
    path = ledger_url_path(job_dir)
    try:
        raw = read_bytes(path, max_bytes=URL_BYTES, what="a ledger URL", follow_links=False)
    except NoInputError:
        return None
    try:
        recorded = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    if "\n" in recorded or "\x00" in recorded:
        raise DataError(f"{path}: more than one line")
    return recorded or None


def open_job_ledger(job_dir: str | Path, url: str | None = None, *, timeout: float = 5.0) -> Ledger:
    """The ledger of a job directory, wherever `init` put it (see `ledger_url`)."""
    return open_ledger(job_dir, ledger_url(job_dir, url), timeout=timeout)


@dataclass(frozen=True)
class InitResult:
    ledger: Ledger
    genesis: Certificate


def issuer() -> str:
    """Who issues a certificate: user@host:pid (an audit hint, not an authority)."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in a container
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}:{os.getpid()}"


def init_job(
    job_dir: str | Path, *, url: str | None = None, job_id: str | None = None, timeout: float = 5.0
) -> InitResult:
    """Create `<job_dir>`, its key (0600, never overwritten) and generation 0 in the ledger."""
    job_dir = Path(job_dir)
    if key_path(job_dir).exists():
        raise GpuguardError(
            f"{job_dir}: already initialized (signing key exists; refusing to overwrite)", exit_code=EXIT_CANTCREAT
        )
    # Reach the ledger before creating anything, so an unreachable etcd leaves nothing behind.
    probe = open_ledger(job_dir, url, timeout=timeout)
    if probe.generations():
        raise GpuguardError(f"{probe.url}: ledger already holds certificates", exit_code=EXIT_CANTCREAT)
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise from_os_error(exc, str(job_dir)) from None
    create_root = getattr(probe, "create_root", None)
    if create_root:
        create_root()
    key = create_key(job_dir)
    if url:
        path = ledger_url_path(job_dir)
        try:  # owner-only, never through a link: the URL may hold etcd credentials (user:password@)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(url + "\n")
        except OSError as exc:
            raise from_os_error(exc, str(path)) from None
    ledger = open_ledger(job_dir, url, key=key, timeout=timeout)
    genesis = issue(
        parent=None,
        job_id=job_id or job_dir.resolve().name,
        members=(),
        reason="genesis",
        frontier=Frontier(0),
        quiescence="proved",
        quiescence_evidence=("genesis: no previous generation",),
        issued_by=issuer(),
        key=key,
    )
    ledger.initialize(genesis)
    return InitResult(ledger, genesis)
