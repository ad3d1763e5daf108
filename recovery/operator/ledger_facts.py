"""What the operator actions read from a job's ledger: the active generation, and why it is unknown."""

from __future__ import annotations

from pathlib import Path

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import GpuguardError
from gpuguard.generation.job import ledger_url, open_job_ledger


def read_active_generation(job_dir: Path, timeout_s: float = 5.0) -> tuple[int | None, str | None]:
    """(active generation, why it could not be read): (None, None) when the job has no ledger at all.

    The ledger is wherever `init` put it (`<job-dir>/ledger/`, `ledger.url`, $GPUGUARD_LEDGER).
    """
    try:
        if ledger_url(job_dir) is None and not jobdir.ledger_dir(job_dir).exists():
            return None, None
        with open_job_ledger(job_dir, timeout=timeout_s) as ledger:
            cert = ledger.active()
    except GpuguardError as exc:
        return None, str(exc)
    if cert is None:
        return None, "the ledger holds no valid certificate"
    return cert.generation, None
