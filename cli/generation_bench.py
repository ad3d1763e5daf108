"""Placeholder: `gpu-generation bench transitions` (the counterexample benchmark), filled in by its issue."""

from __future__ import annotations

import typer


def register(*, app: typer.Typer) -> None:
    """Add the `bench` group to the gpu-generation app."""
