"""An unreadable step log through `gpu-doctor diagnose job` (the real console script): that rank is
`unknown` with the reason, never hung, dead or missing, and the job is not called healthy (issue 15)."""

from __future__ import annotations

import json
from pathlib import Path

from gpuguard.doctor.job_observation import observe_job
from tests.support.step_jobs import live_step_job


def test_a_directory_for_a_step_log_is_unknown_with_the_reason(cli, tmp_path: Path) -> None:
    segs = live_step_job(tmp_path)
    segs[2].unlink()
    segs[2].mkdir()
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--json")
    doc = json.loads(r.stdout)
    by = {x["rank"]: x for x in doc["ranks"]}
    assert sorted(by) == [0, 1, 2], doc  # rank 2 used to vanish from the report
    assert by[2]["verdict"] == "unknown" and by[2]["reason"].startswith("step log unreadable: "), by[2]
    assert "is a directory" in by[2]["reason"] and "\n" not in by[2]["reason"]
    assert doc["verdict"] == "unknown" and r.returncode == 3, doc  # not healthy: one rank is not known
    human = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path))
    assert human.returncode == 3 and "rank 2: unknown" in human.stdout and "step log unreadable" in human.stdout


def test_a_garbage_step_log_is_unknown_not_hung(cli, tmp_path: Path) -> None:
    segs = live_step_job(tmp_path)
    segs[1].write_bytes(b"\x00\x01 not a record\n" * 40)  # its age used to be "since 1970": hung
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--json")
    doc = json.loads(r.stdout)
    by = {x["rank"]: x for x in doc["ranks"]}
    assert by[1]["verdict"] == "unknown" and "none a step record" in by[1]["reason"], by[1]
    assert by[0]["verdict"] == by[2]["verdict"] == "healthy" and not doc["culprits"], doc
    assert doc["verdict"] == "unknown" and r.returncode == 3


def test_the_observation_of_an_unreadable_rank_carries_the_reason(tmp_path: Path) -> None:
    segs = live_step_job(tmp_path)
    segs[0].unlink()
    segs[0].mkdir()
    records, obs = observe_job(tmp_path)
    assert [o.rank for o in obs] == [0, 1, 2] and 0 in records.unusable
    assert not obs[0].has_records and obs[0].notes[0].startswith("step log unreadable: ")
