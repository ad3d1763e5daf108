"""Hazards of a live torchrun job that torchrun itself never reports (pure: facts in, findings out).

Measured on torch 2.13 + gloo (docs/torchrun-hazards.md):
- after a restart, workers can hang inside `init_process_group` for the whole PG timeout while the
  agent reports the group HEALTHY: alive, but no step since they started (`stuck-in-init`);
- an unhandled signal (SIGUSR1) kills only the agent and leaves its workers training with PPID 1,
  outside any supervision (`orphaned-workers`);
- without `--rdzv-id` the run id is the literal `none`: two jobs on one endpoint share a
  rendezvous, and operators cannot address the job (`rdzv-id-none`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuguard.foundation.errors import EXIT_CRITICAL, EXIT_OK, EXIT_WARNING
from gpuguard.foundation.torchrun_facts import AgentFacts, TorchrunFacts, WorkerFacts

WARNING, CRITICAL = "warning", "critical"
DEFAULT_INIT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Hazard:
    kind: str
    severity: str
    message: str
    ranks: tuple[int, ...] = ()
    pids: tuple[int, ...] = ()
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "message": self.message,
            "ranks": list(self.ranks),
            "pids": list(self.pids),
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Assessment:
    hazards: tuple[Hazard, ...]
    live_workers: int
    agents: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def verdict(self) -> str:
        """orphaned | hung | dead | healthy | unknown: what a runbook condition branches on."""
        kinds = {h.kind for h in self.hazards}
        if "orphaned-workers" in kinds:
            return "orphaned"
        if "stuck-in-init" in kinds:
            return "hung"
        if self.live_workers == 0:
            return "dead" if self.agents or self.notes else "unknown"
        return "healthy"

    @property
    def exit_code(self) -> int:
        severities = {h.severity for h in self.hazards}
        if CRITICAL in severities:
            return EXIT_CRITICAL
        return EXIT_WARNING if severities else EXIT_OK


def assess(
    agents: Iterable[AgentFacts],
    workers: Iterable[WorkerFacts],
    *,
    now: float,
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
    notes: Iterable[str] = (),
) -> Assessment:
    agents, workers = list(agents), list(workers)
    hazards: list[Hazard] = []
    for agent in agents:
        opts = agent.options
        if not opts.get("standalone") and opts.get("rdzv_id", "none") in ("", "none"):
            hazards.append(
                Hazard(
                    "rdzv-id-none",
                    WARNING,
                    f"torchrun agent {agent.pid} runs without --rdzv-id: its run id is the literal 'none', shared by "
                    f"every job on {opts.get('rdzv_endpoint', 'its endpoint')}",
                    pids=(agent.pid,),
                    fix="start torchrun with --rdzv-id=<unique job id>",
                )
            )
    live = [w for w in workers if w.alive]
    orphans = [w for w in live if not w.agent_alive or (w.ppid is not None and w.ppid != w.agent_pid)]
    if orphans:
        hazards.append(
            Hazard(
                "orphaned-workers",
                CRITICAL,
                f"{len(orphans)} worker(s) alive without their torchrun agent (agent gone or PPID changed): nothing "
                "restarts or stops them",
                ranks=tuple(sorted(w.rank for w in orphans)),
                pids=tuple(sorted(w.pid for w in orphans)),
                fix="gpu-recover abort --job-dir DIR (kills them by PID), then restart the job",
            )
        )
    stuck = [w for w in live if w.steps == 0 and now - w.started > init_timeout_s and w not in orphans]
    if stuck:
        oldest = max(now - w.started for w in stuck)
        after_restart = any(w.restart_count > 0 for w in stuck)
        hazards.append(
            Hazard(
                "stuck-in-init",
                CRITICAL,
                f"{len(stuck)} worker(s) alive for up to {oldest:.0f} s without a single step"
                f"{' after a restart' if after_restart else ''}: stuck in process-group init (torchrun still reports "
                "the group healthy)",
                ranks=tuple(sorted(w.rank for w in stuck)),
                pids=tuple(sorted(w.pid for w in stuck)),
                fix="set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (or gpuguard's runtime); gpu-recover abort to restart",
            )
        )
    agent_pids = {a.pid for a in agents} | {w.agent_pid for w in live if w.agent_alive}
    return Assessment(tuple(hazards), len(live), len(agent_pids), tuple(notes))


def assess_facts(facts: TorchrunFacts, *, now: float, init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S) -> Assessment:
    """`assess` over what `collectors.torchrun.gather` found."""
    return assess(facts.agents, facts.workers, now=now, init_timeout_s=init_timeout_s, notes=facts.notes)
