"""Activation decisions, pure: which frontier, which reason, is the old generation quiet.

The runtime's coordinator gathers the facts (the parent certificate, the ledger's commit record,
the verified snapshots on disk, what every member saw of the old incarnations on its host) and
these functions turn them into the inputs of the next certificate. No I/O here, so every rule
has a fast unit test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuguard.generation.records import Certificate, Frontier
from gpuguard.recovery.snapshot import Selection


@dataclass(frozen=True)
class Hello:
    """What one member publishes before activation (one JSON value in the attempt's store)."""

    rank: int
    incarnation: Mapping[str, Any]  # Incarnation.to_dict()
    host: str
    old_gone: tuple[str, ...] = ()  # parent incarnations on this host proved gone
    old_alive: tuple[str, ...] = ()  # parent incarnations on this host still running
    newest_local_step: int | None = None  # newest verified snapshot this member can read

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "incarnation": dict(self.incarnation),
            "host": self.host,
            "old_gone": list(self.old_gone),
            "old_alive": list(self.old_alive),
            "newest_local_step": self.newest_local_step,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Hello:
        return cls(
            int(d["rank"]),
            dict(d["incarnation"]),
            str(d["host"]),
            tuple(d.get("old_gone", ())),
            tuple(d.get("old_alive", ())),
            d.get("newest_local_step"),
        )


@dataclass(frozen=True)
class FrontierChoice:
    frontier: Frontier
    limit: int
    note: str
    rejected: tuple[str, ...] = field(default_factory=tuple)


def frontier_limit(parent: Certificate | None, committed_by_all: int | None) -> int:
    """The newest step the next generation may start from: never past what *all* parent members
    committed; the parent's own certified frontier always stays reachable."""
    if parent is None:
        return 0
    return max(parent.frontier.step, committed_by_all if committed_by_all is not None else -1)


def choose_frontier(parent: Certificate | None, committed_by_all: int | None, selection: Selection) -> FrontierChoice:
    """The frontier of the next generation from the newest verified state at or below the limit.

    No verified state at all (first start, or every snapshot rejected) -> step 0 with no digest:
    the job starts from its initial state, and the certificate says so.
    """
    limit = frontier_limit(parent, committed_by_all)
    rejected = tuple(f"step {r.step}: {r.reason}" for r in selection.rejected)
    chosen = selection.chosen
    if chosen is not None and chosen.step <= limit and chosen.manifest_digest:
        return FrontierChoice(
            Frontier(chosen.step, chosen.manifest_digest),
            limit,
            f"newest verified {chosen.kind[:-1]} at or before step {limit}",
            rejected,
        )
    note = "no verified state on disk: start from the initial state" if limit > 0 else "first start"
    return FrontierChoice(Frontier(0, ""), limit, note, rejected)


def quiescence(parent: Certificate | None, hellos: Iterable[Hello]) -> tuple[str, tuple[str, ...]]:
    """`proved` when every parent incarnation was seen gone (pid + create time) by a member on its
    host; else `unknown`, naming the ones nobody could vouch for."""
    if parent is None or not parent.members:
        return "proved", ("no previous members",)
    gone: set[str] = set()
    alive: set[str] = set()
    for h in hellos:
        gone.update(h.old_gone)
        alive.update(h.old_alive)
    evidence: list[str] = []
    unknown: list[str] = []
    for m in parent.members:
        inc = m.incarnation
        if inc.id in alive:
            unknown.append(f"rank {m.rank} incarnation {inc.id} (pid {inc.pid} on {inc.host}) is still running")
        elif inc.id in gone:
            evidence.append(f"rank {m.rank} incarnation {inc.id}: pid {inc.pid} on {inc.host} gone")
        else:
            unknown.append(f"rank {m.rank} incarnation {inc.id} on {inc.host}: no member on that host to check it")
    if unknown:
        return "unknown", tuple(unknown + evidence)
    return "proved", tuple(evidence)


def reason(parent: Certificate | None, new_world: int) -> str:
    if parent is None or not parent.members:
        return "start"
    old = len(parent.members)
    if new_world < old:
        return "scale-down"
    if new_world > old:
        return "scale-up"
    return "rank-failure"


def check_hellos(hellos: Sequence[Hello], world_size: int) -> list[str]:
    """Every rank exactly once, every incarnation exactly once."""
    problems = []
    ranks = sorted(h.rank for h in hellos)
    if ranks != list(range(world_size)):
        problems.append(f"members published ranks {ranks}, expected 0..{world_size - 1}")
    ids = [h.incarnation.get("id") for h in hellos]
    if len(set(ids)) != len(ids):
        problems.append("an incarnation id appears twice")
    return problems
