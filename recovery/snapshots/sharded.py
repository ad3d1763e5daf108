"""Collective sharded snapshots: every rank writes its own shards; the snapshot counts only when all parts are in.

A sharded snapshot is the same `snapshots/step-<S>/` directory as a replicated one (so listing,
pruning, `gpu-recover restore` and `gpu-generation verify --deep` treat it alike), written by a
collective `torch.distributed.checkpoint` save over a dedicated process group: each rank writes
`__<rank>_0.distcp` with the chunks it owns (FSDP2 / HSDP shards, or, for a replicated model, the
pieces DCP's de-duplication gave it), rank 0 writes `.metadata`. Then each rank hashes its own
file's objects (BLAKE3, `generation.manifest.build_entries`) into `gpuguard.part-<R>.json`; the
coordinator (rank 0) gathers the part digests, checks that the parts together cover the metadata
exactly once, writes `state.json` and the one manifest (`gpuguard.manifest/1`, the same Merkle rule
as every manifest), and only then publishes the directory with one rename. A member that dies
mid-snapshot leaves an unpublished staging directory; a published snapshot with a part missing or
altered is refused by `select_sharded` with one line. Format: docs/formats/sharded-snapshots.md.

State goes through `torch.distributed.checkpoint.state_dict` (`model_state` / `apply_model_state`),
so FSDP2 (`fully_shard`), HSDP and plain replicated / DDP models are saved and loaded the same way,
and a load at another world size reshards (DCP reads each new chunk's overlap with the stored ones).

The state digest of a sharded state does not depend on the layout (`state_digest_sharded`): per
tensor, a sum over elements of a 64-bit mix of (global index, value bits), each rank adding its own
chunks (replicas counted once). A restore at another world size checks the loaded state against
the stored chunks read back on their own (`stored_digest_sharded`) and, when the writer recorded
it (`memory_digest=True`), against the state as it was in memory.

Lazy imports (start-up time): torch, only inside the functions that save, load or hash.
"""

from __future__ import annotations

import atexit
import hashlib
import math
import os
import queue
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import DataError, NoInputError
from gpuguard.generation import manifest as m
from gpuguard.generation.canonical import canonical_bytes
from gpuguard.generation.dcp_metadata import load_metadata
from gpuguard.generation.ownership import ShardLayout, layout_from_keys
from gpuguard.recovery.snapshots.store import (
    STATE_FILE,
    STATE_SCHEMA,
    Selection,
    SnapshotInfo,
    clone_state,
    publish_dir,
    quiet_dcp,
    read_state_record,
    select_restorable,
)

LAYOUT = "gpuguard.sharded/1"  # manifest extra["layout"] and state.json "layout"
PART_SCHEMA = "gpuguard.sharded-part/1"
MAX_PART_BYTES = 64 << 20  # a part lists one rank's objects: a few MiB for 100,000s of chunks
_M64 = (1 << 64) - 1
# the runtime's default snapshot budget: a snapshot's CPU (coordinator) at most 3 % of step time
# (issue 16's overhead target), so the interval is ceil(cost / (0.03 x step))
DEFAULT_BUDGET = 0.03


def part_name(rank: int) -> str:
    """A member's part sits beside the data files (no subdirectory: a snapshot stays one flat directory)."""
    return f"gpuguard.part-{int(rank)}.json"


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class Part:
    """One member's share of a sharded snapshot: the objects its file holds, hashed by that member."""

    step: int
    generation: int
    rank: int
    world_size: int
    incarnation: str
    entries: tuple[m.ManifestEntry, ...]
    held: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # chunk key -> sizes it holds in memory
    rng: Mapping[str, str] | None = None  # this rank's RNG states at the step (`rng_state`), hex

    def header(self) -> dict[str, Any]:
        head = {
            "schema": PART_SCHEMA,
            "step": self.step,
            "generation": self.generation,
            "rank": self.rank,
            "world_size": self.world_size,
            "incarnation": self.incarnation,
            "held": {k: list(v) for k, v in sorted(self.held.items())},
        }
        if self.rng is not None:  # optional: a part without it (an older writer) keeps its digest
            head["rng"] = dict(sorted(self.rng.items()))
        return head

    @property
    def digest(self) -> str:
        """The manifest's Merkle rule over this part's header and entries."""
        return m.entries_digest(self.entries, self.header())

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header(),
            "entries": [e.to_dict() for e in sorted(self.entries, key=lambda e: (e.key, e.spec.file))],
            "digest": self.digest,
        }


def write_part(part: Part, directory: Path) -> Path:
    """`gpuguard.part-<R>.json`, canonical, atomically (temp + fsync + rename + directory fsync)."""
    path = directory / part_name(part.rank)
    jobdir.atomic_write_bytes(path, canonical_bytes(part.to_dict()) + b"\n")
    return path


def read_part(directory: Path, rank: int) -> Part:
    """A member's part, re-checked against its own digest: NoInputError if missing, DataError if altered."""
    path = directory / part_name(rank)
    doc = jobdir.read_json(path, max_bytes=MAX_PART_BYTES)
    try:
        if doc.get("schema") != PART_SCHEMA:
            raise ValueError(f"schema is not {PART_SCHEMA}")
        if set(doc) - {"rng"} != {
            "schema",
            "step",
            "generation",
            "rank",
            "world_size",
            "incarnation",
            "held",
            "entries",
            "digest",
        }:
            raise ValueError("unexpected fields")
        rng = doc.get("rng")
        if rng is not None and not _valid_rng(rng):
            raise ValueError("rng is not a map of RNG names to hex strings")
        part = Part(
            int(doc["step"]),
            int(doc["generation"]),
            int(doc["rank"]),
            int(doc["world_size"]),
            str(doc["incarnation"]),
            tuple(m.ManifestEntry.from_dict(e) for e in doc["entries"]),
            {str(k): tuple(int(x) for x in v) for k, v in doc["held"].items()},
            rng,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{path}: unreadable part ({exc})") from None
    if part.rank != rank:
        raise DataError(f"{path}: says rank {part.rank}")
    if part.digest != doc["digest"]:
        raise DataError(f"{path}: part digest does not match its entries: tampered")
    return part


# ---------------------------------------------------------------- per-rank RNG state

RNG_NAMES = ("torch", "cuda")  # torch's CPU generator; the CUDA generators of this process, one after another
MAX_RNG_HEX = 1 << 20


_HEX = re.compile(r"(?:[0-9a-f]{2})*")


def _valid_rng(rng: Any) -> bool:
    return (
        isinstance(rng, dict)
        and set(rng) <= set(RNG_NAMES)
        and all(isinstance(v, str) and len(v) <= MAX_RNG_HEX and _HEX.fullmatch(v) for v in rng.values())
    )


def rng_state() -> dict[str, str]:
    """This rank's RNG states, hex (stored in its part, not in DCP's files: a per-rank stream is
    no tensor to reshard). CUDA only when this process has initialised it (no context is created)."""
    import torch  # noqa: PLC0415 - lazy: torch only where used

    out = {"torch": torch.get_rng_state().numpy().tobytes().hex()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        out["cuda"] = b"".join(len(t).to_bytes(4, "big") + t.numpy().tobytes() for t in states).hex()
    return out


def set_rng_state(rng: Mapping[str, str]) -> None:
    """Put RNG states from `rng_state` back (CUDA: as many devices as both have)."""
    import torch  # noqa: PLC0415 - lazy: torch only where used

    if "torch" in rng:
        torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(rng["torch"])), dtype=torch.uint8))
    if "cuda" in rng and torch.cuda.is_available():
        raw, states = bytes.fromhex(rng["cuda"]), []
        while raw:
            n = int.from_bytes(raw[:4], "big")
            states.append(torch.frombuffer(bytearray(raw[4 : 4 + n]), dtype=torch.uint8))
            raw = raw[4 + n :]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])


def rng_restore_plan(directory: str | Path, world_size: int) -> tuple[bool, str]:
    """Whether a restore of this snapshot at `world_size` restores each rank's RNG, and why, in
    words: only at the world size that wrote it (rank r takes rank r's stream); at another world
    size the streams do not map onto the new ranks, so each keeps what its build() seeded."""
    directory = Path(directory)
    world = int(dict(m.load_manifest(directory).extra).get("world_size", 0))
    if world != world_size:
        return False, (
            f"RNG not restored: world {world} -> {world_size}, per-rank RNG streams do not map onto "
            "another world size; each rank keeps the RNG state its build() left"
        )
    if read_part(directory, 0).rng is None:
        return False, "RNG not restored: the snapshot's parts hold no RNG state"
    return True, f"RNG restored: each of the {world} ranks from its own part"


def restore_rng(directory: str | Path, rank: int, world_size: int) -> tuple[bool, str]:
    """`rng_restore_plan`, carried out for this rank (its own part's RNG state, re-verified)."""
    ok, why = rng_restore_plan(directory, world_size)
    if ok:
        rng = read_part(Path(directory), rank).rng
        if rng is None:
            return False, f"RNG not restored: the part of rank {rank} holds no RNG state"
        set_rng_state(rng)
    return ok, why


@dataclass(frozen=True)
class ShardedInfo:
    """What a collective save produced, the same on every member (the coordinator broadcasts it)."""

    step: int
    path: Path
    world_size: int
    manifest_digest: str
    state_digest: str | None  # the in-memory state's digest (memory_digest=True), else None
    bytes_written: int  # data files of all members
    cost_s: float = 0.0  # the coordinator's CPU for it: its staging (training thread) + its save up to the publish
    step_s: float = 0.0  # the coordinator's recent step time when it was submitted

    def snapshot(self, generation: int | None = None) -> SnapshotInfo:
        return SnapshotInfo(self.step, self.path, "snapshots", generation, self.state_digest, self.manifest_digest)


# ---------------------------------------------------------------- model state (FSDP2, HSDP, DDP alike)


def model_state(model: Any, optimizer: Any, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`{"model": ..., "optim": ..., "extra": ...}` from `get_state_dict` (sharded: DTensors stay sharded)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415 - lazy: torch only where used

    msd, osd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    if extra:
        state["extra"] = dict(extra)
    return state


def apply_model_state(model: Any, optimizer: Any, state: Mapping[str, Any]) -> None:
    """Put a loaded `model_state` back into the model and optimizer (`set_state_dict`)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict  # noqa: PLC0415 - lazy: torch only where used

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def stage(state: Mapping[str, Any]) -> dict[str, Any]:
    """A detached copy of a state (DTensors keep their sharding; their local shard is copied):
    the snapshot thread writes it while training goes on. At most one staged copy is alive
    (`ShardedSnapshotter`): staging memory is bounded by one copy of this rank's state."""
    return clone_state(state, to_cpu=False)


# ---------------------------------------------------------------- the layout-independent state digest

_K = (0x1F3D5B79A2C4E6F1, 0x2545F4914F6CDD1D, 0x27D4EB2F165667C5, 0x5851F42D4C957F2D, 0x14057B7EF767814F)
_INTS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _chunk_sum(local: Any, offsets: tuple[int, ...], global_shape: tuple[int, ...]) -> int:
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
    return int(h.sum()) & _M64


def digest_contributions(state: Mapping[str, Any], rank: int) -> dict[str, list[Any]]:
    """This rank's additive share of the state digest: {path: [dtype, shape, sum]} for the tensor
    chunks it is the first replica of (plain, replicated tensors: rank 0). Non-tensor values are
    not in it: their stored bytes are BLAKE3-verified by the manifest, and a load does not reshard them."""
    import torch  # noqa: PLC0415 - lazy: torch only where used
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - lazy: torch only where used

    tensors: dict[str, list[Any]] = {}
    for path, value in state_leaves(state):
        if isinstance(value, DTensor):
            coord = value.device_mesh.get_coordinate() or []
            first_replica = all(c == 0 for c, p in zip(coord, value.placements) if not p.is_shard())
            total = 0
            if first_replica:
                for ch in value.__create_chunk_list__():
                    total += _chunk_sum(value.to_local(), tuple(int(x) for x in ch.offsets), tuple(value.shape))
            tensors[path] = [str(value.dtype), list(value.shape), total & _M64]
        elif isinstance(value, torch.Tensor):  # replicated: counted once, by rank 0
            total = _chunk_sum(value, (0,) * value.dim(), tuple(value.shape)) if rank == 0 else 0
            tensors[path] = [str(value.dtype), list(value.shape), total]
    return tensors


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
        have[2] = (have[2] + _chunk_sum(t, tuple(s.chunk_offsets or (0,) * t.dim()), shape)) & _M64
    return tensors


def combine_contributions(parts: list[Mapping[str, list[Any]]]) -> str:
    """The state digest from every rank's share: SHA-256 of the canonical sums (equal at any world size)."""
    tensors: dict[str, list[Any]] = {}
    for p in parts:
        for k, (dtype, shape, s) in p.items():
            have = tensors.setdefault(k, [dtype, list(shape), 0])
            have[2] = (have[2] + int(s)) & _M64
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


def stored_digest_sharded(directory: str | Path, group: Any = None) -> str:
    """Collective over `group` (any world size): the same digest of a snapshot's stored state, each
    rank reading a share of its chunks."""
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    mine = stored_contributions(Path(directory), dist.get_rank(group), dist.get_world_size(group))
    return _all_combined(mine, group)


# ---------------------------------------------------------------- save (collective)


def _recording_planner() -> Any:
    """DCP's default save planner, remembering this rank's own chunks (before de-duplication):
    what it holds in memory, replicas included."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: PLC0415 - lazy: torch only where used

    class Recording(DefaultSavePlanner):  # type: ignore[misc]
        held: dict[str, tuple[int, ...]]

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            self.held = held_chunks(plan)
            return plan

    return Recording()


def held_chunks(plan: Any) -> dict[str, tuple[int, ...]]:
    """Tensor chunk key -> sizes, from a DCP `SavePlan` (the manifest's `fqn@offsets` keys)."""
    out = {}
    for item in plan.items:
        if item.tensor_data is None:
            continue
        offs = tuple(int(x) for x in (item.index.offset or ()))
        out[f"{item.index.fqn}@{','.join(map(str, offs))}"] = tuple(int(x) for x in item.tensor_data.chunk.sizes)
    return out


def local_chunks(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The chunks this rank holds of a state, without writing anything (DCP's local save plan)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: PLC0415 - lazy: torch only where used

    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(state), None, False)
    return held_chunks(planner.create_local_plan())


def _src(group: Any) -> int:
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    return dist.get_global_rank(group, 0) if group is not None else 0


def save_sharded(
    job_dir: str | Path,
    step: int,
    state: Mapping[str, Any],
    *,
    group: Any = None,
    generation: int,
    incarnation: str,
    ownership_map_version: int = 0,
    still_current: Callable[[], bool] | None = None,
    before_publish: Callable[[Path], None] | None = None,
    memory_digest: bool = False,
    rng: Mapping[str, str] | None = None,
    submit_s: float = 0.0,
    step_s: float = 0.0,
) -> ShardedInfo | None:
    """Collective over `group` (every member calls it with the same step): write `state` as the
    sharded snapshot of `step`. Returns the published snapshot on every member; None when the
    coordinator was fenced (`still_current()` false); DataError on every member when a part
    failed or was refused; the group's error (a timeout) when a member is gone mid-save.

    `memory_digest`: also compute the layout-independent digest of the state as it is in memory
    (`state_digest` in state.json; a full pass over the state, ~20-60 ns an element on one CPU core),
    so that a restore also proves that what was written is what was in memory. Without it
    `state_digest` is null and a restore checks the loaded state against the stored one.

    `rng`: this rank's RNG states at the step (`rng_state()`, taken on the training thread when the
    state was staged), kept in its part (so under the part's digest and the manifest's Merkle root).
    `submit_s` (what staging cost the training thread) and `step_s` (the recent step time): the
    coordinator's go into the result (`cost_s` = its `submit_s` + its own CPU for the save, and
    `step_s`), the same on every member (`ShardedSnapshotter`'s adaptive interval).

    The group should be a dedicated gloo group with a finite timeout (`new_snapshot_group`): a
    member that dies mid-save makes the others' save fail by that timeout, never hang.
    """
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - lazy: torch only where used

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cpu0 = time.thread_time()
    parent = Path(job_dir) / "snapshots"
    box: list[Any] = [None]
    if rank == 0:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            name = f".tmp-step-{step}-{uuid.uuid4().hex[:8]}"
            (parent / name).mkdir()
            box[0] = name
        except OSError as exc:  # said to every member: nobody waits for a save that never starts
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
    try:
        dist.broadcast_object_list(box, src=_src(group), group=group)
    except BaseException:  # a member gone before the save began: the staging directory is nobody's
        if rank == 0 and isinstance(box[0], str):
            shutil.rmtree(parent / box[0], ignore_errors=True)
        raise
    if not isinstance(box[0], str):
        raise DataError(f"sharded snapshot of step {step}: no staging directory: {box[0][1]}")
    tmp = parent / box[0]
    planner = _recording_planner()
    ok, result = True, None
    try:
        quiet_dcp(lambda: dcp.save(dict(state), checkpoint_id=str(tmp), process_group=group, planner=planner))
        meta = load_metadata(tmp)
        mine = [s for s in m.specs_from_metadata(meta) if m.owner_of(s.file) == rank]
        entries = m.build_entries(mine, tmp, step=step, generation=generation, owners={rank: incarnation})
        part = Part(step, generation, rank, world, incarnation, tuple(entries), getattr(planner, "held", {}), rng)
        write_part(part, tmp)
        summary: Any = {"digest": part.digest}
        if memory_digest:
            summary["contrib"] = digest_contributions(state, rank)
    except Exception as exc:  # noqa: BLE001 - this member's part failed: the gather says so
        ok, summary = False, {"error": f"{type(exc).__name__}: {exc}"}
    try:
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(summary, gathered, dst=_src(group), group=group)
        reason = None
        if rank == 0:
            assert gathered is not None
            final = parent / jobdir.step_dir_name(step)
            try:
                done = _complete(
                    tmp, step, gathered, meta if ok else None, generation, ownership_map_version, incarnation
                )
                if before_publish is not None:
                    before_publish(tmp)
                if still_current is not None and not still_current():
                    reason = f"fenced: generation {generation} is no longer the active one"
                else:
                    publish_dir(tmp, final)
                    cost = submit_s + time.thread_time() - cpu0
                    result = ShardedInfo(step, final, world, *done, cost, step_s)
            except Exception as exc:  # noqa: BLE001 - reported to every member, not raised mid-collective
                reason = f"{type(exc).__name__}: {exc}"
            if result is None:
                shutil.rmtree(tmp, ignore_errors=True)
        out: list[Any] = [(result, reason)]
        dist.broadcast_object_list(out, src=_src(group), group=group)
    except BaseException:  # a member gone mid-collective (gloo timeout): nothing is published
        if rank == 0 and result is None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    result, reason = out[0]
    if not ok:
        raise DataError(f"sharded snapshot of step {step}: this member's part failed: {summary['error']}")
    if result is None and reason is not None and not reason.startswith("fenced"):
        raise DataError(f"sharded snapshot of step {step} not published: {reason}")
    return result  # type: ignore[no-any-return]


def _complete(
    tmp: Path,
    step: int,
    gathered: list[Any],
    meta: Any,
    generation: int,
    ownership_map_version: int,
    incarnation: str,
) -> tuple[str, str | None, int]:
    """The coordinator: every part present and verified, together exactly the metadata, then
    `state.json` and the manifest: (manifest digest, state digest, bytes written); DataError if not."""
    bad = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if "error" in g]
    if bad or meta is None:
        raise DataError(f"a member's part failed: {bad[0] if bad else 'the metadata'}")
    parts = [read_part(tmp, r) for r in range(len(gathered))]
    for p, g in zip(parts, gathered):
        if p.digest != g["digest"] or p.step != step or p.world_size != len(gathered):
            raise DataError(f"part of rank {p.rank} does not match what it reported")
    problems = coverage_problems(parts, m.specs_from_metadata(meta))
    if problems:
        raise DataError(f"parts do not cover the checkpoint: {problems[0]}")
    digest = combine_contributions([g["contrib"] for g in gathered]) if "contrib" in gathered[0] else None
    entries = tuple(e for p in parts for e in p.entries)
    world = len(parts)
    manifest = m.Manifest(
        generation,
        step,
        entries,
        ownership_map_version,
        {"layout": LAYOUT, "world_size": world, "parts": {str(p.rank): p.digest for p in parts}},
    )
    jobdir.atomic_write_json(
        tmp / STATE_FILE,
        {
            "schema": STATE_SCHEMA,
            "step": step,
            "generation": generation,
            "state_digest": digest,
            "owner": f"rank0/{incarnation}",
            "time": time.time(),
            "keys": sorted({e.spec.fqn.split(".")[0] for e in entries}),
            "layout": LAYOUT,
            "world_size": world,
        },
    )
    m.write_manifest(manifest, tmp)
    written = sum(f.stat().st_size for f in tmp.iterdir() if f.name.endswith(".distcp"))
    return manifest.digest, digest, written


def coverage_problems(parts: list[Part], specs: list[m.ObjectSpec]) -> list[str]:
    """Every object of the DCP metadata in exactly one part, with the same file and byte range."""
    want = {(s.key, s.file, s.byte_offset, s.byte_length) for s in specs}
    have: dict[tuple[str, str, int, int], int] = {}
    problems = []
    for p in parts:
        for e in p.entries:
            k = (e.key, e.spec.file, e.spec.byte_offset, e.spec.byte_length)
            if k in have:
                problems.append(f"object {e.key} is in the parts of ranks {have[k]} and {p.rank}")
            have[k] = p.rank
            if m.owner_of(e.spec.file) != p.rank:
                problems.append(f"object {e.key}: rank {p.rank}'s part lists {e.spec.file}")
    problems += [f"object {k[0]} is in no member's part" for k in sorted(want - set(have))]
    problems += [f"object {k[0]} is not in the checkpoint's metadata" for k in sorted(set(have) - want)]
    return problems


def new_snapshot_group(timeout_s: float = 60.0) -> Any:
    """Collective: a gloo process group for snapshots only (DCP's plans and the parts' gather run
    in the snapshot thread, never interleaved with the training collectives), finite timeout."""
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


# ---------------------------------------------------------------- the background writer


class SnapshotStuck(RuntimeError):
    """The previous sharded snapshot did not finish in time: the collective is stuck."""


class ShardedSnapshotter:
    """Sharded snapshots in a background thread, in lockstep on every member.

    `submit(step, state)` stages (copies) the state and hands it to the writer thread. Every member
    must submit the same steps (the save is collective), so a snapshot is never skipped or replaced
    on one member alone: when the previous one is still being written, `submit` waits for it (up to
    `max_wait`, then SnapshotStuck). One staged copy at most: bounded staging memory.

    Hooks (all run in the writer thread): `still_current()` and `before_publish(step, staging dir)`
    on the coordinator just before the rename (fencing, fault injection); `on_done(step, info or
    None, error or None)` on every member after each snapshot (counters, pruning on rank 0);
    `ownership_map_version()` is stamped into each manifest. `nice`: the writer thread's nice
    value (Linux, per thread; 0 leaves it), so that on a busy host it takes the CPU the training
    threads leave (off by default: on the 2-core bench host, 0, 10 and 19 were within the noise).

    A save that fails in a collective (a RuntimeError: a peer gone, a timeout) leaves the group
    unusable, members possibly at different collectives of it: the writer takes no snapshot after
    it (`broken`; later submits are counted in `skipped`). The next generation has a new writer.

    The interval (`due(step)`): every `every` steps with `cpu_budget` 0; with a budget (a fraction
    of step time; the runtime's default is 0.03) it adapts: after each snapshot the next one is due
    `interval` steps later, interval = max(`every`, ceil(cost / (cpu_budget x step time))), where
    cost is the coordinator's CPU for the last snapshot (`ShardedInfo.cost_s`: its staging on the
    training thread plus its writer thread up to the publish) and step time is the median step the
    coordinator passed to `submit`. Both come to every member in the snapshot's outcome (the
    coordinator's broadcast), and each member applies the interval at its next `submit`, which
    first waits for that snapshot: every member picks the same steps. A failed snapshot keeps it.
    """

    def __init__(
        self,
        job_dir: str | Path,
        *,
        generation: int,
        incarnation: str,
        group: Any = None,
        still_current: Callable[[], bool] | None = None,
        on_done: Callable[[int, ShardedInfo | None, BaseException | None], None] | None = None,
        max_wait: float = 120.0,
        memory_digest: bool = False,
        before_publish: Callable[[int, Path], None] | None = None,
        ownership_map_version: Callable[[], int] | None = None,
        nice: int = 0,
        every: int = 1,
        cpu_budget: float = 0.0,
    ) -> None:
        self.job_dir, self.generation, self.incarnation = Path(job_dir), generation, incarnation
        self.group = group if group is not None else new_snapshot_group()
        self.still_current, self.on_done, self.max_wait = still_current, on_done, max_wait
        self.memory_digest, self.before_publish = memory_digest, before_publish
        self.ownership_map_version = ownership_map_version
        self.nice = nice
        self.every, self.cpu_budget = max(1, every), max(0.0, cpu_budget)
        self.interval = self.every  # steps from one snapshot to the next (adaptive with a budget)
        self._next_due = 0
        self.written = 0
        self.errors = 0
        self.unpublished = 0
        self.skipped = 0  # submits not saved: the group failed before (`broken`)
        self.broken: str | None = None  # why this writer's group is unusable (a failed collective)
        self.cpu_s = 0.0
        self.wait_s = 0.0  # time the training thread waited for the previous snapshot
        self.last: ShardedInfo | None = None
        self._q: queue.Queue[tuple[int, dict[str, Any], Mapping[str, str] | None, float, float] | None] = queue.Queue(
            maxsize=1
        )
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="gpuguard-sharded-snapshot", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        """Whether `step` gets a snapshot: the same answer on every member (see the class docstring)."""
        if self.cpu_budget <= 0:
            return step % self.every == 0
        return step >= self._next_due

    def submit(
        self,
        step: int,
        state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        rng: Mapping[str, str] | None = None,
        step_s: float = 0.0,
    ) -> None:
        """Stage `state` (a callable: called here, its cost counted as staging) and this rank's `rng`
        (see `save_sharded`) for the snapshot of `step`; `step_s`: the recent (median) step time."""
        t0 = time.monotonic()
        if not self._idle.wait(self.max_wait):
            raise SnapshotStuck(
                f"the sharded snapshot before step {step} is still being written after {self.max_wait:.0f} s"
            )
        self.wait_s += time.monotonic() - t0
        if self.broken is not None:  # the group failed: another collective on it could desynchronise
            self.skipped += 1
            return
        c0 = time.thread_time()
        staged = stage(state() if callable(state) else state)  # before the writer is busy: a failed copy leaves it idle
        self._next_due = step + self.interval  # the previous snapshot's interval: the same on every member
        self._idle.clear()
        self._q.put((step, staged, dict(rng) if rng is not None else None, step_s, time.thread_time() - c0))

    def _run(self) -> None:
        if self.nice:  # Linux: a thread's own nice value; training threads keep the CPU when both want it
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (OSError, AttributeError):
                pass
        while True:
            item = self._q.get()
            if item is None:
                self.group = None  # a failed group's sockets close once nothing holds it (peers wake)
                return
            step, state, rng, step_s, submit_s = item
            t0 = time.thread_time()
            info: ShardedInfo | None = None
            error: BaseException | None = None
            try:
                info = save_sharded(
                    self.job_dir,
                    step,
                    state,
                    group=self.group,
                    generation=self.generation,
                    incarnation=self.incarnation,
                    still_current=self.still_current,
                    memory_digest=self.memory_digest,
                    before_publish=(lambda p, s=step: hook(s, p)) if (hook := self.before_publish) else None,
                    ownership_map_version=self.ownership_map_version() if self.ownership_map_version else 0,
                    rng=rng,
                    submit_s=submit_s,
                    step_s=step_s,
                )
                if info is None:
                    self.unpublished += 1
                else:
                    self.written += 1
                    self.last = info
                    self.interval = self._interval(info)
            except Exception as exc:  # noqa: BLE001 - a failed snapshot must not kill training
                self.errors += 1
                error = exc
                if isinstance(exc, RuntimeError):  # gloo: a peer gone or timed out; the group is unusable
                    # members may now stand at different collectives of it: a next save could hand one
                    # member another's message (gloo aborts the process: "Received data size doesn't
                    # match", seen when survivors of an in-place switch saved once more)
                    self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            finally:
                del state
                self.cpu_s += time.thread_time() - t0
                if self.on_done is not None:
                    try:
                        self.on_done(step, info, error)
                    except Exception:  # noqa: BLE001,S110 - a reporting hook must not stop the writer
                        pass
                # the error's traceback holds the save's frames, and with them the group: a failed group
                # kept alive here keeps its sockets open, and a peer blocked on this rank waits its timeout
                error = info = None
                self._idle.set()

    def _interval(self, info: ShardedInfo) -> int:
        """The steps until the next snapshot, from the coordinator's figures (the same on every member)."""
        if self.cpu_budget <= 0 or info.step_s <= 0:
            return self.every if self.cpu_budget <= 0 else self.interval
        return max(self.every, math.ceil(info.cost_s / (self.cpu_budget * info.step_s)))

    def flush(self, timeout: float) -> bool:
        """Wait for the snapshot in flight (True when none is left)."""
        return self._idle.wait(timeout)

    def abandon(self) -> None:
        """Stop taking snapshots without waiting: the thread ends after the save in flight (if any)
        fails or finishes (its group failed; a late publish is fenced by `still_current`)."""
        try:
            atexit.unregister(self.flush)  # the runtime's exit flush holds it (and its group) alive
        except Exception:  # noqa: BLE001,S110 - nothing registered
            pass
        try:
            self._q.put_nowait(None)
        except queue.Full:  # a save is queued but not started: the thread takes it, then stops
            threading.Thread(target=self._q.put, args=(None,), daemon=True).start()

    def close(self, timeout: float) -> bool:
        done = self.flush(timeout)
        if done:
            self._q.put(None)
            self._thread.join(timeout)
        return done


# ---------------------------------------------------------------- select, verify, load (restore)


def parts_problem(info: SnapshotInfo) -> str | None:
    """A published sharded snapshot's own rule: every member's part present, unaltered, and the
    parts together exactly the manifest. None = fine; else one line."""
    try:
        manifest = m.load_manifest(info.path)
    except (DataError, NoInputError) as exc:
        return str(exc)
    extra = dict(manifest.extra)
    if extra.get("layout") != LAYOUT:
        return f"not a sharded snapshot (layout {extra.get('layout')!r})"
    world = extra.get("world_size")
    digests = extra.get("parts")
    if not isinstance(world, int) or world < 1 or not isinstance(digests, dict) or len(digests) != world:
        return "manifest names no complete set of parts"
    entries = set()
    for r in range(world):
        try:
            part = read_part(info.path, r)
        except NoInputError:
            return f"the part of rank {r} of {world} is missing"
        except DataError as exc:
            return str(exc)
        if part.digest != digests.get(str(r)):
            return f"the part of rank {r} is not the one the manifest names"
        entries |= {e.canonical() for e in part.entries}
    if entries != {e.canonical() for e in manifest.entries}:
        return "the parts together are not the manifest's objects"
    return None


def select_sharded(job_dir: str | Path, at_or_before_step: int | None = None, **options: Any) -> Selection:
    """The newest complete, verified sharded snapshot: `select_restorable` (every digest re-hashed;
    `expected_manifest_digest`, `max_tries` as there) plus every member's part (`parts_problem`)."""
    return select_restorable(job_dir, at_or_before_step, check=parts_problem, **options)


def snapshot_layout(directory: str | Path) -> ShardLayout:
    """The ownership layout a sharded snapshot recorded: holders from every part, writers from the files."""
    directory = Path(directory)
    manifest = m.load_manifest(directory)
    world = int(dict(manifest.extra).get("world_size", 0))
    parts = [read_part(directory, r) for r in range(world)]
    writers = {e.key: e.owner_rank for e in manifest.entries if e.spec.kind == "tensor"}
    return layout_from_keys(manifest.ownership_map_version, world, {p.rank: p.held for p in parts}, writers)


def current_layout(state: Mapping[str, Any], version: int, group: Any = None) -> ShardLayout:
    """Collective: the layout of the live state of this world (who will hold which chunk)."""
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, local_chunks(state), group=group)
    return layout_from_keys(version, len(every), dict(enumerate(every)))


def load_sharded(
    info: SnapshotInfo, state: Mapping[str, Any], *, group: Any = None, check: bool = True
) -> dict[str, Any]:
    """Collective: load a (verified: `select_sharded`) sharded snapshot into `state` (the live
    `model_state` of this world, any world size: DCP reshards). With `check`, the loaded state's
    layout-independent digest must equal the stored chunks' (read back independently of DCP's
    load) and, when the snapshot has one, the in-memory digest recorded at save: DataError if not."""
    return load_sharded_checked(info, state, group=group, check=check)[0]


def load_sharded_checked(
    info: SnapshotInfo, state: Mapping[str, Any], *, group: Any = None, check: bool = True
) -> tuple[dict[str, Any], str | None]:
    """`load_sharded`, and the loaded state's layout-independent digest (None without `check`): the
    runtime certifies it without a second pass over the state."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - lazy: torch only where used

    loaded = dict(state)
    quiet_dcp(lambda: dcp.load(loaded, checkpoint_id=str(info.path), process_group=group))
    got = None
    if check:
        got = state_digest_sharded(loaded, group)
        stored = stored_digest_sharded(info.path, group)
        if got != stored:
            raise DataError(
                f"{info.path}: the loaded state (digest {got[:16]}…) is not the stored one ({stored[:16]}…)"
            )
        recorded = info.state_digest or read_state_record(info.path).get("state_digest")
        if recorded is not None and recorded != stored:
            raise DataError(
                f"{info.path}: the stored state (digest {stored[:16]}…) is not the one in memory at save ({str(recorded)[:16]}…)"
            )
    return loaded, got
