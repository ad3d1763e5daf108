"""Recovery of a real torchrun + gloo job after a worker SIGKILL: gpuguard against the seed recipe.

    python bench/recovery.py [--json] [--trials N] [--overhead-steps N]

Same job for every method (`gpuguard.examples.demo_train`: 4 gloo workers, a small MLP, a
deterministic data-parallel step), killed N times (rank 1-3 in turn, right after a gradient
all-reduce, one kill every 6 steps):

- `torchrun-default`: the seed recipe (`plain` mode: env:// gloo group, rank 0 checkpoints every 5
  steps, resume from it) under torch's defaults (the shared store);
- `torchrun-noshare`: the same with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`;
- `gpuguard`: the runtime (per-attempt group namespaces, certified activation, snapshot every step);
- `in-place`: the survivors switch generation in place, no restart (`bench/inplace.py`'s measurement:
  its own float64 job of 4 plain gloo workers, kills cycling through the step; oracle checked).

Per kill: recovered = every rank finished a step after the kill within `--resume-timeout` s (a
hung restart otherwise waits 30 min); resume = kill -> first step finished by all ranks; steps
lost = last step finished by all before the kill - the step the job restarted from. A job that did
not recover is killed and a fresh one takes the remaining kills. The runtime's overhead per step is
measured on a ~100 ms step (stand-in compute) with and without it, no faults.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inplace as inplace_bench  # noqa: E402  (bench/inplace.py)
from _common import emit  # noqa: E402

from gpuguard.examples import demo  # noqa: E402
from gpuguard.foundation import jobdir

WORKERS = 4
KILL_EVERY = 6
SLEEP = 0.05
_AGENT_FAIL = re.compile(r"^[EWI](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode: -9\)")


@dataclass
class Trial:
    method: str
    kill_step: int
    kill_time: float
    recovered: bool = False
    resume_s: float | None = None
    steps_lost: int | None = None
    phases: dict[str, float] = field(default_factory=dict)


def read_jsonl(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def step_times(out: Path) -> dict[int, list[dict]]:
    return {r: read_jsonl(out / f"steps-{r}.jsonl") for r in range(WORKERS)}


def plan_kills(n: int) -> list[tuple[int, int]]:
    return [(1 + i % (WORKERS - 1), KILL_EVERY * (i + 1)) for i in range(n)]


def run_series(method: str, n: int, resume_timeout: float, work: Path, log) -> list[Trial]:
    """Kill one job `n` times (fresh jobs after a failed recovery); one Trial per kill."""
    trials: list[Trial] = []
    remaining = n
    attempt = 0
    while remaining > 0:
        attempt += 1
        job = work / f"{method}-{attempt}"
        kills = plan_kills(remaining)
        steps = kills[-1][1] + 4
        extra = ["--step-log", "--sleep", str(SLEEP)]
        if method != "gpuguard":
            extra += ["--mode", "plain", "--ckpt-every", "5"]
        argv = demo.torchrun_argv(
            job,
            workers=WORKERS,
            steps=steps,
            kills=[f"{r}:{s}:after-allreduce" for r, s in kills],
            max_restarts=remaining + 2,
            port=demo.free_port(),
            run_id=f"b-{method}-{attempt}",
            extra=extra,
        )
        env = demo.worker_env()
        env["GPUGUARD_PG_TIMEOUT"] = "30"
        if method == "torchrun-noshare":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        job.mkdir(parents=True)
        logf = open(job / "torchrun.log", "w")
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        done_kills = 0
        try:
            for kill_rank, kill_step in kills:
                trial = _watch_one(method, job, proc, kill_rank, kill_step, resume_timeout)
                if trial is None:  # the job ended or never reached the kill
                    break
                trials.append(trial)
                done_kills += 1
                log(
                    f"  {method}: kill {len(trials)}/{n} at step {kill_step}: "
                    + (
                        f"resumed in {trial.resume_s:.1f} s, {trial.steps_lost} step(s) lost"
                        if trial.recovered
                        else "NOT recovered"
                    )
                )
                if not trial.recovered:
                    break
            if done_kills == len(kills):
                try:
                    proc.wait(timeout=resume_timeout)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            demo.stop_job(proc, job)
            logf.close()
        if method == "gpuguard":
            _add_phases(job, [t for t in trials[-done_kills:]] if done_kills else [])
        remaining -= done_kills
        if done_kills == 0:
            trials.append(Trial(method, kills[0][1], time.time()))  # could not even reach the kill
            remaining -= 1
    return trials


def _watch_one(
    method: str, job: Path, proc: subprocess.Popen, rank: int, step: int, resume_timeout: float
) -> Trial | None:
    from gpuguard.examples.demo_train import kill_marker

    marker = kill_marker(job, rank, step, "after-allreduce")
    deadline = time.monotonic() + 180  # reaching the kill: start-up under load
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    time.sleep(0.05)
    kill = json.loads(marker.read_text())
    t_kill = kill["time"]
    out = job / "demo-out"
    before = step_times(out)
    last_by_all = min(
        (max((r["step"] for r in recs if r["time"] < t_kill), default=0) for recs in before.values()), default=0
    )
    trial = Trial(method, step, t_kill)
    deadline = time.monotonic() + resume_timeout
    while time.monotonic() < deadline:
        firsts = []
        for recs in step_times(out).values():
            after = [r for r in recs if r["time"] > t_kill + 0.5]
            if after:
                firsts.append(min(after, key=lambda r: r["time"]))
        if len(firsts) == WORKERS:
            resumes = read_jsonl(out / "resume-0.jsonl")
            restored = resumes[-1]["frontier_step"] if resumes else 0
            trial.recovered = True
            trial.resume_s = max(r["time"] for r in firsts) - t_kill
            trial.steps_lost = max(0, last_by_all - restored)
            return trial
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    return trial


def _agent_fail_times(job: Path) -> list[float]:
    """When torchrun noticed each dead worker (its log timestamps, local time, ms resolution)."""
    out = []
    year = time.localtime().tm_year
    for line in (job / "torchrun.log").read_text(errors="replace").splitlines():
        m = _AGENT_FAIL.search(line)
        if m:
            dt = datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
            out.append(dt.timestamp())
    return out


def _add_phases(job: Path, trials: list[Trial]) -> None:
    """Split each gpuguard resume into detect / restart / start-up / activation / restore / first step.

    The generation that answered a kill is the first one certified after it (ledger activation
    time); its rank-0 activation record has the in-process timestamps."""
    from gpuguard.generation.ledger_open import open_ledger

    fails = _agent_fail_times(job)
    history = open_ledger(job).history()
    for t in trials:
        cert = next((c for c in history if c.activation_time > t.kill_time), None)
        detect = next((f for f in fails if f >= t.kill_time - 0.05), None)
        path = jobdir.activation_path(job, cert.generation) if cert is not None else None
        if path is None or not path.exists() or detect is None or t.resume_s is None:
            continue
        ph = json.loads(path.read_text())["phases"]
        t.phases = {
            "detect": detect - t.kill_time,  # kill -> torchrun logs the dead worker
            "restart": ph["runtime_created"] - detect,  # stop survivors, re-rendezvous, spawn, python
            "startup": ph["activate_called"] - ph["runtime_created"],  # import torch, build model + optimizer
            "activation": ph["certificate"] - ph["activate_called"],  # attempt, hellos, frontier, certificate (CAS)
            "restore": ph["pg_ready"] - ph["certificate"],  # verify, DCP load + digest, gloo group
            "first_step": t.kill_time + t.resume_s - ph["pg_ready"],  # first step committed by every rank
        }


def measure_overhead(steps: int, burn_s: float, work: Path) -> dict[str, float]:
    """Median step wall time (rank 0, steady state) without the runtime, and with it snapshotting
    every step (the default) and every 5th step; no faults."""
    runs: dict[str, list[float]] = {}
    # interleaved, twice each: the machine is shared and its load drifts
    for i, (mode, every) in enumerate([("plain", 1), ("gpuguard", 1), ("gpuguard-k5", 5)] * 2):
        job = work / f"overhead-{mode}-{i}"
        extra = [
            "--step-log",
            "--burn",
            str(burn_s),
            "--mode",
            mode.split("-")[0],
            "--ckpt-every",
            str(10**9),
            "--snapshot-every",
            str(every),
        ]
        argv = demo.torchrun_argv(
            job,
            workers=WORKERS,
            steps=steps,
            kills=[],
            max_restarts=0,
            port=demo.free_port(),
            run_id=f"b-ovh-{mode}-{i}",
            extra=extra,
        )
        job.mkdir(parents=True)
        with open(job / "torchrun.log", "w") as logf:
            proc = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT, env=demo.worker_env(), start_new_session=True
            )
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                pass
            finally:
                demo.stop_job(proc, job)
        times = [r["time"] for r in read_jsonl(job / "demo-out" / "steps-0.jsonl")]
        deltas = [b - a for a, b in zip(times, times[1:])][5:]
        runs.setdefault(mode, []).append(statistics.median(deltas) if deltas else float("nan"))
        if mode == "gpuguard":  # the runtime's own cost, independent of the machine's load
            final = read_jsonl(job / "demo-out" / "final-0.jsonl")
            if final:
                c = final[-1]["counters"]
                runs.setdefault("runtime_s_per_step", []).append(
                    (c.get("commit_s", 0.0) + c.get("snapshot_cpu_s", 0.0)) / max(1, c.get("commits", 1))
                )
    return {mode: statistics.mean(values) for mode, values in runs.items()}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--trials", type=int, default=10, help="kills per method (>= 10 for the figures)")
    p.add_argument(
        "--resume-timeout",
        type=float,
        default=40.0,
        help="a kill not followed by a step on every rank within this is not recovered",
    )
    p.add_argument("--overhead-steps", type=int, default=60, help="0: skip the overhead runs")
    p.add_argument("--burn", type=float, default=0.1, help="stand-in compute per step for the overhead run")
    p.add_argument("--methods", default="gpuguard,torchrun-noshare,torchrun-default,in-place")
    p.add_argument("--keep", action="store_true", help="keep the job dirs")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = Path(tempfile.mkdtemp(prefix="gpuguard-bench-recovery-"))
    t0 = time.monotonic()
    rows = []
    notes = []
    try:
        methods = args.methods.split(",")
        unknown = set(methods) - {"gpuguard", "torchrun-noshare", "torchrun-default", "in-place"}
        if unknown:
            p.error(f"unknown method(s): {', '.join(sorted(unknown))}")
        # the overhead runs only feed the gpuguard row
        medians = (
            measure_overhead(args.overhead_steps, args.burn, work)
            if args.overhead_steps > 0 and "gpuguard" in methods
            else {}
        )
        overhead = medians["gpuguard"] / medians["plain"] - 1 if medians else None
        if medians:
            log(
                f"step time: plain {medians['plain'] * 1e3:.1f} ms, gpuguard {medians['gpuguard'] * 1e3:.1f} ms "
                f"-> overhead {overhead * 100:+.1f} %"
            )
        for method in methods:
            log(f"{method}: {args.trials} kills")
            if method == "in-place":
                row = inplace_bench.measure(args.trials, 120.0, work / "in-place", log)
                notes += inplace_bench.overhead_notes(row)
                rows.append(row)
                continue
            trials = run_series(method, args.trials, args.resume_timeout, work, log)
            ok = [t for t in trials if t.recovered]
            resumes = [t.resume_s for t in ok if t.resume_s is not None]
            lost = [t.steps_lost for t in ok if t.steps_lost is not None]
            row = {
                "method": method,
                "trials": len(trials),
                "recovered": len(ok),
                "resume_p50_s": pct(resumes, 0.5),
                "resume_p90_s": pct(resumes, 0.9),
                "steps_lost_mean": statistics.mean(lost) if lost else None,
                "overhead_fraction": (round(overhead, 4) if overhead is not None else None)
                if method == "gpuguard"
                else 0.0,
            }
            if method == "gpuguard" and medians.get("runtime_s_per_step") is not None:
                # commit() wall time + snapshot-writer CPU per step, over the plain step time
                row["runtime_cost_fraction"] = round(medians["runtime_s_per_step"] / medians["plain"], 4)
            phased = [t.phases for t in ok if t.phases]
            if phased:
                row["phases_p50_s"] = {k: round(statistics.median(ph[k] for ph in phased), 3) for k in phased[0]}
            rows.append(row)
        base = next((r for r in rows if r["method"] == "torchrun-default"), None)
        gg = next((r for r in rows if r["method"] == "gpuguard"), None)
        if base and gg and base["trials"] and gg["trials"]:
            notes.append(
                f"recovery rate: gpuguard {gg['recovered']}/{gg['trials']} vs torchrun defaults "
                f"{base['recovered']}/{base['trials']}"
            )
        if medians:
            notes.append(
                f"overhead measured on a {args.burn * 1e3:.0f} ms stand-in compute step: plain "
                f"{medians['plain'] * 1e3:.1f} ms, gpuguard {medians['gpuguard'] * 1e3:.1f} ms per step "
                f"(median), gpuguard snapshotting every 5th step {medians['gpuguard-k5'] * 1e3:.1f} ms "
                f"({medians['gpuguard-k5'] / medians['plain'] - 1:+.1%})"
            )
        notes.append(f"{WORKERS} gloo workers on {os.cpu_count()} CPUs; wall time {time.monotonic() - t0:.0f} s")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            notes.append(f"job dirs kept in {work}")
    emit("recovery", rows, args.json, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
