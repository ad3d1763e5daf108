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
previous generation had at that step, at any world size. At the start of each step every rank
draws from its global torch RNG (what dropout or data augmentation would use) and appends the
draw to DIR/fsdp-out/draws-rank<R>.jsonl: a restart at the same world size restores each rank's
RNG from its part of the snapshot, so the restored run draws what an uninterrupted one drew.

`--kill R:S` SIGKILLs rank R (a real signal, once: a marker file) at the start of step S.
`--hsdp` shards over a (2, world/2) mesh: two replica groups (HSDP). `--data` takes each step's rows
from a registered data position (`recovery.runtime.data.SampleStream`, 240 samples, 24 a step)
instead of a generator seeded with the step. `--corrupt` injects a corruption once
(`examples.corruptions`: `nan:R:S`, `diverge:R:S`, `flip:S`, `lose-data:S`).
`--final` gathers the full parameters after the last step into DIR/fsdp-out/final.pt (rank 0;
`gpu-recover demo --scenario fsdp` compares them with `reference`, the same training in one process).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gpuguard.examples import corruptions
from gpuguard.examples.demo_train import Faults
from gpuguard.recovery.runtime.data import SampleStream
from gpuguard.recovery.runtime.runtime import Runtime
from gpuguard.recovery.snapshots.soundness import Policy

GLOBAL_BATCH = 24
POINT = "step-start"
SOUNDNESS = {  # --soundness: every check (the default), finiteness and non-tensor only, none
    "full": Policy(),
    "finite": Policy(replicas=False),
    "off": Policy(finite=False, replicas=False, non_tensor=False, on_unsound="log"),
}


def mlp() -> torch.nn.Sequential:
    """The model, its initial weights seeded (0): the same at every world size and in `reference`."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    )


def build(hsdp: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same initial weights at every world size, sharded over the default group (FSDP2), or
    with `hsdp` over a (2, world/2) mesh: replicate x shard."""
    model = mlp()
    mesh = None
    if hsdp:
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def rows(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples `ids` of the `--data` dataset: each a function of its id."""
    pairs = [(torch.Generator().manual_seed(50_000 + i), i) for i in ids]
    xs = [torch.randn(16, generator=g) for g, _ in pairs]
    ys = [torch.randn(8, generator=g) for g, _ in pairs]
    return torch.stack(xs), torch.stack(ys)


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, data: SampleStream | None = None
) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    if data is not None:
        x, y = rows(data.take(rank, world))
    else:
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)
        n = GLOBAL_BATCH // world
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def reference(steps: int) -> dict[str, torch.Tensor]:
    """The same training without FSDP, in one process, steps 1..`steps`: the full parameters a
    fault-free job ends with (up to the gradient sum's reassociation over the ranks)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _write_final(model: torch.nn.Module, path: Path, rank: int) -> None:
    """Collective: the full (gathered) parameters, written by rank 0 atomically."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({k: v.detach().clone() for k, v in full.items()}, tmp)
        os.replace(tmp, path)


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
    ap.add_argument(
        "--snapshot-budget",
        type=float,
        default=0.0,
        help="the runtime's adaptive snapshot interval (fraction of step time; default here 0: every step, "
        "so the tests lose at most the snapshot in flight; the runtime's own default is 0.03)",
    )
    ap.add_argument("--final", action="store_true", help="gather the full parameters at the end (fsdp-out/final.pt)")
    ap.add_argument("--hsdp", action="store_true", help="HSDP: a (2, world/2) mesh, two replica groups")
    ap.add_argument("--data", action="store_true", help="rows from a registered data position (SampleStream)")
    ap.add_argument("--corrupt", type=corruptions.parse, action="append", default=[], metavar="KIND:[R:]S")
    ap.add_argument("--soundness", choices=tuple(SOUNDNESS), default="full", help="the runtime's soundness checks")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="wall-clock limit of this process")
    a = ap.parse_args(argv)
    deadline = time.monotonic() + a.max_seconds
    rank = int(os.environ.get("RANK", "0"))
    faults = Faults(a.job_dir, rank, a.kill)
    corrupt = corruptions.Corruptions(a.job_dir, rank, a.corrupt)
    rt = Runtime.from_env(
        a.job_dir,
        sharded=True,
        fault_hook=faults,
        activation_timeout_s=60.0,
        snapshot_budget=a.snapshot_budget,
        soundness=SOUNDNESS[a.soundness],
    )
    stream = SampleStream(240, GLOBAL_BATCH, seed=1) if a.data else None
    position = corruptions.Position(stream, corrupt) if stream is not None else None
    state = rt.activate(build=lambda: build(a.hsdp), data=position)
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
                "rng": rt.rng_restore,
            },
        )
    for step in rt.steps(state, until=a.steps):
        if time.monotonic() > deadline:
            print(f"[fsdp rank {rt.rank}] wall-clock limit at step {step}", file=sys.stderr, flush=True)
            return 2
        corrupt.before_step(step, rt.flush_snapshots)
        faults(POINT, step)
        draw = torch.rand(4 + rt.rank)  # the global RNG (per rank: its own use), restored from the rank's part
        if not a.no_digests:
            _append(
                out / f"draws-rank{rt.rank}.jsonl",
                {"generation": state.generation, "step": step, "draw": draw.tolist()},
            )
        train_step(model, opt, step, stream)
        corrupt.after_update(step, model)
        if position is not None:
            position.step = step
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
    if a.final:
        _write_final(model, out / "final.pt", rt.rank)
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
    code = main()
    # FSDP's modules keep the process group alive past destroy_process_group; freed at interpreter
    # finalization, gloo can abort the process (SIGABRT after a clean run, seen in CI): free it now
    gc.collect()
    raise SystemExit(code)
