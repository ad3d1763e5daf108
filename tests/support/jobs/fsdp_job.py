"""A small FSDP2 training job on gloo/CPU with collective sharded snapshots: the target of the resharding tests.

Usage (under torchrun): fsdp_job.py JOB_DIR --steps T [--snapshot-every K] [--resume] [--dump all|ends]
  [--step-sleep S] [--replicated | --hsdp] [--max-seconds N] [--memory-digest] [--device cpu|cuda] [--rng-check]

The model is an MLP sharded with `fully_shard` per layer (with --hsdp over a 2 x world/2 mesh:
two replica groups; with --replicated, a plain replicated model whose gradients are all-reduced),
AdamW. Step s trains on a global batch of 24 rows drawn
from a generator seeded with s, split evenly over the ranks (24 divides by 1, 2, 3 and 4), so that
every world size computes the same global-mean gradient. --dump writes the gathered full state
(model + optimizer) to JOB_DIR/dump/<tag>.pt from rank 0: every step (`all`, a reference run) or
the restored state and the last step (`ends`). Each rank writes its pid to JOB_DIR/pids/rank-<R>
and, after each step, the step to JOB_DIR/progress/rank-<R>. Finite gloo timeouts and a wall-clock
limit: nothing can hang forever.

--device puts the model on the CPU (gloo) or on this rank's GPU (`cpu:gloo,cuda:nccl`; ranks beyond
the GPUs share them: `gpuguard.examples.devices`). --rng-check: every step draws from the CPU (and
CUDA) RNG, each snapshot carries the rank's RNG states (`rng_state`) and writes them, with the raw
`torch.get_rng_state()` / `torch.cuda.get_rng_state_all()` bytes, to JOB_DIR/rng/saved-<step>-rank-<R>.json;
a --resume restores them (`restore_rng`) and writes JOB_DIR/rng/check-rank-<R>.json: whether the
restored bytes equal the saved ones, and whether they differed before the restore.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from gpuguard.examples.devices import rank_device
from gpuguard.foundation.errors import DataError
from gpuguard.generation.ownership import describe_reshard, plan_reshard, reshard_problems
from gpuguard.recovery.snapshots import parts, sharded_writer
from gpuguard.recovery.snapshots import sharded as ss
from gpuguard.recovery.snapshots.store import SnapshotInfo

GLOBAL_BATCH = 24


def build(
    replicated: bool, hsdp: bool = False, device: torch.device | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights at every world size
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    )
    if not replicated:
        mesh = None
        if hsdp or device is not None:
            from torch.distributed.device_mesh import init_device_mesh

            world = dist.get_world_size()
            if hsdp:  # 2 replica groups, each sharding over half the ranks
                mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            else:  # the device given, not the one FSDP2 would guess (a CUDA machine's)
                mesh = init_device_mesh(device.type, (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif device is not None:
        model.to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, replicated: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step, rank, world)
    dev = next(model.parameters()).device
    x, y = x.to(dev), y.to(dev)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if replicated:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    opt.step()
    opt.zero_grad()


def dump(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path, step: int) -> None:
    """Collective: the full (gathered) model and optimizer state, written by rank 0."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"step": step, "model": msd, "optim": osd}, tmp)
        os.replace(tmp, path)


def _rng_now() -> dict[str, object]:
    """This rank's RNG states: as snapshots keep them (`rng_state`) and the raw torch bytes, hex."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "rng": parts.rng_state(),
        "cpu_raw": torch.get_rng_state().numpy().tobytes().hex(),
        "cuda_raw": b"".join(t.numpy().tobytes() for t in torch.cuda.get_rng_state_all()).hex() if cuda else None,
    }


def draw(device: torch.device | None) -> None:
    """What dropout or data augmentation would do to the RNG streams (--rng-check)."""
    torch.rand(8)
    if device is not None and device.type == "cuda":
        torch.rand(8, device=device)


def save_rng(job_dir: Path, step: int, rank: int) -> dict[str, str]:
    """Record this rank's RNG states at a snapshot; returns what the snapshot's part keeps."""
    now = _rng_now()
    path = job_dir / "rng" / f"saved-{step}-rank-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(now))
    return now["rng"]  # type: ignore[return-value]


def check_rng(job_dir: Path, chosen: SnapshotInfo, rank: int, world: int) -> None:
    """Restore this rank's RNG from the snapshot's part and compare the bytes with the saved ones."""
    saved = json.loads((job_dir / "rng" / f"saved-{chosen.step}-rank-{rank}.json").read_text())
    before = _rng_now()
    restored, why = parts.restore_rng(chosen.path, rank, world)
    after = _rng_now()
    cuda = saved["cuda_raw"] is not None
    doc = {
        "rank": rank,
        "step": chosen.step,
        "restored": restored,
        "why": why,
        "cpu_equal": after["cpu_raw"] == saved["cpu_raw"],
        "cpu_differed_before": before["cpu_raw"] != saved["cpu_raw"],
        "cuda_equal": after["cuda_raw"] == saved["cuda_raw"] if cuda else None,
        "cuda_differed_before": before["cuda_raw"] != saved["cuda_raw"] if cuda else None,
        "cuda_state_bytes": len(saved["cuda_raw"]) // 2 if cuda else 0,
    }
    (job_dir / "rng" / f"check-rank-{rank}.json").write_text(json.dumps(doc))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("job_dir", type=Path)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--snapshot-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--dump", choices=("none", "all", "ends"), default="none")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--replicated", action="store_true")
    ap.add_argument("--hsdp", action="store_true", help="HSDP: a (2, world/2) mesh, replicate x shard")
    ap.add_argument("--max-seconds", type=float, default=50.0)
    ap.add_argument("--memory-digest", action="store_true", help="record the in-memory state digest at save")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: the CPU, FSDP2's own mesh")
    ap.add_argument("--rng-check", action="store_true", help="record RNG states at snapshots, check them on --resume")
    a = ap.parse_args()
    device = None
    if a.device is not None:
        world = int(os.environ["WORLD_SIZE"])
        device = rank_device(a.device, int(os.environ["RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    backend = "cpu:gloo,cuda:nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    deadline = time.monotonic() + a.max_seconds
    for sub in ("pids", "progress"):
        (a.job_dir / sub).mkdir(parents=True, exist_ok=True)
    (a.job_dir / "pids" / f"rank-{rank}").write_text(str(os.getpid()))
    model, opt = build(a.replicated, a.hsdp, device)
    start = 0
    if a.resume:
        sel = parts.select_sharded(a.job_dir)
        if sel.chosen is None:
            if rank == 0:
                print("no restorable sharded snapshot:", [r.reason for r in sel.rejected], flush=True)
            return 3
        live = ss.model_state(model, opt, extra={"step": torch.tensor(-1)})
        old = parts.snapshot_layout(sel.chosen.path)
        new = ss.current_layout(live, old.version + 1)
        try:
            loaded = ss.load_sharded(sel.chosen, live)  # reshards; checks the layout-free state digests
        except DataError as exc:
            if rank == 0:
                print(f"restore refused: {exc}", flush=True)
            return 3
        ss.apply_model_state(model, opt, loaded)
        start = int(loaded["extra"]["step"]) + 1
        if a.rng_check:
            check_rng(a.job_dir, sel.chosen, rank, dist.get_world_size())
        if rank == 0:
            plan = plan_reshard(old, new)
            words = describe_reshard(old, new, plan, step=sel.chosen.step)
            report = {
                "restored_step": sel.chosen.step,
                "old_world": old.world_size,
                "new_world": new.world_size,
                "plan_problems": reshard_problems(new, plan),
                "words": words,
                "rejected": [r.reason for r in sel.rejected],
            }
            (a.job_dir / "restore-report.json").write_text(json.dumps(report, indent=1))
            print("\n".join(words), flush=True)
        if a.dump != "none":
            dump(model, opt, a.job_dir / "dump" / "restored.pt", start - 1)
    snapper = None
    if a.snapshot_every:
        snapper = sharded_writer.ShardedSnapshotter(
            a.job_dir, generation=0, incarnation=uuid.uuid4().hex[:12], memory_digest=a.memory_digest
        )
    for step in range(start, a.steps):
        if time.monotonic() > deadline:
            print(f"rank {rank}: wall-clock limit at step {step}", flush=True)
            return 2
        if a.rng_check:
            draw(device)
        train_step(model, opt, step, a.replicated)
        if snapper is not None and step % a.snapshot_every == 0:
            rng = save_rng(a.job_dir, step, rank) if a.rng_check else None
            snapper.submit(step, ss.model_state(model, opt, extra={"step": torch.tensor(step)}), rng=rng)
        if a.dump == "all" or (a.dump == "ends" and step == a.steps - 1):
            dump(model, opt, a.job_dir / "dump" / f"step-{step}.pt", step)
        (a.job_dir / "progress" / f"rank-{rank}").write_text(str(step))
        if a.step_sleep:
            time.sleep(a.step_sleep)
    if snapper is not None:
        snapper.close(30.0)
        if snapper.errors:
            print(f"rank {rank}: {snapper.errors} snapshot errors", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
