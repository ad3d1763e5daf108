"""Dead versus slow on real stragglers: one rank of a real torchrun job throttled, stopped, then killed.

    python bench/stragglers.py [--json] [--quotas 50,20,5,1] [--phase-s 15] [--stop-s 40] [--kill-s 10]
                               [--interval 1.0] [--burn-work 1500] [--keep]

One real job: 4 gloo workers of `gpuguard.examples.demo_train` with a fixed amount of stand-in compute per
step (`--burn-work`, so a CPU quota makes the step longer instead of doing less work). After a healthy
warm-up, rank 2's process is moved into a child cgroup with a CPU quota (v1 `cpu.cfs_quota_us`, or v2
`cpu.max`; tests/support/cpu_quota.py) of 50, 20, 5 and 1 % in turn, each for `--phase-s` seconds, then
moved back (and the cgroup removed) and the job left to recover. The job's ranks run in cgroups of 8 x the
default CPU weight, so that other work on the machine does not decide their share (4 workers on 2 cores get
about half a core each: a 50 % quota is then no slowdown at all). Without cgroup CPU control it falls back
to SIGSTOP/SIGCONT duty cycling (labelled `throttle: sigstop-duty` in every row). Then rank 2 is stopped
(SIGSTOP) for `--stop-s` seconds and continued, and finally killed (SIGKILL) and watched `--kill-s` seconds.

The vote is `gpu-doctor watch job --json --interval I --torchrun-log LOG`: the same `diagnose job` vote once every I s, the
previous check carried (hang confirmation in real checks, CPU progress between checks). Per fault, the
verdict expected of rank 2 is `slow` (quota), `hung` (SIGSTOP, once past its bound) and `dead` (SIGKILL):
* `slowdown`: the job's median step period in the phase / in the healthy warm-up;
* `time_to_verdict_s`: fault applied -> the first check giving rank 2 that verdict with every other rank
  `blocked_by` it (SIGKILL: rank 2 `dead` and a culprit);
* `false_dead`, `false_hung`: checks (in the phase) calling a rank dead / hung that is not (a quota: nobody;
  SIGSTOP: nobody dead, no other rank hung; SIGKILL: another rank dead *and a culprit*, anyone hung);
* `false_slow`: checks (in the phase) calling another rank than 2 `slow`; in the healthy warm-up (`fault: none`),
  checks with any rank not `healthy` (a demanding user wants 0: there is nothing to find);
* `culprit_accuracy`: of the checks after the verdict, those whose culprits are exactly [2];
* `blocked_by_accuracy`: of the other ranks at those checks, those with blocked_by == [2].
Baseline rows on the same checks: `fixed-10s`, a watchdog that fails any rank without a record for 10 s
(computing or waiting; what it names is its culprit: a false hang under a quota, a detection under SIGSTOP
and SIGKILL), and `nvrx-0.7`, NVRx-style relative scores (median own compute over the ranks / the rank's
own; a straggler below 0.7).

Interrupted (Ctrl-C, SIGTERM, SIGHUP), it still removes the cgroup, continues a stopped rank and kills the
job's whole process tree (torchrun starts each worker in a session of its own, so by pid, not by group).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.support.cpu_quota
from _common import emit  # noqa: E402

from gpuguard.collectors.step_records import read_job  # noqa: E402
from tests.support.cpu_quota import Boost, Throttle, burn_job, probe, release_all, remove_stale  # noqa: E402

SLOW_RANK = 2
WORKERS = 4
BOOST = 8  # the job's cgroups get 8 x the default CPU weight: a crowded host's other work does not set its pace


class Watch:
    """`gpu-doctor watch job --json`: every document with the time it arrived."""

    def __init__(self, job: Path, interval: float) -> None:
        exe = Path(sys.executable).with_name("gpu-doctor")
        argv = [str(exe), "watch", "job", "--job-dir", str(job), "--json", "--interval", str(interval)]
        argv += ["--torchrun-log", str(job / "torchrun.log")]  # how gone workers ended: who failed first
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.docs: list[tuple[float, dict]] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.docs.append((time.monotonic(), json.loads(line)))
            except ValueError:
                continue

    def between(self, t0: float, t1: float) -> list[tuple[float, dict]]:
        return [(t, d) for t, d in list(self.docs) if t0 <= t <= t1]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _by(doc: dict) -> dict[int, dict]:
    return {r["rank"]: r for r in doc["ranks"]}


def named(doc: dict, expect: str = "slow", rank: int = SLOW_RANK) -> bool:
    """Rank `rank` has the verdict `expect` and the others wait on it (dead: it is a culprit)."""
    by = _by(doc)
    if rank not in by or by[rank]["verdict"] != expect:
        return False
    if expect == "dead":
        return rank in doc["culprits"]
    return all(r["blocked_by"] == [rank] for k, r in by.items() if k != rank)


def _false(doc: dict, expect: str) -> tuple[bool, bool]:
    """(a false dead, a false hung) in this check, given the fault (see the module docstring)."""
    ranks = doc["ranks"]
    if expect == "slow":
        return any(r["verdict"] == "dead" for r in ranks), any(r["verdict"] == "hung" for r in ranks)
    if expect == "hung":
        return (
            any(r["verdict"] == "dead" for r in ranks),
            any(r["verdict"] == "hung" and r["rank"] != SLOW_RANK for r in ranks),
        )
    return (
        any(r["verdict"] == "dead" and r["culprit"] and r["rank"] != SLOW_RANK for r in ranks),
        any(r["verdict"] == "hung" for r in ranks),
    )


def score_vote(checks: list[tuple[float, dict]], t0: float, expect: str = "slow") -> dict:
    false = [_false(d, expect) for _, d in checks]
    first = next((t for t, d in checks if named(d, expect)), None)
    after = [d for t, d in checks if first is not None and t >= first]
    culprit = sum(1 for d in after if d["culprits"] == [SLOW_RANK])
    others = [r for d in after for r in d["ranks"] if r["rank"] != SLOW_RANK]
    blocked = sum(1 for r in others if r["blocked_by"] == [SLOW_RANK])
    return {
        "time_to_verdict_s": round(first - t0, 2) if first is not None else None,
        "false_dead": sum(1 for d, _ in false if d),
        "false_hung": sum(1 for _, h in false if h),
        # a rank other than the faulty one called slow: the blame inverted (the healthy row: any rank not healthy)
        "false_slow": sum(
            1 for _, d in checks if any(r["verdict"] == "slow" and r["rank"] != SLOW_RANK for r in d["ranks"])
        ),
        "culprit_accuracy": round(culprit / len(after), 3) if after else None,
        "blocked_by_accuracy": round(blocked / len(others), 3) if others else None,
        "checks": len(checks),
    }


def _score_named(fired: list[tuple[float, list[int]]], checks: int, t0: float, fault_is_hang: bool) -> dict:
    """A baseline detector's firings [(time, ranks it names)] scored like the vote."""
    right = sum(1 for _, f in fired if f == [SLOW_RANK])
    hit = next((t for t, f in fired if SLOW_RANK in f), None)
    return {
        "time_to_verdict_s": round(hit - t0, 2) if hit is not None else None,
        "false_dead": 0,
        "false_hung": sum(1 for _, f in fired if not fault_is_hang or f != [SLOW_RANK]),
        "culprit_accuracy": round(right / len(fired), 3) if fired else None,
        "blocked_by_accuracy": None,
        "checks": checks,
    }


def score_fixed(checks: list[tuple[float, dict]], t0: float, timeout_s: float, fault_is_hang: bool = False) -> dict:
    """A fixed watchdog on the same observations: any rank without a record for `timeout_s` has failed
    (a firing is a false hang under a quota; under SIGSTOP/SIGKILL naming anyone but rank 2 is)."""
    fired = []
    for t, d in checks:
        failed = sorted(r["rank"] for r in d["ranks"] if r.get("phase_age_s", 0) > timeout_s and r["phase"] != "closed")
        if failed:
            fired.append((t, failed))
    return _score_named(fired, len(checks), t0, fault_is_hang)


def score_nvrx(checks: list[tuple[float, dict]], t0: float, threshold: float = 0.7) -> dict:
    """NVRx-style relative performance scores on the same checks: the median of the ranks' recent own
    compute over the rank's own; a rank scoring below `threshold` is a straggler."""
    fired = []
    for t, d in checks:
        comp = {r["rank"]: r.get("own_compute_recent_s", 0.0) for r in d["ranks"] if r.get("own_compute_recent_s")}
        if len(comp) < 2:
            continue
        med = statistics.median(comp.values())
        low = sorted(r for r, c in comp.items() if c > 0 and med / c < threshold)
        if low:
            fired.append((t, low))
    row = _score_named(fired, len(checks), t0, fault_is_hang=False)
    row["false_hung"] = 0  # it names stragglers, never a hang: its wrong names show in culprit_accuracy
    return row


def step_periods(job: Path, t0: float, t1: float) -> list[float]:
    """The job's step periods (rank 0's) that ended between wall times t0 and t1."""
    series = read_job(job, max_steps=100_000).ranks.get(0)
    if series is None:
        return []
    return [s.interval_s for s in series.steps if s.interval_s and t0 <= s.end_wall <= t1]


def wait_steps(job: Path, n: int, timeout: float) -> dict[int, int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ranks = read_job(job).ranks
        if len(ranks) == WORKERS and all(len(s.steps) >= n for s in ranks.values()):
            return {r: s.pid or 0 for r, s in ranks.items()}
        time.sleep(0.5)
    raise SystemExit(f"the job did not reach {n} steps on every rank within {timeout:.0f} s (see {job}/torchrun.log)")


def kill_job(proc: subprocess.Popen, pids: dict[int, int]) -> None:
    """SIGKILL torchrun, every descendant and every recorded worker (each worker has a session of its own,
    so a process-group kill of the launcher would leave them running), then reap torchrun."""
    import psutil

    victims: list[psutil.Process] = []
    try:
        root = psutil.Process(proc.pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.Error:
        pass
    for pid in pids.values():
        try:
            victims.append(psutil.Process(pid))
        except psutil.Error:
            pass
    for p in victims:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.Error:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _interrupted(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `finally` and `with`: cgroup removed, job killed


def wait_healthy(watch: Watch, interval: float, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        docs = watch.between(time.monotonic() - 1.5 * interval, time.monotonic())
        if docs and docs[-1][1]["verdict"] == "healthy":
            return
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quotas", default="50,20,5,1", help="CPU quotas (%% of one CPU), comma-separated")
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds each quota is held")
    ap.add_argument("--warmup-s", type=float, default=15.0, help="seconds of healthy checks before the first fault")
    ap.add_argument("--stop-s", type=float, default=40.0, help="seconds rank 2 is held stopped (0: no SIGSTOP row)")
    ap.add_argument("--kill-s", type=float, default=10.0, help="seconds watched after SIGKILL (0: no SIGKILL row)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between checks")
    ap.add_argument("--burn-work", type=int, default=1500, help="fixed stand-in compute per step (matmuls)")
    ap.add_argument("--keep", action="store_true", help="keep the job dir")
    ap.add_argument(
        "--boost", type=float, default=BOOST, help="CPU weight of the job's cgroups x the default (0: none)"
    )
    ap.add_argument("--dump", type=Path, default=None, help="write every check's document here (JSON lines)")
    args = ap.parse_args(argv)
    quotas = [float(q) for q in args.quotas.split(",") if q.strip()]
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)  # SIGINT already raises KeyboardInterrupt
    remove_stale()  # the cgroups of an earlier run that was killed before it could remove them
    t_start = time.monotonic()
    load_start, load_warm = os.getloadavg()[0], float("nan")
    tmp = Path(tempfile.mkdtemp(prefix="gpuguard-stragglers-"))
    job = tmp / "job"
    job.mkdir()
    # a 1 % rank takes long steps: no collective timeout in the bench
    cmd, env = burn_job(
        job, workers=WORKERS, burn_work=args.burn_work, pg_timeout_s=600, run_id=f"stragglers{os.getpid()}"
    )
    log = open(job / "torchrun.log", "w")  # noqa: SIM115 - closed with the job
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    rows: list[dict] = []
    false_slow_reasons: set[str] = set()
    kind = probe()[0] or "sigstop-duty"
    watch = None
    pids: dict[int, int] = {}
    base = float("nan")
    bound_s = None
    done = False
    try:
        pids = wait_steps(job, 30, timeout=180)
        boost = args.boost or None
        if kind != "sigstop-duty" and boost:  # the job's ranks before other work on a crowded host (as the tests do)
            Boost(list(pids.values()), boost).__enter__()
        watch = Watch(job, args.interval)
        w0 = time.time()
        time.sleep(max(args.warmup_s, 4 * args.interval))
        healthy_checks = watch.between(0, time.monotonic())
        load_warm = os.getloadavg()[0]
        base = statistics.median(step_periods(job, w0, time.time()) or [float("nan")])
        h = score_vote(healthy_checks, 0)
        false_slow_reasons = {
            f"rank {r['rank']} {r['verdict']}: {r['reason'][:140]}"
            for _, d in healthy_checks
            for r in d["ranks"]
            if r["verdict"] != "healthy"
        }
        rows.append(
            {
                "fault": "none",
                "method": "vote",
                "quota_pct": 100,
                "slowdown": 1.0,
                "time_to_verdict_s": None,
                "false_dead": h["false_dead"],
                "false_hung": h["false_hung"],
                "culprit_accuracy": None,
                "blocked_by_accuracy": None,
                "false_slow": sum(1 for _, d in healthy_checks if d["verdict"] != "healthy"),
                "checks": h["checks"],
                "throttle": "-",
            }
        )
        for q in quotas:
            t0, w_0 = time.monotonic(), time.time()
            with Throttle(pids[SLOW_RANK], q, fallback=True, boost=boost) as th:
                time.sleep(args.phase_s)
            t1, w_1 = time.monotonic(), time.time()
            checks = watch.between(t0, t1)
            periods = step_periods(job, w_0, w_1)
            slow = round(statistics.median(periods) / base, 2) if periods and base == base else None
            for method, score in (
                ("vote", score_vote(checks, t0)),
                ("fixed-10s", score_fixed(checks, t0, 10.0)),
                ("nvrx-0.7", score_nvrx(checks, t0)),
            ):
                rows.append(
                    {
                        "fault": "cpu-quota",
                        "method": method,
                        "quota_pct": q,
                        "slowdown": slow,
                        **score,
                        "throttle": th.kind,
                    }
                )
            wait_healthy(watch, args.interval, 30)  # recover before the next fault (at most 30 s)
        if args.stop_s > 0:
            t0 = time.monotonic()
            os.kill(pids[SLOW_RANK], signal.SIGSTOP)
            try:
                time.sleep(args.stop_s)
            finally:
                os.kill(pids[SLOW_RANK], signal.SIGCONT)
            checks = watch.between(t0, time.monotonic())
            bound_s = next(
                (
                    v["numbers"].get("bound_s")
                    for _, d in reversed(checks)
                    for r in d["ranks"]
                    if r["rank"] == SLOW_RANK
                    for v in r["evidence"]
                    if v["dimension"] == "progress" and "bound_s" in v["numbers"]
                ),
                None,
            )
            for method, score in (
                ("vote", score_vote(checks, t0, "hung")),
                ("fixed-10s", score_fixed(checks, t0, 10.0, fault_is_hang=True)),
            ):
                rows.append(
                    {
                        "fault": f"sigstop-{args.stop_s:g}s",
                        "method": method,
                        "quota_pct": None,
                        "slowdown": None,
                        **score,
                    }
                )
            wait_healthy(watch, args.interval, 60)
        if args.kill_s > 0:
            t0 = time.monotonic()
            os.kill(pids[SLOW_RANK], signal.SIGKILL)
            time.sleep(args.kill_s)
            checks = watch.between(t0, time.monotonic())
            for method, score in (
                ("vote", score_vote(checks, t0, "dead")),
                ("fixed-10s", score_fixed(checks, t0, 10.0, fault_is_hang=True)),
            ):
                rows.append({"fault": "sigkill", "method": method, "quota_pct": None, "slowdown": None, **score})
        done = True
    finally:
        if watch is not None:
            watch.stop()
            if args.dump is not None:
                with open(args.dump, "w") as fh:
                    for t, d in watch.docs:
                        fh.write(json.dumps({"t": round(t - t_start, 3), "doc": d}) + "\n")
        kill_job(proc, pids)
        log.close()
        release_all()  # a throttle an interruption left (the `with` has normally removed it already)
        if done and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not done:
            print(f"stragglers: the job dir is kept for a look: {tmp}", file=sys.stderr)
    notes = [
        f"real torchrun job: {WORKERS} gloo workers of demo_train --burn-work {args.burn_work}; rank {SLOW_RANK} "
        f"throttled by {kind} for {args.phase_s:g} s per quota, then SIGSTOP for {args.stop_s:g} s, then SIGKILL; "
        f"healthy step period {base:.3f} s (median)",
        f"checks: gpu-doctor watch job --json --interval {args.interval:g} (the diagnose-job vote, previous check "
        "carried); time_to_verdict counts from the fault being applied",
        "fixed-10s: a watchdog failing any rank without a record for 10 s, on the same checks (under a quota every "
        "firing is a false hang); nvrx-0.7: NVRx-style relative score median/own compute < 0.7 names a straggler",
        f"bench wall time {time.monotonic() - t_start:.0f} s on {os.cpu_count()} CPU(s); 1-min load average "
        f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (the machine is shared)",
    ]
    if bound_s is not None:
        notes.append(f"SIGSTOP: rank {SLOW_RANK}'s hang bound at the end of the stop was {bound_s:.1f} s")
    healthy_row = rows[0] if rows and rows[0]["fault"] == "none" else None
    if healthy_row is not None:
        notes.append(
            f"healthy warm-up ({args.warmup_s:g} s, load average {load_warm:.1f} at its end): "
            f"{healthy_row['false_slow']} of {healthy_row['checks']} checks not healthy"
        )
    if false_slow_reasons:
        notes.append("healthy warm-up, non-healthy ranks seen: " + " | ".join(sorted(false_slow_reasons)[:4]))
    if kind == "sigstop-duty":
        notes.append("no writable cgroup CPU controller here: throttled by SIGSTOP/SIGCONT duty cycling instead")
    emit("stragglers", rows, args.json, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
