"""State manifests for DCP checkpoints: every logical object, where its bytes are, their digest, its owner.

A manifest lists each stored object of a `torch.distributed.checkpoint` checkpoint (tensor chunks
and non-tensor objects: optimizer param-group scalars, LR-scheduler state, RNG states, the
data-loader position) with its storage file, byte range and BLAKE3 digest, the owning rank and
incarnation, the generation and the step, and the BLAKE3 of DCP's own `.metadata` (the pickle that
says where every object is: `gpuguard.manifest/2`; a `/1` manifest binds it to nothing and is read
with a note). Its digest is the Merkle root over the header and the entries, which is what a
certificate's frontier names. Verification needs no torch: it re-hashes byte ranges and `.metadata`.

complete = every object of the ownership map is present exactly once;
valid    = every digest matches the stored bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import blake3

from gpuguard.foundation.boundedread import MANIFEST_BYTES, open_regular, read_bytes
from gpuguard.foundation.errors import DataError, GpuguardError, NoInputError, from_os_error
from gpuguard.generation.canonical import canonical_bytes, normalize, parse_canonical
from gpuguard.generation.dcp_metadata import (
    METADATA_FILE,
    decode_metadata,
    load_scalar,
    metadata_digest,
    read_metadata_bytes,
)
from gpuguard.generation.merkle import leaf, merkle_root

MANIFEST_SCHEMA = "gpuguard.manifest/2"  # what every writer writes: `.metadata` bound (`metadata`)
LEGACY_SCHEMA = "gpuguard.manifest/1"  # `.metadata` bound to nothing: read (restored with a warning); written
# only for a checkpoint that has no `.metadata` (the transitions simulator's JSON "shards")
_HEADER_KEYS = {"schema", "generation", "step", "ownership_map_version", "extra"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
MANIFEST_FILE = "gpuguard.manifest.json"
_BIG = 1 << 20  # above this, hash with BLAKE3's threads
POPULATE_MAX_BYTES = 256 << 20  # data files up to this are mapped in one pass (MAP_POPULATE)
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")

Progress = Callable[[int], None]
# the canonical encoder (see canonical.py), kept for the hot loop over 100,000s of entries
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def category(fqn: str) -> str:
    """What kind of state an object is, from its fully qualified name."""
    parts = fqn.lower().split(".")
    head = parts[0]
    if "param_groups" in parts:
        return "optimizer-param-group"
    if head in ("optim", "optimizer", "optimizers") or "optimizer" in head:
        return "optimizer"
    if "sched" in head:
        return "lr-scheduler"
    if "rng" in head or "random" in head or "generator" in head:
        return "rng"
    if any(k in head for k in ("loader", "dataloader", "data_loader", "sampler", "dataset")):
        return "data-loader"
    if head in ("model", "module") or "model" in head:
        return "model"
    return "other"


@dataclass(frozen=True)
class ObjectSpec:
    """What DCP's metadata says about one stored object (before hashing)."""

    fqn: str
    kind: str  # "tensor" | "bytes"
    global_shape: tuple[int, ...] | None
    dtype: str | None
    chunk_offsets: tuple[int, ...] | None
    chunk_sizes: tuple[int, ...] | None
    file: str
    byte_offset: int
    byte_length: int

    @cached_property
    def key(self) -> str:
        """The object's identity: FQN plus chunk offsets (a tensor may be stored as several chunks)."""
        if self.chunk_offsets is None:
            return self.fqn
        return f"{self.fqn}@{','.join(map(str, self.chunk_offsets))}"


@dataclass(frozen=True)
class ManifestEntry:
    spec: ObjectSpec
    digest: str
    owner_rank: int
    owner_incarnation: str
    generation: int
    step: int
    value: Any = None  # a non-tensor object's plain value (e.g. a param-group lr), when it is a scalar

    @property
    def key(self) -> str:
        return self.spec.key

    def to_dict(self) -> dict[str, Any]:
        s = self.spec
        return {
            "fqn": s.fqn,
            "kind": s.kind,
            "category": category(s.fqn),
            "global_shape": None if s.global_shape is None else list(s.global_shape),
            "dtype": s.dtype,
            "chunk_offsets": None if s.chunk_offsets is None else list(s.chunk_offsets),
            "chunk_sizes": None if s.chunk_sizes is None else list(s.chunk_sizes),
            "file": s.file,
            "byte_offset": s.byte_offset,
            "byte_length": s.byte_length,
            "digest": self.digest,
            "owner_rank": self.owner_rank,
            "owner_incarnation": self.owner_incarnation,
            "generation": self.generation,
            "step": self.step,
            "value": self.value,
        }

    def canonical(self) -> bytes:
        """`canonical_bytes(self.to_dict())`, faster: only `value` can hold a float to normalize."""
        d = self.to_dict()
        d["value"] = normalize(d["value"])
        return _ENCODER.encode(d).encode("utf-8")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ManifestEntry:
        def tup(v: Any) -> tuple[int, ...] | None:
            return None if v is None else tuple(int(x) for x in v)

        try:
            spec = ObjectSpec(
                str(d["fqn"]),
                str(d["kind"]),
                tup(d["global_shape"]),
                d["dtype"],
                tup(d["chunk_offsets"]),
                tup(d["chunk_sizes"]),
                str(d["file"]),
                int(d["byte_offset"]),
                int(d["byte_length"]),
            )
            entry = cls(
                spec,
                str(d["digest"]),
                int(d["owner_rank"]),
                str(d["owner_incarnation"]),
                int(d["generation"]),
                int(d["step"]),
                d.get("value"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"manifest entry {d.get('fqn', '?')!r}: bad field ({exc})") from None
        if entry.canonical() != canonical_bytes(dict(d)):
            raise ValueError(f"manifest entry {spec.fqn!r}: unexpected or inconsistent fields")
        return entry


@dataclass(frozen=True)
class MetadataBinding:
    """DCP's `.metadata` as a manifest binds it: its size and BLAKE3 (`gpuguard.manifest/2`). torch
    loads `.metadata` with a plain `pickle.load`; bound, a replaced one is refused before anything
    decodes it (and even then only the restricted unpickler does: `generation.dcp_metadata`)."""

    digest: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"file": METADATA_FILE, "bytes": self.size, "digest": self.digest}

    @classmethod
    def from_dict(cls, d: Any) -> MetadataBinding:
        if not isinstance(d, dict) or set(d) != {"file", "bytes", "digest"}:
            raise ValueError("metadata must be {file, bytes, digest}")
        size, digest = d["bytes"], d["digest"]
        if d["file"] != METADATA_FILE or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"metadata must name {METADATA_FILE} and its size")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError("metadata digest must be 64 lower-case hex digits")
        return cls(digest, size)

    @classmethod
    def of(cls, data: bytes) -> MetadataBinding:
        return cls(metadata_digest(data), len(data))


def entries_digest(entries: Iterable[ManifestEntry], header: Mapping[str, Any]) -> str:
    """Merkle root: the header (generation, step, ownership version) first, then every entry by key."""
    ordered = sorted(entries, key=lambda e: (e.key, e.spec.file, e.spec.byte_offset))
    return merkle_root([leaf(canonical_bytes(dict(header)))] + [leaf(e.canonical()) for e in ordered])


@dataclass(frozen=True)
class Manifest:
    generation: int
    step: int
    entries: tuple[ManifestEntry, ...]
    ownership_map_version: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    metadata: MetadataBinding | None = None  # None: a `gpuguard.manifest/1` document (legacy)

    def header(self) -> dict[str, Any]:
        """The first Merkle leaf: everything but the entries (`.metadata`'s binding included)."""
        head = {
            "schema": MANIFEST_SCHEMA if self.metadata is not None else LEGACY_SCHEMA,
            "generation": self.generation,
            "step": self.step,
            "ownership_map_version": self.ownership_map_version,
            "extra": dict(self.extra),
        }
        if self.metadata is not None:
            head["metadata"] = self.metadata.to_dict()
        return head

    @cached_property
    def digest(self) -> str:
        """Merkle root over the header and the entries (computed once: a Manifest is immutable)."""
        return entries_digest(self.entries, self.header())

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header(),
            "entries": [e.to_dict() for e in sorted(self.entries, key=lambda e: (e.key, e.spec.file))],
            "digest": self.digest,
        }

    def non_tensor_state(self) -> dict[str, Any]:
        """Non-tensor objects by FQN with their plain values (None when not a scalar)."""
        return {e.spec.fqn: e.value for e in self.entries if e.spec.kind == "bytes"}


def specs_from_metadata(meta: Any) -> list[ObjectSpec]:
    """ObjectSpecs from a DCP `Metadata` (duck-typed: no torch import needed here)."""
    out = []
    for index, info in meta.storage_data.items():
        fqn = index.fqn
        md = meta.state_dict_metadata.get(fqn)
        if md is not None and hasattr(md, "chunks"):
            offsets = tuple(int(x) for x in index.offset) if index.offset is not None else None
            sizes = None
            if offsets is not None:
                for ch in md.chunks:
                    if tuple(int(x) for x in ch.offsets) == offsets:
                        sizes = tuple(int(x) for x in ch.sizes)
            out.append(
                ObjectSpec(
                    fqn,
                    "tensor",
                    tuple(int(x) for x in md.size),
                    str(md.properties.dtype).removeprefix("torch."),
                    offsets,
                    sizes,
                    str(info.relative_path),
                    int(info.offset),
                    int(info.length),
                )
            )
        else:
            out.append(
                ObjectSpec(
                    fqn, "bytes", None, None, None, None, str(info.relative_path), int(info.offset), int(info.length)
                )
            )
    return out


def owner_of(file: str) -> int:
    """DCP names data files `__<rank>_<n>.distcp`: the rank that wrote them."""
    m = _RANK_FILE.match(file)
    return int(m.group(1)) if m else -1


def _incarnation_id(owner: Any) -> str:
    if owner is None:
        return ""
    if isinstance(owner, str):
        return owner
    inc = getattr(owner, "incarnation", owner)
    return str(getattr(inc, "id", inc))


class _Files:
    """Open data files once, mmapped; byte ranges are hashed straight from the page cache.

    Each file goes through `foundation.boundedread.open_regular` (no link, and a FIFO, device or
    directory refused before anything blocks: one FIFO `.distcp` used to hang every restart). A file
    up to `POPULATE_MAX_BYTES` is mapped in one kernel pass; a larger one is mapped lazily, so only
    the byte ranges the manifest names are ever touched (a planted 1 GB file costs its ranges only)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._maps: dict[str, mmap.mmap | bytes] = {}

    def range(self, file: str, offset: int, length: int) -> memoryview:
        m = self._maps.get(file)
        if m is None:
            path = self.root / file
            if Path(file).is_absolute() or ".." in Path(file).parts:
                raise DataError(f"{file}: storage path escapes the checkpoint directory")
            try:
                with open_regular(path, what="checkpoint data", follow_links=False) as (fd, st):
                    # MAP_POPULATE: map the (page-cached) file in one kernel pass, not one fault per page
                    populate = getattr(mmap, "MAP_POPULATE", 0) if st.st_size <= POPULATE_MAX_BYTES else 0
                    m = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ) if st.st_size else b""
            except NoInputError:
                raise NoInputError(f"{path}: storage file missing") from None
            except OSError as exc:
                raise from_os_error(exc, str(path)) from None
            self._maps[file] = m
        if offset < 0 or length < 0 or offset + length > len(m):
            raise DataError(f"{self.root / file}: byte range {offset}+{length} past the end ({len(m)} bytes)")
        return memoryview(m)[offset : offset + length]

    def close(self) -> None:
        for m in self._maps.values():
            if isinstance(m, mmap.mmap):
                m.close()
        self._maps.clear()


def hash_range(view: memoryview) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO if len(view) >= _BIG else 1)
    h.update(view)
    return h.hexdigest()


def build_entries(
    specs: Iterable[ObjectSpec],
    checkpoint_dir: str | Path,
    *,
    step: int,
    generation: int,
    owners: Mapping[int, Any] | None = None,
    progress: Progress | None = None,
    values: bool = True,
) -> list[ManifestEntry]:
    """Hash every object's stored bytes and stamp it with owner, generation and step."""
    files = _Files(Path(checkpoint_dir))
    owners = owners or {}
    out = []
    try:
        for s in sorted(specs, key=lambda s: (s.file, s.byte_offset)):
            view = files.range(s.file, s.byte_offset, s.byte_length)
            try:
                digest = hash_range(view)
                value = None
                if values and s.kind == "bytes" and s.byte_length <= 1 << 16:
                    value = load_scalar(bytes(view))
            finally:
                view.release()
            rank = owner_of(s.file)
            out.append(ManifestEntry(s, digest, rank, _incarnation_id(owners.get(rank)), generation, step, value))
            if progress:
                progress(s.byte_length)
    finally:
        files.close()
    return out


def build_manifest(
    checkpoint_dir: str | Path,
    *,
    step: int,
    generation: int,
    owners: Mapping[int, Any] | None = None,
    metadata: Any = None,
    ownership_map_version: int = 0,
    progress: Progress | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Manifest:
    """The manifest of a DCP checkpoint, binding its `.metadata` (metadata decoded from the bytes it
    binds, with the restricted unpickler, unless given); `extra`: the writer's facts about the
    state (its header's `extra`: a soundness record, a layout).

    `owners` maps rank -> Incarnation / Member / incarnation id (the writer of `__<rank>_*.distcp`).
    """
    raw = read_metadata_bytes(checkpoint_dir)
    if metadata is None:  # the writer's own fresh file: decoded in this process (see `load_metadata`)
        metadata = decode_metadata(raw, Path(checkpoint_dir) / METADATA_FILE, forked=False)
    entries = build_entries(
        specs_from_metadata(metadata),
        checkpoint_dir,
        step=step,
        generation=generation,
        owners=owners,
        progress=progress,
    )
    return Manifest(generation, step, tuple(entries), ownership_map_version, dict(extra or {}), MetadataBinding.of(raw))


def write_manifest(manifest: Manifest, checkpoint_dir: str | Path) -> Path:
    """Write `<checkpoint_dir>/gpuguard.manifest.json` atomically (temp + fsync + rename)."""
    path = Path(checkpoint_dir) / MANIFEST_FILE
    tmp = path.with_name(f".{MANIFEST_FILE}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(canonical_bytes(manifest.to_dict()) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise from_os_error(exc, str(path)) from None
    return path


def load_manifest(path: str | Path) -> Manifest:
    """Read a manifest file (bounded: `foundation.boundedread`, at most `MANIFEST_BYTES`, no link, no
    FIFO); a truncated or altered one is a DataError naming the file."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_FILE
    try:
        data = read_bytes(path, max_bytes=MANIFEST_BYTES, what="a manifest", follow_links=False)
    except NoInputError:
        raise NoInputError(f"{path}: no manifest") from None
    try:
        doc = parse_canonical(data.rstrip(b"\n"))
        if not isinstance(doc, dict) or doc.get("schema") not in (MANIFEST_SCHEMA, LEGACY_SCHEMA):
            raise ValueError(f"schema is not {MANIFEST_SCHEMA} (or {LEGACY_SCHEMA})")
        bound = doc["schema"] == MANIFEST_SCHEMA
        if set(doc) != _HEADER_KEYS | {"entries", "digest"} | ({"metadata"} if bound else set()):
            raise ValueError("unexpected fields")
        entries = tuple(ManifestEntry.from_dict(e) for e in doc["entries"])
        manifest = Manifest(
            int(doc["generation"]),
            int(doc["step"]),
            entries,
            int(doc["ownership_map_version"]),
            dict(doc["extra"]),
            MetadataBinding.from_dict(doc["metadata"]) if bound else None,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: unreadable manifest ({exc})") from None
    if manifest.digest != doc["digest"]:
        raise DataError(
            f"{path}: manifest digest {str(doc['digest'])[:16]}… does not match its entries "
            f"({manifest.digest[:16]}…): tampered"
        )
    return manifest


def coverage(manifest: Manifest, expected: Iterable[str] | None = None) -> list[str]:
    """Completeness: every expected object present exactly once (and nothing unexpected)."""
    counts = Counter(e.key for e in manifest.entries)
    problems = [f"object {k} is stored {n} times" for k, n in sorted(counts.items()) if n > 1]
    if expected is not None:
        want = set(expected)
        problems += [f"object {k} is missing" for k in sorted(want - set(counts))]
        problems += [f"object {k} is not in the ownership map" for k in sorted(set(counts) - want)]
    return problems


def metadata_problem(manifest: Manifest, checkpoint_dir: str | Path) -> str | None:
    """Why the checkpoint's `.metadata` is not the one the manifest binds (None: it is, or a legacy
    manifest binds none: `legacy_note`). Bounded read: a link, FIFO or oversize file is a problem."""
    bound = manifest.metadata
    if bound is None:
        return None
    try:
        got = MetadataBinding.of(read_metadata_bytes(checkpoint_dir))
    except GpuguardError as exc:
        return f"{METADATA_FILE}: {exc}"
    if got != bound:
        return (
            f"{METADATA_FILE}: BLAKE3 {got.digest[:16]}… ({got.size:,} bytes) is not the manifest's "
            f"{bound.digest[:16]}… ({bound.size:,} bytes): replaced or corrupted"
        )
    return None


def legacy_note(manifest: Manifest) -> str | None:
    """The warning for a `gpuguard.manifest/1` document (None for a current one)."""
    if manifest.metadata is not None:
        return None
    return (
        f"{LEGACY_SCHEMA}: its DCP {METADATA_FILE} is bound to nothing (written before "
        f"{MANIFEST_SCHEMA}); it is decoded only by the restricted unpickler"
    )


def verify_manifest(
    manifest: Manifest,
    checkpoint_dir: str | Path,
    *,
    expected: Iterable[str] | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """Problems with a checkpoint against its manifest: empty = complete and valid (`.metadata` too)."""
    problems = coverage(manifest, expected)
    bad_metadata = metadata_problem(manifest, checkpoint_dir)
    if bad_metadata is not None:
        problems.append(bad_metadata)
    files = _Files(Path(checkpoint_dir))
    try:
        for e in sorted(manifest.entries, key=lambda e: (e.spec.file, e.spec.byte_offset)):
            s = e.spec
            try:
                view = files.range(s.file, s.byte_offset, s.byte_length)
            except (NoInputError, DataError) as exc:
                problems.append(f"object {e.key}: {exc}")
                continue
            try:
                if hash_range(view) != e.digest:
                    problems.append(
                        f"object {e.key}: digest mismatch in {s.file} bytes {s.byte_offset}+{s.byte_length} (corrupted)"
                    )
            finally:
                view.release()
            if progress:
                progress(s.byte_length)
    finally:
        files.close()
    return problems


def find_manifests(root: str | Path, max_depth: int = 3) -> list[Path]:
    """Manifest files under a job directory (checkpoints and snapshots), a few levels deep."""
    root = Path(root)
    found: list[Path] = []
    for depth in range(max_depth + 1):
        pattern = "/".join(["*"] * depth + [MANIFEST_FILE])
        found += root.glob(pattern)
    # skip work in progress: writers stage checkpoints in hidden temp dirs before renaming them
    return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(root).parts))
