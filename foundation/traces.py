"""Per-rank collective traces in compact form: what trace readers produce and the contract judges.

Every reader (`collectors.flight_recorder` for Flight Recorder dumps and gpuguard's own rings) turns
a rank's dump into a `RankTrace`: per process group and generation, a `Stream` of sequence ids and
small integer ids into one shared `Interner` of signatures and call sites, so that 1,024 ranks x
2,000 entries compare as integers. `diagnostics.contract` reads these and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

COMPLETED = "completed"
SCHEDULED = "scheduled"
ABSENT = -1  # "this rank never issued this sequence id"


class Signature(NamedTuple):
    """What the contract compares. `None` means "not recorded by this trace format"."""

    op: str
    in_sizes: tuple[tuple[int, ...], ...] | None = None
    in_dtypes: tuple[str, ...] | None = None
    out_sizes: tuple[tuple[int, ...], ...] | None = None
    out_dtypes: tuple[str, ...] | None = None
    # shadows tuple.count() on purpose: the field is the trace formats' name (`count=` in every reader)
    count: int | None = None  # type: ignore[assignment]  # typeshed's tuple.count is a method
    reduce_op: str | None = None

    def numel(self) -> int | None:
        if self.count is not None:
            return self.count
        if self.in_sizes is None:
            return None
        total = 0
        for shape in self.in_sizes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "count": self.numel(),
            "dtype": ",".join(self.in_dtypes) if self.in_dtypes else None,
            "reduce_op": self.reduce_op,
            "input_sizes": [list(s) for s in self.in_sizes] if self.in_sizes is not None else None,
            "output_sizes": [list(s) for s in self.out_sizes] if self.out_sizes is not None else None,
        }


class Interner:
    """Maps signatures and call sites to small ints, so ranks compare ints, not structures."""

    def __init__(self) -> None:
        self.signatures: list[Signature] = []
        self.sites: list[str] = []
        self._sig_ids: dict[Signature, int] = {}
        self._site_ids: dict[str, int] = {}

    def sig(self, signature: Signature) -> int:
        i = self._sig_ids.get(signature)
        if i is None:
            i = self._sig_ids[signature] = len(self.signatures)
            self.signatures.append(signature)
        return i

    def site(self, site: str | None) -> int:
        if site is None:
            return ABSENT
        i = self._site_ids.get(site)
        if i is None:
            i = self._site_ids[site] = len(self.sites)
            self.sites.append(site)
        return i


@dataclass(frozen=True)
class Stream:
    """One rank's collectives on one process group in one generation, ascending by sequence id."""

    pg: str
    generation: int
    seqs: Sequence[int]
    sig_ids: Sequence[int]
    states: Sequence[str]
    site_ids: Sequence[int] | None = None
    times_ns: Sequence[int] | None = None
    pg_desc: str = ""
    # False when the recorder's completion states lag or lie (gloo's Flight Recorder marks completion
    # asynchronously, after wait() returns, and also on failure): no state mismatch is derived then.
    states_reliable: bool = True

    def __post_init__(self) -> None:
        n = len(self.seqs)
        if len(self.sig_ids) != n or len(self.states) != n:
            raise ValueError("stream columns differ in length")


@dataclass(frozen=True)
class RankTrace:
    """Everything one rank's dump says, in compact form."""

    rank: int
    source: str
    format: str
    streams: tuple[Stream, ...]
    version: str = ""
    world_size: int | None = None
    pg_ranks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    skipped: int = 0  # entries the contract does not cover (p2p)
    dropped: int = 0  # entries the ring buffer overwrote before the dump
