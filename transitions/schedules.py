"""Fault schedules: where in a step the fault strikes, what the fault is, and who is caught where.

A schedule is data. Each boundary names a *site* of step F (a collective, the commit record, the
checkpoint write) and the set of ranks that got past it when the fault struck (`ahead`); the
others did not. Each fault says who leaves, who joins, what arrives late, what is corrupted:

* process-death   the victim dies (confirmed exit); a hot spare takes its rank (same world size)
* comm-abort      nobody dies; the communicator is aborted, in-flight collectives fail
* stale-completion nobody dies; the aborted operation of the ranks not ahead completes *late*,
                  after the next generation started (a gradient, a commit record, a shard write)
* rank-reuse      the victim hangs (not confirmed dead) and a new process takes its rank number;
                  the old incarnation wakes up later and finishes what it was doing
* scale-down      the victim dies and is not replaced
* scale-up        a new node joins at the boundary (one more rank)
* corrupt-shard   the victim dies and is replaced, and one shard of the newest complete checkpoint
                  on disk has a flipped value (the file still parses)
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuguard.transitions.model import LAYOUTS

# boundary -> (site, whether the `ahead` ranks got past it)
BOUNDARIES: dict[str, tuple[str, bool]] = {
    "before-allreduce": ("collective0", False),  # nobody's first all-reduce of step F completed
    "allreduce-partial": ("collective0", True),  # it completed on some ranks only
    "mid-optimizer-write": (
        "collective1",
        True,
    ),  # dp: bucket 0 written everywhere, bucket 1 on some; zero1: all-gather on some
    "before-commit": ("commit", False),  # every rank updated, no commit record written
    "mid-ledger-write": ("commit", True),  # some ranks' commit records written
    "mid-checkpoint-write": ("checkpoint", True),  # step F's checkpoint: some shards written
}
FAULTS = ("process-death", "comm-abort", "stale-completion", "rank-reuse", "scale-down", "scale-up", "corrupt-shard")


@dataclass(frozen=True)
class Schedule:
    fault: str
    boundary: str
    layout: str = "dp"
    world: int = 4
    steps: int = 10  # the job trains this many steps in all
    checkpoint_every: int = 3
    fault_step: int = 6  # a checkpoint step, so every site exists in it
    ahead_ranks: tuple[int, ...] = (0, 1)
    victim_rank: int = 3  # never in `ahead`: it is caught before the boundary's action
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r} (one of {', '.join(FAULTS)})")
        if self.boundary not in BOUNDARIES:
            raise ValueError(f"unknown boundary {self.boundary!r} (one of {', '.join(BOUNDARIES)})")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}")
        if self.victim_rank in self.ahead_ranks or not 0 <= self.victim_rank < self.world:
            raise ValueError("the victim must be a rank that is not ahead")
        if self.fault_step % self.checkpoint_every or not 0 < self.fault_step < self.steps:
            raise ValueError("the fault step must be a checkpoint step inside the run")

    @property
    def name(self) -> str:
        return f"{self.fault}@{self.boundary}/{self.layout}"

    @property
    def site(self) -> str:
        return BOUNDARIES[self.boundary][0]

    @property
    def ahead(self) -> frozenset[int]:
        """Ranks that got past the site when the fault struck."""
        return frozenset(self.ahead_ranks) if BOUNDARIES[self.boundary][1] else frozenset()

    @property
    def victim(self) -> int | None:
        """The rank that leaves (dies, or hangs for rank-reuse)."""
        return (
            self.victim_rank if self.fault in ("process-death", "rank-reuse", "scale-down", "corrupt-shard") else None
        )

    @property
    def replaced(self) -> bool:
        """A new process takes the victim's rank number."""
        return self.fault in ("process-death", "rank-reuse", "corrupt-shard")

    @property
    def zombie(self) -> bool:
        """The victim is not dead: it finishes its interrupted action after the next generation started."""
        return self.fault == "rank-reuse"

    @property
    def joiners(self) -> int:
        return 1 if self.fault == "scale-up" else 0

    @property
    def new_world(self) -> int:
        return self.world - (1 if self.fault == "scale-down" else 0) + self.joiners

    @property
    def late(self) -> frozenset[int]:
        """Ranks whose interrupted operation completes late (stale completion; the zombie)."""
        behind = frozenset(r for r in range(self.world) if r not in self.ahead)
        if self.fault == "stale-completion":
            return behind
        if self.zombie:
            return frozenset({self.victim_rank})
        return frozenset()

    @property
    def corrupt(self) -> bool:
        return self.fault == "corrupt-shard"

    @property
    def progress_at_fault(self) -> int:
        """Steps every rank had completed when the fault struck (for steps lost)."""
        return self.fault_step if self.site in ("commit", "checkpoint") else self.fault_step - 1


def matrix(layouts: tuple[str, ...] = LAYOUTS, seed: int = 0) -> list[Schedule]:
    """Every fault at every boundary, for each layout."""
    return [Schedule(f, b, layout, seed=seed) for layout in layouts for f in FAULTS for b in BOUNDARIES]
