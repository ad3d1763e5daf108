"""`gpu-recover verify`: wait (bounded) for the new generation's certificate, then verify its chain.

Read-only: it writes nothing, the audit log included (`actions.READ_ONLY`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gpuguard.foundation.errors import EXIT_CRITICAL, EXIT_OK, NoInputError, UnavailableError
from gpuguard.generation.keys import load_key
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.verify import verify_ledger
from gpuguard.recovery.operator.result import ActionResult


def verify(
    job_dir: Path,
    *,
    newer_than: int | None = None,
    timeout_s: float = 60.0,
    poll_s: float = 0.5,
    ledger_url: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ActionResult:
    """Wait (bounded) for an active certificate newer than `newer_than`, then verify its chain."""

    if not job_dir.is_dir():
        raise NoInputError(f"{job_dir}: no such job directory")
    end = time.monotonic() + timeout_s
    while True:
        with open_ledger(job_dir, ledger_url) as ledger:
            cert = ledger.active()
            if cert is not None and (newer_than is None or cert.generation > newer_than):
                report = verify_ledger(ledger, load_key(job_dir), generation=cert.generation)
                break
        if time.monotonic() >= end:
            want = "active certificate" if newer_than is None else f"generation newer than {newer_than}"
            raise UnavailableError(f"no {want} within {timeout_s:g} s")
        sleep(poll_s)
    details = {
        "generation": cert.generation,
        "certificate_digest": cert.digest(),
        "reason": cert.reason,
        "members": len(cert.members),
        "frontier_step": cert.frontier.step,
        "quiescence": cert.quiescence,
        "findings": [str(f) for f in report.findings],
    }
    if report.findings:
        return ActionResult(
            "verify",
            "failed",
            EXIT_CRITICAL,
            f"generation {cert.generation}: {len(report.findings)} finding(s): {report.findings[0]}",
            details,
        )
    return ActionResult(
        "verify",
        "done",
        EXIT_OK,
        f"generation {cert.generation} verified ({len(cert.members)} members, frontier step {cert.frontier.step})",
        details,
    )
