"""A real 4-rank gloo job that keeps, then breaks, the collective contract: for `gpu-doctor contract`.

Run under torchrun. Three scenarios run one after the other in the same workers (one launch: each
launch costs seconds of `import torch`), each on its own process groups, created up front:
  clean  every rank issues the same collectives (on a 4-rank group and a [0, 1] group);
  skip   rank 2 skips the `sync_metrics` all-reduce at step 3 (same op and size as the next call,
         different call site): positions still match, so only the last collective hangs (4 s PG
         timeout);
  size   rank 3 all-reduces 512 elements instead of 1024 at step 4: gloo SIGABRTs a rank, and
         torchrun then stops the job.
Every rank records each collective in gpuguard's CollectiveTrace and in PyTorch's Flight Recorder,
and after *enqueueing* each collective (async_op=True) it overwrites its snapshots: a rank that
gloo aborts writes nothing afterwards. The Flight Recorder buffer is per process, so each
scenario's dump keeps that scenario's process groups only; `all/` keeps the whole buffer.

Outputs under `--out`: <scenario>/{fr_pickle/rank_<r>, fr_json/rank_<r>.json, gg/rank_<r>.json,
gg_ring/rank_<r>.ring (CollectiveTrace's crash-surviving mmap ring: no snapshot needed)},
all/fr_pickle/rank_<r>, done_<scenario>_<r>.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gpuguard.foundation.collective_trace import CollectiveTrace

STEPS = 6


def _write_atomic(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _keep(doc: dict, pg_names: set[str]) -> dict:
    """This scenario's entries and pg_status only (our own dump: plain pickle is fine here)."""
    doc["entries"] = [e for e in doc["entries"] if str(e["process_group"][0]) in pg_names]
    ids = {str(e["pg_id"]) for e in doc["entries"]}  # pg_status is keyed by the rank-local pg uid
    doc["pg_status"] = {k: v for k, v in doc.get("pg_status", {}).items() if k in ids}
    return doc


class Recorder:
    """Issues collectives, keeps both traces and snapshots after each enqueue."""

    def __init__(self, rank: int, world: int, out: str, scenario: str, groups: dict) -> None:
        self.rank, self.out, self.scenario, self.groups = rank, out, scenario, groups
        self.pg_names = {dist.distributed_c10d._get_process_group_name(g) for g in groups.values()}
        self.trace = CollectiveTrace(
            rank,
            generation=0,
            world_size=world,
            job_id=f"contract-{scenario}",
            persist=os.path.join(out, scenario, "gg_ring", f"rank_{rank}.ring"),
        )
        self.seq: dict[str, int] = {}

    def snapshot(self, reason: str) -> None:
        c10d = torch._C._distributed_c10d
        raw = c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False)
        base = os.path.join(self.out, self.scenario)
        _write_atomic(os.path.join(self.out, "all", "fr_pickle", f"rank_{self.rank}"), raw)
        _write_atomic(
            os.path.join(base, "fr_pickle", f"rank_{self.rank}"),
            pickle.dumps(_keep(pickle.loads(raw), self.pg_names), protocol=2),
        )
        js = json.loads(c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False))
        _write_atomic(
            os.path.join(base, "fr_json", f"rank_{self.rank}.json"), json.dumps(_keep(js, self.pg_names)).encode()
        )
        self.trace.dump(os.path.join(base, "gg", f"rank_{self.rank}.json"), reason=reason)

    def issue(
        self, op: str, tensor: torch.Tensor, pg: str = "default", reduce_op: str | None = None, site_depth: int = 1
    ) -> None:
        seq = self.seq.get(pg, 0) + 1
        self.seq[pg] = seq
        caller = sys._getframe(site_depth)
        site = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
        self.trace.record(op, pg, seq, tensor.numel(), str(tensor.dtype).removeprefix("torch."), reduce_op, site)
        group = self.groups[pg]
        if op == "all_reduce":
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[reduce_op or "sum"]
            work = dist.all_reduce(tensor, op=red, group=group, async_op=True)
        else:
            work = dist.broadcast(tensor, src=0, group=group, async_op=True)
        self.snapshot(f"after enqueue {pg}#{seq}")
        work.wait()
        self.trace.complete(seq, pg)


def sync_metrics(rec: Recorder, step: int) -> None:
    rec.issue("all_reduce", torch.full((1024,), float(step)), reduce_op="sum", site_depth=2)


def run(rec: Recorder, scenario: str, rank: int) -> None:
    for step in range(1, STEPS + 1):
        if step == 1:
            rec.issue("broadcast", torch.zeros(64))
        bad = scenario == "size" and step == 4
        if bad and rank != 3:
            time.sleep(1.0)  # let rank 3 snapshot its bad call before gloo aborts it
        rec.issue("all_reduce", torch.ones(512 if bad and rank == 3 else 1024), reduce_op="sum")
        if "pair" in rec.groups and step % 2 == 0 and rank in (0, 1):
            rec.issue("all_reduce", torch.ones(16), "pair", reduce_op="max")
        if step == 3 and not (scenario == "skip" and rank == 2):
            sync_metrics(rec, step)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=4.0)
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # barriers between scenarios
    short = timedelta(seconds=args.timeout)
    # the clean scenario must not time out on a crowded machine (a 4 s collective there aborted a
    # rank of a clean group, seen under load): only the scenarios that hang or abort use `short`
    calm = timedelta(seconds=60)
    everyone = list(range(world))
    groups = {  # created up front, in the same order on every rank
        "clean": {
            "default": dist.new_group(everyone, timeout=calm, group_desc="clean"),
            "pair": dist.new_group([0, 1], timeout=calm, group_desc="clean_pair"),
        },
        "skip": {"default": dist.new_group(everyone, timeout=short, group_desc="skip")},
        "size": {"default": dist.new_group(everyone, timeout=short, group_desc="size")},
    }
    failed = 0
    for scenario in ("clean", "skip", "size"):
        rec = Recorder(rank, world, args.out, scenario, groups[scenario])
        try:
            run(rec, scenario, rank)
            rec.snapshot("end")
            with open(os.path.join(args.out, f"done_{scenario}_{rank}"), "w") as fh:
                fh.write("ok\n")
        except Exception as exc:  # noqa: BLE001 - the dump is the point
            failed = 1
            rec.snapshot(f"failure {type(exc).__name__}")
            print(f"rank {rank} {scenario}: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
        dist.barrier()
    return failed


if __name__ == "__main__":
    sys.exit(main())
