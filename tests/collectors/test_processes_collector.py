"""Job-process collector: real processes carrying torchrun's environment, found by psutil."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gpuguard.collectors import processes


def test_finds_agents_and_workers_by_run_id():
    run_id = f"gpuguard-test-{os.getpid()}"
    sleeper = "import time; time.sleep(60)"
    started = []
    try:
        # an "agent": its command line names torch.distributed.run (torchrun's module)
        started.append(subprocess.Popen([sys.executable, "-c", sleeper, "torch.distributed.run", "--nproc-per-node=2"]))
        for rank in (0, 1):
            env = {**os.environ, "TORCHELASTIC_RUN_ID": run_id, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            started.append(subprocess.Popen([sys.executable, "-c", sleeper], env=env))
        deadline = time.monotonic() + 20
        while True:
            doc = processes.collect(run_id=run_id)
            workers = [p for p in doc["processes"] if p["role"] == "worker"]
            if len(workers) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert doc["schema"] == "gpuguard.processes/1"
        assert [(p["rank"], p["local_rank"], p["run_id"]) for p in workers] == [(0, 0, run_id), (1, 1, run_id)]
        assert {p["pid"] for p in workers} == {p.pid for p in started[1:]}
        assert all(p["rss_bytes"] > 0 and p["age_s"] >= 0 and p["status"] for p in workers)
        agents = [p for p in processes.collect()["processes"] if p["role"] == "agent" and p["pid"] == started[0].pid]
        assert len(agents) == 1
        assert processes.collect(run_id="no-such-run")["processes"] == []
    finally:
        for proc in started:
            proc.kill()
            proc.wait(timeout=10)
