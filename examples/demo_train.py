"""A tiny deterministic data-parallel training job, for the demo, the tests and the benchmark.

    torchrun --nproc-per-node=4 ... -m gpuguard.examples.demo_train --job-dir DIR --steps 30 [--kill R:S:POINT ...]

Every rank holds the same small MLP (seeded), draws its batch from a generator seeded by
(step, rank), all-reduces the gradients with gloo and steps SGD with momentum: the state after
step S is a pure function of S and the world size, so a recovered run can be compared with a
no-fault reference run step by step.

`--mode gpuguard` (default) uses the runtime; `--mode plain` is the seed recipe it is compared
with: `init_process_group` over env://, rank 0 checkpoints every `--ckpt-every` steps.

Fault injection, for demos and tests: `--kill R:S:POINT` SIGKILLs rank R (its own process, a real
signal) at step S, at POINT = before-allreduce | after-allreduce | mid-update | snapshot (rank 0's
snapshot writer, before the snapshot is published). Each kill fires once: a marker file in the job
dir records it (and the kill time, for the benchmark).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gpuguard.foundation.env import JOB_DIR_ENV, PG_TIMEOUT_ENV
from gpuguard.recovery.runtime.runtime import Runtime
from gpuguard.recovery.snapshots.store import state_digest

POINTS = ("before-allreduce", "after-allreduce", "mid-update", "snapshot")


def parse_kill(text: str) -> tuple[int, int, str]:
    try:
        rank, step, point = text.split(":")
        if point not in POINTS:
            raise ValueError
        return int(rank), int(step), point
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kill wants RANK:STEP:POINT with POINT in {', '.join(POINTS)}") from None


def kill_marker(job_dir: Path, rank: int, step: int, point: str) -> Path:
    return job_dir / "faults" / f"kill-r{rank}-s{step}-{point}.json"


class Faults:
    """Fires each planned kill once (marker file created exclusively before the SIGKILL)."""

    def __init__(self, job_dir: Path, rank: int, kills: list[tuple[int, int, str]]) -> None:
        self.job_dir, self.rank = job_dir, rank
        self.kills = {(s, p) for r, s, p in kills if r == rank}

    def armed(self, point: str, step: int) -> bool:
        return (step, point) in self.kills and not kill_marker(self.job_dir, self.rank, step, point).exists()

    def __call__(self, point: str, step: int) -> None:
        if (step, point) not in self.kills:
            return
        marker = kill_marker(self.job_dir, self.rank, step, point)
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        os.write(
            fd,
            json.dumps(
                {"rank": self.rank, "step": step, "point": point, "pid": os.getpid(), "time": time.time()}
            ).encode(),
        )
        os.fsync(fd)
        os.close(fd)
        print(f"[demo rank {self.rank}] SIGKILL at step {step} ({point})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def build(seed: int = 0):

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def batch(step: int, rank: int):

    g = torch.Generator().manual_seed(step * 1009 + rank)
    return torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)


def burn(seconds: float) -> None:
    """Stand-in compute: matmuls for `seconds` of wall time (a ~100 ms step for the overhead bench)."""

    end = time.perf_counter() + seconds
    a = torch.ones(128, 128)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a * 1e-3)


def burn_work(iterations: int) -> None:
    """Stand-in compute of a FIXED amount of work (`iterations` matmuls): under a CPU quota the step takes
    longer, as a real throttled rank's does (wall-time `burn` would just do less work)."""

    a = torch.ones(128, 128)
    for _ in range(iterations):
        a = torch.tanh(a @ a * 1e-3)


def train_step(
    model, opt, step: int, rank: int, world: int, fault, burn_s: float = 0.0, collective=None, burn_n: int = 0
) -> float:
    """One data-parallel step with the fault points in their places.

    `collective(op, nbytes)` (the runtime's) marks the all-reduce in the step records."""

    if burn_s:
        burn(burn_s)
    if burn_n:
        burn_work(burn_n)
    x, y = batch(step, rank)
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    fault("before-allreduce", step)
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    with collective("all_reduce", flat.numel() * flat.element_size()) if collective else contextlib.nullcontext():
        dist.all_reduce(flat)
    flat /= world
    fault("after-allreduce", step)
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    if fault.armed("mid-update", step):
        with torch.no_grad():  # half of the update is in place when the kill lands
            next(model.parameters()).add_(flat[:1], alpha=-0.05)
        fault("mid-update", step)
    opt.step()
    return float(loss.detach())


def _append(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(doc) + "\n")


def run_gpuguard(args: argparse.Namespace) -> int:

    job_dir = Path(args.job_dir)
    rank = int(os.environ["RANK"])
    faults = Faults(job_dir, rank, args.kill)
    options = {} if args.checkpoint_every is None else {"checkpoint_every": args.checkpoint_every}
    rt = Runtime.from_env(job_dir, fault_hook=faults, snapshot_every=args.snapshot_every, **options)
    model, opt = build()
    state = rt.activate(model, opt)
    out = Path(args.out) if args.out else job_dir / "demo-out"
    _append(
        out / f"resume-{rank}.jsonl",
        {
            "rank": rank,
            "generation": state.generation,
            "start_step": state.start_step,
            "frontier_step": state.frontier_step,
            "hash": rt.state_hash(),
            "restored_from": state.restored_from,
            "incarnation": rt.incarnation.id,
            "world_size": rt.world_size,
            "time": time.time(),
            "phases": state.phases,
        },
    )
    loss = float("nan")
    for step in rt.steps(state, until=args.steps):
        loss = train_step(
            model, opt, step, rank, rt.world_size, faults, args.burn, collective=rt.collective, burn_n=args.burn_work
        )
        rt.commit(step)
        if args.hashes and rank == 0:
            _append(out / "hashes.jsonl", {"step": step, "hash": state_digest(rt.state_dict())})
        if args.step_log:
            _append(
                out / f"steps-{rank}.jsonl",
                {"rank": rank, "step": step, "time": time.time(), "generation": state.generation},
            )
        if args.progress and rank == 0:
            print(f"[demo] generation {state.generation} step {step} loss {loss:.4f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    final = {
        "rank": rank,
        "step": args.steps,
        "hash": rt.state_hash(),
        "generation": rt.generation,
        "loss": loss,
        "counters": vars(rt.counters),
        "step_times": list(rt.step_times),
    }
    rt.close()
    _append(out / f"final-{rank}.jsonl", final)
    return 0


def run_plain(args: argparse.Namespace) -> int:
    """The seed recipe: env:// gloo group, rank 0 saves a checkpoint every k steps, resume from it."""

    job_dir = Path(args.job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    faults = Faults(job_dir, rank, args.kill)
    # the same collective timeout as the runtime's group (GPUGUARD_PG_TIMEOUT), else torch's default
    timeout = float(os.environ.get(PG_TIMEOUT_ENV, "1800"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    world = dist.get_world_size()
    model, opt = build()
    ckpt = job_dir / "plain-ckpt.pt"
    start = 1
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        start = int(saved["step"]) + 1
    out = Path(args.out) if args.out else job_dir / "demo-out"
    _append(
        out / f"resume-{rank}.jsonl",
        {
            "rank": rank,
            "start_step": start,
            "frontier_step": start - 1,
            "time": time.time(),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        },
    )
    for step in range(start, args.steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt, step, rank, world, faults, args.burn, burn_n=args.burn_work)
        if rank == 0 and step % args.ckpt_every == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, tmp)
            os.replace(tmp, ckpt)
        if args.step_log:
            _append(
                out / f"steps-{rank}.jsonl",
                {"rank": rank, "step": step, "time": time.time(), "dt": time.perf_counter() - t0},
            )
        if args.sleep:
            time.sleep(args.sleep)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuguard.examples.demo_train", description=__doc__.split("\n")[0])
    p.add_argument("--job-dir", default=os.environ.get(JOB_DIR_ENV), required=JOB_DIR_ENV not in os.environ)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--kill", type=parse_kill, action="append", default=[])
    p.add_argument("--mode", choices=("gpuguard", "plain"), default="gpuguard")
    p.add_argument("--snapshot-every", type=int, default=1)
    p.add_argument("--checkpoint-every", type=int, default=None, help="durable checkpoint interval (default 50)")
    p.add_argument("--ckpt-every", type=int, default=5, help="plain mode: checkpoint interval")
    p.add_argument("--hashes", action="store_true", help="rank 0 records the state digest after every step")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--burn", type=float, default=0.0, help="seconds of stand-in compute per step")
    p.add_argument(
        "--burn-work",
        type=int,
        default=0,
        help="fixed stand-in compute per step (matmuls; a CPU quota makes it slower)",
    )
    p.add_argument("--step-log", action="store_true", help="every rank records each finished step (benchmark)")
    p.add_argument("--out", default=None, help="where resume/final records go (default JOB_DIR/demo-out)")
    args = p.parse_args(argv)
    return run_gpuguard(args) if args.mode == "gpuguard" else run_plain(args)


if __name__ == "__main__":
    sys.exit(main())
