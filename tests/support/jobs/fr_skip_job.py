"""A real 2-rank job for the Flight Recorder on NCCL (one GPU) or gloo (the CPU rehearsal): an
all_reduce, an uneven all_to_all_single, a send/recv pair, then rank 1 skips the last all_reduce, so
rank 0 waits on it until the process group's timeout. Launched by `bench/gpu_check.py`.

Usage (2 ranks, torchrun's environment): fr_skip_job.py --out DIR --backend nccl|gloo [--timeout S] [--dump-wait S]

The dumps go to `$TORCH_FR_DUMP_TEMP_FILE<rank>` (the caller sets it and the other Flight Recorder
variables). On NCCL PyTorch writes them: rank 0's watchdog sees the timeout and signals every rank
through the store (TORCH_NCCL_DUMP_ON_TIMEOUT); each rank waits until every rank's dump is out,
then exits 0. A rank whose own dump does not come within --dump-wait writes one itself to
DIR/fallback/rank_<r> and exits 3: the on-timeout path did not work. gloo has no dump on timeout,
so there each rank writes its own (rank 0 once gloo raises the timeout, rank 1 at once), as the
contract tests' gloo jobs do; gloo's recorder keeps no send/recv entries.
Each rank leaves DIR/rank_<r>.json: how its dump came and how long after the skip.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gpuguard.examples.devices import rank_device

TAG = 1024  # elements of the collectives that must match


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _settled(paths: list[Path], deadline: float) -> bool:
    """Every file exists, is non-empty and has stopped growing (PyTorch writes a dump in place)."""
    last: list[int] | None = None
    while time.monotonic() < deadline:
        sizes = [p.stat().st_size if p.exists() else 0 for p in paths]
        if all(sizes) and sizes == last:
            return True
        last = sizes
        time.sleep(0.25)
    return False


def _dump(backend: str) -> bytes:
    """This rank's Flight Recorder buffer as a pickle. On gloo without call stacks: symbolizing them
    the first time costs 5-8 s of CPU on a loaded 2-core machine, and the culprit is named without them."""
    c10d = torch._C._distributed_c10d
    fn = c10d._dump_nccl_trace if backend == "nccl" else c10d._dump_fr_trace
    return bytes(fn(includeCollectives=True, includeStackTraces=backend == "nccl", onlyActive=False))


def contract_calls(rank: int, world: int, dev: torch.device) -> None:
    """The calls every rank makes: all must hold in the dumps, send/recv paired."""
    dist.all_reduce(torch.ones(TAG, device=dev))
    in_split = [rank + 1] * world  # uneven: rank r sends r+1 elements to every rank
    out_split = [i + 1 for i in range(world)]
    out = torch.zeros(sum(out_split), device=dev)
    dist.all_to_all_single(out, torch.ones(sum(in_split), device=dev), out_split, in_split)
    if rank == 0:
        dist.send(torch.ones(4, device=dev), 1)
    elif rank == 1:
        dist.recv(torch.zeros(4, device=dev), 0)
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    ap.add_argument("--timeout", type=float, default=10.0, help="the process group's collective timeout")
    ap.add_argument("--dump-wait", type=float, default=60.0, help="seconds to wait for the dumps after the skip")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if world != 2 or not prefix:
        print("fr_skip_job needs 2 ranks and TORCH_FR_DUMP_TEMP_FILE", file=sys.stderr)
        return 2
    dev = rank_device("cuda" if a.backend == "nccl" else "cpu", rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dist.init_process_group(a.backend, timeout=timedelta(seconds=a.timeout))
    contract_calls(rank, world, dev)
    skipped_at = time.monotonic()
    dumps = [Path(f"{prefix}{r}") for r in range(world)]
    how = "on-timeout" if a.backend == "nccl" else "job"
    if rank == 0:  # sync_metrics: rank 1 never joins it
        work = dist.all_reduce(torch.full((TAG,), 2.0, device=dev), async_op=True)
        if a.backend == "gloo":
            try:
                work.wait()
            except RuntimeError as exc:  # gloo: the timeout
                print(f"rank 0: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
    end = skipped_at + a.dump_wait
    if a.backend == "gloo":  # rank 0 once gloo has raised the timeout; rank 1 at once, and it stays until the end
        _write_atomic(dumps[rank], _dump(a.backend))
    code = 0
    if not _settled(dumps, end):
        code = 3
        if not dumps[rank].exists():
            how = "fallback"
            _write_atomic(a.out / "fallback" / f"rank_{rank}", _dump(a.backend))
    doc = {"rank": rank, "dump": how, "seconds_after_skip": round(time.monotonic() - skipped_at, 3)}
    _write_atomic(a.out / f"rank_{rank}.json", json.dumps(doc).encode())
    sys.stdout.flush()
    os._exit(code)  # no teardown: rank 0's collective never completes, and the watchdog may abort the process


if __name__ == "__main__":
    sys.exit(main())
