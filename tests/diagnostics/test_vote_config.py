"""The straggler and hang thresholds live in vote.yaml, are validated there, and are the ones the rules use."""

from __future__ import annotations

import os
from dataclasses import fields, replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.diagnostics.arrival import stragglers
from gpuguard.diagnostics.jobstats import robust_tail
from gpuguard.diagnostics.vote import load_config
from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.errors import DataError
from gpuguard.foundation.observations import BETWEEN, ProcessState, RankObservation
from tests.support.cli import run_cli


def write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "vote.yaml"
    p.write_text("vote:\n" + body)
    return p


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("  arrival_window: 2.5\n", "arrival_window must be a whole number"),
        ("  arrival_window: 0\n", "arrival_window must be at least 1"),
        ("  arrival_min_frac: 1.5\n", "arrival_min_frac is a fraction"),
        ("  arrival_max_late_frac: 2\n", "arrival_max_late_frac is a fraction"),
        ("  arrival_min_wait_s: .nan\n", "is not a finite number"),
        ("  hang_k: .inf\n", "is not a finite number"),
        ("  hang_k: 2\n  hang_k: 3\n", "duplicate key 'hang_k'"),
        ("  bandwidth_bytes_s: 0\n", "bandwidth_bytes_s must be more than 0"),
        ("  outlier_cap_k: 0.5\n", "outlier_cap_k must be at least 1"),
        ("  arrival_window: 4\n  arrival_min_collectives: 5\n", "must not exceed arrival_window"),
        ("  hang_floor_s: 100\n  hang_cap_s: 10\n", "is above hang_cap_s"),
        ("  arrival_wait_frac: -0.1\n", "must be a finite non-negative number"),
    ],
)
def test_bad_thresholds_are_refused_with_the_key_named(tmp_path: Path, body: str, says: str) -> None:
    with pytest.raises(DataError, match=says):
        load_config(write(tmp_path, body))


def test_a_fifo_or_an_oversized_file_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file"):
        load_config(fifo)
    big = write(tmp_path, "  # " + "x" * 70_000 + "\n")
    with pytest.raises(DataError, match="more than the 64 KiB"):
        load_config(big)


def test_the_cli_refuses_a_bad_threshold_file_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    res = run_cli(
        "gpu-doctor",
        "diagnose",
        "job",
        "--job-dir",
        str(tmp_path / "job"),
        "--config",
        str(write(tmp_path, "  arrival_window: 0\n")),
    )
    assert res.returncode == 65 and res.stderr.count("\n") == 1 and "arrival_window" in res.stderr, res


def test_the_packaged_yaml_holds_every_arrival_and_outlier_threshold() -> None:
    text = (Path(__file__).resolve().parents[2] / "diagnostics" / "data" / "vote.yaml").read_text()
    for name in (
        "arrival_window",
        "arrival_min_collectives",
        "arrival_min_frac",
        "arrival_wait_frac",
        "arrival_noise_k",
    ):
        assert f"  {name}: " in text
    assert "  arrival_min_wait_s: " in text and "  arrival_max_late_frac: " in text and "  outlier_cap_k: " in text
    assert load_config() == VoteConfig()


ALIVE = ProcessState("running", "pid 1")


def ob(rank: int, entries) -> RankObservation:
    return RankObservation(
        rank=rank,
        alive=ALIVE,
        phase=BETWEEN,
        phase_step=100,
        phase_seq=entries[-1][0],
        n_steps=200,
        period_p50_s=0.1,
        period_p999_s=0.2,
        compute_p50_s=0.05,
        recent_compute_s=0.05,
        recent_period_s=0.1,
        entries=tuple(entries),
    )


def late_job(n_coll: int, late_rank: int = 3, by: float = 0.2):
    per: dict[int, list] = {r: [] for r in range(4)}
    t = 1000.0
    for s in range(n_coll):
        for r in range(4):
            arr = t + (by if r == late_rank else 0.0)
            per[r].append((s, arr, (t + by) - arr))
        t += by + 0.05
    return [ob(r, per[r]) for r in range(4)]


def test_the_arrival_rule_uses_the_configured_thresholds() -> None:
    obs = late_job(3)
    cfg = VoteConfig()
    assert set(stragglers(obs, cfg)) == {3}  # last at the 3 most recent collectives (2 needed by default)
    assert stragglers(obs, replace(cfg, arrival_min_collectives=4)) == {}  # 4 needed, 3 seen
    assert set(stragglers(late_job(2), replace(cfg, arrival_min_collectives=2))) == {3}
    assert stragglers(obs, replace(cfg, arrival_wait_frac=5.0)) == {}  # a 0.2 s wait under 5 x 0.05 s of compute
    assert stragglers(obs, replace(cfg, arrival_min_wait_s=0.5)) == {}
    assert set(stragglers(obs, replace(cfg, arrival_max_late_frac=0.25))) == {3}
    assert stragglers(obs, replace(cfg, arrival_max_late_frac=0.2)) == {}  # one in four is "the pace"


def test_the_outlier_cap_is_the_configured_one() -> None:
    periods = sorted([0.1] * 997 + [0.2, 0.2, 40.0])
    assert robust_tail(periods, 0.999) == robust_tail(periods, 0.999, VoteConfig().outlier_cap_k)
    assert robust_tail(periods, 0.999, 100.0) > robust_tail(periods, 0.999, 2.0)


@given(st.dictionaries(st.sampled_from([f.name for f in fields(VoteConfig)]), st.floats(-10, 1e6)))
def test_load_config_either_refuses_in_one_datarror_or_gives_a_usable_config(over: dict) -> None:
    try:
        cfg = load_config(overrides=over)
    except DataError as exc:
        assert "\n" not in str(exc)
        return
    assert 1 <= cfg.arrival_min_collectives <= cfg.arrival_window and cfg.bandwidth_bytes_s > 0
    assert 0 <= cfg.arrival_min_frac <= 1 and cfg.outlier_cap_k >= 1 and cfg.hang_floor_s <= cfg.hang_cap_s
