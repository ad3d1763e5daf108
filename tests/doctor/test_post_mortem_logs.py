"""`gpu-doctor diagnose job --log`, post-mortem: training logs judged like live step records.

The logs are torchrun/NCCL-shaped: the watchdog lines are the real ones of
`shared/real-logs/053-watchdog.log` (PyTorch 2.x ProcessGroupNCCL, `[rankN]:` prefix, glog time),
re-stamped for each rank; the step lines carry PyTorch's `[rankN]:` or torchrun's `[defaultN]:` prefix
and a Python-logging timestamp. The files are written now, months after their lines' times: an age
taken from the file's mtime (as before) calls every rank fresh.

Before: the case below ("ranks 0-2 print a 600 s NCCL watchdog timeout and rank 3 stopped a step early")
was "job HEALTHY: all 4 ranks progressing", exit 0; 053's two timed-out ranks a healthy "job-wide
pause"; after an in-place shrink 3 -> 2 the vote invented a rank 2 (UNKNOWN, exit 3).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.collectors.log_steps import LogStepSpec, line_rank, read_log_job
from tests.support.cli import REAL_LOGS, run_cli

T0 = dt.datetime(2025, 6, 26, 6, 14, 0)
WATCHDOG = (REAL_LOGS / "053-watchdog.log").read_text().splitlines()[0]  # rank 1's real timeout line


def stamp(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S,") + f"{t.microsecond // 1000:03d}"


def watchdog_line(rank: int, at: dt.datetime) -> str:
    """The real line with its rank and time replaced (glog: `E<MDD> <HH:MM:SS>.<ns>`, the month unpadded)."""
    line = WATCHDOG.replace("[rank1]:", f"[rank{rank}]:").replace("[Rank 1]", f"[Rank {rank}]")
    return re.sub(r"\[E\d{3,4} \d{2}:\d{2}:\d{2}\.", f"[E{at.month}{at:%d %H:%M:%S}.", line)


def training_log(path: Path, prefix: str = "rank", ranks: int = 4, steps: int = 20, stopped: int = 3) -> Path:
    """Every rank logs one line per step (1 s steps); rank `stopped` stops a step early; the others time
    out 600 s later in the NCCL watchdog, as 053's ranks do."""
    lines = []
    for step in range(1, steps + 1):
        for r in range(ranks):
            if r == stopped and step == steps:
                continue
            t = T0 + dt.timedelta(seconds=step, milliseconds=10 * r)
            lines.append(f"[{prefix}{r}]:{stamp(t)} - INFO - train.py:88 - step {step} loss {2 - step / 100:.3f}")
    timeout = T0 + dt.timedelta(seconds=steps + 600)
    lines += [watchdog_line(r, timeout) for r in range(ranks) if r != stopped]
    path.write_text("\n".join(lines) + "\n")
    return path


def diagnose(tmp_path: Path, *args: str):
    job = tmp_path / "job"
    job.mkdir(exist_ok=True)
    return run_cli("gpu-doctor", "diagnose", "job", "--job-dir", str(job), *args, timeout=60)


@pytest.mark.parametrize("prefix", ["rank", "default"])  # PyTorch's [rankN]: / torchrun's [defaultN]: prefix
def test_the_rank_that_stopped_a_step_early_is_named_and_the_watchdog_ranks_are_its_victims(tmp_path, prefix):
    log = training_log(tmp_path / "train.log", prefix)
    r = diagnose(tmp_path, "--log", str(log), "--log-regex", r"step (?P<step>\d+) loss", "--json")
    assert r.returncode == 2, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] in ("hung", "dead") and doc["culprits"] == [3]
    ranks = {x["rank"]: x for x in doc["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert ranks[3]["verdict"] in ("hung", "dead") and ranks[3]["step"] == 19
    assert 600 < ranks[3]["phase_age_s"] < 603  # the log's own times, not the file's age
    for victim in (0, 1, 2):
        assert ranks[victim]["blocked_by"] == [3] and ranks[victim]["collective_seq"] == 808
        assert "its NCCL watchdog timed out in ALLREDUCE #808 after 600 s" in ranks[victim]["notes"][-1]
    assert doc["post_mortem"]["ranks"] == [0, 1, 2, 3]
    page = diagnose(tmp_path, "--log", str(log), "--log-regex", r"step (?P<step>\d+) loss")
    assert page.returncode == 2 and "HEALTHY" not in page.stdout
    assert "rank 3: hung (culprit)" in page.stdout or "rank 3: dead (culprit)" in page.stdout
    assert "rank 0: healthy (victim of rank 3)" in page.stdout
    assert "judged from their logs as of 2025-06-26 06:24:20" in page.stdout


def test_every_rank_in_the_log_timed_out_is_a_hung_collective_not_a_pause(tmp_path):
    r = diagnose(tmp_path, "--log", str(REAL_LOGS / "053-watchdog.log"), "--json")
    assert r.returncode == 2, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "hung" and doc["culprits"] == []
    assert doc["reason"].startswith("ALLREDUCE #808 failed in the NCCL watchdog on rank(s) 0, 1")
    assert {x["rank"]: x["verdict"] for x in doc["ranks"]} == {0: "hung", 1: "hung"}
    # 051: ranks 0 and 4 time out in #1580, rank 3's watchdog reports it stuck there too: one stuck collective
    r = diagnose(tmp_path, "--log", str(REAL_LOGS / "051-watchdog.log"), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 2 and {x["rank"]: x["collective_seq"] for x in doc["ranks"]} == {0: 1580, 3: 1580, 4: 1580}


def test_a_log_without_a_watchdog_line_keeps_the_step_vote(tmp_path):
    log = tmp_path / "ok.log"
    log.write_text(
        "\n".join(
            f"[rank{r}]:{stamp(T0 + dt.timedelta(seconds=s, milliseconds=5 * r))} step {s}"
            for s in range(1, 30)
            for r in range(2)
        )
        + "\n"
    )
    r = diagnose(tmp_path, "--log", str(log), "--log-regex", r"step (?P<step>\d+)", "--json")
    assert r.returncode == 0, r.stdout
    assert json.loads(r.stdout)["verdict"] == "healthy"  # as of its last line, every rank was stepping


# --- the reader: ranks from prefixes, times from the lines (property-based) -------------------------------

ROLE = st.text(string.ascii_letters + "_", min_size=1, max_size=12)


@given(rank=st.integers(0, 9_999_999), role=ROLE, rest=st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_line_rank_reads_pytorch_and_torchrun_prefixes(rank, role, rest):
    assert line_rank(f"[rank{rank}]:{rest}") == rank
    assert line_rank(f"[{role}{rank}]:{rest}") == rank
    assert line_rank(f"[{rank}]:{rest}") == rank
    found = line_rank(f"xx [{role}{rank}]: not at the start")  # a range check, not a 10-million tuple (98 s)
    assert found is None or (isinstance(found, int) and 0 <= found < 10_000_000)


@given(st.lists(st.text(max_size=80), max_size=40), st.booleans())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_read_log_job_never_raises_and_ages_are_ordered(tmp_path, lines, with_watchdog):
    log = tmp_path / "fuzz.log"
    extra = [watchdog_line(1, T0)] if with_watchdog else []
    log.write_bytes("\n".join([*lines, *extra]).encode("utf-8", "surrogatepass"))
    job = read_log_job([log, tmp_path / "missing.log"], LogStepSpec.compile(r"s(?P<step>-?\d+)"))
    for s in job.ranks.values():
        assert all(x.compute_s >= 0 for x in s.steps)
        if job.end_wall is not None and s.last_wall:
            assert s.last_wall <= job.end_wall + 1e-6 or s.phase.kind == "collective"
    if with_watchdog:
        assert job.timeouts[1]["seq"] == 808 and job.ranks[1].phase.seq == 808


# --- only the active generation's world ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_after_an_in_place_shrink_no_rank_of_the_old_world_is_invented(tmp_path):
    """3 real workers (gpuguard.examples.inplace_train), rank 2 SIGKILLed at step 5: the survivors certify
    generation 2 with 2 members in place and finish. Their step logs still say WORLD_SIZE 3 (torchrun's
    launch world): the vote must judge ranks 0 and 1, and list the old rank 2 apart, not invent it."""
    from gpuguard.examples.inplace_train import Cluster
    from gpuguard.generation.ledger_open import open_ledger

    job = tmp_path / "job"
    with Cluster.launch(job, 3, steps=12, faults="2:5:before_allreduce:kill", step_sleep=0.05, grace=3.0) as c:
        codes = c.wait(150)
        assert codes[0] == 0 and codes[1] == 0, c.log(0)[-2000:]
    assert len(open_ledger(job).require_active().members) == 2
    r = run_cli("gpu-doctor", "diagnose", "job", "--job-dir", str(job), "--json", timeout=60)
    doc = json.loads(r.stdout)
    assert r.returncode != 3, doc
    assert [x["rank"] for x in doc["ranks"]] == [0, 1]
    assert 2 in [x["rank"] for x in doc["superseded"]]
