"""Other doctors' findings as vote evidence: a node report's per-GPU verdicts mapped onto ranks.

Pure: takes `gpuguard.node/1` documents (from `gpu-doctor diagnose node --json`) and each rank's
(host, local rank); the GPU index a rank uses is its LOCAL_RANK on the usual launchers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpuguard.foundation.observations import HardwareEvidence

FATAL_VERDICTS = ("reset", "drain")


def hardware_from_node_reports(
    reports: Iterable[Mapping[str, Any]], ranks: Mapping[int, tuple[str, int | None]]
) -> dict[int, tuple[HardwareEvidence, ...]]:
    """rank -> the evidence about its GPU. Unknown shapes are skipped, never fatal."""
    by_gpu: dict[tuple[str, int], list[HardwareEvidence]] = {}
    for doc in reports:
        if not isinstance(doc, Mapping) or doc.get("schema") != "gpuguard.node/1":
            continue
        node = str(doc.get("node", ""))
        for gpu in doc.get("gpus", ()) or ():
            if not isinstance(gpu, Mapping) or not isinstance(gpu.get("index"), int):
                continue
            for ev in gpu.get("evidence", ()) or ():
                if not isinstance(ev, Mapping):
                    continue
                check = str(ev.get("check", ""))
                verdict = str(ev.get("verdict", ""))
                if verdict == "healthy":
                    continue
                kind = (
                    "gpu-lost"
                    if check == "gpu_lost"
                    else "xid"
                    if check.startswith("xid")
                    else "recovery-action"
                    if "recovery" in check
                    else "ecc"
                    if "ecc" in check or "remap" in check
                    else check or "hardware"
                )
                fatal = verdict in FATAL_VERDICTS and kind != "ecc" or kind == "gpu-lost"
                text = f"{node} GPU{gpu['index']}: {ev.get('message', check)} ({verdict})"
                by_gpu.setdefault((node, gpu["index"]), []).append(HardwareEvidence(-1, kind, fatal, text))
    out: dict[int, tuple[HardwareEvidence, ...]] = {}
    for rank, (host, local_rank) in ranks.items():
        if local_rank is None:
            continue
        found: list[HardwareEvidence] = []
        for (node, index), evs in by_gpu.items():
            if index == local_rank and node == host:
                found.extend(HardwareEvidence(rank, e.kind, e.fatal, e.text) for e in evs)
        if found:
            out[rank] = tuple(found)
    return out
