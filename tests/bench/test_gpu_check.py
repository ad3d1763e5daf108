"""bench/gpu_check.py, the prepared device check, rehearsed on the CPU (`--dry-run-cpu`): every step
runs for real (the doctor against the pynvml fake, torchrun jobs on gloo, the in-place runtime, an
FSDP2 job) and passes, and the rows say what was simulated and that CUDA was not exercised. Without
a GPU and without the rehearsal flag, the CUDA steps are reported as not run, never as passed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
STEPS = ["nvml_live", "nccl_contract", "inplace_nccl", "sharded_rng"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_cpu_rehearsal_passes_every_row_and_says_what_it_did_not_prove(tmp_path):
    out = tmp_path / "check"
    r = _run("--dry-run-cpu", "--json", "--out", str(out), "--budget", "240", timeout=280)
    doc = json.loads(r.stdout)
    rows = {row["check"]: row for row in doc["results"]}
    assert list(rows) == STEPS
    assert r.returncode == 0, json.dumps(doc["results"], indent=1)[-4000:]
    assert all(row["ok"] for row in rows.values()) and doc["schema"] == "gpuguard.bench/1"
    assert doc["dry_run_cpu"] is True and any("nothing in it is a GPU result" in n for n in doc["notes"])
    assert doc["environment"]["torch"] and json.loads((out / "gpu-check.json").read_text()) == doc

    nvml = rows["nvml_live"]
    assert nvml["simulated"] is True and nvml["nvml_status"] == "ok" and len(nvml["gpus"]) == 4
    assert (out / "nvml" / "nvml-snapshot.json").exists()  # the --dump-nvml copy the device run keeps as a fixture
    assert all(rows[s]["cuda_exercised"] is False for s in STEPS[1:])

    contract = rows["nccl_contract"]  # the skipping rank named from real Flight Recorder dumps
    assert (contract["backend"], contract["kind"], contract["culprit_ranks"]) == ("gloo", "missing_participant", [1])
    assert contract["p2p_checked"] is False and "records no send/recv" in contract["note"]
    assert sorted(p.name for p in (out / "contract" / "fr").iterdir()) == ["rank_0", "rank_1"]

    inplace = rows["inplace_nccl"]  # a SIGKILL and an in-place switch, the same survivor process
    assert inplace["exit_codes"] == [0, -9] and inplace["switch_chain"][-1] == "in-place"
    assert inplace["equals_reference"] and inplace["survivor_same_process"] and inplace["remember_p50_s"] > 0

    rng = rows["sharded_rng"]
    assert [c["cpu_equal"] and c["cpu_differed_before"] for c in rng["ranks"]] == [True, True]
    assert all(c["cuda_equal"] is None for c in rng["ranks"]) and "CUDA was not exercised" in rng["note"]


def test_without_a_gpu_the_cuda_steps_are_not_run_and_the_check_fails(tmp_path):
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True
    )
    if probe.stdout.strip() != "False":
        pytest.skip("this machine has a GPU: the device run is the real one")
    r = _run("--json", "--out", str(tmp_path / "check"), "--budget", "60", timeout=120)
    assert r.returncode == 1, r.stderr
    rows = {row["check"]: row for row in json.loads(r.stdout)["results"]}
    for name in STEPS[1:]:
        assert rows[name]["ok"] is False and rows[name]["not_run"] is True, rows[name]
        assert "not run" in rows[name]["reason"]
    assert "simulated" in rows["nvml_live"] and rows["nvml_live"]["simulated"] is False


def test_an_output_directory_in_use_is_refused_and_left_alone(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    r = _run("--dry-run-cpu", "--out", str(tmp_path), timeout=60)
    assert r.returncode == 64 and r.stderr.count("\n") == 1 and "not an empty directory" in r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"] and r.stdout == ""
