"""A tiny synchronous gloo job that writes StepLog records: the target of the real-signal tests.

Usage (under torchrun): steps_job.py JOB_DIR [MAX_SECONDS]
Each step: a tiny forward/backward, `STEP_SLEEP` s of "compute" (+ the seconds in
JOB_DIR/control/slow.<rank>, if that file exists: a persistently slower rank), one all_reduce of
the gradients, an update. A finite gloo timeout and a wall-clock limit: nothing can hang forever.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from gpuguard.foundation.steplog import StepLog


def main() -> int:
    job_dir = sys.argv[1]
    max_seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
    base = float(os.environ.get("STEP_SLEEP", "0.05"))
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("GLOO_TIMEOUT", "60"))))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    log = StepLog(job_dir, rank, f"{uuid.uuid4().hex[:12]}", generation=0)
    control = os.path.join(job_dir, "control", f"slow.{rank}")
    deadline = time.monotonic() + max_seconds
    step = 0
    while time.monotonic() < deadline:
        log.begin_step(step)
        loss = model(torch.randn(8, 16)).pow(2).mean()
        model.zero_grad()
        loss.backward()
        extra = 0.0
        try:
            with open(control) as fh:
                extra = float(fh.read().strip() or 0)
        except (OSError, ValueError):
            pass
        time.sleep(base + extra)
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        log.enter_collective(step, "all_reduce", flat.numel() * flat.element_size())
        try:
            dist.all_reduce(flat)
        except Exception as exc:  # a peer died or froze: say so, then leave
            log.error(f"all_reduce {step}: {exc}")
            return 1
        log.exit_collective(step)
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                n = p.numel()
                p -= 0.01 * flat[offset : offset + n].view_as(p) / dist.get_world_size()
                offset += n
        log.end_step(step)
        step += 1
    log.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
