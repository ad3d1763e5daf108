"""What a disagreement at one sequence id is: the majority and the culprits, the kind and field,
an explanation, and hints for why the failure surfaced at a later call (a rank shifted by one
call, call sites that drifted earlier). The semantics table (`collective_semantics`) says where
ranks may legitimately differ."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import NamedTuple, TypeVar

from gpuguard.diagnostics.collective_semantics import LEGIT, TOTALS_MISMATCH, Finding, coalesced_members, judge, numel
from gpuguard.diagnostics.contract_align import SeqColumn, site_at
from gpuguard.diagnostics.contract_report import (
    DTYPE_MISMATCH,
    MISSING_PARTICIPANT,
    OP_MISMATCH,
    REDUCE_OP_MISMATCH,
    SIZE_MISMATCH,
    STATE_MISMATCH,
    Divergence,
    Side,
    describe,
    format_ranks,
    timeline_name,
)
from gpuguard.foundation.traces import ABSENT, COMPLETED, SCHEDULED, Interner, Signature, Stream

_K = TypeVar("_K", bound=Hashable)  # a vote's key: a signature id or a completion state


class TimelineView(NamedTuple):
    """One timeline's columns by rank (signature ids, states, the streams), as the classifier reads
    them at one sequence id (a tuple: the classifier unpacks it)."""

    name: str
    gen: int
    cols: Mapping[int, SeqColumn]
    states: Mapping[int, SeqColumn]
    streams: Mapping[int, Stream | None]
    interner: Interner


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


def classify(
    view: TimelineView,
    seq: int,
    order: list[int],
    group_size: int | None = None,
    complete: bool = False,
    bad_sigs: frozenset[int] = frozenset(),
) -> Divergence | None:
    """The divergence at `seq`, or None when the ranks' entries differ only as the collective allows."""
    name, gen, cols, states, streams, interner = view
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
            f"{timeline_name(name, gen)} #{seq}: {sig.op}: every rank sends "
            f"{numel(sig.in_sizes)} and receives {numel(sig.out_sizes)} elements, so the group's totals cannot "
            "match; every rank issued the same call, so the culprit is the code they share. Ambiguous."
        )
        whole = Side(everyone, sig, states[order[0]].get(seq), site_at(streams[order[0]], seq, interner))
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
            site_at(streams[rep], seq, interner),
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
    where = f"{timeline_name(name, gen)} #{seq}"
    record: str | None = None
    if finding is not None:
        kind, fld = finding.kind, finding.field
        explanation = f"{where}: {majority.signature.op if majority.signature else 'collective'}: {finding.detail}."
    elif majority.signature is None or main.signature is None:
        kind, fld = MISSING_PARTICIPANT, "presence"
        never = [r for s in (majority, *others) if s.signature is None for r in s.ranks]
        issued = [s for s in (majority, *others) if s.signature is not None]
        what = describe(issued[0].signature) if issued else "it"
        explanation = (
            f"{where}: rank(s) {format_ranks(never)} never issued {what}; the others are blocked in it "
            f"until the process-group timeout: this is the hang."
        )
    else:
        kind, fld = _field(majority.signature, main.signature)
        record = _record_in_group(majority.signature, main.signature)
        shapes = kind == SIZE_MISMATCH
        explanation = (
            f"{where}: {fld} differs"
            + (f" in {record}" if record else "")
            + f": rank(s) {format_ranks(main.ranks)} issued {describe(main.signature, shapes=shapes)}, "
            f"rank(s) {format_ranks(majority.ranks)} issued {describe(majority.signature, shapes=shapes)}."
        )
    if ambiguous:
        explanation += " No strict majority" if finding is None else " Ambiguous"
        explanation += (
            ": which side is wrong is a guess."
            if finding is None
            else ": the ranks may legitimately differ here, so the culprit is a guess."
        )
    hints = _later_call_hints(view, seq, majority, main) if finding is None else []
    return Divergence(
        name, gen, seq, kind, culprits, majority, others, fld, explanation, tuple(hints), ambiguous, record=record
    )


def _later_call_hints(view: TimelineView, seq: int, majority: Side, culprit: Side) -> list[str]:
    """Why the error shows up at this call: a rank one call ahead, or call sites that drifted earlier."""
    cols, streams, interner = view.cols, view.streams, view.interner
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
                and site_at(cs, t, interner) == site_at(ms, t + k, interner)
            ):
                t -= 1
            t0 = t + 1
            if t0 > t_end or t0 + min(k, 0) > seq:
                continue
            informative = any(
                cc[u] != mc.get(u) or site_at(cs, u, interner) != site_at(ms, u, interner) for u in range(t0, t_end + 1)
            )
            if not informative:
                continue
            if k > 0:
                skipped = site_at(ms, t0, interner)
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
                    + (f" ({site_at(cs, t0 + k, interner)})" if site_at(cs, t0 + k, interner) else "")
                    + f"; the contract broke there and the failure surfaced only at the later call #{seq}."
                )
            break
    # 2. Did call sites drift before the contract broke (same op and size, different line)?
    if not hints and ms is not None and cs is not None and ms.site_ids is not None and cs.site_ids is not None:
        first = max(ms.seqs[0] if ms.seqs else seq, cs.seqs[0] if cs.seqs else seq)
        for t in range(first, seq):
            a, b = site_at(ms, t, interner), site_at(cs, t, interner)
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


def state_divergence(view: TimelineView, seq: int, order: list[int]) -> Divergence:
    """Every rank issued the call at `seq`, but it completed on some and never started on others."""
    name, gen, cols, states, streams, interner = view
    groups: dict[str, list[int]] = {}
    for r in order:
        groups.setdefault(states[r].get(seq, SCHEDULED), []).append(r)
    sig = interner.signatures[cols[order[0]][seq]]
    done, stuck = groups.get(COMPLETED, []), groups.get(SCHEDULED, [])
    maj_state = COMPLETED if len(done) >= len(stuck) else SCHEDULED
    minority = stuck if maj_state == COMPLETED else done
    majority = groups[maj_state]

    def side(st: str, members: list[int]) -> Side:
        return Side(tuple(members), sig, st, site_at(streams[members[0]], seq, interner))

    others = tuple(side(st, v) for st, v in groups.items() if st != maj_state)
    where = f"{timeline_name(name, gen)} #{seq}"
    explanation = (
        f"{where}: {describe(sig)} completed on rank(s) {format_ranks(done)} but never started on rank(s) "
        f"{format_ranks(stuck)}: those ranks are stuck before or inside it."
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
