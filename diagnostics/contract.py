"""The collective contract: every rank of a process group issues the same collectives, in the same
order, with the same op, size, dtype and reduce op. Pure: takes traces, returns a report.

NCCL and gloo match calls by *position*, not by name: if one rank skips a collective, its next
call pairs with the others' skipped one, and the job hangs or aborts at a *later* call whose
stack trace points at the wrong line. So the checker aligns every process group's entries by
sequence id, finds the first sequence where ranks disagree, votes a majority (the culprits are
the others), classifies the disagreement, and looks for the true start: a rank whose call sites
drift from the majority's earlier on, or whose calls are the majority's shifted by one.

Entries of different generations (gpuguard generations, Flight Recorder reset epochs) are separate
timelines and are never compared with each other; so are disjoint groups that share a name (a
timeline is a name *and* a member set, from pg_config).

Ranks' entries need not be identical: where they differ, `diagnostics.collective_semantics` says
whether the collective allows it (gather/scatter roots, uneven all_to_all, `_v` variants) and who
is wrong when it does not. Sends and recvs are paired per pair of ranks, in order.

Input is compact on purpose (1,024 ranks x 2,000 entries must fit in seconds): each rank's stream
holds sequence ids and small integer ids into one `Interner` of signatures and call sites.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from gpuguard.diagnostics.collective_semantics import (
    LEGIT,
    ROOT_MISMATCH,
    TOTALS_MISMATCH,
    Finding,
    coalesced_members,
    fmt_shapes,
    judge,
    numel,
    self_inconsistent,
)
from gpuguard.foundation.traces import ABSENT, COMPLETED, SCHEDULED, Interner, RankTrace, Signature, Stream

SCHEMA = "gpuguard.contract/1"

MISSING_PARTICIPANT = "missing_participant"
OP_MISMATCH = "op_mismatch"
SIZE_MISMATCH = "size_mismatch"
DTYPE_MISMATCH = "dtype_mismatch"
REDUCE_OP_MISMATCH = "reduce_op_mismatch"
STATE_MISMATCH = "state_mismatch"
MEMBERSHIP_MISMATCH = "membership_mismatch"
P2P_MISMATCH = "p2p_mismatch"
KINDS = (
    MISSING_PARTICIPANT,
    OP_MISMATCH,
    SIZE_MISMATCH,
    DTYPE_MISMATCH,
    REDUCE_OP_MISMATCH,
    STATE_MISMATCH,
    ROOT_MISMATCH,
    TOTALS_MISMATCH,
    MEMBERSHIP_MISMATCH,
    P2P_MISMATCH,
)

DEFAULT_PG_NAMES = frozenset({"0", "default", "default_pg"})

_K = TypeVar("_K", bound=Hashable)  # a vote's key: a signature id or a completion state


@dataclass(frozen=True)
class Side:
    """One side of a divergence: the ranks that agree, and what they issued (None: nothing)."""

    ranks: tuple[int, ...]
    signature: Signature | None
    state: str | None
    call_site: str | None

    def to_json(self) -> dict[str, Any] | None:
        if self.signature is None:
            return None
        doc = self.signature.to_json()
        doc["state"] = self.state
        doc["call_site"] = self.call_site
        return doc


@dataclass(frozen=True)
class Divergence:
    pg: str
    generation: int
    seq: int
    kind: str
    ranks: tuple[int, ...]  # culprits (everyone outside the majority)
    majority: Side
    others: tuple[Side, ...]  # the culprits, grouped by what they did
    field: str
    explanation: str
    hints: tuple[str, ...] = ()
    ambiguous: bool = False  # no strict majority, or the ranks may legitimately differ: the culprit is a guess
    pg_desc: str = ""
    members: tuple[int, ...] | None = None  # the group's member set (pg_config), when the dumps say
    record: str | None = None  # inside a coalesced group: which record differs

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        sides = (self.majority, *self.others)
        return tuple(sorted(r for s in sides if s.signature is None for r in s.ranks))

    def to_json(self) -> dict[str, Any]:
        return {
            "pg": self.pg,
            "pg_desc": self.pg_desc,
            "generation": self.generation,
            "seq": self.seq,
            "kind": self.kind,
            "field": self.field,
            "ranks": list(self.ranks),
            "majority_ranks": list(self.majority.ranks),
            "missing_ranks": list(self.missing_ranks),
            "expected": self.majority.to_json(),
            "actual": self.others[0].to_json() if self.others else None,
            "actual_by_group": [{"ranks": list(s.ranks), "value": s.to_json()} for s in self.others],
            "ambiguous": self.ambiguous,
            "members": list(self.members) if self.members is not None else None,
            "record": self.record,
            "explanation": self.explanation,
            "hints": list(self.hints),
        }


@dataclass(frozen=True)
class Timeline:
    """The verdict for one (process group, member set, generation) and scope."""

    pg: str
    generation: int
    ranks: tuple[int, ...]
    missing_dumps: tuple[int, ...]
    first_seq: int | None
    last_seq: int | None
    checked: int
    divergence: Divergence | None
    pg_desc: str = ""
    members: tuple[int, ...] | None = None  # from pg_config; None: not recorded (gloo), taken from the dumps
    scope: str = "collectives"  # or "p2p" (send/recv pairs) or "membership" (ranks disagree on the members)

    def to_json(self) -> dict[str, Any]:
        return {
            "pg": self.pg,
            "pg_desc": self.pg_desc,
            "scope": self.scope,
            "members": list(self.members) if self.members is not None else None,
            "generation": self.generation,
            "ranks": list(self.ranks),
            "missing_dumps": list(self.missing_dumps),
            "window": [self.first_seq, self.last_seq],
            "sequences_checked": self.checked,
            "holds": self.divergence is None,
            "divergence": self.divergence.to_json() if self.divergence else None,
        }


@dataclass(frozen=True)
class ContractReport:
    timelines: tuple[Timeline, ...]
    warnings: tuple[str, ...]
    partial: bool

    @property
    def divergences(self) -> list[Divergence]:
        return [t.divergence for t in self.timelines if t.divergence is not None]

    @property
    def first_divergence(self) -> Divergence | None:
        found = self.divergences
        return found[0] if found else None

    @property
    def holds(self) -> bool:
        return not self.divergences


# ----------------------------------------------------------------------------------------------
# The checker

# One point-to-point record, as `collectors.flight_recorder` reads it (plain tuple: the readers and
# the judges share no classes but foundation's): (pg name, pg desc, generation, p2p seq id, "send" or
# "recv", source group rank, destination group rank, shapes, dtypes, state, time created ns).
P2PRecord = tuple[str, str, int, int, str, int, int, Any, Any, str, int]

_TimelineKey = tuple[str, int, tuple[int, ...] | None]  # (pg name, generation, member set or None)


def check(
    traces: Iterable[RankTrace],
    interner: Interner,
    *,
    pg: str | None = None,
    world_size: int | None = None,
    warnings: Iterable[str] = (),
    partial: bool = False,
    p2p: Mapping[int, Sequence[P2PRecord]] | None = None,
    completed: Mapping[int, Mapping[str, int]] | None = None,
) -> ContractReport:
    """Check every (process group, member set, generation) timeline; return the report.

    `p2p`: each rank's point-to-point records (paired send with recv per pair of ranks).
    `completed`: each rank's last completed sequence id per pg (Flight Recorder `pg_status`): a rank
    whose `onlyActive` dump holds no entries for a group has completed everything up to it.
    `partial`: the caller already knows some input is missing (a refused file).
    """
    warns = list(warnings)
    by_rank: dict[int, RankTrace] = {}
    for trace in traces:
        if trace.rank in by_rank:
            warns.append(
                f"rank {trace.rank}: two dumps ({by_rank[trace.rank].source}, {trace.source}); using the first"
            )
            partial = True
            continue
        by_rank[trace.rank] = trace
    p2p_by_rank = {r: recs for r, recs in (p2p or {}).items() if r in by_rank}
    done_by_rank = completed or {}

    world = world_size or max((t.world_size or 0 for t in by_rank.values()), default=0) or None
    if world is None and by_rank:
        world = max(by_rank) + 1  # ranks are 0..N-1: a gap is a missing dump
    generations: dict[int, set[int]] = {}
    per_name: dict[tuple[str, int], dict[int, Stream | None]] = {}
    desc: dict[tuple[str, int], str] = {}

    def wanted(name: str, d: str) -> bool:
        return pg is None or pg in (name, d, f"{name}:{d}")

    for trace in by_rank.values():
        for stream in trace.streams:
            if not wanted(stream.pg, stream.pg_desc):
                continue
            key = (stream.pg, stream.generation)
            per_name.setdefault(key, {})[trace.rank] = stream
            desc.setdefault(key, stream.pg_desc)
            generations.setdefault(stream.generation, set()).add(trace.rank)
    for rank, recs in p2p_by_rank.items():
        for rec in recs:
            if wanted(rec[0], rec[1]):
                per_name.setdefault((rec[0], rec[2]), {}).setdefault(rank, None)
                desc.setdefault((rec[0], rec[2]), rec[1])
                generations.setdefault(rec[2], set()).add(rank)
    if len(generations) > 1:
        warns.append(
            "dumps cover generations "
            + ", ".join(f"{g} (ranks {_ranks(sorted(r))})" for g, r in sorted(generations.items()))
            + ": each generation is checked as its own timeline, never against another"
        )

    absent: set[int] = set()
    if world and len(generations) <= 1:
        absent = set(range(world)) - set(by_rank)
        if absent:
            partial = True
            warns.append(
                f"no dump from rank(s) {_ranks(absent)} (expected ranks 0-{world - 1}): their part of "
                "every contract is unknown"
            )
    bad_sigs = self_inconsistent(interner.signatures)
    results: list[tuple[Timeline, int]] = []
    cluster_of: dict[tuple[str, int, int], _TimelineKey] = {}
    for (name, gen), streams in sorted(per_name.items(), key=lambda kv: (kv[0][1], _pg_order(kv[0][0]))):
        pg_desc = desc[(name, gen)]
        for members, ranks_here, clash in _clusters(name, streams, by_rank):
            tkey: _TimelineKey = (name, gen, members)
            for r in ranks_here:
                cluster_of[(name, gen, r)] = tkey
            if clash is not None:
                partial = True
                warns.append(
                    f"pg {name} generation {gen}: ranks disagree about its members (pg_config); its collectives "
                    "are compared over the union, which may not be one group"
                )
                results.append((_membership_timeline(name, gen, pg_desc, clash), 0))
            is_default = name in DEFAULT_PG_NAMES or pg_desc == "default_pg"
            mem = set(ranks_here) | set(members or ())
            if members is None and (is_default or set(ranks_here) == generations.get(gen, set())):
                # a group that spans every dump we have (gloo records no membership): the absent ranks too
                mem |= generations.get(gen, set()) | absent
            missing = tuple(sorted(mem - set(by_rank)))
            if missing and not absent:
                partial = True
                warns.append(
                    f"pg {_label(name, members)} generation {gen}: no dump from rank(s) {_ranks(missing)}; "
                    "their part of the contract is unknown"
                )
            present = {r: streams.get(r) for r in sorted(mem) if r in by_rank}
            done = {
                r: d
                for r in present
                if (present[r] is None or not len(present[r].seqs))  # type: ignore[union-attr]
                and (d := _done(done_by_rank.get(r), name)) is not None
            }
            result = _check_timeline(name, gen, pg_desc, members, present, missing, done, interner, bad_sigs)
            split = _name_shared_by_disjoint_groups(result[0], present) if members is None and not is_default else None
            if split is None:
                results.append(result)
                continue
            partial = True
            warns.append(
                f"pg {name} generation {gen}: ranks {' and '.join(_ranks(c) for c in split)} never issued one "
                "matching entry: taken as separate groups sharing the name (as split_group makes them); the dumps "
                "record no member sets (gloo), so this is a guess"
            )
            for part in split:
                sub = {r: present[r] for r in part}
                results.append(_check_timeline(name, gen, pg_desc, None, sub, (), {}, interner, bad_sigs))
    if p2p_by_rank:
        results.extend(_check_p2p(p2p_by_rank, cluster_of, by_rank, wanted))
    checked = sum(t.checked for t, _ in results)
    if checked == 0 and not any(t.divergence is not None for t, _ in results):
        partial = True
        warns.append(
            "nothing compared: no collective or point-to-point record is held by every rank of its group, "
            "so the contract is unknown, not holding"
        )
    results.sort(key=lambda tt: (tt[0].divergence is None, tt[1]))
    return ContractReport(tuple(t for t, _ in results), tuple(warns), partial)


def _name_shared_by_disjoint_groups(t: Timeline, streams: Mapping[int, Stream | None]) -> list[list[int]] | None:
    """Without member sets, two groups sharing a name look like one group that diverges. Ranks that
    fall into classes (2+ ranks each) which agree within and differ from each other at *every*
    sequence id are those groups; one wrong rank, or ranks that agreed before, are a divergence."""
    d = t.divergence
    if d is None or d.kind in (MISSING_PARTICIPANT, STATE_MISMATCH) or any(s is None for s in streams.values()):
        return None
    classes: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for r, s in streams.items():
        assert s is not None
        classes.setdefault((tuple(s.seqs), tuple(s.sig_ids)), []).append(r)
    if len(classes) < 2 or any(len(v) < 2 for v in classes.values()):
        return None
    keys = list(classes)
    for i, (seqs_a, ids_a) in enumerate(keys):
        col_a = dict(zip(seqs_a, ids_a))
        for seqs_b, ids_b in keys[i + 1 :]:
            if any(col_a.get(q) == v for q, v in zip(seqs_b, ids_b)):
                return None  # they issued one identical entry: one group
    return sorted(sorted(v) for v in classes.values())


def _done(status: Mapping[str, int] | None, name: str) -> int | None:
    if not status:
        return None
    return status.get(name)


def _label(name: str, members: tuple[int, ...] | None) -> str:
    return name if members is None else f"{name} [{_ranks(members)}]"


def _clusters(
    name: str, streams: Mapping[int, Stream | None], by_rank: Mapping[int, RankTrace]
) -> list[tuple[tuple[int, ...] | None, list[int], dict[tuple[int, ...], list[int]] | None]]:
    """Split one group name into timelines by member set (`pg_config`): disjoint groups that share
    a name (`split_group`, per-rank one-member groups) never talk to each other. Overlapping but
    different member sets are one group whose ranks disagree about its members: `clash`."""
    views: dict[int, tuple[int, ...] | None] = {r: by_rank[r].pg_ranks.get(name) for r in streams}
    known = {v for v in views.values() if v is not None}
    if not known:
        return [(None, sorted(streams), None)]
    # union overlapping member sets
    comps: list[set[int]] = []
    comp_views: list[set[tuple[int, ...]]] = []
    for v in sorted(known):
        hit = [i for i, c in enumerate(comps) if c & set(v)]
        merged, mviews = set(v), {v}
        for i in reversed(hit):
            merged |= comps.pop(i)
            mviews |= comp_views.pop(i)
        comps.append(merged)
        comp_views.append(mviews)
    out: list[tuple[tuple[int, ...] | None, list[int], dict[tuple[int, ...], list[int]] | None]] = []
    placed: set[int] = set()
    for comp, cviews in zip(comps, comp_views):
        ranks_here = sorted(r for r, v in views.items() if (v is not None and v in cviews) or (v is None and r in comp))
        placed.update(ranks_here)
        clash = None
        if len(cviews) > 1:
            clash = {v: sorted(r for r in ranks_here if views[r] == v) for v in sorted(cviews)}
        out.append((tuple(sorted(comp)), ranks_here, clash))
    rest = sorted(set(streams) - placed)
    if rest:
        out.append((None, rest, None))
    return out


def _membership_timeline(name: str, gen: int, pg_desc: str, clash: dict[tuple[int, ...], list[int]]) -> Timeline:
    groups = sorted(clash.items(), key=lambda kv: (-len(kv[1]), kv[1][:1]))
    sides = [
        Side(tuple(ranks), Signature(op=f"members [{_ranks(view)}]"), None, None) for view, ranks in groups if ranks
    ]
    everyone = tuple(sorted(r for _, ranks in groups for r in ranks))
    explanation = f"pg {name}" + (f" generation {gen}" if gen else "") + ": its ranks disagree about its members: "
    explanation += "; ".join(f"rank(s) {_ranks(ranks)} say [{_ranks(view)}]" for view, ranks in groups if ranks)
    explanation += " (pg_config): the group was created with different rank lists, so its collectives cannot match."
    majority, others = sides[0], tuple(sides[1:])
    div = Divergence(
        name,
        gen,
        0,
        MEMBERSHIP_MISMATCH,
        tuple(sorted(r for s in others for r in s.ranks)),
        majority,
        others,
        "members",
        explanation,
        ambiguous=len(sides) > 1 and len(sides[0].ranks) == len(sides[1].ranks),
        pg_desc=pg_desc,
    )
    return Timeline(name, gen, everyone, (), None, None, 0, div, pg_desc, scope="membership")


def _pg_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def _first_time(streams: Mapping[int, Stream | None], seq: int) -> int:
    """When the divergent call was issued (earliest rank): broken timelines are listed earliest first."""
    best = 1 << 62
    for stream in streams.values():
        if stream is None or stream.times_ns is None:
            continue
        i = _index(stream, seq)
        if i is not None and stream.times_ns[i]:
            best = min(best, stream.times_ns[i])
    return best


class _Col:
    """A read-only `seq -> value` view of one stream column: O(1) on contiguous streams."""

    __slots__ = ("stream", "values")

    def __init__(self, stream: Stream | None, values: Sequence[Any] | None) -> None:
        self.stream, self.values = stream, values

    def get(self, seq: int, default: Any = None) -> Any:
        if self.stream is None or self.values is None:
            return default
        i = _index(self.stream, seq)
        return default if i is None else self.values[i]

    def __contains__(self, seq: int) -> bool:
        return self.stream is not None and _index(self.stream, seq) is not None

    def __getitem__(self, seq: int) -> Any:
        v = self.get(seq, _MISS)
        if v is _MISS:
            raise KeyError(seq)
        return v

    def __bool__(self) -> bool:
        return self.stream is not None and len(self.stream.seqs) > 0

    def max(self) -> int:
        assert self.stream is not None
        return self.stream.seqs[-1]


_MISS = object()
_STATE_DIFF_CAP = 64


def _contiguous(s: Stream | None) -> bool:
    return s is None or not s.seqs or s.seqs[-1] - s.seqs[0] + 1 == len(s.seqs)


def _check_timeline(
    name: str,
    gen: int,
    pg_desc: str,
    members: tuple[int, ...] | None,
    streams: dict[int, Stream | None],
    missing: tuple[int, ...],
    done: dict[int, int],
    interner: Interner,
    bad_sigs: frozenset[int] = frozenset(),
) -> tuple[Timeline, int]:
    ranks = tuple(streams)
    scan = {r: s for r, s in streams.items() if r not in done}  # onlyActive: completed, nothing active
    live = [s for s in scan.values() if s is not None and len(s.seqs)]
    if not live:
        return Timeline(name, gen, ranks, missing, None, None, 0, None, pg_desc, members=members), 0
    # Ring buffers drop old entries: only the window every rank still holds is comparable.
    start = max(s.seqs[0] for s in live)
    last = max(s.seqs[-1] for s in live)
    order = list(scan)
    held: Sequence[int]
    if all(_contiguous(s) for s in scan.values()):
        diffs, state_cands, held = _scan_contiguous(scan, start)
    else:
        diffs, state_cands, held = _scan_general(scan, order, start, last)
    cols = {r: _Col(s, s.sig_ids if s is not None else None) for r, s in streams.items()}
    states = {r: _Col(s, s.states if s is not None else None) for r, s in streams.items()}
    group_size = len(members) if members is not None else len(streams) + len(missing)
    complete = not missing
    # a rank done through N (onlyActive, no entries) never issued N+1: a missing participant there
    late = [max(start, d + 1) for d in done.values() if d < last]
    if late:
        diffs = sorted(set(diffs) | {min(late)})
    if complete and bad_sigs:  # an entry every rank issued identically can still break its rule (a2a totals)
        bad = bad_sigs
        if bad:
            ref = live[0]
            extra = [q for q, i in zip(ref.seqs, ref.sig_ids) if i in bad and q >= start]
            if extra:
                diffs = sorted(set(diffs) | set(extra[:1]))
    div: Divergence | None = None
    contract_div: int | None = None
    for seq in diffs:
        at = order + [r for r, d in done.items() if d < seq]
        div = _classify(name, gen, seq, at, cols, states, streams, interner, group_size, complete, bad_sigs)
        if div is not None:
            contract_div = seq
            break
    state_div: int | None = None
    if not all(s.states_reliable for s in live):
        state_cands = set()
    for seq in sorted(state_cands):
        if contract_div is not None and seq >= contract_div:
            break
        sts = {states[r].get(seq) for r in order}
        if COMPLETED in sts and SCHEDULED in sts:
            state_div = seq
            break
    if state_div is not None and (contract_div is None or state_div < contract_div):
        div = _state_divergence(name, gen, state_div, order, cols, states, streams, interner)
    checked = bisect_left(held, div.seq) if div is not None else len(held)
    if div is not None:
        div = replace(div, pg_desc=pg_desc, members=members)
    t = Timeline(name, gen, ranks, missing, start, last, checked, div, pg_desc, members=members)
    return t, (_first_time(streams, div.seq) if div is not None else 0)


def _scan_contiguous(streams: dict[int, Stream | None], start: int) -> tuple[list[int], set[int], range]:
    """Compare every rank's window with the longest one as whole lists (C speed); index only differences.

    Returns the ascending sequence ids where some rank's entry differs from the reference (the
    checker then asks the semantics table whether that difference is allowed), state candidates,
    and the sequence ids compared."""
    ref = max((s for s in streams.values() if s is not None and len(s.seqs)), key=lambda s: s.seqs[-1])
    ro = start - ref.seqs[0]
    ref_ids = list(ref.sig_ids[ro:])
    ref_states = list(ref.states[ro:])
    total = len(ref_ids)
    diffs: set[int] = set()
    cands: set[int] = set()
    for s in streams.values():
        if s is None or not len(s.seqs):
            diffs.add(start)
            continue
        o = start - s.seqs[0]
        ids = list(s.sig_ids[o:])
        n = len(ids)
        if n != total or ids != ref_ids[:n]:
            if n < total:
                diffs.add(start + n)
            if ids != ref_ids[:n]:
                diffs.update(start + k for k, (a, b) in enumerate(zip(ids, ref_ids)) if a != b)
        sts = list(s.states[o:])
        if sts != ref_states[:n]:
            found = 0
            for k in range(n):
                if sts[k] != ref_states[k]:
                    cands.add(start + k)
                    found += 1
                    if found == _STATE_DIFF_CAP:
                        break
    return sorted(diffs), cands, range(start, start + total)


def _scan_general(
    streams: dict[int, Stream | None], order: list[int], start: int, last: int
) -> tuple[list[int], set[int], list[int]]:
    """Non-contiguous streams (gaps, merged coalesced groups): align through dicts."""
    picked = [streams[r] for r in order]
    cols = [dict(zip(s.seqs, s.sig_ids)) if s is not None else {} for s in picked]
    sts = [dict(zip(s.seqs, s.states)) if s is not None else {} for s in picked]
    held: list[int] = []
    diffs: list[int] = []
    cands: set[int] = set()
    for seq in range(start, last + 1):
        vals = [c.get(seq, ABSENT) for c in cols]
        first = vals[0]
        if vals.count(first) != len(vals):
            diffs.append(seq)
            held.append(seq)
            continue
        if first == ABSENT:
            continue  # a sequence id nobody holds
        held.append(seq)
        if len({d.get(seq) for d in sts}) > 1:
            cands.add(seq)
    return diffs, cands, held


# -- point-to-point -------------------------------------------------------------------------------


def _check_p2p(
    p2p: Mapping[int, Sequence[P2PRecord]],
    cluster_of: Mapping[tuple[str, int, int], _TimelineKey],
    by_rank: Mapping[int, RankTrace],
    wanted: Any,
) -> list[tuple[Timeline, int]]:
    """Pair each send with its recv, in order, per (group, sender, receiver): NCCL and gloo match
    point-to-point calls between two ranks of a group in the order they were posted."""
    sends: dict[_TimelineKey, dict[tuple[int, int], list[tuple[int, P2PRecord]]]] = {}
    recvs: dict[_TimelineKey, dict[tuple[int, int], list[tuple[int, P2PRecord]]]] = {}
    descs: dict[_TimelineKey, str] = {}
    for rank, recs in sorted(p2p.items()):
        for rec in recs:
            name, pdesc, gen, _, op, src, dst = rec[:7]
            if not wanted(name, pdesc):
                continue
            key = cluster_of.get((name, gen, rank), (name, gen, None))
            descs.setdefault(key, pdesc)
            pair = (_global(key[2], src), _global(key[2], dst))
            (sends if op == "send" else recvs).setdefault(key, {}).setdefault(pair, []).append((rank, rec))
    out: list[tuple[Timeline, int]] = []
    for key in sorted(set(sends) | set(recvs), key=lambda k: (k[1], _pg_order(k[0]), k[2] or ())):
        name, gen, members = key
        s_by, r_by = sends.get(key, {}), recvs.get(key, {})
        checked = 0
        found: list[tuple[int, Divergence]] = []
        ranks: set[int] = set()
        for pair in sorted(set(s_by) | set(r_by)):
            a, b = pair
            ranks.update(p for p in pair if p >= 0)
            if a not in by_rank or b not in by_rank:
                continue  # the peer's dump is missing: already partial
            ss, rr = s_by.get(pair, []), r_by.get(pair, [])
            for k in range(max(len(ss), len(rr))):
                s_rec = ss[k][1] if k < len(ss) else None
                r_rec = rr[k][1] if k < len(rr) else None
                d = _p2p_pair(name, gen, a, b, k, s_rec, r_rec)
                if d is None:
                    checked += 1
                    continue
                t = min(x[10] for x in (s_rec, r_rec) if x is not None) or (1 << 62)
                found.append((t, replace(d, pg_desc=descs[key], members=members)))
                break
        found.sort(key=lambda td: td[0])
        div = found[0][1] if found else None
        tl = Timeline(
            name, gen, tuple(sorted(ranks)), (), None, None, checked, div, descs[key], members=members, scope="p2p"
        )
        out.append((tl, found[0][0] if found else 0))
    return out


def _global(members: tuple[int, ...] | None, group_rank: int) -> int:
    """A group rank as a global rank (Flight Recorder names p2p peers by group rank)."""
    if members is None:
        return group_rank  # the default group, or no member list recorded (gloo): the same numbers
    return members[group_rank] if 0 <= group_rank < len(members) else -1


def _p2p_sig(rec: P2PRecord) -> Signature:
    op, src, dst, sizes, dtypes = rec[4], rec[5], rec[6], rec[7], rec[8]
    label = f"send {src}->{dst}" if op == "send" else f"recv {dst}<-{src}"
    return Signature(op=label, in_sizes=sizes, in_dtypes=dtypes)


def _p2p_pair(
    name: str, gen: int, a: int, b: int, k: int, s_rec: P2PRecord | None, r_rec: P2PRecord | None
) -> Divergence | None:
    where = f"pg {name}" + (f" generation {gen}" if gen else "")
    if s_rec is not None and r_rec is not None:
        s_sig, r_sig = _p2p_sig(s_rec), _p2p_sig(r_rec)
        same_n = _numel(s_sig.in_sizes) == _numel(r_sig.in_sizes)
        same_dt = s_sig.in_dtypes == r_sig.in_dtypes or not s_sig.in_dtypes or not r_sig.in_dtypes
        if same_n and same_dt:
            return None
        fld = "size" if not same_n else "dtype"
        sender = Side((a,), s_sig, s_rec[9], None)
        receiver = Side((b,), r_sig, r_rec[9], None)
        explanation = (
            f"{where}: point-to-point message {k + 1} from rank {a} to rank {b}: rank {a} sent "
            f"{_describe(s_sig, shapes=True)} (p2p #{s_rec[3]}), rank {b} posted a recv of "
            f"{_describe(r_sig, shapes=True)} (p2p #{r_rec[3]}): the {fld} must match; either side may be wrong."
        )
        return Divergence(
            name, gen, s_rec[3], P2P_MISMATCH, (a, b), sender, (receiver,), fld, explanation, ambiguous=True
        )
    rec = s_rec if s_rec is not None else r_rec
    assert rec is not None
    sig = _p2p_sig(rec)
    if s_rec is not None:
        issued, never = Side((a,), sig, rec[9], None), Side((b,), None, None, None)
        text = f"rank {a} sent {_describe(sig, shapes=True)} (p2p #{rec[3]}) to rank {b}, which never posted its recv"
    else:
        issued, never = Side((b,), sig, rec[9], None), Side((a,), None, None, None)
        text = f"rank {b} waits to receive {_describe(sig, shapes=True)} (p2p #{rec[3]}) from rank {a}, which never sent it"
    explanation = f"{where}: point-to-point message {k + 1}: {text}; the waiting side is blocked: this is the hang."
    return Divergence(name, gen, rec[3], MISSING_PARTICIPANT, never.ranks, issued, (never,), "presence", explanation)


def _numel(shapes: Any) -> int:
    return numel(shapes)


def _site_at(stream: Stream | None, seq: int, interner: Interner) -> str | None:
    if stream is None or stream.site_ids is None:
        return None
    i = _index(stream, seq)
    if i is None or stream.site_ids[i] == ABSENT:
        return None
    return interner.sites[stream.site_ids[i]]


def _index(stream: Stream, seq: int) -> int | None:
    seqs = stream.seqs
    if not seqs:
        return None
    i = seq - seqs[0]
    if 0 <= i < len(seqs) and seqs[i] == seq:
        return i
    lo, hi = 0, len(seqs)
    while lo < hi:  # non-contiguous stream: binary search
        mid = (lo + hi) // 2
        if seqs[mid] < seq:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(seqs) and seqs[lo] == seq else None


def _vote(groups: dict[_K, list[int]]) -> tuple[_K, bool]:
    """The majority key; ties go to the side that issued the call, then to the lowest rank."""
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0] == ABSENT, min(kv[1])))
    ambiguous = len(ranked) > 1 and len(ranked[0][1]) == len(ranked[1][1])
    return ranked[0][0], ambiguous


def _field(a: Signature, b: Signature) -> tuple[str, str]:
    if a.op != b.op:
        return OP_MISMATCH, "op"
    if a.numel() != b.numel() or a.in_sizes != b.in_sizes or a.out_sizes != b.out_sizes:
        return SIZE_MISMATCH, "count" if a.numel() != b.numel() else "shape"
    if a.in_dtypes != b.in_dtypes or a.out_dtypes != b.out_dtypes:
        return DTYPE_MISMATCH, "dtype"
    return REDUCE_OP_MISMATCH, "reduce_op"


def _describe(sig: Signature | None, *, shapes: bool = False) -> str:
    if sig is None:
        return "nothing"
    parts = [sig.op]
    n = sig.numel()
    if n is not None:
        parts.append(f"count={n}")
    if shapes and (sig.in_sizes is not None or sig.out_sizes is not None):
        parts.append(f"in={fmt_shapes(sig.in_sizes)}")
        if sig.out_sizes is not None and not sig.op.startswith(("send ", "recv ")):
            parts.append(f"out={fmt_shapes(sig.out_sizes)}")
    if sig.in_dtypes:
        parts.append(f"dtype={','.join(sig.in_dtypes)}")
    if sig.reduce_op:
        parts.append(f"op={sig.reduce_op}")
    return " ".join(parts)


def _record_in_group(a: Signature, b: Signature) -> str | None:
    """Which record of a coalesced group differs: `record 2 of 3 (all_reduce)`."""
    members = coalesced_members(a.op)
    if not members or a.op != b.op:
        return None
    for side in ("in", "out"):
        sa = a.in_sizes if side == "in" else a.out_sizes
        sb = b.in_sizes if side == "in" else b.out_sizes
        da = a.in_dtypes if side == "in" else a.out_dtypes
        db = b.in_dtypes if side == "in" else b.out_dtypes
        for k in range(max(len(sa or ()), len(sb or ()), len(da or ()), len(db or ()))):
            va = ((sa or ())[k : k + 1], (da or ())[k : k + 1])
            vb = ((sb or ())[k : k + 1], (db or ())[k : k + 1])
            if va != vb:
                tensors = len(sa or ()) if side == "in" else len(sa or ())
                if tensors == len(members):
                    return f"record {k + 1} of {len(members)} ({members[k]})"
                return f"{side}put tensor {k + 1} of the group ({len(members)} records: {','.join(members)})"
    return None


def _classify(
    name: str,
    gen: int,
    seq: int,
    order: list[int],
    cols: dict[int, _Col],
    states: dict[int, _Col],
    streams: dict[int, Stream | None],
    interner: Interner,
    group_size: int | None = None,
    complete: bool = False,
    bad_sigs: frozenset[int] = frozenset(),
) -> Divergence | None:
    """The divergence at `seq`, or None when the ranks' entries differ only as the collective allows."""
    groups: dict[int, list[int]] = {}
    for r in order:
        groups.setdefault(cols[r].get(seq, ABSENT), []).append(r)
    sigs = interner.signatures
    if len(groups) == 1:
        (key,) = groups
        if key == ABSENT or not complete or key not in bad_sigs:
            return None
        everyone = tuple(order)
        sig = sigs[key]
        explanation = (
            f"pg {name}" + (f" generation {gen}" if gen else "") + f" #{seq}: {sig.op}: every rank sends "
            f"{numel(sig.in_sizes)} and receives {numel(sig.out_sizes)} elements, so the group's totals cannot "
            "match; every rank issued the same call, so the culprit is the code they share. Ambiguous."
        )
        whole = Side(everyone, sig, states[order[0]].get(seq), _site_at(streams[order[0]], seq, interner))
        return Divergence(name, gen, seq, TOTALS_MISMATCH, everyone, whole, (), "totals", explanation, (), True)
    finding: Finding | None = None
    if ABSENT not in groups and len({sigs[k].op for k in groups}) == 1:
        op = sigs[next(iter(groups))].op
        per_rank = {r: sigs[k] for k, rs in groups.items() for r in rs}
        verdict = judge(op, per_rank, group_size, complete, [(sigs[k], rs) for k, rs in groups.items()])
        if verdict == LEGIT:
            return None
        if isinstance(verdict, Finding):
            finding = verdict
    if finding is not None:
        rep = finding.majority[0] if finding.majority else None
        major_key = cols[rep].get(seq, ABSENT) if rep is not None else max(groups, key=lambda k: len(groups[k]))
        ambiguous = finding.ambiguous
    else:
        major_key, ambiguous = _vote(groups)

    def side(key: int, members: list[int]) -> Side:
        rep = members[0]
        return Side(
            tuple(members),
            sigs[key] if key != ABSENT else None,
            states[rep].get(seq),
            _site_at(streams[rep], seq, interner),
        )

    if finding is not None and finding.majority:
        # the finding's majority agrees on what matters, not necessarily on every field
        maj_ranks = list(finding.majority)
        majority = side(major_key, maj_ranks)
        culprit_groups: dict[int, list[int]] = {}
        for r in finding.culprits:
            culprit_groups.setdefault(cols[r].get(seq, ABSENT), []).append(r)
        others = tuple(side(k, v) for k, v in sorted(culprit_groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1]))))
    else:
        majority = side(major_key, groups[major_key])
        others = tuple(
            side(k, v) for k, v in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1]))) if k != major_key
        )
    culprits = finding.culprits if finding is not None else tuple(sorted(r for s in others for r in s.ranks))
    main = others[0]
    where = f"pg {name}" + (f" generation {gen}" if gen else "") + f" #{seq}"
    record: str | None = None
    if finding is not None:
        kind, fld = finding.kind, finding.field
        explanation = f"{where}: {majority.signature.op if majority.signature else 'collective'}: {finding.detail}."
    elif majority.signature is None or main.signature is None:
        kind, fld = MISSING_PARTICIPANT, "presence"
        never = [r for s in (majority, *others) if s.signature is None for r in s.ranks]
        issued = [s for s in (majority, *others) if s.signature is not None]
        what = _describe(issued[0].signature) if issued else "it"
        explanation = (
            f"{where}: rank(s) {_ranks(never)} never issued {what}; the others are blocked in it "
            f"until the process-group timeout: this is the hang."
        )
    else:
        kind, fld = _field(majority.signature, main.signature)
        record = _record_in_group(majority.signature, main.signature)
        shapes = kind == SIZE_MISMATCH
        explanation = (
            f"{where}: {fld} differs"
            + (f" in {record}" if record else "")
            + f": rank(s) {_ranks(main.ranks)} issued {_describe(main.signature, shapes=shapes)}, "
            f"rank(s) {_ranks(majority.ranks)} issued {_describe(majority.signature, shapes=shapes)}."
        )
    if ambiguous:
        explanation += " No strict majority" if finding is None else " Ambiguous"
        explanation += (
            ": which side is wrong is a guess."
            if finding is None
            else ": the ranks may legitimately differ here, so the culprit is a guess."
        )
    hints = _later_call_hints(seq, majority, main, streams, cols, interner) if finding is None else []
    return Divergence(
        name, gen, seq, kind, culprits, majority, others, fld, explanation, tuple(hints), ambiguous, record=record
    )


def _later_call_hints(
    seq: int,
    majority: Side,
    culprit: Side,
    streams: dict[int, Stream | None],
    cols: dict[int, _Col],
    interner: Interner,
) -> list[str]:
    """Why the error shows up at this call: a rank one call ahead, or call sites that drifted earlier."""
    hints: list[str] = []
    m_rank, c_rank = majority.ranks[0], culprit.ranks[0]
    mc, cc = cols[m_rank], cols[c_rank]
    ms, cs = streams[m_rank], streams[c_rank]
    # 1. Is the culprit shifted by k calls? Its #t holds what the majority issued at #t+k.
    if cc and mc:
        for k in (1, -1, 2, -2):
            t_end = min(cc.max(), mc.max() - k, seq + 16)
            if t_end < seq - 1:
                continue
            t = t_end
            while (
                t in cc
                and (t + k) in mc
                and cc[t] == mc[t + k]
                and _site_at(cs, t, interner) == _site_at(ms, t + k, interner)
            ):
                t -= 1
            t0 = t + 1
            if t0 > t_end or t0 + min(k, 0) > seq:
                continue
            informative = any(
                cc[u] != mc.get(u) or _site_at(cs, u, interner) != _site_at(ms, u, interner)
                for u in range(t0, t_end + 1)
            )
            if not informative:
                continue
            if k > 0:
                skipped = _site_at(ms, t0, interner)
                hints.append(
                    f"rank {c_rank} is {k} call(s) ahead of rank {m_rank} from #{t0}: its #{t0}..#{t_end} "
                    f"are the majority's #{t0 + k}..#{t_end + k}. It skipped the majority's #{t0}"
                    + (f" (at {skipped})" if skipped else "")
                    + f"; the contract broke there and the failure surfaced only at the later call #{seq}."
                )
            else:
                hints.append(
                    f"rank {c_rank} is {-k} call(s) behind rank {m_rank} from #{t0 + k}: it issued an extra "
                    f"collective at #{t0 + k}"
                    + (f" ({_site_at(cs, t0 + k, interner)})" if _site_at(cs, t0 + k, interner) else "")
                    + f"; the contract broke there and the failure surfaced only at the later call #{seq}."
                )
            break
    # 2. Did call sites drift before the contract broke (same op and size, different line)?
    if not hints and ms is not None and cs is not None and ms.site_ids is not None and cs.site_ids is not None:
        first = max(ms.seqs[0] if ms.seqs else seq, cs.seqs[0] if cs.seqs else seq)
        for t in range(first, seq):
            a, b = _site_at(ms, t, interner), _site_at(cs, t, interner)
            if a is not None and b is not None and a != b:
                hints.append(
                    f"call sites diverge earlier, at #{t}: rank {m_rank} was at {a}, rank {c_rank} at {b}; "
                    f"positions still matched (same op, size and dtype), so the contract broke silently "
                    f"there and the failure only surfaced at #{seq}. Look at rank {c_rank}'s control flow "
                    f"before {b}."
                )
                break
    if not hints and culprit.signature is None:
        hints.append(
            f"rank {c_rank} stopped before #{seq}: it skipped a collective earlier (the calls still matched "
            f"by position), exited, or is stuck outside any collective; the error appears at the later call."
        )
    return hints


def _state_divergence(
    name: str,
    gen: int,
    seq: int,
    order: list[int],
    cols: dict[int, _Col],
    states: dict[int, _Col],
    streams: dict[int, Stream | None],
    interner: Interner,
) -> Divergence:
    groups: dict[str, list[int]] = {}
    for r in order:
        groups.setdefault(states[r].get(seq, SCHEDULED), []).append(r)
    sig = interner.signatures[cols[order[0]][seq]]
    done, stuck = groups.get(COMPLETED, []), groups.get(SCHEDULED, [])
    maj_state = COMPLETED if len(done) >= len(stuck) else SCHEDULED
    minority = stuck if maj_state == COMPLETED else done
    majority = groups[maj_state]

    def side(st: str, members: list[int]) -> Side:
        return Side(tuple(members), sig, st, _site_at(streams[members[0]], seq, interner))

    others = tuple(side(st, v) for st, v in groups.items() if st != maj_state)
    where = f"pg {name}" + (f" generation {gen}" if gen else "") + f" #{seq}"
    explanation = (
        f"{where}: {_describe(sig)} completed on rank(s) {_ranks(done)} but never started on rank(s) "
        f"{_ranks(stuck)}: those ranks are stuck before or inside it."
    )
    return Divergence(
        name,
        gen,
        seq,
        STATE_MISMATCH,
        tuple(sorted(minority)),
        side(maj_state, majority),
        others,
        "state",
        explanation,
        ambiguous=len(done) == len(stuck),
    )


def _ranks(ranks: Iterable[int]) -> str:
    """`0-3,7`: compact rank lists for 1,024-rank jobs."""
    items = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


format_ranks = _ranks


def report_to_json(report: ContractReport, inputs: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    first = report.first_divergence
    return {
        "schema": SCHEMA,
        "holds": report.holds,
        "partial": report.partial,
        "warnings": list(report.warnings),
        "first_divergence": first.to_json() if first else None,
        "timelines": [t.to_json() for t in report.timelines],
        "inputs": list(inputs),
    }


def around(
    traces: Iterable[RankTrace], interner: Interner, div: Divergence, radius: int = 2
) -> list[tuple[int, list[str]]]:
    """Rows `(seq, [cell per side])` around a divergence, one representative rank per side."""
    sides = (div.majority, *div.others)
    wanted = {side.ranks[0] for side in sides}
    streams: dict[int, Stream | None] = {r: None for r in wanted}
    for trace in traces:
        if trace.rank in wanted:
            for s in trace.streams:
                if s.pg == div.pg and s.generation == div.generation:
                    streams[trace.rank] = s
    rows = []
    shapes = div.kind in (SIZE_MISMATCH, TOTALS_MISMATCH, ROOT_MISMATCH)
    for seq in range(div.seq - radius, div.seq + radius + 1):
        cells = []
        for side in sides:
            stream = streams[side.ranks[0]]
            i = _index(stream, seq) if stream is not None else None
            if stream is None or i is None:
                cells.append("-")
            else:
                sig = interner.signatures[stream.sig_ids[i]]
                cells.append(f"{_describe(sig, shapes=shapes)} [{stream.states[i]}]")
        if any(c != "-" for c in cells) or seq == div.seq:
            rows.append((seq, cells))
    return rows
