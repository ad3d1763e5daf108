"""The data job of `data_job.py`, switching world size in place (issue 24: the in-place data stream).

Run by one torchrun agent per "node" (`examples.demo_node_loss.start_agent`, module
`tests.support.jobs.inplace_data_job`), environment: GPUGUARD_JOB_DIR, DATA_STEPS, and DATA_HOLD
"R:S": rank R, at the start of step S, writes JOB_DIR/faults/hold-r<R>-s<S>.json and waits there
(the test then SIGKILLs its node, so every survivor has taken its samples of step S and is in the
step's collective when the rank is lost). `InPlaceRuntime` with the `SampleStream` registered
(`activate(data=...)`): the survivors switch to the smaller world in the same processes and redo the
steps after the frontier. Each step every rank appends what it took to JOB_DIR/samples/rank-<orig>.jsonl
(generation, world, rank, step, its ids, the step's global batch); each survivor writes its final
parameters and AdamW step counts to JOB_DIR/results/<orig>.pt.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpuguard.foundation.env import JOB_DIR_ENV
from gpuguard.recovery.runtime.data import SampleStream
from gpuguard.recovery.runtime.inplace import InPlaceRuntime
from tests.support.jobs.data_job import BATCH, SEED, SIZE, build, grads_of, update


def hold_marker(job_dir: Path, rank: int, step: int) -> Path:
    return job_dir / "faults" / f"hold-r{rank}-s{step}.json"


def main() -> int:
    job_dir = Path(os.environ[JOB_DIR_ENV])
    orig = int(os.environ["RANK"])
    steps = int(os.environ["DATA_STEPS"])
    hold_rank, hold_step = (int(v) for v in os.environ.get("DATA_HOLD", "-1:-1").split(":"))
    rt = InPlaceRuntime.from_env(job_dir, pg_timeout_s=10.0, grace_s=3.0, checkpoint_every=0)
    model, opt = build()
    stream = SampleStream(SIZE, BATCH, SEED)
    state = rt.activate(model, opt, data=stream)
    log = job_dir / "samples" / f"rank-{orig}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)

    def step_fn(step: int, rank: int, world: int) -> None:
        if (orig, step) == (hold_rank, hold_step):
            marker = hold_marker(job_dir, orig, step)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            time.sleep(600)  # until the node is lost
        whole = stream.peek()
        mine = stream.take(rank, world)
        rec = {"generation": rt.generation, "world": world, "rank": rank, "step": step, "ids": mine, "global": whole}
        with open(log, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        every: list[torch.Tensor | None] = [None] * world
        dist.all_gather_object(every, grads_of(model, mine))
        update(model, opt, torch.cat([t for t in every if t is not None]))

    last = rt.run(state, step_fn, until=steps)
    out = job_dir / "results"
    out.mkdir(exist_ok=True)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    counts = torch.tensor(sorted(float(s["step"]) for s in opt.state.values()))
    torch.save({"params": final, "steps": counts, "last": torch.tensor(last)}, out / f".{orig}.pt")
    os.replace(out / f".{orig}.pt", out / f"{orig}.pt")  # a reader never sees it half-written
    rt.close(timeout=10.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
