"""What a digest pass measures besides the digest: non-finite counts, replica groups, non-tensor facts.

The soundness checks (`recovery.snapshots.soundness`) ride on the passes that already read every
element of a state (`store.state_digest` for replicated state, `digests.measure` for sharded
state): per tensor a NaN / infinity count, with a fast path (a sum is finite only when every
element is: one reduction, ~0.1-2 ns an element, and a count only when it is not), and plain facts
about the non-tensor state (optimizer step counters, learning rates, the LR scheduler's last lr,
a grad scaler's scale, the data position's keys, RNG present) with a fingerprint of the rest, so
that ranks can be compared.

Lazy imports (start-up time): torch, only inside the functions that measure.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

DATA_KEY = "dataloader"  # where a registered data object's state lives in a state dict (category data-loader)
PER_RANK = (DATA_KEY,)  # top-level keys that may differ between ranks (left out of the fingerprint)


def nonfinite_counts(t: Any) -> tuple[int, int]:
    """(NaN elements, infinite elements) of a floating tensor ((0, 0) for any other)."""
    import torch  # noqa: PLC0415 - lazy: torch only where used

    if not t.is_floating_point() or t.numel() == 0:
        return 0, 0
    total = float(t.sum())  # NaN or inf anywhere makes the sum non-finite; an overflow only costs the count
    if math.isfinite(total):
        return 0, 0
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def replica_group(value: Any) -> tuple[int, bool]:
    """A DTensor's replica group (its mesh coordinate over the non-shard dimensions, flattened: HSDP's
    replicate index) and whether it is the first replica (group 0)."""
    coord = value.device_mesh.get_coordinate() or []
    shape = value.device_mesh.shape
    group = 0
    for c, p, n in zip(coord, value.placements, shape):
        if not p.is_shard():
            group = group * int(n) + int(c)
    return group, group == 0


def add_nonfinite(out: dict[str, dict[str, list[int]]], path: str, group: int, t: Any) -> None:
    """Count `t`'s non-finite elements into `out[path][group]` (nothing added when there are none)."""
    nan, inf = nonfinite_counts(t)
    if nan or inf:
        have = out.setdefault(path, {}).setdefault(str(group), [0, 0])
        have[0] += nan
        have[1] += inf


def non_tensor_facts(
    state: Mapping[str, Any], leaves: Iterable[tuple[str, Any]], *, rng: bool | None = None
) -> dict[str, Any]:
    """Plain facts about a state's non-tensor parts (`soundness.judge` reads them); `leaves`: the
    state's (path, leaf) pairs (`digests.state_leaves`), walked once by the caller's pass."""
    import torch  # noqa: PLC0415 - lazy: torch only where used

    raw = state.get("optim")
    optim: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    steps: set[int] = set()
    for per_param in (optim.get("state") or {}).values():
        if isinstance(per_param, Mapping) and "step" in per_param:
            steps.add(int(_scalar(per_param["step"])))
    groups = optim.get("param_groups") or []
    lrs = [_scalar(g["lr"]) for g in groups if isinstance(g, Mapping) and "lr" in g] or None
    sched = state.get("sched")
    last = sched.get("_last_lr") if isinstance(sched, Mapping) else None
    scaler_path = "scaler" if isinstance(state.get("scaler"), Mapping) else "extra.scaler"
    scaler = state.get("scaler") or (state.get("extra") or {}).get("scaler")
    scale = scaler.get("scale") if isinstance(scaler, Mapping) else None
    data = state.get(DATA_KEY)
    if rng is None:
        rng = isinstance(state.get("rng"), Mapping) and isinstance(state["rng"].get("torch"), torch.Tensor)
    return {
        "optimizer_steps": sorted(steps),
        "lrs": lrs,
        "scheduler_lr": None if last is None else [_scalar(x) for x in last],
        "scaler_scale": None if scale is None else _scalar(scale),
        "scaler_path": f"{scaler_path}.scale",
        "data_keys": sorted(map(str, data)) if isinstance(data, Mapping) and data else None,
        "rng": bool(rng),
        "fingerprint": _fingerprint(leaves),
    }


def _scalar(v: Any) -> Any:
    """A plain number from a Python number or a one-element (D)Tensor."""
    local = v.to_local() if hasattr(v, "to_local") else v
    return local.item() if hasattr(local, "item") else local


def _fingerprint(leaves: Iterable[tuple[str, Any]]) -> str:
    """SHA-256 over the non-tensor leaves (path = repr), the per-rank parts left out."""
    import torch  # noqa: PLC0415 - lazy: torch only where used

    h = hashlib.sha256()
    for path, value in leaves:
        if path.split(".")[0] not in PER_RANK and not isinstance(value, torch.Tensor):
            h.update(f"{path}={value!r}\n".encode())
    return h.hexdigest()
