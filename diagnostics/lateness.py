"""Which rank is slow, step by step: each rank's own compute time minus the step's median (pure).

Why not the step period: in a synchronous job every rank's period is the slowest rank's, so a
straggler's sparkline looks like everyone else's. Its own compute time (the step log's `E` record,
wait excluded) is what only it spends; against the median of the ranks that ran the same step of the
same generation it is its lateness. No clocks are compared across hosts.
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median
from typing import NamedTuple

from gpuguard.foundation.observations import RankSeries


class LatenessGrid(NamedTuple):
    """Ranks x steps of one generation: `late[i][j]` is rank `ranks[i]`'s lateness (seconds, >= 0
    below the median clipped to 0) at step `steps[j]`, None where the rank has no record of it."""

    generation: int
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    late: tuple[tuple[float | None, ...], ...]

    @property
    def worst(self) -> float:
        return max((v for row in self.late for v in row if v is not None), default=0.0)

    def row_mean(self, i: int) -> float:
        vals = [v for v in self.late[i] if v is not None]
        return sum(vals) / len(vals) if vals else 0.0


def lateness_grid(series: Iterable[RankSeries], *, last: int = 60, generation: int | None = None) -> LatenessGrid:
    """The last `last` steps of `generation` (default: the newest one any rank recorded) as a grid."""
    runs = list(series)
    if generation is None:
        generation = max((s.generation for s in runs if s.steps), default=0)
    computes: dict[int, dict[int, float]] = {}
    for s in runs:
        if s.generation == generation:
            row = computes.setdefault(s.rank, {})
            row.update({st.step: st.compute_s for st in s.steps})
    steps = sorted({step for row in computes.values() for step in row})[-max(1, last) :]
    ranks = tuple(sorted(computes))
    medians = {st: median([computes[r][st] for r in ranks if st in computes[r]]) for st in steps}
    late = tuple(
        tuple(max(0.0, computes[r][st] - medians[st]) if st in computes[r] else None for st in steps) for r in ranks
    )
    return LatenessGrid(generation, ranks, tuple(steps), late)
