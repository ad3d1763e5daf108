"""A compute straggler in a real job: one rank of a 4-worker torchrun/gloo demo_train job under a cgroup CPU quota.

The job runs `demo_train --burn-work` (a fixed amount of stand-in compute per step, step records through
the Runtime), so a CPU quota makes rank 2's steps longer while it keeps working, as a throttled GPU or a
contended host does. Checked once a second as `watch job` does (the previous check carried, the interval
in use passed in): first the healthy job, four workers on a crowded host whose scheduler makes ranks late
by turns, draws no `slow`, `hung` or `dead` at all; then at 20 % and 5 % of one CPU (2-4 x and ~15 x its
compute) rank 2 is `slow` and the culprit within the 3 checks after the quota (1 s apart), the others are `blocked_by` it,
and nobody is ever `dead` or `hung` while it progresses. The quota is removed and the job recovers between
phases.

Skipped only where no cgroup CPU controller is writable (tests/support/cpu_quota.py says why). The cgroup
and every process of the job are removed whatever happens (the quota in a `with`, the job in a fixture).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from gpuguard.diagnostics.arrival import arrival_noise_s
from gpuguard.diagnostics.vote import load_config, vote
from gpuguard.doctor.job_observation import observe_job
from tests.support import cpu_quota
from tests.support.cli import run_cli
from tests.support.processes import kill_trees

KIND, WHY_NOT = cpu_quota.probe()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not KIND, reason=f"no writable cgroup CPU controller: {WHY_NOT}"),
]

SLOW, WORKERS = 2, 4
BURN_WORK = 1500  # ~0.08 s of matmuls per step on one free core
# the job's ranks get BOOST x the default CPU weight: on a machine crowded by other work a rank's fair share
# could fall below 20 % of a CPU, and then the quota would not make it a straggler at all
BOOST = 8
INTERVAL = 1.0  # seconds between checks, as `watch job --interval 1`
MAX_CHECKS = 3  # the throttled rank is named within this many checks of the quota being applied
HEALTHY_CHECKS = 15  # checks of the healthy job, before any quota: every rank healthy at every one
HOLD = 5  # ... and stays named at every one of the next HOLD checks
CFG = load_config()


@dataclass
class Job:
    dir: Path
    pids: dict[int, int]


class Watcher:
    """The vote once per check, the previous result carried and the real time between checks passed in."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir, self.previous, self.last = job_dir, None, None
        self.seen: list[dict[int, str]] = []

    def check(self):
        t = time.monotonic()
        elapsed = INTERVAL if self.last is None else max(INTERVAL, t - self.last)
        self.last = t
        self.records, obs = observe_job(self.job_dir)
        self.previous = vote(obs, CFG, self.previous, interval_s=elapsed)
        self.seen.append({r.rank: r.verdict for r in self.previous.ranks})
        return self.previous

    def until(self, predicate, timeout: float, forbid=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.check()
            if forbid is not None:
                assert not forbid(job), f"{forbid(job)}: {describe(job)}"
            if predicate(job):
                return job
            time.sleep(INTERVAL)
        raise AssertionError(f"not within {timeout} s; last {describe(self.previous)}; seen {self.seen[-6:]}")


def describe(job) -> list:
    return [(r.rank, r.verdict, r.blocked_by, r.reason[:160]) for r in job.ranks] if job else []


def arrivals(records, last: int = 8) -> str:
    """The recent collectives' arrival order as the arrival rule sees it (for a failure message): per
    collective the last rank, its lateness, and the job's arrival noise."""
    per: dict[int, dict[int, float]] = {}
    for r, s in records.ranks.items():
        for seq, wall, _, _ in s.entries:
            per.setdefault(seq, {})[r] = wall
    done = {q: a for q, a in per.items() if len(a) == len(records.ranks)}
    rows = []
    for q in sorted(done)[-last:]:
        t = sorted(done[q].items(), key=lambda kv: kv[1])
        rows.append(f"{q}: last {t[-1][0]} by {t[-1][1] - t[-2][1]:.3f} s")
    return f"noise {arrival_noise_s(done):.3f} s; " + ", ".join(rows)


def dead_or_hung(job) -> str:
    bad = [(r.rank, r.verdict) for r in job.ranks if r.verdict in ("dead", "hung")]
    return f"called {bad} while every rank progresses" if bad else ""


def named(job) -> bool:
    """The throttled rank is slow and the only culprit; every other rank waits on it."""
    by = job.by_rank()
    return (
        len(by) == WORKERS
        and by[SLOW].verdict == "slow"
        and job.culprits == (SLOW,)
        and all(by[r].blocked_by == (SLOW,) for r in by if r != SLOW)
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    cpu_quota.remove_stale()  # what an interrupted earlier run may have left
    job_dir = tmp_path_factory.mktemp("stragglers") / "job"
    job_dir.mkdir()
    # a 5 % rank's steps are long: no collective timeout meanwhile
    cmd, env = cpu_quota.burn_job(
        job_dir, workers=WORKERS, burn_work=BURN_WORK, pg_timeout_s=120, run_id=f"stragglers{os.getpid()}"
    )
    log = open(job_dir / "torchrun.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    pids: dict[int, int] = {}
    boost = None
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            records, _ = observe_job(job_dir, probe=False)
            if len(records.ranks) == WORKERS and all(len(s.steps) >= 30 for s in records.ranks.values()):
                pids = {r: s.pid or 0 for r, s in records.ranks.items()}
                break
            assert proc.poll() is None, (job_dir / "torchrun.log").read_text()[-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError(f"the job did not reach 30 steps: {(job_dir / 'torchrun.log').read_text()[-3000:]}")
        boost = cpu_quota.Boost(list(pids.values()), BOOST).__enter__()
        yield Job(job_dir, pids)
    finally:
        if boost is not None:
            boost.release()
        kill_trees([proc])  # torchrun's workers run in sessions of their own: the tree, by pid
        for pid in pids.values():
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        log.close()
        cpu_quota.remove_stale()


def test_a_healthy_job_on_a_crowded_host_draws_no_false_slow_hung_or_dead(job: Job) -> None:
    """Four workers on this machine's cores, one of them last at every collective by tens of ms, by turns."""
    w = Watcher(job.dir)
    for n in range(1, HEALTHY_CHECKS + 1):
        j = w.check()
        bad = [(r.rank, r.verdict, r.reason[:200]) for r in j.ranks if r.verdict != "healthy"]
        assert not bad and j.culprits == (), f"healthy check {n} of {HEALTHY_CHECKS}: {bad}; seen {w.seen}"
        time.sleep(INTERVAL)
    print(f"healthy: {HEALTHY_CHECKS} of {HEALTHY_CHECKS} checks healthy on {os.cpu_count()} CPU(s)")


@pytest.mark.parametrize("pct", [20, 5])
def test_a_throttled_rank_is_slow_and_the_culprit_others_blocked_by_it_never_dead_or_hung(job: Job, pct: int) -> None:
    w = Watcher(job.dir)
    w.until(lambda j: j.verdict == "healthy", timeout=45, forbid=dead_or_hung)
    steps_before = w.previous.by_rank()[SLOW].observation.phase_step
    with cpu_quota.Throttle(job.pids[SLOW], pct, boost=BOOST) as th:
        assert th.kind == KIND
        for n in range(1, MAX_CHECKS + 1):  # the checks after the quota, one interval apart as watch's are
            time.sleep(INTERVAL)
            j = w.check()
            assert not dead_or_hung(j), f"check {n} at {pct} %: {dead_or_hung(j)}: {describe(j)}"
            if named(j):
                break
        else:
            raise AssertionError(
                f"rank {SLOW} at {pct} % not named in {MAX_CHECKS} checks: {describe(j)}; {w.seen}; "
                f"arrivals: {arrivals(w.records)}"
            )
        first = n
        for _ in range(HOLD):
            time.sleep(INTERVAL)
            j = w.check()
            assert not dead_or_hung(j), f"{pct} %: {dead_or_hung(j)}: {describe(j)}"
            assert named(j), f"{pct} %: rank {SLOW} no longer named: {describe(j)}; seen {w.seen}"

        # the premise: the quota made its compute slower than its peers' (not just the machine's pace)
        def under_quota(r: int) -> float:  # its own compute over its steps under the quota (median)
            return statistics.median(s.compute_s for s in w.records.ranks[r].steps if s.step > steps_before)

        own, peers = under_quota(SLOW), max(under_quota(r) for r in range(WORKERS) if r != SLOW)
        assert own > 1.25 * peers, (own, peers)
        # it progresses all along (that is what makes `hung` wrong): its steps advanced under the quota
        assert j.by_rank()[SLOW].observation.phase_step > steps_before, describe(j)
        assert j.exit_code == 1 and "culprit: rank(s) 2" in j.reason, j.reason
        # the job-level line names what it costs: rank 2 accounts for the peers' extra wait per step
        assert j.impact is not None and [r for r, _ in j.impact.cost_s] == [SLOW], j.impact
        assert f"rank {SLOW} accounts for" in j.reason, j.reason
        if pct == 5:  # the same in the CLI's document, from one check on its own
            res = run_cli("gpu-doctor", "diagnose", "job", "--job-dir", str(job.dir), "--json", timeout=60)
            doc = json.loads(res.stdout)
            assert res.returncode == 1 and doc["culprits"] == [SLOW], (res.returncode, res.stderr, doc["reason"])
            assert list(doc["impact"]["cost_s"]) == [str(SLOW)] and doc["impact"]["line"] in doc["reason"], doc
        print(
            f"{pct} %: named at check {first} of {MAX_CHECKS}, then at {HOLD} of {HOLD}; compute {own / peers:.1f} x; {j.impact.line()}"
        )
    w.until(lambda j: j.verdict == "healthy", timeout=60, forbid=dead_or_hung)


def test_the_cgroup_is_gone_afterwards(job: Job) -> None:
    """Nothing of a quota is left once its phase ends: one cgroup of ours remains, the job's boost group,
    and the throttled rank is back in it."""
    assert not cpu_quota.remove_stale()
    roots = [r for _, r in cpu_quota._roots()]
    ours = [p for r in roots for p in r.iterdir() if p.name.startswith(f"{cpu_quota.PREFIX}{os.getpid()}-")]
    assert len(ours) == 1, ours
    assert str(job.pids[SLOW]) in (ours[0] / "cgroup.procs").read_text().split()
