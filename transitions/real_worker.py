"""The real-mode worker: the benchmark's mini-training as a torchrun/gloo job, one strategy per job.

    torchrun --nproc-per-node=3 --max-restarts=1 ... -m gpuguard.transitions.real_worker \
        --strategy gpuguard --job-dir DIR --fault process-death --boundary mid-optimizer-write

The state is int64 tensors (parameters and momentum as module buffers; RNG, data position and step
as extra tensors), updated exactly as `model` does, with two all-reduced buckets per step. Every
all-reduced bucket carries two provenance slots (the sender's step and restart generation), so the
receiver knows, not guesses, whether all contributions came from the same step of the same
generation. Faults are real: the victim SIGKILLs itself at the boundary (once: a marker file).

* `restart-all`: the seed recipe: `init_process_group` over env://, rank 0 `torch.save`s the state
  in place every k steps, `load_step()` reloads it with no integrity check.
* `gpuguard`: `gpuguard.recovery.Runtime`: certified activation through the ledger, a commit record
  per step, snapshots with manifests, fencing.

At the end each rank writes `out/final-<rank>.json` (state, the step it was restored at, the steps
it applied with their provenance) for the oracle.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpuguard.foundation import jobdir
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.recovery.runtime.runtime import Runtime
from gpuguard.transitions import model as m

POINTS = ("before-allreduce", "mid-optimizer-write", "before-commit")


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _unsigned(x: int) -> int:
    return x + (1 << 64) if x < 0 else x


class Holder:
    """The training state as tensors (what DCP / torch.save see) <-> model.TrainState."""

    def __init__(self, seed: int) -> None:

        s0 = m.initial_state(seed)
        self.module = nn.Module()
        self.module.register_buffer("params", torch.tensor(s0.params, dtype=torch.int64))
        self.module.register_buffer("momentum", torch.tensor([0] * m.N_PARAMS, dtype=torch.int64))
        self.extra = {
            "rng": torch.tensor([_signed(s0.rng)], dtype=torch.int64),
            "data_pos": torch.tensor([0], dtype=torch.int64),
            "step": torch.tensor([0], dtype=torch.int64),
        }

    def get(self) -> m.TrainState:
        return m.TrainState(
            int(self.extra["step"][0]),
            tuple(int(x) for x in self.module.params.tolist()),
            tuple(int(x) for x in self.module.momentum.tolist()),
            _unsigned(int(self.extra["rng"][0])),
            int(self.extra["data_pos"][0]),
        )

    def set(self, s: m.TrainState) -> None:

        self.module.params.copy_(torch.tensor(s.params, dtype=torch.int64))
        self.module.momentum.copy_(torch.tensor([0 if x is None else x for x in s.momentum], dtype=torch.int64))
        self.extra["rng"][0] = _signed(s.rng)
        self.extra["data_pos"][0] = s.data_pos
        self.extra["step"][0] = s.step

    def to_save(self) -> dict:
        return {
            "params": self.module.params.clone(),
            "momentum": self.module.momentum.clone(),
            **{k: v.clone() for k, v in self.extra.items()},
        }

    def from_saved(self, d: dict) -> None:
        self.module.params.copy_(d["params"])
        self.module.momentum.copy_(d["momentum"])
        for k in self.extra:
            self.extra[k].copy_(d[k])


class Faults:
    def __init__(self, args: argparse.Namespace, rank: int, generation_tag: int) -> None:
        self.args, self.rank, self.first = args, rank, generation_tag == 0
        self.dir = Path(args.job_dir) / "bench-faults"

    def __call__(self, point: str, step: int, holder: Holder, extra: dict) -> None:
        a = self.args
        if not (self.first and self.rank == a.victim and step == a.fault_step and point == a.boundary):
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        marker = self.dir / "fired.json"
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        if a.fault == "corrupt-shard":
            corrupt_newest(a)
        if a.fault == "stale-completion":
            spawn_late_writer(a, self.rank, step, holder, extra)
        os.write(fd, json.dumps({"rank": self.rank, "step": step, "point": point, "time": time.time()}).encode())
        os.fsync(fd)
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


def corrupt_newest(a: argparse.Namespace) -> None:
    """Flip one stored value of the newest complete checkpoint (it still loads)."""
    job = Path(a.job_dir)
    if a.strategy == "restart-all":
        path = job / "ckpt.pt"
        d = torch.load(path, weights_only=True)
        d["params"][0] ^= 1
        torch.save(d, path)
        return
    # the snapshot of the step before is written asynchronously: corrupt that one, not an older one
    deadline = time.monotonic() + 20
    while not jobdir.snapshot_dir(job, a.fault_step - 1).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    snaps = [path for _, path in jobdir.step_dirs(jobdir.snapshots_dir(job))]
    if not snaps:
        return
    data = max((p for p in snaps[-1].glob("*.distcp")), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))


def spawn_late_writer(a: argparse.Namespace, rank: int, step: int, holder: Holder, extra: dict) -> None:
    """A writer of this (old) incarnation that outlives it: it waits for the next generation, then writes."""
    job = Path(a.job_dir)
    payload = {
        "strategy": a.strategy,
        "job_dir": str(job),
        "rank": rank,
        "step": step,
        "incarnation": extra.get("incarnation", ""),
        "generation": extra.get("generation", 0),
        "state": holder.get().to_dict(),
    }
    (job / "bench-faults").mkdir(parents=True, exist_ok=True)
    spec = job / "bench-faults" / "late.json"
    spec.write_text(json.dumps(payload))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuguard.transitions.real_worker", "--late", str(spec)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (job / "bench-faults" / "late.pid").write_text(str(proc.pid))


def late_writer(spec_path: str) -> int:
    """Run by the detached writer: wait (bounded) until a newer generation is active, then write."""
    spec = json.loads(Path(spec_path).read_text())
    job = Path(spec["job_dir"])
    deadline = time.monotonic() + 120
    result: dict = {
        "kind": "commit-record" if spec["strategy"] == "gpuguard" else "checkpoint-shard",
        "origin_generation": spec["generation"],
        "step": spec["step"],
        "rank": spec["rank"],
    }
    while time.monotonic() < deadline:
        if spec["strategy"] == "gpuguard":
            active = open_ledger(job).active()
            if active is not None and active.generation > spec["generation"]:
                ok = open_ledger(job).record_commit(spec["generation"], spec["step"], spec["rank"], spec["incarnation"])
                result.update(accepted=bool(ok), active_generation=active.generation)
                break
        else:
            first = job / "bench-out" / f"first-step-g{spec['generation'] + 1}-r0.json"
            if first.exists():  # the restarted group has run a step: the old write lands now
                s = m.TrainState.from_dict(spec["state"])
                torch.save(
                    {
                        "params": torch.tensor(s.params),
                        "momentum": torch.tensor(s.momentum),
                        "rng": torch.tensor([_signed(s.rng)]),
                        "data_pos": torch.tensor([s.data_pos]),
                        "step": torch.tensor([s.step]),
                    },
                    job / "ckpt.pt",
                )
                result.update(accepted=True, active_generation=1)
                break
        time.sleep(0.05)
    (job / "bench-faults" / "late-result.json").write_text(json.dumps(result))
    return 0


def one_step(step: int, holder: Holder, world: int, rank: int, generation: int, fault: Faults, extra: dict) -> dict:
    """One data-parallel step, two all-reduced buckets each followed by its optimizer write.

    Each bucket carries the sender's step and generation in two extra slots: the sums say whether
    every contribution belonged to this step of this generation. Raises on a collective error.
    """

    s = holder.get()
    part = m.local_gradient(s, world, rank)
    fault("before-allreduce", step, holder, extra)
    results = []
    for b, bucket in enumerate(m.BUCKETS):
        t = torch.tensor(
            [part[j] if j in bucket else 0 for j in range(m.N_PARAMS)] + [step, generation], dtype=torch.int64
        )
        dist.all_reduce(t)
        vals = [int(x) % m.MOD for x in t[: m.N_PARAMS].tolist()]
        results.append((int(t[m.N_PARAMS]), int(t[m.N_PARAMS + 1])))
        s = m.update_slots(s, vals, bucket)
        holder.set(s)
        if b == 0:
            fault("mid-optimizer-write", step, holder, extra)
    holder.set(m.finish_step(s))
    same_step = all(ss == step * world for ss, _ in results)
    same_gen = all(gs == generation * world for _, gs in results)
    fault("before-commit", step, holder, extra)
    return {
        "step": step,
        "generation": generation,
        "grad_steps": [step] if same_step else [-1],
        "grad_generation": generation if same_gen else -1,
    }


def first_step_done(out: Path, generation: int, rank: int) -> None:
    (out / f"first-step-g{generation}-r{rank}.json").write_text(
        json.dumps({"time": time.time(), "generation": generation})
    )


def write_final(
    out: Path,
    rank: int,
    incarnation: str,
    generation: int,
    base: int,
    holder: Holder,
    history: list,
    world: int,
    resume_step: int | None = None,
) -> None:
    """What the oracle reads; `resume_step`: the step this rank continued from after the fault."""
    final = {
        "rank": rank,
        "incarnation": incarnation,
        "generation": generation,
        "base_step": base,
        "state": holder.get().to_dict(),
        "history": history,
        "world": world,
        "resume_step": base if resume_step is None else resume_step,
    }
    (out / f"final-{rank}.json").write_text(json.dumps(final))


def train_comm_only(a: argparse.Namespace) -> int:
    """Survivors rebuild the gloo group without the dead rank and carry on with the state they hold.

    No torchrun (its agent would stop the survivors): the driver starts the workers, rank 0 hosts
    the store, each generation's group lives under its own store prefix, and the old group is torn
    down outside the `except` block (inside it, the traceback keeps the old group alive and one
    survivor waits out the whole PG timeout: docs/torchrun-hazards.md). A step whose collective
    failed is retried from the top, as a raw shrink loop does.
    """

    job = Path(a.job_dir)
    out = job / "bench-out"
    out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        rank == 0,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )
    holder = Holder(a.seed)
    generation = 1
    extra: dict[str, Any] = {"incarnation": f"pid{os.getpid()}", "generation": generation}

    def join() -> None:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"g{generation}", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=5),
        )

    join()
    fault = Faults(a, rank, 0)
    history: list = []
    started: set[int] = set()
    resume: int | None = None
    while holder.get().step < a.steps:
        step = holder.get().step + 1
        failed = False
        try:
            history.append(one_step(step, holder, world, rank, generation, fault, extra))
        except RuntimeError:
            failed = True
        if failed:  # the victim was the last rank: the survivors keep their numbers
            resume = holder.get().step if resume is None else resume
            dist.destroy_process_group()
            generation += 1
            world -= 1
            extra["generation"] = generation
            fault.first = False
            join()
            continue
        if generation not in started:
            started.add(generation)
            first_step_done(out, generation, rank)
    write_final(out, rank, extra["incarnation"], generation, 0, holder, history, world, resume)
    dist.destroy_process_group()
    return 0


def train(a: argparse.Namespace) -> int:

    job = Path(a.job_dir)
    out = job / "bench-out"
    out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    holder = Holder(a.seed)
    rt = None
    extra: dict = {}
    if a.strategy == "gpuguard":
        rt = Runtime.from_env(job, snapshot_every=1, checkpoint_every=0)
        st = rt.activate(holder.module, None, extra=holder.extra)
        generation, base = st.generation, st.frontier_step
        extra = {"incarnation": rt.incarnation.id, "generation": generation}
        start = st.start_step
    else:
        dist.init_process_group("gloo")
        generation = restart + 1
        extra = {"incarnation": f"pid{os.getpid()}-restart{restart}", "generation": generation}
        base = 0
        ckpt = job / "ckpt.pt"
        if ckpt.exists():  # load_step(): no integrity check
            holder.from_saved(torch.load(ckpt, weights_only=True))
            base = holder.get().step
        elif rank == 0:
            torch.save(holder.to_save(), ckpt)
        start = base + 1
    if holder.get().step != start - 1:
        print(f"rank {rank}: restored step {holder.get().step} but told to start at {start}", file=sys.stderr)
    fault = Faults(a, rank, restart)
    history = []
    for step in range(start, a.steps + 1):
        history.append(one_step(step, holder, world, rank, generation, fault, extra))
        if rt is not None:
            rt.commit(step)
        elif rank == 0 and step % a.ckpt_every == 0:
            torch.save(holder.to_save(), job / "ckpt.pt")  # in place, as the recipe does
        if step == start:
            first_step_done(out, generation, rank)
    write_final(out, rank, extra["incarnation"], generation, base, holder, history, world)
    if rt is not None:
        rt.close()
    elif dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="real_worker")
    ap.add_argument("--late")
    ap.add_argument("--strategy", choices=("restart-all", "gpuguard", "communicator-only"))
    ap.add_argument("--job-dir")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ckpt-every", type=int, default=3)
    ap.add_argument("--fault", default="process-death")
    ap.add_argument("--boundary", choices=POINTS, default="mid-optimizer-write")
    ap.add_argument("--fault-step", type=int, default=6)
    ap.add_argument("--victim", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.late:
        return late_writer(a.late)
    if a.strategy == "communicator-only":
        return train_comm_only(a)
    return train(a)


if __name__ == "__main__":
    sys.exit(main())
