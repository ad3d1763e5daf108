"""A real 4-rank gloo job that breaks (or keeps) the collective contract, for `gpu-doctor contract`.

Run under torchrun. Every rank records each collective in gpuguard's CollectiveTrace and in
PyTorch's Flight Recorder, and after *enqueueing* each collective (async_op=True) it overwrites
its per-rank snapshots: gloo SIGABRTs a rank on a size mismatch, so a dump written only on
exception would never exist for that rank. On exception or at the end it dumps again.

Scenarios (`--scenario`):
  clean  every rank issues the same collectives;
  size   rank 3 all-reduces 512 elements instead of 1024 at step 4 (gloo aborts a rank);
  skip   rank 2 skips the `sync_metrics` all-reduce at step 3 (same op and size, different call
         site): positions still match, so the job only hangs at the very last collective.

Outputs under `--out`: fr_pickle/rank_<r>, fr_json/rank_<r>.json, gg/rank_<r>.json, done_<r>.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gpuguard.recovery.collective_trace import CollectiveTrace

STEPS = 6


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


class Recorder:
    """Issues collectives, keeps both traces and snapshots after each enqueue."""

    def __init__(self, rank: int, out: str, trace: CollectiveTrace) -> None:
        self.rank, self.out, self.trace = rank, out, trace
        self.seq: dict[str, int] = {}
        for sub in ("fr_pickle", "fr_json", "gg"):
            os.makedirs(os.path.join(out, sub), exist_ok=True)

    def snapshot(self, reason: str) -> None:
        c10d = torch._C._distributed_c10d
        _write_atomic(os.path.join(self.out, "fr_pickle", f"rank_{self.rank}"),
                      c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False))
        _write_atomic(os.path.join(self.out, "fr_json", f"rank_{self.rank}.json"),
                      c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False))
        self.trace.dump(os.path.join(self.out, "gg", f"rank_{self.rank}.json"), reason=reason)

    def issue(self, op: str, tensor: torch.Tensor, pg_name: str, group=None, reduce_op: str | None = None,
              site_depth: int = 1) -> None:
        seq = self.seq.get(pg_name, 0) + 1
        self.seq[pg_name] = seq
        caller = sys._getframe(site_depth)
        site = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
        self.trace.record(op, pg_name, seq, tensor.numel(), str(tensor.dtype).removeprefix("torch."),
                          reduce_op, site)
        if op == "all_reduce":
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[reduce_op or "sum"]
            work = dist.all_reduce(tensor, op=red, group=group, async_op=True)
        elif op == "broadcast":
            work = dist.broadcast(tensor, src=0, group=group, async_op=True)
        else:  # pragma: no cover - the job only uses the two above
            raise ValueError(op)
        self.snapshot(f"after enqueue {pg_name}#{seq}")
        work.wait()
        self.trace.complete(seq, pg_name)


def sync_metrics(rec: Recorder, step: int) -> None:
    rec.issue("all_reduce", torch.full((1024,), float(step)), "default", reduce_op="sum", site_depth=2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=("clean", "size", "skip"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=4.0)
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    pair = dist.new_group([0, 1])
    trace = CollectiveTrace(rank, generation=0, world_size=world, job_id=f"contract-{args.scenario}")
    rec = Recorder(rank, args.out, trace)
    try:
        for step in range(1, STEPS + 1):
            if step == 1:
                rec.issue("broadcast", torch.zeros(64), "default")
            grad = torch.ones(512 if (args.scenario == "size" and step == 4 and rank == 3) else 1024)
            if args.scenario == "size" and step == 4 and rank != 3:
                time.sleep(0.5)  # let rank 3 snapshot its bad call before gloo aborts it
            rec.issue("all_reduce", grad, "default", reduce_op="sum")
            if step % 2 == 0 and rank in (0, 1):
                rec.issue("all_reduce", torch.ones(16), "pair", group=pair, reduce_op="max")
            if step == 3 and not (args.scenario == "skip" and rank == 2):
                sync_metrics(rec, step)
        rec.snapshot("end")
        with open(os.path.join(args.out, f"done_{rank}"), "w") as fh:
            fh.write("ok\n")
    except Exception as exc:  # noqa: BLE001 - the dump is the point
        rec.snapshot(f"failure {type(exc).__name__}")
        print(f"rank {rank}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
