"""Placeholder for `gpu-recover demo` (owned by the in-job runtime helper)."""

from __future__ import annotations

import typer


def register(*, app: typer.Typer) -> None:
    """Add the `demo` command to the gpu-recover app."""
