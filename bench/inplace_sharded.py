"""In-place recovery with sharded state (HSDP 2 x 2 losing a rank) two ways, against a torchrun restart from DCP.

    python bench/inplace_sharded.py [--json] [--trials N] [--steps S] [--sleep SECONDS]

In place: 4 plain gloo workers (`gpuguard.examples.inplace_fsdp`, HSDP: 2 replicas of 2 shards,
the MLP of `examples.fsdp_train`, AdamW, a sharded snapshot every step); rank 3 is SIGKILLed after
its update of step 5, before its commit. The survivors certify generation 2 in place, rebuild the
model over 3 ranks and take what they lack from a surviving replica, peer to peer (re-partition).
Same run, same fault, the policy "keep the HSDP layout" (`InPlaceRuntime(shrink="keep-layout")`): the
damaged replica is dropped whole (rank 2 leaves), ranks 0-1 keep their model, moved to the new mesh
without a rebuild, and roll back to the frontier from their own memory: 0 elements move.
resume = kill -> every member of generation 2 committed its first step; switch = the first survivor
noticing -> the same (what the switch itself costs: how soon a survivor notices depends on where the
kill finds it, up to the collective timeout, alike for both switches); phases from the switch
records (detect, decide, rebuild+transfer, first step); steps lost = what all generation 1 members
had committed - the certified frontier; moved = elements sent between ranks (and / elements held).
Baseline, same run: what a user has without gpuguard's in-place path, torchrun restarting every
worker (`--max-restarts=1`) of `examples.fsdp_train` (FSDP2 over 4, the same model and snapshots),
which restores the certified sharded snapshot (`Runtime(sharded=True)`, DCP underneath): kill (at
the start of step 5) -> every member of the restarted generation committed its first step.
Oracle: every in-place run ends equal to the one-process reference (atol 2e-5, rtol 1e-4).
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

from gpuguard.examples.demo_train import kill_marker  # noqa: E402
from gpuguard.examples.fsdp_train import POINT  # noqa: E402
from gpuguard.examples.inplace_train import Cluster  # noqa: E402
from gpuguard.foundation.inplace_files import (
    read_switch_records,  # noqa: E402
)
from gpuguard.foundation.steplog import committed_steps  # noqa: E402
from gpuguard.generation.ledger_open import open_ledger  # noqa: E402

KILL_STEP = 5


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_commits(job: Path, generation: int) -> float | None:
    """When every member of `generation` had committed its first step (None: not all did)."""
    cert = open_ledger(job).get(generation)
    first: dict[str, float] = {}
    for c in committed_steps(job, generation):
        first.setdefault(c.incarnation, c.wall)
    members = {m.incarnation.id for m in cert.members}
    return max(first[i] for i in members) if members <= set(first) else None


def _close_to_reference(job: Path, steps: int) -> bool:
    import torch

    from gpuguard.examples.fsdp_train import reference

    try:
        final = torch.load(job / "results" / "final.pt", weights_only=True)
    except OSError:
        return False
    ref = reference(steps)
    return all(torch.allclose(final[k], v, atol=2e-5, rtol=1e-4) for k, v in ref.items())


def in_place_trial(job: Path, steps: int, sleep: float, timeout: float, shrink: str = "repartition") -> dict:
    with Cluster.launch(
        job,
        4,
        steps=steps,
        faults=f"3:{KILL_STEP}:before_commit:kill",
        step_sleep=sleep,
        pg_timeout=5.0,
        grace=3.0,
        module="gpuguard.examples.inplace_fsdp",
        extra_env={"INPLACE_SHARD": "2", "INPLACE_SHRINK": shrink},
    ) as c:
        codes = c.wait(timeout)
    row: dict = {"recovered": False, "codes": codes}
    kill_t = json.loads((job / "faults" / f"3-before_commit-{KILL_STEP}.json").read_text())["time"]
    led = open_ledger(job)
    cert = led.active()
    by_rank = read_switch_records(job, 2)
    recs = list(by_rank.values())
    if cert is None or cert.generation != 2 or cert.extra.get("switch") != "in-place" or len(recs) != len(cert.members):
        return row
    by_all = led.last_committed_by_all(1)
    ph = {
        k: min(r["phases"][k] for r in recs) if k == "detect" else max(r["phases"][k] for r in recs)
        for k in set.intersection(*(set(r["phases"]) for r in recs))  # the coordinator has more phases
    }
    reshard = recs[0]["reshard"]
    results = [json.loads((job / "results" / f"{r}.json").read_text()) for r in sorted(by_rank)]
    row.update(
        recovered=True,
        world=len(cert.members),
        rebuilt=reshard.get("rebuilt", True),
        resume_s=max(r["phases"]["first_commit"] for r in recs) - kill_t,
        switch_s=max(r["phases"]["first_commit"] for r in recs) - ph["detect"],
        steps_lost=max(0, (by_all if by_all is not None else cert.frontier.step) - cert.frontier.step),
        phases={
            "detect": ph["detect"] - kill_t,
            "decide": ph["decided"] - ph["detect"],
            "rebuild_transfer": ph["resharded"] - ph["decided"],
            "first_step": ph["first_commit"] - ph["resharded"],
        },
        moved=reshard["elements_moved"],
        moved_fraction=reshard["elements_moved"] / reshard["elements"],
        oracle_ok=_close_to_reference(job, steps),
        remember_s=statistics.median(r["remember_p50_s"] for r in results if r.get("remember_p50_s") is not None),
        step_s=statistics.median(r["step_time_p50_s"] for r in results if r.get("step_time_p50_s") is not None),
    )
    return row


def restart_trial(job: Path, steps: int, sleep: float, timeout: float) -> dict:
    job.mkdir(parents=True)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=4",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "--monitor-interval=0.1",
        "-m",
        "gpuguard.examples.fsdp_train",
        "--job-dir",
        str(job),
        "--steps",
        str(steps),
        "--kill",
        f"3:{KILL_STEP}",
        "--step-sleep",
        str(sleep),
        "--no-digests",
        "--max-seconds",
        str(timeout),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GPUGUARD_PG_TIMEOUT": "5"}
    try:
        rc = subprocess.run(argv, env=env, capture_output=True, timeout=timeout + 30, check=False).returncode
    except subprocess.TimeoutExpired:
        return {"recovered": False, "rc": None}
    try:
        kill_t = json.loads(kill_marker(job, 3, KILL_STEP, POINT).read_text())["time"]
    except (OSError, ValueError, KeyError):
        kill_t = None
    led = open_ledger(job)
    cert = led.active()
    if rc != 0 or kill_t is None or cert is None or cert.generation != 2:
        return {"recovered": False, "rc": rc}
    first = _first_commits(job, 2)
    by_all = led.last_committed_by_all(1)
    return {
        "recovered": first is not None,
        "resume_s": (first - kill_t) if first is not None else None,
        "steps_lost": max(0, (by_all if by_all is not None else cert.frontier.step) - cert.frontier.step),
    }


def _p50(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get("recovered") and r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def _in_place_row(method: str, rows: list[dict], restart_p50: float | None) -> dict:
    ok = [r for r in rows if r.get("recovered")]
    p50 = _p50(rows, "resume_s")
    return {
        "method": method,
        "trials": len(rows),
        "recovered": len(ok),
        "world_after": ok[0]["world"] if ok else None,
        "rebuilt": ok[0]["rebuilt"] if ok else None,
        "resume_p50_s": p50,
        "switch_p50_s": _p50(rows, "switch_s"),
        "steps_lost_max": max((r["steps_lost"] for r in ok), default=None),
        "elements_moved_p50": _p50(rows, "moved"),
        "moved_fraction_p50": _p50(rows, "moved_fraction"),
        "oracle_violations": sum(1 for r in ok if not r["oracle_ok"]) + len(rows) - len(ok),
        "phases_p50_s": {k: round(statistics.median(r["phases"][k] for r in ok), 4) for k in ok[0]["phases"]}
        if ok
        else None,
        "remember_per_commit_s": _p50(rows, "remember_s"),
        "step_s": _p50(rows, "step_s"),
        "vs_restart": round(p50 / restart_p50, 3) if p50 and restart_p50 else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.05, help="stand-in compute per step (s)")
    p.add_argument("--timeout", type=float, default=150.0)
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gpuguard-bench-inplace-sharded-"))
    t0 = time.monotonic()
    try:
        inplace, kept, restart = [], [], []
        for i in range(a.trials):  # interleaved: drift and load hit all alike
            print(f"trial {i + 1}/{a.trials}: in place, re-partitioned", file=sys.stderr, flush=True)
            inplace.append(in_place_trial(work / f"inplace{i}", a.steps, a.sleep, a.timeout))
            print(f"trial {i + 1}/{a.trials}: in place, layout kept", file=sys.stderr, flush=True)
            kept.append(in_place_trial(work / f"kept{i}", a.steps, a.sleep, a.timeout, shrink="keep-layout"))
            print(f"trial {i + 1}/{a.trials}: torchrun restart", file=sys.stderr, flush=True)
            restart.append(restart_trial(work / f"restart{i}", a.steps, a.sleep, a.timeout))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rp50 = _p50(restart, "resume_s")
    results = [
        _in_place_row("in-place, re-partitioned (HSDP 2x2 -> FSDP2 x3, shards from a replica)", inplace, rp50),
        _in_place_row("in-place, layout kept (HSDP 2x2 -> 1x2, damaged replica dropped, no rebuild)", kept, rp50),
        {
            "method": "torchrun restart + certified DCP restore (FSDP2 x4)",
            "trials": len(restart),
            "recovered": sum(1 for r in restart if r.get("recovered")),
            "resume_p50_s": rp50,
            "steps_lost_max": max((r["steps_lost"] for r in restart if r.get("recovered")), default=None),
        },
    ]
    emit("inplace_sharded", results, a.json, [f"wall {time.monotonic() - t0:.0f} s; load {os.getloadavg()[0]:.1f}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
