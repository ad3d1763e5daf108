"""The records the dead-vs-slow vote reads: per-rank step series, phase, process state.

Pure data (frozen dataclasses, no I/O): collectors fill them from step logs, the process table and
other doctors' findings; the vote and the simulator consume them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpuguard.foundation.step_columns import StepSample as StepSample  # re-exported: its home before step_columns
from gpuguard.foundation.step_summary import StepSummary

# phase kinds
COMPUTING = "computing"  # inside a step, not in a collective: the rank's own work
COLLECTIVE = "collective"  # waiting in collective N: blocked on the slowest peer
BETWEEN = "between"  # after end_step, before the next begin_step (data loading, logging)
STARTING = "starting"  # header written, no step yet
CLOSED = "closed"  # the rank closed its log cleanly


@dataclass(frozen=True, slots=True)
class Phase:
    """What the rank was doing at its last record, and since when."""

    kind: str
    step: int = -1
    seq: int = -1  # the collective it waits in; outside one, the last collective it left
    op: str = ""
    nbytes: int = 0
    since_wall: float = 0.0
    since_mono: float = 0.0


@dataclass(frozen=True, slots=True)
class RankSeries:
    """Everything one rank's (current) incarnation wrote."""

    rank: int
    incarnation: str
    generation: int = 0
    pid: int | None = None
    host: str = ""
    local_rank: int | None = None  # the GPU index on its host, when the launcher set LOCAL_RANK
    world_size: int | None = None  # WORLD_SIZE as the rank saw it
    start_time: float | None = None  # the process's create time (foundation.identity), if recorded
    start_wall: float = 0.0
    start_mono: float = 0.0
    steps: Sequence[StepSample] = ()  # the reader's are `foundation.step_columns.StepSamples`
    phase: Phase = Phase(STARTING)
    last_wall: float = 0.0  # last record of any kind (heartbeat included)
    last_mono: float = 0.0
    errors: tuple[str, ...] = ()
    bad_lines: int = 0
    clock_jumps: int = 0
    incarnations_seen: int = 1
    files: tuple[str, ...] = ()
    # the most recent collective entries (C records) as (seq, wall, mono, wait_s), oldest first: the arrival
    # order; wait_s is what the X record measured, -1.0 while the rank is still in that collective
    entries: Sequence[tuple[int, float, float, float]] = ()  # the reader's: `step_columns.CollectiveEntries`
    # the step-time distribution over the last `history` steps in bounded memory, when the reader built one
    # (`collectors.step_records.read_job(history=...)`): then `steps` holds only the most recent ones
    summary: StepSummary | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ProcessState:
    """The rank's process as the OS sees it (psutil), or `unknown` when it cannot be seen."""

    state: str  # running | sleeping | stopped | zombie | disk-sleep | gone | unknown
    detail: str = ""
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class HardwareEvidence:
    """A node doctor's finding about the GPU a rank runs on (input, not computed here)."""

    rank: int
    kind: str  # xid | gpu-lost | recovery-action | ecc
    fatal: bool
    text: str = ""


@dataclass(frozen=True, slots=True)
class CommError:
    """A communication error from some log, naming the rank that saw it and, if known, its peer."""

    rank: int | None
    peer: int | None
    text: str = ""


@dataclass(frozen=True, slots=True)
class RankObservation:
    """The vote's input for one rank at one check: features, not raw history (fast at 10,000 ranks)."""

    rank: int
    alive: ProcessState = ProcessState("unknown")
    has_records: bool = True
    phase: str = STARTING
    phase_step: int = -1
    phase_seq: int = -1
    phase_age_s: float = 0.0  # how long it has been in its current phase
    progress_age_s: float = 0.0  # since its last record of any kind
    n_steps: int = 0
    period_p50_s: float = 0.0  # own step period quantiles (learned)
    period_p99_s: float = 0.0
    period_p999_s: float = 0.0
    compute_p50_s: float = 0.0  # own compute quantiles
    compute_p999_s: float = 0.0
    recent_compute_s: float = 0.0  # median own compute over the recent window
    recent_period_s: float = 0.0
    nbytes: int = 0  # bytes of the collective it is in (or of its last step)
    closed: bool = False
    errors: tuple[str, ...] = ()
    hardware: tuple[HardwareEvidence, ...] = ()
    comm_errors: tuple[CommError, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # recent collective entries (seq, wall time, wait_s or -1.0 while in it), oldest first: arrival order
    entries: Sequence[tuple[int, float, float]] = ()  # from a reader: a view of its series' entries
    recent_period_max_s: float = 0.0  # the longest own step period of the recent window (not capped)
    cpu_s: float | None = None  # the process's CPU time (user + system) at this check, when visible here
