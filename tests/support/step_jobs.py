"""A real job directory of StepLogs written by the calling (live) process: its ranks are healthy now."""

from __future__ import annotations

import os
from pathlib import Path

from gpuguard.foundation.steplog import StepLog


def live_step_job(root: Path, ranks: int = 3, steps: int = 6) -> list[Path]:
    """`ranks` StepLogs (WORLD_SIZE recorded) with `steps` steps each; returns each rank's segment, by rank."""
    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(ranks)
    try:
        logs = [StepLog(root, r, f"i{r}") for r in range(ranks)]
    finally:
        if before is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = before
    for s in range(steps):
        for log in logs:
            log.begin_step(s)
            log.enter_collective(s, "all_reduce", 4096)
            log.exit_collective(s)
            log.end_step(s)
    segs = sorted((root / "ranks").iterdir(), key=lambda p: int(p.name.split(".")[0]))
    assert len(segs) == ranks, segs
    return segs
