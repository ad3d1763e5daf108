"""What a job is doing now, from evidence that is shown: the first line of `gpu-recover status`.

Pure (no I/O): `status.gather` reads the facts, this module names the state and lists the evidence
it rests on, so the page never says more than it saw. Before this module the page had two answers,
"alive" or "down", and said the wrong one at the two moments on-call asks: while torchrun restarted
the workers ("every member is gone: safe to resume") and once the job had finished cleanly
("CRITICAL: the job is down").

States, each from its own evidence:
- `running`: every member of the active generation is alive (process table, pid + start time).
- `restarting (agent alive)`: members are gone and a torchrun agent of the job is alive on this host
  (it restarts the workers itself; new workers it started are listed).
- `switching in place`: survivors of the active generation reported for an in-place switch
  (`coord/inplace/g<G>/report-*`) or an operator asked for one (`abort.json`), none refused.
- `finished`: every member is gone, each after closing its step log in the active generation (the
  `Z` record) and no agent is left to restart anything.
- `down`: members are gone without a clean close and nothing (agent, switch) brings the job back.
- `starting (agent alive)` / `not started`: the active generation has no members yet.
- `unknown`: the evidence cannot tell (no certificate, members only on other hosts, a probe failed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

RUNNING = "running"
RESTARTING = "restarting (agent alive)"
SWITCHING = "switching in place"
FINISHED = "finished"
DOWN = "down"
STARTING = "starting (agent alive)"
NOT_STARTED = "not started"
UNKNOWN = "unknown"
STATES = (RUNNING, RESTARTING, SWITCHING, FINISHED, DOWN, STARTING, NOT_STARTED, UNKNOWN)
MAX_LISTED = 8  # ranks named in one evidence line


@dataclass(frozen=True)
class MemberLiveness:
    rank: int
    incarnation: str
    host: str
    pid: int
    state: str  # alive | gone | unknown
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "host": self.host,
            "pid": self.pid,
            "state": self.state,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class MemberRecord:
    """What a member's step log says of it in the active generation."""

    closed: bool  # its last record is the clean close (`Z`)
    last_step: int | None  # the last step it finished (None: none)


@dataclass(frozen=True)
class SwitchEvidence:
    """The in-place switch's files for the active generation (directory transport)."""

    reported: tuple[int, ...] = ()  # ranks of G whose survivor report is on disk
    refused: str | None = None  # the coordinator's refusal, if any
    abort_requested: bool = False
    committed: Mapping[int, int | None] = field(default_factory=dict)  # rank -> committed step it reported


@dataclass(frozen=True)
class Lifecycle:
    state: str
    evidence: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "evidence": list(self.evidence)}


def ranks(values: Sequence[int]) -> str:
    """'0, 1, 2' or '0, 1, 2, … (12)': a rank list that fits one line."""
    shown = ", ".join(str(r) for r in values[:MAX_LISTED])
    return shown + (f", … ({len(values)})" if len(values) > MAX_LISTED else "")


def lifecycle(
    generation: int | None,
    members: Sequence[MemberLiveness],
    *,
    records: Mapping[int, MemberRecord],
    agents: Sequence[int] | None,
    new_workers: Sequence[tuple[int, int]] = (),
    switch: SwitchEvidence = SwitchEvidence(),
    problem: str | None = None,
) -> Lifecycle:
    """The job's state and its evidence. `agents`: live torchrun agents of the job on this host (None:
    the process table could not be read); `new_workers`: (rank, pid) of live workers that are no member
    of the active generation (a restart's, not yet activated); `problem`: why the members are unknown."""
    if generation is None:
        return Lifecycle(UNKNOWN, (f"no active generation: {problem or 'no certificate'}",))
    if problem:
        return Lifecycle(UNKNOWN, (f"the members of generation {generation} could not be checked: {problem}",))
    agent_line = _agents_line(agents)
    if not members:
        if agents:
            return Lifecycle(STARTING, (f"generation {generation} has no members yet", agent_line))
        return Lifecycle(NOT_STARTED, (f"generation {generation} has no members: nothing has run yet",))
    alive = [m.rank for m in members if m.state == "alive"]
    gone = [m.rank for m in members if m.state == "gone"]
    unsure = [m for m in members if m.state not in ("alive", "gone")]
    evidence = [_members_line(generation, len(members), alive, gone, unsure)]
    switching = switch.refused is None and (switch.reported or switch.abort_requested)
    if switching and alive:
        if switch.reported:
            evidence.append(f"in-place reports of generation {generation} from rank {ranks(switch.reported)}")
        if switch.abort_requested:
            evidence.append(f"an operator asked generation {generation} to switch (abort.json)")
        return Lifecycle(SWITCHING, (*evidence, agent_line))
    if switch.refused is not None:
        evidence.append(f"the in-place switch of generation {generation} was refused: {switch.refused}")
    if not gone:
        if alive:
            return Lifecycle(RUNNING, (*evidence, agent_line))
        return Lifecycle(UNKNOWN, (*evidence, "no member can be checked from here"))
    closed = [r for r in gone if (rec := records.get(r)) is not None and rec.closed]
    open_ = [r for r in gone if r not in closed]
    if not alive and not unsure and not open_:
        last = {rec.last_step for r in gone if (rec := records.get(r)) is not None}
        at = f" at step {max(s for s in last if s is not None)}" if any(s is not None for s in last) else ""
        evidence.append(f"every member closed its step log in generation {generation}{at}")
        if agents:
            evidence.append(f"{agent_line} (exiting)")
        return Lifecycle(FINISHED, tuple(evidence))
    if open_:
        evidence.append(f"rank {ranks(open_)} ended without closing its step log (no clean exit)")
    if agents:
        if new_workers:
            evidence.append(
                f"{len(new_workers)} new worker(s) started by the agent, not yet in a generation "
                f"(rank {ranks(sorted(r for r, _ in new_workers))})"
            )
        return Lifecycle(RESTARTING, (*evidence, agent_line))
    if unsure and not alive:
        return Lifecycle(UNKNOWN, (*evidence, agent_line))
    why = agent_line + ("; no in-place switch has begun" if alive else "")
    return Lifecycle(DOWN, (*evidence, why))


def _agents_line(agents: Sequence[int] | None) -> str:
    if agents is None:
        return "torchrun agents: unknown (the process table could not be read)"
    if not agents:
        return "no torchrun agent of the job alive on this host"
    return f"torchrun agent pid {ranks(sorted(agents))} alive"


def _members_line(
    generation: int, n: int, alive: Sequence[int], gone: Sequence[int], unsure: Sequence[MemberLiveness]
) -> str:
    parts = []
    if alive:
        parts.append(f"rank {ranks(alive)} alive")
    if gone:
        parts.append(f"rank {ranks(gone)} gone")
    if unsure:
        parts.append(f"rank {ranks([m.rank for m in unsure])} unknown ({unsure[0].detail})")
    return f"{n} member(s) of generation {generation}: " + "; ".join(parts)
