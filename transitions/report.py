"""The benchmark's table and its `gpuguard.bench/1` document: semantic failures first, then cost.

Per strategy x fault x boundary (x layout): did the run map to a legal serial history (the
oracle's verdict), and only then how long recovery took, how many steps were rolled back and
what extra synchronisation the strategy paid per step.

Lazy imports (start-up time): rich, only when the table is rendered.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from gpuguard.transitions.runner import Row
from gpuguard.transitions.schedules import BOUNDARIES, FAULTS

SCHEMA = "gpuguard.bench/1"
BENCH = "transitions"


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summary(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Per strategy: runs, semantic failures (and at which fault/boundary), median latency, mean rollback."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.strategy for r in rows):
        mine = [r for r in rows if r.strategy == name]
        failed = [r for r in mine if r.semantic_failure]
        lost = [r.steps_lost for r in mine if r.steps_lost is not None]
        out[name] = {
            "runs": len(mine),
            "semantic_failures": len(failed),
            "failing_faults": sorted({r.fault for r in failed}),
            "failing_boundaries": sorted({r.boundary for r in failed}),
            "failing": [f"{r.fault}@{r.boundary}/{r.layout}" for r in failed],
            "median_recovery_s": _median(r.recovery_s for r in mine),
            "mean_steps_lost": round(sum(lost) / len(lost), 3) if lost else None,
            "sync_ops_per_step": _median(r.sync_ops_per_step for r in mine),
            "median_sync_s_per_step": _median(r.sync_s_per_step for r in mine),
            "fenced": sum(r.fenced for r in mine),
        }
    return out


def ratios(summ: dict[str, dict[str, Any]], baseline: str = "restart-all", subject: str = "gpuguard") -> dict[str, Any]:
    """How the subject compares with the baseline a user would otherwise use, in the same run."""
    b, s = summ.get(baseline), summ.get(subject)
    if not b or not s:
        return {}
    out: dict[str, Any] = {"baseline": baseline, "subject": subject}
    if b["median_recovery_s"] and s["median_recovery_s"]:
        out["recovery_speedup"] = round(b["median_recovery_s"] / s["median_recovery_s"], 2)
    if b["mean_steps_lost"] is not None and s["mean_steps_lost"] is not None:
        out["steps_lost_ratio"] = (
            round(s["mean_steps_lost"] / b["mean_steps_lost"], 3) if b["mean_steps_lost"] else None
        )
    return out


def document(rows: list[Row], notes: Iterable[str] = (), extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `gpuguard.bench/1` document: one result row per run, a summary per strategy."""
    summ = summary(rows)
    return {
        "schema": SCHEMA,
        "bench": BENCH,
        "results": [r.to_dict() for r in rows],
        "summary": summ,
        "ratios": ratios(summ),
        "notes": list(notes),
        **(extra or {}),
    }


def ordered(rows: list[Row]) -> list[Row]:
    """Strategy by strategy, semantic failures first, then in schedule order (layout, fault, boundary)."""
    rank = {n: i for i, n in enumerate(dict.fromkeys(r.strategy for r in rows))}
    faults = {f: i for i, f in enumerate(FAULTS)}
    bounds = {b: i for i, b in enumerate(BOUNDARIES)}
    return sorted(
        rows,
        key=lambda r: (
            rank[r.strategy],
            not r.semantic_failure,
            r.layout,
            faults.get(r.fault, 99),
            bounds.get(r.boundary, 99),
        ),
    )


def render(rows: list[Row], notes: Iterable[str] = (), console: Any = None) -> None:
    """The human table (rich): the per-strategy summary, then every run."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console(highlight=False)
    summ = summary(rows)
    t = Table(title="membership-transition counterexample benchmark: per strategy")
    for col in (
        "strategy",
        "runs",
        "semantic failures",
        "median recovery s",
        "mean steps lost",
        "sync ops/step",
        "fenced late results",
        "failing faults",
    ):
        t.add_column(col)
    for name, s in summ.items():
        t.add_row(
            name,
            str(s["runs"]),
            str(s["semantic_failures"]),
            _f(s["median_recovery_s"]),
            _f(s["mean_steps_lost"]),
            _f(s["sync_ops_per_step"]),
            str(s["fenced"]),
            ", ".join(s["failing_faults"]) or "-",
        )
    con.print(t)
    d = Table(title="per strategy x fault x boundary (semantic failures first)")
    for col in (
        "strategy",
        "fault",
        "boundary",
        "layout",
        "semantic",
        "recovery s",
        "steps lost",
        "sync s/step",
        "detail",
    ):
        d.add_column(col, overflow="fold")
    for r in ordered(rows):
        d.add_row(
            r.strategy,
            r.fault,
            r.boundary,
            r.layout,
            "FAIL" if r.semantic_failure else "ok",
            _f(r.recovery_s),
            "-" if r.steps_lost is None else str(r.steps_lost),
            _f(r.sync_s_per_step),
            r.detail,
        )
    con.print(d)
    rat = ratios(summ)
    if rat:
        con.print(
            f"gpuguard vs restart-all: recovery {rat.get('recovery_speedup', '-')}x faster (median), "
            f"steps lost ratio {rat.get('steps_lost_ratio', '-')}"
        )
    for n in notes:
        con.print(f"note: {n}")


def _f(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}"


def gpuguard_failures(rows: list[Row]) -> int:
    return sum(1 for r in rows if r.strategy == "gpuguard" and r.semantic_failure)
