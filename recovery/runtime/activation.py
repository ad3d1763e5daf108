"""Activation decisions, pure: which frontier, which reason, is the old generation quiet.

The restart coordinator (`recovery.runtime.restart`) gathers the facts (the parent certificate, the
ledger's commit record, the operator's restore pin, the verified snapshots on disk, what every
member saw of the old incarnations on its host) and these functions turn them into the inputs of
the next certificate (`plan_activation`). No I/O here, so every rule has a fast unit test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuguard.generation.frontier import frontier_limit
from gpuguard.generation.records import Certificate, Frontier, Incarnation, Member
from gpuguard.generation.rules import PROOF_FENCED, PROOF_GONE, PROOF_LEASE
from gpuguard.recovery.snapshots.store import Rejection, Selection

MAX_UNRESTORABLE_SKIPS = 8  # states skipped as unrestorable before the coordinator takes what is left


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


def quiescence(
    parent: Certificate | None,
    hellos: Iterable[Hello],
    lease_expired: frozenset[str] = frozenset(),
    fenced: frozenset[str] = frozenset(),
) -> tuple[str, tuple[str, ...]]:
    """`proved` when every parent incarnation was seen gone (pid + create time) by a member on its
    host, or (across hosts, etcd ledger) its lease expired, which it fenced itself before, or it is
    fenced (every sink it could write to refuses its generation: docs/fencing.md); else `unknown`,
    naming the ones nobody could vouch for."""
    q, evidence, _ = quiescence_proofs(parent, hellos, lease_expired, fenced)
    return q, evidence


def quiescence_proofs(
    parent: Certificate | None,
    hellos: Iterable[Hello],
    lease_expired: frozenset[str] = frozenset(),
    fenced: frozenset[str] = frozenset(),
) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """`quiescence` plus, per old incarnation id, the proof that held (`rules.PROOFS`): what the
    certificate records as `extra.quiescence_by`. A process seen alive on its host is never proved
    quiet by a lease or by fencing (a live process outranks a missing key: it could still hold a
    resource no sink guards, its GPU). `fenced`: incarnations no member can see whose every sink
    refuses their generation: quiet without waiting for their lease (docs/fencing.md)."""
    if parent is None or not parent.members:
        return "proved", ("no previous members",), {}
    gone: set[str] = set()
    alive: set[str] = set()
    for h in hellos:
        gone.update(h.old_gone)
        alive.update(h.old_alive)
    evidence: list[str] = []
    unknown: list[str] = []
    by: dict[str, str] = {}
    for m in parent.members:
        inc = m.incarnation
        if inc.id in alive:
            unknown.append(f"rank {m.rank} incarnation {inc.id} (pid {inc.pid} on {inc.host}) is still running")
        elif inc.id in gone:
            evidence.append(f"rank {m.rank} incarnation {inc.id}: pid {inc.pid} on {inc.host} gone")
            by[inc.id] = PROOF_GONE
        elif inc.id in lease_expired:
            evidence.append(f"rank {m.rank} incarnation {inc.id} on {inc.host}: {PROOF_LEASE}")
            by[inc.id] = PROOF_LEASE
        elif inc.id in fenced:
            evidence.append(f"rank {m.rank} incarnation {inc.id} on {inc.host}: {PROOF_FENCED}")
            by[inc.id] = PROOF_FENCED
        else:
            unknown.append(
                f"rank {m.rank} incarnation {inc.id} on {inc.host}: no member on that host to check it "
                "and no expired lease"
            )
    if unknown:
        return "unknown", tuple(unknown + evidence), {}
    return "proved", tuple(evidence), by


def unvouched(parent: Certificate | None, hellos: Iterable[Hello]) -> tuple[str, ...]:
    """Parent incarnations no member saw on its own host (gone or alive): only a lease can prove them."""
    if parent is None:
        return ()
    seen: set[str] = set()
    for h in hellos:
        seen.update(h.old_gone)
        seen.update(h.old_alive)
    return tuple(m.incarnation.id for m in parent.members if m.incarnation.id not in seen)


def branch_problem(
    generation: int | None, step: int, frontiers: Mapping[int, int], parent_generation: int
) -> str | None:
    """Why a state written by `generation` at `step` is not on the chain that ends in the parent, or None.

    Generation h resumed from its frontier F_h (`frontiers[h]`): every state of an older generation
    after F_h was redone by h, so such a copy is a superseded branch, e.g. the late write of a stale
    incarnation (a partitioned rank 0 that came back) or a state the chain rolled back past. It is
    refused where it is read, whatever its writer's clock or lease did."""
    if generation is None:
        return "its state record names no generation"
    if generation > parent_generation:
        return f"written by generation {generation}, newer than the active generation {parent_generation}"
    for h in sorted(frontiers):
        if generation < h <= parent_generation and frontiers[h] < step:
            return (
                f"written by generation {generation}, but generation {h} resumed from step "
                f"{frontiers[h]}: a superseded branch (a stale incarnation's write)"
            )
    return None


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


def restore_bound(parent: Certificate | None, committed_by_all: int | None, pin: int | None) -> int:
    """The newest step to look for a snapshot at: the frontier limit, and never past a state
    `gpu-recover restore` pinned (an operator's choice only ever moves the frontier back)."""
    bound = frontier_limit(parent, committed_by_all)
    return bound if pin is None else min(bound, pin)


def skip_unrestorable(selection: Selection, older: Selection) -> Selection:
    """The selection once its chosen state is dropped because a member already failed to load it:
    `older` (searched below that step) takes its place, and every rejection is kept, in step order,
    so the certificate says why the newer states were passed over."""
    chosen = selection.chosen
    if chosen is None:
        return selection
    return Selection(
        older.chosen,
        (
            *selection.rejected,
            Rejection(chosen.step, chosen.path, "unrestorable: a member failed to load it"),
            *(r for r in older.rejected if r.step < chosen.step),
        ),
        selection.limit,
    )


def admitted_members(hellos: Iterable[Hello]) -> tuple[Member, ...]:
    """The next generation's members: every incarnation that published a hello, on its own rank."""
    return tuple(Member(h.rank, Incarnation.from_dict(h.incarnation)) for h in hellos)


def rejections_to_log(choice: FrontierChoice) -> tuple[str, ...]:
    """The rejections worth a log line: a state newer than the frontier is expected, not a problem."""
    return tuple(line for line in choice.rejected if "after the frontier" not in line)


@dataclass(frozen=True)
class ActivationFacts:
    """What the coordinator gathered before issuing the next generation's certificate."""

    parent: Certificate
    hellos: tuple[Hello, ...]
    committed_by_all: int | None  # None: the parent has no members, or one of them committed nothing
    selection: Selection  # the restorable state at or below `restore_bound`, unrestorable ones skipped
    restore_pin: int | None
    world_size: int
    attempt_token: str = ""
    attempt_source: str = ""
    restart_count: int = 0
    rendezvous_round: int | None = None  # the torchrun rendezvous round the members were started in
    lease_expired: frozenset[str] = frozenset()  # parent incarnations whose etcd lease expired (fenced first)
    fenced: frozenset[str] = frozenset()  # parent incarnations no member can see, every sink refusing them
    rendezvous_participants: tuple[str, ...] = ()  # the round's agents (torch's node names), group-rank order


@dataclass(frozen=True)
class ActivationPlan:
    """The certificate to issue (all but the signature and the ledger's compare-and-swap)."""

    members: tuple[Member, ...]
    reason: str
    choice: FrontierChoice
    quiescence: str
    quiescence_evidence: tuple[str, ...]
    extra: Mapping[str, Any]
    log_rejected: tuple[str, ...]
    consume_pin: bool  # the restore pin was honoured once: archive it so later generations are bounded by commits


def plan_activation(facts: ActivationFacts) -> ActivationPlan:
    """The restart path's certificate: the hellos' incarnations on their ranks, the frontier from
    the newest verified state in bounds, quiescence from what the members saw on their hosts and,
    for hosts no member is on, from expired leases."""
    parent = facts.parent
    choice = choose_frontier(parent, facts.committed_by_all, facts.selection)
    q, evidence, by = quiescence_proofs(parent, facts.hellos, facts.lease_expired, facts.fenced)
    extra: dict[str, Any] = {
        "switch": "restart",
        "attempt": facts.attempt_token,
        "attempt_source": facts.attempt_source,
        "rendezvous_round": facts.rendezvous_round,
        "rendezvous_participants": list(facts.rendezvous_participants),
        "restart_count": facts.restart_count,
        "committed_by_all": facts.committed_by_all,
        "frontier_note": choice.note,
        "rejected": list(choice.rejected[:16]),
        "world_size": facts.world_size,
        "restore_pin": facts.restore_pin,
    }
    if by:  # which proof held for each old incarnation (checked by generation.rules.quiescence_proofs)
        extra["quiescence_by"] = by
    return ActivationPlan(
        members=admitted_members(facts.hellos),
        reason=reason(parent, facts.world_size),
        choice=choice,
        quiescence=q,
        quiescence_evidence=evidence,
        extra=extra,
        log_rejected=rejections_to_log(choice),
        consume_pin=facts.restore_pin is not None,
    )
