"""In-place generation switch, the pure part: who coordinates, who is evicted, which layout, which frontier.

The in-place runtime (`recovery.runtime.inplace`) gathers the facts — the survivors' reports, what the
process table says of the old generation's members on its host, the ledger's commit record, the
snapshots on disk — and these functions turn them into the next certificate's inputs: one pass of
the coordinator is `decide_eviction` (then the shell kills), `admit_survivors`, `frontier_limit` +
`agree_on_state`, `certified_manifest` and `plan_switch`. No I/O, so every rule has a fast test.

Rank order follows `diagnostics.planners.layout_plan`: rank = dp·(pp·tp) + pp_idx·tp + tp_idx, so
one data-parallel replica is the block of pp·tp consecutive ranks. Only whole replicas can leave:
without one TP shard or PP stage no replica can compute its part of the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuguard.foundation.identity import GONE_STATES
from gpuguard.foundation.inplace_files import Report
from gpuguard.generation.records import Certificate, Frontier, Incarnation, Member
from gpuguard.generation.rules import PROOF_FENCED, PROOF_GONE, PROOF_KILLED, PROOF_LEASE, PROOF_REPORTED
from gpuguard.recovery.snapshots.store import Selection

OPERATOR_ABORT = "operator abort"  # the failure text of a switch an operator asked for (`request_abort`)
REMOTE_WAIT_S = 5.0  # at least this long for a member on another host to report before giving up

Liveness = Literal["gone", "stopped", "running"]


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


def keep_layout_shrink(world: int, replica: int, lost: Iterable[int]) -> Shrink:
    """HSDP's layout-preserving shrink: drop every replica (block of `replica` consecutive ranks, the
    shard group) that lost a rank. The survivors of the others keep their shards at the same shard
    position (dense renumbering preserves it), so nothing moves; the other survivors of a damaged
    replica leave. Refused when the world is not whole replicas or no replica is whole."""
    lost = set(lost)
    if replica < 1 or world % replica:
        return Shrink(None, refused=f"a world of {world} is not whole replicas of {replica} ranks")
    kept = [
        r
        for d in range(world // replica)
        if not lost.intersection(range(d * replica, (d + 1) * replica))
        for r in range(d * replica, (d + 1) * replica)
    ]
    if not kept:
        return Shrink(None, refused=f"every replica of {replica} ranks lost a rank: none keeps its layout")
    return Shrink(Layout(len(kept)), tuple(kept))


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


# ---------------------------------------------------------------------- facts about processes
def liveness(status: str) -> Liveness:
    """`foundation.identity.process_status` of a recorded process -> what the switch acts on: a
    zombie, a reused pid or a process we may not inspect is gone (it cannot be this member any
    more); SIGSTOP / traced is stopped (alive but frozen: killed, never waited for)."""
    if status in GONE_STATES or status == "unknown":
        return "gone"
    return "stopped" if status == "stopped" else "running"


def coordinator_probes(
    reports: Mapping[int, Report], members: Mapping[int, Incarnation], host: str
) -> dict[int, tuple[int, float]]:
    """old rank -> (pid, start time) to probe before choosing the coordinator: the reporters on
    this host, with the start time the parent certificate recorded (0.0 for a rank that was no
    member: no live process matches it, so such a reporter counts as gone)."""
    return {
        r: (rep.pid, members[r].start_time if r in members else 0.0) for r, rep in reports.items() if rep.host == host
    }


def operator_requested(operator: bool, reports: Iterable[Report]) -> bool:
    """The switch is the operator's when this survivor saw the abort or any survivor reported it."""
    return operator or any(r.failure == OPERATOR_ABORT for r in reports)


# ---------------------------------------------------------------------- eviction
@dataclass(frozen=True)
class EvictionFacts:
    """What the coordinator knows of generation G's members in one pass of its decision."""

    generation: int  # G
    members: tuple[Member, ...]  # G's members, by old rank
    reports: Mapping[int, Report]  # old rank -> the report found under that rank
    host: str  # the coordinator's host: only its processes can be probed
    status: Mapping[str, str]  # incarnation id -> process_status, for every member on `host`
    killed_before: Mapping[str, str]  # incarnation id -> evidence, killed by this coordinator earlier
    waited_s: float  # since this coordinator started deciding
    grace_s: float  # how long a member on this host may take to report before it is killed
    lease_expired: frozenset[str] = frozenset()  # remote incarnations whose lease expired (each fenced itself first)
    remote_wait_s: float = REMOTE_WAIT_S  # how long to wait for a remote member (with leases: past its TTL)
    # every sink a remote member could write to refuses an older generation (etcd ledger and coordination:
    # docs/fencing.md): a remote member that is silent (suspected by a survivor's heartbeat, or no report
    # within the grace) is evicted as fenced at once, never waited for until its lease expires
    fenced_sinks: bool = False


@dataclass(frozen=True)
class Kill:
    """A member to SIGKILL (and confirm gone) before the switch: frozen, or silent past the grace."""

    rank: int
    incarnation_id: str
    pid: int
    start_time: float
    evidence: str  # what the certificate says once the kill is confirmed


@dataclass(frozen=True)
class Eviction:
    """Every member of G sorted: lost (dead, killed), still awaited, or kept; the evidence in member order."""

    dead: tuple[int, ...] = ()
    killed: tuple[int, ...] = ()  # killed earlier, or in `kill` (valid once those kills are confirmed)
    kill: tuple[Kill, ...] = ()
    waiting: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()
    evidence: tuple[str, ...] = ()
    give_up: str = ""  # non-empty: stop waiting, refuse the in-place switch with this reason
    proof: Mapping[str, str] = field(default_factory=dict)  # incarnation id -> kind (generation.rules.PROOFS)

    @property
    def lost(self) -> tuple[int, ...]:
        return self.dead + self.killed


def decide_eviction(facts: EvictionFacts) -> Eviction:
    """Who leaves generation G and why, and whether to keep waiting.

    A report counts only if it carries the member's own incarnation (another process on that rank
    number is not this member). On this host: gone (pid + start time) -> dead; stopped, or no
    report after the grace -> killed. On another host nothing can be probed: a member there either
    reported (kept) or is awaited, and after max(grace, remote_wait_s) the switch gives up — unless
    its lease expired: it fenced itself before that could happen (recovery.runtime.lease), so it is dead,
    whether it reported first or not (a reporter that is gone now would only make G+1 fail to form).
    With `fenced_sinks` (every sink refuses an older generation: docs/fencing.md) a remote member
    that has not reported is dead as soon as a survivor's heartbeat names it silent, or the grace
    passed: it may still run until its lease fences it, and nothing it does is seen.
    """
    dead: list[int] = []
    killed: list[int] = []
    kill: list[Kill] = []
    waiting: list[int] = []
    kept: list[int] = []
    evidence: list[str] = []
    proof: dict[str, str] = {}
    host = facts.host
    suspected = {r for rep in facts.reports.values() for r in rep.suspects}
    for m in facts.members:
        inc, rep = m.incarnation, facts.reports.get(m.rank)
        if rep is not None and rep.incarnation_id != inc.id:
            rep = None  # a report from another process on that rank number is not this member's
        st = "remote" if inc.host != host else liveness(facts.status[inc.id])
        overdue = rep is None and st != "remote" and facts.waited_s > facts.grace_s
        if st == "gone" and inc.id in facts.killed_before:  # killed in an earlier pass of this decision
            killed.append(m.rank)
            evidence.append(facts.killed_before[inc.id])
            proof[inc.id] = PROOF_KILLED
        elif st == "gone":
            dead.append(m.rank)
            evidence.append(f"rank {m.rank} incarnation {inc.id}: pid {inc.pid} on {host} gone")
            proof[inc.id] = PROOF_GONE
        elif st == "remote" and inc.id in facts.lease_expired:
            dead.append(m.rank)
            evidence.append(f"rank {m.rank} incarnation {inc.id}: pid {inc.pid} on {inc.host}: {PROOF_LEASE}")
            proof[inc.id] = PROOF_LEASE
        elif (
            st == "remote"
            and rep is None
            and facts.fenced_sinks
            and (m.rank in suspected or facts.waited_s > facts.grace_s)
        ):
            why = "silent to its heartbeat watchers" if m.rank in suspected else f"no report within {facts.grace_s:g} s"
            dead.append(m.rank)
            evidence.append(f"rank {m.rank} incarnation {inc.id} on {inc.host}: {why}; {PROOF_FENCED}")
            proof[inc.id] = PROOF_FENCED
        elif st == "stopped" or overdue:
            why = "stopped (SIGSTOP)" if st == "stopped" else f"no report within {facts.grace_s:g} s"
            said = f"rank {m.rank} incarnation {inc.id}: {why}, killed (pid {inc.pid} on {host} gone)"
            killed.append(m.rank)
            kill.append(Kill(m.rank, inc.id, inc.pid, inc.start_time, said))
            evidence.append(said)
            proof[inc.id] = PROOF_KILLED
        elif rep is None:
            waiting.append(m.rank)
        else:
            kept.append(m.rank)
            evidence.append(
                f"rank {m.rank} incarnation {inc.id}: reported, tore down generation {facts.generation}'s group"
            )
            proof[inc.id] = PROOF_REPORTED
    give_up = ""
    remote = {m.rank for m in facts.members if m.incarnation.host != host}
    if waiting and facts.waited_s > max(facts.grace_s, facts.remote_wait_s) and remote.intersection(waiting):
        give_up = f"ranks {waiting} on other hosts neither reported nor can be proved gone from here"
    return Eviction(
        tuple(dead), tuple(killed), tuple(kill), tuple(waiting), tuple(kept), tuple(evidence), give_up, proof
    )


# ---------------------------------------------------------------------- admission and frontier
@dataclass(frozen=True)
class Admission:
    """The survivors that form G+1 and its layout, or why G's survivors cannot continue in place.
    `replica` (HSDP's layout kept): the ranks per replica, and `dropped` the survivors of the damaged
    replicas, who leave."""

    layout: Layout | None
    kept: tuple[int, ...] = ()  # old ranks, ascending
    refused: str = ""
    replica: int | None = None
    dropped: tuple[int, ...] = ()


def admit_survivors(layout: Layout, eviction: Eviction, replica: int | None = None) -> Admission:
    """Shrink the layout by the lost ranks (whole replicas only) and keep the reporters inside it.
    With `replica` (the policy "keep the HSDP layout if possible", ranks per replica) drop each
    damaged HSDP replica whole when a whole one survives; otherwise every survivor is kept (the
    state is re-partitioned over them)."""
    shrink = shrink_layout(layout, eviction.lost)
    if shrink.layout is None:
        return Admission(None, refused=shrink.refused)
    inside = set(shrink.kept_ranks)
    if replica is not None and layout.tp == layout.pp == 1 and eviction.lost:
        kept = keep_layout_shrink(layout.world, replica, eviction.lost)
        if kept.layout is not None:
            whole = set(kept.kept_ranks)
            return Admission(
                Layout(kept.layout.dp, global_batch=layout.global_batch),
                tuple(r for r in eviction.kept if r in whole),
                replica=replica,
                dropped=tuple(r for r in eviction.kept if r not in whole),
            )
    return Admission(shrink.layout, tuple(r for r in eviction.kept if r in inside))


def certified_manifest(selection: Selection, frontier: int) -> str:
    """The manifest digest the certificate binds: the durable snapshot of exactly the frontier step,
    if one verifies; "" otherwise (the survivors' in-memory copies are the state, by digest)."""
    chosen = selection.chosen
    if chosen is not None and chosen.step == frontier and chosen.manifest_digest:
        return chosen.manifest_digest
    return ""


# ---------------------------------------------------------------------- the certificate
@dataclass(frozen=True)
class SwitchFacts:
    """Everything the in-place certificate is made of, once eviction, admission and agreement passed."""

    parent: Certificate
    previous_layout: Layout
    layout: Layout  # G+1's, from `admit_survivors`
    kept: tuple[int, ...]  # the admitted old ranks, from `admit_survivors`
    eviction: Eviction
    reports: Mapping[int, Report]
    committed_by_all: int | None
    frontier: int
    manifest: str
    state_digest: str | None  # the survivors' agreed replicated-state digest of the frontier
    operator: bool
    phases: Mapping[str, float]  # absolute wall times of this coordinator's phases
    since: float  # when this coordinator started deciding (phases count from "detect", else from this)
    coordinator_rank: int
    coordinator_incarnation: str
    sharded: bool = False  # state_digest is the survivors' chunks together (recovery.runtime.reshard)
    admission: Admission | None = None  # the layout kept (`replica`), and who leaves (`dropped`)


@dataclass(frozen=True)
class SwitchPlan:
    """The certificate to issue (all but the signature and the ledger's compare-and-swap)."""

    members: tuple[Member, ...]
    reason: str
    frontier: Frontier
    quiescence_evidence: tuple[str, ...]
    extra: Mapping[str, Any]


def plan_switch(facts: SwitchFacts) -> SwitchPlan:
    """G+1: the admitted survivors renumbered densely, the frontier, the reason, and what the
    certificate records of the switch (phases relative to detection, layouts, evictions, who rolls back)."""
    parent, kept, ev = facts.parent, facts.kept, facts.eviction
    new_rank = dense_ranks(kept)
    old = parent.ranks
    t0 = facts.phases.get("detect", facts.since)
    extra = {
        "switch": "in-place",
        "phases": {k: round(v - t0, 6) for k, v in facts.phases.items()},
        "layout": facts.layout.to_dict(),
        "previous_layout": facts.previous_layout.to_dict(),
        "evicted": {"dead": list(ev.dead), "killed": list(ev.killed)},
        "rank_map": {str(o): n for o, n in new_rank.items()},
        "committed_by_all": facts.committed_by_all,
        ("sharded_state_digest" if facts.sharded else "replicated_state_digest"): facts.state_digest,
        "coordinator": {"rank": facts.coordinator_rank, "incarnation": facts.coordinator_incarnation},
        "rolled_back": sorted(r for r in kept if (facts.reports[r].committed_step or 0) > facts.frontier),
        "quiescence_by": dict(ev.proof),
    }
    adm = facts.admission
    if adm is not None and adm.replica is not None:
        extra["layout_kept"] = {
            "replica_ranks": adm.replica,
            "dropped": list(adm.dropped),
            "dropped_incarnations": [old[r].id for r in adm.dropped],
        }
    return SwitchPlan(
        members=tuple(Member(new_rank[r], old[r]) for r in kept),
        reason=switch_reason(dead=ev.dead, killed=ev.killed, operator=facts.operator),
        frontier=Frontier(facts.frontier, facts.manifest),
        quiescence_evidence=ev.evidence,
        extra=extra,
    )


def follow_racer(active_generation: int | None, parent_generation: int) -> bool:
    """After the ledger refused my certificate: True when another coordinator already moved the
    ledger past G (follow it), False when the refusal is real (the switch cannot happen in place)."""
    return active_generation is not None and active_generation > parent_generation


def committed_by_all_from_reports(members: Iterable[int], reports: Mapping[int, Report], start: int = 0) -> int | None:
    """What the survivors' reports prove every member of the failed generation committed (None: nothing).

    With no per-step commit records, the in-place coordinator reads it from the reports:
    - every member reported: the smallest committed step, exactly;
    - a member did not (it is lost): a survivor that committed step S completed S's collective on
      the default group, which every member entered only after committing S - 1 (the in-place
      runtime's step function runs a world collective: docs/formats/inplace.md), so every member
      committed at least max(S) - 1 — but only for an S past `start`, the generation's certified
      frontier (where it began: no collective of the generation is behind it); and a survivor
      holds nothing past its own commit: the smallest reported step caps it.
    A survivor that committed nothing proves nothing, nor does a generation in which no step was
    completed (None); nothing below `start` is ever claimed."""
    steps = [rep.committed_step for rep in reports.values()]
    if not steps or any(s is None for s in steps):
        return None
    known = [int(s) for s in steps if s is not None]
    if max(known) <= start:
        return None  # nobody completed a step of this generation: nothing past its certificate
    proved = min(known) if set(members) <= set(reports) else min(min(known), max(known) - 1)
    return max(proved, start)
