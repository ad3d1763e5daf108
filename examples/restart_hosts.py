"""The restart-path demo job on separate hosts: one torchrun agent per host, nothing shared but etcd
and the checkpoint storage.

`RestartHostJob.launch(cluster, ["h1", "h2", "h3"], ...)` takes any cluster with the
`gpuguard.testhosts` shape (`exec`, `run`, `host(name).address/.hostdir`, `job_dir`, `shared_path`,
`etcd_url`), duck-typed so the harness layers stay independent. It initialises the ledger on the
first host, hands every host's private job directory the job's identity and signing key (a
deployment's secret, not coordination), and starts on each host

    torchrun --nnodes=MIN:MAX --rdzv-backend=gpuguard --rdzv-endpoint=<etcd> --local-addr=<host> ...
        -m gpuguard.examples.demo_train --job-dir <private job dir> --out <shared>/out --hashes

so the rendezvous lives in etcd (no training host serves it), each generation's activation store is
served by that round's rank 0 (its address published through the rendezvous, i.e. etcd), the
ledger, commits and leases are in etcd, and snapshots are written to the shared storage
(`GPUGUARD_SNAPSHOT_ROOT`), where a new rank 0 on another host finds them.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.examples.hostjob import HostJobBase, console
from gpuguard.foundation.env import (
    JOB_DIR_ENV,
    JOB_ID_ENV,
    LEASE_TTL_ENV,
    LEDGER_ENV,
    PG_TIMEOUT_ENV,
    SNAPSHOT_ROOT_ENV,
)

# keep-alive 1 s x 3: a lost agent leaves the rendezvous 3 s after its last heartbeat (torch's default 15 s)
DYNAMIC_CONF = "last_call_timeout=1,join_timeout=90,keep_alive_interval=1,keep_alive_max_attempt=3"
RDZV_CONF = f"key_prefix=/gpuguard-rdzv,read_timeout=3,store_timeout=60,lease_ttl=6,closed_ttl=60,{DYNAMIC_CONF}"
C10D_PORT = 29400


@dataclass
class RestartHostJob(HostJobBase):
    """One job: a torchrun agent per host (procs keyed by host), its logs outside the hosts."""

    argv: list[str] = field(default_factory=list)  # torchrun's arguments after the program, every host
    env: dict[str, str] = field(default_factory=dict)

    @property
    def shared(self) -> Path:
        """This job's folder on the shared checkpoint storage (the same path inside and outside)."""
        return Path(self.cluster.shared_path) / self.name

    @classmethod
    def launch(
        cls,
        cluster: Any,
        hosts: list[str],
        log_dir: Path,
        *,
        nnodes: str = "2:3",
        steps: int = 30,
        sleep: float = 0.2,
        pg_timeout: float = 3.0,
        lease_ttl: float = 4.0,
        max_restarts: int = 3,
        spares: list[str] | None = None,
        name: str | None = None,
        step_log: bool = False,
        seed_recipe: bool = False,
        ckpt_every: int = 5,
    ) -> RestartHostJob:
        """Start an agent on each of `hosts`; `spares` get the job's key too (for `start_agent` later).

        `seed_recipe`: the baseline a user would otherwise run on the same hosts: torchrun's own c10d
        rendezvous served by the first host's agent, `demo_train --mode plain` (env:// group, rank 0
        checkpoints every `ckpt_every` steps to the shared storage, resume from the last one)."""
        name = name or f"rs-{uuid.uuid4().hex[:8]}"
        url = cluster.etcd_url.replace("http://", "etcd://", 1) + f"/gpuguard-{name}"
        job = cls(cluster, list(hosts), name, url, Path(log_dir))
        job.log_dir.mkdir(parents=True, exist_ok=True)
        (job.shared / "state").mkdir(parents=True)
        (job.shared / "out").mkdir()
        first = hosts[0]
        job.init_ledger([*hosts[1:], *(spares or [])])
        etcd_host = cluster.etcd_url.split("://", 1)[1]
        if seed_recipe:
            rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint={cluster.host(first).address}:{C10D_PORT}"]
            rdzv.append(f"--rdzv-conf={DYNAMIC_CONF}")
            mode = ["--mode", "plain", "--ckpt-every", str(ckpt_every)]
        else:
            rdzv = ["--rdzv-backend=gpuguard", f"--rdzv-endpoint={etcd_host}", f"--rdzv-conf={RDZV_CONF}"]
            mode = []
        job.argv = [
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            *rdzv,
            f"--rdzv-id={name}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2",
            "-m",
            "gpuguard.examples.demo_train",
            "--job-dir",
            str(job.shared / "plain") if seed_recipe else job.job_dir,
            "--steps",
            str(steps),
            "--sleep",
            str(sleep),
            "--out",
            str(job.shared / "out"),
            "--hashes",
            *(["--step-log"] if step_log else []),
            *mode,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GPUGUARD_", "TORCH_DISABLE"))}
        env.update(
            {
                JOB_DIR_ENV: job.job_dir,
                JOB_ID_ENV: name,
                LEDGER_ENV: url,
                LEASE_TTL_ENV: str(lease_ttl),
                PG_TIMEOUT_ENV: str(pg_timeout),
                SNAPSHOT_ROOT_ENV: str(job.shared / "state"),
                "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore",
                "LOGLEVEL": "INFO",
            }
        )
        job.env = env
        try:
            for h in hosts:
                job.start_agent(h)
        except BaseException:
            job.kill_all()
            raise
        return job

    def start_agent(self, host: str) -> Any:
        """A torchrun agent on `host` (a spare joining later, or one of the first hosts)."""
        argv = [console("torchrun"), f"--local-addr={self.cluster.host(host).address}", *self.argv]
        with open(self.log_dir / f"{self.name}-{host}.log", "ab") as log:
            proc = self.cluster.exec(host, argv, env=self.env, inherit_env=False, stdout=log, stderr=log)
        self.procs[host] = proc
        return proc

    # -- observing ------------------------------------------------------------------------------
    def records(self, kind: str) -> list[dict[str, Any]]:
        """The demo's records on the shared storage: `resume`, `final`, `steps` (every rank; `steps` with
        `step_log`) or `hashes` (rank 0)."""
        out: list[dict[str, Any]] = []
        for p in sorted((self.shared / "out").glob(f"{kind}*.jsonl")):
            for line in p.read_text(errors="replace").splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a line half-written when its host lost power
        return out

    def newest_step(self) -> int:
        return max((r["step"] for r in self.records("hashes")), default=0)

    def rank_host(self, rank: int, generation: int) -> str | None:
        """The host whose worker holds `rank` in `generation` (its incarnation record, on its host)."""
        for h in self.procs:
            d = self.outside(h) / "incarnations"
            for p in d.glob("*.json") if d.exists() else []:
                try:
                    doc = json.loads(p.read_text())
                except (OSError, ValueError):
                    continue
                if doc.get("rank") == rank and doc.get("generation") == generation:
                    return h
        return None

    def wait_for(self, predicate: Any, timeout: float, interval: float = 0.1) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(interval)
        return bool(predicate())

    def log(self, host: str) -> str:
        try:
            return (self.log_dir / f"{self.name}-{host}.log").read_text(errors="replace")
        except OSError:
            return ""

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {h}\n{self.log(h)[-tail:]}" for h in self.procs)

    def verify(self, host: str, *extra: str) -> tuple[int, dict[str, Any]]:
        """`gpu-generation verify --deep` on `host`, the frontier states re-hashed on the shared storage."""
        return super().verify(host, "--deep", "--snapshot-root", str(self.shared / "state"), *extra)
