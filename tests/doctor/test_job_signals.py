"""Real signals against a real 4-rank torchrun/gloo job that writes StepLog records.

One job serves the whole module (torch start-up is the expensive part): a rank made persistently
slower, a short SIGSTOP/SIGCONT, a held SIGSTOP, then SIGKILL of the stopped rank. Verdicts are
polled with generous deadlines (the machine is shared); the assertions are about behaviour: never
`dead` for a pause, the stopped rank named (not the ranks waiting for it), `dead` at the next check
after a kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuguard.diagnostics.vote import load_config, vote
from gpuguard.doctor.job_observation import observe_job
from tests.support.cli import JOBS

pytestmark = pytest.mark.timeout(240)
JOB = JOBS / "steps_job.py"
CFG = load_config()


def check(job_dir: Path, previous=None):
    _, obs = observe_job(job_dir)
    return vote(obs, CFG, previous)


def wait_for(job_dir: Path, predicate, timeout: float, every: float = 0.1, forbid=None, previous=None):
    """Poll the vote until predicate(job) holds; `forbid(job)` returning a message fails at once.
    `previous`: the last check's verdict, as a watcher carries it from one check to the next."""
    deadline = time.monotonic() + timeout
    job = previous
    seen = []
    while time.monotonic() < deadline:
        job = check(job_dir, job)
        seen.append({r.rank: r.verdict for r in job.ranks})
        if forbid is not None:
            bad = forbid(job)
            assert not bad, f"{bad}: {[(r.rank, r.verdict, r.reason) for r in job.ranks]}"
        if predicate(job):
            return job, seen
        time.sleep(every)
    raise AssertionError(
        f"condition not met within {timeout} s; last verdicts "
        f"{[(r.rank, r.verdict, r.reason) for r in job.ranks] if job else None}; seen {seen[-5:]}"
    )


def never_dead(job):
    dead = [r.rank for r in job.ranks if r.verdict == "dead"]
    return f"rank(s) {dead} called dead" if dead else ""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    job_dir = tmp_path_factory.mktemp("stepjob")
    (job_dir / "control").mkdir()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "STEP_SLEEP": "0.05",
        "GLOO_TIMEOUT": "60",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    log = open(job_dir / "torchrun.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=4",
            "--max-restarts=0",
            str(JOB),
            str(job_dir),
            "150",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        wait_for(
            job_dir,
            lambda j: len(j.ranks) == 4 and all(r.observation.n_steps >= 60 for r in j.ranks),
            timeout=120,
            every=0.5,
        )
        yield job_dir
    finally:
        try:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        log.close()


def process_alive(pid: int) -> bool:
    """True while the OS still runs `pid` (a zombie has exited: only its parent's reap is left)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pids(job_dir: Path) -> dict[int, int]:
    records, _ = observe_job(job_dir, probe=False)
    return {r: s.pid for r, s in records.ranks.items()}


def test_healthy_then_a_persistently_slower_rank_is_slow_never_dead(job: Path) -> None:
    first, _ = wait_for(job, lambda j: j.verdict == "healthy", timeout=30, forbid=never_dead)
    assert first.exit_code == 0
    (job / "control" / "slow.1").write_text("0.25")
    try:
        slow, _ = wait_for(job, lambda j: j.by_rank()[1].verdict == "slow", timeout=40, forbid=never_dead)
        # named by the arrival order (last at every collective) or, later, by its own compute (cohort)
        named = [v for v in slow.by_rank()[1].votes if v.dimension in ("arrival", "cohort") and v.verdict == "slow"]
        assert named, slow.by_rank()[1]
        # the others share its wall step but not its compute: they are not the straggler, they wait for it
        for r in (0, 2, 3):
            other = next(v for v in slow.by_rank()[r].votes if v.dimension == "cohort")
            assert other.verdict == "healthy" and slow.by_rank()[r].verdict in ("healthy", "slow"), slow.by_rank()[r]
            assert slow.by_rank()[r].blocked_by == (1,), slow.by_rank()[r]
        assert slow.culprits == (1,)
    finally:
        (job / "control" / "slow.1").unlink()
    wait_for(job, lambda j: j.verdict == "healthy", timeout=40, forbid=never_dead)


def test_a_short_sigstop_is_a_pause_never_dead(job: Path) -> None:
    pid = pids(job)[2]
    os.kill(pid, signal.SIGSTOP)
    try:
        paused, seen = wait_for(job, lambda j: j.by_rank()[2].verdict == "slow", timeout=20, forbid=never_dead)
        assert "paused" in paused.by_rank()[2].reason
        assert all(paused.by_rank()[r].verdict == "healthy" for r in (0, 1, 3)), paused
        time.sleep(max(0.0, 2.5 - 1.0))
        mid = check(job)
        assert mid.by_rank()[2].verdict in ("slow", "hung") and not never_dead(mid)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(job, lambda j: j.verdict == "healthy", timeout=40, forbid=never_dead)


def test_held_sigstop_is_hung_and_names_the_stopped_rank_then_sigkill_is_dead(job: Path, cli) -> None:
    pid = pids(job)[3]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        hung, _ = wait_for(job, lambda j: j.by_rank()[3].verdict == "hung", timeout=45, forbid=never_dead)
        took = time.monotonic() - t0
        assert hung.culprits == (3,), [hung.by_rank()[r] for r in hung.culprits]
        for r in (0, 1, 2):
            assert hung.by_rank()[r].verdict == "healthy" and hung.by_rank()[r].blocked_by == (3,), hung
        assert hung.exit_code == 2
        obs3 = hung.by_rank()[3].observation
        bound = max(CFG.hang_k * obs3.period_p999_s, CFG.hang_floor_s) + CFG.check_interval_s
        assert took < bound + 20, (took, bound)
        res = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(job), "--json", timeout=60)
        assert res.returncode == 2, res.stderr
        doc = json.loads(res.stdout)
        assert doc["schema"] == "gpuguard.job/1" and doc["culprits"] == [3]
        assert {r["rank"]: r["verdict"] for r in doc["ranks"]}[3] == "hung"
        os.kill(pid, signal.SIGKILL)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # SIGKILL is asynchronous: the kernel still has to run the exit. "The next check" is the
    # first one after the OS shows the process gone (or a zombie awaiting its agent's reap).
    gone_by = time.monotonic() + 10
    while time.monotonic() < gone_by and process_alive(pid):
        time.sleep(0.01)
    dead = check(job, hung)
    assert dead.by_rank()[3].verdict == "dead", dead.by_rank()[3]
    assert 3 in dead.culprits
    # torchrun then tears the survivors down: they are dead too, but as collateral, not culprits
    after, _ = wait_for(job, lambda j: all(r.verdict == "dead" for r in j.ranks), timeout=30, every=0.2, previous=dead)
    assert after.culprits == (3,)
    for r in (0, 1, 2):
        assert "collateral" in after.by_rank()[r].reason and not after.by_rank()[r].culprit
    human = cli(
        "gpu-doctor", "diagnose", "job", "--job-dir", str(job), "--torchrun-log", str(job / "torchrun.log"), timeout=60
    )
    assert human.returncode == 2 and "rank 3: dead" in human.stdout
    assert "killed by SIGKILL" in human.stdout, human.stdout  # the exit status only torchrun saw


GENERATION_WRITER = """
import os, sys, time
from gpuguard.foundation.steplog import StepLog
job, gen, ranks, mode = sys.argv[1], int(sys.argv[2]), [int(r) for r in sys.argv[3].split(",")], sys.argv[4]
logs = {r: StepLog(job, r, f"g{gen}r{r}", gen) for r in ranks}
step = 0
while True:
    for r, log in logs.items():
        log.begin_step(step)
        time.sleep(0.001)
        log.enter_collective(step, "all_reduce", 4096)
        log.exit_collective(step)
        log.end_step(step)
    step += 1
    if mode == "die" and step == 60:
        for r, log in logs.items():  # the fault: rank 0 never reaches collective 60, its peers wait in it
            log.begin_step(step)
            if r != 0:
                log.enter_collective(step, "all_reduce", 4096)
        os._exit(1)  # the whole generation gone without a clean close (torchrun tore it down)
    if step == 60:
        print("ready", flush=True)
    time.sleep(0.02)
"""


@pytest.mark.parametrize("world_after", [3, 4])
def test_incarnations_of_an_earlier_generation_are_reported_apart_never_waiting_on_the_new_ones(
    tmp_path: Path, world_after: int, cli
) -> None:
    """Generation 0 (4 ranks) died with rank 0 missing from collective 60 and ranks 1-3 waiting in it;
    generation 1 runs ranks 0-2 (the world shrank to 3, or rank 3 has not started yet in a world of 4). The
    vote is on generation 1; generation 0's rank 3, dead while waiting in collective 60, is reported apart
    (gone), never as waiting on the new ranks."""
    job = tmp_path / "job"
    env = {**os.environ, "WORLD_SIZE": "4"}
    old = subprocess.run(
        [sys.executable, "-c", GENERATION_WRITER, str(job), "0", "0,1,2,3", "die"], env=env, timeout=60
    )
    assert old.returncode == 1
    env["WORLD_SIZE"] = str(world_after)
    new = subprocess.Popen(
        [sys.executable, "-c", GENERATION_WRITER, str(job), "1", "0,1,2", "run"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert new.stdout.readline().strip() == "ready"
        _, obs = observe_job(job)
        assert {o.rank for o in obs if o.has_records} == {0, 1, 2}  # the active generation only
        res = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(job), "--json", timeout=60)
        doc = json.loads(res.stdout)
        ranks = {r["rank"]: r for r in doc["ranks"]}
        assert all(ranks[r]["verdict"] == "healthy" and ranks[r]["blocked_by"] == [] for r in (0, 1, 2)), doc
        assert [(r["rank"], r["generation"]) for r in doc["superseded"]] == [(3, 0)], doc["superseded"]
        old3 = doc["superseded"][0]
        assert old3["verdict"] == "dead" and "superseded" in old3["reason"] and "gone" in old3["reason"], old3
        assert old3["blocked_by"] == [], old3  # never waiting on the new generation's ranks
        if world_after == 3:  # the world shrank: rank 3 is no part of the job now
            assert set(ranks) == {0, 1, 2} and res.returncode == 0 and doc["verdict"] == "healthy", doc
        else:  # rank 3 has not started in generation 1 yet: unknown, not dead
            assert ranks[3]["verdict"] == "unknown" and "active generation 1" in ranks[3]["reason"], ranks[3]
            assert res.returncode == 3 and doc["culprits"] == [], doc
        human = cli("gpu-doctor", "diagnose", "job", "--job-dir", str(job), timeout=60)
        assert "earlier generation: rank 3 dead: generation 0 incarnation, superseded" in human.stdout, human.stdout
    finally:
        new.kill()
        new.wait(timeout=10)
