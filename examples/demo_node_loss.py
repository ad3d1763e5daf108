"""`gpu-recover demo --scenario node-loss`: a node dies and the survivors switch generation in place.

Three real `torchrun` agents (`--nnodes=3`, one gloo worker each, c10d rendezvous) run
`gpuguard.examples.inplace_train` on this host as three "nodes". The rendezvous TCPStore lives in
this process, a host that runs no training: with the agent-hosted default, losing the node that
hosts it makes every surviving agent kill its workers (see tests/recovery/runtime/test_inplace_torchrun.py). Once
the job has committed `kill_step` steps, the node whose worker is rank 0 (the first coordinator
and the snapshot writer) is lost: its agent and its worker are SIGKILLed at once. The surviving
agents restart nothing; their workers certify the next generation in place (`switch: in-place`)
and finish in the same processes, ending equal to a single-process reference run. The job dir
stays for inspection.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist

from gpuguard.examples.demo import first_commit_time, free_port
from gpuguard.examples.inplace_train import reference
from gpuguard.foundation import jobdir
from gpuguard.foundation.env import JOB_DIR_ENV, PG_TIMEOUT_ENV
from gpuguard.foundation.errors import UnavailableError
from gpuguard.foundation.steplog import committed_steps
from gpuguard.generation.ledger_open import open_ledger

AGENTS = 3
LAUNCHER = f"torchrun: {AGENTS} agents (--nnodes={AGENTS}, 1 gloo worker each), rendezvous store off the training nodes"


@dataclass
class NodeDemoResult:
    """What every lost-node demo reports (node-loss, fsdp, hsdp add their own checks)."""

    job_dir: Path
    launcher: str = LAUNCHER
    kill: dict[str, Any] | None = None  # `lose_node`'s record
    generations: list[int] = field(default_factory=list)
    reason: str | None = None
    frontier: int | None = None
    resume_s: float | None = None
    matches_reference: bool = False


@dataclass
class NodeLossResult(NodeDemoResult):
    switch: str | None = None
    survivors: list[dict[str, Any]] = field(default_factory=list)
    pids_unchanged: bool = False
    agents_restarted_nothing: bool = False

    @property
    def recovered(self) -> bool:
        return (
            self.switch == "in-place"
            and self.pids_unchanged
            and self.matches_reference
            and len(self.survivors) == AGENTS - 1
            and self.agents_restarted_nothing
        )


def _ledger(job: Path) -> Any:

    return open_ledger(job)


def _committed(job: Path) -> int:
    try:
        return max((c.step for c in committed_steps(job, 1)), default=-1)
    except Exception:  # noqa: BLE001 - the ledger does not exist yet
        return -1


def _node_env(job: Path, steps: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_"))}
    env.update(
        {
            JOB_DIR_ENV: str(job),
            "INPLACE_STEPS": str(steps),
            "INPLACE_STEP_SLEEP": "0.1",
            PG_TIMEOUT_ENV: "5",
            "INPLACE_GRACE": "3",
            "PYTHONWARNINGS": "ignore",
        }
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_agent(
    log: Path,
    *,
    port: int,
    rdzv_id: str,
    env: Mapping[str, str],
    nnodes: int = AGENTS,
    module: str = "gpuguard.examples.inplace_train",
) -> subprocess.Popen:
    """One of `nnodes` torchrun "nodes": one `module` worker (`inplace_train`), c10d rendezvous on the
    store at 127.0.0.1:`port`, no restarts, in a session of its own (killed as a group), output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nnodes),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                rdzv_id,
                "--max-restarts",
                "0",
                "--monitor-interval",
                "0.1",
                "-m",
                module,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _tree(pid: int) -> list[Any]:

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def lose_node(job: Path, agents: list[subprocess.Popen], first: Mapping[int, int], rank: int) -> dict[str, Any]:
    """SIGKILL the "node" running `rank` (pid `first[rank]`): its agent's process group and its
    workers, at once. The kill record the demos print: node, ranks lost, pids, last committed step, time."""
    victim = next((i for i, a in enumerate(agents) if first.get(rank) in {c.pid for c in _tree(a.pid)}), None)
    if victim is None:
        raise UnavailableError(f"no agent runs rank {rank} (pid {first.get(rank)}): logs in {job}/agent-*.log")
    workers = _tree(agents[victim].pid)
    kill_time = time.time()
    os.killpg(agents[victim].pid, signal.SIGKILL)
    for w in workers:
        try:
            w.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    after = _committed(job)  # read after the kill: no commit of the lost rank can come later
    return {
        "node": victim,
        "rank": rank,
        "ranks": sorted(r for r, pid in first.items() if pid in {w.pid for w in workers}),
        "agent_pid": agents[victim].pid,
        "worker_pids": [w.pid for w in workers],
        "after_step": after,
        "time": kill_time,
    }


def stop_agents(agents: list[subprocess.Popen]) -> None:
    """Kill what we started: every agent's workers (by pid), then the agent's process group."""
    for a in agents:
        for c in _tree(a.pid):
            try:
                c.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        if a.poll() is None:
            try:
                os.killpg(a.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            a.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _wait(cond: Callable[[], bool], deadline: float, poll: float = 0.05) -> bool:
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def run_node_loss(
    job: Path, *, steps: int, kill_step: int, timeout_s: float, on_event: Callable[[str], None]
) -> NodeLossResult:
    """Run the scenario in `job` (an empty dir); `on_event` gets one line per milestone."""

    with warnings.catch_warnings():  # torch without numpy warns at import: not the demo's business
        warnings.simplefilter("ignore")

    res = NodeLossResult(job)
    port = free_port()
    deadline = time.monotonic() + timeout_s
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = _node_env(job, steps)
    agents: list[subprocess.Popen] = []
    try:
        for i in range(AGENTS):
            agents.append(start_agent(job / f"agent-{i}.log", port=port, rdzv_id=f"demo-{job.name}", env=env))
        on_event(
            f"started {AGENTS} agents (pids {', '.join(str(a.pid) for a in agents)}); "
            f"rendezvous store on 127.0.0.1:{port} in this process"
        )
        if not _wait(lambda: _committed(job) >= kill_step, deadline):
            raise UnavailableError(
                f"the job did not commit step {kill_step} within {timeout_s:.0f} s (logs: {job}/agent-*.log)"
            )
        first = {m.rank: m.incarnation.pid for m in _ledger(job).get(1).members}
        on_event(
            f"generation 1 certified: ranks {sorted(first)} (pids {', '.join(str(first[r]) for r in sorted(first))}); "
            f"step {_committed(job)} committed"
        )
        res.kill = lose_node(job, agents, first, 0)
        victim = res.kill["node"]
        workers_pids = res.kill["worker_pids"]
        lost = res.kill["ranks"]
        on_event(
            f"node {victim} lost: SIGKILL its agent (pid {agents[victim].pid}) and its worker "
            f"(pid {', '.join(str(p) for p in workers_pids)}, rank {', '.join(map(str, lost))}) "
            f"after step {res.kill['after_step']}"
        )
        survivors = sorted(set(first) - set(lost))
        if _wait(lambda: len(_ledger(job).generations()) >= 3, deadline):
            cert = _ledger(job).get(2)
            res.switch, res.reason, res.frontier = cert.extra.get("switch"), cert.reason, cert.frontier.step
            on_event(
                f"generation 2 certified ({res.switch}, reason {res.reason}, frontier step {res.frontier}) "
                f"{cert.activation_time - res.kill['time']:.2f} s after the kill; members pids "
                f"{', '.join(str(m.incarnation.pid) for m in cert.members)}"
            )
        results = job / "results"
        _wait(lambda: all((results / f"{r}.json").exists() for r in survivors), deadline, poll=0.1)
        ref = reference(steps)
        for r in survivors:
            path = results / f"{r}.json"
            doc = json.loads(path.read_text()) if path.exists() else {}  # {}: falsy, as below
            res.survivors.append(
                {
                    "rank_before": r,
                    "pid_before": first[r],
                    "rank_after": doc["rank"] if doc else None,
                    "pid_after": doc["pid"] if doc else None,
                    "last_step": doc["last_step"] if doc else None,
                    "matches_reference": bool(doc)
                    and all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(doc["params"], ref)),
                }
            )
        res.pids_unchanged = bool(res.survivors) and all(s["pid_after"] == s["pid_before"] for s in res.survivors)
        res.matches_reference = bool(res.survivors) and all(
            s["matches_reference"] and s["last_step"] == steps for s in res.survivors
        )
        on_event(
            f"survivors finished step {steps} in the same processes: "
            + ", ".join(f"rank {s['rank_before']}->{s['rank_after']} pid {s['pid_after']}" for s in res.survivors)
            + f"; state equal to a single-process reference: {'yes' if res.matches_reference else 'NO'}"
        )
        # no agent started a second worker (one incarnation per original worker) and none failed; a
        # surviving agent may still sit in torchrun's exit barrier waiting for the lost node: stopped below
        res.agents_restarted_nothing = len(list(jobdir.incarnations_dir(job).glob("*.json"))) == AGENTS and all(
            a.poll() in (None, 0) for i, a in enumerate(agents) if i != victim
        )
        res.generations = _ledger(job).generations()
        if res.switch is not None:
            t = first_commit_time(job, 2)
            res.resume_s = t - res.kill["time"] if t is not None else None
    finally:
        stop_agents(agents)
        del store
    return res
