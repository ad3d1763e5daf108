"""recovery.runtime.warmup: torch's lazy `torch._dynamo` import (the first optimizer a script builds
pays it: seconds of main-thread module code under load) happens before the runtime's Context exists,
so never while the lease's keepalive and self-fence threads need the GIL (a crowded host fenced
healthy workers that way: `bench/hosts.py --load`)."""

from __future__ import annotations

import subprocess
import sys

CODE = r"""
import sys
import torch
import gpuguard.recovery.runtime.runtime as runtime
before = "torch._dynamo" in sys.modules
seen = []

class Spy(runtime.Context):  # the Context starts the lease (an etcd ledger): what is imported by then?
    def __init__(self, *args, **kwargs):
        seen.append("torch._dynamo" in sys.modules)
        super().__init__(*args, **kwargs)

runtime.Context = Spy
runtime.Runtime(sys.argv[1], rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=1,
                run_id="x", restart_count=0, use_agent_store=False)
print(before, seen)
"""


def test_torch_dynamo_is_imported_before_the_context_and_its_lease(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "[True]"]  # not imported by gpuguard's modules, but by the runtime


def test_a_torch_without_the_module_is_skipped_not_fatal(monkeypatch):
    from gpuguard.recovery.runtime import warmup

    monkeypatch.setattr(warmup, "HEAVY_IMPORTS", ("torch._no_such_module_here",))
    assert warmup.import_heavy_modules() == ("torch._no_such_module_here",)
