"""`gpu-doctor diagnose job`, `watch job` and `plan ...` through the real console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpuguard.foundation.steplog import StepLog, segment_name
from tests.support.cli import REAL_LOGS


def _steps(log: StepLog, n: int, compute: float, start: int = 0) -> None:
    for s in range(start, start + n):
        log.begin_step(s)
        time.sleep(compute)
        log.enter_collective(s, "all_reduce", 4096)
        log.exit_collective(s)
        log.end_step(s)


def test_plan_checkpoint_matches_the_seed(cli) -> None:
    r = cli("gpu-doctor", "plan", "checkpoint", "--cost", "60", "--failures-per-hour", "0.333333", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "gpuguard.plan/1"
    assert abs(doc["interval_s"] / 60 - 19.0) < 0.1 and abs(doc["overhead_fraction"] - 0.105) < 0.001
    human = cli(
        "gpu-doctor",
        "plan",
        "checkpoint",
        "--cost",
        "60",
        "--mtbf-hours",
        "30000",
        "--gpus",
        "10000",
        "--async-blocking",
        "5",
    )
    assert human.returncode == 0 and "overhead" in human.stdout and "async" in human.stdout
    for bad in (
        ["--cost", "60"],
        ["--cost", "60", "--failures-per-hour", "1", "--gpus", "8"],
        ["--cost", "-1", "--failures-per-hour", "1"],
    ):
        r = cli("gpu-doctor", "plan", "checkpoint", *bad)
        assert r.returncode == 64 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, bad


def test_plan_layout_and_collective(cli) -> None:
    r = cli("gpu-doctor", "plan", "layout", "--tp", "8", "--pp", "16", "--dp", "64", "--failed-rank", "1000", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["world"] == 8192 and doc["shrink"]["gpus_lost"] == 128
    assert doc["tp_group"] == list(range(1000, 1008))
    human = cli("gpu-doctor", "plan", "layout", "--tp", "8", "--pp", "16", "--dp", "64", "--failed-rank", "1000")
    assert "8192 = 64 (dp) × 16 (pp) × 8 (tp)" in human.stdout and "8064" in human.stdout
    assert (
        cli("gpu-doctor", "plan", "layout", "--tp", "8", "--pp", "1", "--dp", "1", "--failed-rank", "8").returncode
        == 64
    )
    c = cli("gpu-doctor", "plan", "collective", "--ranks", "8", "--bytes", "1GiB", "--bandwidth", "100GB/s", "--json")
    doc = json.loads(c.stdout)
    assert c.returncode == 0 and doc["best"] == "ring"
    assert abs(doc["ring_bandwidth_term_s"] - 2 * 7 / 8 * 2**30 / 100e9) < 1e-9
    assert (
        cli("gpu-doctor", "plan", "collective", "--ranks", "8", "--bytes", "lots", "--bandwidth", "1e9").returncode
        == 64
    )


def test_diagnose_missing_and_empty_job_dirs(cli, tmp_path: Path) -> None:
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path / "nope"))
    assert r.returncode == 66 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 3 and doc["schema"] == "gpuguard.job/1" and doc["verdict"] == "unknown"
    assert "no rank" in doc["reason"]
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("vote: {hang_k: -1}\n")
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--config", str(cfg))
    assert r.returncode == 65 and "hang_k" in r.stderr


def test_diagnose_healthy_slow_and_dead_with_bad_files(cli, tmp_path: Path) -> None:
    logs = [StepLog(tmp_path, r, f"inc{r}") for r in range(4)]
    for s in range(12):
        for log in logs:
            _steps(log, 1, 0.002, start=s)
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0, doc
    assert [x["verdict"] for x in doc["ranks"]] == ["healthy"] * 4
    assert doc["cohort_step_s"]["compute"]["n"] == 48 and {"p50", "p90", "p99", "p999"} <= set(
        doc["cohort_step_s"]["period"]
    )

    # rank 2 becomes a straggler by its own compute time
    for s in range(12, 32):
        for r, log in enumerate(logs):
            _steps(log, 1, 0.03 if r == 2 else 0.002, start=s)
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1, doc
    assert {x["rank"]: x["verdict"] for x in doc["ranks"]} == {0: "healthy", 1: "healthy", 2: "slow", 3: "healthy"}

    # a rank whose process is gone (a real child that wrote steps and was killed), plus a torn file and junk
    code = (
        f"import sys,time; from gpuguard.foundation.steplog import StepLog; l=StepLog({str(tmp_path)!r}, 4, 'child');"
        "[(l.begin_step(s), l.enter_collective(s,'all_reduce',8), l.exit_collective(s), l.end_step(s)) for s in range(40)];"
        "l.begin_step(40); print('ready', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        child.kill()
        child.wait(timeout=10)
    with open(tmp_path / "ranks" / segment_name(0, "inc0", 0), "ab") as fh:
        fh.write(b"E 99 17")  # torn
    (tmp_path / "ranks" / "7.junk.000000.steplog").write_bytes(b"\x00\xffnot a record\n")
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 2, doc
    v = {x["rank"]: x for x in doc["ranks"]}
    assert v[4]["verdict"] == "dead" and v[4]["process"] == "gone" and 4 in doc["culprits"]
    assert v[7]["verdict"] in ("unknown", "hung", "slow")  # header-less junk: no pid, no steps
    assert any("rank 4: dead" in s for s in doc["next_steps"])
    human = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path))
    assert human.returncode == 2 and "rank 4: dead (culprit)" in human.stdout and "p99.9=" in human.stdout


def test_watch_job_counts_checks(cli, tmp_path: Path) -> None:
    import threading

    log = StepLog(tmp_path, 0, "w")
    stop = threading.Event()

    def step_on() -> None:  # a live rank: the watch must see it progressing
        s = 0
        while not stop.is_set():
            _steps(log, 1, 0.01, start=s)
            s += 1

    t = threading.Thread(target=step_on)
    t.start()
    try:
        _check_watch(cli, tmp_path)
    finally:
        stop.set()
        t.join()


def _check_watch(cli, tmp_path: Path) -> None:
    time.sleep(0.2)
    r = cli("gpu-doctor", "watch", "job", "--job-dir", str(tmp_path), "--interval", "0.1", "--count", "2", "--json")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.returncode == 0 and len(lines) == 2 and all(d["schema"] == "gpuguard.job/1" for d in lines)
    r = cli(
        "gpu-doctor",
        "watch",
        "job",
        "--job-dir",
        str(tmp_path),
        "--interval",
        "0.1",
        "--count",
        "1",
        env={"GPUGUARD_JOB_DIR": str(tmp_path)},
    )
    assert r.returncode == 0 and "all healthy" in r.stdout
    assert os.path.isdir(tmp_path / "ranks")


def test_node_report_and_training_log_inputs(cli, tmp_path: Path, monkeypatch) -> None:
    import socket

    for r in range(3):
        monkeypatch.setenv("LOCAL_RANK", str(r))
        _steps(StepLog(tmp_path, r, f"i{r}"), 3, 0.001)
    report = tmp_path / "node.json"
    report.write_text(
        json.dumps(
            {
                "schema": "gpuguard.node/1",
                "node": socket.gethostname(),
                "gpus": [
                    {
                        "index": 1,
                        "verdict": "drain",
                        "evidence": [{"verdict": "drain", "check": "gpu_lost", "message": "GPU is lost"}],
                    }
                ],
            }
        )
    )
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--node-report", str(report), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 2 and {x["rank"]: x["verdict"] for x in doc["ranks"]}[1] == "dead", doc
    assert "GPU lost" in doc["ranks"][1]["reason"]
    (tmp_path / "bad.json").write_text("{")
    assert (
        cli(
            "gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--node-report", str(tmp_path / "bad.json")
        ).returncode
        == 65
    )

    logdir = tmp_path / "logjob"
    logdir.mkdir()
    log = tmp_path / "train.log"
    log.write_text(
        "".join(f"[rank{r}] step {s} step_time {0.5 if r else 0.2}s\n" for s in range(1, 30) for r in range(4))
    )
    rx = r"\[rank(?P<rank>\d+)\] step (?P<step>\d+) step_time (?P<step_s>[0-9.]+)s"
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(logdir), "--log", str(log), "--log-regex", rx, "--json")
    doc = json.loads(r.stdout)
    assert [x["rank"] for x in doc["ranks"]] == [0, 1, 2, 3] and doc["ranks"][1]["steps_recorded"] == 29
    assert cli("gpu-doctor", "diagnose", "job", "--job-dir", str(logdir), "--log-regex", rx).returncode == 64


def test_a_rank_that_never_wrote_is_unknown(cli, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    for r in (0, 2):
        _steps(StepLog(tmp_path, r, f"i{r}"), 3, 0.001)
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 3 and doc["verdict"] == "unknown"
    assert {x["rank"]: x["verdict"] for x in doc["ranks"]}[1] == "unknown"
    assert "no step records" in doc["ranks"][1]["reason"]


def test_real_watchdog_log_marks_the_reporting_ranks_as_victims(cli, tmp_path: Path) -> None:

    for r in range(6):
        _steps(StepLog(tmp_path, r, f"i{r}"), 3, 0.001)
    r = cli(
        "gpu-doctor",
        "diagnose",
        "job",
        "--job-dir",
        str(tmp_path),
        "--json",
        "--log",
        str(REAL_LOGS / "051-watchdog.log"),
    )
    doc = json.loads(r.stdout)
    assert r.returncode in (0, 1), r.stderr
    comm = {
        x["rank"]: next((e for e in x["evidence"] if e["dimension"] == "communication"), None) for x in doc["ranks"]
    }
    for rank in (0, 3, 4):  # the ranks whose NCCL watchdog fired in that log
        assert comm[rank] is not None and comm[rank]["numbers"]["errors_seen_by_rank"] >= 1
        assert "watchdog" in comm[rank]["reason"].lower()
    assert comm[2] is None and comm[5] is None


def test_record_text_is_escaped_in_human_output(cli, tmp_path: Path, monkeypatch) -> None:
    """A node report's (or a log's) text reaches the rank's reason: its control characters must not
    drive the operator's terminal."""
    import socket

    for r in range(3):
        monkeypatch.setenv("LOCAL_RANK", str(r))
        _steps(StepLog(tmp_path, r, f"i{r}"), 3, 0.001)
    report = tmp_path / "node.json"
    evil = {"verdict": "drain", "check": "gpu_lost", "message": "GPU is lost \x1b]0;owned\x07\x1b[2J"}
    report.write_text(
        json.dumps(
            {
                "schema": "gpuguard.node/1",
                "node": socket.gethostname(),
                "gpus": [{"index": 1, "verdict": "drain", "evidence": [evil]}],
            }
        )
    )
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--node-report", str(report))
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout, r.stdout
    assert "GPU is lost \\x1b]0;owned\\x07\\x1b[2J" in r.stdout


def test_diagnose_job_takes_the_interval_in_use(cli, tmp_path: Path) -> None:
    logs = [StepLog(tmp_path, r, f"inc{r}") for r in range(2)]
    for log in logs:
        _steps(log, 3, 0.001)
    r = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(tmp_path), "--json", "--interval", "2.5")
    doc = json.loads(r.stdout)
    assert r.returncode == 0, doc
    assert doc["thresholds"]["check_interval_s"] == 2.5
    assert all("past_bound_checks" in x for x in doc["ranks"])
