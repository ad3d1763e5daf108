"""The layout-independent digest of a sharded state: equal at any world size, computed in one pass.

Per tensor, a sum over elements of a 64-bit mix of (global index, value bits), each rank adding its
own chunks (replicas counted once): the sum does not depend on who holds which chunk, so the state
saved by 4 ranks and the state loaded by 3 have the same digest. A restore at another world size
checks the loaded state against the stored chunks read back on their own (`stored_digest_sharded`)
and, when the writer recorded it, against the state as it was in memory.

Lazy imports (start-up time): torch, only inside the functions that hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuguard.foundation.errors import DataError
from gpuguard.generation import manifest as m
from gpuguard.generation.canonical import canonical_bytes
from gpuguard.recovery.snapshots.measure import add_nonfinite, non_tensor_facts, replica_group

M64 = (1 << 64) - 1


_K = (0x1F3D5B79A2C4E6F1, 0x2545F4914F6CDD1D, 0x27D4EB2F165667C5, 0x5851F42D4C957F2D, 0x14057B7EF767814F)


_INTS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def chunk_sum(local: Any, offsets: tuple[int, ...], global_shape: tuple[int, ...]) -> int:
    """Σ mix(global flat index, value bits) over a chunk, mod 2^64 (int64 arithmetic wraps)."""
    import torch  # noqa: PLC0415 - lazy: torch only where used

    t = local.detach().contiguous().cpu()
    if t.numel() == 0:
        return 0
    if t.dtype == torch.bool:
        src = t
    elif t.is_floating_point() or t.element_size() in _INTS:
        src = t.view(getattr(torch, _INTS[t.element_size()]))
    else:  # complex and other exotic types: hash their bytes as int8
        src = t.view(torch.int8)
    h = src.to(torch.int64, copy=True).reshape(-1)  # a copy: the in-place steps below never touch the state
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    idx = torch.zeros((), dtype=torch.int64)
    for d, (o, n) in enumerate(zip(offsets, t.shape)):
        shape = [1] * t.dim()
        shape[d] = n
        idx = idx + ((torch.arange(n, dtype=torch.int64) + o) * strides[d]).view(shape)
    idx = idx.expand(t.shape).reshape(-1) if t.dim() else idx.reshape(1)  # a temporary of ours
    h.mul_(_K[0]).add_(idx.mul_(_K[1])).add_(_K[2])
    h.bitwise_xor_((h >> 31) & ((1 << 33) - 1)).mul_(_K[3])
    h.bitwise_xor_((h >> 29) & ((1 << 35) - 1)).mul_(_K[4])
    h.bitwise_xor_((h >> 32) & ((1 << 32) - 1))
    return int(h.sum()) & M64


def digest_contributions(state: Mapping[str, Any], rank: int) -> dict[str, list[Any]]:
    """This rank's additive share of the state digest: {path: [dtype, shape, sum]} for the tensor
    chunks it is the first replica of (plain, replicated tensors: rank 0). Non-tensor values are
    not in it: their stored bytes are BLAKE3-verified by the manifest, and a load does not reshard them."""
    contrib: dict[str, list[Any]] = measure(state, rank, sums="first", finite=False, facts=False)["contrib"]
    return contrib


def measure(
    state: Mapping[str, Any],
    rank: int,
    *,
    sums: str = "first",
    finite: bool = True,
    facts: bool = True,
    rng: bool | None = None,
) -> dict[str, Any]:
    """One walk over this rank's part of a state, for the digest and the soundness checks at once.

    `sums`: "first" = this rank's share of the state digest (`contrib`: the chunks it is the first
    replica of); "all" = also every chunk it holds, replicas included, keyed `path@offsets` with
    its replica group (`sums`: what `soundness.judge` compares across replicas); "none" = neither.
    `finite`: NaN / infinity counts per path and replica group (`nonfinite`, only the non-zero
    ones). `facts`: the non-tensor facts (`measure.non_tensor_facts`; `rng`: whether this rank's
    RNG state goes with the snapshot). Replica group: a DTensor's coordinate over its non-shard
    mesh dimensions (HSDP's replicate index); a plain tensor is held whole by every rank, so its
    group is the rank."""
    import torch  # noqa: PLC0415 - lazy: torch only where used
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - lazy: torch only where used

    leaves = state_leaves(state)
    contrib: dict[str, list[Any]] = {}
    held: dict[str, list[Any]] = {}
    nonfinite: dict[str, dict[str, list[int]]] = {}
    tensors = elements = 0
    for path, value in leaves:
        if isinstance(value, DTensor):
            local = value.to_local()
            group, first = replica_group(value)
            chunks = [tuple(int(x) for x in ch.offsets) for ch in value.__create_chunk_list__()]
        elif isinstance(value, torch.Tensor):
            local, group, first, chunks = value, rank, rank == 0, [(0,) * value.dim()]
        else:
            continue
        shape = tuple(int(x) for x in value.shape)
        total = 0
        for offsets in chunks:
            if sums == "all" or (sums == "first" and first):
                s = chunk_sum(local, offsets, shape)
                total += s if first else 0
                if sums == "all":
                    held[f"{path}@{','.join(map(str, offsets))}"] = [group, format(s, "016x")]
        contrib[path] = [str(value.dtype), list(shape), total & M64]
        tensors += 1
        elements += local.numel()
        if finite:
            add_nonfinite(nonfinite, path, group, local)
    return {
        "contrib": contrib if sums != "none" else None,
        "sums": held,
        "nonfinite": nonfinite,
        "tensors": tensors,
        "elements": elements,
        "facts": non_tensor_facts(state, leaves, rng=rng) if facts else None,
    }


def state_leaves(state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(path, leaf) of a nested state in a fixed order; a path joins the keys and list indexes with
    dots (`optim.state.0.weight.exp_avg`): the names the state digest and the in-place reshard share."""
    out: list[tuple[str, Any]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k in sorted(value, key=str):
                walk(f"{prefix}.{k}" if prefix else str(k), value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            out.append((prefix, value))

    walk("", state)
    return out


def stored_contributions(directory: Path, rank: int, world: int) -> dict[str, list[Any]]:
    """The same share computed from a snapshot's stored chunks (every `world`-th tensor entry of
    the manifest, from `rank`): each chunk read back (`torch.load(weights_only=True)`), on its own."""
    import io  # noqa: PLC0415 - lazy: with torch

    import torch  # noqa: PLC0415 - lazy: torch only where used

    manifest = m.load_manifest(directory)
    entries = sorted((e for e in manifest.entries if e.spec.kind == "tensor"), key=lambda e: e.key)
    tensors: dict[str, list[Any]] = {}
    for e in entries[rank::world]:
        s = e.spec
        if Path(s.file).is_absolute() or ".." in Path(s.file).parts:
            raise DataError(f"{s.file}: storage path escapes the checkpoint directory")
        with open(directory / s.file, "rb") as fh:
            fh.seek(s.byte_offset)
            data = fh.read(s.byte_length)
        t = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        shape = tuple(s.global_shape or ())
        have = tensors.setdefault(s.fqn, [str(t.dtype), list(shape), 0])
        have[2] = (have[2] + chunk_sum(t, tuple(s.chunk_offsets or (0,) * t.dim()), shape)) & M64
    return tensors


def combine_contributions(parts: list[Mapping[str, list[Any]]]) -> str:
    """The state digest from every rank's share: SHA-256 of the canonical sums (equal at any world size)."""
    tensors: dict[str, list[Any]] = {}
    for p in parts:
        for k, (dtype, shape, s) in p.items():
            have = tensors.setdefault(k, [dtype, list(shape), 0])
            have[2] = (have[2] + int(s)) & M64
    doc = {k: [d, sh, format(s, "016x")] for k, (d, sh, s) in sorted(tensors.items())}
    return hashlib.sha256(canonical_bytes(doc)).hexdigest()


def _all_combined(mine: Mapping[str, list[Any]], group: Any) -> str:
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, dict(mine), group=group)
    return combine_contributions(every)


def state_digest_sharded(state: Mapping[str, Any], group: Any = None) -> str:
    """Collective over `group`: the layout-independent digest of a live (sharded) state."""
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    return _all_combined(digest_contributions(state, dist.get_rank(group)), group)


def measured_sharded(state: Mapping[str, Any], group: Any = None) -> tuple[str, list[dict[str, Any]]]:
    """Collective over `group`: the layout-independent digest of a live (sharded) state and, from
    the same pass, every rank's NaN / infinity counts (`measure(finite=True)`, rank order)."""
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    mine = measure(state, dist.get_rank(group), sums="first", finite=True, facts=False)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return combine_contributions([m["contrib"] for m in every]), every


def stored_digest_sharded(directory: str | Path, group: Any = None) -> str:
    """Collective over `group` (any world size): the same digest of a snapshot's stored state, each
    rank reading a share of its chunks."""
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    mine = stored_contributions(Path(directory), dist.get_rank(group), dist.get_world_size(group))
    return _all_combined(mine, group)
