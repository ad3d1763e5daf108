"""`read_job(history=...)` streams each rank's tail into a bounded summary: the vote's features agree with
the full series' (exactly, but for a p50 past 64 steps, which is within the documented 1 %)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.collectors.step_records import read_job
from gpuguard.diagnostics.jobstats import observe
from gpuguard.foundation.step_summary import RELATIVE_ERROR

APPROXIMATE = {"period_p50_s", "compute_p50_s"}  # past 64 steps: within RELATIVE_ERROR; the rest exact

STEP = st.tuples(
    st.floats(min_value=0.0, max_value=5.0),  # own compute
    st.floats(min_value=0.0, max_value=2.0),  # collective wait
    st.floats(min_value=0.0, max_value=3.0),  # time between steps
    st.sampled_from(["", "", "", "garbage", "E 1 2", "B"]),  # a bad line now and then
)


def write_log(root: Path, steps: list[tuple[float, float, float, str]]) -> None:
    (root / "ranks").mkdir(parents=True)
    t = 1_700_000_000.0
    header = {"v": 1, "rank": 0, "incarnation": "i", "generation": 1, "pid": 7, "host": "elsewhere"}
    lines = ["H " + json.dumps({**header, "world_size": 1, "wall": t, "mono": 100.0}, separators=(",", ":"))]
    for n, (compute, wait, gap, bad) in enumerate(steps, 1):
        m = 100.0 + (t - 1_700_000_000.0)
        lines.append(f"S {n} {t:.6f} {m:.6f}")
        lines.append(f"C {n} {n} {t + compute:.6f} {m + compute:.6f} 8 all_reduce")
        t2 = t + compute + wait
        lines.append(f"X {n} {t2:.6f} {m + compute + wait:.6f} {wait:.6f}")
        lines.append(f"E {n} {t2:.6f} {m + compute + wait:.6f} {compute:.6f} {wait:.6f} 8")
        if bad:
            lines.append(bad)
        t = t2 + gap
    (root / "ranks" / "0.i.000000.steplog").write_text("\n".join(lines) + "\n")


@settings(max_examples=60, deadline=None)
@given(st.lists(STEP, max_size=300), st.integers(min_value=1, max_value=400), st.integers(min_value=1, max_value=60))
def test_the_streamed_summary_agrees_with_the_full_series(steps: list, history: int, window: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write_log(Path(tmp), steps)
        full = read_job(tmp, max_steps=history).ranks[0]
        streamed = read_job(tmp, max_steps=max(window, 40), history=history).ranks[0]
    assert streamed.summary is not None and full.summary is None
    assert len(streamed.steps) <= max(window, 40)  # what is kept per rank does not grow with the steps
    now = streamed.last_wall + 1.0
    a = observe(full, now_wall=now, window=window, history=history)
    b = observe(streamed, now_wall=now, window=window, history=history)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in APPROXIMATE and not streamed.summary.exact:
            assert abs(x - y) <= RELATIVE_ERROR * x * (1 + 1e-9), (f.name, x, y)
        else:
            assert x == y, (f.name, x, y)
