"""A rank's recent step samples and collective entries as columns of machine numbers, not objects.

Why: `gpu-doctor diagnose job` holds every rank's last 40 step samples and 64 collective entries while it
votes. As Python objects (a `StepSample` and five floats a step, a 4-tuple and three floats an entry, and
the observation's own 3-tuple of each) that was ~9 KB of a 100,000-rank job's ~17 KB per rank; here a
sample is 7 numbers (56 bytes) and an entry 4 (32 bytes), and the observation's view shares them.

Each class is a read-only `Sequence` of exactly what the tuple it replaces held (a `StepSample`; an
`(seq, wall, mono, wait_s)` tuple; its `(seq, wall, wait_s)` projection), built object by object on
access, and equal to a tuple of the same items: readers index, slice, iterate and compare as before.
Integers that do not fit 64 bits (a hostile log) keep their column as a plain list: nothing is refused
that the tuples took. A step without a period (`interval_s` None) is stored as NaN: `append` refuses a
NaN period, so NaN only ever means None.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, overload

_T = TypeVar("_T")
_NAN = float("nan")
_FLOATS = 5  # end_wall, end_mono, compute_s, wait_s, interval_s (NaN: None)
_INTS = 2  # step, nbytes


@dataclass(frozen=True, slots=True)
class StepSample:
    """One finished step of one rank: its own compute time separated from its collective wait."""

    step: int
    end_wall: float
    end_mono: float
    compute_s: float
    wait_s: float
    nbytes: int = 0
    interval_s: float | None = None  # time since the previous step's end (the rank's step period)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.wait_s


def _int_column(values: list[int]) -> array[int] | list[int]:
    """64-bit integers, or the list itself when one does not fit (a hostile log: kept, not refused)."""
    try:
        return array("q", values)
    except OverflowError:
        return values


def _period(interval_s: float | None) -> float:
    """A step period as stored: NaN for none (so a NaN period itself cannot be stored)."""
    if interval_s is None:
        return _NAN
    if math.isnan(interval_s):
        raise ValueError("a NaN step period cannot be stored (NaN stands for none)")
    return interval_s


class _Rows(Sequence[_T]):
    """Shared plumbing: rows built on access, slices as new instances, equality with a tuple of the rows."""

    __slots__ = ()

    def __len__(self) -> int:
        raise NotImplementedError

    def _row(self, i: int) -> _T:
        raise NotImplementedError

    def _slice(self, start: int, stop: int) -> Sequence[_T]:
        raise NotImplementedError

    def _index(self, index: int) -> int:
        n = len(self)
        k = index + n if index < 0 else index
        if not 0 <= k < n:
            raise IndexError(index)
        return k

    @overload
    def __getitem__(self, index: int) -> _T: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[_T]: ...
    def __getitem__(self, index: int | slice) -> _T | Sequence[_T]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return self._slice(start, max(start, stop))
            return tuple(self._row(i) for i in range(start, stop, step))
        return self._row(self._index(index))

    def __iter__(self) -> Iterator[_T]:
        return (self._row(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (tuple, _Rows)):  # as a tuple: never equal to a list
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


class StepSamples(_Rows[StepSample]):
    """Step samples, oldest first (`RankSeries.steps`): five float columns and two integer columns."""

    __slots__ = ("_f", "_i")

    def __init__(self, samples: Iterable[StepSample] = ()) -> None:
        floats: list[float] = []
        ints: list[int] = []
        for x in samples:
            ints.extend((x.step, x.nbytes))
            floats.extend((x.end_wall, x.end_mono, x.compute_s, x.wait_s, _period(x.interval_s)))
        self._f: array[float] = array("d", floats)
        self._i = _int_column(ints)

    @classmethod
    def from_columns(cls, floats: list[float], ints: list[int]) -> StepSamples:
        """From the reader's row-major lists: 5 floats a sample (end_wall, end_mono, compute_s, wait_s, and
        interval_s or NaN for none) and 2 integers (step, nbytes)."""
        if len(floats) != _FLOATS * len(ints) // _INTS:
            raise ValueError("the float and integer columns hold different numbers of samples")
        out = cls()
        out._f, out._i = array("d", floats), _int_column(ints)
        return out

    def __len__(self) -> int:
        return len(self._i) // _INTS

    def _row(self, i: int) -> StepSample:
        f, j = self._f, i * _FLOATS
        interval = f[j + 4]
        return StepSample(
            self._i[i * _INTS],
            f[j],
            f[j + 1],
            f[j + 2],
            f[j + 3],
            self._i[i * _INTS + 1],
            None if interval != interval else interval,
        )

    def _slice(self, start: int, stop: int) -> StepSamples:
        out = StepSamples()
        out._f = self._f[start * _FLOATS : stop * _FLOATS]
        out._i = self._i[start * _INTS : stop * _INTS]
        return out

    def computes(self) -> list[float]:
        """Every sample's own compute time, oldest first (no sample built)."""
        return self._f[2::_FLOATS].tolist()

    def periods(self) -> list[float]:
        """The step periods that are known and not zero (`if s.interval_s`), oldest first (no sample built)."""
        return [v for v in self._f[4::_FLOATS] if v and v == v]


Entry = tuple[int, float, float, float]  # (seq, wall, mono, wait_s): wait_s -1.0 while still in it
EntryTime = tuple[int, float, float]  # (seq, wall, wait_s): the vote's arrival evidence


class CollectiveEntries(_Rows[Entry]):
    """Collective entries, oldest first (`RankSeries.entries`): the sequence numbers and three float columns."""

    __slots__ = ("_seq", "_f")

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        seqs: list[int] = []
        floats: list[float] = []
        for seq, wall, mono, wait in entries:
            seqs.append(seq)
            floats.extend((wall, mono, wait))
        self._seq = _int_column(seqs)
        self._f: array[float] = array("d", floats)

    @classmethod
    def from_columns(cls, seqs: list[int], floats: list[float]) -> CollectiveEntries:
        """From the reader's lists: the sequence numbers, and 3 floats an entry (wall, mono, wait_s)."""
        if len(floats) != 3 * len(seqs):
            raise ValueError("the float and integer columns hold different numbers of entries")
        out = cls()
        out._seq, out._f = _int_column(seqs), array("d", floats)
        return out

    def __len__(self) -> int:
        return len(self._seq)

    def _row(self, i: int) -> Entry:
        f = self._f
        return (self._seq[i], f[3 * i], f[3 * i + 1], f[3 * i + 2])

    def _slice(self, start: int, stop: int) -> CollectiveEntries:
        out = CollectiveEntries()
        out._seq = self._seq[start:stop]
        out._f = self._f[3 * start : 3 * stop]
        return out

    def times(self) -> EntryTimes:
        """The `(seq, wall, wait_s)` view the vote reads (`RankObservation.entries`), sharing these columns."""
        return EntryTimes(self._seq, self._f, 0, len(self._seq))


class EntryTimes(_Rows[EntryTime]):
    """`(seq, wall, wait_s)` of rows [start, stop) of a `CollectiveEntries`' columns, nothing copied."""

    __slots__ = ("_seq", "_f", "_start", "_stop")

    def __init__(self, seq: array[int] | list[int], floats: array[float], start: int, stop: int) -> None:
        self._seq, self._f, self._start, self._stop = seq, floats, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def _row(self, i: int) -> EntryTime:
        k = self._start + i
        return (self._seq[k], self._f[3 * k], self._f[3 * k + 2])

    def _slice(self, start: int, stop: int) -> EntryTimes:
        return EntryTimes(self._seq, self._f, self._start + start, self._start + stop)


def computes_of(steps: Sequence[StepSample]) -> list[float]:
    """The samples' own compute times, oldest first: from the columns when they are `StepSamples`."""
    if isinstance(steps, StepSamples):
        return steps.computes()
    return [s.compute_s for s in steps]


def periods_of(steps: Sequence[StepSample]) -> list[float]:
    """The samples' step periods that are known and not zero, oldest first (`[s.interval_s ... if s.interval_s]`)."""
    if isinstance(steps, StepSamples):
        return steps.periods()
    return [s.interval_s for s in steps if s.interval_s]
