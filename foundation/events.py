"""The structured event every log parser returns (`gpuguard.events/1`).

One record type for kernel Xid lines, NCCL warnings, watchdog timeouts, gloo errors, torchrun agent
events and CUDA errors, so the node verdict, the job vote and the CLI consume one shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

EVENTS_SCHEMA = "gpuguard.events/1"


@dataclass(frozen=True)
class Event:
    """One thing a log line says.

    kind: `xid`, `sxid`, `gpu_lost`, `gpu_fault` (a GPU fault without an Xid: `fields["fault"]` names its
    entry in `gpu_faults.FAULTS`), `nccl_warn`, `watchdog_timeout`, `gloo_error`, `worker_failure`, ...
    line: 1-based line number in its source. fields: the per-kind fields of the JSON schema
    (e.g. `xid`, `pci_bus_id`, `pid`, `process` for `xid`). timestamp: seconds since the epoch when
    the line carries an absolute time, else None. diagnosis: what it means and what to do.
    """

    kind: str
    line: int
    text: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    timestamp: float | None = None
    source: str | None = None
    severity: str = "info"  # info | warning | critical
    diagnosis: str = ""

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind, "line": self.line}
        doc.update(self.fields)
        doc["severity"] = self.severity
        doc["diagnosis"] = self.diagnosis
        if self.timestamp is not None:
            doc["timestamp"] = self.timestamp
        if self.source is not None:
            doc["source"] = self.source
        doc["text"] = self.text
        return doc
