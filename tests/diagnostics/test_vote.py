"""The dead-vs-slow vote on constructed observations: each dimension, the combination rules, coupling."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.diagnostics.vote import load_config, to_json, vote
from gpuguard.diagnostics.voters import VoteConfig, expected_collective_s, hang_bound_s
from gpuguard.foundation.errors import DataError
from gpuguard.foundation.observations import (
    BETWEEN,
    COLLECTIVE,
    COMPUTING,
    STARTING,
    CommError,
    HardwareEvidence,
    ProcessState,
    RankObservation,
)

CFG = VoteConfig()
ALIVE = ProcessState("running", "pid 1")


def ob(
    rank: int,
    phase: str = BETWEEN,
    age: float = 0.01,
    *,
    step: int = 100,
    seq: int | None = None,
    p999: float = 0.2,
    compute: float = 0.05,
    alive: ProcessState = ALIVE,
    **kw,
) -> RankObservation:
    if seq is None:
        seq = step if phase == COLLECTIVE else step - 1
    return RankObservation(
        rank=rank,
        alive=alive,
        phase=phase,
        phase_step=step,
        phase_seq=seq,
        phase_age_s=age,
        progress_age_s=age,
        n_steps=200,
        period_p50_s=0.1,
        period_p99_s=p999 * 0.8,
        period_p999_s=p999,
        compute_p50_s=compute,
        compute_p999_s=compute * 2,
        recent_compute_s=compute,
        recent_period_s=0.1,
        **kw,
    )


def verdicts(job) -> dict[int, str]:
    return {r.rank: r.verdict for r in job.ranks}


def test_healthy_cohort() -> None:
    job = vote([ob(r, compute=0.05 + r * 0.001) for r in range(8)], CFG)
    assert set(verdicts(job).values()) == {"healthy"} and job.exit_code == 0 and job.culprits == ()


def test_straggler_is_named_by_its_own_compute_not_the_shared_wall_step() -> None:
    # everyone's wall step is the same (coupled); rank 5 computes 3x longer, the others wait for it
    obs = [ob(r, compute=0.15 if r == 5 else 0.05) for r in range(8)]
    job = vote(obs, CFG)
    assert verdicts(job) == {r: ("slow" if r == 5 else "healthy") for r in range(8)}
    assert job.exit_code == 1
    ev = next(v for v in job.by_rank()[5].votes if v.dimension == "cohort")
    assert ev.numbers["score"] < 0.75 and ev.numbers["z"] > 3.5


def test_the_rank_that_never_arrived_is_hung_the_waiters_are_not() -> None:
    age = 30.0  # far past max(3 x 0.2 s, 5 s floor) + one confirm interval
    obs = [ob(r, COLLECTIVE, age) for r in range(4) if r != 2] + [ob(2, COMPUTING, age + 0.05)]
    job = vote(obs, CFG)
    assert verdicts(job) == {0: "healthy", 1: "healthy", 2: "hung", 3: "healthy"}
    assert job.culprits == (2,)
    for r in (0, 1, 3):
        assert job.by_rank()[r].blocked_by == (2,)
        assert "never arrived" in job.by_rank()[r].reason
    assert job.exit_code == 2


def test_a_stopped_rank_inside_the_collective_is_the_culprit() -> None:
    stopped = ProcessState("stopped", "pid 9 status stopped")
    obs = [ob(r, COLLECTIVE, 30.0) for r in range(4) if r != 1] + [ob(1, COLLECTIVE, 30.0, alive=stopped)]
    job = vote(obs, CFG)
    assert verdicts(job) == {0: "healthy", 1: "hung", 2: "healthy", 3: "healthy"}
    assert job.culprits == (1,)
    assert "stopped" in job.by_rank()[1].reason


def test_a_short_stop_is_slow_paused_never_dead_or_hung() -> None:
    stopped = ProcessState("stopped", "pid 9 status stopped")
    for age in (0.05, 1.5, 3.0, 5.5):  # up to the bound + confirmation window (6 s)
        obs = [ob(r, COLLECTIVE, age) for r in range(4) if r != 1] + [ob(1, COMPUTING, age, alive=stopped)]
        v = verdicts(vote(obs, CFG))
        assert v[1] == "slow", (age, v)
        assert all(x == "healthy" for r, x in v.items() if r != 1)


def test_process_gone_is_dead_at_once_and_a_clean_exit_is_not() -> None:
    gone = ProcessState("gone", "pid 7 does not exist")
    job = vote([ob(r) for r in range(3)] + [ob(3, COMPUTING, 0.02, alive=gone)], CFG)
    assert verdicts(job)[3] == "dead" and job.culprits == (3,)
    closed = replace(ob(3, "closed", 1.0, alive=gone), closed=True)
    assert verdicts(vote([ob(r) for r in range(3)] + [closed], CFG))[3] == "healthy"
    zombie = ProcessState("zombie", "pid 7 zombie")
    assert verdicts(vote([ob(r) for r in range(3)] + [ob(3, alive=zombie)], CFG))[3] == "dead"


def test_collateral_deaths_are_not_culprits() -> None:
    """torchrun tears every worker down after one dies: the one that died first is the culprit."""
    gone = ProcessState("gone", "gone")
    obs = [
        ob(r, COLLECTIVE, 2.0, alive=gone, errors=("Connection closed by peer [127.0.0.1]:4000",)) for r in (0, 1, 3)
    ]
    obs.append(ob(2, COMPUTING, 2.0, alive=gone))
    job = vote(obs, CFG)
    assert set(verdicts(job).values()) == {"dead"}
    assert job.culprits == (2,)
    assert "collateral" in job.by_rank()[0].reason
    # killed while inside the collective: the phase cannot tell, the victims' own errors do
    obs = [ob(r, COLLECTIVE, 2.0, alive=gone, errors=("Connection reset by peer",)) for r in (0, 1, 3)]
    obs.append(ob(2, COLLECTIVE, 2.0, alive=gone))
    assert vote(obs, CFG).culprits == (2,)


def test_two_independent_dimensions_need_a_second_check_for_dead() -> None:
    xid = HardwareEvidence(2, "xid", True, "Xid 79: GPU has fallen off the bus")
    peers = tuple(CommError(r, 2, "NCCL error: remote rank 2 unreachable") for r in (0, 1))
    obs = [ob(r) for r in (0, 1, 3)] + [ob(2, hardware=(xid,), comm_errors=peers)]
    first = vote(obs, CFG)
    assert verdicts(first)[2] != "dead" and first.by_rank()[2].pending_dead
    second = vote(obs, CFG, previous=first)
    assert verdicts(second)[2] == "dead" and "two consecutive checks" in second.by_rank()[2].reason
    # one non-decisive dimension alone is never enough
    lone = vote([ob(r) for r in (0, 1, 3)] + [ob(2, hardware=(xid,))], CFG)
    assert verdicts(vote([ob(r) for r in (0, 1, 3)] + [ob(2, hardware=(xid,))], CFG, previous=lone))[2] == "slow"


def test_gpu_lost_is_decisive() -> None:
    lost = HardwareEvidence(0, "gpu-lost", True, "NVML: GPU is lost")
    assert verdicts(vote([ob(0, hardware=(lost,)), ob(1), ob(2)], CFG))[0] == "dead"


def test_everyone_in_the_collective_and_stuck_is_hung_without_a_culprit() -> None:
    job = vote([ob(r, COLLECTIVE, 60.0) for r in range(4)], CFG)
    assert set(verdicts(job).values()) == {"hung"} and job.culprits == ()
    assert "collective itself is stuck" in job.ranks[0].reason


def test_bound_is_the_ranks_own_and_large_collectives_widen_it() -> None:
    fast = ob(0, COMPUTING, 15.0, p999=1.0)
    slow_stage = ob(1, COMPUTING, 15.0, p999=10.0)  # a pipeline stage whose steps are 10x longer
    assert hang_bound_s(fast, 2, CFG) == pytest.approx(5.0)
    assert hang_bound_s(slow_stage, 2, CFG) == pytest.approx(20.0)
    v = verdicts(vote([fast, slow_stage], CFG))
    assert v == {0: "hung", 1: "slow"}  # same age: hung for one, only paused for the other
    big = ob(0, COLLECTIVE, 7.0, p999=1.0, nbytes=40 * 10**9)  # 40 GB all-gather at 10 GB/s
    assert expected_collective_s(big.nbytes, 2, CFG) > 3.0
    assert hang_bound_s(big, 2, CFG) > 7.0 + 1.0
    assert verdicts(vote([big, ob(1, COLLECTIVE, 7.0, p999=1.0, nbytes=40 * 10**9)], CFG))[0] != "hung"


def test_few_samples_and_startup_use_the_generous_initial_bounds() -> None:
    young = replace(ob(0, COMPUTING, 100.0), n_steps=3)
    starting = replace(ob(1, STARTING, 400.0, step=-1), n_steps=0)
    assert hang_bound_s(young, 2, CFG) == CFG.initial_timeout_s
    assert hang_bound_s(starting, 2, CFG) == CFG.startup_timeout_s
    assert "hung" not in verdicts(vote([young, starting], CFG)).values()


def test_empty_single_and_recordless() -> None:
    assert vote([], CFG).verdict == "unknown" and vote([], CFG).exit_code == 3
    one = vote([ob(0)], CFG)
    assert one.verdict == "healthy" and "no cohort" in one.reason
    norec = replace(ob(1), has_records=False)
    job = vote([ob(0), norec], CFG)
    assert verdicts(job)[1] == "unknown" and job.verdict == "unknown" and job.exit_code == 3


def test_json_document_schema() -> None:
    doc = to_json(vote([ob(r) for r in range(3)], CFG), job_dir="/j", config=CFG)
    assert doc["schema"] == "gpuguard.job/1" and doc["exit_code"] == 0
    assert {"rank", "verdict", "reason", "evidence", "culprit", "blocked_by"} <= set(doc["ranks"][0])
    assert doc["thresholds"]["hang_k"] == CFG.hang_k


def test_yaml_defaults_match_the_documented_dataclass(tmp_path: Path) -> None:
    assert load_config() == VoteConfig()
    bad = tmp_path / "v.yaml"
    bad.write_text("vote:\n  hang_kk: 3\n")
    with pytest.raises(DataError):
        load_config(bad)
    bad.write_text("vote:\n  hang_k: fast\n")
    with pytest.raises(DataError):
        load_config(bad)
    bad.write_text("[1, 2")
    with pytest.raises(DataError):
        load_config(bad)
    assert load_config(overrides={"hang_floor_s": 9}).hang_floor_s == 9.0


_phases = st.sampled_from([BETWEEN, COMPUTING, COLLECTIVE, STARTING, "closed"])
_states = st.sampled_from(["running", "sleeping", "stopped", "zombie", "gone", "disk-sleep", "unknown"])


@st.composite
def _obs(draw, rank: int) -> RankObservation:
    return RankObservation(
        rank=rank,
        alive=ProcessState(draw(_states)),
        has_records=draw(st.booleans()),
        phase=draw(_phases),
        phase_step=draw(st.integers(-1, 50)),
        phase_seq=draw(st.integers(-1, 50)),
        phase_age_s=draw(st.floats(0, 1e5)),
        progress_age_s=draw(st.floats(0, 1e5)),
        n_steps=draw(st.integers(0, 3000)),
        period_p50_s=draw(st.floats(0, 100)),
        period_p99_s=draw(st.floats(0, 100)),
        period_p999_s=draw(st.floats(0, 100)),
        recent_compute_s=draw(st.floats(0, 100)),
        nbytes=draw(st.integers(0, 10**12)),
        closed=draw(st.booleans()),
        hardware=tuple(
            draw(
                st.lists(
                    st.builds(
                        HardwareEvidence, st.just(rank), st.sampled_from(["xid", "gpu-lost", "ecc"]), st.booleans()
                    ),
                    max_size=2,
                )
            )
        ),
        comm_errors=tuple(
            draw(st.lists(st.builds(CommError, st.integers(0, 5), st.one_of(st.none(), st.integers(0, 5))), max_size=2))
        ),
    )


@given(st.integers(0, 6).flatmap(lambda n: st.tuples(*[_obs(r) for r in range(n)])))
@settings(max_examples=150, deadline=None)
def test_vote_never_crashes_and_is_deterministic(obs) -> None:
    a, b = vote(list(obs), CFG), vote(list(reversed(obs)), CFG)
    assert a == b
    assert {r.verdict for r in a.ranks} <= {"dead", "hung", "slow", "healthy", "unknown"}
    assert a.exit_code in (0, 1, 2, 3)
    for r in a.ranks:
        if r.verdict == "dead":  # only on a decisive signal (no previous check here)
            assert any(v.decisive and v.verdict == "dead" for v in r.votes)
    assert set(a.culprits) <= {r.rank for r in a.ranks}


def test_every_config_field_is_documented_in_the_yaml() -> None:
    text = (Path(__file__).resolve().parents[2] / "diagnostics" / "data" / "vote.yaml").read_text()
    for f in fields(VoteConfig):
        assert f"  {f.name}:" in text


def test_node_report_evidence_maps_onto_the_ranks_gpu() -> None:
    from gpuguard.diagnostics.jobevidence import hardware_from_node_reports

    doc = {
        "schema": "gpuguard.node/1",
        "node": "n1",
        "gpus": [
            {
                "index": 1,
                "evidence": [
                    {"verdict": "drain", "check": "gpu_lost", "message": "NVML: GPU is lost"},
                    {"verdict": "healthy", "check": "xid.63", "message": "Xid 63"},
                ],
            },
            {"index": 2, "evidence": [{"verdict": "reset", "check": "xid.48", "message": "Xid 48: DBE"}]},
            {"index": 3, "evidence": [{"verdict": "degraded", "check": "ecc.volatile", "message": "ECC"}]},
            {"index": "x"},
            "junk",
        ],
    }
    ranks = {0: ("n1", 0), 1: ("n1", 1), 2: ("n1", 2), 3: ("n1", 3), 4: ("n2", 1), 5: ("n1", None)}
    ev = hardware_from_node_reports([doc, {"schema": "other"}, "junk"], ranks)
    assert set(ev) == {1, 2, 3}
    assert ev[1][0].kind == "gpu-lost" and ev[1][0].fatal and len(ev[1]) == 1
    assert ev[2][0].kind == "xid" and ev[2][0].fatal and not ev[3][0].fatal
    job = vote([ob(r, hardware=ev.get(r, ())) for r in range(4)], CFG)
    assert verdicts(job) == {0: "healthy", 1: "dead", 2: "slow", 3: "healthy"}


def test_peer_named_in_an_error_message_becomes_comm_evidence() -> None:
    from gpuguard.diagnostics.jobstats import comm_errors_from_text

    errs = comm_errors_from_text(
        0, ["NCCL WARN Net : Connection closed by remote peer 3", "Connection reset [127.0.0.1]:4"]
    )
    assert [(e.rank, e.peer) for e in errs] == [(0, 3), (0, None)]
    obs = [ob(0, comm_errors=errs), ob(1), ob(2), ob(3)]
    job = vote(obs, CFG)
    assert next(v for v in job.by_rank()[3].votes if v.dimension == "communication").verdict == "dead"
    assert verdicts(job)[3] == "slow"  # one dimension alone is not enough for dead


def test_a_job_wide_pause_blames_nobody_but_a_straggler_stays_slow() -> None:
    obs = [ob(r, BETWEEN, 3.0, compute=0.15 if r == 2 else 0.05) for r in range(4)]
    job = vote(obs, CFG)
    assert verdicts(job) == {0: "healthy", 1: "healthy", 2: "slow", 3: "healthy"}
    assert "job-wide pause" in job.by_rank()[0].reason
    # past the hang bound it is no longer a pause: everyone idle and alive is hung
    stuck = vote([ob(r, BETWEEN, 60.0) for r in range(4)], CFG)
    assert set(verdicts(stuck).values()) == {"hung"} and stuck.culprits == ()


def test_killed_inside_the_collective_the_silent_one_is_the_culprit() -> None:
    gone = ProcessState("gone", "gone")
    obs = [ob(r, COLLECTIVE, 2.0, alive=gone, errors=("all_reduce 9: Connection closed by peer",)) for r in (0, 1, 3)]
    obs.append(ob(2, COLLECTIVE, 2.0, alive=gone))
    job = vote(obs, CFG)
    assert job.culprits == (2,)
    assert all("collateral" in job.by_rank()[r].reason for r in (0, 1, 3))
    assert "stuck" not in job.by_rank()[0].reason


@given(st.integers(2, 12), st.data())
@settings(max_examples=100, deadline=None)
def test_coupling_property_waiters_are_never_blamed(n: int, data) -> None:
    """One rank that has not arrived, every other rank waiting for it in the collective, arbitrary ages
    and learned quantiles: no waiter is ever dead or hung, and the late rank is the only one named."""
    late = data.draw(st.integers(0, n - 1))
    age = data.draw(st.floats(0, 5000))
    p999 = data.draw(st.floats(0.01, 100))
    obs = []
    for r in range(n):
        if r == late:
            if data.draw(st.booleans()):  # still computing step 100 (it left collective 99)
                obs.append(ob(r, COMPUTING, age, p999=p999, step=100, seq=99))
            else:  # finished step 99, has not begun step 100
                obs.append(ob(r, BETWEEN, age, p999=p999, step=99, seq=99))
        else:
            obs.append(ob(r, COLLECTIVE, data.draw(st.floats(0, age)), p999=data.draw(st.floats(0.01, 100))))
    job = vote(obs, CFG)
    for r in job.ranks:
        if r.rank != late:
            assert r.verdict not in ("dead", "hung"), r
    assert job.by_rank()[late].verdict != "dead"
    assert set(job.culprits) <= {late}
    if job.by_rank()[late].verdict == "hung":
        assert job.culprits == (late,)


def test_idle_together_at_the_pause_boundary_is_not_slow() -> None:
    # a check that lands just as the whole job crosses the pause bound: ages 1.003 vs 0.999
    obs = [ob(0, BETWEEN, 1.003, p999=0.01), ob(1, BETWEEN, 0.999, p999=0.01), ob(2, BETWEEN, 1.001, p999=0.01)]
    assert set(verdicts(vote(obs, CFG)).values()) == {"healthy"}
    # one rank idle while the others progress is paused
    obs = [ob(0, BETWEEN, 2.5, p999=0.01), ob(1, BETWEEN, 0.01, p999=0.01), ob(2, COMPUTING, 0.02, p999=0.01)]
    assert verdicts(vote(obs, CFG))[0] == "slow"


def test_a_named_culprit_that_dies_stays_the_cause_of_later_silent_deaths() -> None:
    """Rank 1 was stopped inside the collective (named hung), then SIGKILLed; torchrun's SIGTERM then
    takes the others down before they report anything. Nothing in the final picture tells the
    culprit apart (all four died silently inside the same collective) except the previous check."""
    stopped = ProcessState("stopped", "pid 9 status stopped")
    before = vote([ob(r, COLLECTIVE, 30.0) for r in (0, 2, 3)] + [ob(1, COLLECTIVE, 30.0, alive=stopped)], CFG)
    assert before.culprits == (1,)
    gone = ProcessState("gone", "gone")
    all_dead = [ob(r, COLLECTIVE, 31.0, alive=gone) for r in range(4)]
    without_memory = vote(all_dead, CFG)
    assert set(verdicts(without_memory).values()) == {"dead"}
    assert without_memory.culprits == (0, 1, 2, 3)  # the picture alone cannot tell them apart
    job = vote(all_dead, CFG, previous=before)
    assert set(verdicts(job).values()) == {"dead"}
    assert job.culprits == (1,)
    assert all("collateral" in job.by_rank()[r].reason for r in (0, 2, 3))
    # and it carries on from check to check
    assert vote(all_dead, CFG, previous=job).culprits == (1,)
