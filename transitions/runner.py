"""Run strategy x fault x boundary (x layout) in the in-process simulator and collect one row each."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.transitions import strategies as strat
from gpuguard.transitions.certified import Certified
from gpuguard.transitions.model import LAYOUTS
from gpuguard.transitions.oracle import judge
from gpuguard.transitions.schedules import Schedule, matrix
from gpuguard.transitions.sim import Sim


@dataclass(frozen=True)
class Row:
    strategy: str
    fault: str
    boundary: str
    layout: str
    semantic_failure: bool
    detail: str
    recovery_s: float | None
    steps_lost: int | None
    sync_ops_per_step: float
    sync_s_per_step: float
    fenced: int = 0  # old-generation results that arrived late and were rejected
    findings: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    mode: str = "sim"
    latency: str = "model"  # "model": modelled from measurements + measured bookkeeping; "measured"
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "fault": self.fault,
            "boundary": self.boundary,
            "layout": self.layout,
            "semantic_failure": self.semantic_failure,
            "detail": self.detail,
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 4),
            "steps_lost": self.steps_lost,
            "sync_ops_per_step": round(self.sync_ops_per_step, 3),
            "sync_s_per_step": round(self.sync_s_per_step, 6),
            "fenced": self.fenced,
            "findings": list(self.findings),
            "mode": self.mode,
            "latency": self.latency,
            "wall_s": round(self.wall_s, 4),
        }


def run_one(schedule: Schedule, strategy: str, workdir: str | Path | None = None) -> Row:
    """One schedule against one strategy, judged by the oracle."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuguard-transitions-", dir=workdir) as tmp:
        s = make_strategy(strategy)
        sim = Sim(schedule, s, Path(tmp))
        sim.run()
        outcome = sim.outcome()
        verdict = judge(outcome)
    joined = schedule.joiners + (1 if schedule.replaced else 0)
    recovered = sim.faulted and sim.resume_step is not None
    steps = max(1, schedule.steps)
    return Row(
        strategy=strategy,
        fault=schedule.fault,
        boundary=schedule.boundary,
        layout=schedule.layout,
        semantic_failure=not verdict.ok,
        detail=verdict.detail,
        recovery_s=s.latency_s(sim, joined) if recovered else None,
        steps_lost=max(0, schedule.progress_at_fault - sim.resume_step)
        if recovered and sim.resume_step is not None
        else None,
        sync_ops_per_step=sim.sync_ops / steps,
        sync_s_per_step=sim.sync_s / steps,
        fenced=sum(1 for e in outcome.effects if not e.accepted),
        findings=tuple(f.to_dict() for f in verdict.findings),
        wall_s=time.perf_counter() - t0,
    )


def run_matrix(
    strategies: Iterable[str] = strat.STRATEGIES,
    layouts: Iterable[str] = LAYOUTS,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    workdir: str | Path | None = None,
) -> list[Row]:
    """Every schedule of the matrix against every strategy (files under `workdir`, default the temp dir:
    its fsync cost is part of gpuguard's measured synchronisation)."""
    schedules = matrix(tuple(layouts), seed=seed)
    names = list(strategies)
    total = len(schedules) * len(names)
    rows = []
    for name in names:
        for sch in schedules:
            rows.append(run_one(sch, name, workdir))
            if progress:
                progress(len(rows), total)
    return rows


def make_strategy(name: str) -> Any:
    """A fresh strategy object by name (one of `strategies.STRATEGIES`)."""
    if name == "restart-all":
        return strat.RestartAll()
    if name == "communicator-only":
        return strat.CommunicatorOnly()
    if name == "gpuguard":
        return Certified()
    raise ValueError(f"unknown strategy {name!r} (one of {', '.join(strat.STRATEGIES)})")
