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
_I64 = 1 << 63
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


def _fits(*values: int) -> bool:
    return all(-_I64 <= v < _I64 for v in values)


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
        self._f: array[float] = array("d")
        self._i: array[int] | list[int] = array("q")
        for s in samples:
            self.append(s.step, s.end_wall, s.end_mono, s.compute_s, s.wait_s, s.nbytes, s.interval_s)

    def append(
        self,
        step: int,
        end_wall: float,
        end_mono: float,
        compute_s: float,
        wait_s: float,
        nbytes: int,
        interval_s: float | None,
    ) -> None:
        """One more sample (the reader's builder; a finished series is not changed)."""
        if interval_s is not None and math.isnan(interval_s):
            raise ValueError("a NaN step period cannot be stored (NaN stands for none)")
        if isinstance(self._i, array) and not _fits(step, nbytes):
            self._i = list(self._i)
        self._i.extend((step, nbytes))
        self._f.extend((end_wall, end_mono, compute_s, wait_s, _NAN if interval_s is None else interval_s))

    def keep_last(self, n: int) -> None:
        """Drop all but the last `n` samples (the reader's bound while it folds a long log)."""
        drop = len(self) - n
        if drop > 0:
            del self._f[: drop * _FLOATS]
            del self._i[: drop * _INTS]

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
        self._seq: array[int] | list[int] = array("q")
        self._f: array[float] = array("d")
        for seq, wall, mono, wait in entries:
            self.append(seq, wall, mono, wait)

    def append(self, seq: int, wall: float, mono: float, wait_s: float) -> None:
        if isinstance(self._seq, array) and not _fits(seq):
            self._seq = list(self._seq)
        self._seq.append(seq)
        self._f.extend((wall, mono, wait_s))

    def exited(self, seq: int, wait_s: float) -> None:
        """An X record: the wait of the newest entry, when that is collective `seq` and still open."""
        if self._seq and self._seq[-1] == seq and self._f[-1] < 0:
            self._f[-1] = max(0.0, wait_s)

    def keep_last(self, n: int) -> None:
        drop = len(self._seq) - n
        if drop > 0:
            del self._seq[:drop]
            del self._f[: 3 * drop]

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
