"""In-place generation switch, the pure part: who coordinates, who is evicted, which layout, which frontier.

The in-place runtime (`recovery.inplace`) gathers the facts — the survivors' reports, which
processes of the old generation are gone or frozen, the ledger's commit record — and these
functions turn them into the next certificate's inputs. No I/O, so every rule has a fast test.

Rank order follows `diagnostics.planners.layout_plan`: rank = dp·(pp·tp) + pp_idx·tp + tp_idx, so
one data-parallel replica is the block of pp·tp consecutive ranks. Only whole replicas can leave:
without one TP shard or PP stage no replica can compute its part of the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REPORT_SCHEMA = "gpuguard.inplace-report/1"


@dataclass(frozen=True)
class Report:
    """What one survivor of generation G publishes after its group failed (one JSON file)."""

    generation: int
    rank: int  # its logical rank in G
    incarnation_id: str
    pid: int
    host: str
    committed_step: int | None  # the newest step it committed (None: none yet)
    digests: Mapping[int, str]  # step -> replicated-state digest of each local snapshot
    failure: str
    time: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA,
            "generation": self.generation,
            "rank": self.rank,
            "incarnation_id": self.incarnation_id,
            "pid": self.pid,
            "host": self.host,
            "committed_step": self.committed_step,
            "digests": {str(k): v for k, v in sorted(self.digests.items())},
            "failure": self.failure,
            "time": self.time,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Report:
        if d.get("schema") != REPORT_SCHEMA:
            raise ValueError(f"not a {REPORT_SCHEMA} record")
        step = d.get("committed_step")
        return cls(
            int(d["generation"]),
            int(d["rank"]),
            str(d["incarnation_id"]),
            int(d["pid"]),
            str(d["host"]),
            None if step is None else int(step),
            {int(k): str(v) for k, v in dict(d["digests"]).items()},
            str(d.get("failure", "")),
            float(d["time"]),
        )


@dataclass(frozen=True)
class Layout:
    """A TP×PP×DP layout (tp and pp fastest). `global_batch` stays fixed across a shrink: every
    replica then takes global_batch/dp samples and gradients are averaged over the global batch."""

    dp: int
    tp: int = 1
    pp: int = 1
    global_batch: int | None = None

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "world": self.world}
        if self.global_batch is not None:
            d["global_batch"] = self.global_batch
            d["per_replica_batch"] = round(self.global_batch / self.dp, 6)
            d["grad_average"] = f"sum over {self.dp} replicas / global batch {self.global_batch}"
        return d


@dataclass(frozen=True)
class Shrink:
    """The layout after losing some ranks, or the reason it cannot shrink in place."""

    layout: Layout | None
    kept_ranks: tuple[int, ...] = ()
    refused: str = ""


def shrink_layout(layout: Layout, lost: Iterable[int]) -> Shrink:
    """Drop the replicas that lost ranks; refuse when a replica lost only part of its TP/PP group
    (its survivors cannot compute without the missing shard) or when no replica is left."""
    per = layout.tp * layout.pp
    lost = set(lost)
    bad = sorted(r for r in lost if not 0 <= r < layout.world)
    if bad:
        return Shrink(None, refused=f"ranks {bad} are not in the {layout.tp}x{layout.pp}x{layout.dp} layout")
    kept: list[int] = []
    for d in range(layout.dp):
        replica = set(range(d * per, (d + 1) * per))
        gone = replica & lost
        if not gone:
            kept.extend(sorted(replica))
        elif gone != replica:
            return Shrink(
                None,
                refused=(
                    f"replica {d} (ranks {min(replica)}..{max(replica)}) lost ranks {sorted(gone)} "
                    f"but not its whole TP/PP group (tp={layout.tp}, pp={layout.pp}): "
                    "its survivors cannot compute without the missing shard"
                ),
            )
    if not kept:
        return Shrink(None, refused="no complete data-parallel replica survives")
    new = Layout(len(kept) // per, layout.tp, layout.pp, layout.global_batch)
    return Shrink(new, tuple(kept))


def choose_coordinator(reported: Iterable[int], gone: Iterable[int] = ()) -> int | None:
    """The lowest old rank that reported and is not known gone: every survivor computes the same
    answer from the same files, and a process that died before reporting can never be it."""
    alive = sorted(set(reported) - set(gone))
    return alive[0] if alive else None


def dense_ranks(kept_old_ranks: Sequence[int]) -> dict[int, int]:
    """old logical rank -> new logical rank (0..n-1 in old-rank order): what gloo needs."""
    return {old: new for new, old in enumerate(sorted(kept_old_ranks))}


def switch_reason(*, dead: Iterable[int], killed: Iterable[int], operator: bool) -> str:
    """The certificate's reason: a member died > a member hung and was killed > an operator asked."""
    if list(dead):
        return "rank-failure"
    if list(killed):
        return "hang"
    return "operator" if operator else "hang"


@dataclass(frozen=True)
class StateAgreement:
    digest: str | None
    problems: tuple[str, ...] = field(default_factory=tuple)


def agree_on_state(reports: Iterable[Report], frontier: int) -> StateAgreement:
    """Every survivor must hold the frontier's state locally and all must hold the same digest
    (data-parallel replicas are identical); otherwise the switch cannot happen in place."""
    digests: dict[str, list[int]] = {}
    problems = []
    for rep in reports:
        d = rep.digests.get(frontier)
        if d is None:
            have = sorted(rep.digests)
            problems.append(f"rank {rep.rank} holds no local state of step {frontier} (has {have})")
        else:
            digests.setdefault(d, []).append(rep.rank)
    if len(digests) > 1:
        problems.append(
            "survivors disagree on the state of step "
            f"{frontier}: " + "; ".join(f"{d[:12]} on ranks {r}" for d, r in digests.items())
        )
    if problems:
        return StateAgreement(None, tuple(problems))
    return StateAgreement(next(iter(digests)) if digests else None)


def steps_to_roll_back(committed_step: int | None, frontier: int) -> int:
    """How many committed-but-not-certified steps a survivor must undo (the mid-update case)."""
    if committed_step is None:
        return 0
    return max(0, committed_step - frontier)
