"""A real torchrun/gloo job for the contract tests: run once per pytest process, shared by modules.

One 4-rank launch runs three scenarios in turn (clean; rank 2 skips a collective; rank 3's size
mismatch, which gloo answers with SIGABRT) and leaves Flight Recorder pickle + JSON dumps and
gpuguard collective traces per rank and scenario (~15 s on 2 cores, mostly `import torch`). The
job's process group is killed in a `finally`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = HERE / "jobs" / "contract_job.py"
SCENARIOS = ("clean", "size", "skip")
_cache: dict[str, Path] = {}


def real_dumps(timeout: float = 150.0) -> dict[str, Path]:
    """{scenario: dir with fr_pickle/, fr_json/, gg/} plus "all" (whole FR buffers), from ONE real
    4-rank torchrun job that runs the three scenarios in turn (cached per pytest process)."""
    if _cache:
        return dict(_cache)
    root = Path(tempfile.mkdtemp(prefix="gg-contract-"))
    atexit.register(shutil.rmtree, root, True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log_path = root / "job.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=1",
                "--nproc-per-node=4",
                "--max-restarts=0",
                "--standalone",  # c10d on port 0: no window for another process to take a chosen port
                str(JOB),
                "--out",
                str(root),
                "--timeout",
                "4",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
    for name in SCENARIOS:
        for sub in ("fr_pickle", "fr_json", "gg", "gg_ring"):
            d = root / name / sub
            # a rank killed mid-snapshot may leave a temp file: count the dumps themselves
            if not d.is_dir() or len(list(d.glob("rank_*[0-9]*"))) - len(list(d.glob("*.tmp"))) != 4:
                log = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"job left no complete {name}/{sub} dumps (rc={proc.returncode}):\n{log}")
        _cache[name] = root / name
    _cache["all"] = root / "all"
    _cache["root"] = root
    return dict(_cache)


SEMANTICS_JOB = HERE / "jobs" / "contract_semantics_job.py"
_sem_cache: dict[str, Path] = {}


def semantics_dumps(timeout: float = 90.0) -> dict[str, Path]:
    """{"ok": dir, "bad": dir, "root": dir}, each scenario dir with fr_pickle/ and fr_json/, from ONE
    real 4-rank gloo torchrun job of gather, scatter, uneven all_to_all_single, same-named disjoint
    groups and send/recv (ok), then a non-root's wrong gather size (bad). ~10 s on 2 cores; cached
    per pytest process; the job's process group is killed in a `finally`."""
    if _sem_cache:
        return dict(_sem_cache)
    # the planted mismatch ends in a gloo abort: on a crowded machine a rank can be aborted before
    # its dumps are out (seen once in CI: SIGABRT of rank 3). Run the job again once, then give up.
    for attempt in (1, 2):
        try:
            return _run_semantics_job(timeout)
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_semantics_job(timeout: float) -> dict[str, Path]:
    root = Path(tempfile.mkdtemp(prefix="gg-contract-sem-"))
    atexit.register(shutil.rmtree, root, True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log_path = root / "job.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=1",
                "--nproc-per-node=4",
                "--max-restarts=0",
                "--standalone",  # c10d on port 0: no window for another process to take a chosen port
                str(SEMANTICS_JOB),
                "--out",
                str(root),
                "--timeout",
                "3",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
    for name in ("ok", "bad"):
        for sub in ("fr_pickle", "fr_json"):
            d = root / name / sub
            if not d.is_dir() or len(list(d.glob("rank_*[0-9]*"))) - len(list(d.glob("*.tmp"))) != 4:
                log = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"job left no complete {name}/{sub} dumps (rc={proc.returncode}):\n{log}")
    for name in ("ok", "bad"):
        _sem_cache[name] = root / name
    _sem_cache["root"] = root
    return dict(_sem_cache)


# ---------------------------------------------------------------- synthetic Flight Recorder dumps

FRAMES_MAIN = [
    {"name": "all_reduce", "filename": "/x/site-packages/torch/distributed/distributed_c10d.py", "line": 3245},
    {"name": "train_step", "filename": "/job/train.py", "line": 52},
]


def fr_entry(
    seq: int,
    *,
    op: str = "all_reduce",
    sizes=((1024,),),
    dtype: str = "Float",
    pg=("0", "default_pg"),
    prefix: str = "nccl",
    state: str = "completed",
    version: str = "2.10",
    frames=None,
    p2p: bool = False,
    record_id: int | None = None,
) -> dict:
    """One entry shaped like the given Flight Recorder format version writes it."""
    rid = seq - 1 if record_id is None else record_id
    e = {
        "record_id": rid,
        "pg_id": int(pg[0]) if str(pg[0]).isdigit() else 0,
        "profiling_name": f"{prefix}:{op}",
        "time_created_ns": 1_700_000_000_000_000_000 + seq,
        "input_sizes": [list(s) for s in sizes],
        "output_sizes": [list(s) for s in sizes],
        "state": state,
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "retired": True,
        "frames": frames if frames is not None else FRAMES_MAIN,
    }
    major, minor = (int(x) for x in version.split("."))
    if (major, minor) < (2, 2):  # 2.0 / 2.1: one seq_id, no process_group tuple, no dtypes
        e["seq_id"] = seq
        return e
    e.update(
        {
            "process_group": tuple(pg),
            "collective_seq_id": 0 if p2p else seq,
            "p2p_seq_id": seq if p2p else 0,
            "op_id": seq,
            "input_dtypes": [dtype] * len(sizes),
            "output_dtypes": [dtype] * len(sizes),
            "is_p2p": p2p,
            "timeout_ms": 600000,
        }
    )
    if (major, minor) >= (2, 10):
        e.update({"thread_name": "python", "thread_id": "1"})
    return e


def fr_doc(entries: list, *, version: str = "2.10", ranks=(0, 1, 2, 3), gloo: bool = False) -> dict:
    cfg = (
        {"": {"name": "", "desc": "", "ranks": "[]"}}
        if gloo
        else {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(ranks))}}
    )
    doc = {"version": version, "pg_config": cfg, "entries": entries}
    if version >= "2.4" or version == "2.10":
        doc["pg_status"] = {
            "0": {
                "last_enqueued_collective": len(entries),
                "last_started_collective": -1,
                "last_completed_collective": -1,
            }
        }
        doc["comm_lib_version"] = ""
    return doc
