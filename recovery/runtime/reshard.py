"""The in-place switch with sharded state: survivors keep their shards in memory and move the lost ones
peer to peer (docs/formats/inplace.md, "Sharded state").

With FSDP2 / HSDP a lost rank takes its shards with it; with replica groups (HSDP) another rank still
holds each of them in memory. At every commit a survivor remembers its own chunks (`remember`: local
copies, no hashing on the training path). When the group fails it reports, per remembered step, each
chunk it holds with its additive sum (`chunk_sums`, the same mixing as the layout-independent state
digest of `recovery.snapshots.sharded`). The coordinator (`recovery.runtime.switch.agree_on_sharded_state`)
checks that replicas agree and that the survivors' chunks cover every tensor, and certifies the
digest those chunks make together. After the new group forms and `build()` made the model over the
new world, `transfer` executes `generation.ownership.plan_reshard(..., in_memory=True)`: each new
rank copies what it already holds and receives the rest from the lowest surviving holder (gloo
isend/irecv); the filled state must have the certified digest before the first step.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuguard.foundation.errors import DataError
from gpuguard.generation.ownership import ChunkRead
from gpuguard.recovery.snapshots import digests


@dataclass(frozen=True)
class Remembered:
    """One committed step of this rank's sharded state, in memory.

    chunks: chunk key (`path@offsets`, global coordinates) -> a local copy of the chunk;
    shapes: chunk key -> the tensor's global shape; others: path -> a non-tensor leaf (param groups,
    the scheduler, extra), each rank's own copy (every rank holds the same); initial: the optimizer
    had not stepped, so its state is not here and a freshly built optimizer is it (the initial state)."""

    chunks: Mapping[str, Any]
    shapes: Mapping[str, tuple[int, ...]]
    others: Mapping[str, Any]
    initial: bool = False

    def held(self) -> dict[str, tuple[int, ...]]:
        """chunk key -> local sizes: what this rank holds (`layout_from_keys`)."""
        return {k: tuple(int(s) for s in t.shape) for k, t in self.chunks.items()}


def _key(path: str, offsets: Sequence[int]) -> str:
    return f"{path}@{','.join(str(int(o)) for o in offsets)}"


def tensor_chunks(path: str, value: Any) -> list[tuple[str, Any, tuple[int, ...]]]:
    """(chunk key, local tensor, global shape) of a tensor leaf: a DTensor's own chunk (FSDP2 / HSDP:
    one per rank, possibly empty), a plain tensor whole (every rank holds it)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - lazy: torch only where used

    if isinstance(value, DTensor):
        chunks = value.__create_chunk_list__()
        if len(chunks) != 1:
            raise DataError(f"{path}: {len(chunks)} chunks on one rank (only one per rank can move in place)")
        return [(_key(path, chunks[0].offsets), value.to_local(), tuple(int(s) for s in value.shape))]
    return [(_key(path, (0,) * value.dim()), value, tuple(int(s) for s in value.shape))]


def remember(state: Mapping[str, Any], *, initial: bool = False) -> Remembered:
    """A detached copy, in host memory, of this rank's part of a sharded state (`Runtime.sharded_state()`);
    `initial`: the state of an optimizer that has not stepped (see `Remembered`)."""
    import torch  # noqa: PLC0415 - lazy: torch only where used

    chunks: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    others: dict[str, Any] = {}
    for path, value in digests.state_leaves(state):
        if isinstance(value, torch.Tensor):
            for key, local, shape in tensor_chunks(path, value):
                # host memory: a device copy per kept step would cost accelerator memory the job needs
                chunks[key] = local.detach().to("cpu", copy=True)
                shapes[key] = shape
        else:
            others[path] = copy.deepcopy(value)
    return Remembered(chunks, shapes, others, initial)


def chunk_sums(mem: Remembered) -> dict[str, list[Any]]:
    """chunk key -> [dtype, global shape, local sizes, sum as 16 hex digits]: what a survivor reports."""
    out: dict[str, list[Any]] = {}
    for key, t in sorted(mem.chunks.items()):
        offsets = tuple(int(x) for x in key.rpartition("@")[2].split(",") if x != "")
        shape = mem.shapes[key]
        out[key] = [str(t.dtype), list(shape), list(t.shape), format(digests.chunk_sum(t, offsets, shape), "016x")]
    return out


def digest_of(chunks: Mapping[str, Sequence[Any]]) -> str:
    """The layout-independent state digest of a set of distinct chunks (`chunk_sums` entries, any
    holders): equal to `recovery.snapshots.digests.state_digest_sharded` of the state they make up."""
    per_path: dict[str, list[Any]] = {}
    for key, (dtype, shape, _sizes, total) in sorted(chunks.items()):
        path = key.rpartition("@")[0]
        have = per_path.setdefault(path, [dtype, list(shape), 0])
        have[2] = (have[2] + int(str(total), 16)) & digests.M64
    return digests.combine_contributions([per_path])


def held_by(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """chunk key -> local sizes of a live state, without copying anything."""
    import torch  # noqa: PLC0415 - lazy: torch only where used

    out: dict[str, tuple[int, ...]] = {}
    for path, value in digests.state_leaves(state):
        if isinstance(value, torch.Tensor):
            for key, local, _shape in tensor_chunks(path, value):
                out[key] = tuple(int(s) for s in local.shape)
    return out


def _box(t: Any, offsets: Sequence[int], region_offsets: Sequence[int], sizes: Sequence[int]) -> Any:
    """The view of local chunk `t` (starting at global `offsets`) covering a global region."""
    view = t
    for d, (o, ro, n) in enumerate(zip(offsets, region_offsets, sizes)):
        view = view.narrow(d, int(ro) - int(o), int(n))
    return view


def _offsets(key: str) -> tuple[int, ...]:
    return tuple(int(x) for x in key.rpartition("@")[2].split(",") if x != "")


@dataclass(frozen=True)
class TransferStats:
    """What `transfer` did on this rank."""

    copied: int  # elements copied from this rank's own memory
    received: int  # elements received from peers
    sent: int  # elements sent to peers


def transfer(
    plan: Sequence[ChunkRead],
    mem: Remembered,
    state: Mapping[str, Any],
    *,
    rank: int,
    group: Any = None,
    timeout_s: float = 60.0,
) -> tuple[dict[str, Any], TransferStats]:
    """Collective over `group` (the new world): fill `state` (this rank's freshly built sharded state)
    from the survivors' memory as `plan` says, in place; returns the non-tensor leaves to put back
    (path -> value, this rank's own copies) and what moved. Every rank walks the same plan: a read
    from a peer is an irecv here and an isend there, tagged by its index in the plan."""
    import torch  # noqa: PLC0415 - lazy: torch only where used
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    targets: dict[str, Any] = {}
    for path, value in digests.state_leaves(state):
        if isinstance(value, torch.Tensor):
            for key, local, _shape in tensor_chunks(path, value):
                targets[key] = local
    new_keys: dict[str, list[str]] = {}
    for key in targets:
        new_keys.setdefault(key.rpartition("@")[0], []).append(key)

    def target_for(t: ChunkRead) -> tuple[str, Any]:
        for key in new_keys.get(t.region.fqn, ()):
            local = targets[key]
            offs = _offsets(key)
            if all(
                o <= ro and ro + n <= o + s for o, s, ro, n in zip(offs, local.shape, t.region.offsets, t.region.sizes)
            ):
                return key, local
        raise DataError(f"rank {rank}: no chunk of {t.region.fqn} holds the region at {list(t.region.offsets)}")

    ops: list[Any] = []
    pending: list[tuple[Any, Any]] = []  # (received buffer, destination view)
    copied = received = sent = 0
    for tag, t in enumerate(sorted(plan, key=lambda x: (x.to_rank, x.region.fqn, x.region.offsets, x.old_key))):
        if t.source == "checkpoint":
            raise DataError(f"{t.region.fqn} at {list(t.region.offsets)}: no survivor holds it in memory")
        n = t.region.numel
        if t.to_rank == rank:
            key, local = target_for(t)
            dest = _box(local, _offsets(key), t.region.offsets, t.region.sizes)
            if t.from_rank == rank:
                src = mem.chunks[t.old_key]
                dest.copy_(_box(src, _offsets(t.old_key), t.region.offsets, t.region.sizes))
                copied += n
            else:
                # received in host memory, like the sender's copy (one backend: cpu:gloo in a GPU job)
                buf = torch.empty(tuple(t.region.sizes), dtype=local.dtype, device="cpu")
                ops.append(dist.P2POp(dist.irecv, buf, t.from_rank, group, tag))
                pending.append((buf, dest))
                received += n
        elif t.from_rank == rank:
            src = mem.chunks[t.old_key]
            box = _box(src, _offsets(t.old_key), t.region.offsets, t.region.sizes).contiguous()
            ops.append(dist.P2POp(dist.isend, box, t.to_rank, group, tag))
            sent += n
    if ops:
        for work in dist.batch_isend_irecv(ops):
            if not work.wait(timeout=_timedelta(timeout_s)):
                raise DataError(f"rank {rank}: a shard transfer did not complete within {timeout_s:.0f} s")
    for buf, dest in pending:
        dest.copy_(buf)
    return dict(mem.others), TransferStats(copied, received, sent)


def _timedelta(seconds: float) -> Any:
    from datetime import timedelta  # noqa: PLC0415 - small

    return timedelta(seconds=seconds)


def put_back(state: Mapping[str, Any], others: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `state`'s structure with its non-tensor leaves replaced by `others` (by path): the
    optimizer's param groups, the scheduler and extras as this survivor had them at the frontier."""
    import torch  # noqa: PLC0415 - lazy: torch only where used

    def walk(prefix: str, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: walk(f"{prefix}.{k}" if prefix else str(k), v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(f"{prefix}.{i}", v) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(walk(f"{prefix}.{i}", v) for i, v in enumerate(value))
        if isinstance(value, torch.Tensor):
            return value
        if prefix not in others:
            raise DataError(f"{prefix}: the frontier state has no value for it (the model changed?)")
        return copy.deepcopy(others[prefix])

    return walk("", state)


# ---------------------------------------------------------------- the coordinator's agreement (pure)
@dataclass(frozen=True)
class ShardedAgreement:
    """The certified digest of the frontier state the survivors hold together, or why they cannot."""

    digest: str | None
    problems: tuple[str, ...] = ()
    chunks: int = 0  # distinct chunks the survivors hold
    replicated: int = 0  # of them, held by more than one survivor


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def agree_on_sharded_state(reports: Sequence[Any], frontier: int) -> ShardedAgreement:
    """Every survivor holds its chunks of the frontier step; copies of one chunk on several survivors
    (HSDP replicas, replicated tensors) are equal; together they cover every element of every tensor
    exactly once. Then the digest of the state is what those chunks make (`digest_of`)."""
    problems: list[str] = []
    seen: dict[str, tuple[tuple[Any, ...], list[int]]] = {}
    diverged: list[tuple[str, list[int], int]] = []
    for rep in sorted(reports, key=lambda r: r.rank):
        got = rep.chunks.get(frontier)
        if got is None:
            problems.append(f"rank {rep.rank} holds no sharded state of step {frontier} (has {sorted(rep.chunks)})")
            continue
        for key, entry in got.items():
            entry_t = (str(entry[0]), tuple(entry[1]), tuple(entry[2]), str(entry[3]))
            have = seen.get(key)
            if have is None:
                seen[key] = (entry_t, [rep.rank])
            elif have[0] != entry_t:
                diverged.append((key, have[1], rep.rank))
            else:
                have[1].append(rep.rank)
    if diverged:
        key, first, other = diverged[0]
        problems.append(
            f"survivors hold different copies of {len(diverged)} chunks of step {frontier} "
            f"(e.g. {key} on ranks {first} and {other}): the replicas diverged"
        )
    per_path: dict[str, list[int]] = {}
    for key, (entry, _ranks) in seen.items():
        held = per_path.setdefault(key.rpartition("@")[0], [0, _numel(entry[1])])
        held[0] += _numel(entry[2])
    short = {p: (h, n) for p, (h, n) in per_path.items() if h < n}
    over = {p: (h, n) for p, (h, n) in per_path.items() if h > n}
    if short:
        path, (h, n) = sorted(short.items())[0]
        problems.append(
            f"no survivor holds {sum(n - h for h, n in short.values())} elements of {len(short)} tensors of "
            f"step {frontier} in memory (e.g. {path}: {h} of {n}): no replica of the lost shards survives, "
            "only the snapshot has them (the restart path restores it resharded)"
        )
    if over:
        path, (h, n) = sorted(over.items())[0]
        problems.append(f"the survivors' chunks of {path} overlap ({h} elements of {n}): not one layout")
    if problems:
        return ShardedAgreement(None, tuple(problems))
    entries = {k: e for k, (e, _r) in seen.items()}
    return ShardedAgreement(
        digest_of(entries), (), len(entries), sum(1 for _e, ranks in seen.values() if len(ranks) > 1)
    )
