"""Step-time overhead of collective sharded snapshots on a real FSDP2 job (torchrun, gloo, CPU).

    python bench/sharded.py [--json] [--workers 2] [--rounds 4] [--block 10] [--every 1]
                            [--gpu-ms 100] [--hidden 1024] [--replicated] [--restore-workers N] [--nice 0]
                            [--runtime [--runtime-only] [--budget B]] [--restore-only]

One torchrun job of `--workers` ranks trains an MLP (16 -> hidden -> hidden -> 16, every Linear and
the root `fully_shard`ed, AdamW; with --replicated the same MLP replicated under torch's
`DistributedDataParallel`). Each step is the real forward/backward/update plus `--gpu-ms` of
sleep, the stand-in for device time during which a GPU job's CPU is idle (0 makes every step pure
CPU: the snapshot thread then competes with training for the cores). Three modes run in the same
processes, interleaved in blocks of `--block` steps for `--rounds` rounds, so drift and load hit
them alike:

* `plain`: FSDP2 training, no snapshots (the baseline of the ratios);
* `sharded`: `recovery.snapshots.sharded.ShardedSnapshotter.submit` every `--every` steps (stage a
  copy, then the collective DCP save, each rank's part, the coordinator's manifest and rename, in
  the background thread over its own gloo group). A submit waits for the previous snapshot, so a
  writer slower than the interval shows in the step times; the wait for the block's last snapshot
  (which in steady state overlaps the next step) is not charged and is reported on its own;
* `dcp-sync`: `dcp.save(get_state_dict(...))` on the training thread every `--every` steps, the
  plain synchronous DCP baseline (no manifest, no parts, no publication).

Per mode: the median over blocks of the mean step time, the ratio to `plain` from the same run,
and for `sharded` the writer thread's CPU time per snapshot (rank 0), the time the training thread
waited for the previous snapshot, the median submit (get_state_dict, staging copy, hand-over: the
part the training thread pays in any case), the uncharged end-of-block flush, and bytes written per snapshot
against the state's size.
With --runtime, a third job measures the runtime itself: the same loop under
`Runtime(sharded=True)`, blocks of the bare loop, `rt.commit` without snapshots and `rt.commit`
with its collective sharded snapshot (`runtime-*` rows) at the runtime's default interval:
adaptive, a snapshot's CPU (the coordinator's staging + writer) at most `--budget` (default
0.03) of the median step, never more often than every `--every` steps; `--budget 0`: every
`--every` steps. `--runtime-only` runs only that job.
`--restore-only`: only the restore figures: a short job of `--workers` ranks saves one sharded
snapshot (3 steps of training first, so AdamW has state), then `--restore-workers` ranks restore it
(select, plan, load resharded, check, apply), e.g. 4 -> 3 or 8 -> 6.
Speed is never asserted in tests; this is the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from gpuguard.recovery.snapshots.sharded_writer import DEFAULT_BUDGET  # noqa: E402 - no torch at import

MODES = ("plain", "sharded", "sharded-memdigest", "dcp-sync")


def build(hidden: int, replicated: bool = False):  # noqa: ANN201 - torch types, imported lazily
    """The MLP sharded with FSDP2 (every Linear, then the root), or replicated under DDP. Needs the group."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    h = hidden
    model = torch.nn.Sequential(
        torch.nn.Linear(16, h), torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 16)
    )
    if replicated:
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def restore_worker(a: argparse.Namespace) -> int:
    """Restart path at another world size: select (re-hash every digest, every part), plan, load
    (DCP reshards), check (loaded vs stored digests), each timed; rank 0 writes the figures."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gpuguard.generation.ownership import plan_reshard
    from gpuguard.recovery.snapshots import digests, parts
    from gpuguard.recovery.snapshots import sharded as ss

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model, opt = build(a.hidden, a.replicated)
    t0 = time.perf_counter()
    sel = parts.select_sharded(a.job_dir)
    t1s = time.perf_counter()
    dist.barrier()  # the ranks' skew (select, start-up) apart from the plan's own collective
    t1 = time.perf_counter()
    assert sel.chosen is not None, sel.rejected
    live = ss.model_state(model, opt, extra={"step": torch.tensor(-1)})  # DCP initialises AdamW's state
    tp = time.perf_counter()
    old = parts.snapshot_layout(sel.chosen.path)
    new = ss.current_layout(live, old.version + 1)  # collective: every rank's chunk list
    plan = plan_reshard(old, new)
    t2 = time.perf_counter()
    loaded = ss.load_sharded(sel.chosen, live, check=False)
    t3 = time.perf_counter()
    same = digests.state_digest_sharded(loaded) == digests.stored_digest_sharded(sel.chosen.path)
    t4 = time.perf_counter()
    ss.apply_model_state(model, opt, loaded)
    dist.barrier()
    t5 = time.perf_counter()
    if dist.get_rank() == 0:
        doc = {
            "from_world": old.world_size,
            "to_world": new.world_size,
            "select_s": t1s - t0,
            "skew_s": t1 - t1s,
            "state_dict_s": tp - t1,
            "plan_s": t2 - tp,
            "load_s": t3 - t2,
            "check_s": t4 - t3,
            "apply_s": t5 - t4,
            "digests_equal": same,
            "chunk_reads": len(plan),
        }
        Path(a.out).write_text(json.dumps(doc))
    dist.destroy_process_group()
    return 0


def save_worker(a: argparse.Namespace) -> int:
    """`--restore-only`'s first job: 3 steps of training, one collective sharded snapshot, exit."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gpuguard.recovery.snapshots import sharded as ss

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model, opt = build(a.hidden, a.replicated)
    for step in range(3):
        train_step(model, opt, step, a)
    state = ss.model_state(model, opt, extra={"step": torch.tensor(3)})
    group = ss.new_snapshot_group(60.0)
    info = ss.save_sharded(Path(a.job_dir), 3, state, group=group, generation=0, incarnation="bench")
    dist.barrier()
    if dist.get_rank() == 0:
        Path(a.out).write_text(
            json.dumps({"world": dist.get_world_size(), "bytes": info.bytes_written if info else None})
        )
    dist.destroy_process_group()
    return 0


def train_step(model, opt, step: int, a: argparse.Namespace) -> None:  # noqa: ANN001 - torch types
    """One step: forward/backward (FSDP2's reduce-scatter or DDP's all-reduce)/update, then `--gpu-ms` of sleep."""
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    torch.nn.functional.mse_loss(model(x), x).backward()
    opt.step()
    opt.zero_grad()
    if a.gpu_ms:
        time.sleep(a.gpu_ms / 1000)


RUNTIME_MODES = ("plain", "runtime-commit", "runtime-sharded")


def runtime_worker(a: argparse.Namespace) -> int:
    """The runtime's own overhead: `Runtime(sharded=True)`'s commit (step + commit records) with and
    without its sharded snapshot every `--every` steps, against the bare loop, interleaved blocks."""
    import torch.distributed as dist

    from gpuguard.recovery.runtime.runtime import Runtime

    rt = Runtime.from_env(a.job_dir, sharded=True, snapshot_every=a.every, snapshot_budget=a.budget, checkpoint_every=0)
    state = rt.activate(build=lambda: build(a.hidden, a.replicated))
    model, opt, step = state.model, state.optimizer, state.start_step
    for _ in range(3):  # warm-up, snapshots included
        train_step(model, opt, step, a)
        rt.commit(step)
        step += 1
    rt.flush_snapshots(120)
    times: dict[str, list[float]] = {m: [] for m in RUNTIME_MODES}
    commits: list[float] = []
    cpu0 = rt.counters.snapshot_cpu_s
    snaps0 = rt.counters.snapshots
    for _ in range(a.rounds):
        for mode in RUNTIME_MODES:
            rt.snapshot_every = a.every if mode == "runtime-sharded" else 0
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.block):
                train_step(model, opt, step, a)
                if mode != "plain":
                    t1 = time.perf_counter()
                    rt.commit(step)
                    if mode == "runtime-sharded":
                        commits.append(time.perf_counter() - t1)
                step += 1
            times[mode].append((time.perf_counter() - t0) / a.block)
            rt.flush_snapshots(120)  # the block's last snapshot overlaps the next step in steady state
            dist.barrier()
    snaps = rt.counters.snapshots - snaps0
    doc = {
        "steps_per_snapshot": a.rounds * a.block / max(1, snaps),
        "times": times,
        "world": rt.world_size,
        "snapshots_rank0": snaps,
        "errors": rt.counters.snapshot_errors,
        "writer_cpu_s_per_snapshot_rank0": (rt.counters.snapshot_cpu_s - cpu0) / max(1, snaps),
        "commit_s_median_rank0": statistics.median(commits) if commits else 0.0,
    }
    rank = rt.rank
    rt.close()
    if rank == 0:
        Path(a.out).write_text(json.dumps(doc))
    return 0


def worker(a: argparse.Namespace) -> int:
    import uuid
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gpuguard.recovery.snapshots import sharded as ss
    from gpuguard.recovery.snapshots import sharded_writer, store
    from gpuguard.recovery.snapshots.store import prune

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(a.hidden, a.replicated)
    job = Path(a.job_dir)
    snapper = sharded_writer.ShardedSnapshotter(job, generation=0, incarnation=uuid.uuid4().hex[:12], nice=a.nice)
    snappers = {
        "sharded": snapper,
        "sharded-memdigest": sharded_writer.ShardedSnapshotter(
            job, generation=0, incarnation=uuid.uuid4().hex[:12], memory_digest=True, nice=a.nice
        ),
    }
    sync_dir = job / "dcp-sync"
    step = 0

    def train() -> None:
        nonlocal step
        train_step(model, opt, step, a)
        step += 1

    for _ in range(3):  # warm-up: allocator, first optimizer state, gloo connections
        train()
    warm = ss.model_state(model, opt, extra={"step": torch.tensor(step)})
    ss.save_sharded(job, step, warm, group=snapper.group, generation=0, incarnation="warm")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    snaps = 0
    flush_s: list[float] = []
    submit_s: list[float] = []  # get_state_dict + stage + hand-over, on the training thread
    for _ in range(a.rounds):
        for mode in MODES:
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(a.block):
                train()
                if mode in snappers and i % a.every == 0:
                    t1 = time.perf_counter()
                    snappers[mode].submit(step, ss.model_state(model, opt, extra={"step": torch.tensor(step)}))
                    if mode == "sharded":
                        submit_s.append(time.perf_counter() - t1)
                        snaps += 1
                elif mode == "dcp-sync" and i % a.every == 0:
                    store.quiet_dcp(
                        lambda: dcp.save(ss.model_state(model, opt), checkpoint_id=str(sync_dir / f"step-{step}"))
                    )
            times[mode].append((time.perf_counter() - t0) / a.block)
            if mode in snappers:  # the last snapshot overlaps the next step in steady state: not charged
                t1 = time.perf_counter()
                snappers[mode].flush(120)
                if mode == "sharded":
                    flush_s.append(time.perf_counter() - t1)
            dist.barrier()
            if rank == 0:  # keep the disk small: outside the timed block
                prune(job, 2)
                shutil.rmtree(sync_dir, ignore_errors=True)
            dist.barrier()
    for sn in snappers.values():
        sn.close(60)
    state_bytes = sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
        for t in _tensors(ss.model_state(model, opt))
    )
    sizes: list[int] = [0] * world
    dist.all_gather_object(sizes, state_bytes)
    if rank == 0:
        last = snapper.last
        doc = {
            "times": times,
            "world": world,
            "snapshots": snaps,
            "errors": sum(sn.errors for sn in snappers.values()),
            "writer_cpu_s_per_snapshot_rank0": snapper.cpu_s / max(1, snapper.written),
            "wait_s_per_snapshot_rank0": snapper.wait_s / max(1, snaps),
            "flush_s_per_block_rank0": statistics.median(flush_s) if flush_s else 0.0,
            "submit_s_median_rank0": statistics.median(submit_s) if submit_s else 0.0,
            "bytes_per_snapshot": last.bytes_written if last else None,
            "state_bytes": sum(sizes),
        }
        Path(a.out).write_text(json.dumps(doc))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _tensors(value: object) -> list:
    import torch

    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return [value] if isinstance(value, torch.Tensor) else []


def _torchrun(a: argparse.Namespace, workers: int, args: list[str], tmp: Path) -> dict:
    """Run this file under torchrun (`workers` ranks, job dir `tmp/job`) and return rank 0's figures."""
    out = tmp / f"result-{args[0].lstrip('-')}.json"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={workers}",
        "--max-restarts=0",
        __file__,
        *args,
        f"--job-dir={tmp / 'job'}",
        f"--out={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "LOGLEVEL": "ERROR"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        log, _ = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"the {args[0]} job did not finish in {a.timeout:.0f} s") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the {args[0]} job failed ({proc.returncode}):\n{log[-2000:]}")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the gpuguard.bench/1 document")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--gpu-ms", type=float, default=100.0)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=500.0)
    ap.add_argument("--nice", type=int, default=0, help="the writer thread's nice value (ShardedSnapshotter nice=)")
    ap.add_argument("--replicated", action="store_true", help="a replicated (DDP-style) model instead of FSDP2")
    ap.add_argument(
        "--restore-workers", type=int, default=None, help="restore at this world size (default workers - 1)"
    )
    ap.add_argument(
        "--runtime",
        action="store_true",
        help="also measure the runtime's own overhead: Runtime(sharded=True) commits with and without snapshots",
    )
    ap.add_argument("--runtime-only", action="store_true", help="only the runtime job (implies --runtime)")
    ap.add_argument(
        "--restore-only", action="store_true", help="only the restore: save at --workers, restore at --restore-workers"
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET,
        help="the runtime's snapshot budget (fraction of step time; 0: every --every steps)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--runtime-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--restore-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.restore_worker:
        return restore_worker(a)
    if a.save_worker:
        return save_worker(a)
    if a.runtime_worker:
        return runtime_worker(a)
    tmp = Path(tempfile.mkdtemp(prefix="gpuguard-bench-sharded-"))
    try:
        shape = ("rounds", "block", "every", "gpu-ms", "hidden", "nice")
        kind = ["--replicated"] if a.replicated else []
        doc = rest = None
        back = a.restore_workers or max(1, a.workers - 1)
        if a.restore_only:
            saved = _torchrun(a, a.workers, ["--save-worker", *kind, f"--hidden={a.hidden}"], tmp)
            t0 = time.perf_counter()
            rest = _torchrun(a, back, ["--restore-worker", *kind, f"--hidden={a.hidden}"], tmp)
            rest["job_s"], rest["bytes"] = time.perf_counter() - t0, saved["bytes"]
        elif not a.runtime_only:
            doc = _torchrun(
                a, a.workers, ["--worker", *kind, *(f"--{k}={getattr(a, k.replace('-', '_'))}" for k in shape)], tmp
            )
            rest = _torchrun(a, back, ["--restore-worker", *kind, f"--hidden={a.hidden}"], tmp)
        shape_args = [*kind, *(f"--{k}={getattr(a, k.replace('-', '_'))}" for k in (*shape, "budget"))]
        rt_doc = None
        if (
            a.runtime or a.runtime_only
        ) and not a.restore_only:  # a job dir of its own: a fresh ledger, no snapshots of the runs above
            (tmp / "rt").mkdir()
            rt_doc = _torchrun(a, a.workers, ["--runtime-worker", *shape_args], tmp / "rt")
    except RuntimeError as exc:
        print(f"bench/sharded.py: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows: list[dict] = []
    notes: list[str] = [
        f"{a.workers} gloo workers on {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"
    ]
    if doc is not None:
        base = statistics.median(doc["times"]["plain"])
        for mode in MODES:
            med = statistics.median(doc["times"][mode])
            row = {
                "mode": mode,
                "model": "replicated" if a.replicated else "fsdp2",
                "workers": doc["world"],
                "gpu_ms": a.gpu_ms,
                "every": a.every,
                "writer_nice": a.nice,
                "step_ms_median": round(med * 1000, 2),
                "step_ms_blocks": [round(t * 1000, 2) for t in doc["times"][mode]],
                "ratio_vs_plain": round(med / base, 4),
            }
            if mode == "sharded-memdigest":
                row["note"] = "with the in-memory state digest (memory_digest=True)"
            if mode == "sharded":
                row["writer_cpu_ms_per_snapshot_rank0"] = round(doc["writer_cpu_s_per_snapshot_rank0"] * 1000, 2)
                row["wait_ms_per_snapshot_rank0"] = round(doc["wait_s_per_snapshot_rank0"] * 1000, 2)
                row["submit_ms_median_rank0"] = round(doc["submit_s_median_rank0"] * 1000, 2)
                row["uncharged_flush_ms_per_block_rank0"] = round(doc["flush_s_per_block_rank0"] * 1000, 2)
                row["bytes_per_snapshot"] = doc["bytes_per_snapshot"]
                row["state_bytes"] = doc["state_bytes"]
                row["snapshot_errors"] = doc["errors"]
            rows.append(row)
        notes += [
            "ratio_vs_plain: median block step time / plain's, same processes, interleaved blocks",
            "bytes_per_snapshot: all members' .distcp files; state_bytes: model + optimizer tensors of all ranks",
        ]
    if rest is not None:
        restore_row = {
            "mode": f"restore {rest['from_world']}->{rest['to_world']}",
            "model": "replicated" if a.replicated else "fsdp2",
            "workers": rest["to_world"],
            "select_ms": round(rest["select_s"] * 1000, 1),
            "wait_for_slowest_ms": round(rest.get("skew_s", 0.0) * 1000, 1),
            "state_dict_ms": round(rest["state_dict_s"] * 1000, 1),
            "plan_ms": round(rest["plan_s"] * 1000, 1),
            "load_ms": round(rest["load_s"] * 1000, 1),
            "check_ms": round(rest["check_s"] * 1000, 1),
            "apply_ms": round(rest["apply_s"] * 1000, 1),
            "restore_ms": round(
                sum(rest[k] for k in ("select_s", "state_dict_s", "plan_s", "load_s", "check_s", "apply_s")) * 1000, 1
            ),
            "digests_equal": rest["digests_equal"],
            "chunk_reads": rest["chunk_reads"],
        }
        # the baseline in the same run: a plain DCP restore (get_state_dict, dcp.load, set_state_dict),
        # without gpuguard's selection, plan and check
        plain_ms = sum(restore_row[k] for k in ("state_dict_ms", "load_ms", "apply_ms"))
        restore_row["plain_dcp_restore_ms"] = round(plain_ms, 1)
        restore_row["ratio_vs_plain_dcp_restore"] = round(restore_row["restore_ms"] / max(0.1, plain_ms), 3)
        if "job_s" in rest:  # --restore-only: the restoring torchrun job end to end (start-up, imports, group)
            restore_row["restore_job_s"] = round(rest["job_s"], 2)
            restore_row["snapshot_bytes"] = rest["bytes"]
        rows.append(restore_row)
        notes.append(
            "restore: select = every manifest digest re-hashed and every part read (by every rank), wait_for_slowest = a "
            "barrier after it (the ranks' skew, not in restore_ms), state_dict = get_state_dict of the new model and "
            "optimizer (DCP initialises AdamW's state: any DCP restore pays it), plan = snapshot and live layouts "
            "(a collective) and plan_reshard, load = dcp.load resharding, "
            "check = loaded vs stored layout-independent digests (collective), apply = set_state_dict"
        )
    if rt_doc is not None:
        rt_base = statistics.median(rt_doc["times"]["plain"])
        for mode in RUNTIME_MODES[1:]:
            med = statistics.median(rt_doc["times"][mode])
            row = {
                "mode": mode,
                "model": "replicated" if a.replicated else "fsdp2",
                "workers": rt_doc["world"],
                "gpu_ms": a.gpu_ms,
                "every": a.every if mode == "runtime-sharded" else 0,
                "budget": a.budget if mode == "runtime-sharded" else 0,
                "step_ms_median": round(med * 1000, 2),
                "step_ms_blocks": [round(t * 1000, 2) for t in rt_doc["times"][mode]],
                "plain_step_ms_median": round(rt_base * 1000, 2),
                "ratio_vs_plain": round(med / rt_base, 4),
            }
            if mode == "runtime-sharded":
                row["commit_ms_median_rank0"] = round(rt_doc["commit_s_median_rank0"] * 1000, 2)
                row["writer_cpu_ms_per_snapshot_rank0"] = round(rt_doc["writer_cpu_s_per_snapshot_rank0"] * 1000, 2)
                row["snapshot_errors"] = rt_doc["errors"]
                row["steps_per_snapshot"] = round(rt_doc["steps_per_snapshot"], 2)
                row["writer_cpu_share_of_step"] = round(
                    rt_doc["writer_cpu_s_per_snapshot_rank0"] / rt_doc["steps_per_snapshot"] / rt_base, 4
                )
            rows.append(row)
        notes.append(
            "runtime-*: the same loop under Runtime(sharded=True) (activation, lease-free file ledger): rt.commit per "
            "step (step and commit records) without (runtime-commit) and with (runtime-sharded) its collective sharded "
            "snapshot (runtime-sharded: at the runtime's interval, --budget of the step for its CPU, 0: every --every "
            "steps; steps_per_snapshot measured); ratio against the bare loop in the same processes (plain_step_ms_median)"
        )
    emit("sharded", rows, a.json, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
