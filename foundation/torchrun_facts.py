"""What a reader saw of a live torchrun job: its agents and its recorded workers, joined with the OS.

Shared data: `collectors.torchrun` fills these from the process table and the job directory, and
`diagnostics.torchrun_hazards` judges them. Neither imports the other; both import this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AgentFacts:
    """A torchrun agent process seen on this host."""

    pid: int
    options: Mapping[str, str]  # parsed rendezvous options (collectors.torchrun.parse_torchrun_cmdline)


@dataclass(frozen=True)
class WorkerFacts:
    """One recorded worker incarnation joined with what the OS and its step records say."""

    rank: int
    incarnation_id: str
    pid: int
    alive: bool  # the pid exists AND its create_time matches the record (a reused pid is not alive)
    agent_pid: int
    agent_alive: bool
    ppid: int | None
    started: float  # process create time (wall)
    steps: int  # steps this incarnation recorded
    restart_count: int = 0
    run_id: str = ""


@dataclass(frozen=True)
class TorchrunFacts:
    """Everything one look at the host found, plus notes on what could not be checked here."""

    agents: tuple[AgentFacts, ...]
    workers: tuple[WorkerFacts, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
