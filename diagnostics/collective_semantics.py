"""Which fields of one collective must agree across its process group, and how: the one table.

Why: ranks' Flight Recorder entries for one collective are *not* always identical. The root of a
gather records the gathered tensors and the other ranks record none; an all_to_all with uneven
splits sends and receives different amounts on every rank; the `_v` variants gather or scatter
uneven pieces. Comparing whole entries raises false alarms there (and blames the root, who is
outnumbered). This module says, per collective, what must hold; `diagnostics.contract` calls
`judge` only where ranks' entries differ, so the common all-identical case stays a list compare.

Documented in docs/formats/collective-semantics.md (keep the two in step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuguard.foundation.traces import Signature

# How a collective's per-rank entries must relate (the `rule` of a `Semantics`).
IDENTICAL = "identical"  # every recorded field equal on every rank
ROOTED_GATHER = "rooted_gather"  # inputs equal everywhere; outputs only on the root
ROOTED_SCATTER = "rooted_scatter"  # outputs equal everywhere; inputs only on the root
GATHER_V = "gather_v"  # outputs equal everywhere; inputs may differ; sum of inputs == output
SCATTER_V = "scatter_v"  # inputs equal everywhere; outputs may differ; sum of outputs == input
TOTALS = "totals"  # per-rank sizes may differ; sum sent == sum received over the group
OP_ONLY = "op_only"  # only the op must agree (barrier: its dummy tensor is an implementation detail)
COALESCED = "coalesced"  # member by member, each by its own rule
P2P = "p2p"  # not a group collective: each send pairs with one recv (diagnostics.contract)

# Kinds of finding this module adds to diagnostics.contract's.
ROOT_MISMATCH = "root_mismatch"
TOTALS_MISMATCH = "totals_mismatch"
SIZE_MISMATCH = "size_mismatch"
DTYPE_MISMATCH = "dtype_mismatch"


@dataclass(frozen=True)
class Semantics:
    """One row of the table."""

    op: str
    rule: str
    note: str


def _rows() -> dict[str, Semantics]:
    rows: list[tuple[tuple[str, ...], str, str]] = [
        (("all_reduce", "allreduce", "_all_reduce_oop"), IDENTICAL, "same shapes, dtypes and reduce op"),
        (("allreduce_coalesced",), IDENTICAL, "same list of shapes and dtypes"),
        (("reduce", "_reduce_oop"), IDENTICAL, "every rank passes the same tensor; only the root keeps the result"),
        (("broadcast", "_broadcast_oop"), IDENTICAL, "every rank passes the same-shaped tensor"),
        (
            ("all_gather", "allgather", "_all_gather_base", "all_gather_base", "all_gather_single"),
            IDENTICAL,
            "same input and output shapes (output = group size x input)",
        ),
        (("all_gather_into_tensor_coalesced", "ALLGATHER_coalesced"), IDENTICAL, "member by member identical"),
        (("all_gather_v",), GATHER_V, "per-rank inputs may differ; outputs identical; sum of inputs == output"),
        (
            ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_base", "reduce_scatter_single"),
            IDENTICAL,
            "same input and output shapes (input = group size x output)",
        ),
        (("reduce_scatter_tensor_coalesced", "REDUCE_SCATTER_coalesced"), IDENTICAL, "member by member identical"),
        (("reduce_scatter_v",), SCATTER_V, "inputs identical; per-rank outputs may differ; sum of outputs == input"),
        (("gather",), ROOTED_GATHER, "inputs identical; only the root records outputs (group size x input)"),
        (("scatter",), ROOTED_SCATTER, "outputs identical; only the root records inputs (group size x output)"),
        (
            (
                "all_to_all",
                "alltoall",
                "all_to_all_single",
                "alltoall_base",
                "all_to_allv",
                "all_to_all_v",
                "all_to_all_v_single",
            ),
            TOTALS,
            "splits may be uneven: only the group's total sent == total received, and the dtype, must agree",
        ),
        (("barrier", "all_reduce_barrier"), OP_ONLY, "only the op; its tensor is the backend's dummy"),
        (("coalesced",), COALESCED, "a coalesced group: member by member, each by its own rule"),
        (("send", "recv", "isend", "irecv"), P2P, "paired per pair of ranks: send size/dtype == recv size/dtype"),
    ]
    out: dict[str, Semantics] = {}
    for names, rule, note in rows:
        for n in names:
            out[n] = Semantics(names[0], rule, note)
    return out


TABLE: Mapping[str, Semantics] = _rows()
_UNKNOWN = Semantics("?", IDENTICAL, "not in the table: every recorded field must be identical")


def semantics(op: str) -> Semantics:
    """The row for an op as Flight Recorder or gpuguard names it (`coalesced[a,b]` is a coalesced group)."""
    if op.startswith("coalesced["):
        return TABLE["coalesced"]
    return TABLE.get(op, _UNKNOWN)


def coalesced_members(op: str) -> list[str]:
    """`coalesced[all_reduce,all_reduce]` -> the member ops."""
    if op.startswith("coalesced[") and op.endswith("]"):
        return [m for m in op[len("coalesced[") : -1].split(",") if m]
    return []


@dataclass(frozen=True)
class Finding:
    """A real divergence the table found: who agrees, who does not, and why."""

    kind: str
    field: str
    majority: tuple[int, ...]
    culprits: tuple[int, ...]
    ambiguous: bool
    detail: str


DEFAULT = "default"  # judge's answer: no special rule, compare whole signatures
LEGIT = "legit"  # judge's answer: the difference is allowed by the collective's semantics

Shapes = tuple[tuple[int, ...], ...] | None


def numel(shapes: Shapes) -> int:
    total = 0
    for shape in shapes or ():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def empty(shapes: Shapes) -> bool:
    """No tensor recorded: `[]`, `[[]]` (an undefined placeholder) or zero elements."""
    return not shapes or all(len(s) == 0 for s in shapes) or numel(shapes) == 0


def _dts(dtypes: tuple[str, ...] | None, shapes: Shapes) -> frozenset[str]:
    return frozenset(dtypes or ()) if not empty(shapes) else frozenset()


def _vote(groups: Mapping[Any, list[int]]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    ranked = sorted(groups.values(), key=lambda v: (-len(v), min(v)))
    majority = tuple(sorted(ranked[0]))
    culprits = tuple(sorted(r for v in ranked[1:] for r in v))
    ambiguous = len(ranked) > 1 and len(ranked[0]) == len(ranked[1])
    return majority, culprits, ambiguous


def fmt_shapes(shapes: Shapes) -> str:
    if shapes is None:
        return "?"
    return "[" + ",".join("[" + ",".join(map(str, s)) + "]" for s in shapes) + "]"


Uniq = Sequence[tuple[Signature, Sequence[int]]]  # each distinct entry once, with the ranks that issued it


def judge(
    op: str, sigs: Mapping[int, Signature], group_size: int | None, complete: bool, uniq: Uniq | None = None
) -> Finding | str:
    """Judge one collective whose ranks' entries differ (every rank issued `op`).

    Returns `DEFAULT` (compare whole signatures), `LEGIT` (no alarm), or a `Finding`.
    `group_size` is the group's size when known; `complete` says every member's entry is here
    (totals can only be checked then). `uniq`, when the caller has it: the distinct entries with
    their ranks (1,024 ranks of uneven all_to_all are a few dozen distinct entries).
    """
    if uniq is None:
        by: dict[Signature, list[int]] = {}
        for r, sig in sigs.items():
            by.setdefault(sig, []).append(r)
        uniq = list(by.items())
    rule = semantics(op).rule
    if rule == IDENTICAL:
        return DEFAULT
    if rule == OP_ONLY:
        return LEGIT
    if rule == COALESCED:
        members = coalesced_members(op)
        if members and all(semantics(m).rule == IDENTICAL for m in members):
            return DEFAULT
        return _dtypes_only(uniq)
    if any(s.in_sizes is None and s.out_sizes is None for s, _ in uniq):
        return DEFAULT  # a trace format without shapes (gpuguard's: one count): identical is all it can say
    if rule == ROOTED_GATHER:
        return _rooted(sigs, group_size, gather=True)
    if rule == ROOTED_SCATTER:
        return _rooted(sigs, group_size, gather=False)
    if rule == TOTALS:
        return _totals(sigs, uniq, complete)
    if rule in (GATHER_V, SCATTER_V):
        return _vee(sigs, uniq, complete, gather=rule == GATHER_V)
    return DEFAULT


def self_inconsistent(signatures: Sequence[Signature]) -> frozenset[int]:
    """Ids of signatures that break their own rule even when every rank issues them identically:
    an all_to_all whose input and output totals differ (the group's totals then differ too)."""
    return frozenset(
        i
        for i, s in enumerate(signatures)
        if semantics(s.op).rule == TOTALS
        and s.in_sizes is not None
        and s.out_sizes is not None
        and numel(s.in_sizes) != numel(s.out_sizes)
    )


def _common(sigs: Mapping[int, Signature], key: str) -> Finding | None:
    """The side every rank records the same way (gather inputs, scatter outputs, ...) must agree."""
    groups: dict[object, list[int]] = {}
    for r, s in sigs.items():
        sizes, dtypes = (s.in_sizes, s.in_dtypes) if key == "input" else (s.out_sizes, s.out_dtypes)
        groups.setdefault((sizes, dtypes), []).append(r)
    if len(groups) == 1:
        return None
    majority, culprits, ambiguous = _vote(groups)
    a, b = sigs[majority[0]], sigs[culprits[0]]
    sa, sb = (a.in_sizes, b.in_sizes) if key == "input" else (a.out_sizes, b.out_sizes)
    kind = SIZE_MISMATCH if sa != sb else DTYPE_MISMATCH
    if kind == SIZE_MISMATCH:
        va, vb = fmt_shapes(sa), fmt_shapes(sb)
    else:
        da, db = (a.in_dtypes, b.in_dtypes) if key == "input" else (a.out_dtypes, b.out_dtypes)
        va, vb = "dtype " + ",".join(da or ()), "dtype " + ",".join(db or ())
    return Finding(
        kind,
        f"{key} {'shape' if kind == SIZE_MISMATCH else 'dtype'}",
        majority,
        culprits,
        ambiguous,
        f"every rank's {key} must be the same; rank(s) {_r(culprits)} recorded {vb}, rank(s) {_r(majority)} {va}",
    )


def _rooted(sigs: Mapping[int, Signature], group_size: int | None, *, gather: bool) -> Finding | str:
    common_key = "input" if gather else "output"
    bad = _common(sigs, common_key)
    if bad is not None:
        return bad

    def rooted_side(s: Signature) -> tuple[Shapes, tuple[str, ...] | None, Shapes]:
        return (s.out_sizes, s.out_dtypes, s.in_sizes) if gather else (s.in_sizes, s.in_dtypes, s.out_sizes)

    roots = [r for r, s in sigs.items() if not empty(rooted_side(s)[0]) and rooted_side(s)[0] != rooted_side(s)[2]]
    if len(roots) > 1:
        shown = "; ".join(f"rank {r} {fmt_shapes(rooted_side(sigs[r])[0])}" for r in roots[:4])
        return Finding(
            ROOT_MISMATCH,
            "root",
            tuple(sorted(set(sigs) - set(roots))),
            tuple(sorted(roots)),
            True,
            f"{len(roots)} ranks act as the root ({shown}): the ranks disagree on src/dst",
        )
    if not roots:
        return LEGIT  # the root's dump may be absent; nothing contradicts
    root = roots[0]
    sizes, dtypes, per_rank = rooted_side(sigs[root])
    others = tuple(sorted(set(sigs) - {root}))
    if group_size and numel(sizes) != numel(per_rank) * group_size:
        return Finding(
            SIZE_MISMATCH,
            "root " + ("output" if gather else "input"),
            others,
            (root,),
            False,
            f"the root (rank {root}) recorded {fmt_shapes(sizes)} = {numel(sizes)} elements, but "
            f"{group_size} ranks x {fmt_shapes(per_rank)} = {numel(per_rank) * group_size}",
        )
    common_dt = _dts(sigs[root].in_dtypes if gather else sigs[root].out_dtypes, per_rank)
    if dtypes and common_dt and frozenset(dtypes) != common_dt:
        return Finding(
            DTYPE_MISMATCH,
            "root dtype",
            others,
            (root,),
            False,
            f"the root (rank {root}) recorded {','.join(dtypes)}, every rank's {common_key} is {','.join(sorted(common_dt))}",
        )
    return LEGIT


def _dtypes_only(uniq: Uniq) -> Finding | str:
    groups: dict[frozenset[str], list[int]] = {}
    for s, ranks in uniq:
        dt = _dts(s.in_dtypes, s.in_sizes) | _dts(s.out_dtypes, s.out_sizes)
        if dt:
            groups.setdefault(dt, []).extend(ranks)
    if len(groups) <= 1:
        return LEGIT
    majority, culprits, ambiguous = _vote(groups)
    of = {r: dt for dt, members in groups.items() for r in members}
    return Finding(
        DTYPE_MISMATCH,
        "dtype",
        majority,
        culprits,
        ambiguous,
        f"rank(s) {_r(culprits)} send or receive {','.join(sorted(of[culprits[0]]))}, "
        f"rank(s) {_r(majority)} {','.join(sorted(of[majority[0]]))}",
    )


def _totals(sigs: Mapping[int, Signature], uniq: Uniq, complete: bool) -> Finding | str:
    dt = _dtypes_only(uniq)
    if dt != LEGIT or not complete:
        return dt
    sent = sum(numel(s.in_sizes) * len(ranks) for s, ranks in uniq)
    received = sum(numel(s.out_sizes) * len(ranks) for s, ranks in uniq)
    if sent == received:
        return LEGIT
    per = "; ".join(
        f"rank {r} {fmt_shapes(s.in_sizes)}->{fmt_shapes(s.out_sizes)}" for r, s in sorted(sigs.items())[:8]
    )
    groups: dict[object, list[int]] = {}
    for s, ranks in uniq:
        groups.setdefault((s.in_sizes, s.out_sizes), []).extend(ranks)
    majority, culprits, _ = _vote(groups)
    if len(groups) == len(sigs):  # every rank differs (uneven splits): no majority to speak of
        majority, culprits = (), tuple(sorted(sigs))
    return Finding(
        TOTALS_MISMATCH,
        "totals",
        majority,
        culprits,
        True,
        f"the group sends {sent} elements in all but receives {received} (per rank sent->received: {per}); "
        "splits may be uneven, so which rank's splits are wrong cannot be told from sizes",
    )


def _vee(sigs: Mapping[int, Signature], uniq: Uniq, complete: bool, *, gather: bool) -> Finding | str:
    bad = _common(sigs, "output" if gather else "input")
    if bad is not None:
        return bad
    dt = _dtypes_only(uniq)
    if dt != LEGIT or not complete:
        return dt
    any_sig = next(iter(sigs.values()))
    whole = numel(any_sig.out_sizes if gather else any_sig.in_sizes)
    parts = sum(numel(s.in_sizes if gather else s.out_sizes) * len(ranks) for s, ranks in uniq)
    if whole == parts:
        return LEGIT
    return Finding(
        TOTALS_MISMATCH,
        "totals",
        (),
        tuple(sorted(sigs)),
        True,
        f"the per-rank pieces add up to {parts} elements but the {'gathered output' if gather else 'scattered input'} "
        f"holds {whole}",
    )


def _r(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks[:16])) + ("..." if len(ranks) > 16 else "")
