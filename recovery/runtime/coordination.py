"""Where the in-place switch coordinates: one small interface, two transports, chosen from the ledger URL.

The pure decisions (`recovery.runtime.switch`) need the same facts whatever carries them: the survivors'
reports, the coordinator's refusal, an operator's abort, a store through which the next
generation's group forms, and (across hosts) which old incarnations' leases have expired. The
directory transport keeps them under `<job-dir>/coord/inplace/` (one host, or a job dir that
really is shared); the etcd transport (`recovery.runtime.coordination_etcd`) keeps them next to the etcd ledger,
so no host's filesystem coordinates anything and each job dir holds local files only.

Lazy imports (start-up time): torch.distributed only where a group store is made, and the etcd
transport only for an etcd ledger.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import GpuguardError
from gpuguard.foundation.inplace_files import (
    Report,
    abort_requested,
    inplace_dir,
    read_reports,
    request_abort,
    write_report,
)


class Coordination(Protocol):
    """What an in-place switch reads and writes besides the ledger (see the module docstring)."""

    kind: str  # "dir" or "etcd"

    def write_report(self, report: Report) -> bool:
        """Publish a survivor's report of generation G; False when it was fenced (G is no longer
        active, or this incarnation's lease is gone): the writer then must not take part. Where its
        host aggregates (etcd), a report left for another rank to publish is fenced at that write."""

    def aggregate(self, generation: int) -> bool:
        """Publish this host's reports of G when this process is the host's aggregator (etcd: one
        record per host, docs/formats/inplace.md); False when that write was fenced."""

    def read_reports(self, generation: int) -> dict[int, Report]: ...

    def request_abort(self, generation: int, why: str = "operator") -> None: ...

    def abort_requested(self, generation: int) -> bool: ...

    def record_refusal(self, generation: int, doc: dict[str, Any]) -> None: ...

    def refusal(self, generation: int) -> dict[str, Any] | None: ...

    def group_store(self, generation: int, rank: int, timeout_s: float) -> Any:
        """A torch.distributed Store (fresh for `generation`) through which its gloo group forms."""

    def expired(self, incarnation_ids: Iterable[str]) -> frozenset[str]:
        """The incarnations whose lease has expired (each one fenced itself first): gone for sure."""

    def prune(self, below: int) -> int:
        """Forget what generations older than `below` coordinated (etcd: bounded keys); how many went."""

    def close(self) -> None: ...


class DirCoordination:
    """The files of docs/formats/inplace.md under `<job-dir>/coord/inplace/`; no leases."""

    kind = "dir"

    def __init__(self, job_dir: str | os.PathLike[str]) -> None:
        self.job_dir = Path(job_dir)

    def write_report(self, report: Report) -> bool:
        write_report(self.job_dir, report)
        return True

    def aggregate(self, generation: int) -> bool:
        """Each report is its own file in the job dir: nothing to gather."""
        return True

    def read_reports(self, generation: int) -> dict[int, Report]:
        return read_reports(self.job_dir, generation)

    def request_abort(self, generation: int, why: str = "operator") -> None:
        request_abort(self.job_dir, generation, why)

    def abort_requested(self, generation: int) -> bool:
        return abort_requested(self.job_dir, generation)

    def _refused_path(self, generation: int) -> Path:
        return inplace_dir(self.job_dir) / f"g{generation}" / "refused.json"

    def record_refusal(self, generation: int, doc: dict[str, Any]) -> None:
        jobdir.atomic_write_json(self._refused_path(generation), doc)

    def refusal(self, generation: int) -> dict[str, Any] | None:
        path = self._refused_path(generation)
        if not path.exists():
            return None
        try:
            return jobdir.read_json(path)
        except GpuguardError:
            return {"reason": f"{path} unreadable"}

    def group_store(self, generation: int, rank: int, timeout_s: float) -> Any:
        import torch.distributed as dist

        store = dist.FileStore(str(inplace_dir(self.job_dir) / f"g{generation}.store"), -1)
        store.set_timeout(timedelta(seconds=timeout_s))
        return store

    def expired(self, incarnation_ids: Iterable[str]) -> frozenset[str]:
        return frozenset()

    def prune(self, below: int) -> int:
        """The job dir keeps its reports (local files, read by `gpu-recover status`): nothing to bound."""
        return 0

    def close(self) -> None:
        return None


def open_coordination(job_dir: str | os.PathLike[str], ledger_url: str | None, **etcd_options: Any) -> Any:
    """The transport that goes with the ledger: etcd for `etcd://...`, the job directory otherwise."""
    if ledger_url and ledger_url.startswith(("etcd://", "http://")):
        from gpuguard.recovery.runtime.coordination_etcd import EtcdCoordination

        return EtcdCoordination.from_url(ledger_url, **etcd_options)
    return DirCoordination(job_dir)


def wait_until(predicate: Any, timeout_s: float, interval_s: float = 0.01) -> Any:
    """Poll `predicate()` until it returns something truthy or `timeout_s` passes (then its last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got or time.monotonic() >= deadline:
            return got
        time.sleep(interval_s)
