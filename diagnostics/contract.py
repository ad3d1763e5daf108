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

This module is the checker's entry (`check`, `around`); the records and their JSON are in
`contract_report`, stream alignment in `contract_align`, the member-set rules in `contract_groups`,
the classification of one disagreement in `contract_classify`, point-to-point pairing in
`contract_p2p`. The names callers use stay importable from here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from gpuguard.diagnostics.collective_semantics import ROOT_MISMATCH, TOTALS_MISMATCH, self_inconsistent
from gpuguard.diagnostics.contract_align import (
    SeqColumn,
    contiguous,
    first_time,
    index_of,
    scan_contiguous,
    scan_general,
)
from gpuguard.diagnostics.contract_classify import TimelineView, classify, state_divergence
from gpuguard.diagnostics.contract_groups import (
    clusters_by_members,
    done_through,
    group_label,
    membership_timeline,
    name_shared_by_disjoint_groups,
    pg_order,
)
from gpuguard.diagnostics.contract_p2p import check_p2p
from gpuguard.diagnostics.contract_report import (
    DTYPE_MISMATCH,
    KINDS,
    MEMBERSHIP_MISMATCH,
    MISSING_PARTICIPANT,
    OP_MISMATCH,
    P2P_MISMATCH,
    REDUCE_OP_MISMATCH,
    SCHEMA,
    SIZE_MISMATCH,
    STATE_MISMATCH,
    ContractReport,
    Divergence,
    P2PRecord,
    Timeline,
    TimelineKey,
    describe,
    format_ranks,
    report_to_json,
)
from gpuguard.foundation.traces import COMPLETED, SCHEDULED, Interner, RankTrace, Signature, Stream

__all__ = [
    "COMPLETED",
    "DTYPE_MISMATCH",
    "KINDS",
    "MEMBERSHIP_MISMATCH",
    "MISSING_PARTICIPANT",
    "OP_MISMATCH",
    "P2P_MISMATCH",
    "REDUCE_OP_MISMATCH",
    "ROOT_MISMATCH",
    "SCHEDULED",
    "SCHEMA",
    "SIZE_MISMATCH",
    "STATE_MISMATCH",
    "TOTALS_MISMATCH",
    "ContractReport",
    "Divergence",
    "Interner",
    "P2PRecord",
    "RankTrace",
    "Signature",
    "Stream",
    "Timeline",
    "around",
    "check",
    "format_ranks",
    "report_to_json",
]

DEFAULT_PG_NAMES = frozenset({"0", "default", "default_pg"})


@dataclass
class _Notes:
    """What one check says beside its timelines: warnings, and whether some input is missing."""

    warnings: list[str]
    partial: bool

    def warn(self, text: str, *, partial: bool = True) -> None:
        self.warnings.append(text)
        self.partial = self.partial or partial


@dataclass
class _Groups:
    """Every rank's streams, keyed by (pg name, generation), before member sets split them."""

    streams: dict[tuple[str, int], dict[int, Stream | None]] = field(default_factory=dict)
    desc: dict[tuple[str, int], str] = field(default_factory=dict)
    generations: dict[int, set[int]] = field(default_factory=dict)

    def add(self, name: str, desc: str, gen: int, rank: int, stream: Stream | None) -> None:
        held = self.streams.setdefault((name, gen), {})
        if stream is not None or rank not in held:
            held[rank] = stream
        self.desc.setdefault((name, gen), desc)
        self.generations.setdefault(gen, set()).add(rank)


class _Run(NamedTuple):
    """What every group's check of one `check` call shares (a tuple: `_check_group` unpacks it)."""

    by_rank: Mapping[int, RankTrace]
    groups: _Groups
    absent: set[int]
    completed: Mapping[int, Mapping[str, int]]
    interner: Interner
    bad_sigs: frozenset[int]
    notes: _Notes


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
    notes = _Notes(list(warnings), partial)
    by_rank = _one_dump_per_rank(traces, notes)
    p2p_by_rank = {r: recs for r, recs in (p2p or {}).items() if r in by_rank}

    def wanted(name: str, d: str) -> bool:
        return pg is None or pg in (name, d, f"{name}:{d}")

    groups = _gather(by_rank, p2p_by_rank, wanted)
    if len(groups.generations) > 1:
        notes.warn(
            "dumps cover generations "
            + ", ".join(f"{g} (ranks {format_ranks(sorted(r))})" for g, r in sorted(groups.generations.items()))
            + ": each generation is checked as its own timeline, never against another",
            partial=False,
        )
    absent = _absent_ranks(by_rank, world_size, groups, notes)
    run = _Run(by_rank, groups, absent, completed or {}, interner, self_inconsistent(interner.signatures), notes)
    results: list[tuple[Timeline, int]] = []
    cluster_of: dict[tuple[str, int, int], TimelineKey] = {}
    for key, streams in sorted(groups.streams.items(), key=lambda kv: (kv[0][1], pg_order(kv[0][0]))):
        name, gen = key
        for members, ranks_here, clash in clusters_by_members(name, streams, by_rank):
            for r in ranks_here:
                cluster_of[(name, gen, r)] = (name, gen, members)
            results.extend(_check_group(run, key, members, ranks_here, clash, streams))
    if p2p_by_rank:
        results.extend(check_p2p(p2p_by_rank, cluster_of, by_rank, wanted))
    if sum(t.checked for t, _ in results) == 0 and not any(t.divergence is not None for t, _ in results):
        notes.warn(
            "nothing compared: no collective or point-to-point record is held by every rank of its group, "
            "so the contract is unknown, not holding"
        )
    results.sort(key=lambda tt: (tt[0].divergence is None, tt[1]))
    return ContractReport(tuple(t for t, _ in results), tuple(notes.warnings), notes.partial)


def _one_dump_per_rank(traces: Iterable[RankTrace], notes: _Notes) -> dict[int, RankTrace]:
    """Each rank's trace; a second dump from one rank is refused (which one is right is unknowable)."""
    by_rank: dict[int, RankTrace] = {}
    for trace in traces:
        if trace.rank in by_rank:
            notes.warn(f"rank {trace.rank}: two dumps ({by_rank[trace.rank].source}, {trace.source}); using the first")
            continue
        by_rank[trace.rank] = trace
    return by_rank


def _gather(
    by_rank: Mapping[int, RankTrace],
    p2p_by_rank: Mapping[int, Sequence[P2PRecord]],
    wanted: Callable[[str, str], bool],
) -> _Groups:
    """Group the wanted streams by (name, generation); a rank with only p2p records there holds None."""
    groups = _Groups()
    for trace in by_rank.values():
        for stream in trace.streams:
            if wanted(stream.pg, stream.pg_desc):
                groups.add(stream.pg, stream.pg_desc, stream.generation, trace.rank, stream)
    for rank, recs in p2p_by_rank.items():
        for rec in recs:
            if wanted(rec[0], rec[1]):
                groups.add(rec[0], rec[1], rec[2], rank, None)
    return groups


def _absent_ranks(by_rank: Mapping[int, RankTrace], world_size: int | None, groups: _Groups, notes: _Notes) -> set[int]:
    """The world's ranks without a dump (ranks are 0..N-1: a gap is a missing dump); only knowable
    when the dumps cover one generation."""
    world = world_size or max((t.world_size or 0 for t in by_rank.values()), default=0) or None
    if world is None and by_rank:
        world = max(by_rank) + 1
    if not world or len(groups.generations) > 1:
        return set()
    absent = set(range(world)) - set(by_rank)
    if absent:
        notes.warn(
            f"no dump from rank(s) {format_ranks(absent)} (expected ranks 0-{world - 1}): their part of "
            "every contract is unknown"
        )
    return absent


def _check_group(
    run: _Run,
    key: tuple[str, int],
    members: tuple[int, ...] | None,
    ranks_here: list[int],
    clash: dict[tuple[int, ...], list[int]] | None,
    streams: Mapping[int, Stream | None],
) -> list[tuple[Timeline, int]]:
    """The timelines of one group (a name and a member set) in one generation (`key`)."""
    name, gen = key
    by_rank, groups, absent, completed, interner, bad_sigs, notes = run
    pg_desc = groups.desc[(name, gen)]
    out: list[tuple[Timeline, int]] = []
    if clash is not None:
        notes.warn(
            f"pg {name} generation {gen}: ranks disagree about its members (pg_config); its collectives "
            "are compared over the union, which may not be one group"
        )
        out.append((membership_timeline(name, gen, pg_desc, clash), 0))
    is_default = name in DEFAULT_PG_NAMES or pg_desc == "default_pg"
    everyone = groups.generations.get(gen, set())
    mem = set(ranks_here) | set(members or ())
    if members is None and (is_default or set(ranks_here) == everyone):
        # a group that spans every dump we have (gloo records no membership): the absent ranks too
        mem |= everyone | absent
    missing = tuple(sorted(mem - set(by_rank)))
    if missing and not absent:
        notes.warn(
            f"pg {group_label(name, members)} generation {gen}: no dump from rank(s) {format_ranks(missing)}; "
            "their part of the contract is unknown"
        )
    present = {r: streams.get(r) for r in sorted(mem) if r in by_rank}
    done = {
        r: d
        for r, s in present.items()
        if (s is None or not len(s.seqs)) and (d := done_through(completed.get(r), name)) is not None
    }
    result = _check_timeline(name, gen, pg_desc, members, present, missing, done, interner, bad_sigs)
    split = name_shared_by_disjoint_groups(result[0], present) if members is None and not is_default else None
    if split is None:
        out.append(result)
        return out
    notes.warn(
        f"pg {name} generation {gen}: ranks {' and '.join(format_ranks(c) for c in split)} never issued one "
        "matching entry: taken as separate groups sharing the name (as split_group makes them); the dumps "
        "record no member sets (gloo), so this is a guess"
    )
    for part in split:
        sub = {r: present[r] for r in part}
        out.append(_check_timeline(name, gen, pg_desc, None, sub, (), {}, interner, bad_sigs))
    return out


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
    if all(contiguous(s) for s in scan.values()):
        diffs, state_cands, held = scan_contiguous(scan, start)
    else:
        diffs, state_cands, held = scan_general(scan, order, start, last)
    cols = {r: SeqColumn(s, s.sig_ids if s is not None else None) for r, s in streams.items()}
    states = {r: SeqColumn(s, s.states if s is not None else None) for r, s in streams.items()}
    view = TimelineView(name, gen, cols, states, streams, interner)
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
        div = classify(view, seq, at, group_size, complete, bad_sigs)
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
        div = state_divergence(view, state_div, order)
    checked = bisect_left(held, div.seq) if div is not None else len(held)
    if div is not None:
        div = replace(div, pg_desc=pg_desc, members=members)
    t = Timeline(name, gen, ranks, missing, start, last, checked, div, pg_desc, members=members)
    return t, (first_time(streams, div.seq) if div is not None else 0)


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
            i = index_of(stream, seq) if stream is not None else None
            if stream is None or i is None:
                cells.append("-")
            else:
                sig = interner.signatures[stream.sig_ids[i]]
                cells.append(f"{describe(sig, shapes=shapes)} [{stream.states[i]}]")
        if any(c != "-" for c in cells) or seq == div.seq:
            rows.append((seq, cells))
    return rows
