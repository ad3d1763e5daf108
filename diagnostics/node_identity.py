"""Whose evidence is it: the boot and the GPU (UUID, board serial) a piece of evidence was seen with.

Why: a verdict outlives the hardware it was about. A sweep keeps kernel-log events for hours, so a GPU
that has since been swapped (another serial at the same PCI address) or a node that has since rebooted
would inherit an old decision, as NVIDIA's own drain marker does (NVRx PR #383: the marker "carries no
allocation identity"). Each retained event carries the identity it was seen with (`seen_boot_id`,
`seen_gpu_uuid`, `seen_gpu_serial`); against the node's identity now, evidence of another boot or of
another GPU is *stale*: reported, never counted, so it can never drive a drain.

Pure: identities in, reasons out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any, NamedTuple

from gpuguard.foundation.events import Event

SEEN_BOOT = "seen_boot_id"
SEEN_UUID = "seen_gpu_uuid"
SEEN_SERIAL = "seen_gpu_serial"


class GpuIdentity(NamedTuple):
    """A GPU as NVML (or a pasted report) names it now (a NamedTuple: cheaper to create at import than a
    dataclass, on the path of every `diagnose node`)."""

    uuid: str | None = None
    serial: str | None = None


def gpu_identities(snapshot: Mapping[str, Any] | None) -> dict[str, GpuIdentity]:
    """PCI address -> the GPU's identity, for the GPUs of a snapshot that name one."""
    out: dict[str, GpuIdentity] = {}
    for gpu in (snapshot or {}).get("gpus") or []:
        pci = gpu.get("pci_bus_id")
        if pci and (gpu.get("uuid") or gpu.get("serial")):
            out[str(pci)] = GpuIdentity(gpu.get("uuid"), gpu.get("serial"))
    return out


def seen_with(event: Event, boot_id: str | None, gpus: Mapping[str, GpuIdentity]) -> dict[str, str]:
    """The identity fields to keep with an event seen now (boot, and its GPU's UUID and serial if known)."""
    out: dict[str, str] = {}
    if boot_id:
        out[SEEN_BOOT] = boot_id
    ident = gpus.get(str(event.fields.get("pci_bus_id") or ""))
    if ident is not None:
        if ident.uuid:
            out[SEEN_UUID] = ident.uuid
        if ident.serial:
            out[SEEN_SERIAL] = ident.serial
    return out


def stale_reason(event: Event, boot_id: str | None, gpus: Mapping[str, GpuIdentity]) -> str | None:
    """Why an event no longer speaks for the node as it is now, or None when it still does.

    Stale: seen in another boot than `boot_id`, or about a GPU whose serial / UUID at that PCI address is
    now another one (replaced). Unknown identities (none recorded, or none known now) are not stale:
    staleness needs proof, as a verdict does."""
    f = event.fields
    seen_boot = f.get(SEEN_BOOT)
    if boot_id and seen_boot and seen_boot != boot_id:
        return f"seen in an earlier boot ({str(seen_boot)[:8]}, now {boot_id[:8]})"
    now = gpus.get(str(f.get("pci_bus_id") or ""))
    if now is None:
        return None
    if f.get(SEEN_SERIAL) and now.serial and f[SEEN_SERIAL] != now.serial:
        return f"about GPU serial {f[SEEN_SERIAL]}, replaced since (serial {now.serial} at {f.get('pci_bus_id')})"
    if f.get(SEEN_UUID) and now.uuid and f[SEEN_UUID] != now.uuid:
        return f"about {f[SEEN_UUID]}, replaced since ({now.uuid} at {f.get('pci_bus_id')})"
    return None


def evidence_range(events: Iterable[Event]) -> tuple[float | None, float | None]:
    """(first, last) time of the evidence: each event's own time, else when a sweep saw it."""
    times = [
        t
        for t in (e.timestamp if e.timestamp is not None else e.fields.get("seen_at") for e in events)
        if isinstance(t, (int, float))
    ]
    return (min(times), max(times)) if times else (None, None)


def iso(t: float | None) -> str | None:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds") if t is not None else None
