"""What every demo job on namespace hosts shares: where its files are, its ledger, verify, teardown.

`examples.inplace_hosts.HostJob` (one in-place worker per host) and
`examples.restart_hosts.RestartHostJob` (one torchrun agent per host) both build on `HostJobBase`.
The cluster is duck-typed (`run`, `host(name).hostdir`, `job_dir`): any cluster with the
`gpuguard.testhosts` shape.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.foundation.steplog import committed_steps

LEDGER_PROBE = (
    "import json, sys\n"
    "from gpuguard.generation.ledger_open import open_ledger\n"
    "led = open_ledger(sys.argv[1], sys.argv[2], timeout=5.0)\n"
    "hist = led.history()\n"
    "doc = {'generations': led.generations(), 'fenced': led.fenced_count(), 'history': [], 'frontiers': {}}\n"
    "for c in hist:\n"
    "    doc['history'].append({'generation': c.generation, 'reason': c.reason, 'frontier': c.frontier.step,\n"
    "        'quiescence': c.quiescence, 'evidence': list(c.quiescence_evidence),\n"
    "        'extra': json.loads(json.dumps(c.extra, default=dict)),\n"
    "        'members': [{'rank': m.rank, 'id': m.incarnation.id, 'host': m.incarnation.host} for m in c.members]})\n"
    "    f = led.frontier_record(c.generation)\n"
    "    doc['frontiers'][c.generation] = None if f is None else [f.step, f.evidence, f.by]\n"
    "print(json.dumps(doc))\n"
)


def console(name: str) -> str:
    """A console script of this Python's environment (gpu-generation, torchrun)."""
    return str(Path(sys.executable).with_name(name))


@dataclass
class HostJobBase:
    """One job: its processes (keyed by rank or by host), its logs outside the hosts, its job dir
    private on each host, its ledger in etcd."""

    cluster: Any
    hosts: list[str]
    name: str
    url: str
    log_dir: Path
    procs: dict[Any, Any] = field(default_factory=dict)

    @property
    def job_dir(self) -> str:
        """The job directory: the same path on every host, its own contents on each."""
        return f"{self.cluster.job_dir}/{self.name}"

    def outside(self, host: str) -> Path:
        """That host's job directory as this (outside) process sees it."""
        return Path(self.cluster.host(host).hostdir) / "job" / self.name

    def init_ledger(self, to_hosts: list[str]) -> None:
        """`gpu-generation init` on the first host, then the job's identity and signing key (0600) on
        each of `to_hosts`: a deployment's secret handed out, not coordination."""
        first = self.hosts[0]
        argv = [console("gpu-generation"), "init", "--job-dir", self.job_dir, "--ledger", self.url]
        self.cluster.run(first, [*argv, "--job-id", self.name], timeout=60, check=True)
        src = self.outside(first)
        for h in to_hosts:
            dst = self.outside(h)
            dst.mkdir(parents=True, exist_ok=True)
            for f in ("generation.key", "ledger.url", "job.json"):
                if (src / f).exists():
                    shutil.copy2(src / f, dst / f)
            os.chmod(dst / "generation.key", 0o600)

    def wait(self, keys: list[Any], timeout: float) -> dict[Any, int | None]:
        """Exit codes of these processes once all have exited, or None for one still there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.procs[k].poll() is None for k in keys):
            time.sleep(0.05)
        return {k: self.procs[k].poll() for k in keys}

    def ledger(self, host: str) -> dict[str, Any]:
        """History, frontier records and the fenced count, read from etcd on `host`; and `commits`: every
        commit any host's step records hold, per generation (a commit is local: the ledger keeps one
        frontier record per generation, not a record per rank-step)."""
        out = self.cluster.run(host, [sys.executable, "-c", LEDGER_PROBE, self.job_dir, self.url], timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"ledger probe on {host}: {out.stderr[-2000:]}")
        doc: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        doc["commits"] = self.commits()
        return doc

    def commits(self) -> dict[str, list[list[Any]]]:
        """generation (as a JSON key) -> [rank, incarnation, step] of every commit in the hosts' step records."""
        out: dict[str, list[list[Any]]] = {}
        for h in self.hosts:
            for c in committed_steps(self.outside(h)):
                out.setdefault(str(c.generation), []).append([c.rank, c.incarnation, c.step])
        return out

    def verify(self, host: str, *extra: str) -> tuple[int, dict[str, Any]]:
        """`gpu-generation verify --ledger etcd://... --json [extra]` on `host`: (exit code, document)."""
        argv = [console("gpu-generation"), "verify", "--job-dir", self.job_dir, "--ledger", self.url, "--json"]
        out = self.cluster.run(host, [*argv, *extra], timeout=90)
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

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
