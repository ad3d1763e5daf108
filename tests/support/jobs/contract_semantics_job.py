"""A real 4-rank gloo job whose ranks' Flight Recorder entries legitimately differ, then one that
really diverges: for `gpu-doctor contract`'s collective semantics (issue 17).

Run under torchrun. Two scenarios, one launch (each launch costs seconds of `import torch`), each
on its own process groups created up front:
  ok   gather to root 0, scatter from root 1, all_to_all_single with uneven splits (rank r sends
       r+1 elements to every rank), two disjoint groups that share one name ("9", as
       `split_group` names them; gloo has no split_group, so they are made the way it makes
       them: one name, a store prefix per group) all-reducing 8 and 6 elements, and send/recv
       0->1 plus a batched ring exchange, then rank 2 sends 4 elements to a recv of 5 on rank 3
       (gloo records no point-to-point calls in its Flight Recorder and completes this silently);
  bad  rank 2 gathers 5 elements where the others gather 4 (gloo aborts the root; every rank
       snapshots right after enqueueing, rank 2 last, so the dumps show it).
Outputs under `--out`: <scenario>/{fr_pickle/rank_<r>, fr_json/rank_<r>.json}, ok/fr_active/rank_<r>.json
(PyTorch's own onlyActive JSON, unfiltered, written after everything completed), done_<scenario>_<r>.
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
from torch.distributed import distributed_c10d as c10d_py


def _write_atomic(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def snapshot(out: str, scenario: str, rank: int, names: set[str]) -> None:
    """This scenario's entries only (our own dump: plain pickle is fine here)."""
    c10d = torch._C._distributed_c10d
    raw = pickle.loads(c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False))
    js = json.loads(c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    for doc in (raw, js):
        doc["entries"] = [e for e in doc.get("entries", []) if str(e["process_group"][0]) in names]
        if not doc["entries"] and doc is js:
            del doc["entries"]  # as PyTorch's JSON writer does for an empty list
    base = os.path.join(out, scenario)
    _write_atomic(os.path.join(base, "fr_pickle", f"rank_{rank}"), pickle.dumps(raw, protocol=2))
    _write_atomic(os.path.join(base, "fr_json", f"rank_{rank}.json"), json.dumps(js).encode())


def same_named_halves(rank: int, timeout: timedelta) -> dist.ProcessGroup:
    half = [0, 1] if rank < 2 else [2, 3]
    store = dist.PrefixStore(f"split{half[0]}/", c10d_py._get_default_store())
    pg, _ = c10d_py._new_process_group_helper(
        2, half.index(rank), half, "gloo", store, group_name="9", timeout=timeout, group_desc="half"
    )
    c10d_py._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(half)}
    c10d_py._world.pg_names[pg] = "9"
    return pg


def ok(rank: int, world: int, g: dist.ProcessGroup, half: dist.ProcessGroup) -> None:
    outs = [torch.zeros(4) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((4,), float(rank)), outs, dst=0, group=g)
    ins = [torch.ones(3) for _ in range(world)] if rank == 1 else None
    dist.scatter(torch.zeros(3), ins, src=1, group=g)
    in_split = [rank + 1] * world  # uneven: rank r sends r+1 to everyone
    out_split = [i + 1 for i in range(world)]
    dist.all_to_all_single(torch.zeros(sum(out_split)), torch.ones(sum(in_split)), out_split, in_split, group=g)
    dist.all_reduce(torch.ones(8 if rank < 2 else 6), group=half)
    if rank == 0:
        dist.send(torch.ones(4), 1, group=g)
    elif rank == 1:
        dist.recv(torch.zeros(4), 0, group=g)
    ops = [
        dist.P2POp(dist.isend, torch.ones(3), (rank + 1) % world, group=g),
        dist.P2POp(dist.irecv, torch.zeros(3), (rank - 1) % world, group=g),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if rank == 2:  # the planted p2p mismatch: 4 sent, 5 expected
        dist.send(torch.ones(4), 3, group=g)
    elif rank == 3:
        dist.recv(torch.zeros(5), 2, group=g)
    dist.barrier(group=g)


def bad(rank: int, world: int, g: dist.ProcessGroup, out: str, names: set[str]) -> None:
    outs = [torch.zeros(4) for _ in range(world)] if rank == 0 else None
    if rank == 2:
        time.sleep(0.5)  # the others enqueue and snapshot first: rank 2's bad size makes gloo abort the root
    work = dist.gather(torch.ones(5 if rank == 2 else 4), outs, dst=0, group=g, async_op=True)
    snapshot(out, "bad", rank, names)
    work.wait()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 4:
        print("contract_semantics_job needs 4 ranks", file=sys.stderr)
        return 2
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # barriers between scenarios
    short = timedelta(seconds=args.timeout)
    g_ok = dist.new_group(list(range(world)), timeout=short, group_desc="sem")
    g_bad = dist.new_group(list(range(world)), timeout=short, group_desc="sem_bad")
    half = same_named_halves(rank, short)
    names_ok = {c10d_py._get_process_group_name(g_ok), "9"}
    names_bad = {c10d_py._get_process_group_name(g_bad)}
    failed = 0
    try:
        ok(rank, world, g_ok, half)
        snapshot(args.out, "ok", rank, names_ok)
        time.sleep(0.3)  # let gloo mark the last entries completed, then the onlyActive dump as written
        active = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=True)
        _write_atomic(os.path.join(args.out, "ok", "fr_active", f"rank_{rank}.json"), active)
        with open(os.path.join(args.out, f"done_ok_{rank}"), "w") as fh:
            fh.write("ok\n")
    except Exception as exc:  # noqa: BLE001 - the dump is the point
        failed = 1
        snapshot(args.out, "ok", rank, names_ok)
        print(f"rank {rank} ok: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
    dist.barrier()
    try:
        bad(rank, world, g_bad, args.out, names_bad)
    except Exception as exc:  # noqa: BLE001
        failed = 1
        print(f"rank {rank} bad: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
    with open(os.path.join(args.out, f"done_bad_{rank}"), "w") as fh:
        fh.write("ok\n")
    return failed


if __name__ == "__main__":
    sys.exit(main())
