"""A small FSDP2 training loop on the gpuguard runtime with sharded state (the restart path, resharding).

    torchrun --nproc-per-node=3 ... -m gpuguard.examples.fsdp_train --job-dir DIR --steps 10 [--kill R:S ...]

The lines a user adds to an FSDP2 loop: the runtime (`sharded=True`), `activate(build=...)` (the
model is sharded once the runtime has formed this generation's group), `rt.steps` and
`rt.commit(step)` after the optimizer step. Every rank writes its own shards of each snapshot
(collective DCP save in the background); a restart at another world size restores them resharded.

The model is an MLP sharded with `fully_shard` per layer, AdamW. Step s trains on a global batch of
24 rows drawn from a generator seeded with s, split evenly over the ranks (24 divides by 1, 2, 3
and 4), so every world size computes the same global-mean gradient. After each commit every rank
takes part in the layout-independent state digest (`rt.state_hash()`, a collective) and rank 0
appends it to DIR/fsdp-out/digests.jsonl; each activation (frontier, restored digest) goes to
DIR/fsdp-out/activations.jsonl: a restored state can be compared bitwise with the state the
previous generation had at that step, at any world size.

`--kill R:S` SIGKILLs rank R (a real signal, once: a marker file) at the start of step S.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from gpuguard.examples.demo_train import Faults
from gpuguard.recovery.runtime import Runtime

GLOBAL_BATCH = 24
POINT = "step-start"


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same initial weights at every world size, sharded over the default group (FSDP2)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)
    n = GLOBAL_BATCH // world
    loss = torch.nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def parse_kill(text: str) -> tuple[int, int, str]:
    try:
        rank, step = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError("--kill wants RANK:STEP") from None
    return rank, step, POINT


def _append(path: Path, rec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job-dir", type=Path, required=True)
    ap.add_argument("--steps", type=int, required=True, help="train until this step (inclusive)")
    ap.add_argument("--kill", type=parse_kill, action="append", default=[], metavar="R:S")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="stand-in compute per step (s)")
    ap.add_argument("--no-digests", action="store_true", help="no per-step state digest (the benchmark)")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="wall-clock limit of this process")
    a = ap.parse_args(argv)
    deadline = time.monotonic() + a.max_seconds
    rank = int(os.environ.get("RANK", "0"))
    faults = Faults(a.job_dir, rank, a.kill)
    rt = Runtime.from_env(a.job_dir, sharded=True, fault_hook=faults, activation_timeout_s=60.0)
    state = rt.activate(build=build)
    model, opt = state.model, state.optimizer
    out = a.job_dir / "fsdp-out"
    if rt.rank == 0:
        _append(
            out / "activations.jsonl",
            {
                "generation": state.generation,
                "world_size": rt.world_size,
                "frontier_step": state.frontier_step,
                "start_step": state.start_step,
                "restored_from": state.restored_from,
                "state_digest": state.state_digest,
                "reshard": rt.reshard,
            },
        )
    for step in rt.steps(state, until=a.steps):
        if time.monotonic() > deadline:
            print(f"[fsdp rank {rt.rank}] wall-clock limit at step {step}", file=sys.stderr, flush=True)
            return 2
        faults(POINT, step)
        train_step(model, opt, step)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        rt.commit(step)
        if not a.no_digests:
            digest = rt.state_hash()  # collective: every rank
            if rt.rank == 0:
                _append(
                    out / "digests.jsonl",
                    {"generation": state.generation, "world_size": rt.world_size, "step": step, "digest": digest},
                )
    counters = rt.counters
    rt.close()
    if rt.rank == 0:
        print(
            f"[fsdp rank 0] done: {counters.snapshots} snapshots, {counters.snapshot_errors} errors, "
            f"writer CPU {counters.snapshot_cpu_s:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
