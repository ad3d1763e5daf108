"""The in-place demo job on separate hosts: one worker per host, etcd ledger, nothing shared but etcd.

`HostJob.launch(cluster, ["h1", "h2", "h3"], ...)` takes any cluster with the `gpuguard.testhosts`
shape (`exec`, `run`, `host(name).address/.hostdir`, `job_dir`, `etcd_url`), duck-typed so the
harness layers stay independent. It initialises the ledger on the first host, gives every host's
(private) job directory the job's identity and signing key, as a deployment would hand out a
secret, and starts `examples.inplace_train` on each host with RANK / WORLD_SIZE / MASTER_ADDR as the
single-host launcher does. The first (restart-path) activation uses a TCPStore served by rank 0;
every in-place switch after it coordinates through etcd only (`recovery.runtime.coordination_etcd`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuguard.examples.hostjob import HostJobBase
from gpuguard.examples.inplace_train import FAULTS_ENV
from gpuguard.foundation import jobdir
from gpuguard.foundation.env import JOB_DIR_ENV, JOB_ID_ENV, LEASE_TTL_ENV, LEDGER_ENV, PG_TIMEOUT_ENV
from gpuguard.foundation.errors import GpuguardError

MASTER_PORT = 29500


@dataclass
class HostJob(HostJobBase):
    """One job: a worker per host (procs keyed by rank), its logs outside the hosts."""

    started: float = 0.0

    @classmethod
    def launch(
        cls,
        cluster: Any,
        hosts: list[str],
        log_dir: Path,
        *,
        steps: int = 30,
        step_sleep: float = 0.05,
        pg_timeout: float = 3.0,
        lease_ttl: float = 3.0,
        grace: float = 1.0,
        faults: str = "",
        name: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> HostJob:
        name = name or f"job-{uuid.uuid4().hex[:8]}"
        url = cluster.etcd_url.replace("http://", "etcd://", 1) + f"/gpuguard-{name}"
        job = cls(cluster, list(hosts), name, url, Path(log_dir))
        job.log_dir.mkdir(parents=True, exist_ok=True)
        first = hosts[0]
        job.init_ledger(hosts[1:])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_"))}
        env.update(
            {
                JOB_DIR_ENV: job.job_dir,
                JOB_ID_ENV: name,
                LEDGER_ENV: url,
                LEASE_TTL_ENV: str(lease_ttl),
                PG_TIMEOUT_ENV: str(pg_timeout),
                "WORLD_SIZE": str(len(hosts)),
                "LOCAL_RANK": "0",
                "MASTER_ADDR": cluster.host(first).address,
                "MASTER_PORT": str(MASTER_PORT),
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                "TORCHELASTIC_RUN_ID": name,
                "INPLACE_STEPS": str(steps),
                "INPLACE_STEP_SLEEP": str(step_sleep),
                "INPLACE_GRACE": str(grace),
                FAULTS_ENV: faults,
                "PYTHONWARNINGS": "ignore",
                **(extra_env or {}),
            }
        )
        job.started = time.time()
        try:
            for rank, h in enumerate(hosts):
                with open(job.log_dir / f"{name}-{h}.log", "wb") as log:
                    job.procs[rank] = cluster.exec(
                        h,
                        [sys.executable, "-m", "gpuguard.examples.inplace_train"],
                        env={**env, "RANK": str(rank)},
                        inherit_env=False,
                        stdout=log,
                        stderr=log,
                    )
        except BaseException:
            job.kill_all()
            raise
        return job

    # -- observing ------------------------------------------------------------------------------
    def wait_file(self, host: str, relpath: str, timeout: float) -> Path | None:
        """A file the worker on `host` writes into its job dir (bounded wait)."""
        path = self.outside(host) / relpath
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return path
            time.sleep(0.02)
        return path if path.exists() else None

    def result(self, rank: int) -> dict[str, Any] | None:
        path = self.outside(self.hosts[rank]) / "results" / f"{rank}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def switch_records(self, host: str) -> list[dict[str, Any]]:
        out = []
        for p in jobdir.switch_record_paths(self.outside(host)):
            try:
                out.append(jobdir.read_json(p))
            except GpuguardError:
                continue
        return out

    def log(self, rank: int) -> str:
        try:
            return (self.log_dir / f"{self.name}-{self.hosts[rank]}.log").read_text(errors="replace")
        except OSError:
            return ""
