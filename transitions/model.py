"""A deterministic mini-training whose correct state after any number of steps is exactly computable.

Everything is integer arithmetic modulo a prime, so results are bit-exact on any machine, in any
reduction order, and independent of the world size: the global batch is fixed and split into
contiguous per-rank slices, so the all-reduced gradient of a step does not depend on how many
ranks computed it. That is what lets the oracle compare a run that changed its world size
mid-way with one serial reference.

State = parameters, optimizer state (momentum), RNG state and data-loader position, plus the
step counter. The update is non-commutative (momentum feeds on itself, the gradient depends on
the parameters), so a step applied twice, a skipped step, a stale gradient or a rank one step
ahead all change the numbers.

Two layouts: `dp` (every rank holds everything; the update runs per bucket, interleaved with the
bucket's all-reduce, as an overlapped optimizer does) and `zero1` (momentum sharded by an
ownership map; each rank updates its own slice, then the parameters are all-gathered).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

MOD = 2_147_483_647  # 2**31 - 1, prime
N_PARAMS = 8
GLOBAL_BATCH = 12
BUCKETS: tuple[tuple[int, ...], ...] = ((0, 1, 2, 3), (4, 5, 6, 7))
LAYOUTS = ("dp", "zero1")
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TrainState:
    """One rank's (or the reference's) training state after `step` applied steps.

    `momentum[j]` is None where this rank does not hold slot j (zero1: not its shard).
    """

    step: int
    params: tuple[int, ...]
    momentum: tuple[int | None, ...]
    rng: int
    data_pos: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "params": list(self.params),
            "momentum": list(self.momentum),
            "rng": self.rng,
            "data_pos": self.data_pos,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        return cls(
            int(d["step"]),
            tuple(int(x) for x in d["params"]),
            tuple(None if x is None else int(x) for x in d["momentum"]),
            int(d["rng"]),
            int(d["data_pos"]),
        )

    def digest(self) -> str:
        """SHA-256 of the canonical JSON: what replicas compare and what a frontier names."""
        raw = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()

    def restricted(self, owned: Iterable[int]) -> TrainState:
        """The same state holding momentum only for the `owned` slots (zero1 shard view)."""
        keep = set(owned)
        return replace(self, momentum=tuple(m if j in keep else None for j, m in enumerate(self.momentum)))


def _mix(x: int) -> int:
    """splitmix64 finalizer: a fixed, portable hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def initial_state(seed: int = 0) -> TrainState:
    params = tuple(_mix(seed * 1000 + j) % MOD for j in range(N_PARAMS))
    return TrainState(0, params, (0,) * N_PARAMS, _mix(seed ^ 0x5EED) & _MASK64, 0)


def sample(index: int, j: int) -> int:
    """Feature j of data sample `index` (the data set is infinite and fixed)."""
    return _mix(index * 131 + j) % 1009


def next_rng(rng: int) -> int:
    return (rng * 6364136223846793005 + 1442695040888963407) & _MASK64


def noise(rng: int, j: int) -> int:
    """Per-slot noise drawn from the RNG state of a step (think dropout / stochastic rounding)."""
    return _mix(rng + j) % 257


def batch_slice(world: int, rank: int) -> range:
    """Rank's contiguous slice of the global batch (balanced; any world size 1..GLOBAL_BATCH)."""
    if not 0 <= rank < world or world > GLOBAL_BATCH:
        raise ValueError(f"rank {rank} of world {world} (global batch {GLOBAL_BATCH})")
    base, extra = divmod(GLOBAL_BATCH, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def owner(j: int, world: int) -> int:
    """zero1 ownership map: slot j belongs to this rank (contiguous blocks)."""
    return j * world // N_PARAMS


def owned(world: int, rank: int) -> tuple[int, ...]:
    return tuple(j for j in range(N_PARAMS) if owner(j, world) == rank)


def local_gradient(state: TrainState, world: int, rank: int) -> tuple[int, ...]:
    """Rank's partial gradient for the step after `state` (sum over its slice of the batch)."""
    out = [0] * N_PARAMS
    p = state.params
    for i in batch_slice(world, rank):
        idx = state.data_pos + i
        for j in range(N_PARAMS):
            out[j] = (out[j] + sample(idx, j) * (p[(j + 1) % N_PARAMS] + 1 + i)) % MOD
    return tuple(out)


def reduce_sum(parts: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """All-reduce (sum) in fixed rank order; modular, hence exact."""
    out = [0] * N_PARAMS
    for part in parts:
        for j, v in enumerate(part):
            out[j] = (out[j] + v) % MOD
    return tuple(out)


def update_slots(state: TrainState, grad: Sequence[int], slots: Iterable[int]) -> TrainState:
    """The optimizer write for `slots` (momentum then parameter), nothing else advances."""
    step_rng = next_rng(state.rng)
    params = list(state.params)
    mom = list(state.momentum)
    for j in slots:
        m = mom[j] or 0  # None: no momentum yet
        m = (3 * m + grad[j] + noise(step_rng, j)) % MOD
        mom[j] = m
        params[j] = (params[j] - m) % MOD
    return replace(state, params=tuple(params), momentum=tuple(mom))


def finish_step(state: TrainState) -> TrainState:
    """The end of a step: the RNG and the data loader advance, the step counter moves on."""
    return replace(state, step=state.step + 1, rng=next_rng(state.rng), data_pos=state.data_pos + GLOBAL_BATCH)


def apply_step(state: TrainState, grad: Sequence[int]) -> TrainState:
    """A whole step's update on a full replica."""
    return finish_step(update_slots(state, grad, range(N_PARAMS)))


def reference(seed: int, n: int) -> TrainState:
    """The state after n serial steps on one rank: the oracle's answer."""
    s = initial_state(seed)
    for _ in range(n):
        s = apply_step(s, local_gradient(s, 1, 0))
    return s


def distributed_reference(seed: int, worlds: Sequence[int], layout: str = "dp") -> TrainState:
    """The same steps computed the distributed way: step i runs on `worlds[i]` ranks.

    Per-rank partial gradients, an all-reduce in rank order, per-bucket (dp) or per-shard (zero1)
    updates, then the all-gather; the momentum is re-assembled from its owners. Must equal
    `reference(seed, len(worlds))` bit for bit: the model's world-size independence.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}")
    s = initial_state(seed)
    for world in worlds:
        grad = reduce_sum([local_gradient(s, world, r) for r in range(world)])
        if layout == "dp":
            for bucket in BUCKETS:
                s = update_slots(s, grad, bucket)
            s = finish_step(s)
        else:
            shards = [update_slots(s, grad, owned(world, r)) for r in range(world)]
            params = list(s.params)
            mom = list(s.momentum)
            for r, shard in enumerate(shards):
                for j in owned(world, r):
                    params[j], mom[j] = shard.params[j], shard.momentum[j]
            s = finish_step(replace(s, params=tuple(params), momentum=tuple(mom)))
    return s
