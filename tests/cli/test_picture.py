"""`gpu-doctor picture` (issue 26, item 3) on a real restarted job (`gpu-recover demo`: 4 gloo workers
under torchrun, one SIGKILLed, a certified restart): the Chrome trace parses and holds each generation,
each rank and the restart's phases; the terminal heatmap and timeline fit 80 columns; `--plot` without
matplotlib is one line and 69. The lateness grid is property-tested on synthetic series."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.diagnostics.lateness import lateness_grid
from gpuguard.doctor.job_trace import recovery_phases
from gpuguard.foundation.observations import RankSeries, StepSample
from tests.support.cli import run_cli

pytestmark = pytest.mark.slow
REQUIRED = ("ph", "pid", "tid", "name")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    jd = tmp_path_factory.mktemp("picture") / "job"
    r = run_cli("gpu-recover", "demo", "--job-dir", str(jd), "--json", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    hist = json.loads(run_cli("gpu-generation", "history", "--job-dir", str(jd), "--json", timeout=60).stdout)
    return jd, [g["generation"] for g in hist["generations"]]


def test_the_perfetto_export_holds_each_generation_rank_and_recovery_phase(job):
    jd, generations = job
    r = run_cli("gpu-doctor", "picture", "--job-dir", str(jd), "--export", "perfetto", timeout=120)
    assert r.returncode == 0, r.stderr
    trace = json.loads(r.stdout)
    assert trace["otherData"]["schema"] == "gpuguard.trace/1" and trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    for e in events:  # the trace event format's rules, as chrome://tracing's importer applies them
        assert all(k in e for k in REQUIRED) and e["ph"] in ("X", "i", "M"), e
        if e["ph"] != "M":  # metadata events carry no time
            assert isinstance(e["ts"], (int, float)), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {(100 + rank, f"rank {rank}") for rank in range(4)} <= names
    gens = {e["name"] for e in events if e.get("cat") == "generation"}
    assert gens == {f"generation {g}" for g in generations}, gens
    steps = {(e["pid"], e["args"]["generation"]) for e in events if e.get("cat") == "step"}
    assert {(100 + rank, generations[-1]) for rank in range(4)} <= steps  # every rank stepped after the restart
    phases = [e for e in events if e.get("cat") == "recovery" and e["args"]["generation"] == generations[-1]]
    kinds = [e["args"]["phase"] for e in phases]
    assert kinds[0] in ("down", "down_and_import") and kinds[-1] == "first_step", kinds
    assert {"activate_called", "certificate", "restored"} <= set(kinds), kinds
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(phases, phases[1:])), "phases overlap"


def test_the_terminal_pictures_fit_80_columns(job):
    jd, generations = job
    r = run_cli("gpu-doctor", "picture", "--job-dir", str(jd), env={"COLUMNS": "80", "NO_COLOR": "1"}, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("rank ")] == ["0", "1", "2", "3"]
    assert f"restart into generation {generations[-1]}:" in r.stdout
    assert "quiescence + certificate" in r.stdout and "import torch" in r.stdout
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]


def test_plot_without_matplotlib_is_one_line_and_69(job, tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        r = run_cli("gpu-doctor", "picture", "--job-dir", str(job[0]), "--plot", str(tmp_path / "h.png"))
        assert r.returncode == 69 and r.stderr.count("\n") == 1 and "matplotlib" in r.stderr, r.stderr
        assert not (tmp_path / "h.png").exists()
    else:
        r = run_cli("gpu-doctor", "picture", "--job-dir", str(job[0]), "--plot", str(tmp_path / "h.svg"))
        assert r.returncode == 0 and (tmp_path / "h.svg").read_text().lstrip().startswith("<?xml")


def test_bad_export_and_plot_names_are_usage_errors(job, tmp_path):
    r = run_cli("gpu-doctor", "picture", "--job-dir", str(job[0]), "--export", "pdf")
    assert r.returncode == 64 and r.stderr.count("\n") == 1
    r = run_cli("gpu-doctor", "picture", "--job-dir", str(job[0]), "--plot", str(tmp_path / "h.pdf"))
    assert r.returncode in (64, 69) and r.stderr.count("\n") == 1


def _series(rank: int, computes: list[float], generation: int = 1) -> RankSeries:
    steps = tuple(StepSample(i, 100.0 + i, 100.0 + i, c, 0.01) for i, c in enumerate(computes))
    return RankSeries(rank, f"inc{rank}", generation=generation, steps=steps)


@given(
    base=st.lists(st.floats(0.001, 5.0), min_size=1, max_size=40),
    extra=st.floats(0.01, 10.0),
    ranks=st.integers(3, 12),
    slow=st.integers(0, 11),
)
def test_a_straggler_is_late_by_its_own_extra_compute(base, extra, ranks, slow):
    slow %= ranks
    series = [_series(r, [c + (extra if r == slow else 0.0) for c in base]) for r in range(ranks)]
    series.append(_series(0, [99.0] * len(base), generation=0))  # an older generation is not drawn
    grid = lateness_grid(series)
    assert grid.generation == 1 and grid.ranks == tuple(range(ranks)) and len(grid.steps) == len(base)
    for i, row in enumerate(grid.late):
        for v in row:
            assert v is not None and v >= 0
            assert v == pytest.approx(extra if i == slow else 0.0, abs=1e-9)
    assert grid.worst == pytest.approx(extra)


def test_a_step_a_rank_has_no_record_of_is_none():
    grid = lateness_grid([_series(0, [1.0, 1.0]), _series(1, [1.0])], last=10)
    assert grid.late == ((0.0, 0.0), (0.0, None))


def _ran(rank: int, generation: int, start: float, end: float) -> RankSeries:
    steps = (StepSample(0, end, end, 0.1, 0.0),)
    return RankSeries(
        rank, f"i{rank}g{generation}", generation=generation, start_wall=start, last_wall=end, steps=steps
    )


def test_restart_phases_run_from_the_old_generations_last_record_to_the_first_step():
    series = (_ran(0, 1, 0.0, 10.0), _ran(1, 1, 0.0, 9.0), _ran(0, 2, 14.5, 20.0), _ran(1, 2, 14.6, 21.0))
    marks = {"process_start": 11.0, "runtime_created": 13.0, "certificate": 14.0, "pg_ready": 14.4}
    spans = recovery_phases(series, {1: {}, 2: marks})
    assert [(p.phase, p.start, p.end) for p in spans] == [
        ("down", 10.0, 11.0),
        ("runtime_created", 11.0, 13.0),
        ("certificate", 13.0, 14.0),
        ("pg_ready", 14.0, 14.4),
        ("first_step", 14.4, 20.0),
    ]
    # a process start before the old generation's last record (psutil's create time is only as exact as
    # the boot time's second): down and the import are one span, never a negative one
    spans = recovery_phases(series, {2: {**marks, "process_start": 9.5}})
    assert [(p.phase, p.start, p.end) for p in spans][:2] == [
        ("down_and_import", 10.0, 13.0),
        ("certificate", 13.0, 14.0),
    ]


def test_in_place_phases_start_at_the_failed_ranks_last_record():
    series = (_ran(0, 1, 0.0, 10.4), _ran(1, 1, 0.0, 10.0), _ran(0, 2, 10.4, 11.0))
    marks = {"detect": 10.2, "reported": 10.25, "certified": 10.3, "first_commit": 10.5}
    spans = recovery_phases(series, {2: marks})
    assert [(p.phase, p.start) for p in spans] == [
        ("down_inplace", 10.0),
        ("reported", 10.2),
        ("certified", 10.25),
        ("first_commit", 10.3),
        ("first_step", 10.5),
    ]
