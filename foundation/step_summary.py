"""A rank's step-time distribution in bounded memory: exact while small, a relative-error sketch beyond.

Why: `gpu-doctor diagnose job` learns each rank's own step period and compute quantiles from its history
(up to 2,000 steps). Keeping every step of 100,000 ranks is gigabytes; this keeps a few hundred bytes
per rank however many steps it wrote, so a 100k-rank job is read in bounded memory.

What is exact and what is not (documented in docs/formats/step-log.md, "Reader summary"):
- the count, and every order statistic while there are at most `exact` values (64 per rank);
- beyond that, the `TOP_VALUES` largest values are still exact (p99 and p99.9 of up to 2,300 values,
  the maximum, and the outlier cap, which reads the two largest), and any other order statistic is
  within `RELATIVE_ERROR` (1 %) of the true one, relative to its value (a log-bucketed histogram, the
  DDSketch construction). Only values more than `MAX_BUCKETS` buckets (a factor of ~6e17) below the
  largest are folded together, and lose that bound: the log's 1 µs resolution to a year is 3e13.
  The buckets are a dense array between the lowest and the highest used: tens of bytes for a rank
  whose steps vary by tens of percent, 16 KiB at most.

No quantile rule lives here: the sketch answers "the k-th smallest value" (`ordered()`, a sorted
sequence view) and `diagnostics.jobstats.quantile` interpolates as it does for a plain sorted list.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import overload

EXACT_VALUES = 64  # values kept exactly per sketch before it switches to buckets
TOP_VALUES = 24  # largest values kept exactly in bucket mode (the tail quantiles the vote reads)
RELATIVE_ERROR = 0.01  # the bound on any other order statistic in bucket mode, relative to its value
MAX_BUCKETS = 2048  # buckets kept at most; lower ones fold into the lowest (a span of GAMMA ** 2048, ~6e17)
GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA = math.log(GAMMA)


class QuantileSketch:
    """The order statistics of a stream of non-negative values in bounded memory (see the module doc).

    Mutable while it is fed (`add`, `merge`); readers use `n`, `exact` and `ordered()`."""

    __slots__ = ("n", "cap", "_exact", "_sorted", "_top", "_zeros", "_offset", "_counts")

    def __init__(self, cap: int = EXACT_VALUES) -> None:
        self.n = 0
        self.cap = cap
        self._exact: array[float] | None = array("d")
        self._sorted = True
        self._top: list[float] = []  # bucket mode: a min-heap of the TOP_VALUES largest values
        self._zeros = 0  # bucket mode: values <= 0
        self._offset = 0  # bucket mode: the index of _counts[0]
        self._counts: array[int] = array("Q")

    @property
    def exact(self) -> bool:
        """True while every order statistic is exact (at most `cap` values seen)."""
        return self._exact is not None

    def add(self, value: float) -> None:
        self.n += 1
        if self._exact is not None:
            if self._sorted and self._exact and value < self._exact[-1]:
                self._sorted = False
            self._exact.append(value)
            if len(self._exact) > self.cap:
                self._to_buckets()
            return
        self._bucket(value, 1)
        if len(self._top) < TOP_VALUES:
            heapq.heappush(self._top, value)
        elif value > self._top[0]:
            heapq.heapreplace(self._top, value)

    def extend(self, values: Iterable[float]) -> None:
        """`add` each value in turn (the same state, without a call per value: 100,000 ranks' summaries
        are built and merged value by value)."""
        vals = values if isinstance(values, (list, array)) else list(values)
        i = 0
        exact = self._exact
        if exact is not None:  # while exact: append what still fits, noting whether it stays sorted
            i = min(len(vals), self.cap - len(exact))
            if i > 0:
                if self._sorted:
                    prev = exact[-1] if exact else None
                    for v in vals[:i]:
                        if prev is not None and v < prev:
                            self._sorted = False
                            break
                        prev = v
                exact.extend(vals[:i])
                self.n += i
        if i >= len(vals):
            return
        if self._exact is not None:  # the value that passes the cap switches to buckets, as `add` does
            self.add(vals[i])
            i += 1
        top, log_gamma = self._top, _LOG_GAMMA
        for v in vals[i:]:
            self.n += 1
            if v <= 0:
                self._zeros += 1
            else:
                self._bucket_index(math.ceil(math.log(v) / log_gamma), 1)
            if len(top) < TOP_VALUES:
                heapq.heappush(top, v)
            elif v > top[0]:
                heapq.heapreplace(top, v)

    def merge(self, other: QuantileSketch) -> None:
        """Add every value `other` has seen (as exactly as `other` holds them)."""
        if other._exact is not None:
            self.extend(other._exact)
            return
        if self._exact is not None:
            self._to_buckets()
        self.n += other.n
        self._zeros += other._zeros
        for i, c in enumerate(other._counts):
            if c:
                self._bucket_index(other._offset + i, c)
        for v in other._top:
            if len(self._top) < TOP_VALUES:
                heapq.heappush(self._top, v)
            elif v > self._top[0]:
                heapq.heapreplace(self._top, v)

    def ordered(self) -> Sequence[float]:
        """The values as a sorted sequence: a list while exact, else a view answering each index."""
        if self._exact is not None:
            if not self._sorted:
                self._exact = array("d", sorted(self._exact))
                self._sorted = True
            return self._exact
        return OrderedView(self.n, self._value_at)

    def nbytes(self) -> int:
        """The memory this sketch holds in its buffers (what must not grow with the values seen)."""
        exact = 0 if self._exact is None else self._exact.itemsize * self._exact.buffer_info()[1]
        return exact + 8 * len(self._top) + self._counts.itemsize * self._counts.buffer_info()[1]

    # -- bucket mode --------------------------------------------------------------------------------
    def _to_buckets(self) -> None:
        values, self._exact = self._exact or array("d"), None
        for v in values:
            self._bucket(v, 1)
        self._top = heapq.nlargest(TOP_VALUES, values)
        heapq.heapify(self._top)

    def _bucket(self, value: float, count: int) -> None:
        if value <= 0:
            self._zeros += count
            return
        self._bucket_index(math.ceil(math.log(value) / _LOG_GAMMA), count)

    def _bucket_index(self, i: int, count: int) -> None:
        c = self._counts
        if not c:
            self._offset = i
            c.append(count)
            return
        if i < self._offset:
            i = max(i, self._offset + len(c) - MAX_BUCKETS)  # beyond the span: into the lowest bucket
            if i < self._offset:
                c[0:0] = array("Q", bytes(8 * (self._offset - i)))
                self._offset = i
        elif i >= self._offset + len(c):
            c.extend(array("Q", bytes(8 * (i - self._offset - len(c) + 1))))
            over = len(c) - MAX_BUCKETS
            if over > 0:  # fold the lowest buckets into the new lowest one
                folded = sum(c[: over + 1])
                del c[:over]
                c[0] = folded
                self._offset += over
        c[i - self._offset] += count

    def _value_at(self, k: int) -> float:
        """The k-th smallest value (0-based): exact among the top values, else its bucket's estimate."""
        top_from = self.n - len(self._top)
        if k >= top_from:
            return sorted(self._top)[k - top_from]
        if k < self._zeros:
            return 0.0
        seen = self._zeros
        for i, c in enumerate(self._counts):
            seen += c
            if seen > k:
                # the bucket (GAMMA**(j-1), GAMMA**j]: this estimate is within RELATIVE_ERROR of any value in it
                return 2 * GAMMA ** (self._offset + i) / (GAMMA + 1)
        return sorted(self._top)[0] if self._top else 0.0  # unreachable: the counts add up to n


class OrderedView(Sequence[float]):
    """A sorted sequence answered index by index (`at(k)`, 0 <= k < length), never materialised: a
    sketch's order statistics, or a sorted list with one value replaced or left out (the judges' views
    of 100,000 ranks). Indexing and len only, which is what `jobstats.quantile` reads."""

    def __init__(self, length: int, at: Callable[[int], float]) -> None:
        self._length, self._at = length, at

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[float]: ...
    def __getitem__(self, index: int | slice) -> float | Sequence[float]:
        if isinstance(index, slice):
            return [self._at(i) for i in range(*index.indices(self._length))]
        k = index + self._length if index < 0 else index
        if not 0 <= k < self._length:
            raise IndexError(index)
        return self._at(k)

    def __iter__(self) -> Iterator[float]:
        return (self._at(i) for i in range(self._length))


class StepSummary:
    """A rank's step periods and own compute times over its history, in bounded memory."""

    __slots__ = ("periods", "computes")

    def __init__(self, cap: int = EXACT_VALUES) -> None:
        self.periods = QuantileSketch(cap)
        self.computes = QuantileSketch(cap)

    @property
    def n(self) -> int:
        """The number of steps summarised."""
        return self.computes.n

    @property
    def exact(self) -> bool:
        return self.periods.exact and self.computes.exact

    def add(self, interval_s: float | None, compute_s: float) -> None:
        """One finished step: its period (None or <= 0 when unknown: not a period) and its own compute."""
        self.computes.add(compute_s)
        if interval_s is not None and interval_s > 0:
            self.periods.add(interval_s)

    def nbytes(self) -> int:
        return self.periods.nbytes() + self.computes.nbytes()
