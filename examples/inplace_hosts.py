"""The in-place demo job on separate hosts: one worker per host, etcd ledger, nothing shared but etcd.

`HostJob.launch(cluster, ["h1", "h2", "h3"], ...)` takes any cluster with the `gpuguard.testhosts`
shape (`exec`, `run`, `host(name).address/.hostdir`, `job_dir`, `etcd_url`), duck-typed so the
harness layers stay independent. It initialises the ledger on the first host, gives every host's
(private) job directory the job's identity and signing key, as a deployment would hand out a
secret, and starts `examples.inplace_train` on each host with RANK / WORLD_SIZE / MASTER_ADDR as the
single-host launcher does. The first (restart-path) activation uses a TCPStore served by rank 0;
every in-place switch after it coordinates through etcd only (`recovery.coord_etcd`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.examples.inplace_train import FAULTS_ENV
from gpuguard.foundation.env import JOB_DIR_ENV, JOB_ID_ENV, LEASE_TTL_ENV, LEDGER_ENV, PG_TIMEOUT_ENV

MASTER_PORT = 29500
LEDGER_PROBE = (
    "import json, sys\n"
    "from gpuguard.generation.ledger_open import open_ledger\n"
    "led = open_ledger(sys.argv[1], sys.argv[2], timeout=5.0)\n"
    "hist = led.history()\n"
    "doc = {'generations': led.generations(), 'fenced': led.fenced_count(), 'history': [], 'commits': {}}\n"
    "for c in hist:\n"
    "    doc['history'].append({'generation': c.generation, 'reason': c.reason, 'frontier': c.frontier.step,\n"
    "        'quiescence': c.quiescence, 'evidence': list(c.quiescence_evidence),\n"
    "        'extra': json.loads(json.dumps(c.extra, default=dict)),\n"
    "        'members': [{'rank': m.rank, 'id': m.incarnation.id, 'host': m.incarnation.host} for m in c.members]})\n"
    "    doc['commits'][c.generation] = [[r.rank, r.incarnation_id, r.step] for r in led.commits(c.generation)[0]]\n"
    "print(json.dumps(doc))\n"
)


def _console(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


@dataclass
class HostJob:
    """One job: a worker per host, its logs outside the hosts, its job dir private on each host."""

    cluster: Any
    hosts: list[str]
    name: str
    url: str
    log_dir: Path
    procs: dict[int, Any] = field(default_factory=dict)
    started: float = 0.0

    @property
    def job_dir(self) -> str:
        """The job directory: the same path on every host, its own contents on each."""
        return f"{self.cluster.job_dir}/{self.name}"

    def outside(self, host: str) -> Path:
        """That host's job directory as this (outside) process sees it."""
        return Path(self.cluster.host(host).hostdir) / "job" / self.name

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
        cluster.run(
            first,
            [_console("gpu-generation"), "init", "--job-dir", job.job_dir, "--ledger", url, "--job-id", name],
            timeout=60,
            check=True,
        )
        src = job.outside(first)
        for h in hosts[1:]:  # the job's identity and key on every host: a deployment's secret, not coordination
            dst = job.outside(h)
            dst.mkdir(parents=True, exist_ok=True)
            for f in ("generation.key", "ledger.url"):
                shutil.copy2(src / f, dst / f)
            os.chmod(dst / "generation.key", 0o600)
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

    def wait(self, ranks: list[int], timeout: float) -> dict[int, int | None]:
        """Exit codes of these ranks' workers once all have exited, or None for one still there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.procs[r].poll() is None for r in ranks):
            time.sleep(0.05)
        return {r: self.procs[r].poll() for r in ranks}

    def result(self, rank: int) -> dict[str, Any] | None:
        path = self.outside(self.hosts[rank]) / "results" / f"{rank}.json"
        try:
            return json.loads(path.read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None

    def switch_records(self, host: str) -> list[dict[str, Any]]:
        d = self.outside(host) / "coord" / "inplace"
        out = []
        for p in sorted(d.glob("switch-g*-r*.json")) if d.exists() else []:
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def log(self, rank: int) -> str:
        try:
            return (self.log_dir / f"{self.name}-{self.hosts[rank]}.log").read_text(errors="replace")
        except OSError:
            return ""

    def ledger(self, host: str) -> dict[str, Any]:
        """History, commits per generation and the fenced count, read from etcd on `host`."""
        out = self.cluster.run(host, [sys.executable, "-c", LEDGER_PROBE, self.job_dir, self.url], timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"ledger probe on {host}: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    def verify(self, host: str) -> tuple[int, dict[str, Any]]:
        """`gpu-generation verify --ledger etcd://... --json` on `host`: (exit code, document)."""
        out = self.cluster.run(
            host,
            [_console("gpu-generation"), "verify", "--job-dir", self.job_dir, "--ledger", self.url, "--json"],
            timeout=60,
        )
        try:
            doc = json.loads(out.stdout)
        except ValueError:
            doc = {"stdout": out.stdout[-2000:], "stderr": out.stderr[-2000:]}
        return out.returncode, doc

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a frozen host's process: the harness tears it down
                pass

    def __enter__(self) -> HostJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
