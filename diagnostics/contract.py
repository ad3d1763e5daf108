"""The collective contract: every rank of a process group issues the same collectives, in the same
order, with the same op, size, dtype and reduce op. Pure: takes traces, returns a report.

NCCL and gloo match calls by *position*, not by name: if one rank skips a collective, its next
call pairs with the others' skipped one, and the job hangs or aborts at a *later* call whose
stack trace points at the wrong line. So the checker aligns every process group's entries by
sequence id, finds the first sequence where ranks disagree, votes a majority (the culprits are
the others), classifies the disagreement, and looks for the true start: a rank whose call sites
drift from the majority's earlier on, or whose calls are the majority's shifted by one.

Entries of different generations (gpuguard generations, Flight Recorder reset epochs) are separate
timelines and are never compared with each other.

Input is compact on purpose (1,024 ranks x 2,000 entries must fit in seconds): each rank's stream
holds sequence ids and small integer ids into one `Interner` of signatures and call sites.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from gpuguard.foundation.traces import ABSENT, COMPLETED, SCHEDULED, Interner, RankTrace, Signature, Stream

SCHEMA = "gpuguard.contract/1"

MISSING_PARTICIPANT = "missing_participant"
OP_MISMATCH = "op_mismatch"
SIZE_MISMATCH = "size_mismatch"
DTYPE_MISMATCH = "dtype_mismatch"
REDUCE_OP_MISMATCH = "reduce_op_mismatch"
STATE_MISMATCH = "state_mismatch"
KINDS = (MISSING_PARTICIPANT, OP_MISMATCH, SIZE_MISMATCH, DTYPE_MISMATCH, REDUCE_OP_MISMATCH, STATE_MISMATCH)

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
    ambiguous: bool = False  # no strict majority: the culprit is a guess
    pg_desc: str = ""

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
            "explanation": self.explanation,
            "hints": list(self.hints),
        }


@dataclass(frozen=True)
class Timeline:
    """The verdict for one (process group, generation)."""

    pg: str
    generation: int
    ranks: tuple[int, ...]
    missing_dumps: tuple[int, ...]
    first_seq: int | None
    last_seq: int | None
    checked: int
    divergence: Divergence | None
    pg_desc: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "pg": self.pg,
            "pg_desc": self.pg_desc,
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


def check(
    traces: Iterable[RankTrace],
    interner: Interner,
    *,
    pg: str | None = None,
    world_size: int | None = None,
    warnings: Iterable[str] = (),
) -> ContractReport:
    """Check every (process group, generation) timeline; return the report."""
    warns = list(warnings)
    partial = False
    by_rank: dict[int, RankTrace] = {}
    for trace in traces:
        if trace.rank in by_rank:
            warns.append(
                f"rank {trace.rank}: two dumps ({by_rank[trace.rank].source}, {trace.source}); using the first"
            )
            partial = True
            continue
        by_rank[trace.rank] = trace

    world = world_size or max((t.world_size or 0 for t in by_rank.values()), default=0) or None
    if world is None and by_rank:
        world = max(by_rank) + 1  # ranks are 0..N-1: a gap is a missing dump
    generations: dict[int, set[int]] = {}
    timelines: dict[tuple[str, int], dict[int, Stream]] = {}
    desc: dict[tuple[str, int], str] = {}
    config: dict[str, set[int]] = {}
    for trace in by_rank.values():
        for name, pg_members in trace.pg_ranks.items():
            if pg_members:
                config.setdefault(name, set()).update(pg_members)
        for stream in trace.streams:
            if pg is not None and pg not in (stream.pg, stream.pg_desc, f"{stream.pg}:{stream.pg_desc}"):
                continue
            key = (stream.pg, stream.generation)
            timelines.setdefault(key, {})[trace.rank] = stream
            desc.setdefault(key, stream.pg_desc)
            generations.setdefault(stream.generation, set()).add(trace.rank)
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
    results: list[Timeline] = []
    for (name, gen), streams in sorted(timelines.items(), key=lambda kv: (kv[0][1], _pg_order(kv[0][0]))):
        is_default = name in DEFAULT_PG_NAMES or desc[(name, gen)] == "default_pg"
        members = set(streams) | config.get(name, set())
        if is_default or set(streams) == generations.get(gen, set()):
            # a group that spans every dump we have (gloo records no membership): the absent ranks too
            members |= generations.get(gen, set()) | absent
        missing = tuple(sorted(members - set(by_rank)))
        if missing and not absent:
            partial = True
            warns.append(
                f"pg {name} generation {gen}: no dump from rank(s) {_ranks(missing)}; "
                "their part of the contract is unknown"
            )
        present = {r: streams.get(r) for r in sorted(members) if r in by_rank}
        results.append(_check_timeline(name, gen, desc[(name, gen)], present, missing, interner))
    results.sort(key=lambda t: (t.divergence is None, _divergence_time(t, timelines, interner)))
    return ContractReport(tuple(results), tuple(warns), partial)


def _pg_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def _divergence_time(t: Timeline, timelines: dict[tuple[str, int], dict[int, Stream]], interner: Interner) -> int:
    """Order broken timelines by when their divergent call was issued (earliest first)."""
    d = t.divergence
    if d is None:
        return 0
    best = 1 << 62
    for stream in timelines[(t.pg, t.generation)].values():
        if stream.times_ns is None:
            continue
        for s, ts in zip(stream.seqs, stream.times_ns):
            if s == d.seq and ts:
                best = min(best, ts)
                break
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
    name: str, gen: int, pg_desc: str, streams: dict[int, Stream | None], missing: tuple[int, ...], interner: Interner
) -> Timeline:
    ranks = tuple(streams)
    live = [s for s in streams.values() if s is not None and len(s.seqs)]
    if not live:
        return Timeline(name, gen, ranks, missing, None, None, 0, None, pg_desc)
    # Ring buffers drop old entries: only the window every rank still holds is comparable.
    start = max(s.seqs[0] for s in live)
    last = max(s.seqs[-1] for s in live)
    order = list(streams)
    if all(_contiguous(s) for s in streams.values()):
        contract_div, state_cands, checked = _scan_contiguous(streams, start, last)
    else:
        contract_div, state_cands, checked = _scan_general(streams, order, start, last)
    cols = {r: _Col(s, s.sig_ids if s is not None else None) for r, s in streams.items()}  # order == list(streams)
    states = {r: _Col(s, s.states if s is not None else None) for r, s in streams.items()}
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
    div: Divergence | None = None
    if contract_div is not None and (state_div is None or contract_div < state_div):
        div = _classify(name, gen, contract_div, order, cols, states, streams, interner)
    elif state_div is not None:
        div = _state_divergence(name, gen, state_div, order, cols, states, streams, interner)
    if div is not None and pg_desc:
        div = replace(div, pg_desc=pg_desc)
    return Timeline(name, gen, ranks, missing, start, last, checked, div, pg_desc)


def _scan_contiguous(streams: dict[int, Stream | None], start: int, last: int) -> tuple[int | None, set[int], int]:
    """Compare every rank's window with the longest one as whole lists (C speed); index only differences."""
    ref = max((s for s in streams.values() if s is not None and len(s.seqs)), key=lambda s: s.seqs[-1])
    ro = start - ref.seqs[0]
    ref_ids = list(ref.sig_ids[ro:])
    ref_states = list(ref.states[ro:])
    total = len(ref_ids)
    first_diff = total
    cands: set[int] = set()
    for s in streams.values():
        if s is None or not len(s.seqs):
            first_diff = 0
            continue
        o = start - s.seqs[0]
        ids = list(s.sig_ids[o:])
        n = len(ids)
        if n != total or ids != ref_ids[:n]:
            first_diff = min(first_diff, next((k for k in range(n) if ids[k] != ref_ids[k]), n))
        sts = list(s.states[o:])
        if sts != ref_states[:n]:
            found = 0
            for k in range(n):
                if sts[k] != ref_states[k]:
                    cands.add(start + k)
                    found += 1
                    if found == _STATE_DIFF_CAP:
                        break
    return (start + first_diff if first_diff < total else None), cands, first_diff


def _scan_general(
    streams: dict[int, Stream | None], order: list[int], start: int, last: int
) -> tuple[int | None, set[int], int]:
    """Non-contiguous streams (gaps, merged coalesced groups): align through dicts."""
    picked = [streams[r] for r in order]
    cols = [dict(zip(s.seqs, s.sig_ids)) if s is not None else {} for s in picked]
    sts = [dict(zip(s.seqs, s.states)) if s is not None else {} for s in picked]
    checked = 0
    cands: set[int] = set()
    for seq in range(start, last + 1):
        vals = [c.get(seq, ABSENT) for c in cols]
        first = vals[0]
        if vals.count(first) != len(vals):
            return seq, cands, checked
        if first == ABSENT:
            continue  # a sequence id nobody holds
        checked += 1
        if len({d.get(seq) for d in sts}) > 1:
            cands.add(seq)
    return None, cands, checked


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


def _describe(sig: Signature | None) -> str:
    if sig is None:
        return "nothing"
    parts = [sig.op]
    n = sig.numel()
    if n is not None:
        parts.append(f"count={n}")
    if sig.in_dtypes:
        parts.append(f"dtype={','.join(sig.in_dtypes)}")
    if sig.reduce_op:
        parts.append(f"op={sig.reduce_op}")
    return " ".join(parts)


def _classify(
    name: str,
    gen: int,
    seq: int,
    order: list[int],
    cols: dict[int, _Col],
    states: dict[int, _Col],
    streams: dict[int, Stream | None],
    interner: Interner,
) -> Divergence:
    groups: dict[int, list[int]] = {}
    for r in order:
        groups.setdefault(cols[r].get(seq, ABSENT), []).append(r)
    major_key, ambiguous = _vote(groups)
    sigs = interner.signatures

    def side(key: int, members: list[int]) -> Side:
        rep = members[0]
        return Side(
            tuple(members),
            sigs[key] if key != ABSENT else None,
            states[rep].get(seq),
            _site_at(streams[rep], seq, interner),
        )

    majority = side(major_key, groups[major_key])
    others = tuple(
        side(k, v) for k, v in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1]))) if k != major_key
    )
    culprits = tuple(sorted(r for s in others for r in s.ranks))
    main = others[0]
    if majority.signature is None or main.signature is None:
        kind, fld = MISSING_PARTICIPANT, "presence"
    else:
        kind, fld = _field(majority.signature, main.signature)
    where = f"pg {name}" + (f" generation {gen}" if gen else "") + f" #{seq}"
    if kind == MISSING_PARTICIPANT:
        never = [r for s in (majority, *others) if s.signature is None for r in s.ranks]
        issued = [s for s in (majority, *others) if s.signature is not None]
        what = _describe(issued[0].signature) if issued else "it"
        explanation = (
            f"{where}: rank(s) {_ranks(never)} never issued {what}; the others are blocked in it "
            f"until the process-group timeout: this is the hang."
        )
    else:
        explanation = (
            f"{where}: {fld} differs: rank(s) {_ranks(main.ranks)} issued {_describe(main.signature)}, "
            f"rank(s) {_ranks(majority.ranks)} issued {_describe(majority.signature)}."
        )
    if ambiguous:
        explanation += " No strict majority: which side is wrong is a guess."
    hints = _later_call_hints(seq, majority, main, streams, cols, interner)
    return Divergence(name, gen, seq, kind, culprits, majority, others, fld, explanation, tuple(hints), ambiguous)


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
    for seq in range(div.seq - radius, div.seq + radius + 1):
        cells = []
        for side in sides:
            stream = streams[side.ranks[0]]
            i = _index(stream, seq) if stream is not None else None
            if stream is None or i is None:
                cells.append("-")
            else:
                cells.append(f"{_describe(interner.signatures[stream.sig_ids[i]])} [{stream.states[i]}]")
        if any(c != "-" for c in cells) or seq == div.seq:
            rows.append((seq, cells))
    return rows
