"""A replicated training job whose data position is state, and whose update does not depend on the world size.

Usage (under torchrun): data_job.py JOB_DIR --steps T [--kill R:S] [--size N --batch B --seed K]

The position is a `recovery.runtime.data.SampleStream` registered with `Runtime.activate(data=...)`:
each snapshot keeps it, a restore at any world size goes on from it (the rule of
docs/formats/sharded-snapshots.md, "Data position"). Each step every rank records the sample ids it
took (JOB_DIR/samples/rank-<R>.jsonl: generation, world, step, its ids, the step's global batch).
The update is world-size free: each rank takes the gradient of each of its samples on its own, every
rank gathers all of them (`all_gather_object`, rank order = the global batch's order) and adds them
one by one in that order, so a run at any world size, or one that changes world size on the way,
computes bitwise what `reference()` computes in one process, a plain loop without the runtime. Rank 0 writes the final parameters to
JOB_DIR/final.pt. `--kill R:S` SIGKILLs rank R at the start of step S (once: a marker file).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from gpuguard.examples.demo_train import Faults
from gpuguard.examples.fsdp_train import parse_kill
from gpuguard.recovery.runtime.data import SampleStream, reference_batches
from gpuguard.recovery.runtime.runtime import Runtime

SIZE, BATCH, SEED = 60, 6, 3


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    # AdamW: its step count is state, and a read that stepped a fresh one (torch's `get_state_dict`)
    # made the run differ from `reference` (issue 24)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `i` of the dataset: a function of its id only."""
    g = torch.Generator().manual_seed(90_000 + i)
    return torch.randn(1, 8, generator=g), torch.randn(1, 4, generator=g)


def grads_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """One row per sample: the flattened gradient of its loss alone."""
    params = list(model.parameters())
    rows = []
    for i in ids:
        x, y = sample(i)
        loss = torch.nn.functional.mse_loss(model(x), y)
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows) if rows else torch.zeros(0, sum(p.numel() for p in params))


def update(model: torch.nn.Module, opt: torch.optim.Optimizer, rows: torch.Tensor) -> None:
    """Add the rows one by one in their order, average, step: the same arithmetic at any world size."""
    total = torch.zeros(rows.shape[1])
    for row in rows:
        total = total + row
    total = total / rows.shape[0]
    offset = 0
    for p in model.parameters():
        p.grad = total[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    opt.step()
    opt.zero_grad()


def reference(steps: int, size: int = SIZE, batch: int = BATCH, seed: int = SEED) -> dict[str, torch.Tensor]:
    """The fault-free run in one process: what every world size must end with, bitwise."""
    model, opt = build()
    for ids in reference_batches(size, batch, seed, steps):
        update(model, opt, grads_of(model, ids))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("job_dir", type=Path)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--kill", type=parse_kill, action="append", default=[])
    ap.add_argument("--size", type=int, default=SIZE)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--seed", type=int, default=SEED)
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    faults = Faults(a.job_dir, rank, a.kill)
    rt = Runtime.from_env(a.job_dir, snapshot_every=1, checkpoint_every=0, activation_timeout_s=60.0)
    model, opt = build()
    stream = SampleStream(a.size, a.batch, a.seed)
    state = rt.activate(model, opt, data=stream)
    log = a.job_dir / "samples" / f"rank-{rt.rank}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    for step in rt.steps(state, until=a.steps):
        faults("step-start", step)
        whole = stream.peek()
        mine = stream.take(rt.rank, rt.world_size)
        rec = {"generation": state.generation, "world": rt.world_size, "step": step, "ids": mine, "global": whole}
        with open(log, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        every: list[torch.Tensor | None] = [None] * rt.world_size
        dist.all_gather_object(every, grads_of(model, mine))
        update(model, opt, torch.cat([t for t in every if t is not None]))
        rt.commit(step)
    if rt.rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.job_dir / "final.pt")
    rt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
