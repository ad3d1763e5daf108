"""Collective sharded snapshots: every rank writes its own shards; the snapshot counts only when all parts are in.

A collective `torch.distributed.checkpoint` save over a dedicated process group writes each rank's
chunks (FSDP2 / HSDP shards, or, for a replicated model, the pieces DCP's de-duplication gave it)
and rank 0's `.metadata`; each rank then writes its part (`recovery.snapshots.parts`); the
coordinator (rank 0) gathers the part digests, checks the coverage, writes `state.json` and the one
manifest (`gpuguard.manifest/2`, the same Merkle rule as every manifest, binding `.metadata`), and only then publishes
the directory with one rename. A member that dies mid-snapshot leaves an unpublished staging
directory. Format: docs/formats/sharded-snapshots.md.

State goes through `torch.distributed.checkpoint.state_dict` (`model_state` / `apply_model_state`),
so FSDP2 (`fully_shard`), HSDP and plain replicated / DDP models are saved and loaded the same way,
and a load at another world size reshards (DCP reads each new chunk's overlap with the stored ones),
checked against the layout-independent digest (`recovery.snapshots.digests`).

Lazy imports (start-up time): torch, only inside the functions that save or load.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import DataError
from gpuguard.generation import manifest as m
from gpuguard.generation.dcp_metadata import METADATA_FILE, decode_metadata, read_metadata_bytes
from gpuguard.generation.ownership import ShardLayout, layout_from_keys
from gpuguard.recovery.snapshots.dcp_io import dcp_load
from gpuguard.recovery.snapshots.digests import (
    combine_contributions,
    measure,
    measured_sharded,
    stored_digest_sharded,
)
from gpuguard.recovery.snapshots.parts import LAYOUT, Part, coverage_problems, read_part, write_part
from gpuguard.recovery.snapshots.soundness import Expect, Policy, judge
from gpuguard.recovery.snapshots.store import (
    SnapshotInfo,
    clone_state,
    publish_dir,
    quiet_dcp,
    unsound_line,
)


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
    unsound: str | None = None  # its soundness verdict's line when unsound (published, never selected)

    def snapshot(self, generation: int | None = None) -> SnapshotInfo:
        return SnapshotInfo(
            self.step, self.path, "snapshots", generation, self.state_digest, self.manifest_digest, unsound=self.unsound
        )


def model_state(
    model: Any,
    optimizer: Any,
    extra: Mapping[str, Any] | None = None,
    *,
    optimizer_state: bool = True,
    read: bool = False,
) -> dict[str, Any]:
    """`{"model": ..., "optim": ..., "extra": ...}` from `get_state_dict` (sharded: DTensors stay sharded).

    `optimizer_state=False`: the model alone (`get_model_state_dict`), for an optimizer that has not
    stepped yet: reading one through `get_state_dict` creates its state by a zero step (torch's
    `_init_optim_state`; AdamW's step count becomes 1), so the read would change the training.
    `read=True`: such an optimizer recorded fresh instead (`read_state_dicts`); the default creates
    its state, as a template DCP loads into needs."""
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 - lazy: torch only where used
        get_model_state_dict,
        get_state_dict,
    )

    state: dict[str, Any]
    if optimizer_state:
        msd, osd = read_state_dicts(model, optimizer) if read else get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    if extra:
        state["extra"] = dict(extra)
    return state


def read_state_dicts(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`get_state_dict(model, optimizer)` as a read that leaves the optimizer as it was.

    torch creates a fresh optimizer's state by a zero step (`_init_optim_state`: AdamW's step count
    becomes 1), so a job read at activation would train unlike the same job unread. For a fresh
    optimizer that state is dropped again and the read records it fresh: `state` empty, its param
    groups as they are (`set_state_dict` of that leaves an optimizer fresh). A state DCP loads into
    needs the created state instead (`get_state_dict` itself: it is about to be overwritten)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415 - lazy: torch only where used

    fresh = not optimizer.state
    msd, osd = get_state_dict(model, optimizer)
    if fresh and optimizer.state:  # the zero step ran: grads were None before it and are None again
        optimizer.state.clear()
        osd = {**osd, "state": {}}
    return msd, osd


def apply_model_state(model: Any, optimizer: Any, state: Mapping[str, Any]) -> None:
    """Put a loaded `model_state` back into the model and optimizer (`set_state_dict`); a state
    without `optim` (the initial state) leaves the optimizer as it is: fresh."""
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 - lazy: torch only where used
        set_model_state_dict,
        set_state_dict,
    )

    if "optim" not in state:
        set_model_state_dict(model, state["model"])
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def stage(state: Mapping[str, Any]) -> dict[str, Any]:
    """A detached copy of a state (DTensors keep their sharding; their local shard is copied):
    the snapshot thread writes it while training goes on. At most one staged copy is alive
    (`ShardedSnapshotter`): staging memory is bounded by one copy of this rank's state."""
    return clone_state(state, to_cpu=False)


def _recording_planner() -> Any:
    """DCP's default save planner, remembering this rank's own chunks (before de-duplication):
    what it holds in memory, replicas included."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: PLC0415 - lazy: torch only where used

    class Recording(DefaultSavePlanner):
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
    policy: Policy | None = None,
    expect: Expect | None = None,
) -> ShardedInfo | None:
    """Collective over `group` (every member calls it with the same step): write `state` as the
    sharded snapshot of `step`. Returns the published snapshot on every member; None when the
    coordinator was fenced (`still_current()` false); DataError on every member when a part
    failed or was refused; the group's error (a timeout) when a member is gone mid-save.

    `memory_digest`: also compute the layout-independent digest of the state as it is in memory
    (`state_digest` in state.json; a full pass over the state, ~20-60 ns an element on one CPU core),
    so that a restore also proves that what was written is what was in memory. Without it
    `state_digest` is null and a restore checks the loaded state against the stored one.

    `policy`: also measure the state's soundness in that pass (`digests.measure`: NaN / infinity
    counts, with `policy.replicas` every held chunk's sum, which gives the state digest too, and the
    non-tensor facts, `expect` saying what this job has); the coordinator judges every member's
    measurement (`soundness.judge`) into the manifest's `extra.soundness`. An unsound state is
    published all the same (the evidence, `ShardedInfo.unsound`); selection never takes it.

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
        raw = read_metadata_bytes(tmp)  # the coordinator's, just written: bound below, decoded here
        meta = decode_metadata(raw, tmp / METADATA_FILE, forked=False)
        mine = [s for s in m.specs_from_metadata(meta) if m.owner_of(s.file) == rank]
        entries = m.build_entries(mine, tmp, step=step, generation=generation, owners={rank: incarnation})
        part = Part(step, generation, rank, world, incarnation, tuple(entries), getattr(planner, "held", {}), rng)
        write_part(part, tmp)
        binding = m.MetadataBinding.of(raw)
        summary: Any = {"digest": part.digest, "metadata": [binding.digest, binding.size]}
        if memory_digest or policy is not None:
            sums = "all" if policy is not None and policy.replicas else "first" if memory_digest else "none"
            finite = policy is not None and policy.finite
            facts = policy is not None and policy.non_tensor
            summary["measure"] = measure(state, rank, sums=sums, finite=finite, facts=facts, rng=rng is not None)
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
                    tmp,
                    step,
                    gathered,
                    meta if ok else None,
                    generation,
                    ownership_map_version,
                    incarnation,
                    policy,
                    expect,
                )
                if before_publish is not None:
                    before_publish(tmp)
                if still_current is not None and not still_current():
                    reason = f"fenced: generation {generation} is no longer the active one"
                else:
                    publish_dir(tmp, final)
                    cost = submit_s + time.thread_time() - cpu0
                    result = ShardedInfo(step, final, world, *done[:3], cost, step_s, done[3])
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
    return result


def _complete(
    tmp: Path,
    step: int,
    gathered: list[Any],
    meta: Any,
    generation: int,
    ownership_map_version: int,
    incarnation: str,
    policy: Policy | None = None,
    expect: Expect | None = None,
) -> tuple[str, str | None, int, str | None]:
    """The coordinator: every part present and verified, together exactly the metadata (the
    `.metadata` every member read, which the manifest binds), the members' measurements judged,
    then `state.json` and the manifest: (manifest digest, state digest, bytes written, why unsound
    or None); DataError if not."""
    bad = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if "error" in g]
    if bad or meta is None:
        raise DataError(f"a member's part failed: {bad[0] if bad else 'the metadata'}")
    read = {tuple(g["metadata"]) for g in gathered}
    if len(read) != 1:
        raise DataError(f"the members read {len(read)} different {METADATA_FILE} files")
    digest_size = read.pop()
    binding = m.MetadataBinding(str(digest_size[0]), int(digest_size[1]))
    parts = [read_part(tmp, r) for r in range(len(gathered))]
    for p, g in zip(parts, gathered):
        if p.digest != g["digest"] or p.step != step or p.world_size != len(gathered):
            raise DataError(f"part of rank {p.rank} does not match what it reported")
    problems = coverage_problems(parts, m.specs_from_metadata(meta))
    if problems:
        raise DataError(f"parts do not cover the checkpoint: {problems[0]}")
    measured = [g["measure"] for g in gathered] if "measure" in gathered[0] else None
    digest = None
    if measured is not None and measured[0]["contrib"] is not None:
        digest = combine_contributions([x["contrib"] for x in measured])
    entries = tuple(e for p in parts for e in p.entries)
    world = len(parts)
    extra: dict[str, Any] = {"layout": LAYOUT, "world_size": world, "parts": {str(p.rank): p.digest for p in parts}}
    verdict = judge(measured, policy, expect) if policy is not None and measured is not None else None
    if verdict is not None:
        extra["soundness"] = verdict.to_dict()
    manifest = m.Manifest(generation, step, entries, ownership_map_version, extra, binding)
    jobdir.write_snapshot_state(
        tmp,
        jobdir.SnapshotState(
            step=step,
            generation=generation,
            state_digest=digest,
            owner=f"rank0/{incarnation}",
            time=time.time(),
            keys=tuple(sorted({e.spec.fqn.split(".")[0] for e in entries})),
            layout=LAYOUT,
            world_size=world,
        ),
    )
    m.write_manifest(manifest, tmp)
    written = sum(f.stat().st_size for f in tmp.iterdir() if f.name.endswith(".distcp"))
    return manifest.digest, digest, written, unsound_line(verdict)


def new_snapshot_group(timeout_s: float = 60.0) -> Any:
    """Collective: a gloo process group for snapshots only (DCP's plans and the parts' gather run
    in the snapshot thread, never interleaved with the training collectives), finite timeout."""
    import torch.distributed as dist  # noqa: PLC0415 - lazy: torch only where used

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


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
    info: SnapshotInfo,
    state: Mapping[str, Any],
    *,
    group: Any = None,
    check: bool = True,
    policy: Policy | None = None,
) -> tuple[dict[str, Any], str | None]:
    """`load_sharded`, and the loaded state's layout-independent digest (None without `check`): the
    runtime certifies it without a second pass over the state. `.metadata` is the one the manifest
    binds, decoded by the restricted unpickler (`dcp_io`), never by torch. With `policy` (and
    `check`), the digest's pass also counts non-finite values: a restored state with any the policy
    does not declare is a DataError (a snapshot written before soundness was recorded)."""
    loaded = dict(state)
    dcp_load(
        loaded,
        info.path,
        metadata_digest=info.metadata_digest,
        manifest_digest=info.manifest_digest,
        process_group=group,
    )
    got = None
    if check:
        got, measured = measured_sharded(loaded, group)
        if policy is not None and policy.finite:
            verdict = judge(measured, Policy(policy.allow_inf, policy.allow_nan, replicas=False, non_tensor=False))
            if not verdict.sound:
                raise DataError(f"{info.path}: the restored state is not sound: {verdict.line()}")
        stored = stored_digest_sharded(info.path, group)
        if got != stored:
            raise DataError(
                f"{info.path}: the loaded state (digest {got[:16]}…) is not the stored one ({stored[:16]}…)"
            )
        recorded = info.state_digest or jobdir.read_snapshot_state(info.path).state_digest
        if recorded is not None and recorded != stored:
            raise DataError(
                f"{info.path}: the stored state (digest {stored[:16]}…) is not the one in memory at save ({str(recorded)[:16]}…)"
            )
    return loaded, got
