"""Planners: checkpoint interval (Young/Daly), TP×PP×DP layout after a failure, ring vs tree cost.

Pure arithmetic with the assumptions spelled out, so an operator can check them against the seed's
worked examples (c = 60 s, λ = 1/3 per hour → Δt* ≈ 19 min, overhead ≈ 10.5 %; 8192 = 64 × 16 × 8).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuguard.diagnostics.voters import ring_allreduce_s, tree_allreduce_s
from gpuguard.foundation.errors import UsageError

SCHEMA = "gpuguard.plan/1"
# The inputs' bounds: the largest training jobs are ~10^5 GPUs. A layout lists its groups rank by rank,
# so an unbounded --tp (e.g. 99999999999999999999) would try to build them all (23 GB before the OOM
# killer); and a count past float range would overflow the arithmetic. Past a bound: a usage error (64).
MAX_RANKS = 1_000_000  # world size of a layout, --ranks of a collective, --gpus of a checkpoint plan
MAX_BATCH = 10**15  # --global-batch
MAX_SECONDS = 10**9  # --cost, --async-blocking: ~30 years


def _bounded(value: float, upper: float, what: str) -> None:
    """A usage error (64) naming the option when `value` is past its bound (`MAX_*` above)."""
    if not value <= upper:  # also catches NaN
        raise UsageError(f"{what} must be at most {upper:,}, got {str(value)[:40]}")


# -- checkpoint interval -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointPlan:
    interval_s: float  # Young: Δt* = √(2 c_blocking / λ) (at least the background write time)
    overhead_fraction: float  # expected fraction of time lost at the optimum (checkpointing + rework)
    failures_per_hour: float
    job_mtbf_hours: float
    cost_s: float
    blocking_s: float
    background_s: float
    interval_daly_s: float  # Daly's higher-order refinement (matters when c is not ≪ MTBF)
    checkpoint_overhead_fraction: float
    rework_fraction: float
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return {"schema": SCHEMA, "plan": "checkpoint", **d}


def failure_rate_per_hour(
    failures_per_hour: float | None = None, mtbf_hours: float | None = None, gpus: int | None = None
) -> float:
    """λ for the whole job: given directly, or per-GPU MTBF divided across N GPUs (independent failures)."""
    if failures_per_hour is not None:
        if failures_per_hour <= 0:
            raise UsageError("--failures-per-hour must be > 0")
        return float(failures_per_hour)
    if mtbf_hours is None or gpus is None:
        raise UsageError("give --failures-per-hour, or --mtbf-hours with --gpus")
    if mtbf_hours <= 0 or gpus <= 0:
        raise UsageError("--mtbf-hours and --gpus must be > 0")
    _bounded(gpus, MAX_RANKS, "--gpus")
    return gpus / mtbf_hours


def checkpoint_plan(cost_s: float, failures_per_hour: float, async_blocking_s: float | None = None) -> CheckpointPlan:
    """Young/Daly. Waste per unit time W(Δ) = b/Δ + λ(Δ/2 + w), minimised at Δ* = √(2b/λ).

    Synchronous: b = c, w = 0 → W* = √(2cλ). Asynchronous: only the blocking part b stalls training;
    the background part w = c − b extends the rework window (a failure while the write is in flight
    loses back to the previous checkpoint), and the next checkpoint cannot start before it ends.
    """
    if cost_s <= 0:
        raise UsageError("--cost must be > 0 seconds")
    _bounded(cost_s, MAX_SECONDS, "--cost")
    lam = failures_per_hour / 3600.0
    b = cost_s if async_blocking_s is None else float(async_blocking_s)
    if b < 0 or b > cost_s:
        raise UsageError("--async-blocking must be between 0 and --cost")
    w = cost_s - b
    notes: list[str] = []
    if b == 0:
        interval = max(w, 1.0)
        notes.append("no blocking part: checkpoint back to back (interval = background write time)")
    else:
        interval = math.sqrt(2 * b / lam)
        if interval < w:
            interval = w
            notes.append("the background write is longer than the optimum: interval raised to the write time")
    ckpt = b / interval
    rework = lam * (interval / 2 + w)
    mtbf_s = 1 / lam
    if b < 2 * mtbf_s:
        r = b / (2 * mtbf_s)
        daly = math.sqrt(2 * b * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - b if b > 0 else interval
        daly = max(daly, w)
    else:
        daly = mtbf_s
        notes.append("checkpoint cost ≥ 2 × MTBF: Daly's optimum is the MTBF itself")
    if interval * lam > 0.5:
        notes.append("interval is a large fraction of the MTBF: first-order Young is optimistic, prefer Daly")
    return CheckpointPlan(
        interval,
        ckpt + rework,
        failures_per_hour,
        1 / failures_per_hour,
        cost_s,
        b,
        w,
        daly,
        ckpt,
        rework,
        tuple(notes),
    )


# -- layout ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutPlan:
    tp: int
    pp: int
    dp: int
    world: int
    failed_rank: int
    coords: dict[str, int]  # tp, pp, dp index of the failed rank
    tp_group: tuple[int, ...]
    pp_group: tuple[int, ...]
    dp_group: tuple[int, ...]
    replica: tuple[int, ...]  # the whole DP replica (pp × tp ranks)
    hot_spare: dict[str, Any]
    shrink: dict[str, Any]
    order: str = "tp fastest, then pp, then dp: rank = dp·(pp·tp) + pp_idx·tp + tp_idx"
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("tp_group", "pp_group", "dp_group", "replica", "notes"):
            d[k] = list(d[k])
        return {"schema": SCHEMA, "plan": "layout", **d}


def layout_plan(tp: int, pp: int, dp: int, failed_rank: int, global_batch: int | None = None) -> LayoutPlan:
    """Which groups rank R is in; what a hot spare restores; what shrinking costs (a whole DP replica)."""
    if min(tp, pp, dp) < 1:
        raise UsageError("--tp, --pp and --dp must be ≥ 1")
    for value, what in ((tp, "--tp"), (pp, "--pp"), (dp, "--dp")):
        _bounded(value, MAX_RANKS, what)
    world = tp * pp * dp
    _bounded(world, MAX_RANKS, f"--tp × --pp × --dp ({tp}×{pp}×{dp})")
    if global_batch is not None:
        _bounded(global_batch, MAX_BATCH, "--global-batch")
    if not 0 <= failed_rank < world:
        raise UsageError(f"--failed-rank must be in [0, {world - 1}] for {tp}×{pp}×{dp} = {world} ranks")
    t = failed_rank % tp
    p = (failed_rank // tp) % pp
    d = failed_rank // (tp * pp)
    per_replica = tp * pp
    tp_group = tuple(d * per_replica + p * tp + i for i in range(tp))
    pp_group = tuple(d * per_replica + j * tp + t for j in range(pp))
    dp_group = tuple(k * per_replica + p * tp + t for k in range(dp))
    replica = tuple(range(d * per_replica, (d + 1) * per_replica))
    hot = {
        "gpus_needed": 1,
        "world_after": world,
        "dp_after": dp,
        "restores": f"the exact {tp}×{pp}×{dp} layout; rank {failed_rank}'s TP shard {t} of PP stage {p}",
        "state_from": (
            f"any DP peer at the same (pp={p}, tp={t}) position, e.g. rank "
            f"{dp_group[(d + 1) % dp] if dp > 1 else 'none (dp=1): from the last checkpoint'}"
        ),
        "batch": "unchanged",
        "learning_rate": "unchanged",
    }
    after_dp = dp - 1
    shrink: dict[str, Any] = {
        "possible": after_dp >= 1,
        "gpus_lost": per_replica,
        "healthy_gpus_idled": per_replica - 1,
        "world_after": world - per_replica,
        "dp_after": after_dp,
        "why_not_tp_or_pp": (
            f"TP (size {tp}) splits every layer's matrices and PP (size {pp}) splits the layers: "
            "without the failed shard no replica can compute its part, so the whole DP replica "
            f"of {per_replica} ranks goes"
        ),
        "throughput_after": f"{after_dp}/{dp} = {after_dp / dp:.4f} of before" if dp else "",
    }
    if global_batch is not None and after_dp >= 1:
        per_replica_batch = global_batch / dp
        shrink["batch"] = {
            "keep_global_batch": (
                f"each replica takes {global_batch / after_dp:.3g} samples instead of "
                f"{per_replica_batch:.3g} (more micro-batches / grad accumulation): same LR, "
                f"{dp / after_dp:.4f}× longer steps"
            ),
            "keep_per_replica_batch": (
                f"global batch {global_batch} → {per_replica_batch * after_dp:.6g}; "
                f"scale the LR by {after_dp}/{dp} = {after_dp / dp:.4f} (linear rule)"
            ),
        }
    else:
        shrink["batch"] = (
            f"global batch shrinks by 1/{dp} unless each of the {after_dp} replicas takes more "
            f"micro-batches; with a smaller batch scale the LR by {after_dp}/{dp} (linear rule)"
        )
    notes = (
        f"a ZeRO/distributed optimizer sharded over DP must be resharded from {dp} to {after_dp} ways on shrink",
        "the data loader's sample order changes on shrink unless it is re-sharded by global sample index",
    )
    return LayoutPlan(
        tp,
        pp,
        dp,
        world,
        failed_rank,
        {"tp": t, "pp": p, "dp": d},
        tp_group,
        pp_group,
        dp_group,
        replica,
        hot,
        shrink,
        notes=notes,
    )


# -- collective cost ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CollectivePlan:
    ranks: int
    nbytes: float
    bandwidth_bytes_s: float
    latency_s: float
    ring_s: float
    tree_s: float
    best: str
    ring_bandwidth_term_s: float
    ring_latency_term_s: float
    crossover_bytes: float  # above this, ring wins; below, tree

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "plan": "collective", **asdict(self)}


def collective_plan(ranks: int, nbytes: float, bandwidth_bytes_s: float, latency_s: float) -> CollectivePlan:
    """Ring: 2(N−1)/N · S/BW + 2(N−1)·α; tree: 2·S/BW + 2⌈log2 N⌉·α. Ring is bandwidth-optimal, tree latency-optimal."""
    if ranks < 1 or nbytes < 0 or bandwidth_bytes_s <= 0 or latency_s < 0:
        raise UsageError("need --ranks ≥ 1, --bytes ≥ 0, --bandwidth > 0, --latency ≥ 0")
    _bounded(ranks, MAX_RANKS, "--ranks")
    ring = ring_allreduce_s(nbytes, ranks, bandwidth_bytes_s, latency_s)
    tree = tree_allreduce_s(nbytes, ranks, bandwidth_bytes_s, latency_s)
    bw_term = 2 * (ranks - 1) / ranks * nbytes / bandwidth_bytes_s if ranks > 1 else 0.0
    lat_term = 2 * (ranks - 1) * latency_s if ranks > 1 else 0.0
    # ring == tree where (2/N)·S/BW = (2(N-1) - 2⌈log2 N⌉)·α  →  S = N·(N-1-⌈log2 N⌉)·α·BW
    cross = (
        ranks * max(0, ranks - 1 - math.ceil(math.log2(ranks))) * latency_s * bandwidth_bytes_s if ranks > 1 else 0.0
    )
    best = "ring" if ring <= tree else "tree"
    return CollectivePlan(ranks, nbytes, bandwidth_bytes_s, latency_s, ring, tree, best, bw_term, lat_term, cross)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGTP]?)(i?)([Bb]?)(?:/s)?\s*$")


def parse_quantity(text: str, *, what: str) -> float:
    """'1e9', '256MB', '4GiB', '100GB/s', '25Gb/s' (bits) → a number of bytes (or bytes/s)."""
    m = _SIZE.match(str(text))
    if not m:
        raise UsageError(f"{what}: cannot read {text!r} (examples: 1e9, 256MB, 4GiB, 100GB/s)")
    value = float(m.group(1))
    prefix, binary, unit = m.group(2), m.group(3), m.group(4)
    base = 1024 if binary else 1000
    value *= base ** "_KMGTP".index(prefix) if prefix else 1
    if unit == "b":
        value /= 8
    if not math.isfinite(value):  # '1e999' reads as inf
        raise UsageError(f"{what}: {text!r} is not a finite number")
    return value
