"""`gpu-doctor diagnose torchrun`: hazards of a live torchrun job (filled in by the recovery issue)."""

from __future__ import annotations

import typer


def register(*, app: typer.Typer, diagnose: typer.Typer, watch: typer.Typer, plan: typer.Typer) -> None:
    """Add this module's commands to the gpu-doctor app."""
