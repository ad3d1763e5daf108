"""The commit path on an etcd ledger: writes per step, keys, bytes, and the step-time overhead, from etcd's own /metrics.

    python bench/commit_path.py [--json] [--steps 200] [--every 10] [--burn 0.1] [--workers 2] [--reps 2]

A real torchrun + gloo job (`gpuguard.examples.demo_train`, `--workers` ranks, a ~`--burn` s step of
stand-in compute) on a real etcd on loopback (a throwaway one unless $GPUGUARD_TEST_ETCD names
one), snapshots every `--every` steps, `GPUGUARD_LEDGER=etcd://...`. Before and after the job,
etcd's `/metrics` give the writes (`etcd_mvcc_put_total` + `etcd_mvcc_delete_total`), the raft
proposals, the keys (`etcd_debugging_mvcc_keys_total`) and the database size.

Rows:
- `commit_path` / gpuguard: the job under the runtime (no ledger write per rank-step: one frontier
  record per snapshot for the whole job): etcd writes per training step, new keys per job
  (`etcd_new_keys_per_job`: etcd's key count across the whole job, its set-up keys included; what
  grows per step is the `etcd_growth` row), and the
  step-time overhead against the same job without the runtime (`--mode plain`). `ok`: every job
  (both modes, both lengths) exited 0 with all its steps; `failed_runs`: for each job that did not,
  its mode, exit status, steps recorded and its log's last lines. The
  two run in `--reps` pairs, one after the other, the order alternating (plain first, then gpuguard
  first: a load that drifts within a pair favours neither), each job's step time the median of
  rank 0's steady-state steps. Two independent figures of the overhead:
  - side by side: `step_overhead_per_pair` (each pair's gpuguard / plain - 1: the noise),
    `step_overhead_median_pair` (their median) and `step_overhead_ci95` ([low, high]: the
    distribution-free confidence interval of that median from the pairs' order statistics, at
    least 95 % (`step_overhead_ci_level`, the exact coverage); null below 6 pairs, where none
    reaches 95 %). `step_overhead_vs_plain` is the older figure: the median of each mode's steps.
    A median of all steps leaves out what happens once a snapshot cycle (the snapshot step's
    meeting and state copy), so the same again on each job's typical cycle (`cycle_step`: the
    median duration of each step position in the cycle, averaged): `step_overhead_per_pair_cycle`,
    `step_overhead_cycle_median_pair`, `step_overhead_cycle_ci95` (same interval, same coverage).
  - in process: `runtime_ms_per_step` (each rank, each run: the runtime's own wall time on the
    training thread per step, from its counters: `commit()` with the frontier meeting and the
    snapshot copy, plus `begin_step()` and the collective marks; `commit_ms_per_step` is the
    `commit()` part alone) and `runtime_overhead_direct` (the median over runs of the slowest
    rank's `runtime_ms_per_step`, over the plain step time; `runtime_overhead_direct_max`: the
    largest run's). The load disturbs it far less than the side-by-side step times. What it does
    not see: the background threads' CPU (`snapshot_cpu_ms_per_step`: rank 0's snapshot writer),
    which costs the step only when the cores are saturated.
  `overhead_le_1pct`: "shown" when both side-by-side intervals' high ends are at most 1 %,
  "refuted" when both low ends are above 1 %, else "not shown" (the pairs are too noisy to tell).
- `commit_path` / baseline: the design before issue 29 in the same run, on the same etcd: every
  rank's `Ledger.record_commit` each step (a read of the active chain, then a transaction), by
  `--workers` simulated ranks for the same steps: writes and keys per step, commit latency.
- `etcd_growth`: what each design adds to etcd per step beyond the keys it writes once at set-up,
  per hour at the job's step rate, extrapolated to 10,240 ranks. Counted under the job's own key
  prefix (not etcd's server-wide key count, which other clients of a shared etcd move too):
  `setup_keys` (the keys a job holds however long it runs, at `setup_ranks` ranks),
  `new_keys_per_step` (beyond those, at `setup_ranks` ranks), `new_keys_per_hour` and
  `bytes_per_hour` (10,240 ranks: the baseline grows with ranks x steps; gpuguard's growth, if
  any, is taken as not growing with ranks). gpuguard: two job lengths in the same run, the
  `--steps` jobs above and one more of `--steps / 2` (at least `--every`): growth = the difference
  of their final key counts over the difference of their steps, set-up = the rest (a job's
  certificate, chain and frontier keys, written once; its lease keys are gone at its end).
  Baseline: its keys after the ledger's set-up and after the steps, in process.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from math import comb
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, wants_json  # noqa: E402
from ledger import etcd_server  # noqa: E402  (bench/ledger.py)

from gpuguard.examples import demo  # noqa: E402
from gpuguard.foundation.env import LEDGER_ENV  # noqa: E402
from gpuguard.foundation.etcd import EtcdClient  # noqa: E402
from gpuguard.generation.certificate import issue  # noqa: E402
from gpuguard.generation.ledger_open import open_ledger  # noqa: E402
from gpuguard.generation.records import Frontier, Incarnation, Member  # noqa: E402
from recovery import read_jsonl  # noqa: E402  (bench/recovery.py)

METRICS = {
    "puts": "etcd_mvcc_put_total",
    "deletes": "etcd_mvcc_delete_total",
    "proposals": "etcd_server_proposals_committed_total",
    "keys": "etcd_debugging_mvcc_keys_total",
    "db_bytes": "etcd_mvcc_db_total_size_in_use_in_bytes",
}


def _arg(name: str, default: float) -> float:
    argv = sys.argv[1:]
    return float(argv[argv.index(name) + 1]) if name in argv else default


def metrics(url: str) -> dict[str, float]:
    """The counters above from etcd's /metrics (Prometheus text), 0 for one it does not export."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:  # noqa: S310 - loopback, our own etcd
        text = r.read().decode()
    out = {}
    for name, metric in METRICS.items():
        m = re.search(rf"^{metric}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def prefix_keys(url: str, prefix: str) -> int:
    """The keys under one ledger's prefix now (a count-only range: etcd's index, not the values)."""
    with EtcdClient.from_url(url) as client:
        return int(client.range(f"/{prefix}/", "bench prefix keys", prefix=True, count_only=True).get("count", 0))


def run_job(url: str, work: Path, mode: str, steps: int, every: int, burn: float, workers: int) -> dict[str, Any]:
    """One job; etcd's counters around it and rank 0's median steady-state step time."""
    job = work / f"{mode}-{uuid.uuid4().hex[:6]}"
    job.mkdir(parents=True)
    prefix = f"bench-commit-{uuid.uuid4().hex[:8]}"
    ledger_url = url.replace("http://", "etcd://", 1) + f"/{prefix}"
    extra = ["--step-log", "--burn", str(burn), "--mode", mode, "--ckpt-every", str(10**9)]
    extra += ["--snapshot-every", str(every), "--checkpoint-every", "0"]
    argv = demo.torchrun_argv(
        job, workers=workers, steps=steps, kills=[], max_restarts=0, port=demo.free_port(), run_id=prefix, extra=extra
    )
    env = {**demo.worker_env(), LEDGER_ENV: ledger_url} if mode == "gpuguard" else demo.worker_env()
    before = metrics(url)
    with open(job / "torchrun.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=120 + steps * (burn + 0.5))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            demo.stop_job(proc, job)
    after = metrics(url)
    keys = prefix_keys(url, prefix) if mode == "gpuguard" else 0
    records = read_jsonl(job / "demo-out" / "steps-0.jsonl") if rc == 0 else []
    times = [r["time"] for r in records]
    deltas = [b - a for a, b in zip(times, times[1:])][5:]
    ended = {int(r["step"]): float(r["time"]) for r in records}
    by_step = [(s, ended[s] - ended[s - 1]) for s in sorted(ended) if s - 1 in ended and s > 6]
    finals = [r for f in sorted((job / "demo-out").glob("final-*.jsonl")) for r in read_jsonl(f)]
    counters = [r["counters"] for r in sorted(finals, key=lambda r: r["rank"]) if r.get("counters", {}).get("commits")]
    ok = rc == 0 and len(times) == steps
    return {
        "ok": ok,
        "step_s": statistics.median(deltas) if deltas else None,
        "cycle_step_s": cycle_step(by_step, every),
        # the runtime's own time on the training thread in commit() (meeting and snapshot copy included)
        "commit_ms_per_step": [round(1e3 * c["commit_s"] / c["commits"], 3) for c in counters],
        # ... and in begin_step() and the collective marks too (`marks_s`: 0 where the runtime has no such counter)
        "runtime_ms_per_step": [
            round(1e3 * (c["commit_s"] + c.get("marks_s", 0.0)) / c["commits"], 3) for c in counters
        ],
        "snapshot_cpu_ms_per_step": [round(1e3 * c["snapshot_cpu_s"] / c["commits"], 3) for c in counters],
        "etcd": _delta(before, after),
        "prefix_keys": keys,  # the job's keys under its ledger prefix once it has ended
        "log": str(job / "torchrun.log"),
        **({} if ok else {"failure": failure(mode, rc, len(times), job / "torchrun.log")}),
    }


def failure(mode: str, rc: int | None, recorded: int, log: Path) -> dict[str, Any]:
    """Why a job is not ok, kept in the row (the job's directory is gone after the run)."""
    try:
        tail = log.read_text(errors="replace").splitlines()[-12:]
    except OSError as exc:
        tail = [f"(no log: {exc})"]
    return {"mode": mode, "rc": rc, "steps_recorded": recorded, "log_tail": tail}


def cycle_step(by_step: list[tuple[int, float]], every: int) -> float | None:
    """The step time of a typical snapshot cycle: the median duration of each step position in the
    cycle (step % every), averaged over the positions. A load spike is no more than an outlier, as
    in the median of all steps, but the snapshot step's own cost (the meeting, the state copy: one
    step in `every`) counts, which the median of all steps leaves out."""
    every = max(1, every)
    classes = [[d for s, d in by_step if s % every == c] for c in range(every)]
    if not all(classes):
        return None
    return statistics.mean(statistics.median(c) for c in classes)


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """(low, high, coverage): the narrowest interval of order statistics [x(k), x(n-k+1)] that holds
    the median with probability at least `level` whatever the distribution (each value is above the
    median with probability 1/2: the coverage is 1 - 2 P(Binomial(n, 1/2) < k)); None if none does."""
    xs, n = sorted(values), len(values)
    found = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(comb(n, i) for i in range(k)) / 2**n
        if coverage < level:
            break
        found = (xs[k - 1], xs[n - k], coverage)
    return found


def baseline(url: str, steps: int, workers: int) -> dict[str, Any]:
    """The commit path before issue 29: every rank commits every step in the ledger."""
    key = os.urandom(32)
    job = Path(tempfile.mkdtemp(prefix="bench-commit-base-"))
    prefix = f"bench-base-{uuid.uuid4().hex[:8]}"
    ledger_url = url.replace("http://", "etcd://", 1) + f"/{prefix}"
    led = open_ledger(job, ledger_url, key=key)
    led.initialize(
        issue(
            parent=None,
            job_id="j",
            members=(),
            reason="genesis",
            frontier=Frontier(0),
            quiescence="proved",
            issued_by="bench",
            key=key,
        )
    )
    mem = tuple(Member(r, Incarnation(uuid.uuid4().hex, "h", 100 + r, 1.0)) for r in range(workers))
    led.activate(
        issue(
            parent=led.require_active(),
            job_id="j",
            members=mem,
            reason="start",
            frontier=Frontier(0),
            quiescence="proved",
            issued_by="bench",
            key=key,
        )
    )
    lat: list[float] = []
    lock = threading.Lock()
    setup_keys = prefix_keys(url, prefix)
    before = metrics(url)

    def rank(r: int) -> None:
        own = open_ledger(job, ledger_url, key=key)  # a client per rank, as each process had
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            own.record_commit(1, step, r, mem[r].incarnation.id)
            with lock:
                lat.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = metrics(url)
    s = sorted(lat)
    return {
        "etcd": _delta(before, after),
        "setup_keys": setup_keys,
        "end_keys": prefix_keys(url, prefix),
        "commit_p50_ms": round(1e3 * s[len(s) // 2], 2),
        "commit_p99_ms": round(1e3 * s[min(len(s) - 1, int(0.99 * len(s)))], 2),
    }


def main() -> None:
    steps, every, burn, workers, reps = (
        int(_arg("--steps", 200)),
        int(_arg("--every", 10)),
        _arg("--burn", 0.1),
        int(_arg("--workers", 2)),
        max(1, int(_arg("--reps", 2))),
    )
    results, notes = [], []
    with etcd_server() as url, tempfile.TemporaryDirectory(prefix="bench-commit-") as tmp:
        work = Path(tmp)
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "gpuguard": []}
        for rep in range(reps):  # interleaved pairs, the order alternating: the machine's load drifts
            for mode in ("plain", "gpuguard") if rep % 2 == 0 else ("gpuguard", "plain"):
                runs[mode].append(run_job(url, work, mode, steps, every, burn, workers))
        # a second job length: what does not grow with the steps is set-up (past the first snapshot)
        short_steps = max(every, steps // 2)
        if short_steps >= steps:
            raise SystemExit(f"--steps {steps}: want at least 2 x --every ({every}) for two job lengths")
        short = run_job(url, work, "gpuguard", short_steps, every, burn, workers)
        failed = [r["failure"] for rs in (*runs.values(), [short]) for r in rs if "failure" in r]
        ok = not failed
        gg = runs["gpuguard"]
        writes = statistics.mean((r["etcd"]["puts"] + r["etcd"]["deletes"]) / steps for r in gg)
        keys = statistics.mean(r["etcd"]["keys"] for r in gg)
        plain_s = [r["step_s"] for r in runs["plain"] if r["step_s"]]
        gg_s = [r["step_s"] for r in gg if r["step_s"]]
        overhead = statistics.median(gg_s) / statistics.median(plain_s) - 1 if plain_s and gg_s else None
        pairs = [
            round(g["step_s"] / p["step_s"] - 1, 4) for p, g in zip(runs["plain"], gg) if p["step_s"] and g["step_s"]
        ]
        ci = median_ci(pairs)
        cycle_pairs = [
            round(g["cycle_step_s"] / p["cycle_step_s"] - 1, 4)
            for p, g in zip(runs["plain"], gg)
            if p["cycle_step_s"] and g["cycle_step_s"]
        ]
        cycle_ci = median_ci(cycle_pairs)
        plain_med = statistics.median(plain_s) if plain_s else None
        slowest = [max(r["runtime_ms_per_step"]) for r in gg if r["runtime_ms_per_step"]]
        direct = [1e-3 * ms / plain_med for ms in slowest] if plain_med else []
        verdict = "not shown"
        if ci is not None and cycle_ci is not None and max(ci[1], cycle_ci[1]) <= 0.01:
            verdict = "shown"
        elif ci is not None and cycle_ci is not None and min(ci[0], cycle_ci[0]) > 0.01:
            verdict = "refuted"
        step_s = statistics.median(gg_s) if gg_s else burn
        results.append(
            {
                "metric": "commit_path",
                "design": "gpuguard",
                "ranks": workers,
                "ok": ok,
                "failed_runs": failed,
                "seconds": round(step_s, 4),
                "steps": steps,
                "snapshot_every": every,
                "etcd_writes_per_step": round(writes, 3),
                "etcd_writes_per_rank_step": round(writes / workers, 4),
                "etcd_new_keys_per_job": round(keys, 2),  # set-up included: the etcd_growth row splits them
                "raft_proposals_per_step": round(statistics.mean(r["etcd"]["proposals"] / steps for r in gg), 3),
                "step_overhead_vs_plain": None if overhead is None else round(overhead, 4),
                "plain_step_s": None if not plain_s else round(statistics.median(plain_s), 4),
                "step_overhead_per_pair": pairs,  # each interleaved (plain, gpuguard) pair: the spread
                # less noisy than the step time: what commit() itself costs each rank (rank order, per run)
                "commit_ms_per_step": [r["commit_ms_per_step"] for r in gg],
                "step_overhead_median_pair": round(statistics.median(pairs), 4) if pairs else None,
                "step_overhead_ci95": None if ci is None else [round(ci[0], 4), round(ci[1], 4)],
                "step_overhead_ci_level": None if ci is None else round(ci[2], 4),
                "step_overhead_per_pair_cycle": cycle_pairs,
                "step_overhead_cycle_median_pair": round(statistics.median(cycle_pairs), 4) if cycle_pairs else None,
                "step_overhead_cycle_ci95": None
                if cycle_ci is None
                else [round(cycle_ci[0], 4), round(cycle_ci[1], 4)],
                "runtime_ms_per_step": [r["runtime_ms_per_step"] for r in gg],
                "runtime_overhead_direct": round(statistics.median(direct), 5) if direct else None,
                "runtime_overhead_direct_max": round(max(direct), 5) if direct else None,
                "snapshot_cpu_ms_per_step": [r["snapshot_cpu_ms_per_step"] for r in gg],
                "overhead_le_1pct": verdict,
            }
        )
        base = baseline(url, steps, workers)
        bw = (base["etcd"]["puts"] + base["etcd"]["deletes"]) / steps
        results.append(
            {
                "metric": "commit_path",
                "design": "baseline (record_commit per rank-step)",
                "ranks": workers,
                "ok": True,
                "seconds": base["commit_p50_ms"] / 1e3,
                "steps": steps,
                "etcd_writes_per_step": round(bw, 3),
                "etcd_writes_per_rank_step": round(bw / workers, 4),
                "etcd_new_keys_per_job": base["etcd"]["keys"],
                "commit_p50_ms": base["commit_p50_ms"],
                "commit_p99_ms": base["commit_p99_ms"],
            }
        )
        per_hour = 3600 / step_s
        long_keys = statistics.median(r["prefix_keys"] for r in gg)
        gg_growth = (long_keys - short["prefix_keys"]) / (steps - short_steps)
        base_growth = (base["end_keys"] - base["setup_keys"]) / steps
        designs: tuple[tuple[str, float, float, float, bool, dict[str, Any]], ...] = (
            # one frontier key per generation, raised in place: no new key per step
            (
                "gpuguard",
                long_keys - gg_growth * steps,
                gg_growth,
                1,
                ok,
                {"job_keys": {short_steps: short["prefix_keys"], steps: long_keys}},
            ),
            ("baseline (record_commit per rank-step)", base["setup_keys"], base_growth, 10_240 / workers, True, {}),
        )
        for design, setup, keys_per_step, ranks_factor, measured, extra in designs:
            results.append(
                {
                    "metric": "etcd_growth",
                    "design": design,
                    "ranks": 10_240,
                    "ok": measured,
                    "seconds": round(step_s, 4),
                    "setup_keys": round(setup, 2),
                    "setup_ranks": workers,
                    "new_keys_per_step": round(keys_per_step, 4),
                    "new_keys_per_hour": round(keys_per_step * ranks_factor * per_hour),
                    "bytes_per_hour": round(keys_per_step * ranks_factor * per_hour * 243),
                    **extra,  # gpuguard: the final keys of each job length, by steps
                }
            )
        notes.append(
            f"{workers} ranks, {steps} steps of ~{burn * 1e3:.0f} ms stand-in compute, snapshot every {every}; "
            "writes = etcd_mvcc_put_total + etcd_mvcc_delete_total deltas around each job; etcd_growth: the keys under "
            f"each job's prefix, gpuguard's growth from two job lengths ({short_steps} and {steps} steps), set-up keys "
            "apart, extrapolated to 10,240 ranks at the measured step rate (243 bytes a commit record, measured before)"
        )
    emit("commit_path", results, wants_json(), notes)


if __name__ == "__main__":
    main()
