"""The collective contract's verdict: the kinds of divergence, the records a report is made of
(`Side`, `Divergence`, `Timeline`, `ContractReport`), their versioned JSON, and the words every
explanation uses (compact rank lists, a call described in one line). Apart from the checker so that
a renderer needs only the records."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuguard.diagnostics.collective_semantics import ROOT_MISMATCH, TOTALS_MISMATCH, fmt_shapes
from gpuguard.foundation.traces import Signature

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


# One point-to-point record, as `collectors.flight_recorder` reads it (plain tuple: the readers and
# the judges share no classes but foundation's): (pg name, pg desc, generation, p2p seq id, "send" or
# "recv", source group rank, destination group rank, shapes, dtypes, state, time created ns).
P2PRecord = tuple[str, str, int, int, str, int, int, Any, Any, str, int]

TimelineKey = tuple[str, int, tuple[int, ...] | None]  # (pg name, generation, member set or None)


def timeline_name(name: str, gen: int) -> str:
    """`pg 3 generation 2` (generation 0 left out): how every explanation names a timeline."""
    return f"pg {name}" + (f" generation {gen}" if gen else "")


def format_ranks(ranks: Iterable[int]) -> str:
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


def describe(sig: Signature | None, *, shapes: bool = False) -> str:
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
