"""`gpu-doctor diagnose job` at 1,000, 10,000 and 100,000 ranks: seconds and peak memory (issue 29).

    python bench/diagnose_scale.py [--json] [--sizes 1000,10000,100000] [--steps 20] [--sweep 100,2000]

Writes synthetic step logs (the v1 format of docs/formats/step-log.md: a header and S/C/X/E records per
step, one slow rank) for N ranks into a temporary directory, deletes them afterwards, and runs the
diagnosis in a fresh child process per row (in-process `doctor.job_diagnosis.assess`, as the CLI does),
so each row's peak RSS is its own. Rows `{"metric": "diagnose_job", "ranks", "steps", "design", "ok",
"seconds", "peak_rss_mb", "rss_growth_mb", "bytes_per_rank", "verdict"}`:

- `design` `streaming`: each rank's history as a bounded summary (foundation/step_summary.py), only its
  last 40 samples kept.
- `design` `full-series`: the previous design in the same run: every rank's full series of up to
  `history` (2,000) samples kept in memory (`read_job(max_steps=history)`, no summary), which `observe`
  then reads as before.

`rss_growth_mb` is the peak RSS minus the child's RSS after its imports; `bytes_per_rank` is that over
the ranks (at 1,000 ranks it includes the allocator's hold on the transient buffers of the rank being
read). The `--sweep` rows (200 ranks, more steps each, under tracemalloc) show what grows with the
steps: `py_held_bytes_per_rank`, what the result still holds per rank, grows for the full series and
not for the summary once its caps are reached (40 step samples, 64 collective entries: from 64 steps
on, so the default sweep starts at 100). The diagnosis is judged as of just after the last record (a stopped wall clock in
the child: writing the logs takes a while). `ok`: the two designs agree on every rank's verdict, and
the streaming one's `py_held_bytes_per_rank` at the most steps is within 1.5 x that at the fewest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

SLOW_RANK = 3
SWEEP_RANKS = 200  # the --sweep rows run under tracemalloc (several times slower): fewer ranks
PERIOD_S = 0.1


def write_job(root: Path, ranks: int, steps: int, seed: int = 0) -> float:
    """N ranks' step logs of `steps` steps each, healthy but for SLOW_RANK (2 x compute); returns the
    wall time the diagnosis is to be judged as of (just after the last record: writing 100,000 ranks
    takes a while, and records that old would read as hung)."""
    rng = random.Random(seed)
    out = root / "ranks"
    out.mkdir(parents=True)
    end = time.time()
    mono_end = time.monotonic()
    for r in range(ranks):
        t0 = end - steps * PERIOD_S - 0.05
        header = {
            "v": 1,
            "rank": r,
            "incarnation": "bench",
            "generation": 1,
            "pid": 100000 + r,
            "host": f"bench-host-{r // 8}",
            "local_rank": r % 8,
            "world_size": ranks,
            "start_time": t0 - 5,
            "segment": 0,
            "wall": round(t0, 6),
            "mono": round(mono_end - (end - t0), 6),
        }
        lines = ["H " + json.dumps(header, separators=(",", ":"))]
        off = round(mono_end - (end - t0), 6) - t0
        t = t0
        for s in range(1, steps + 1):
            compute = PERIOD_S * (0.9 if r == SLOW_RANK else 0.45) * rng.uniform(0.95, 1.05)
            lines.append(f"S {s} {t:.6f} {t + off:.6f}")
            c = t + compute
            wait = max(0.0, PERIOD_S - compute) if r != SLOW_RANK else 0.0005
            lines.append(f"C {s} {s} {c:.6f} {c + off:.6f} 4096 all_reduce")
            x = c + wait
            lines.append(f"X {s} {x:.6f} {x + off:.6f} {wait:.6f}")
            lines.append(f"E {s} {x:.6f} {x + off:.6f} {compute:.6f} {wait:.6f} 4096")
            t = max(x, t + PERIOD_S)
        (out / f"{r}.bench.000000.steplog").write_text("\n".join(lines) + "\n")
    return end + 0.2


def _rss_mb() -> float:
    """This process's peak RSS so far (ru_maxrss: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Clock:
    """The `time` module as job_observation sees it, its wall clock stopped at `as_of` (both designs)."""

    def __init__(self, as_of: float) -> None:
        self.as_of = as_of
        self.monotonic = time.monotonic

    def time(self) -> float:
        return self.as_of


def child(job_dir: str, design: str, as_of: str, trace: str) -> None:
    """One diagnosis in this (fresh) process; prints {seconds, peak_rss_mb, base_rss_mb, verdicts} and,
    with `trace` "1", tracemalloc's peak and what the result still holds (slower: the sweep only)."""
    import tracemalloc
    from collections import Counter

    import gpuguard.doctor.job_observation as jo
    from gpuguard.collectors.step_records import read_job
    from gpuguard.doctor.job_diagnosis import assess

    jo.time = _Clock(float(as_of))  # type: ignore[assignment]

    if design == "full-series":  # the previous design: every rank's whole series in memory, no summary

        def full(job_dir: Any, *, max_steps: int, history: int | None = None, on_progress: Any = None) -> Any:
            return read_job(job_dir, max_steps=history or max_steps)

        jo.read_job = full  # type: ignore[assignment]
    base = _rss_mb()
    if trace == "1":
        tracemalloc.start()
    t0 = time.perf_counter()
    result = assess(job_dir)
    seconds = time.perf_counter() - t0
    held, py_peak = tracemalloc.get_traced_memory() if trace == "1" else (0, 0)
    verdicts = {str(r.rank): r.verdict for r in result.verdict.ranks}
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_rss_mb": _rss_mb(),
                "base_rss_mb": base,
                "verdict": result.verdict.verdict,
                "counts": dict(Counter(verdicts.values())),
                "verdicts": verdicts,
                "cohort_exact": result.document["cohort_step_s"]["period"].get("exact"),
                "py_peak": py_peak,
                "py_held": held,
            }
        )
    )


def measure(job_dir: Path, design: str, as_of: float, trace: bool, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(job_dir), design, repr(as_of), "1" if trace else "0"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"crashed": f"over {timeout_s:.0f} s"}
    if done.returncode != 0:
        return {"crashed": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def rows_for(ranks: int, steps: int, timeout_s: float, trace: bool = False) -> list[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="gpuguard-diagnose-scale-"))
    try:
        as_of = write_job(tmp / "job", ranks, steps)
        got = {d: measure(tmp / "job", d, as_of, trace, timeout_s) for d in ("streaming", "full-series")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = all("verdicts" in g for g in got.values()) and got["streaming"]["verdicts"] == got["full-series"]["verdicts"]
    rows = []
    for design, g in got.items():
        row: dict[str, Any] = {"metric": "diagnose_job", "ranks": ranks, "steps": steps, "design": design}
        if "crashed" in g:
            rows.append({**row, "ok": False, "crashed": g["crashed"]})
            continue
        growth = max(0.0, g["peak_rss_mb"] - g["base_rss_mb"])
        row.update(
            ok=same,
            seconds=round(g["seconds"], 3),
            peak_rss_mb=round(g["peak_rss_mb"], 1),
            rss_growth_mb=round(growth, 1),
            bytes_per_rank=int(growth * 2**20 / ranks),
            verdict=g["verdict"],
            verdict_counts=g["counts"],
            cohort_exact=g["cohort_exact"],
        )
        if trace:  # Python's own figures: what the result holds per rank, and the peak (transients included)
            row.update(py_held_bytes_per_rank=g["py_held"] // ranks, py_peak_mb=round(g["py_peak"] / 2**20, 1))
        rows.append(row)
    if len(rows) == 2 and "crashed" not in rows[0] and "crashed" not in rows[1]:
        rows[0]["rss_ratio_vs_full"] = round(rows[0]["rss_growth_mb"] / max(rows[1]["rss_growth_mb"], 0.1), 3)
        rows[0]["seconds_ratio_vs_full"] = round(rows[0]["seconds"] / max(rows[1]["seconds"], 1e-6), 3)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes", default="1000,10000,100000", help="rank counts (steps: --steps)")
    ap.add_argument("--steps", type=int, default=20, help="steps per rank for the --sizes rows")
    ap.add_argument(
        "--sweep", default="100,2000", help="steps per rank for the 200-rank sweep, past the caps ('' none)"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child diagnosis")
    ap.add_argument("--child", nargs=4, metavar=("JOB_DIR", "DESIGN", "AS_OF", "TRACE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(*a.child)
        return 0
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in a.sizes.split(",") if x]:
        rows += rows_for(n, a.steps, a.timeout)
    sweep = [int(x) for x in a.sweep.split(",") if x]
    for steps in sweep:
        rows += [{**r, "metric": "diagnose_job_sweep"} for r in rows_for(SWEEP_RANKS, steps, a.timeout, trace=True)]
    stream = [
        r for r in rows if r["metric"] == "diagnose_job_sweep" and r["design"] == "streaming" and "crashed" not in r
    ]
    if len(stream) >= 2:  # what the result holds per rank must not grow with the steps
        flat = stream[-1]["py_held_bytes_per_rank"] <= 1.5 * max(stream[0]["py_held_bytes_per_rank"], 1)
        for r in rows:
            if r["metric"] == "diagnose_job_sweep" and r["design"] == "streaming":
                r["ok"] = bool(r["ok"]) and flat
    notes = [
        f"synthetic v1 step logs, {os.cpu_count()} CPU(s); each row a fresh child process; RSS from ru_maxrss",
        "cohort quantiles are exact up to 4,096 values, else within 1 % (foundation/step_summary.py)",
    ]
    emit("diagnose_scale", rows, a.json, notes)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
