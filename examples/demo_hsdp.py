"""`gpu-recover demo --scenario hsdp`: an HSDP job loses a node; the survivors go on in place, resharded from memory.

Four real `torchrun` agents (`--nnodes=4`, one gloo worker each, no restarts, c10d rendezvous on a
store in this process, off the training nodes) train `gpuguard.examples.inplace_fsdp`: the MLP of
`fsdp_train` sharded as HSDP (2 replicas of 2 shards), AdamW, `InPlaceRuntime(sharded=True)`. Once
step `kill_step` is committed, the node whose worker is rank 3 is lost (its agent and its worker
SIGKILLed at once, mid-step). The other agents see healthy workers and restart nothing: the three
survivors certify generation 2 in place (rank 3's shards still live on its replica, rank 1), build
the model over 3 ranks (FSDP2) and take what each lacks from the others' memory, peer to peer.

With `shrink="keep-layout"` (`run_hsdp`, the in-place runtime's policy "keep the HSDP layout if
possible") the survivors drop rank 3's damaged replica whole instead: rank 2 leaves (status 0, its
agent ends well), ranks 0-1 keep their model and optimizer, moved to the new mesh, and 0 elements move.

The demo then checks that the survivors are the same processes, that the state rebuilt in place is
bitwise the certified one (and generation 1's at the frontier, when generation 1 logged it), that
the full parameters at the end equal a fault-free one-process reference within `ATOL`/`RTOL`
(`demo_fsdp`: the same tolerance and why), and that `gpu-generation verify --deep` accepts the ledger.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from gpuguard.examples import demo as d
from gpuguard.examples.demo_fsdp import ATOL, RTOL, against_reference
from gpuguard.examples.demo_node_loss import (
    NodeDemoResult,
    _committed,
    _ledger,
    _node_env,
    _wait,
    lose_node,
    start_agent,
    stop_agents,
)
from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import UnavailableError
from gpuguard.foundation.steplog import committed_steps

AGENTS, VICTIM_RANK = 4, 3
LAUNCHER = (
    f"torchrun: {AGENTS} agents (--nnodes={AGENTS}, 1 gloo worker each, no restarts), rendezvous store off the nodes"
)


@dataclass
class HsdpDemoResult(NodeDemoResult):
    launcher: str = LAUNCHER
    switch: str | None = None
    world_after: int | None = None
    steps_redone: int | None = None
    pids_unchanged: bool = False
    restored_bitwise: bool = False
    compared_with_generation_1: bool = False
    reshard_lines: list[str] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)  # survivors of a damaged replica that left (layout kept)
    rebuilt: bool | None = None  # whether the survivors built the model anew (False: layout kept, re-homed)
    elements_moved: int | None = None
    elements: int | None = None
    final_max_abs_diff: float | None = None
    agents_restarted_nothing: bool = False
    verify_deep_rc: int | None = None
    verify_deep: str = ""

    @property
    def recovered(self) -> bool:
        return (
            self.switch == "in-place"
            and self.world_after == AGENTS - 1 - len(self.dropped)
            and self.pids_unchanged
            and self.restored_bitwise
            and self.matches_reference
            and self.agents_restarted_nothing
        )


def _digests(job: Path) -> dict[tuple[int, int], str]:
    path = job / "fsdp-out" / "digests.jsonl"
    if not path.exists():
        return {}
    docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["generation"], r["step"]): r["digest"] for r in docs}


def run_hsdp(
    job: Path,
    *,
    steps: int,
    kill_step: int,
    timeout_s: float,
    on_event: Callable[[str], None],
    shrink: str = "repartition",
) -> HsdpDemoResult:
    """Run the scenario in `job` (an empty dir); `on_event` gets one line per milestone. `shrink`:
    the in-place runtime's policy (`"keep-layout"`: drop the damaged replica, move nothing)."""
    res = HsdpDemoResult(job)
    port = d.free_port()
    deadline = time.monotonic() + timeout_s
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**_node_env(job, steps), "INPLACE_SHARD": "2", "INPLACE_DIGESTS": "1", "INPLACE_STEP_SLEEP": "0.2"}
    env["INPLACE_SHRINK"] = shrink
    agents: list[subprocess.Popen] = []
    try:
        for i in range(AGENTS):
            agents.append(
                start_agent(
                    job / f"agent-{i}.log",
                    port=port,
                    rdzv_id=f"hsdp-{job.name}",
                    env=env,
                    nnodes=AGENTS,
                    module="gpuguard.examples.inplace_fsdp",
                )
            )
        on_event(f"started {AGENTS} agents (pids {', '.join(str(a.pid) for a in agents)}), HSDP 2x2 MLP + AdamW")
        if not _wait(lambda: _committed(job) >= kill_step, deadline):
            raise UnavailableError(
                f"the job did not commit step {kill_step} in {timeout_s:.0f} s (logs: {job}/agent-*.log)"
            )
        first = {mb.rank: mb.incarnation.pid for mb in _ledger(job).get(1).members}
        on_event(
            f"generation 1 certified at world {len(first)} (2 replicas x 2 shards); step {_committed(job)} committed"
        )
        res.kill = lose_node(job, agents, first, VICTIM_RANK)
        victim, kill_time, after = res.kill["node"], res.kill["time"], res.kill["after_step"]
        on_event(f"node {victim} lost (agent + rank {VICTIM_RANK} SIGKILLed) during step {after + 1}")
        if _wait(lambda: len(_ledger(job).generations()) >= 3, deadline):
            cert = _ledger(job).get(2)
            res.switch, res.reason, res.frontier = cert.extra.get("switch"), cert.reason, cert.frontier.step
            res.world_after = len(cert.members)
            res.dropped = list((cert.extra.get("layout_kept") or {}).get("dropped", []))
            on_event(
                f"generation 2 certified ({res.switch}, {res.reason}, world {res.world_after}, frontier step "
                f"{res.frontier}) {cert.activation_time - kill_time:.2f} s after the kill"
            )
        if res.dropped:
            on_event(f"HSDP layout kept: the damaged replica's survivors {res.dropped} leave, nothing moves")
        survivors = sorted(set(first) - {VICTIM_RANK} - set(res.dropped))
        results = job / "results"
        _wait(lambda: all((results / f"{r}.json").exists() for r in survivors), deadline, poll=0.1)
        docs = {
            r: json.loads((results / f"{r}.json").read_text()) for r in survivors if (results / f"{r}.json").exists()
        }
        res.pids_unchanged = sorted(docs) == survivors and all(docs[r]["pid"] == first[r] for r in survivors)
        switch = next((s for doc in docs.values() for s in doc.get("switches", []) if s.get("reshard")), None)
        if switch is not None:
            rs = switch["reshard"]
            res.reshard_lines = list(rs.get("lines") or [])
            res.elements_moved, res.elements = rs.get("elements_moved"), rs.get("elements")
            res.rebuilt = rs.get("rebuilt", True)
            for line in res.reshard_lines:
                on_event(f"  ownership change: {line}")
        res.agents_restarted_nothing = len(list(jobdir.incarnations_dir(job).glob("*.json"))) == AGENTS and all(
            a.poll() in (None, 0) for i, a in enumerate(agents) if i != victim
        )
        res.generations = _ledger(job).generations()
        t = d.first_commit_time(job, 2)
        res.resume_s = t - kill_time if t is not None else None
        if res.frontier is not None:
            committed = [c.step for c in committed_steps(job, 1)]
            res.steps_redone = max(committed, default=res.frontier) - res.frontier
    finally:
        stop_agents(agents)
        del store
    _check(job, res, steps)
    versus = " and generation 1's" if res.compared_with_generation_1 else ""
    on_event(
        f"state rebuilt in place bitwise the certified one{versus} at step {res.frontier}: "
        f"{'yes' if res.restored_bitwise else 'NO'}; survivors the same processes: {'yes' if res.pids_unchanged else 'NO'}"
    )
    diff = f"{res.final_max_abs_diff:.2e}" if res.final_max_abs_diff is not None else "-"
    on_event(
        f"final parameters vs a fault-free one-process reference at step {steps}: max |diff| {diff} "
        f"(tolerance atol {ATOL:g}, rtol {RTOL:g}): {'yes' if res.matches_reference else 'NO'}"
    )
    res.verify_deep_rc, res.verify_deep = d.gpu_generation("verify", "--deep", "--job-dir", str(job))
    return res


def _check(job: Path, res: HsdpDemoResult, steps: int) -> None:
    """The rebuilt state against the certificate (and generation 1), the final one against the reference."""
    if res.frontier is not None and len(res.generations) >= 3:
        want = _ledger(job).get(2).extra.get("sharded_state_digest")
        digests = _digests(job)
        res.restored_bitwise = want is not None and digests.get((2, res.frontier)) == want
        if (1, res.frontier) in digests:  # logged when rank 3 took part in the next step's digest
            res.compared_with_generation_1 = True
            res.restored_bitwise = res.restored_bitwise and digests[(1, res.frontier)] == want
    res.final_max_abs_diff, res.matches_reference = against_reference(job / "results" / "final.pt", steps)
