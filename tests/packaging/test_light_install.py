"""Without torch (a plain `pip install gpuguard`): the doctor, the ledger and the operator actions
work; the features that need torch say so in one line and exit 69. torch is hidden from the real
console scripts by a `sitecustomize` on PYTHONPATH whose import hook finds no torch, as on a machine
without it.
(.ci/run also installs the wheel into a fresh venv without torch and runs the same commands.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import run_cli

EXIT_UNAVAILABLE = 69
HIDE_TORCH = """
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch' (hidden by the test)", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
"""


@pytest.fixture
def no_torch(tmp_path: Path) -> dict[str, str]:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HIDE_TORCH)
    return {"PYTHONPATH": str(shim)}


def test_doctor_runs_without_torch(no_torch: dict[str, str]) -> None:
    res = run_cli("gpu-doctor", "diagnose", "node", "--demo", "--json", env=no_torch)
    assert res.returncode == 2, res.stderr  # the bundled sample is a drain
    assert json.loads(res.stdout)["schema"] == "gpuguard.node/1"


def test_ledger_init_and_verify_without_torch(no_torch: dict[str, str], tmp_path: Path) -> None:
    job = tmp_path / "job"
    assert run_cli("gpu-generation", "init", "--job-dir", str(job), env=no_torch).returncode == 0
    res = run_cli("gpu-generation", "verify", "--job-dir", str(job), "--deep", "--json", env=no_torch)
    assert res.returncode == 0, res.stderr
    res = run_cli("gpu-recover", "restore", "--job-dir", str(job), "--dry-run", env=no_torch)
    assert res.returncode == 66 and "no snapshot" in res.stderr  # an operator action, torch-free


@pytest.mark.parametrize(
    "argv",
    [("gpu-recover", "demo"), ("gpu-generation", "bench", "transitions", "--real")],
    ids=["demo", "bench-real"],
)
def test_torch_features_say_so_in_one_line(no_torch: dict[str, str], tmp_path: Path, argv: tuple[str, ...]) -> None:
    extra = ("--job-dir", str(tmp_path / "demo")) if argv[-1] == "demo" else ()
    res = run_cli(*argv, *extra, env=no_torch)
    assert res.returncode == EXIT_UNAVAILABLE
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs torch" in lines[0] and "gpuguard[runtime]" in lines[0]
    assert "Traceback" not in res.stderr
