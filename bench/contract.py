"""Benchmark: time to verdict and peak memory of `gpu-doctor contract` versus PyTorch's
`torchfrtrace`, on the same synthetic Flight Recorder dumps with one planted divergence.

Dumps: FR format 2.10 pickles, nccl-style (`nccl:` prefixes, a proper `pg_config`, which is what
`torchfrtrace` accepts; it crashes on raw gloo dumps), one per rank, 2,000 entries each (the FR
default buffer), seqs 48,001..50,000, a realistic mix of collectives with shared frame dicts like
the C++ writer emits. The planted divergence: one rank all-reduces half the elements at the last
sequence id (the hang). Both tools run as subprocesses with a time limit; peak memory is the
sampled RSS of the whole process tree (gpu-doctor reads dumps with a small process pool).
Also measures `CollectiveTrace.record` in ns per call.

    python bench/contract.py [--json] [--ranks 1024] [--entries 2000] [--small-ranks 64] [--limit 300]
                             [--no-baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, wants_json  # noqa: E402

BIN = Path(sys.executable).parent
FIRST_SEQ = 48_001
FRAMES = {
    name: [
        {
            "name": "all_reduce" if "reduce" in name else name,
            "filename": "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
            "line": 3245,
        },
        {
            "name": "wrapper",
            "filename": "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py",
            "line": 83,
        },
        {"name": fn, "filename": "/job/train.py", "line": line},
    ]
    for name, fn, line in (
        ("all_gather_into_tensor", "fsdp_unshard", 120),
        ("reduce_scatter_tensor", "fsdp_reshard", 141),
        ("all_reduce", "clip_grad_norm", 207),
        ("broadcast", "sync_rng", 33),
    )
}
# (profiling name, frames key, input numel, output numel as a multiple of the world size or 1)
PATTERN = (
    ("_all_gather_base", "all_gather_into_tensor", 4096, "world"),
    ("_reduce_scatter_base", "reduce_scatter_tensor", 4096, "shard"),
    ("all_reduce", "all_reduce", 1024, None),
    ("broadcast", "broadcast", 2, None),
)


def make_entries(n: int, rank: int, world: int) -> list[dict]:
    """One rank's FR entries (2.10 layout); frame dicts are shared, frame lists are not (like the C++ writer)."""
    entries = []
    t0 = 1_795_000_000_000_000_000 + rank * 1_000
    pg = ("0", "default_pg")
    shift = (2 - (n - 1)) % len(PATTERN)  # the last entry (the hang) is an all_reduce
    for i in range(n):
        seq = FIRST_SEQ + i
        op, fname, numel, kind = PATTERN[(i + shift) % len(PATTERN)]
        insz = [[numel * world]] if kind == "shard" else [[numel]]
        outsz = [[numel * world]] if kind == "world" else [[numel]]
        last = i == n - 1
        entries.append(
            {
                "record_id": seq - 1,
                "pg_id": 0,
                "process_group": pg,
                "thread_name": "python",
                "thread_id": "1",
                "collective_seq_id": seq,
                "p2p_seq_id": 0,
                "op_id": seq,
                "profiling_name": f"nccl:{op}",
                "time_created_ns": t0 + i * 1_000_000,
                "input_sizes": insz,
                "input_dtypes": ["BFloat16"],
                "output_sizes": outsz,
                "output_dtypes": ["BFloat16"],
                "state": "started" if last else "completed",
                "time_discovered_started_ns": t0 + i * 1_000_000 + 10,
                "time_discovered_completed_ns": None if last else t0 + i * 1_000_000 + 900_000,
                "retired": not last,
                "timeout_ms": 600_000,
                "is_p2p": False,
                "frames": list(FRAMES[fname]),
            }
        )  # a new list of shared frame dicts, as the C++ writer emits
    return entries


def write_dumps(root: Path, world: int, n: int, culprit: int) -> int:
    """Write `world` dumps; the culprit's last all_reduce has half the elements. Returns the bad seq."""
    root.mkdir(parents=True, exist_ok=True)
    base = make_entries(n, 0, world)
    bad_seq = base[-1]["collective_seq_id"]
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}}
    for rank in range(world):
        for e in base:
            e["time_created_ns"] += 1_000 if rank else 0
        entries = base
        if rank == culprit:
            entries = base[:-1] + [dict(base[-1], input_sizes=[[512]], output_sizes=[[512]])]
        doc = {
            "version": "2.10",
            "pg_config": cfg,
            "comm_lib_version": "2.27.3",
            "pg_status": {
                "0": {
                    "last_enqueued_collective": bad_seq,
                    "last_started_collective": bad_seq,
                    "last_completed_collective": bad_seq - 1,
                }
            },
            "entries": entries,
        }
        (root / f"rank_{rank}").write_bytes(pickle.dumps(doc, protocol=2))
    return bad_seq


def run_measured(cmd: list[str], limit: float) -> tuple[float, float, int | None, str, float]:
    """Run `cmd`; return (seconds, peak MB of the process tree, returncode or None on timeout, stdout,
    CPU seconds of the whole tree: robust when other work shares the machine)."""
    import resource

    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)

    out = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    peak = 0
    ps = psutil.Process(proc.pid)
    rc: int | None = None
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                pass
            if time.perf_counter() - t0 > limit:
                break
            try:
                rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
                peak = max(peak, rss)
            except psutil.Error:
                pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    seconds = time.perf_counter() - t0
    out.seek(0)
    text = out.read().decode(errors="replace")
    out.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, peak / 2**20, rc, text, cpu


def bench_gpuguard(root: Path, world: int, n: int, bad_seq: int, culprit: int, limit: float) -> dict:
    secs, peak, rc, text, cpu = run_measured([str(BIN / "gpu-doctor"), "contract", str(root), "--json"], limit)
    found = False
    if rc in (0, 1):
        d = json.loads(text).get("first_divergence") or {}
        found = d.get("seq") == bad_seq and d.get("ranks") == [culprit] and d.get("kind") == "size_mismatch"
    return {
        "method": "gpu-doctor contract",
        "ranks": world,
        "entries": n,
        "seconds": round(secs, 3),
        "peak_mb": round(peak, 1),
        "found": found,
        "cpu_s": round(cpu, 2),
        "status": f"exit {rc}" if rc is not None else "timeout",
    }


def bench_torchfrtrace(root: Path, world: int, n: int, bad_seq: int, culprit: int, limit: float) -> dict:
    exe = BIN / "torchfrtrace"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    secs, peak, rc, text, cpu = run_measured(cmd + [str(root), "-p", "rank_"], limit)
    found = (f"sequence number: {bad_seq}" in text) and (f"Culprit rank {culprit};" in text)
    if rc is None:
        status = f"timeout after {limit:.0f} s"
    elif rc != 0:
        last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [""]
        status = f"crashed (exit {rc}): {last[0][:100]}"
    else:
        status = "exit 0"
    return {
        "method": "torchfrtrace",
        "ranks": world,
        "entries": n,
        "seconds": round(secs, 3) if rc is not None else None,
        "peak_mb": round(peak, 1),
        "found": found,
        "cpu_s": round(cpu, 2),
        "status": status,
    }


def bench_record(calls: int = 1_000_000, persist: str | None = None) -> dict:
    from gpuguard.foundation.collective_trace import CollectiveTrace

    t = CollectiveTrace(rank=0, generation=0, capacity=2000, persist=persist)
    rec = t.record
    t0 = time.perf_counter_ns()
    for i in range(calls):
        rec("all_reduce", "default", i, 1024, "bfloat16", "sum", "train.py:207")
    elapsed = time.perf_counter_ns() - t0
    name = "CollectiveTrace.record" + (" (persist=mmap ring)" if persist else "")
    return {
        "method": name,
        "ranks": 1,
        "entries": calls,
        "seconds": round(elapsed / 1e9, 3),
        "peak_mb": None,
        "found": None,
        "status": f"{elapsed / calls:.0f} ns per record",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--small-ranks", type=int, default=64, help="also compare at this scale (0: skip)")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds allowed to each tool per run")
    ap.add_argument("--no-baseline", action="store_true", help="skip torchfrtrace")
    args = ap.parse_args()
    results = []
    notes = []
    root = Path(tempfile.mkdtemp(prefix="gg-bench-contract-"))
    try:
        scales = [w for w in (args.small_ranks, args.ranks) if w]
        for world in scales:
            culprit = world // 2 + 5 if world > 10 else world - 1
            d = root / f"w{world}"
            t0 = time.perf_counter()
            bad_seq = write_dumps(d, world, args.entries, culprit)
            notes.append(
                f"{world} ranks: wrote {world} dumps ({sum(f.stat().st_size for f in d.iterdir()) / 2**20:.0f}"
                f" MiB) in {time.perf_counter() - t0:.1f} s; planted size mismatch on rank {culprit} at "
                f"seq {bad_seq}"
            )
            results.append(bench_gpuguard(d, world, args.entries, bad_seq, culprit, args.limit))
            if not args.no_baseline:
                results.append(bench_torchfrtrace(d, world, args.entries, bad_seq, culprit, args.limit))
                g, f = results[-2], results[-1]
                if g["seconds"] and f["seconds"] and f["status"] == "exit 0":
                    notes.append(
                        f"{world} ranks: torchfrtrace / gpu-doctor: {f['seconds'] / g['seconds']:.1f}x wall "
                        f"time, {f['cpu_s'] / max(g['cpu_s'], 1e-9):.1f}x CPU time"
                    )
            shutil.rmtree(d, ignore_errors=True)
        results.append(bench_record())
        results.append(bench_record(persist=str(root / "rank_0.ring")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    notes.append(
        "peak_mb: sampled RSS (50 ms) of the tool's whole process tree; torchfrtrace unpickles the dumps "
        "unrestricted, gpu-doctor with a restricted unpickler"
    )
    emit("contract", results, args.json or wants_json(), notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
