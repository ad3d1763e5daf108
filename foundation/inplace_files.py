"""The in-place switch's files under `<job-dir>/coord/inplace/`: survivors' reports and abort requests.

Writer and reader side by side (docs/formats/inplace.md). Survivors of a failed generation G each
write one report (`g<G>/report-<rank>-<incarnation>.json`, atomic rename), the coordinator reads them
all; an operator's abort of generation G is `abort.json`. Readers skip torn, foreign or malformed
files: a report that cannot be read is a survivor that did not report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import GpuguardError

REPORT_SCHEMA = "gpuguard.inplace-report/1"
ABORT_FILE = "abort.json"


inplace_dir = jobdir.inplace_dir  # where the in-place switch coordinates (a directory every member can read)


@dataclass(frozen=True)
class Report:
    """What one survivor of generation G publishes after its group failed (one JSON file)."""

    generation: int
    rank: int  # its logical rank in G
    incarnation_id: str
    pid: int
    host: str
    committed_step: int | None  # the newest step it committed (None: none yet)
    digests: Mapping[int, str]  # step -> replicated-state digest of each local snapshot
    failure: str
    time: float
    # sharded state only: step -> chunk key -> [dtype, global shape, local sizes, sum (16 hex digits)]
    chunks: Mapping[int, Mapping[str, list[Any]]] = field(default_factory=dict)
    suspects: tuple[int, ...] = ()  # ranks this survivor's peer heartbeat found silent (the evidence)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA,
            "generation": self.generation,
            "rank": self.rank,
            "incarnation_id": self.incarnation_id,
            "pid": self.pid,
            "host": self.host,
            "committed_step": self.committed_step,
            "digests": {str(k): v for k, v in sorted(self.digests.items())},
            "failure": self.failure,
            "time": self.time,
            **({"chunks": {str(k): dict(v) for k, v in sorted(self.chunks.items())}} if self.chunks else {}),
            **({"suspects": sorted(self.suspects)} if self.suspects else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Report:
        if d.get("schema") != REPORT_SCHEMA:
            raise ValueError(f"not a {REPORT_SCHEMA} record")
        step = d.get("committed_step")
        return cls(
            int(d["generation"]),
            int(d["rank"]),
            str(d["incarnation_id"]),
            int(d["pid"]),
            str(d["host"]),
            None if step is None else int(step),
            {int(k): str(v) for k, v in dict(d["digests"]).items()},
            str(d.get("failure", "")),
            float(d["time"]),
            _chunks(d.get("chunks", {})),
            _ranks(d.get("suspects", [])),
        )


HOST_REPORT_SCHEMA = "gpuguard.inplace-host-report/1"
HOST_BLOCK = 64  # ranks per aggregated key: rank // HOST_BLOCK (64 reports of REPORT_INLINE_MAX fit etcd's 1.5 MiB)
REPORT_INLINE_MAX = 16 << 10  # a report larger than this (bytes of JSON) is published on its own key


@dataclass(frozen=True)
class HostReport:
    """The reports of one host's survivors of generation G whose ranks fall in one block of
    HOST_BLOCK, published by the host's aggregator as one record: the coordinator reads O(hosts)
    records, not O(ranks) (docs/formats/inplace.md, "Aggregated reports")."""

    generation: int
    host: str
    block: int  # every report's rank // HOST_BLOCK
    aggregator: int  # the rank that published it
    aggregator_incarnation: str
    reports: tuple[Report, ...]  # ascending rank

    def __post_init__(self) -> None:
        for r in self.reports:  # the record names them once: a report of another one cannot be in it
            if (r.generation, r.host, r.rank // HOST_BLOCK) != (self.generation, self.host, self.block):
                raise ValueError(f"report of rank {r.rank} does not belong to {self.host} block {self.block}")

    def to_dict(self) -> dict[str, Any]:
        """Each report as one row, its digests and failure text by index into `strings`: a
        host's replicas share one digest and mostly one failure, so the record is a fraction of
        its reports' own JSON (the coordinator reads every host's record on each pass)."""
        strings: dict[str, int] = {}

        def ref(text: str) -> int:
            return strings.setdefault(text, len(strings))

        rows = [
            [
                r.rank,
                r.incarnation_id,
                r.pid,
                r.committed_step,
                [[step, ref(d)] for step, d in sorted(r.digests.items())],
                ref(r.failure),
                r.time,
                sorted(r.suspects),
                {str(k): dict(v) for k, v in sorted(r.chunks.items())},
            ]
            for r in self.reports
        ]
        return {
            "schema": HOST_REPORT_SCHEMA,
            "generation": self.generation,
            "host": self.host,
            "block": self.block,
            "aggregator": {"rank": self.aggregator, "incarnation_id": self.aggregator_incarnation},
            "strings": list(strings),
            "reports": rows,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HostReport:
        """ValueError unless every row is well formed and of this host's block."""
        if d.get("schema") != HOST_REPORT_SCHEMA:
            raise ValueError(f"not a {HOST_REPORT_SCHEMA} record")
        agg, rows, strings = d["aggregator"], d["reports"], d["strings"]
        if not isinstance(agg, Mapping) or not isinstance(rows, list) or len(rows) > HOST_BLOCK:
            raise ValueError("aggregator or reports malformed")
        if not isinstance(strings, list) or not all(isinstance(x, str) for x in strings):
            raise ValueError("strings is not a list of strings")
        generation, host, block = _int(d["generation"]), d["host"], _int(d["block"])
        if not isinstance(host, str):
            raise ValueError("host is not a string")
        reports = tuple(_report_row(row, generation, host, strings) for row in rows)
        return cls(generation, host, block, _int(agg["rank"]), str(agg["incarnation_id"]), reports)


def _int(v: Any) -> int:
    if type(v) is not int or v < 0:
        raise ValueError(f"{v!r} is not a non-negative integer")
    return v


def _report_row(row: Any, generation: int, host: str, strings: list[str]) -> Report:
    """One row of a HostReport (see `HostReport.to_dict`) as the Report it stands for."""
    if not isinstance(row, list) or len(row) != 9:
        raise ValueError("a report row is not a list of 9")
    rank, inc, pid, step, digests, failure, when, suspects, chunks = row
    if not isinstance(inc, str) or not isinstance(digests, list) or type(when) not in (int, float):
        raise ValueError(f"report row of rank {rank!r} malformed")
    if step is not None and type(step) is not int:
        raise ValueError(f"committed_step of rank {rank!r} malformed")
    text = {}
    for pair in digests:
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or type(pair[0]) is not int
            or not 0 <= _int(pair[1]) < len(strings)
        ):
            raise ValueError(f"digests of rank {rank!r} malformed")
        text[pair[0]] = strings[pair[1]]
    if not 0 <= _int(failure) < len(strings):
        raise ValueError(f"failure of rank {rank!r} malformed")
    return Report(
        generation,
        _int(rank),
        inc,
        _int(pid),
        host,
        step,
        text,
        strings[failure],
        float(when),
        {} if type(chunks) is dict and not chunks else _chunks(chunks),  # most rows: no chunks, no suspects
        () if type(suspects) is list and not suspects else _ranks(suspects),
    )


def merge_reports(generation: int, reports: Iterable[Report], host_reports: Iterable[HostReport]) -> dict[int, Report]:
    """old rank -> report of generation G, from per-rank records and aggregated ones together.

    The same answer as reading every report on its own key: of two reports under one rank the one
    with the greater incarnation id is kept (the per-rank keys `<rank>-<incarnation>` are read in
    key order, the last one kept), whichever record carried it."""
    out: dict[int, Report] = {}
    every = [*reports, *(r for h in host_reports if h.generation == generation for r in h.reports)]
    for rep in every:
        if rep.generation != generation:
            continue
        have = out.get(rep.rank)
        if have is None or rep.incarnation_id > have.incarnation_id:
            out[rep.rank] = rep
    return out


def _ranks(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list) or len(raw) > 1_000_000 or not all(type(r) is int and r >= 0 for r in raw):
        raise ValueError("suspects is not a list of ranks")
    return tuple(raw)


def _chunks(raw: Any) -> dict[int, dict[str, list[Any]]]:
    """A report's `chunks`: every entry [dtype, shape, sizes, sum] checked (ValueError if not)."""
    if not isinstance(raw, Mapping):
        raise ValueError("chunks is not an object")
    out: dict[int, dict[str, list[Any]]] = {}
    for step, keys in raw.items():
        if not isinstance(keys, Mapping):
            raise ValueError(f"chunks of step {step} is not an object")
        entries: dict[str, list[Any]] = {}
        for key, e in keys.items():
            ok = (
                isinstance(e, list)
                and len(e) == 4
                and isinstance(e[0], str)
                and all(isinstance(x, list) and all(type(i) is int and i >= 0 for i in x) for x in e[1:3])
                and len(e[1]) == len(e[2])
                and isinstance(e[3], str)
                and len(e[3]) == 16
                and all(c in "0123456789abcdef" for c in e[3])
            )
            if not ok or "@" not in str(key):
                raise ValueError(f"chunk {key!r} of step {step} is malformed")
            entries[str(key)] = [e[0], list(e[1]), list(e[2]), e[3]]
        out[int(step)] = entries
    return out


def write_report(job_dir: str | os.PathLike[str], report: Report) -> Path:
    """Publish one survivor's report for its generation (atomic: readers never see half of it)."""
    d = inplace_dir(job_dir) / f"g{report.generation}"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"report-{report.rank}-{report.incarnation_id}.json"
    jobdir.atomic_write_json(path, report.to_dict())
    return path


def read_reports(job_dir: str | os.PathLike[str], generation: int) -> dict[int, Report]:
    """The reports of generation G's survivors by old rank (malformed or partial files are skipped)."""
    out: dict[int, Report] = {}
    d = inplace_dir(job_dir) / f"g{generation}"
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.startswith("report-"):
            continue
        try:
            rep = Report.from_dict(jobdir.read_json(d / name))  # bounded: a FIFO or link is a report not made
        except (GpuguardError, ValueError, KeyError, TypeError):
            continue
        out[rep.rank] = rep
    return out


REFUSED_FILE = "refused.json"


def refusal_path(job_dir: str | os.PathLike[str], generation: int) -> Path:
    """`g<G>/refused.json`: the coordinator's refusal to switch generation G in place."""
    return inplace_dir(job_dir) / f"g{int(generation)}" / REFUSED_FILE


def read_refusal(job_dir: str | os.PathLike[str], generation: int) -> dict[str, Any] | None:
    """The refusal of generation G's switch (None: none; an unreadable file is a refusal that says so)."""
    path = refusal_path(job_dir, generation)
    if not path.exists():
        return None
    try:
        return jobdir.read_json(path)
    except GpuguardError:
        return {"reason": f"{path} unreadable"}


def request_abort(job_dir: str | os.PathLike[str], generation: int, why: str = "operator") -> Path:
    """An operator's abort of generation `generation`: its members switch in place at the next step."""
    path = inplace_dir(job_dir) / ABORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    jobdir.atomic_write_json(path, {"generation": generation, "why": why, "time": time.time()})
    return path


def abort_requested(job_dir: str | os.PathLike[str], generation: int) -> bool:
    """Has an operator asked generation `generation` to switch (a torn or foreign file: no)?"""
    path = inplace_dir(job_dir) / ABORT_FILE
    if not path.exists():
        return False
    try:
        return jobdir.read_json(path).get("generation") == generation
    except GpuguardError:
        return False


SWITCH_SCHEMA = "gpuguard.inplace-switch/1"


def write_switch_record(job_dir: str | os.PathLike[str], record: Mapping[str, Any]) -> Path:
    """Written by each member at its first commit in the new generation (`gpuguard.inplace-switch/1`):
    a record of this host's job dir, never coordination (nobody waits for it)."""
    path = jobdir.switch_record_path(job_dir, int(record["generation"]), int(record["rank"]))
    jobdir.atomic_write_json(path, {**record, "schema": SWITCH_SCHEMA})
    return path


def read_switch_records(job_dir: str | os.PathLike[str], generation: int) -> dict[int, dict[str, Any]]:
    """rank -> switch record of `generation`; unreadable or foreign files are skipped."""
    out: dict[int, dict[str, Any]] = {}
    for path in jobdir.switch_record_paths(job_dir, generation):
        try:
            doc = jobdir.read_json(path)
        except GpuguardError:
            continue
        if doc.get("schema") == SWITCH_SCHEMA and isinstance(doc.get("rank"), int):
            out[doc["rank"]] = doc
    return out
