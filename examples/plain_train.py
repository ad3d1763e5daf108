"""The in-place demo's workload without gpuguard: what a user would otherwise run (the bench baseline).

Plain torch.distributed: a gloo group through `tcp://MASTER_ADDR:MASTER_PORT`, the collective
timeout `GPUGUARD_PG_TIMEOUT`, and rank 0 writing `torch.save` checkpoints every
`PLAIN_CKPT_EVERY` steps into `PLAIN_CKPT_DIR` (the cluster's shared checkpoint storage; temp file +
rename). On start it resumes from the newest checkpoint there. On a lost peer the collective
times out and the process exits non-zero: recovery is the operator's (or a supervisor's) kill
everything and relaunch. The mathematics are `examples.inplace_train`'s, so `reference()` is the oracle.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gpuguard.examples.inplace_train import average_grads, flat_params, local_grads, make_model


def newest_checkpoint(d: Path) -> tuple[int, Path] | None:
    found = []
    for p in d.glob("ckpt-*.pt") if d.exists() else []:
        try:
            found.append((int(p.stem.split("-", 1)[1]), p))
        except ValueError:
            continue
    return max(found) if found else None


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps = int(os.environ.get("INPLACE_STEPS", "30"))
    sleep = float(os.environ.get("INPLACE_STEP_SLEEP", "0.02"))
    every = max(1, int(os.environ.get("PLAIN_CKPT_EVERY", "5")))
    ckpt = Path(os.environ["PLAIN_CKPT_DIR"])
    timeout = timedelta(seconds=float(os.environ.get("GPUGUARD_PG_TIMEOUT", "60")))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    model, opt = make_model()
    start = 1
    found = newest_checkpoint(ckpt)
    if found is not None:
        doc = torch.load(found[1], weights_only=True)
        model.load_state_dict(doc["model"])
        opt.load_state_dict(doc["optim"])
        start = int(doc["step"]) + 1
    print(f"plain rank {rank}/{world}: resuming at step {start}", file=sys.stderr, flush=True)
    for step in range(start, steps + 1):
        local_grads(model, opt, step, rank, world)
        average_grads(model)
        opt.step()
        if rank == 0:
            (ckpt / "progress").mkdir(parents=True, exist_ok=True)
            (ckpt / "progress" / f"{step}-w{world}").write_text(str(time.time()))  # committed, for the bench
            if step % every == 0:
                tmp = ckpt / f".ckpt-{step}.tmp"
                torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, tmp)
                os.replace(tmp, ckpt / f"ckpt-{step}.pt")
        if sleep:
            time.sleep(sleep)
    if rank == 0:
        (ckpt / "result.json").write_text(json.dumps({"params": flat_params(model), "world": world, "start": start}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
