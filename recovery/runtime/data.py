"""The data position as state: which samples each step takes, resumable at any world size.

A data loader's position is training state (torchft #309: a restart that lost it trained on other
data than the fault-free run would have). `SampleStream` is the position of a map-style dataset of
`size` samples under a documented rule (docs/formats/sharded-snapshots.md, "Data position"):

- each epoch's order is a permutation of the sample ids, seeded by (seed, epoch);
- step k of an epoch takes the global batch `perm[k*B : (k+1)*B]` (an epoch has size // B steps:
  the last size mod B ids of its permutation are not used);
- rank r of W takes positions `[r*B // W, (r+1)*B // W)` of that global batch.

The state is the global position (epoch, samples taken in it), the same on every rank, so a
snapshot keeps one copy and a restore at another world size goes on from it: every sample is seen
once an epoch, each step's global batch is the fault-free run's, and only the split over the ranks
changes. Register it with `Runtime.activate(..., data=stream)` (any object with `state_dict` /
`load_state_dict` works the same way); its state goes into every snapshot under `dataloader`.

Standard library only: the permutation is `random.Random`'s shuffle (the same on every platform and
CPython 3 version), so a reference can be computed anywhere.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

STATE_KEYS = ("epoch", "position", "seed", "size", "global_batch")


def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    """The sample ids of `epoch` in the order the rule takes them."""
    order = list(range(size))
    random.Random(f"gpuguard-samples/{seed}/{epoch}").shuffle(order)
    return order


def share(batch: list[int], rank: int, world: int) -> list[int]:
    """Rank `rank`'s share of a global batch: positions [rank*B // world, (rank+1)*B // world)."""
    n = len(batch)
    return batch[rank * n // world : (rank + 1) * n // world]


@dataclass
class SampleStream:
    """The position of a `size`-sample dataset read `global_batch` samples a step (module docstring)."""

    size: int
    global_batch: int
    seed: int = 0
    epoch: int = 0
    position: int = 0  # samples of this epoch already taken (a multiple of global_batch)
    _order: tuple[int, list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.size < self.global_batch:
            raise ValueError(f"a step takes 1..{self.size} samples, not {self.global_batch}")

    @property
    def steps_per_epoch(self) -> int:
        return self.size // self.global_batch

    def peek(self) -> list[int]:
        """The next step's global batch (nothing moves)."""
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(self.size, self.seed, self.epoch))
        return self._order[1][self.position : self.position + self.global_batch]

    def take(self, rank: int, world: int) -> list[int]:
        """This rank's samples of the next step, and the position moves on one step (every rank
        calls it once a step, so every rank's copy moves alike)."""
        batch = self.peek()
        self.position += self.global_batch
        if self.position + self.global_batch > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        return share(batch, rank, world)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size,
                "global_batch": self.global_batch}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved position; a position of another dataset or batch size is refused
        (ValueError): its global index does not mean the same samples here."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"data position lacks {', '.join(missing)}")
        for k in ("seed", "size", "global_batch"):
            if int(state[k]) != getattr(self, k):
                raise ValueError(f"data position of {k} {int(state[k])}, this stream has {getattr(self, k)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0 or position % self.global_batch or position + self.global_batch > self.size:
            raise ValueError(f"data position epoch {epoch} sample {position} is not a step boundary")
        self.epoch, self.position = epoch, position


def reference_batches(size: int, global_batch: int, seed: int, steps: int) -> list[list[int]]:
    """The global batches of the first `steps` steps under the rule (what a fault-free run takes)."""
    stream = SampleStream(size, global_batch, seed)
    return [stream.take(0, 1) for _ in range(steps)]
