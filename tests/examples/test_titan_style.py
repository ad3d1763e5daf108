"""Adoption with few lines, run for real: the torchtitan-style FSDP2 loop with `fault_tolerant`.

The plain loop (`examples/titan_style_plain.py`) runs under torchrun without a fault: the reference.
The adopted loop (`examples/titan_style_train.py`) runs with rank 1 SIGKILLed at the start of a
step; torchrun restarts the group (`--max-restarts=1`), the next generation resumes from the
certified sharded snapshot, and its final (gathered) parameters must equal the plain run's
bitwise (the same world size: the same reductions in the same order). The lines adoption changes
are counted here, by the rule the README states, and must be the README's figures.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import EXIT_REFUSED
from gpuguard.generation.ledger_open import open_ledger
from tests.recovery.snapshots.test_sharded_snapshot import finish
from tests.support.cli import REPO, free_port, run_cli

STEPS, KILL_STEP, WORLD = 8, 5, 2


def torchrun(module: str, out: Path, *args: str, restarts: int = 0, timeout: float = 40.0) -> str:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={WORLD}",
        f"--max-restarts={restarts}", "--standalone",
        "--monitor-interval=0.1", "-m", module, "--out", str(out), "--steps", str(STEPS), "--final", *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GPUGUARD_PG_TIMEOUT": "20"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rc, text = finish(proc, timeout)  # reaps the whole tree on a timeout, and on any failure
    assert rc == 0, text[-4000:]
    return text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sigkilled_rank_resumes_from_the_certified_snapshot_and_ends_bitwise_where_the_plain_loop_does(tmp_path):
    plain, adopted = tmp_path / "plain", tmp_path / "adopted"
    torchrun("gpuguard.examples.titan_style_plain", plain)
    out = torchrun("gpuguard.examples.titan_style_train", adopted, "--kill", f"1:{KILL_STEP}", restarts=1)
    # the kill happened, for real, and torchrun started a second generation
    assert (adopted / "faults" / f"kill-r1-s{KILL_STEP}-step-start.json").exists(), out[-3000:]
    first = jobdir.read_json(jobdir.activation_path(adopted, 1))
    second = jobdir.read_json(jobdir.activation_path(adopted, 2))
    assert first["restored_from"] is None and second["world_size"] == WORLD
    # it resumed from a certified sharded snapshot taken before the kill, not from step 0
    assert second["restored_from"] and 1 <= second["frontier_step"] < KILL_STEP, second
    cert = open_ledger(adopted).get(2)
    assert cert.frontier.step == second["frontier_step"] and cert.frontier.state_manifest_digest
    res = run_cli("gpu-generation", "verify", "--job-dir", str(adopted))
    assert res.returncode == 0, res.stdout + res.stderr
    # and ended where the fault-free plain loop ended, bitwise
    ref = torch.load(plain / "final.pt", weights_only=True)
    got = torch.load(adopted / "final.pt", weights_only=True)
    assert sorted(got) == sorted(ref)
    unequal = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not unequal, f"differ from the fault-free run: {unequal}"


# ---------------------------------------------------------------- the lines adoption changes

PLAIN, ADOPTED = REPO / "examples" / "titan_style_plain.py", REPO / "examples" / "titan_style_train.py"


def main_lines(path: Path) -> list[str]:
    """main()'s lines, stripped of indentation (re-indenting under `with` is an editor's work),
    blank and comment lines dropped."""
    src = path.read_text()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    lines = (ast.get_source_segment(src, node) or "").splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def adoption_diff() -> tuple[int, int, int]:
    """(lines added or changed in main(), lines removed from it, gpuguard import lines): the rule
    README's adoption table states."""
    added = removed = 0
    for line in difflib.ndiff(main_lines(PLAIN), main_lines(ADOPTED)):
        added += line.startswith("+ ")
        removed += line.startswith("- ")
    imports = [
        n
        for n in ast.parse(ADOPTED.read_text()).body
        if isinstance(n, ast.ImportFrom) and n.module == "gpuguard.recovery"
    ]
    return added, removed, len(imports)


def test_adoption_changes_the_lines_the_readme_says():
    added, removed, imports = adoption_diff()
    assert (added, removed, imports) == (3, 4, 1)
    readme = (REPO / "README.md").read_text()
    assert f"| gpuguard (`fault_tolerant`) | {added + imports} |" in readme


# ---------------------------------------------------------------- the wrapper's contract, one process

ONE_RANK = textwrap.dedent(
    """
    import json, sys, torch
    from gpuguard.recovery import fault_tolerant

    mode, job = sys.argv[1], sys.argv[2]

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step_of(run, step):
        run.model(torch.ones(3, 4)).sum().backward()
        run.optimizer.step()
        run.optimizer.zero_grad()

    if mode == "fenced":  # an incarnation of an older generation (as a zombie would be) commits
        with fault_tolerant(build, job_dir=job) as run:
            for step in run.steps(until=10):
                step_of(run, step)
                run.runtime.context.generation -= 1
        raise SystemExit("not fenced")
    if mode == "break":
        with fault_tolerant(build, job_dir=job, sharded=False) as run:
            for step in run.steps(until=10):
                step_of(run, step)
                if step == 3:
                    break
        s = run.summary
    else:
        @fault_tolerant(build, job_dir=job, snapshot_budget=0.0)
        def train(run, until):
            for step in run.steps(until=until):
                step_of(run, step)
            return run
        s = train(4).summary
    print(json.dumps({"start": s.start_step, "last": s.last_committed, "gen": s.generation,
                      "restored": s.restored_from is not None}))
    """
)


def one_rank(mode: str, job: Path, rc: int = 0) -> subprocess.CompletedProcess:
    env = {
        **os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
    }  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", ONE_RANK, mode, str(job)], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == rc, proc.stderr[-3000:]
    return proc


def summary(mode: str, job: Path) -> dict:
    return json.loads(one_rank(mode, job).stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_step_left_with_break_is_not_committed_and_a_rerun_resumes_after_the_last_commit(tmp_path):
    first = summary("break", tmp_path / "b")
    assert first == {"start": 1, "last": 2, "gen": 1, "restored": False}
    # the decorator form, sharded (one rank): every step committed and snapshotted, then resumed
    job = tmp_path / "d"
    assert summary("decorate", job) == {"start": 1, "last": 4, "gen": 1, "restored": False}
    again = summary("decorate", job)  # nothing left to run past step 4: resumes at 5, runs none
    assert again == {"start": 5, "last": None, "gen": 2, "restored": True}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_fenced_commit_stops_the_process_with_one_line_and_status_4(tmp_path):
    proc = one_rank("fenced", tmp_path / "f", rc=EXIT_REFUSED)
    said = [line for line in proc.stderr.splitlines() if line.startswith("gpuguard: rank 0")]
    assert len(said) == 1 and "stops: commit of step 1 in generation 0 fenced" in said[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_usage_errors_are_one_line_with_the_usage_exit_code():
    from gpuguard.foundation.errors import EXIT_USAGE, GpuguardError
    from gpuguard.recovery import FaultTolerant, fault_tolerant

    with pytest.raises(GpuguardError) as both:
        fault_tolerant(lambda: (None, None), model=object())
    assert both.value.exit_code == EXIT_USAGE and "either build or model" in str(both.value)
    with pytest.raises(GpuguardError) as neither:
        fault_tolerant()
    assert neither.value.exit_code == EXIT_USAGE
    with pytest.raises(GpuguardError) as early:
        next(FaultTolerant(lambda: (None, None)).steps())
    assert early.value.exit_code == EXIT_USAGE and "outside" in str(early.value)
