"""A tiny gloo training job for the gpu-recover tests (run under torchrun).

Every worker records its incarnation (recovery.jobdir) and its steps (recovery.steplog) in
$GPUGUARD_JOB_DIR, then trains an nn.Linear with a gloo all-reduce per step until killed or until
RECOVER_JOB_STEPS steps. RECOVER_JOB_INIT_DELAY="<rank>:<seconds>" makes that rank start its process
group late (only while the file RECOVER_JOB_INIT_DELAY_IF exists, if set), so its peers are really
stuck in group init meanwhile.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from datetime import timedelta

import psutil

from gpuguard.foundation.jobdir import IncarnationRecord, write_incarnation
from gpuguard.foundation.steplog import StepLog


def main() -> int:
    job_dir = os.environ["GPUGUARD_JOB_DIR"]
    rank = int(os.environ["RANK"])
    inc_id = uuid.uuid4().hex
    me = psutil.Process()
    write_incarnation(
        job_dir,
        IncarnationRecord(
            incarnation={"id": inc_id, "host": socket.gethostname(), "pid": me.pid, "start_time": me.create_time()},
            rank=rank,
            local_rank=int(os.environ["LOCAL_RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            generation=None,
            agent_pid=os.getppid(),
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", "none"),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        ),
    )
    log = StepLog(job_dir, rank, inc_id)
    delay = os.environ.get("RECOVER_JOB_INIT_DELAY", "")
    gate = os.environ.get("RECOVER_JOB_INIT_DELAY_IF", "")  # only when this file exists (e.g. after a restart)
    if delay and int(delay.split(":")[0]) == rank and (not gate or os.path.exists(gate)):
        end = time.monotonic() + float(delay.split(":")[1])
        while time.monotonic() < end:
            log.heartbeat()
            time.sleep(0.5)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = int(os.environ.get("RECOVER_JOB_STEPS", "100000"))
    x = torch.ones(4, 8)
    for step in range(steps):
        log.begin_step(step)
        opt.zero_grad()
        model(x).sum().backward()
        log.enter_collective(step, "all_reduce", 8 * 8 * 4)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        log.exit_collective(step)
        opt.step()
        log.end_step(step)
        time.sleep(0.1)
    log.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
