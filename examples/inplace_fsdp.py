"""FSDP2 / HSDP training that switches generation in place with sharded state (a worker for `Cluster`).

    Cluster.launch(job, 4, module="gpuguard.examples.inplace_fsdp", extra_env={"INPLACE_SHARD": "2"})

The model and the batches are `examples/fsdp_train`'s (the global-mean gradient does not depend on
the world size, so any run ends equal to its one-process `reference` up to the reduction order).
`build()` shards it over the world it finds: HSDP with `INPLACE_SHARD` ranks per replica when the
world divides into at least two such replicas, plain FSDP2 over every rank otherwise (so 2 x 2 HSDP
that loses a rank goes on as FSDP2 over 3, taking the lost rank's shards from its replica). With
`INPLACE_DIGESTS=1` every step starts with the layout-independent digest of the state (a collective)
and rank 0 appends it to `<job>/fsdp-out/digests.jsonl` as the state after the step before: the test
compares it with the certificate. Faults as in `examples.inplace_train` (`INPLACE_FAULTS`; points
`before_allreduce` at the start of a step, `before_commit` after the update). `INPLACE_SHRINK=keep-layout`:
the in-place runtime's policy "keep the HSDP layout if possible" (drop a damaged replica whole).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gpuguard.examples.fsdp_train import mlp, train_step
from gpuguard.examples.inplace_train import FAULTS_ENV, fault_hook, parse_faults, result_doc
from gpuguard.foundation import jobdir
from gpuguard.foundation.env import JOB_DIR_ENV, PG_TIMEOUT_ENV
from gpuguard.recovery.runtime.inplace import InPlaceRuntime


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same initial weights at every world size; HSDP when the world splits into replicas."""
    world = dist.get_world_size()
    shard = int(os.environ.get("INPLACE_SHARD", "2"))
    if shard > 0 and world % shard == 0 and world // shard >= 2:
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _append(path: Path, rec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def worker_main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to the log
    job_dir = Path(os.environ[JOB_DIR_ENV])
    orig = int(os.environ["RANK"])
    hook = fault_hook(job_dir, orig, parse_faults(os.environ.get(FAULTS_ENV, "")))
    steps = int(os.environ.get("INPLACE_STEPS", "8"))
    sleep = float(os.environ.get("INPLACE_STEP_SLEEP", "0.02"))
    digests = os.environ.get("INPLACE_DIGESTS") == "1"
    rt = InPlaceRuntime.from_env(
        job_dir,
        sharded=True,
        fault_hook=hook,
        pg_timeout_s=float(os.environ.get(PG_TIMEOUT_ENV, "5")),
        grace_s=float(os.environ.get("INPLACE_GRACE", "1.0")),
        shrink=os.environ.get("INPLACE_SHRINK", "repartition"),
        snapshot_budget=0.0,  # a snapshot every step: the restart fallback loses at most the one in flight
        activation_timeout_s=60.0,
    )
    state = rt.activate(build=build)
    out = job_dir / "fsdp-out"

    def step_fn(step: int, rank: int, world: int) -> None:
        rt.fault("before_allreduce", step)
        if digests:  # (before the first step, the initial state: a fresh optimizer is not read)
            d = rt.state_hash()  # collective: the state after step - 1
            if rank == 0:
                _append(
                    out / "digests.jsonl", {"generation": rt.generation, "world": world, "step": step - 1, "digest": d}
                )
        train_step(rt.model, rt.optimizer, step)
        rt.fault("before_commit", step)
        if sleep:
            time.sleep(sleep)

    last = rt.run(state, step_fn, until=steps)
    full = get_model_state_dict(rt.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    results = job_dir / "results"
    results.mkdir(exist_ok=True)
    if rt.rank == 0:  # before this rank's result: a reader that saw every result finds it whole
        torch.save({k: v.detach().clone() for k, v in full.items()}, results / "final.tmp")
        os.replace(results / "final.tmp", results / "final.pt")
    jobdir.atomic_write_json(results / f"{orig}.json", result_doc(rt, orig, last))
    rt.close(timeout=10.0)
    return 0


if __name__ == "__main__":
    code = worker_main()
    gc.collect()  # FSDP keeps the group alive: free it before interpreter finalization (see fsdp_train)
    sys.exit(code)
