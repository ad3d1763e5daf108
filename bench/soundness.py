"""Certify only sound state: corruptions injected into real jobs, how many were refused, how many accepted.

    python bench/soundness.py [--json] [--per-kind N] [--steps S]

Each kind runs one real torchrun job (2 gloo workers, `examples.fsdp_train --hsdp`: two replica
groups, AdamW, a snapshot every step, `--max-restarts` = N + 1) with N injections
(`examples.corruptions`, every 3 steps, each once):
- `nan`: rank 1 (replica group 1) writes NaN into its copy of a weight after the update, before the
  commit and so before the snapshot;
- `diverge`: the same with a finite change: the replicas silently disagree;
- `flip`: a bit of the newest published snapshot's largest tensor chunk is flipped, then rank 1 is
  SIGKILLed (the restart must not take that snapshot);
- `lose-data`: the snapshot gets an empty data position while a data loader is registered
  (`--data`: a `SampleStream`).

Per injection at step S in generation g (S: the corrupted snapshot's step; for `flip` the flipped
one): `refused` when generation g+1's certificate rejects step S by name (`unsound:` / `corrupt:`);
`accepted` when generation g+1 certifies step S or later (a snapshot g wrote from the corruption on).
Row: `injected`, `refused`, `corrupt_states_accepted` (the goal: 0) and `recovered_without_operator`
(the job exited 0 with every step done, no command in between, and its final parameters equal the
fault-free reference run's bitwise). `cost` rows: the soundness measure against the digest pass
alone per element (`digests.measure`, 5 M float32 elements), and the snapshot writer's CPU per
snapshot of a clean job with every check against none (`--soundness full|off`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from gpuguard.generation.ledger_open import open_ledger  # noqa: E402

KINDS = ("nan", "diverge", "flip", "lose-data")
EVERY = 3  # steps between injections


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(job: Path, steps: int, *args: str, restarts: int = 0, timeout: float = 600) -> tuple[int, str]:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        f"--max-restarts={restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "--monitor-interval=0.1", "-m", "gpuguard.examples.fsdp_train", "--job-dir", str(job),
        "--steps", str(steps), "--hsdp", "--no-digests", "--final", "--max-seconds", str(timeout), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GPUGUARD_PG_TIMEOUT": "20"}
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout + 60, check=False)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    return proc.returncode, proc.stdout + proc.stderr


def plan(kind: str, n: int) -> list[str]:
    steps = [EVERY * (i + 1) + 1 for i in range(n)]
    if kind in ("nan", "diverge"):
        return [a for s in steps for a in ("--corrupt", f"{kind}:1:{s}")]
    if kind == "flip":
        return [a for s in steps for a in ("--corrupt", f"flip:{s}", "--kill", f"1:{s}")]
    return ["--data", *[a for s in steps for a in ("--corrupt", f"lose-data:{s}")]]


def injections(job: Path) -> list[tuple[int, float]]:
    """(corrupted snapshot's step, when) of every injection that fired."""
    out = []
    for path in (job / "faults").glob("corrupt-*.json"):
        rec = json.loads(path.read_text())
        if rec["kind"] == "lose-data" and rec.get("rank") != 0:
            continue  # one marker per rank: the injection counts once
        out.append((int(rec.get("flipped_step", rec["step"])), float(rec["time"])))
    return sorted(out)


def judge_run(job: Path, reference: Path, rc: int) -> dict[str, Any]:
    """The row's counts from the ledger: each injection against the certificate that followed it."""
    ledger = open_ledger(job)
    history = ledger.history()
    refused = accepted = 0
    fired = injections(job)
    for step, when in fired:
        before = [c for c in history if c.activation_time <= when]
        after = [c for c in history if c.activation_time > when]
        if not before or not after:
            continue  # no restart after it (the job ended first): nothing was certified from it
        nxt = after[0]
        if nxt.frontier.step >= step:
            accepted += 1
        elif any(
            r.startswith(f"step {step}: ") and ("unsound:" in r or "corrupt:" in r)
            for r in nxt.extra.get("rejected", ())
        ):
            refused += 1
    final_ok = False
    try:
        import torch

        got = torch.load(job / "fsdp-out" / "final.pt", weights_only=True)
        ref = torch.load(reference / "fsdp-out" / "final.pt", weights_only=True)
        final_ok = sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    except (OSError, RuntimeError):
        pass
    return {
        "injected": len(fired),
        "refused": refused,
        "corrupt_states_accepted": accepted,
        "recovered_without_operator": rc == 0 and final_ok,
        "generations": len(history) - 1,
    }


def cost_rows(root: Path, steps: int) -> list[dict[str, Any]]:
    """The soundness measure's cost against the digest pass alone, and per snapshot in a real job."""
    import torch

    from gpuguard.recovery.snapshots import digests

    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(1_000_000) for i in range(5)}}
    n = 5_000_000

    def best(fn: Any) -> float:
        return min(timeit.repeat(fn, number=1, repeat=5))

    digest = best(lambda: digests.measure(state, 0, sums="first", finite=False, facts=False))
    fused = best(lambda: digests.measure(state, 0, sums="first", finite=True, facts=True))
    finite = best(lambda: digests.measure(state, 0, sums="none", finite=True, facts=False))
    rows: list[dict[str, Any]] = [
        {"kind": "cost: digest pass alone", "ns_per_element": round(digest / n * 1e9, 3)},
        {"kind": "cost: digest + soundness (fused)", "ns_per_element": round(fused / n * 1e9, 3)},
        {"kind": "cost: finiteness alone", "ns_per_element": round(finite / n * 1e9, 3)},
    ]
    for mode in ("off", "full"):
        job = root / f"cost-{mode}"
        rc, out = torchrun(job, steps, "--soundness", mode)
        cpu = snaps = None
        for line in out.splitlines():
            if "done:" in line and "writer CPU" in line:
                snaps = int(line.split("done: ")[1].split()[0])
                cpu = float(line.split("writer CPU ")[1].split()[0])
        rows.append(
            {
                "kind": f"cost: snapshot writer CPU, --soundness {mode}",
                "snapshots": snaps,
                "ms_per_snapshot": round(cpu / snaps * 1e3, 2) if cpu is not None and snaps else None,
                "rc": rc,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--per-kind", type=int, default=5, help="injections per kind (4 kinds)")
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    ap.add_argument("--no-cost", action="store_true", help="skip the cost rows")
    a = ap.parse_args(argv)
    steps = EVERY * (a.per_kind + 1) + 2
    root = Path(tempfile.mkdtemp(prefix="bench-soundness-"))
    rows: list[dict[str, Any]] = []
    refs: dict[bool, Path] = {}
    for kind in a.kinds:
        data = kind == "lose-data"
        if data not in refs:
            refs[data] = root / f"reference-{'data' if data else 'plain'}"
            rc, out = torchrun(refs[data], steps, *(["--data"] if data else []))
            if rc != 0:
                raise SystemExit(f"bench: the fault-free reference run failed (rc {rc}): {out[-500:]}")
        job = root / kind
        t0 = time.monotonic()
        rc, _out = torchrun(job, steps, *plan(kind, a.per_kind), restarts=a.per_kind + 1)
        row = {"kind": kind, **judge_run(job, refs[data], rc), "wall_s": round(time.monotonic() - t0, 1)}
        rows.append(row)
    total = {k: sum(int(r[k]) for r in rows) for k in ("injected", "refused", "corrupt_states_accepted")}
    total["recovered_without_operator"] = sum(bool(r["recovered_without_operator"]) for r in rows)
    rows.append({"kind": "total", **total})
    if not a.no_cost:
        rows += cost_rows(root, steps)
    notes = [
        f"{steps} steps a job, an injection every {EVERY} steps, 2 gloo workers (HSDP 2 x 1), job dirs under {root}",
        "goal: corrupt_states_accepted = 0, every job recovered without an operator",
    ]
    emit("soundness", rows, a.json, notes)
    return 0 if total["corrupt_states_accepted"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
