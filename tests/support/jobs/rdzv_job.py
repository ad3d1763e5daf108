"""A tiny gloo job for the etcd rendezvous tests (run under torchrun --rdzv-backend=gpuguard).

Each worker records how it was started (rank, world, its agent, the store torchrun gave it) in
$RDZV_JOB_OUT/start-<rank>-<restart>.json, then all-reduces `rank + 1` for $RDZV_JOB_STEPS steps
($RDZV_JOB_SLEEP s apart, progress in progress-<restart>-<rank>), checks each sum, and writes
done-<rank>-<restart>.json. A finite gloo timeout: a lost peer fails the step instead of hanging.
With $RDZV_JOB_FAIL_RESTARTS=N, a worker of restart < N exits 1 after recording its start (torchrun
restarts it: one more rendezvous round each time).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def main() -> None:
    out = Path(os.environ["RDZV_JOB_OUT"])
    steps = int(os.environ.get("RDZV_JOB_STEPS", "5"))
    pause = float(os.environ.get("RDZV_JOB_SLEEP", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    info = {
        "rank": rank,
        "world": world,
        "group_rank": int(os.environ["GROUP_RANK"]),
        "pid": os.getpid(),
        "agent_pid": os.getppid(),
        "restart": restart,
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "use_agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
    }
    _write(out / f"start-{rank}-{restart}.json", info)
    if restart < int(os.environ.get("RDZV_JOB_FAIL_RESTARTS", "0")):
        raise SystemExit(1)
    want = world * (world + 1) / 2
    for step in range(steps):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        assert t.item() == want, (t.item(), want)
        (out / f"progress-{restart}-{rank}").write_text(str(step + 1))
        time.sleep(pause)
    dist.barrier()
    _write(out / f"done-{rank}-{restart}.json", {**info, "steps": steps, "sum": want})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
