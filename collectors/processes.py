"""Job-process collector: torchrun agents and their workers on this node, via psutil.

A worker is any process whose environment holds `TORCHELASTIC_RUN_ID` (torchrun sets it for every
worker); an agent is a process running `torchrun` / `torch.distributed.run`. Reading another user's
environment is usually refused: such processes are counted, not guessed.

Lazy imports (start-up time): psutil, only when processes are listed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

SCHEMA = "gpuguard.processes/1"
_AGENT_MARKERS = ("torchrun", "torch.distributed.run", "torch/distributed/run.py")


@dataclass(frozen=True)
class JobProcess:
    pid: int
    ppid: int
    role: str  # agent | worker
    run_id: str | None
    rank: int | None
    local_rank: int | None
    status: str  # psutil status: running, sleeping, disk-sleep, zombie, stopped, ...
    cpu_percent: float | None
    rss_bytes: int | None
    age_s: float
    cmdline: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def collect(*, run_id: str | None = None, cpu_interval: float = 0.0) -> dict[str, Any]:
    """Every torchrun agent and worker visible here (`gpuguard.processes/1`)."""
    import psutil  # lazy: only the node/job commands need it

    now = time.time()
    found: list[JobProcess] = []
    unreadable = 0
    for proc in psutil.process_iter(["pid", "ppid", "name", "cmdline", "status", "create_time"]):
        info = proc.info
        cmd = " ".join(info.get("cmdline") or [])[:300]
        is_agent = any(m in cmd for m in _AGENT_MARKERS)
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.ZombieProcess):
            env = None
            if not is_agent:
                unreadable += 1
        except (psutil.NoSuchProcess, OSError):
            continue
        rid = (env or {}).get("TORCHELASTIC_RUN_ID")
        is_worker = rid is not None and "LOCAL_RANK" in (env or {}) and not is_agent
        if not (is_agent or is_worker):
            continue
        if run_id is not None and rid != run_id:
            continue
        try:
            cpu = proc.cpu_percent(interval=cpu_interval) if cpu_interval else proc.cpu_percent(None)
            rss = proc.memory_info().rss
        except (psutil.Error, OSError):
            cpu, rss = None, None
        found.append(
            JobProcess(
                pid=info["pid"],
                ppid=info.get("ppid") or 0,
                role="agent" if is_agent else "worker",
                run_id=rid,
                rank=_int((env or {}).get("RANK")),
                local_rank=_int((env or {}).get("LOCAL_RANK")),
                status=str(info.get("status")),
                cpu_percent=cpu,
                rss_bytes=rss,
                age_s=max(0.0, now - (info.get("create_time") or now)),
                cmdline=cmd,
            )
        )
    found.sort(key=lambda p: (p.role != "agent", p.run_id or "", p.rank if p.rank is not None else -1, p.pid))
    return {
        "schema": SCHEMA,
        "status": "ok",
        "processes": [p.to_json() for p in found],
        "unreadable_environments": unreadable,
    }
