"""Open a job's ledger by URL: the directory backend by default, etcd for `etcd://host:port/prefix`.

Its own module because it names both backends, and both backends build on `generation.ledger`.
"""

from __future__ import annotations

from pathlib import Path

from gpuguard.foundation.errors import UsageError
from gpuguard.foundation.jobdir import ledger_dir
from gpuguard.generation.keys import key_path, load_key
from gpuguard.generation.ledger import Ledger
from gpuguard.generation.ledger_dir import DirectoryLedger
from gpuguard.generation.ledger_etcd import EtcdLedger


def open_ledger(
    job_dir: str | Path, url: str | None = None, *, key: bytes | None = None, timeout: float = 5.0
) -> Ledger:
    """The job's ledger: `<job_dir>/ledger/` by default, or etcd for `etcd://host:port/prefix`.

    The signing key is read from the job dir when present (without it the chain is still
    walked and linked, but signatures are not checked and nothing can be activated).
    """
    job_dir = Path(job_dir)
    if key is None and key_path(job_dir).exists():
        key = load_key(job_dir)
    if url is None or url in ("", "dir", "file"):
        return DirectoryLedger(ledger_dir(job_dir), key=key)
    if url.startswith("file://"):
        return DirectoryLedger(Path(url[len("file://") :]), key=key)
    if url.startswith(("etcd://", "http://")):
        return EtcdLedger.from_url(url, key=key, timeout=timeout)

    raise UsageError(f"unsupported ledger URL {url!r} (use a directory default or etcd://host:port/prefix)")
