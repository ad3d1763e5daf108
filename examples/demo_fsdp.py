"""`gpu-recover demo --scenario fsdp`: an FSDP2 job loses a node and resumes resharded on the others.

Four real `torchrun` agents (`--nnodes=3:4`, one gloo worker each, c10d rendezvous on a store in
this process, off the training nodes) train `gpuguard.examples.fsdp_train` (an MLP sharded with
`fully_shard`, AdamW) with `Runtime(sharded=True)`: every rank writes its own shards of each
collective snapshot. Once step `kill_step` is committed, the node whose worker is rank 3 is lost
(its agent and its worker SIGKILLed at once, while the others are in the next step). The three
surviving agents restart their workers, re-rendezvous at world size 3, and the runtime certifies
the restart: the frontier's ownership map and the reshard plan (who reads the lost rank's shards)
are in the certificate, DCP reshards the 4-rank snapshot onto 3 ranks, and the loaded state's
layout-independent digest is checked against the stored chunks before the first collective.

The demo then checks that the restored state is, bitwise, the state generation 1 had at the
frontier step (the digest does not depend on the layout), that the full parameters gathered at
the end equal a fault-free reference (`fsdp_train.reference`, the same training in one process)
within `ATOL`/`RTOL`, and that `gpu-generation verify --deep` accepts the ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpuguard.examples import demo as d
from gpuguard.examples.demo_node_loss import NodeDemoResult, _committed, _ledger, _wait, lose_node, stop_agents
from gpuguard.examples.fsdp_train import reference
from gpuguard.foundation.env import PG_TIMEOUT_ENV
from gpuguard.foundation.errors import UnavailableError

AGENTS, VICTIM_RANK = 4, 3
# last call 3 s: the 4 agents of the first round start within it on a loaded host (at 1 s a slow
# fourth agent makes round 0 complete with 3); keep-alive 1 s x 3: the lost agent leaves the
# rendezvous 3 s after its last heartbeat (torch's default is 15 s)
RDZV_CONF = "last_call_timeout=3,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"
LAUNCHER = f"torchrun: {AGENTS} agents (--nnodes=3:{AGENTS}, 1 gloo worker each), rendezvous store off the nodes"
# Tolerance of the final parameters against the one-process reference: FSDP2 averages the
# per-rank gradients with a reduce-scatter over 4 (then 3) ranks where the reference takes one
# mean over the batch, a float32 reassociation of a few ulps per step; AdamW's update is at most
# ~lr = 1e-2 an element, so k steps stay within ~k * lr * 1e-4 (2e-5 for k <= 20). A state one
# step off (a lost or repeated step) differs by ~lr: far outside.
ATOL, RTOL = 2e-5, 1e-4


@dataclass
class FsdpDemoResult(NodeDemoResult):
    launcher: str = LAUNCHER
    first_world: int | None = None
    world_after: int | None = None
    steps_lost: int | None = None
    restored_bitwise: bool = False
    reshard_lines: list[str] = field(default_factory=list)
    plan_held: bool = False
    rng: str | None = None
    final_max_abs_diff: float | None = None
    agents_ok: bool = False
    verify_deep_rc: int | None = None
    verify_deep: str = ""

    @property
    def recovered(self) -> bool:
        return (
            self.first_world == AGENTS
            and self.world_after == AGENTS - 1
            and self.restored_bitwise
            and self.plan_held
            and self.matches_reference
            and self.agents_ok
        )


def _env(job: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_"))}
    # torch 2.13's shared rendezvous store: a round after round 0 waits for a MASTER_ADDR only
    # round 0 writes (tests/recovery/runtime/test_recovery_real_multinode.py)
    env.update({PG_TIMEOUT_ENV: "10", "PYTHONWARNINGS": "ignore", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_agent(job: Path, i: int, *, port: int, steps: int, max_s: float, env: Mapping[str, str]) -> subprocess.Popen:
    """One of the `AGENTS` "nodes": a torchrun agent with one fsdp_train worker, in a session of its own."""
    with open(job / f"agent-{i}.log", "wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes=3:{AGENTS}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=fsdp-{job.name}",
                f"--rdzv-conf={RDZV_CONF}",
                "--max-restarts=3",
                "--monitor-interval=0.1",
                "-m",
                "gpuguard.examples.fsdp_train",
                "--job-dir",
                str(job),
                "--steps",
                str(steps),
                "--step-sleep",
                "0.1",
                "--final",
                "--max-seconds",
                str(int(max_s)),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _records(job: Path, name: str) -> list[dict[str, Any]]:
    path = job / "fsdp-out" / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check(job: Path, res: FsdpDemoResult, steps: int) -> None:
    """What the job left: the restored state against generation 1's, the final one against the reference."""
    acts = _records(job, "activations.jsonl")
    if acts:
        res.first_world = acts[0]["world_size"]
    if len(acts) >= 2:
        last = acts[-1]
        res.world_after, res.frontier, res.rng = last["world_size"], last["frontier_step"], last.get("rng")
        res.plan_held = bool((last.get("reshard") or {}).get("certified_plan_held"))
        before = [
            r["digest"]
            for r in _records(job, "digests.jsonl")
            if r["generation"] == acts[0]["generation"] and r["step"] == res.frontier
        ]
        res.restored_bitwise = len(before) == 1 and before[0] == last["state_digest"]
    res.final_max_abs_diff, res.matches_reference = against_reference(job / "fsdp-out" / "final.pt", steps)


def against_reference(final: Path, steps: int) -> tuple[float | None, bool]:
    """The gathered final parameters (`final.pt`) against `fsdp_train.reference(steps)`: the max
    absolute difference (None: no file, or other tensors) and whether it is within ATOL/RTOL."""
    if not final.exists():
        return None, False
    got, want = torch.load(final, weights_only=True), reference(steps)
    if got.keys() != want.keys():
        return None, False
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    return diff, all(torch.allclose(got[k], want[k], atol=ATOL, rtol=RTOL) for k in want)


def run_fsdp(
    job: Path, *, steps: int, kill_step: int, timeout_s: float, on_event: Callable[[str], None]
) -> FsdpDemoResult:
    """Run the scenario in `job` (an empty dir); `on_event` gets one line per milestone."""
    res = FsdpDemoResult(job)
    port = d.free_port()
    deadline = time.monotonic() + timeout_s
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = _env(job)
    agents: list[subprocess.Popen] = []
    try:
        agents = [start_agent(job, i, port=port, steps=steps, max_s=timeout_s, env=env) for i in range(AGENTS)]
        on_event(f"started {AGENTS} agents (pids {', '.join(str(a.pid) for a in agents)}), FSDP2 MLP + AdamW")
        if not _wait(lambda: _committed(job) >= kill_step, deadline):
            raise UnavailableError(
                f"the job did not commit step {kill_step} in {timeout_s:.0f} s (logs: {job}/agent-*.log)"
            )
        first = {mb.rank: mb.incarnation.pid for mb in _ledger(job).get(1).members}
        on_event(f"generation 1 certified at world {len(first)}; step {_committed(job)} committed")
        res.kill = lose_node(job, agents, first, VICTIM_RANK)
        victim, kill_time, after = res.kill["node"], res.kill["time"], res.kill["after_step"]
        on_event(f"node {victim} lost (agent + rank {VICTIM_RANK} SIGKILLed) during step {after + 1}")
        if _wait(lambda: len(_ledger(job).generations()) >= 3, deadline):
            cert = _ledger(job).get(2)
            res.reason, res.frontier = cert.reason, cert.frontier.step
            res.steps_lost = after - cert.frontier.step
            res.reshard_lines = list((cert.extra.get("reshard") or {}).get("lines") or [])
            on_event(
                f"generation 2 certified ({res.reason}, world {len(cert.members)}, frontier step {res.frontier}) "
                f"{cert.activation_time - kill_time:.2f} s after the kill"
            )
            for line in res.reshard_lines:
                on_event(f"  ownership change: {line}")
        survivors = [a for i, a in enumerate(agents) if i != victim]
        _wait(lambda: all(a.poll() is not None for a in survivors), deadline, poll=0.1)
        res.agents_ok = all(a.poll() == 0 for a in survivors)
        res.generations = _ledger(job).generations()
        t = d.first_commit_time(job, 2)
        res.resume_s = t - kill_time if t is not None else None
    finally:
        stop_agents(agents)
        del store
    _check(job, res, steps)
    on_event(
        f"restored state bitwise generation 1's at step {res.frontier}: {'yes' if res.restored_bitwise else 'NO'}; "
        f"{res.rng or 'RNG: -'}"
    )
    diff = f"{res.final_max_abs_diff:.2e}" if res.final_max_abs_diff is not None else "-"
    on_event(
        f"final parameters vs a fault-free one-process reference at step {steps}: max |diff| {diff} "
        f"(tolerance atol {ATOL:g}, rtol {RTOL:g}): {'yes' if res.matches_reference else 'NO'}"
    )
    res.verify_deep_rc, res.verify_deep = d.gpu_generation("verify", "--deep", "--job-dir", str(job))
    return res
