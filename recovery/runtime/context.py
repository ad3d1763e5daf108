"""What every part of one incarnation shares: who it is, where its files are, its ledger, lease, counters and log.

The runtime is composed of parts that each do one thing (the coordinator of a restart, the
per-rank state, the in-place switch); they all need the same few facts and handles. `Context`
holds them, so no part reaches into another's private members:

- who: this process's incarnation, its rank and world size (an in-place switch renumbers them)
  and the generation it runs in, with what torchrun said about the launch (`Launch`);
- where: the job directory (this host's records) and the snapshot root (the shared storage);
- the ledger (opened lazily, reopened once the coordinator has created the signing key), the
  in-place coordination transport and, next to an etcd ledger, the incarnation's lease;
- the counters, the log, the fault hook of the tests and demos.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from gpuguard.foundation import jobdir
from gpuguard.foundation.env import JOB_ID_ENV, LEASE_TTL_ENV
from gpuguard.foundation.errors import EXIT_REFUSED, EXIT_USAGE, GpuguardError
from gpuguard.generation.keys import key_path
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.records import Incarnation
from gpuguard.recovery.runtime.attempt import Attempt
from gpuguard.recovery.runtime.coordination import open_coordination
from gpuguard.recovery.runtime.lease import DEFAULT_TTL_S, Heartbeat, LeaseTiming
from gpuguard.recovery.runtime.refusals import leave


@dataclass(frozen=True)
class Launch:
    """What torchrun told this process about its launch (its environment), read once."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int
    use_agent_store: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Launch:
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            master_addr, master_port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        except (KeyError, ValueError) as exc:
            raise GpuguardError(f"not started by torchrun (missing or bad {exc})", exit_code=EXIT_USAGE) from None
        return cls(
            rank=rank,
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", rank)),
            master_addr=master_addr,
            master_port=master_port,
            run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True",
        )


@dataclass
class Counters:
    commits: int = 0
    fenced_commits: int = 0
    snapshots: int = 0
    fenced_snapshots: int = 0
    snapshot_errors: int = 0
    skipped_snapshots: int = 0
    commit_s: float = 0.0  # wall time spent in commit() (main thread)
    marks_s: float = 0.0  # wall time in begin_step() and the collective marks' enter/exit (main thread)
    snapshot_cpu_s: float = 0.0  # CPU time of the snapshot writer thread


class Context:
    """The shared facts and handles of one incarnation (see the module docstring)."""

    def __init__(
        self,
        job_dir: str | Path,
        launch: Launch,
        *,
        ledger_url: str | None = None,
        snapshot_root: str | Path | None = None,
        lease_ttl_s: float | None = None,
        log: Callable[[str], None] | None = None,
        fault_hook: Callable[[str, int], None] | None = None,
    ) -> None:
        self.job_dir = Path(os.path.realpath(job_dir))  # followed once; nothing inside it is
        # where snapshots and checkpoints live: the job dir on one host, shared storage across hosts
        self.snapshot_root = Path(os.path.realpath(jobdir.snapshot_root(job_dir, snapshot_root)))
        self.launch = launch
        self.rank, self.world_size = launch.rank, launch.world_size
        self.ledger_url = ledger_url
        self.fault_hook = fault_hook
        self._log = log
        self.incarnation = Incarnation.current()
        self.job = jobdir.ensure_job(self.job_dir, job_id=os.environ.get(JOB_ID_ENV) or None)
        self.generation: int | None = None
        self.frontier_step = -1  # the certified frontier of this generation: pruning keeps its snapshot
        self.attempt: Attempt | None = None
        self.counters = Counters()
        self._ledger: Any = None
        self._writer_ledger: Any = None
        self.write_incarnation()
        ttl = lease_ttl_s if lease_ttl_s is not None else float(os.environ.get(LEASE_TTL_ENV, DEFAULT_TTL_S))
        self.lease_timing = LeaseTiming(ttl)
        self.coord = open_coordination(self.job_dir, self.ledger_url)
        self.lease: Heartbeat | None = None
        if self.coord.kind == "etcd":  # other hosts cannot see this process: its lease speaks for it
            self.lease = self.coord.hold_lease(
                self.incarnation.id,
                {
                    "rank": self.rank,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "start_time": self.incarnation.start_time,
                },
                self.lease_timing,
                self.fenced,
            )

    # ------------------------------------------------------------------ the ledger
    def ledger(self) -> Any:
        """This incarnation's ledger handle; reopened once if it was opened before the key existed."""
        if self._ledger is not None and self._ledger.key is None and self.has_key():
            self._ledger = None
        if self._ledger is None:
            self._ledger = open_ledger(self.job_dir, self.ledger_url)
        return self._ledger

    def has_key(self) -> bool:
        return key_path(self.job_dir).exists()

    def forget_ledger(self) -> None:
        """Drop the handle (the job was just initialised: the next call opens it with the key)."""
        self._ledger = None

    def still_current(self) -> bool:
        """The snapshot writer's check before it publishes: the lease is provably alive and this
        generation is still the active one (a ledger handle of the writer thread's own)."""
        if self.lease is not None and not self.lease.valid():
            return False
        if self._writer_ledger is None:
            self._writer_ledger = open_ledger(self.job_dir, self.ledger_url)
        active = self._writer_ledger.active()
        return active is not None and active.generation == self.generation

    # ------------------------------------------------------------------ the lease and refusals
    def require_lease(self, what: str) -> None:
        """Before a write: fence (exit 4) if the lease cannot be proved alive."""
        if self.lease is not None:
            self.lease.require(what)

    def fenced(self, why: str) -> NoReturn:
        """The self-fence: this incarnation may no longer be alive in etcd's eyes, so it writes
        nothing more and leaves at once (the process's group sockets die with it). Exit status 4."""
        leave(self.rank, self.incarnation.id, "fenced itself", why)

    def refuse(self, verb: str, why: object, code: int = EXIT_REFUSED) -> NoReturn:
        leave(self.rank, self.incarnation.id, verb, why, code)

    # ------------------------------------------------------------------ records, log, faults
    def write_incarnation(self, **extra: Any) -> None:
        launch = self.launch
        rec = jobdir.IncarnationRecord(
            incarnation=self.incarnation.to_dict(),
            rank=self.rank,
            local_rank=launch.local_rank,
            world_size=self.world_size,
            generation=self.generation,
            agent_pid=os.getppid(),
            run_id=launch.run_id,
            master_addr=launch.master_addr,
            master_port=launch.master_port,
            restart_count=launch.restart_count,
            attempt=self.attempt.token if self.attempt else "",
            extra=extra,
            uid=os.getuid(),
        )
        jobdir.write_incarnation(self.job_dir, rec)

    def log(self, msg: str) -> None:
        if self._log is not None:
            self._log(msg)
        else:
            print(f"[gpuguard rank {self.rank}] {msg}", file=sys.stderr, flush=True)

    def fault(self, point: str, step: int) -> None:
        """Call the test/demo fault hook at a named point (no-op without one)."""
        if self.fault_hook is not None:
            self.fault_hook(point, step)

    def close(self) -> None:
        """Leave the host's lease: a clean exit deletes this incarnation's key at once."""
        self.coord.close()
