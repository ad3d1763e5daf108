"""`gpu-doctor diagnose job` past what it keeps exactly: the cohort quantiles say they are approximate, stay
within the documented 1 %, and each rank keeps only its recent samples (bounded memory per rank)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from gpuguard.collectors.step_records import read_job
from gpuguard.diagnostics.jobstats import distribution
from gpuguard.doctor.job_diagnosis import assess
from gpuguard.doctor.job_observation import RECENT_STEPS
from gpuguard.foundation.step_summary import RELATIVE_ERROR
from gpuguard.foundation.steplog import MAX_STEPS


def _write(root: Path, ranks: int, steps: int) -> None:
    """Step logs written as the format says (docs/formats/step-log.md), ending a second ago."""
    import time

    rng = random.Random(3)
    (root / "ranks").mkdir(parents=True)
    now = time.time()
    for r in range(ranks):
        t = now - steps * 0.1 - 1
        lines = [f'H {{"v":1,"rank":{r},"incarnation":"i","generation":1,"pid":9,"host":"elsewhere","wall":{t}}}']
        for s in range(steps):
            compute = rng.uniform(0.03, 0.06)
            lines.append(f"S {s} {t:.6f} {t:.6f}")
            lines.append(f"E {s} {t + 0.1:.6f} {t + 0.1:.6f} {compute:.6f} {0.1 - compute:.6f} 8")
            t += 0.1 + rng.uniform(0, 0.01)
        (root / "ranks" / f"{r}.i.000000.steplog").write_text("\n".join(lines) + "\n")


def test_cohort_quantiles_past_the_exact_limit_are_marked_and_within_the_bound(cli, tmp_path: Path) -> None:
    _write(tmp_path, ranks=3, steps=1500)  # 4,500 step values: more than the 4,096 kept exactly
    doc = json.loads(cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--json").stdout)
    comp = doc["cohort_step_s"]["compute"]
    assert comp["n"] == 4500 and comp["exact"] is False and comp["relative_error"] == RELATIVE_ERROR
    full = read_job(tmp_path, max_steps=MAX_STEPS)  # the full series, as before
    true = distribution([s.compute_s for r in full.ranks.values() for s in r.steps])
    for q in ("p50", "p90", "p99", "p999"):
        assert abs(comp[q] - true[q]) <= RELATIVE_ERROR * true[q] + 1e-5, (q, comp[q], true[q])  # 1e-5: rounding
    assert comp["max"] == round(true["max"], 5)
    human = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path))
    assert "(quantiles within 1%)" in human.stdout, human.stdout


def test_each_rank_keeps_its_recent_samples_and_a_summary_of_its_history(tmp_path: Path) -> None:
    _write(tmp_path, ranks=2, steps=600)
    result = assess(tmp_path)
    for series in result.records.ranks.values():
        assert len(series.steps) == RECENT_STEPS and series.summary is not None and series.summary.n == 600
    few = tmp_path / "few"
    _write(few, ranks=2, steps=30)
    small = assess(few)
    assert small.document["cohort_step_s"]["compute"]["exact"] is True
    assert [r["verdict"] for r in small.document["ranks"]] == [r["verdict"] for r in result.document["ranks"]]


def _retained(job: Path, **kw: object) -> int:
    """Bytes still held by what `read_job` returned (tracemalloc), the transient buffers gone."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        records = read_job(job, **kw)  # type: ignore[arg-type]
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(records.ranks) == 20
    return held


def test_memory_per_rank_does_not_grow_with_the_steps(tmp_path: Path) -> None:
    """20 ranks of 100 steps and of 1,500: what the streaming read keeps is the same size; the full series
    (the previous design) grows with the steps."""
    _write(tmp_path / "short", ranks=20, steps=100)
    _write(tmp_path / "long", ranks=20, steps=1500)
    streamed = {k: _retained(tmp_path / k, max_steps=RECENT_STEPS, history=2000) for k in ("short", "long")}
    assert streamed["long"] <= 1.3 * streamed["short"], streamed
    full = {k: _retained(tmp_path / k, max_steps=2000) for k in ("short", "long")}
    assert full["long"] > 5 * full["short"], full  # the premise: the full series does grow
    print(f"per rank: streaming {streamed['long'] // 20} B, full series {full['long'] // 20} B at 1,500 steps")
