"""Aligning ranks' streams by sequence id: a `seq -> value` view of one stream column, and the
sequence ids where some rank's entry differs inside the window every rank still holds. The checker's
inner loop, built for 1,024 ranks x 2,000 entries (whole-list comparisons on contiguous streams)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuguard.foundation.traces import ABSENT, Interner, Stream


def site_at(stream: Stream | None, seq: int, interner: Interner) -> str | None:
    if stream is None or stream.site_ids is None:
        return None
    i = index_of(stream, seq)
    if i is None or stream.site_ids[i] == ABSENT:
        return None
    return interner.sites[stream.site_ids[i]]


def index_of(stream: Stream, seq: int) -> int | None:
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


class SeqColumn:
    """A read-only `seq -> value` view of one stream column: O(1) on contiguous streams."""

    __slots__ = ("stream", "values")

    def __init__(self, stream: Stream | None, values: Sequence[Any] | None) -> None:
        self.stream, self.values = stream, values

    def get(self, seq: int, default: Any = None) -> Any:
        if self.stream is None or self.values is None:
            return default
        i = index_of(self.stream, seq)
        return default if i is None else self.values[i]

    def __contains__(self, seq: int) -> bool:
        return self.stream is not None and index_of(self.stream, seq) is not None

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


def contiguous(s: Stream | None) -> bool:
    return s is None or not s.seqs or s.seqs[-1] - s.seqs[0] + 1 == len(s.seqs)


def scan_contiguous(streams: dict[int, Stream | None], start: int) -> tuple[list[int], set[int], range]:
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


def scan_general(
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


def first_time(streams: Mapping[int, Stream | None], seq: int) -> int:
    """When the divergent call was issued (earliest rank): broken timelines are listed earliest first."""
    best = 1 << 62
    for stream in streams.values():
        if stream is None or stream.times_ns is None:
            continue
        i = index_of(stream, seq)
        if i is not None and stream.times_ns[i]:
            best = min(best, stream.times_ns[i])
    return best
