"""Shared helpers of the node-health tests (NVML fake loading, snapshots, events)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FAKES = REPO / "tests" / "support" / "fakes"
SAMPLE_NVML = REPO / "collectors" / "data" / "sample-nvml.json"
SAMPLE_LOG = REPO / "collectors" / "data" / "sample-kern.log"


def load_fake_pynvml() -> Any:
    """Import tests/support/fakes/pynvml.py under its own name (the CLI tests use PYTHONPATH instead)."""
    name = "gpuguard_test_fake_pynvml"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, FAKES / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sample_snapshot() -> dict[str, Any]:
    return json.loads(SAMPLE_NVML.read_text())


def healthy_gpu(index: int = 0, pci: str | None = None) -> dict[str, Any]:
    """A GPU with every counter at its healthy value (built from the sample's healthy GPU 2)."""
    gpu = copy.deepcopy(sample_snapshot()["gpus"][2])
    gpu.update(index=index, pci_bus_id=pci or f"0000:{0x10 + index:02x}:00.0", uuid=f"GPU-test-{index}")
    return gpu


def snapshot(*gpus: dict[str, Any], **top: Any) -> dict[str, Any]:
    doc = {
        "schema": "gpuguard.nvml/1",
        "status": "ok",
        "reason": None,
        "collected_at": 0.0,
        "driver_version": "550.90.07",
        "gpus": list(gpus),
    }
    doc.update(top)
    return doc


def write_json(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


def fake_env(snapshot_path: Path) -> dict[str, str]:
    """Environment for a CLI run against the fake pynvml."""
    import os

    return {
        "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "GPUGUARD_FAKE_NVML": str(snapshot_path),
    }


def sample_sweep_argv(state_dir: Path, *outputs: str, options: tuple[str, ...] = ()) -> list[str]:
    """`gpu-doctor sweep` over the sample kernel log and NVML snapshot, as JSON, with these outputs
    (`--output NAME` each) and `--output-option` values."""
    argv = ["gpu-doctor", "sweep", "--kernel-log", str(SAMPLE_LOG), "--nvml-snapshot", str(SAMPLE_NVML)]
    argv += ["--state-dir", str(state_dir), "--json"]
    for name in outputs:
        argv += ["--output", name]
    for opt in options:
        argv += ["--output-option", opt]
    return argv
