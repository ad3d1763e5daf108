"""Snapshots: a committed step's full training state on disk, tied to the ledger by a manifest.

A snapshot is a DCP (`torch.distributed.checkpoint`) directory `snapshots/step-<S>/` holding the
model, optimizer, scheduler, RNG and data position after step S, plus `state.json` (step,
generation, the digest of the state as it was in memory) and `gpuguard.manifest.json` (every stored
object with its byte range and BLAKE3 digest: `generation.manifest`). It is written under a temp name and renamed into place only after
the manifest is written, so a writer killed mid-snapshot leaves a temp dir that no reader ever
takes for a snapshot.

Reading (`list_snapshots`, `select_restorable`) is torch-free: `gpu-recover restore` uses it.
Writing and loading import torch lazily.

Lazy imports (start-up time): torch and DCP, only where a snapshot is written or loaded: `gpu-recover restore` lists snapshots without torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import DataError, NoInputError
from gpuguard.generation import manifest as m
from gpuguard.recovery.snapshots.dcp_io import dcp_load, quiet_dcp
from gpuguard.recovery.snapshots.digests import state_leaves
from gpuguard.recovery.snapshots.measure import add_nonfinite, non_tensor_facts
from gpuguard.recovery.snapshots.soundness import Expect, Policy, Soundness, judge, of_extra

KINDS = (jobdir.SNAPSHOTS_DIR, jobdir.CHECKPOINTS_DIR)


# ---------------------------------------------------------------- manifest adapter
# generation.manifest owns the manifest format; these three calls are all this module needs.


def build_and_write_manifest(
    directory: Path, *, step: int, generation: int, owner: str, extra: Mapping[str, Any] | None = None
) -> str:
    """Build the manifest of the DCP checkpoint in `directory` (rank 0 wrote it), write it, return its digest."""

    manifest = m.build_manifest(directory, step=step, generation=generation, owners={0: owner}, extra=extra)
    m.write_manifest(manifest, directory)
    return manifest.digest


def read_and_verify_manifest(directory: Path) -> tuple[Any, list[str]]:
    """(manifest, problems) for `directory`; problems empty = complete and every digest matches."""

    if not (directory / m.MANIFEST_FILE).exists():
        return None, [f"no {m.MANIFEST_FILE} (incomplete snapshot)"]
    try:
        manifest = m.load_manifest(directory)
    except (DataError, NoInputError) as exc:
        return None, [str(exc)]
    return manifest, list(m.verify_manifest(manifest, directory))


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot (or durable checkpoint) directory as found on disk."""

    step: int
    path: Path
    kind: str  # "snapshots" | "checkpoints"
    generation: int | None = None
    state_digest: str | None = None
    manifest_digest: str | None = None
    layout: str | None = None  # the verified manifest's `extra.layout` ("gpuguard.sharded/1"; None: replicated)
    metadata_digest: str | None = None  # the BLAKE3 of `.metadata` the verified manifest binds
    warning: str | None = None  # what a restore of it must say (a legacy manifest: `.metadata` bound to nothing)
    unsound: str | None = None  # a written snapshot whose soundness record says unsound: why (one line)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": str(self.path),
            "kind": self.kind,
            "generation": self.generation,
            "state_digest": self.state_digest,
            "manifest_digest": self.manifest_digest,
            "layout": self.layout,
            "metadata_digest": self.metadata_digest,
            "warning": self.warning,
            "unsound": self.unsound,
        }


@dataclass(frozen=True)
class Rejection:
    step: int
    path: Path
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "path": str(self.path), "reason": self.reason}


@dataclass(frozen=True)
class Selection:
    """What `select_restorable` found: the state to restore (or None) and why the others were not."""

    chosen: SnapshotInfo | None
    rejected: tuple[Rejection, ...] = field(default_factory=tuple)
    limit: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.to_dict() if self.chosen else None,
            "limit": self.limit,
            "rejected": [r.to_dict() for r in self.rejected],
        }


def list_snapshots(snapshot_root: str | Path, kinds: tuple[str, ...] = KINDS) -> list[SnapshotInfo]:
    """Every `step-<S>` directory under the snapshot root (snapshots and durable checkpoints), newest first.

    Nothing is verified here (cheap listing); `select_restorable` verifies.
    """
    found: list[SnapshotInfo] = []
    for kind in kinds:
        parent = Path(snapshot_root) / kind
        for step, path in jobdir.step_dirs(parent):
            gen = digest = None
            try:
                rec = jobdir.read_snapshot_state(path)
                gen, digest = rec.generation, rec.state_digest
            except (DataError, NoInputError):
                pass
            found.append(SnapshotInfo(step, path, kind, gen, digest))
    found.sort(key=lambda s: (s.step, s.kind == "snapshots"), reverse=True)
    return found


def select_restorable(
    snapshot_root: str | Path,
    at_or_before_step: int | None = None,
    *,
    expected_manifest_digest: str | None = None,
    max_tries: int = 8,
    check: Callable[[SnapshotInfo], str | None] | None = None,
) -> Selection:
    """The newest complete, verified snapshot at or before `at_or_before_step` (None: any).

    Each candidate is verified against its manifest (every file present, every digest equal) and
    its state record; a corrupt or incomplete one is rejected with the reason and the next older
    one is tried, at most `max_tries` times (never an endless search over a broken disk). With
    `expected_manifest_digest` (a certificate's frontier) only that exact state is acceptable.
    `check` (a verified candidate -> a problem or None) adds a layout's own rule, e.g. every member's
    part of a sharded snapshot (`recovery.snapshots.sharded.select_sharded`).
    """
    rejected: list[Rejection] = []
    tries = 0
    for info in list_snapshots(snapshot_root):
        if at_or_before_step is not None and info.step > at_or_before_step:
            rejected.append(Rejection(info.step, info.path, f"after the frontier (step {at_or_before_step})"))
            continue
        if tries >= max_tries:
            rejected.append(Rejection(info.step, info.path, f"not tried: {max_tries} candidates already rejected"))
            continue
        tries += 1
        problem, verified = _verify(info)
        if (
            problem is None
            and expected_manifest_digest is not None
            and verified.manifest_digest != expected_manifest_digest
        ):
            problem = f"manifest digest {verified.manifest_digest} is not the certified {expected_manifest_digest}"
        if problem is None and check is not None:
            problem = check(verified)
        if problem is not None:
            rejected.append(Rejection(info.step, info.path, problem))
            continue
        return Selection(verified, tuple(rejected), at_or_before_step)
    return Selection(None, tuple(rejected), at_or_before_step)


def _verify(info: SnapshotInfo) -> tuple[str | None, SnapshotInfo]:
    try:
        rec = jobdir.read_snapshot_state(info.path)
    except (DataError, NoInputError) as exc:
        return f"state record: {exc}", info
    if rec.step != info.step:
        return f"state record says step {rec.step}, directory says {info.step}", info
    manifest, problems = read_and_verify_manifest(info.path)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return f"corrupt: {problems[0]}{more}", info
    try:
        verdict = of_extra(manifest.extra)
    except ValueError as exc:
        return f"corrupt: soundness record: {exc}", info
    if verdict is not None and not verdict.sound:
        return f"unsound: {verdict.line()}", info
    layout = dict(manifest.extra).get("layout")
    return None, SnapshotInfo(
        info.step,
        info.path,
        info.kind,
        rec.generation,
        rec.state_digest,
        manifest.digest,
        layout if isinstance(layout, str) else None,
        None if manifest.metadata is None else manifest.metadata.digest,
        m.legacy_note(manifest),
    )


# ---------------------------------------------------------------- torch side


def state_digest(state: Mapping[str, Any], measured: dict[str, Any] | None = None) -> str:
    """SHA-256 over a (nested) state dict: keys, dtypes, shapes and bytes of every tensor, in key
    order. Equal on every rank that holds the same state, whatever the world size.

    With `measured` (a dict), the same walk counts every floating tensor's NaN and infinite values
    into it (`nonfinite`, `tensors`, `elements`: a `digests.measure` result of one replica, group
    0), for the soundness check (`measured_state`)."""
    import torch

    h = hashlib.sha256()
    nonfinite: dict[str, dict[str, list[int]]] = {}
    counts = [0, 0]

    def walk(prefix: str, dotted: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k in sorted(value, key=str):
                walk(f"{prefix}/{k}", f"{dotted}.{k}" if dotted else str(k), value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", f"{dotted}.{i}", v)
        elif isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{prefix}:{t.dtype}:{tuple(t.shape)}\n".encode())
            h.update(_tensor_bytes(t))
            if measured is not None:
                add_nonfinite(nonfinite, dotted, 0, t)
                counts[0] += 1
                counts[1] += t.numel()
        else:
            h.update(f"{prefix}={value!r}\n".encode())

    walk("", "", state)
    if measured is not None:
        measured.update(nonfinite=nonfinite, tensors=counts[0], elements=counts[1], sums={}, contrib=None)
    return h.hexdigest()


def measured_state(state: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(state digest, soundness measurement) of a replicated state in one walk (the finiteness
    counts fused into the digest's pass; the non-tensor facts from the same leaves)."""
    measured: dict[str, Any] = {}
    digest = state_digest(state, measured)
    measured["facts"] = non_tensor_facts(state, state_leaves(state))
    return digest, measured


def _tensor_bytes(t: Any) -> bytes:
    """The raw bytes of a contiguous CPU tensor (numpy is not installed everywhere)."""
    import ctypes

    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def clone_state(state: Mapping[str, Any], *, to_cpu: bool = True) -> dict[str, Any]:
    """A detached deep copy of a state dict: the snapshot thread writes it while training goes on.
    `to_cpu=False` copies each tensor where it is (a DTensor keeps its mesh: the sharded writer)."""
    import torch

    def walk(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        if isinstance(value, torch.Tensor):
            # one copy: to the host (a CUDA tensor is not copied twice), or where it is
            return value.detach().to("cpu", copy=True) if to_cpu else value.detach().clone()
        return value

    return walk(state)


def save_snapshot(
    snapshot_root: str | Path,
    step: int,
    state: Mapping[str, Any],
    *,
    generation: int,
    owner: str,
    kind: str = jobdir.SNAPSHOTS_DIR,
    digest: str | None = None,
    still_current: Callable[[], bool] | None = None,
    before_publish: Callable[[Path], None] | None = None,
    policy: Policy | None = None,
    expect: Expect | None = None,
) -> SnapshotInfo | None:
    """Write `state` (tensors only, nested dicts) as the snapshot of `step`; return it, or None if
    fenced (`still_current()` said this writer's generation is no longer the active one).

    DCP writes into a temp dir; `state.json` and the manifest follow; then one rename publishes it.
    Without a precomputed `digest`, the digest's pass also measures the state's soundness
    (`policy`, default `Policy()`: finite tensors and the non-tensor state `expect` says this job
    has); the verdict goes into the manifest (`extra.soundness`). An unsound state is published
    all the same (the evidence), with `unsound` set, and `select_restorable` never takes it.
    """
    import torch.distributed.checkpoint as dcp

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    parent = Path(snapshot_root) / kind
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-step-{step}-{uuid.uuid4().hex[:8]}"
    final = parent / jobdir.step_dir_name(step)
    try:
        verdict = None
        if digest is None:
            digest, measured = measured_state(state)
            # one writer holds the whole state: no replica to compare it with here
            checks = Policy() if policy is None else policy
            verdict = judge([measured], replace(checks, replicas=False), expect)
        quiet_dcp(lambda: dcp.save(dict(state), checkpoint_id=str(tmp), no_dist=True))
        jobdir.write_snapshot_state(
            tmp, jobdir.SnapshotState(step, generation, digest, owner, time.time(), tuple(sorted(state.keys())))
        )
        extra = {"soundness": verdict.to_dict()} if verdict is not None else None
        manifest_digest = build_and_write_manifest(tmp, step=step, generation=generation, owner=owner, extra=extra)
        if before_publish is not None:
            before_publish(tmp)
        if still_current is not None and not still_current():
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return SnapshotInfo(step, final, kind, generation, digest, manifest_digest, unsound=unsound_line(verdict))


def unsound_line(verdict: Soundness | None) -> str | None:
    """Why a state is unsound (its verdict's line), or None when it is sound or was not checked."""
    return None if verdict is None or verdict.sound else verdict.line()


def publish_dir(tmp: Path, final: Path) -> None:
    """(Shared by the sharded writer.) Rename `tmp` to `final`; an existing `final` (a replayed step) is moved aside first."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(tmp, final)
    jobdir.fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_snapshot(info: SnapshotInfo, template: Mapping[str, Any]) -> dict[str, Any]:
    """Load the snapshot into `template` (a state dict of the right structure, loaded in place):
    `.metadata` checked against the manifest and decoded by the restricted unpickler (`dcp_io`)."""
    state = dict(template)
    dcp_load(state, info.path, metadata_digest=info.metadata_digest, manifest_digest=info.manifest_digest, no_dist=True)
    return state


def prune(
    snapshot_root: str | Path, keep: int, kind: str = jobdir.SNAPSHOTS_DIR, protect: frozenset[int] = frozenset()
) -> list[int]:
    """Delete all but the newest `keep` step dirs of `kind` (and stale temp dirs); the removed steps.

    `protect`: steps never deleted (the active generation's certified frontier, so that
    `gpu-generation verify --deep` can always check it)."""
    parent = Path(snapshot_root) / kind
    steps = jobdir.step_dirs(parent)
    removed = []
    for step, path in steps[:-keep] if keep > 0 else steps:
        if step in protect:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(step)
    now = time.time()
    try:
        for entry in os.scandir(parent):
            if entry.name.startswith((".tmp-step-", ".old-step-")) and now - entry.stat().st_mtime > 120:
                shutil.rmtree(entry.path, ignore_errors=True)
    except FileNotFoundError:
        pass
    return removed


def copy_to_checkpoint(snapshot_root: str | Path, info: SnapshotInfo) -> SnapshotInfo:
    """Promote a verified snapshot to a durable checkpoint (same shape, `checkpoints/step-<S>/`)."""
    parent = jobdir.checkpoints_dir(snapshot_root)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-step-{info.step}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(info.path, tmp)
    for name in os.listdir(tmp):
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
    publish_dir(tmp, jobdir.checkpoint_dir(snapshot_root, info.step))
    return SnapshotInfo(
        info.step,
        jobdir.checkpoint_dir(snapshot_root, info.step),
        "checkpoints",
        info.generation,
        info.state_digest,
        info.manifest_digest,
        info.layout,
        info.metadata_digest,
        info.warning,
    )


_publish, _quiet_dcp = publish_dir, quiet_dcp  # the earlier private names, for callers that use them
