"""A tiny job that recovers in place, and a launcher for it (the tests, the bench and demos use both).

The workload is a float64 linear regression with SGD + momentum (so the optimizer state matters on
rollback). The global batch of step s is fixed (`GLOBAL_BATCH` samples, a function of s only);
with W data-parallel replicas each takes a contiguous shard and the all-reduced gradient *sum* is
divided by the global batch, so the mathematics do not depend on W: any run, however it shrank,
must end equal (up to float summation order) to `reference(steps)`, a single-process run. That is
the oracle.

Workers are plain processes (no torchrun): the launcher hosts the TCPStore used by the first,
restart-path activation only; every in-place generation rendezvouses through a FileStore in the
job dir (or through etcd, with an etcd ledger: `HostJob` starts one worker per test host). Faults:
`INPLACE_FAULTS="<orig-rank>:<step>:<point>:<kill|stop|spin|mark>,..."` (spin: a livelock; mark: only
the file, for a harness that faults the whole host), points
`before_allreduce | before_update | before_commit` (step = the step), `reported | coordinate`
(step = the generation being left) and `joining` (step = the generation being joined); the time of each fault is written to `<job>/faults/`.
`INPLACE_DEVICE=cuda` trains on this rank's GPU (with `GPUGUARD_BACKEND=cpu:gloo,cuda:nccl` the gradient
all-reduce runs on NCCL; ranks beyond the GPUs share them: `gpuguard.examples.devices`), and
`INPLACE_PAD_MB=N` adds an N MB buffer to the model's state (no part of the training): what each
commit copies to host memory for the rollback, so `remember_p50_s` in the results is that copy's cost.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from gpuguard.examples.devices import rank_device
from gpuguard.foundation import jobdir
from gpuguard.foundation.env import JOB_DIR_ENV, PG_TIMEOUT_ENV
from gpuguard.recovery.runtime.inplace import InPlaceRuntime
from gpuguard.recovery.runtime.switch import Layout

GLOBAL_BATCH = 12
DIM = 4
LR = 0.05
FAULTS_ENV = "INPLACE_FAULTS"


def batch(step: int) -> tuple[Any, Any]:

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g, dtype=torch.float64)
    y = x @ torch.arange(1, DIM + 1, dtype=torch.float64).unsqueeze(1) + 0.1 * torch.randn(
        GLOBAL_BATCH, 1, generator=g, dtype=torch.float64
    )
    return x, y


def shard(rank: int, world: int) -> tuple[int, int]:
    return rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world


def make_model(device: Any = None, pad_mb: float = 0.0) -> tuple[Any, Any]:

    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1, dtype=torch.float64)  # built on the CPU: the same weights anywhere
    if device is not None:
        model.to(device)
    if pad_mb > 0:  # state the rollback snapshot must copy, untouched by training
        model.register_buffer("pad", torch.zeros(int(pad_mb * 2**20) // 8, dtype=torch.float64, device=device))
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def local_grads(model: Any, opt: Any, step: int, rank: int, world: int) -> None:
    x, y = batch(step)
    lo, hi = shard(rank, world)
    x, y = x.to(model.weight.device), y.to(model.weight.device)
    opt.zero_grad()
    ((model(x[lo:hi]) - y[lo:hi]) ** 2).sum().backward()


def average_grads(model: Any) -> None:
    """Sum every rank's gradients in one all_reduce and divide by the global batch: the mean over
    the whole batch whatever the world size (the oracle divides the same sum)."""
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= GLOBAL_BATCH
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def flat_params(model: Any) -> list[float]:

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def reference(steps: int) -> list[float]:
    """The oracle: `steps` steps on the whole global batch in one process."""
    model, opt = make_model()
    for step in range(1, steps + 1):
        local_grads(model, opt, step, 0, 1)
        for p in model.parameters():
            p.grad /= GLOBAL_BATCH
        opt.step()
    return flat_params(model)


def parse_faults(text: str) -> list[tuple[int, int, str, str]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        r, s, point, action = part.split(":")
        if action not in ("kill", "stop", "spin", "mark"):
            raise ValueError(f"fault action must be kill, stop, spin or mark, not {action!r}")
        out.append((int(r), int(s), point, action))
    return out


def fault_hook(job_dir: Path, orig: int, faults: list[tuple[int, int, str, str]]) -> Callable[[str, int], None]:
    """The runtime's fault hook for `INPLACE_FAULTS` (see the module docstring): the fault's record
    goes to `<job>/faults/` first, then the action."""

    def hook(point: str, step: int) -> None:
        for r, s, p, action in faults:
            if r == orig and s == step and p == point:
                d = job_dir / "faults"
                d.mkdir(exist_ok=True)
                (d / f"{orig}-{point}-{step}.json").write_text(
                    json.dumps(
                        {
                            "rank": orig,
                            "pid": os.getpid(),
                            "point": point,
                            "step": step,
                            "action": action,
                            "time": time.time(),
                        }
                    )
                )
                if action == "mark":  # only the file above: a harness acting on the host waits for it
                    continue
                if action == "spin":  # a livelock: alive, running, never reaching another collective
                    while True:
                        pass
                os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)

    return hook


def result_doc(rt: InPlaceRuntime, orig: int, last: int) -> dict[str, Any]:
    """What every worker of these examples reports at the end (`<job>/results/<orig>.json`)."""
    return {
        "orig_rank": orig,
        "pid": os.getpid(),
        "rank": rt.rank,
        "world": rt.world_size,
        "generation": rt.generation,
        "last_step": last,
        "incarnation": rt.incarnation.id,
        "switches": rt.switches,
        "step_time_p50_s": _median(rt.step_times),
        "remember_p50_s": _median(rt.remember_times),
    }


def worker_main() -> int:

    job_dir = Path(os.environ[JOB_DIR_ENV])
    orig = int(os.environ["RANK"])
    hook = fault_hook(job_dir, orig, parse_faults(os.environ.get(FAULTS_ENV, "")))
    steps = int(os.environ.get("INPLACE_STEPS", "30"))
    sleep = float(os.environ.get("INPLACE_STEP_SLEEP", "0.02"))
    world = int(os.environ["WORLD_SIZE"])
    tp = int(os.environ.get("INPLACE_TP", "1"))  # declares a TP layout (the model is not split): refusal tests
    # before any group forms: NCCL reads its host id at its first communicator
    device = rank_device(os.environ.get("INPLACE_DEVICE", "cpu"), orig, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    rt = InPlaceRuntime.from_env(
        job_dir,
        fault_hook=hook,
        layout=Layout(dp=world // tp, tp=tp, global_batch=GLOBAL_BATCH),
        pg_timeout_s=float(os.environ.get(PG_TIMEOUT_ENV, "5")),
        grace_s=float(os.environ.get("INPLACE_GRACE", "1.0")),
        checkpoint_every=0,
    )
    model, opt = make_model(device, float(os.environ.get("INPLACE_PAD_MB", "0")))
    state = rt.activate(model, opt)

    def step_fn(step: int, rank: int, world: int) -> None:
        local_grads(model, opt, step, rank, world)
        rt.fault("before_allreduce", step)
        average_grads(model)
        rt.fault("before_update", step)
        opt.step()
        rt.fault("before_commit", step)
        if sleep:
            time.sleep(sleep)

    last = rt.run(state, step_fn, until=steps)
    out = job_dir / "results"
    out.mkdir(exist_ok=True)
    doc = {
        **result_doc(rt, orig, last),
        "params": flat_params(model),
        "digest": rt.replicated_digest(),
    }
    jobdir.atomic_write_json(out / f"{orig}.json", doc)  # a reader never sees it half-written
    rt.close(timeout=10.0)
    return 0


@dataclass
class Cluster:
    """N worker processes of one job (each in its own session, so the whole tree can be killed)."""

    job_dir: Path
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    store: Any = None

    @classmethod
    def launch(
        cls,
        job_dir: Path,
        n: int,
        *,
        steps: int = 30,
        faults: str = "",
        step_sleep: float = 0.02,
        pg_timeout: float = 5.0,
        grace: float = 1.0,
        extra_env: dict[str, str] | None = None,
        module: str = "gpuguard.examples.inplace_train",
    ) -> Cluster:

        job_dir.mkdir(parents=True, exist_ok=True)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        cluster = cls(job_dir, store=store)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_"))}
        env.update(
            {
                JOB_DIR_ENV: str(job_dir),
                "WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RUN_ID": job_dir.name,
                "INPLACE_STEPS": str(steps),
                FAULTS_ENV: faults,
                "INPLACE_STEP_SLEEP": str(step_sleep),
                PG_TIMEOUT_ENV: str(pg_timeout),
                "INPLACE_GRACE": str(grace),
                "PYTHONWARNINGS": "ignore",
                **(extra_env or {}),
            }
        )
        logs = job_dir / "logs"
        logs.mkdir(exist_ok=True)
        try:
            for r in range(n):
                with open(logs / f"worker-{r}.log", "wb") as log:
                    cluster.procs[r] = subprocess.Popen(
                        [sys.executable, "-m", module],
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
        except BaseException:
            cluster.kill_all()
            raise
        return cluster

    def wait(self, timeout: float) -> dict[int, int | None]:
        """Exit codes by original rank once every worker has exited or is stopped (None: still there)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(p.poll() is not None or _stopped(p.pid) for p in self.procs.values()):
                break
            time.sleep(0.05)
        return {r: p.poll() for r, p in self.procs.items()}

    def results(self) -> dict[int, dict[str, Any]]:
        out = {}
        for path in sorted((self.job_dir / "results").glob("*.json")):
            doc = json.loads(path.read_text())
            out[int(doc["orig_rank"])] = doc
        return out

    def log(self, rank: int) -> str:
        try:
            return (self.job_dir / "logs" / f"worker-{rank}.log").read_text(errors="replace")
        except OSError:
            return ""

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.store = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()


def _median(values: Sequence[float]) -> float | None:

    return statistics.median(values) if values else None


def _stopped(pid: int) -> bool:

    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


if __name__ == "__main__":
    sys.exit(worker_main())
