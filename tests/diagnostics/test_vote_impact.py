"""The job-level impact line: what the slowness costs the whole job per step, and which rank costs it."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.cli.doctor_job import _print_human
from gpuguard.diagnostics.jobstats import job_impact
from gpuguard.diagnostics.vote import load_config, to_json, vote
from gpuguard.foundation.observations import BETWEEN, ProcessState, RankObservation

CFG = load_config()
ALIVE = ProcessState("running", "pid 1")


def ob(rank: int, *, period: float, normal: float, compute: float, normal_compute: float) -> RankObservation:
    return RankObservation(
        rank=rank,
        alive=ALIVE,
        phase=BETWEEN,
        phase_step=500,
        phase_seq=499,
        phase_age_s=0.01,
        progress_age_s=0.01,
        n_steps=500,
        period_p50_s=normal,
        period_p99_s=normal * 1.5,
        period_p999_s=normal * 2,
        compute_p50_s=normal_compute,
        compute_p999_s=normal_compute * 2,
        recent_compute_s=compute,
        recent_period_s=period,
        recent_period_max_s=period * 1.1,
    )


def straggling_job() -> list[RankObservation]:
    """The issue's numbers: the job normally steps in 0.18 s (0.15 s of own compute); rank 2 now computes
    1.9 s, so every step takes 1.95 s and its peers wait ~1.8 s of each for it."""
    return [
        ob(r, period=1.95, normal=0.18, compute=1.9 if r == 2 else 0.15, normal_compute=0.15 if r != 2 else 0.16)
        for r in range(8)
    ]


def test_the_issue_example_line() -> None:
    imp = job_impact(straggling_job(), [2], CFG.impact_min_slowdown)
    assert imp is not None
    assert imp.line() == "job step 1.95 s, 11 x its normal 0.18 s; rank 2 accounts for 1.77 s of each step"
    assert imp.cost_s == ((2, 1.77),) or abs(imp.cost_s[0][1] - 1.77) < 1e-9
    assert imp.to_json()["cost_s"] == {"2": 1.77} and imp.to_json()["slowdown"] == round(1.95 / 0.18, 3)


def test_the_vote_names_the_straggler_and_reports_its_cost_in_reason_and_json() -> None:
    job = vote(straggling_job(), CFG)
    assert job.by_rank()[2].verdict == "slow"  # by its own compute (cohort): slow of its own
    assert job.impact is not None and [r for r, _ in job.impact.cost_s] == [2]
    assert "job step 1.95 s, 11 x its normal 0.18 s; rank 2 accounts for 1.77 s of each step" in job.reason
    doc = to_json(job)
    assert doc["schema"] == "gpuguard.job/1"  # an added field, the same schema
    assert doc["impact"]["line"] in doc["reason"] and doc["impact"]["cost_s"] == {"2": 1.77}


def test_a_healthy_job_has_no_impact() -> None:
    obs = [ob(r, period=0.18, normal=0.18, compute=0.15, normal_compute=0.15) for r in range(4)]
    job = vote(obs, CFG)
    assert job.verdict == "healthy" and job.impact is None and to_json(job)["impact"] is None
    assert job_impact(obs, [], CFG.impact_min_slowdown) is None
    assert job_impact([], [2], CFG.impact_min_slowdown) is None


def test_the_whole_job_slower_blames_nobody() -> None:
    obs = [ob(r, period=0.9, normal=0.18, compute=0.85, normal_compute=0.15) for r in range(4)]
    imp = job_impact(obs, [], CFG.impact_min_slowdown)
    assert imp is not None and imp.cost_s == ()
    assert imp.line() == "job step 0.90 s, 5.0 x its normal 0.18 s; no rank to blame (the whole job is slower)"
    below = job_impact(obs, [], 6.0)  # under the configured threshold: nothing worth a line
    assert below is None


def test_two_stragglers_share_the_cost() -> None:
    obs = straggling_job()
    obs[5] = replace(obs[5], recent_compute_s=1.9)
    imp = job_impact(obs, [5, 2], CFG.impact_min_slowdown)
    assert imp is not None and [r for r, _ in imp.cost_s] == [2, 5]
    assert imp.line().endswith("; ranks 2, 5 account for 1.77 s of each step")


def test_the_human_output_shows_the_line(capsys) -> None:
    doc = to_json(vote(straggling_job(), CFG), cohort_steps=_cohort())
    _print_human(doc)
    out = capsys.readouterr().out
    assert out.count("rank 2 accounts for 1.77 s of each step") == 1, out  # in the reason, not repeated
    # a job-wide slowdown is not in the (healthy) reason: its own line
    slow_all = [ob(r, period=0.9, normal=0.18, compute=0.85, normal_compute=0.15) for r in range(4)]
    _print_human(to_json(vote(slow_all, CFG), cohort_steps=_cohort()))
    assert "impact: job step 0.90 s, 5.0 x its normal 0.18 s" in capsys.readouterr().out


def _cohort() -> dict:
    d = {"n": 1, "p50": 0.1, "p90": 0.1, "p99": 0.1, "p999": 0.1, "max": 0.1}
    return {"period": d, "compute": d}


@given(
    st.lists(
        st.tuples(st.floats(0.001, 100), st.floats(0.001, 100), st.floats(0, 100), st.floats(0, 100)),
        min_size=1,
        max_size=12,
    ),
    st.sets(st.integers(0, 11), max_size=3),
)
def test_impact_is_finite_and_never_negative(rows, named) -> None:
    obs = [ob(i, period=p, normal=n, compute=c, normal_compute=nc) for i, (p, n, c, nc) in enumerate(rows)]
    imp = job_impact(obs, sorted(named), 1.5)
    if imp is None:
        return
    assert imp.slowdown > 0 and imp.job_step_s > 0 and imp.normal_step_s > 0
    assert all(c >= 0 and c == c for _, c in imp.cost_s)
    assert imp.line().startswith("job step ")


def test_at_the_onset_the_recent_collectives_show_the_cost_before_the_windows_median() -> None:
    # rank 3 arrived 1.5 s late at the last 4 collectives; the window's median step has not moved yet
    entries: dict[int, list[tuple[int, float, float]]] = {r: [] for r in range(4)}
    t = 1000.0
    for s in range(4):
        for r in range(4):
            arr = t + (1.5 if r == 3 else 0.0)
            entries[r].append((s, arr, t + 1.5 - arr))
        t += 1.7
    obs = [
        replace(ob(r, period=0.18, normal=0.18, compute=0.15, normal_compute=0.15), entries=tuple(entries[r]))
        for r in range(4)
    ]
    job = vote(obs, CFG)
    assert job.culprits == (3,) and job.impact is not None
    assert job.impact.wait_s == ((3, 1.5),)
    assert job.impact.line().endswith(
        "; rank 3 accounts for 0.00 s of each step so far, and now 1.50 s of each collective"
    )
    assert to_json(job)["impact"]["collective_wait_s"] == {"3": 1.5}
