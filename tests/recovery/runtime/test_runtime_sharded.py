"""The runtime with sharded state (FSDP2, gloo on CPU): collective snapshots, certified restores, resharding.

Two real torchrun jobs share one job directory (the machine has 2 cores): 3 workers train
`examples/fsdp_train.py` with `sharded=True`, rank 1 is SIGKILLed at the start of a step, torchrun
restarts the group at the same world size and it resumes from the certified sharded snapshot;
then the job is relaunched with 2 workers from the same directory, and the certified state of 3
ranks is restored resharded onto 2. Each time the restored state's layout-independent digest must
equal the digest the previous generation recorded at the frontier step (the state, bitwise, at
any world size), the certificate must carry the frontier snapshot's ownership map and the reshard
plan, `gpu-generation verify --deep` must accept the ledger and `gpu-generation show` must say
who reads whose shards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.generation.ownership import (
    Chunk,
    ShardLayout,
    layout_from_keys,
    plan_reshard,
    predict_layout,
    reshard_problems,
    reshard_record,
)
from gpuguard.recovery.snapshots import parts
from tests.recovery.snapshots.test_sharded_snapshot import finish
from tests.support.cli import free_port, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

STEPS, KILL_STEP, MORE_STEPS = 8, 5, 11


def launch(job_dir: Path, workers: int, steps: int, *args: str, restarts: int = 0, timeout: float = 55.0) -> str:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={workers}",
        f"--max-restarts={restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--monitor-interval=0.1",
        "-m",
        "gpuguard.examples.fsdp_train",
        "--job-dir",
        str(job_dir),
        "--steps",
        str(steps),
        "--max-seconds",
        str(timeout),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GPUGUARD_PG_TIMEOUT": "20"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rc, out = finish(proc, timeout)  # reaps the whole tree on a timeout, and on any failure
    assert rc == 0, out[-4000:]
    return out


def records(job_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "fsdp-out" / name).read_text().splitlines() if line.strip()]


def digest_at(job_dir: Path, generation: int, step: int) -> str:
    found = [
        r["digest"] for r in records(job_dir, "digests.jsonl") if r["generation"] == generation and r["step"] == step
    ]
    assert len(found) == 1, f"generation {generation} recorded no digest of step {step}"
    return found[0]


def active_certificate(job_dir: Path) -> dict:
    res = run_cli("gpu-generation", "show", "--job-dir", str(job_dir), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["certificate"]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    job_dir = tmp_path_factory.mktemp("fsdp")
    launch(job_dir, 3, STEPS, "--kill", f"1:{KILL_STEP}", restarts=1)
    return job_dir


@pytest.fixture(scope="module")
def resharded(job) -> Path:
    # the newest snapshot loses a member's part: the coordinator must pass over it, saying why
    (job / "snapshots" / f"step-{STEPS}" / parts.part_name(1)).unlink()
    launch(job, 2, MORE_STEPS)
    return job


def test_a_killed_rank_resumes_from_the_certified_sharded_state_at_the_same_world_size(job):
    first, second = records(job, "activations.jsonl")
    assert first["generation"] == 1 and first["restored_from"] is None
    assert second["world_size"] == 3 and second["restored_from"]
    frontier = second["frontier_step"]
    assert KILL_STEP - 2 <= frontier < KILL_STEP  # at most the snapshot in flight at the kill is lost
    # the restored state is, bitwise, the state generation 1 had after the frontier step
    assert second["state_digest"] == digest_at(job, 1, frontier)
    # and training on from it retraces generation 1 (same world size: the same reductions)
    done = {r["step"] for r in records(job, "digests.jsonl") if r["generation"] == 1}
    for step in sorted(done):
        if step > frontier:
            assert digest_at(job, 2, step) == digest_at(job, 1, step)
    # every rank wrote its own shards and part of the certified snapshot
    names = sorted(p.name for p in Path(second["restored_from"]).iterdir())
    assert [n for n in names if n.endswith(".distcp")] == [f"__{r}_0.distcp" for r in range(3)]
    assert [n for n in names if n.startswith("gpuguard.part-")] == [f"gpuguard.part-{r}.json" for r in range(3)]
    cert = active_certificate(job)
    assert cert["reason"] == "rank-failure" and cert["frontier"]["step"] == frontier
    omap = cert["extra"]["ownership_map"]
    assert omap["version"] == 0 and omap["world_size"] == 3 and set(omap["by_rank"]) == {"0", "1", "2"}
    assert set(omap["owners"].values()) == {0, 1, 2} and omap["objects"] == len(omap["owners"])
    reshard = cert["extra"]["reshard"]
    assert (reshard["from_world"], reshard["to_world"], reshard["problems"]) == (3, 3, [])
    assert cert["ownership_map_version"] == 0  # the same layout: nothing changes owner
    assert second["reshard"]["certified_plan_held"] is True
    deep = run_cli("gpu-generation", "verify", "--deep", "--job-dir", str(job))
    assert deep.returncode == 0, deep.stdout + deep.stderr
    shown = run_cli("gpu-generation", "show", "--job-dir", str(job)).stdout
    # each rank reads its own rows back, and every rank the replicated scalars (AdamW's step) a rank wrote
    assert f"rank 0's shards of 18 tensors: read from snapshot step {frontier} by rank 0" in shown
    assert f"rank 1's shards of 21 tensors: read from snapshot step {frontier} by ranks 0,1,2" in shown


def draws(job_dir: Path, rank: int, generation: int) -> dict[int, list[float]]:
    return {r["step"]: r["draw"] for r in records(job_dir, f"draws-rank{rank}.jsonl") if r["generation"] == generation}


def test_a_restart_at_the_same_world_size_draws_the_random_numbers_of_an_uninterrupted_run(job):
    second = records(job, "activations.jsonl")[1]
    frontier = second["frontier_step"]
    assert second["rng"] == "RNG restored: each of the 3 ranks from its own part"
    assert active_certificate(job)["extra"]["rng"] == second["rng"]
    for rank in range(3):
        before, after = draws(job, rank, 1), draws(job, rank, 2)
        # generation 1 drew at steps it never committed (the kill came at KILL_STEP): generation 2 redoes them
        again = sorted(s for s in after if s in before and s > frontier)
        assert again, f"rank {rank}: no step drawn by both generations after the frontier {frontier}"
        for step in again:
            assert after[step] == before[step], f"rank {rank} step {step}: {after[step]} != {before[step]}"
        # not what a fresh process draws first (build() seeds 0): the restored stream, not a reseeded one
        assert after[frontier + 1] != before[1]
    # each rank draws 4 + rank numbers a step, so the streams differ: each was restored from its own part
    assert draws(job, 0, 2)[frontier + 1] != draws(job, 1, 2)[frontier + 1][:4]


def test_a_relaunch_at_world_size_2_restores_the_3_rank_state_resharded(resharded):
    job = resharded
    last = records(job, "activations.jsonl")[-1]
    assert last["world_size"] == 2 and last["generation"] == 3
    frontier = last["frontier_step"]
    assert frontier == STEPS - 1  # the newest (step STEPS) has a part missing: the one before it
    cert = active_certificate(job)
    assert any(f"step {STEPS}: the part of rank 1 of 3 is missing" in r for r in cert["extra"]["rejected"])
    # bitwise the state the 3 ranks had (the digest does not depend on the layout)
    assert last["state_digest"] == digest_at(job, 2, frontier)
    assert last["reshard"]["certified_plan_held"] is True
    # per-rank RNG streams of 3 ranks do not map onto 2: not restored, and the certificate says so
    assert last["rng"].startswith("RNG not restored: world 3 -> 2") and cert["extra"]["rng"] == last["rng"]
    assert draws(job, 0, 3)[frontier + 1] == draws(job, 0, 1)[1]  # rank 0 draws what its build() seeded
    assert cert["reason"] == "scale-down" and cert["ownership_map_version"] == 1
    assert cert["extra"]["ownership_map"]["world_size"] == 3
    reshard = cert["extra"]["reshard"]
    assert (reshard["from_world"], reshard["to_world"], reshard["lost"], reshard["problems"]) == (3, 2, [2], [])
    assert reshard["plan_digest"] == last["reshard"]["plan_digest"]
    # rank 2's rows of every sharded tensor go to the new ranks 0 and 1 (64 rows: 44..63 -> 32..63 on rank 1,
    # and the replicated scalars to both)
    lost_reads = {r["to_rank"] for r in reshard["reads"] if r["from_rank"] == 2}
    assert lost_reads == {0, 1}
    shown = run_cli("gpu-generation", "show", "--job-dir", str(job)).stdout
    assert "world 3 -> 2 (ownership map v0 -> v1)" in shown
    assert "rank 2 (lost)'s shards of" in shown and f"read from snapshot step {frontier} by ranks 0,1" in shown
    deep = run_cli("gpu-generation", "verify", "--deep", "--job-dir", str(job))
    assert deep.returncode == 0, deep.stdout + deep.stderr
    # the 2-rank generation writes 2-part snapshots stamped with the new ownership map version
    newest = parts.select_sharded(job).chosen
    assert newest is not None and newest.step == MORE_STEPS
    layout = parts.snapshot_layout(newest.path)
    assert (layout.world_size, layout.version) == (2, 1)


def test_the_runtime_default_interval_adapts_to_the_snapshot_cost_the_same_on_every_rank(tmp_path):
    # the runtime's default budget: a snapshot's CPU at most 3 % of the step. Here (a tiny model,
    # 20 ms of stand-in compute, 2 loaded cores) a snapshot costs far more than 3 % of a step, so
    # they come every few steps; every rank must pick the same steps (the save is collective: a
    # rank out of step would time the others' save out, and count an error)
    out = launch(tmp_path, 3, 16, "--snapshot-budget", "0.03", "--step-sleep", "0.02")
    done = [line for line in out.splitlines() if "[fsdp rank 0] done:" in line]
    assert len(done) == 1, out[-3000:]
    snaps, errors = (int(x) for x in done[0].split("done: ")[1].replace(" snapshots,", "").split()[:2])
    assert errors == 0 and 1 <= snaps < 16, done[0]
    kept = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "snapshots").glob("step-*"))
    # the first snapshots come every step until a step time and a snapshot cost are known (CI: kept
    # [2, 3, 10]); by the last ones the interval has grown
    assert len(kept) >= 2 and kept[0] >= 1 and kept[-1] - kept[-2] >= 2, kept
    for step in kept:  # every one complete: all three parts, the manifest's objects
        chosen = parts.select_sharded(tmp_path, step).chosen
        assert chosen is not None and chosen.step == step


# ------------------------------------------------------------------ the prediction the certificate uses (pure)


def _fsdp_layout(world: int, rows: int = 64, cols: int = 16, version: int = 0) -> ShardLayout:
    step = -(-rows // world)
    held: dict[int, dict[str, tuple[int, ...]]] = {}
    for r in range(world):
        lo, hi = r * step, min(rows, (r + 1) * step)
        held[r] = {"step@": ()}
        if hi > lo:
            held[r][f"w@{lo},0"] = (hi - lo, cols)
    writers = {f"w@{r * step},0": r for r in range(world) if r * step < rows} | {"step@": 0}
    return layout_from_keys(version, world, held, writers)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 200), cols=st.integers(1, 5), old=st.integers(1, 9), new=st.integers(1, 9))
def test_predicted_fsdp_layouts_are_the_real_rule_and_the_plan_covers_them(rows, cols, old, new):
    before = _fsdp_layout(old, rows, cols)
    predicted = predict_layout(before, new, 1)
    assert predicted is not None
    real = _fsdp_layout(new, rows, cols, version=1)
    assert dict(predicted.chunks) == dict(real.chunks) and dict(predicted.holders) == dict(real.holders)
    plan = plan_reshard(before, predicted)
    assert reshard_problems(predicted, plan) == []
    rec = reshard_record(before, predicted, plan, step=7, lost=range(new, old))
    assert rec["lines"][0] == f"world {old} -> {new} (ownership map v0 -> v1)"
    assert rec["problems"] == []
    assert sum(r["elements"] for r in rec["reads"]) == rows * cols + new  # every row once, the scalar on each rank
    assert rec["lost"] == list(range(new, old))


def test_a_layout_with_replica_groups_is_not_predicted():
    hsdp = ShardLayout(
        0,
        4,
        {"w@0,0": Chunk("w", (0, 0), (32, 4)), "w@32,0": Chunk("w", (32, 0), (32, 4))},
        {"w@0,0": (0, 2), "w@32,0": (1, 3)},
    )
    assert predict_layout(hsdp, 2, 1) is None


def test_what_sharded_mode_does_not_do_yet_is_refused_as_a_usage_error(tmp_path):
    code = r"""
import sys
from gpuguard.foundation.errors import GpuguardError
from gpuguard.recovery.runtime.inplace import InPlaceRuntime
from gpuguard.recovery.runtime.runtime import Runtime
kw = dict(rank=1, world_size=2, local_rank=1, master_addr="127.0.0.1", master_port=1, run_id="x",
          restart_count=0, use_agent_store=True)
for make in (lambda: InPlaceRuntime(sys.argv[1], sharded=True, **kw).activate(object()),
             lambda: Runtime(sys.argv[1], **kw).activate(build=lambda: (None, None))):
    try:
        make()
        print("ACCEPTED")
    except GpuguardError as exc:
        print(exc.exit_code, exc)
"""
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first == "64 the in-place switch with sharded state needs activate(build=...)"
    assert second == "64 activate(build=...) needs sharded=True"


@pytest.mark.parametrize(
    ("text", "want"),
    [("gloo", "gloo"), ("nccl", "nccl"), (" cpu:gloo,cuda:nccl ", "cpu:gloo,cuda:nccl"), ("cuda:nccl", "cuda:nccl")],
)
def test_the_world_group_backend_is_what_torch_takes(text, want):
    from gpuguard.recovery.runtime.runtime import parse_backend

    assert parse_backend(text) == want


@pytest.mark.parametrize(
    "text", ["", "tcp", "cpu:gloo,cpu:nccl", "gpu:nccl", "cpu:", "cpu:gloo;cuda:nccl", "gloo,nccl"]
)
def test_a_backend_torch_would_not_take_is_a_usage_error(text):
    from gpuguard.foundation.errors import EXIT_USAGE, GpuguardError
    from gpuguard.recovery.runtime.runtime import parse_backend

    with pytest.raises(GpuguardError) as err:
        parse_backend(text)
    assert err.value.exit_code == EXIT_USAGE and "cpu:gloo,cuda:nccl" in str(err.value)


def test_a_backend_missing_from_this_torch_is_one_clear_error_before_any_group(tmp_path):
    import torch.distributed as dist

    from gpuguard.foundation.errors import EXIT_UNAVAILABLE, GpuguardError
    from gpuguard.recovery.runtime.runtime import Runtime

    if dist.is_backend_available("nccl"):  # a CUDA build: the check has nothing to refuse here
        pytest.skip("this torch has NCCL")
    kw = dict(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=1, run_id="x")
    with pytest.raises(GpuguardError) as err:
        Runtime(tmp_path, restart_count=0, use_agent_store=False, backend="cpu:gloo,cuda:nccl", **kw)
    assert err.value.exit_code == EXIT_UNAVAILABLE and "nccl is not built into this torch" in str(err.value)
