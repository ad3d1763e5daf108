"""A job's history as pictures read it: every rank's steps per generation, the generations, and where
each restart's time went; and as a Chrome trace (`docs/formats/chrome-trace.md`) for ui.perfetto.dev.

Why: "where did the 16 s of recovery go" and "which rank is slow" are answered faster by looking.
The recovery phases come from what the job already writes: the previous generation's last step record
(the failure, at the latest), each new worker's process start (torchrun detected the failure and
respawned it), and the activation record's wall times (`coord/activation-g<N>.json`: runtime built,
store connected, certificate, state restored, process group ready), up to the first step's end. An
in-place switch has no restart: its phases are the lowest rank's switch record's
(`coord/inplace/switch-g<N>-r<rank>.json`: detect, reported, evicted, certified, restored, group
ready, first commit), after the failed rank's last record.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from gpuguard.collectors.step_records import read_history
from gpuguard.foundation.boundedread import read_json
from gpuguard.foundation.errors import GpuguardError
from gpuguard.foundation.jobdir import activation_path, ledger_dir, ledger_url_path, switch_record_paths
from gpuguard.foundation.observations import RankSeries
from gpuguard.generation.job import open_job_ledger

TRACE_SCHEMA = "gpuguard.trace/1"
LEDGER_TIMEOUT_S = 2.0
MAX_ACTIVATION_BYTES = 64 * 1024
# what happens between one activation phase and the next: the span is named after what it waited for
PHASE_NAMES = {
    "down": "down: torchrun detects, respawns",
    "down_and_import": "down, respawn, import torch",
    "down_inplace": "down: until a survivor detects it",
    "reported": "survivors report",
    "evicted": "evict the failed ranks",
    "frontier": "agree on the frontier",
    "certified": "certificate",
    "decided": "switch decided",
    "group_ready": "new process group",
    "resharded": "reshard the state",
    "first_commit": "first commit",
    "runtime_created": "import torch, build the runtime",
    "activate_called": "model setup, until activate()",
    "attempt_known": "read the attempt",
    "store_connected": "connect the store",
    "hellos": "hellos: every member reports",
    "certificate": "quiescence + certificate",
    "restored": "restore the state",
    "pg_ready": "process group ready",
    "verified": "verify the state",
    "first_step": "first step",
}


class Generation(NamedTuple):
    generation: int
    activated: float  # wall time
    reason: str
    switch: str
    members: int


class PhaseSpan(NamedTuple):
    generation: int
    phase: str  # a key of PHASE_NAMES (or the record's own key)
    start: float
    end: float

    @property
    def label(self) -> str:
        return PHASE_NAMES.get(self.phase, self.phase.replace("_", " "))


class JobHistory(NamedTuple):
    job_dir: str
    series: tuple[RankSeries, ...]  # every incarnation's run of one generation
    generations: tuple[Generation, ...]
    phases: tuple[PhaseSpan, ...]


def _generations(job_dir: Path) -> tuple[Generation, ...]:
    if not any(p.exists() for p in (ledger_dir(job_dir), ledger_url_path(job_dir))):
        return ()
    try:
        with open_job_ledger(job_dir, timeout=LEDGER_TIMEOUT_S) as ledger:
            chain = ledger.history()
    except Exception:  # noqa: BLE001 - an unreadable ledger: the step logs still draw the picture
        return ()
    return tuple(
        Generation(
            c.generation,
            float(c.activation_time),
            str(c.reason),
            str((c.extra or {}).get("switch") or "-"),
            len(c.members),
        )
        for c in chain
    )


def _activation(job_dir: Path, generation: int) -> dict[str, float]:
    """The activation record's phase wall times, {} when there is none or it is not one."""
    return _phases_of(activation_path(job_dir, generation), "an activation record")


def _phases_of(path: Path, what: str) -> dict[str, float]:
    """The `phases` wall times of a JSON record, {} when there is none or it is not one."""
    if not path.is_file():
        return {}
    try:
        doc = read_json(path, max_bytes=MAX_ACTIVATION_BYTES, what=what)
    except (GpuguardError, OSError):  # a torn, foreign or unreadable file: no phases, the picture stands
        return {}
    phases = doc.get("phases") if isinstance(doc, dict) else None
    if not isinstance(phases, dict):
        return {}
    return {str(k): float(v) for k, v in phases.items() if isinstance(v, (int, float)) and v > 0}


def recovery_phases(series: tuple[RankSeries, ...], activations: dict[int, dict[str, float]]) -> list[PhaseSpan]:
    """Each restart's spans: down (the previous generation's last record -> the first new process),
    the activation phases in time order, then the first step (-> the first step's end)."""
    out: list[PhaseSpan] = []
    for gen, marks in sorted(activations.items()):
        if gen == 0 or not marks:
            continue
        before = [s.last_wall for s in series if s.generation < gen and s.last_wall]
        last = max(before, default=0.0)
        down = "down"
        if "detect" in marks:  # in place: the survivors' logs go on; the failed rank's stopped first
            parent = max((s.generation for s in series if s.generation < gen), default=None)
            before = [min(s.last_wall for s in series if s.generation == parent)] if parent is not None else []
            last, down = (before[0], "down_inplace") if before else (0.0, down)
        elif before and marks.get("process_start", last + 1) <= last:
            # psutil's create time is only as exact as the boot time's whole second: a process start
            # before the old generation's last record is that error; down and the import are one span
            marks = {k: v for k, v in marks.items() if k != "process_start"}
            down = "down_and_import"
        ordered = sorted(marks.items(), key=lambda kv: kv[1])
        if before and last < ordered[0][1]:
            out.append(PhaseSpan(gen, down, last, ordered[0][1]))
        for (_, t0), (name, t1) in zip(ordered, ordered[1:], strict=False):
            out.append(PhaseSpan(gen, name, t0, t1))
        first = [s.steps[0].end_wall for s in series if s.generation == gen and s.steps]
        if first and min(first) > ordered[-1][1]:
            out.append(PhaseSpan(gen, "first_step", ordered[-1][1], min(first)))
    return out


def _switch(job_dir: Path, generation: int) -> dict[str, float]:
    """An in-place switch's phase wall times from its lowest rank's switch record (inplace.md), {} if none."""
    records = switch_record_paths(job_dir, generation)
    for path in sorted(records, key=lambda p: (len(p.name), p.name))[:1]:
        return _phases_of(path, "a switch record")
    return {}


def read_job_history(job_dir: str | os.PathLike[str]) -> JobHistory:
    path = Path(job_dir)
    series = read_history(path)
    generations = _generations(path)
    gens = {g.generation for g in generations} | {s.generation for s in series}
    activations = {g: _activation(path, g) or _switch(path, g) for g in sorted(gens)}
    return JobHistory(str(path), series, generations, tuple(recovery_phases(series, activations)))


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 1)


def chrome_trace(history: JobHistory) -> dict[str, Any]:
    """The Chrome trace event format (JSON object form): pid 1 the generations, pid 2 the recovery
    phases, pid 100 + N rank N (tid 1 its steps, tid 2 its collective waits). Times in microseconds
    since the first event; `otherData.t0` is that instant's wall time."""
    times = [g.activated for g in history.generations] + [p.start for p in history.phases]
    times += [s.start_wall for s in history.series if s.start_wall]
    t0 = min(times, default=0.0)
    ev: list[dict[str, Any]] = []

    def meta(pid: int, name: str, tid: int | None = None, thread: str = "") -> None:
        if tid is None:
            ev.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}})
            ev.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        else:
            ev.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}})

    meta(1, "generations")
    meta(2, "recovery")
    last = max([s.last_wall for s in history.series] + times, default=t0)
    gens = list(history.generations)
    for g, nxt in zip(gens, [*gens[1:], None], strict=False):
        end = nxt.activated if nxt is not None else last
        args = {"reason": g.reason, "switch": g.switch, "members": g.members}
        ev.append({"ph": "X", "pid": 1, "tid": 1, "name": f"generation {g.generation}", "cat": "generation",
                   "ts": _us(g.activated, t0), "dur": max(0.0, _us(end, g.activated)), "args": args})  # fmt: skip
        ev.append({"ph": "i", "pid": 1, "tid": 1, "s": "g", "name": f"activate generation {g.generation}",
                   "cat": "transition", "ts": _us(g.activated, t0), "args": args})  # fmt: skip
    for p in history.phases:
        ev.append({"ph": "X", "pid": 2, "tid": p.generation, "name": p.label, "cat": "recovery",
                   "ts": _us(p.start, t0), "dur": _us(p.end, p.start),
                   "args": {"generation": p.generation, "phase": p.phase}})  # fmt: skip
    for gen in sorted({p.generation for p in history.phases}):
        meta(2, "", gen, f"restart into generation {gen}")
    for rank in sorted({s.rank for s in history.series}):
        meta(100 + rank, f"rank {rank}")
        meta(100 + rank, "", 1, "steps")
        meta(100 + rank, "", 2, "collective waits")
    for s in history.series:
        pid = 100 + s.rank
        for st in s.steps:
            begin = st.end_wall - st.total_s
            ev.append({"ph": "X", "pid": pid, "tid": 1, "name": f"step {st.step}", "cat": "step",
                       "ts": _us(begin, t0), "dur": round(st.total_s * 1e6, 1),
                       "args": {"generation": s.generation, "compute_s": st.compute_s, "wait_s": st.wait_s,
                                "incarnation": s.incarnation}})  # fmt: skip
        for seq, wall, _mono, wait in s.entries:
            if wait >= 0:
                ev.append({"ph": "X", "pid": pid, "tid": 2, "name": f"collective {seq}", "cat": "collective",
                           "ts": _us(wall, t0), "dur": round(wait * 1e6, 1), "args": {"generation": s.generation}})  # fmt: skip
    return {
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {"schema": TRACE_SCHEMA, "job_dir": history.job_dir, "t0": t0},
    }
