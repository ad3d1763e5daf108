"""`gpu-doctor diagnose torchrun`: hazards of live torchrun jobs that torchrun itself never reports.

Workers stuck in process-group init after a restart, workers orphaned by a dead agent, and agents
running with the run id `none`. psutil + the job dir only: never imports torch.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from gpuguard.cli._app import console, emit_json, job_dir_option


def register(*, app: typer.Typer, diagnose: typer.Typer, watch: typer.Typer, plan: typer.Typer) -> None:
    """Add this module's commands to the gpu-doctor app."""

    @diagnose.command("torchrun")
    def diagnose_torchrun(
        job_dir: Path | None = job_dir_option(required=False),
        init_timeout: float = typer.Option(
            60.0,
            "--init-timeout",
            min=0.0,
            help="Seconds alive without a step before a worker counts as stuck in init.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print gpuguard.torchrun-hazards/1 JSON."),
    ) -> int:
        """Flag torchrun hazards: stuck in group init, orphaned workers, --rdzv-id left at none.

        Exit 0: none; 1: warnings; 2: critical.
        """
        from gpuguard.collectors.torchrun import gather
        from gpuguard.diagnostics.torchrun_hazards import assess_facts
        from gpuguard.foundation.errors import NoInputError

        if job_dir is not None and not job_dir.is_dir():
            raise NoInputError(f"{job_dir}: no such job directory")
        assessment = assess_facts(gather(job_dir), now=time.time(), init_timeout_s=init_timeout)
        if as_json:
            emit_json(
                {
                    "schema": "gpuguard.torchrun-hazards/1",
                    "job_dir": str(job_dir) if job_dir else None,
                    "verdict": assessment.verdict,
                    "live_workers": assessment.live_workers,
                    "hazards": [h.to_json() for h in assessment.hazards],
                    "notes": list(assessment.notes),
                }
            )
            return assessment.exit_code
        out = console()
        out.print(
            f"torchrun: {assessment.verdict}; {assessment.live_workers} live worker(s); "
            f"{len(assessment.hazards)} hazard(s)",
            markup=False,
            soft_wrap=True,
        )
        for h in assessment.hazards:
            out.print(f"  [{h.severity}] {h.kind}: {h.message}", markup=False, soft_wrap=True)
            if h.pids:
                out.print(f"      pids: {', '.join(map(str, h.pids))}", markup=False, soft_wrap=True)
            out.print(f"      fix: {h.fix}", markup=False, soft_wrap=True)
        for note in assessment.notes:
            out.print(f"  note: {note}", markup=False, soft_wrap=True)
        return assessment.exit_code
