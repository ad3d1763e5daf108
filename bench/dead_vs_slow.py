"""Dead vs slow at scale: the vote against fixed timeouts, on a simulator with ground truth.

    python bench/dead_vs_slow.py [--json] [--seeds N] [--ranks N] [--steps N]

A synchronous job of 10,000 ranks × 2,000 steps: each rank's compute time is log-normal (median 1 s,
σ = 0.25) with rare long pauses (p = 1e-4 per rank-step, 2–8 × the step); a step ends when the
slowest rank has arrived at the collective (plus 0.1 s of collective), so one slow rank makes every
rank's wall step slow and one hung rank stalls every rank. Injected at random steps: process deaths
(visible to the process table), node losses (the process cannot be seen: only progress tells), hangs
(alive, running, no progress; injected in the compute phase), and persistent stragglers (1.5–3 ×).

Methods, evaluated on the same timeline at the same check instants (every `--interval` s):
* `vote`          — gpuguard's vote (diagnostics.vote, the default thresholds in diagnostics/data/vote.yaml)
* `fixed-10s`, `fixed-600s` — a rank computing for longer than T is declared failed
* `nvrx-5x-max`   — NVRx-style: T = 5 × the largest step interval observed so far (after 5 warm-up steps);
                    straggler scores: min-median / own-median < 0.75
The baselines are given the phase for free (only a rank that has not arrived can time out), which
favours them; a real collective timeout fires on every waiting rank too.

Speed: the bulk of healthy ranks is never simulated one by one. A step's slowest healthy rank is drawn
directly from the order statistic of N log-normals (exp(μ + σ Φ⁻¹(U^{1/N}))); pauses, stragglers and
the faulty rank are simulated explicitly. The vote runs on the ranks that matter at an instant (every
rank still computing plus a sample of waiters, with the statistics of all ranks): exact for kicks,
because a waiter's verdict only depends on whether someone has not arrived. One full 10,000-rank vote
per seed is timed and checked against the reduced vote.
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from gpuguard.diagnostics.jobstats import quantile  # noqa: E402
from gpuguard.diagnostics.vote import load_config, vote  # noqa: E402
from gpuguard.diagnostics.voters import Cohort, cohort_speed, confirm_window_s  # noqa: E402
from gpuguard.foundation.observations import COLLECTIVE, COMPUTING, ProcessState, RankObservation  # noqa: E402

ND = statistics.NormalDist()
RUNNING = ProcessState("running", "simulated")
GONE = ProcessState("gone", "simulated: exited")
UNSEEN = ProcessState("unknown", "simulated: node lost")
METHODS = ("vote", "fixed-10s", "fixed-600s", "nvrx-5x-max")
KICK = ("dead", "hung")


@dataclass
class Params:
    ranks: int = 10_000
    steps: int = 2_000
    median_s: float = 1.0
    sigma: float = 0.25
    pause_p: float = 1e-4
    pause_lo: float = 2.0
    pause_hi: float = 8.0
    coll_s: float = 0.1
    interval_s: float = 1.0
    deaths: int = 5
    node_losses: int = 3
    hangs: int = 8
    stragglers: int = 10
    straggler_lo: float = 1.5
    straggler_hi: float = 3.0
    warm: int = 100
    window: int = 20
    history: int = 2000
    horizon_s: float = 900.0
    waiter_sample: int = 16
    straggler_every: int = 100


@dataclass
class Tally:
    false_kicks: int = 0
    missed: int = 0
    hang_lat: list[float] = field(default_factory=list)
    death_lat: list[float] = field(default_factory=list)
    stragglers_found: int = 0
    stragglers_total: int = 0
    straggler_fp: int = 0
    hang_within_target: int = 0
    hang_events: int = 0


class Sim:
    def __init__(self, p: Params, seed: int, cfg) -> None:
        self.p, self.cfg, self.rng = p, cfg, random.Random(seed)
        self.mu = math.log(p.median_s)
        self.periods: deque[float] = deque()
        self.sorted_periods: list[float] = []
        self.stragglers: dict[int, float] = {}
        self.tally = {m: Tally() for m in METHODS}
        self.max_period = 0.0
        self.vote_10k_s: list[float] = []
        self.vote_10k_cpu_s: list[float] = []
        self.consistent = True
        self.targets: list[float] = []
        spread = 1.4826 * 0.674 * p.sigma * 1.2533 / math.sqrt(p.window)  # MAD of window medians (log space)
        self.cohort = Cohort(
            world=p.ranks,
            compute_median_s=p.median_s,
            compute_mad_s=p.median_s * spread / 1.4826,
            ranks_with_steps=p.ranks,
        )

    # -- random pieces ----------------------------------------------------------------------------
    def compute(self, rank: int) -> float:
        c = self.rng.lognormvariate(self.mu, self.p.sigma)
        return c * self.stragglers.get(rank, 1.0)

    def bulk_extreme(self, n: int, top: bool) -> float:
        u = max(self.rng.random(), 1e-300)
        q = math.exp(math.log(u) / max(n, 1))
        q = min(max(q if top else 1 - q, 1e-15), 1 - 1e-15)
        return math.exp(self.mu + self.p.sigma * ND.inv_cdf(q))

    def poisson(self, lam: float) -> int:
        k, prod, lim = 0, self.rng.random(), math.exp(-lam)
        while prod > lim:
            k += 1
            prod *= self.rng.random()
        return k

    # -- learned history (identical for every rank: the step period is shared) ---------------------
    def add_period(self, x: float) -> None:
        self.periods.append(x)
        bisect.insort(self.sorted_periods, x)
        if len(self.periods) > self.p.history:
            old = self.periods.popleft()
            del self.sorted_periods[bisect.bisect_left(self.sorted_periods, old)]
        self.max_period = max(self.max_period, x)

    def quantiles(self) -> tuple[float, float, float]:
        s = self.sorted_periods
        return quantile(s, 0.5), quantile(s, 0.99), quantile(s, 0.999)

    # -- observations ------------------------------------------------------------------------------
    def obs(
        self, rank: int, phase: str, age: float, step: int, alive: ProcessState = RUNNING, compute: float | None = None
    ) -> RankObservation:
        p50, p99, p999 = self.quantiles()
        c = compute if compute is not None else self.p.median_s * self.stragglers.get(rank, 1.0)
        return RankObservation(
            rank=rank,
            alive=alive,
            phase=phase,
            phase_step=step,
            phase_seq=step if phase == COLLECTIVE else step - 1,
            phase_age_s=max(age, 0.0),
            progress_age_s=max(age, 0.0),
            n_steps=len(self.periods),
            period_p50_s=p50,
            period_p99_s=p99,
            period_p999_s=p999,
            compute_p50_s=c,
            recent_compute_s=c,
            recent_period_s=p50,
        )

    def instant_obs(
        self, t_rel: float, step: int, explicit: dict[int, float], fault: tuple | None, t_fault_rel: float = math.inf
    ) -> list[RankObservation]:
        """Every rank still computing at t_rel into the step, plus a sample of waiters."""
        out = []
        for r, c in explicit.items():
            if fault is not None and r == fault[1]:
                kind = fault[0]
                alive = RUNNING if (kind == "hang" or t_rel < t_fault_rel) else (GONE if kind == "death" else UNSEEN)
                out.append(self.obs(r, COMPUTING, t_rel, step, alive))
            elif c > t_rel:
                out.append(self.obs(r, COMPUTING, t_rel, step))
            else:
                out.append(self.obs(r, COLLECTIVE, t_rel - c, step))
        taken = set(explicit)
        fastest = self.bulk_extreme(self.p.ranks, top=False)
        for i in range(self.p.waiter_sample):
            r = self.rng.randrange(self.p.ranks)
            if r in taken:
                continue
            taken.add(r)
            c = fastest if i == 0 else self.compute(r)
            out.append(self.obs(r, COMPUTING, t_rel, step) if c > t_rel else self.obs(r, COLLECTIVE, t_rel - c, step))
        return out

    def checks(self, t0: float, t1: float):
        """Global check instants in (t0, t1]."""
        k = math.floor(t0 / self.p.interval_s) + 1
        while k * self.p.interval_s <= t1:
            yield k * self.p.interval_s
            k += 1

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> None:
        p, rng = self.p, self.rng
        n_faults = p.deaths + p.node_losses + p.hangs
        fault_steps = rng.sample(range(p.warm, p.steps), n_faults)
        kinds = ["death"] * p.deaths + ["node-loss"] * p.node_losses + ["hang"] * p.hangs
        rng.shuffle(kinds)
        faults = {s: k for s, k in zip(fault_steps, kinds)}
        strag_at = {
            s: rng.uniform(p.straggler_lo, p.straggler_hi)
            for s in rng.sample(range(p.warm, p.steps - 2 * p.window), p.stragglers)
        }
        strag_since: dict[int, int] = {}
        min_kick_age = min(self.cfg.hang_floor_s, self.cfg.initial_timeout_s) + confirm_window_s(self.cfg)
        t = rng.uniform(0, p.interval_s)
        timed = False
        for s in range(p.steps):
            if s in strag_at:
                r = rng.randrange(p.ranks)
                self.stragglers[r] = strag_at[s]
                strag_since[r] = s
            explicit = {r: self.compute(r) for r in self.stragglers}
            for _ in range(self.poisson(p.ranks * p.pause_p)):
                r = rng.randrange(p.ranks)
                explicit[r] = self.compute(r) * rng.uniform(p.pause_lo, p.pause_hi)
            bulk = self.bulk_extreme(p.ranks - len(explicit), top=True)
            r_bulk = rng.randrange(p.ranks)
            if r_bulk not in explicit:
                explicit[r_bulk] = bulk
            if s in faults:
                t = self.fault(t, s, faults[s], explicit, timed)
                timed = True
                continue
            m = max(explicit.values())
            self.normal_step(t, s, explicit, m, min_kick_age)
            self.add_period(m + p.coll_s)
            t += m + p.coll_s
            if s % p.straggler_every == 0 and s >= p.warm:
                self.straggler_check(s, strag_since)

    def normal_step(self, t: float, s: int, explicit: dict[int, float], m: float, min_kick_age: float) -> None:
        p50, p99, p999 = self.quantiles()
        # baselines: a computing rank past T at a check instant is kicked (a false kick: nobody failed)
        for name, limit in (("fixed-10s", 10.0), ("fixed-600s", 600.0), ("nvrx-5x-max", self.nvrx_limit())):
            for c in explicit.values():
                if c > limit and any(True for _ in self.checks(t + limit, t + c)):
                    self.tally[name].false_kicks += 1
        # the vote can only kick a rank whose age passed its floor: only long steps need a look
        if m <= min_kick_age:
            return
        prev = None
        for tc in self.checks(t + min_kick_age, t + m):
            job = vote(self.instant_obs(tc - t, s, explicit, None), self.cfg, prev, self.cohort)
            prev = job
            self.tally["vote"].false_kicks += sum(1 for r in job.ranks if r.verdict in KICK)

    def nvrx_limit(self) -> float:
        return 5 * self.max_period if len(self.periods) >= 5 else math.inf

    def fault(self, t: float, s: int, kind: str, explicit: dict[int, float], time_full: bool) -> float:
        p = self.p
        victim = self.rng.randrange(p.ranks)
        c = explicit.get(victim) or self.compute(victim)
        t_f_rel = self.rng.uniform(0.05, 0.95) * c  # fails part-way through its compute
        explicit = dict(explicit)
        explicit[victim] = math.inf
        fault = (kind, victim)
        p50, p99, p999 = self.quantiles()
        if kind == "hang":
            target = 3 * p99 + p.interval_s
            self.targets.append(target)
        detected: dict[str, float] = {}
        for name, limit in (("fixed-10s", 10.0), ("fixed-600s", 600.0), ("nvrx-5x-max", self.nvrx_limit())):
            first = next(self.checks(t + max(limit, t_f_rel), t + max(limit, t_f_rel) + p.interval_s), None)
            if first is not None and first - t - t_f_rel <= p.horizon_s:
                detected[name] = first - t - t_f_rel
            if limit < t_f_rel and any(True for _ in self.checks(t + limit, t + t_f_rel)):
                self.tally[name].false_kicks += 1  # kicked while it was still healthy
        prev = None
        for tc in self.checks(t, t + t_f_rel + p.horizon_s):
            rel = tc - t
            obs = self.instant_obs(rel, s, explicit, fault, t_f_rel)
            job = vote(obs, self.cfg, prev, self.cohort)
            prev = job
            v = job.by_rank()
            others = sum(1 for r in job.ranks if r.rank != victim and r.verdict in KICK)
            self.tally["vote"].false_kicks += others
            if v[victim].verdict in KICK:
                if rel < t_f_rel:
                    self.tally["vote"].false_kicks += 1
                    continue
                detected["vote"] = rel - t_f_rel
                if not time_full:
                    self.time_full_vote(rel, s, explicit, fault, t_f_rel, prev, v[victim].verdict)
                break
        for name in METHODS:
            tl = self.tally[name]
            if name not in detected:
                tl.missed += 1
                continue
            (tl.hang_lat if kind == "hang" else tl.death_lat).append(detected[name])
            if kind == "hang":
                tl.hang_events += 1
                tl.hang_within_target += detected[name] <= target
        self.stragglers.pop(victim, None)  # the failed rank is replaced
        stall = max(detected.values(), default=p.horizon_s)
        return t + t_f_rel + min(stall, p.horizon_s) + 10.0  # + restart

    def time_full_vote(
        self, rel: float, s: int, explicit: dict[int, float], fault: tuple, t_f_rel: float, prev, expected: str
    ) -> None:
        """One vote over every rank at a real instant: its time, and that it agrees with the reduced vote."""
        full = []
        for r in range(self.p.ranks):
            if r == fault[1]:
                alive = RUNNING if fault[0] == "hang" else (GONE if fault[0] == "death" else UNSEEN)
                full.append(self.obs(r, COMPUTING, rel, s, alive))
            else:
                c = explicit.get(r) or self.compute(r)
                full.append(self.obs(r, COMPUTING, rel, s) if c > rel else self.obs(r, COLLECTIVE, rel - c, s))
        t0, c0 = time.perf_counter(), time.process_time()
        job = vote(full, self.cfg, None, self.cohort)
        self.vote_10k_s.append(time.perf_counter() - t0)
        self.vote_10k_cpu_s.append(time.process_time() - c0)
        v = job.by_rank()
        kicked = [r.rank for r in job.ranks if r.verdict in KICK]
        if fault[0] == "death" or fault[0] == "hang":
            self.consistent &= kicked == [fault[1]] and v[fault[1]].verdict == expected
        else:  # node loss: confirmation of dead may need the previous check; hung or dead both name it
            self.consistent &= kicked == [fault[1]]

    def straggler_check(self, s: int, since: dict[int, int]) -> None:
        """Every rank's recent own-compute median against the cohort (vote) and NVRx's relative score."""
        p = self.p
        lo = p.window // 2
        meds: dict[int, float] = {}
        for r in range(p.ranks):
            f = self.stragglers.get(r)
            if f is not None and s - since[r] >= p.window:
                meds[r] = statistics.median(self.rng.lognormvariate(self.mu, p.sigma) for _ in range(p.window)) * f
            else:  # median of `window` log-normals, drawn from its order-statistic distribution
                u = self.rng.betavariate(lo + 0.5, p.window - lo + 0.5)
                meds[r] = math.exp(self.mu + p.sigma * ND.inv_cdf(min(max(u, 1e-12), 1 - 1e-12)))
        values = sorted(meds.values())
        med = quantile(values, 0.5)
        mad_ = quantile(sorted(abs(v - med) for v in values), 0.5)
        cohort = Cohort(p.ranks, med, mad_, p.ranks)
        ref = values[0]
        for r, m in meds.items():
            o = RankObservation(rank=r, n_steps=len(self.periods), recent_compute_s=m)
            is_strag = r in self.stragglers and s - since[r] >= p.window
            flagged = cohort_speed(o, cohort, self.cfg).verdict == "slow"
            nv = ref / m < 0.75
            for name, hit in (("vote", flagged), ("nvrx-5x-max", nv)):
                tl = self.tally[name]
                if is_strag and hit and r not in getattr(tl, "_found", set()):
                    tl.__dict__.setdefault("_found", set()).add(r)
                elif not is_strag and hit:
                    tl.straggler_fp += 1
        for r in self.stragglers:
            if s - since[r] >= p.window:
                self.__dict__.setdefault("_strag_seen", set()).add(r)

    def finish(self) -> None:
        seen = self.__dict__.get("_strag_seen", set())
        for name in METHODS:
            tl = self.tally[name]
            tl.stragglers_total = len(seen)
            tl.stragglers_found = len(tl.__dict__.get("_found", set()) & seen)


def pct(values: list[float], q: float) -> float | None:
    return round(quantile(sorted(values), q), 2) if values else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=Params.ranks)
    ap.add_argument("--steps", type=int, default=Params.steps)
    ap.add_argument("--interval", type=float, default=Params.interval_s)
    args = ap.parse_args(argv)
    cfg = load_config()
    p = Params(ranks=args.ranks, steps=args.steps, interval_s=args.interval)
    total = {m: Tally() for m in METHODS}
    vote_times: list[float] = []
    vote_cpu: list[float] = []
    consistent = True
    targets: list[float] = []
    t0 = time.perf_counter()
    for seed in range(args.seeds):
        sim = Sim(p, seed, cfg)
        sim.run()
        sim.finish()
        vote_times += sim.vote_10k_s
        vote_cpu += sim.vote_10k_cpu_s
        consistent &= sim.consistent
        targets += sim.targets
        for m in METHODS:
            a, b = total[m], sim.tally[m]
            a.false_kicks += b.false_kicks
            a.missed += b.missed
            a.hang_lat += b.hang_lat
            a.death_lat += b.death_lat
            a.stragglers_found += b.stragglers_found
            a.stragglers_total += b.stragglers_total
            a.straggler_fp += b.straggler_fp
            a.hang_within_target += b.hang_within_target
            a.hang_events += b.hang_events
    wall = time.perf_counter() - t0
    rows = []
    for m in METHODS:
        tl = total[m]
        detects = m in ("vote", "nvrx-5x-max")
        rows.append(
            {
                "method": m,
                "false_kicks": tl.false_kicks,
                "missed": tl.missed,
                "hang_latency_p50_s": pct(tl.hang_lat, 0.5),
                "hang_latency_p99_s": pct(tl.hang_lat, 0.99),
                "death_latency_p50_s": pct(tl.death_lat, 0.5),
                "death_latency_p99_s": pct(tl.death_lat, 0.99),
                "hangs_within_target": f"{tl.hang_within_target}/{tl.hang_events}",
                "straggler_recall": (
                    round(tl.stragglers_found / tl.stragglers_total, 3) if detects and tl.stragglers_total else 0.0
                ),
                "straggler_false_positives": tl.straggler_fp if detects else 0,
            }
        )
    notes = [
        f"{args.seeds} seed(s) × {p.ranks} ranks × {p.steps} steps; per seed {p.deaths} process deaths, "
        f"{p.node_losses} node losses, {p.hangs} hangs, {p.stragglers} stragglers; checks every {p.interval_s:g} s",
        f"hang target (3 × own P99 step + one check interval): median {pct(targets, 0.5)} s, "
        f"min {round(min(targets), 2) if targets else None} s",
        f"one full vote over {p.ranks} ranks: CPU {pct(vote_cpu, 0.5)} s median / {pct(vote_cpu, 1.0)} s max, "
        f"wall {pct(vote_times, 0.5)} s median / {pct(vote_times, 1.0)} s max on a shared machine (target < 1 s); "
        f"full vote agrees with the reduced vote: {consistent}",
        "false kicks: a healthy or slow rank called dead/hung (vote) or timed out (baselines); "
        "straggler false positives are rank-checks flagged slow that were not stragglers (not kicks)",
        f"bench wall time {wall:.1f} s",
    ]
    emit("dead_vs_slow", rows, args.json, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
