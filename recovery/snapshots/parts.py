"""The part format of a sharded snapshot: what each member wrote, hashed by that member, and its RNG.

A sharded snapshot is the same `snapshots/step-<S>/` directory as a replicated one (so listing,
pruning, `gpu-recover restore` and `gpu-generation verify --deep` treat it alike), written by a
collective DCP save (`recovery.snapshots.sharded`): each rank writes `__<rank>_0.distcp` and then
hashes its own file's objects (BLAKE3, `generation.manifest.build_entries`) into
`gpuguard.part-<R>.json`, with its RNG states. The coordinator checks that the parts together
cover DCP's metadata exactly once (`coverage_problems`) and names every part's digest in the one
manifest. A published snapshot with a part missing or altered is refused by `select_sharded` with
one line (`parts_problem`). Format: docs/formats/sharded-snapshots.md.

Lazy imports (start-up time): torch, only to read or set the RNG states.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.foundation import jobdir
from gpuguard.foundation.errors import DataError, NoInputError
from gpuguard.generation import manifest as m
from gpuguard.generation.canonical import canonical_bytes
from gpuguard.generation.ownership import ShardLayout, layout_from_keys
from gpuguard.recovery.snapshots.store import (
    Selection,
    SnapshotInfo,
    select_restorable,
)

LAYOUT = "gpuguard.sharded/1"  # manifest extra["layout"] and state.json "layout"


PART_SCHEMA = "gpuguard.sharded-part/1"


MAX_PART_BYTES = 64 << 20  # a part lists one rank's objects: a few MiB for 100,000s of chunks


def part_name(rank: int) -> str:
    """A member's part sits beside the data files (no subdirectory: a snapshot stays one flat directory)."""
    return f"gpuguard.part-{int(rank)}.json"


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
