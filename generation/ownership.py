"""The ownership map (which rank owns which logical object, versioned) and the transfer plan (pure).

When the world changes, `plan_transfer` computes who owns what next and where each object's
bytes come from: the rank already holding it (`local`), a surviving owner (`survivor`), a
surviving rank holding a replica (`replica`), or the verified checkpoint (`checkpoint`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpuguard.generation.canonical import canonical_bytes, sha256_hex

SOURCES = ("local", "survivor", "replica", "checkpoint")


@dataclass(frozen=True)
class OwnershipMap:
    version: int
    world_size: int
    owners: Mapping[str, int] = field(default_factory=dict)  # object key -> rank

    def __post_init__(self) -> None:
        object.__setattr__(self, "owners", MappingProxyType(dict(self.owners)))
        bad = {k: r for k, r in self.owners.items() if not 0 <= r < self.world_size}
        if bad:
            k, r = next(iter(bad.items()))
            raise ValueError(f"object {k} is owned by rank {r}, outside world size {self.world_size}")

    def load(self) -> Counter[int]:
        return Counter(self.owners.values())

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "world_size": self.world_size, "owners": dict(self.owners)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OwnershipMap:
        return cls(int(d["version"]), int(d["world_size"]), {str(k): int(v) for k, v in d["owners"].items()})


@dataclass(frozen=True)
class Transfer:
    object: str
    to_rank: int
    source: str  # one of SOURCES
    from_rank: int | None = None  # new-world rank to copy from (None for checkpoint)

    def to_dict(self) -> dict[str, Any]:
        return {"object": self.object, "to_rank": self.to_rank, "source": self.source, "from_rank": self.from_rank}


def plan_transfer(
    old: OwnershipMap,
    *,
    new_world_size: int,
    survivors: Mapping[int, int],
    replicas: Mapping[str, Sequence[int]] | None = None,
    objects: Iterable[str] | None = None,
) -> tuple[OwnershipMap, list[Transfer]]:
    """New ownership for `new_world_size` ranks, and the transfer that realises it.

    survivors: old rank -> new rank for processes that live on (their memory still holds their
    objects); replicas: object -> old ranks that hold a copy. An object stays with its owner if the
    owner survives inside the new world; otherwise it goes to the least-loaded new rank (ties:
    lowest rank), deterministic in object order. Every object appears exactly once in the plan.
    """
    if new_world_size < 1:
        raise ValueError("the new world needs at least one rank")
    bad = {o: n for o, n in survivors.items() if not 0 <= n < new_world_size}
    if bad:
        raise ValueError(f"survivor mapping points outside the new world: {bad}")
    if len(set(survivors.values())) != len(survivors):
        raise ValueError("two survivors map to the same new rank")
    replicas = replicas or {}
    keys = sorted(set(old.owners) | set(objects or ()))
    new_owner: dict[str, int] = {}
    load: Counter[int] = Counter({r: 0 for r in range(new_world_size)})
    orphans = []
    for k in keys:
        old_rank = old.owners.get(k)
        if old_rank is not None and old_rank in survivors:
            new_owner[k] = survivors[old_rank]
            load[new_owner[k]] += 1
        else:
            orphans.append(k)
    for k in orphans:
        target = min(range(new_world_size), key=lambda r: (load[r], r))
        new_owner[k] = target
        load[target] += 1
    plan = []
    for k in keys:
        to = new_owner[k]
        old_rank = old.owners.get(k)
        holder = survivors.get(old_rank) if old_rank is not None else None
        if holder == to:
            plan.append(Transfer(k, to, "local", to))
        elif holder is not None:
            plan.append(Transfer(k, to, "survivor", holder))
        else:
            live = sorted(survivors[r] for r in replicas.get(k, ()) if r in survivors)
            if to in live:
                plan.append(Transfer(k, to, "local", to))
            elif live:
                plan.append(Transfer(k, to, "replica", live[0]))
            else:
                plan.append(Transfer(k, to, "checkpoint", None))
    return OwnershipMap(old.version + 1, new_world_size, new_owner), plan


def plan_problems(new: OwnershipMap, plan: Sequence[Transfer]) -> list[str]:
    """A plan is sound when it moves every object of the new map exactly once, to its owner."""
    counts = Counter(t.object for t in plan)
    problems = [f"object {k} planned {n} times" for k, n in sorted(counts.items()) if n > 1]
    problems += [f"object {k} has no transfer" for k in sorted(set(new.owners) - set(counts))]
    problems += [
        f"object {t.object} goes to rank {t.to_rank}, its owner is {new.owners.get(t.object)}"
        for t in plan
        if new.owners.get(t.object) != t.to_rank
    ]
    return problems


# ---------------------------------------------------------------- the sharded layout (chunks, holders)
# A sharded state (FSDP2 / HSDP / DDP) is stored as tensor chunks: `fqn@o1,o2` (the manifest's key).
# Which rank's file stores a chunk (its writer) and which ranks hold it in memory (its holders,
# replicas included) come from the DCP metadata and from every rank's own save plan.


@dataclass(frozen=True)
class Chunk:
    """A box of a tensor: `sizes` elements from `offsets` (global coordinates); () for a scalar/object."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def key(self) -> str:
        """The manifest's object key (`generation.manifest.ObjectSpec.key`)."""
        return f"{self.fqn}@{','.join(map(str, self.offsets))}"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def overlap(self, other: Chunk) -> Chunk | None:
        """The common box of two chunks of the same tensor, or None (a scalar overlaps a scalar)."""
        if other.fqn != self.fqn or len(other.offsets) != len(self.offsets):
            return None
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= lo_ for lo_, h in zip(lo, hi)):
            return None
        return Chunk(self.fqn, lo, tuple(h - lo_ for lo_, h in zip(lo, hi)))


def _chunk_from_key(key: str, sizes: Sequence[int]) -> Chunk:
    fqn, _, offs = key.rpartition("@")
    offsets = tuple(int(x) for x in offs.split(",")) if offs else ()
    return Chunk(fqn, offsets, tuple(int(s) for s in sizes))


@dataclass(frozen=True)
class ShardLayout:
    """Which rank holds which chunk of which tensor (replicas included), versioned.

    chunks: key -> Chunk; writers: key -> the rank whose storage file holds it (a snapshot's layout;
    -1 when nothing is stored yet); holders: key -> every rank holding it in memory, sorted.
    `ownership()` is the certificate's ownership map (the writer owns a chunk).
    """

    version: int
    world_size: int
    chunks: Mapping[str, Chunk]
    holders: Mapping[str, tuple[int, ...]]
    writers: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", MappingProxyType(dict(self.chunks)))
        object.__setattr__(self, "holders", MappingProxyType({k: tuple(sorted(v)) for k, v in self.holders.items()}))
        object.__setattr__(self, "writers", MappingProxyType(dict(self.writers)))
        for k, ranks in self.holders.items():
            if k not in self.chunks:
                raise ValueError(f"chunk {k} has holders but no geometry")
            bad = [r for r in ranks if not 0 <= r < self.world_size]
            if bad:
                raise ValueError(f"chunk {k} is held by rank {bad[0]}, outside world size {self.world_size}")
        for k, w in self.writers.items():
            if k not in self.chunks or not -1 <= w < self.world_size:
                raise ValueError(f"chunk {k}: writer {w} unknown or outside world size {self.world_size}")

    def ownership(self) -> OwnershipMap:
        """Writer of each stored chunk (else its lowest holder): the versioned ownership map."""
        owners = {}
        for k in self.chunks:
            w = self.writers.get(k, -1)
            if w < 0 and self.holders.get(k):
                w = self.holders[k][0]
            if w >= 0:
                owners[k] = w
        return OwnershipMap(self.version, self.world_size, owners)

    def replicas(self) -> dict[str, list[int]]:
        """key -> the ranks holding a copy (for `plan_transfer(replicas=...)`)."""
        return {k: list(v) for k, v in self.holders.items() if len(v) > 1}

    def tensors_of(self, rank: int) -> set[str]:
        """FQNs of which `rank` stores at least one chunk."""
        return {self.chunks[k].fqn for k, w in self.writers.items() if w == rank}

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "world_size": self.world_size,
            "chunks": {
                k: {
                    "sizes": list(c.sizes),
                    "holders": list(self.holders.get(k, ())),
                    "writer": self.writers.get(k, -1),
                }
                for k, c in sorted(self.chunks.items())
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardLayout:
        chunks, holders, writers = {}, {}, {}
        for k, v in d["chunks"].items():
            chunks[str(k)] = _chunk_from_key(str(k), v["sizes"])
            holders[str(k)] = tuple(int(r) for r in v["holders"])
            writers[str(k)] = int(v["writer"])
        return cls(int(d["version"]), int(d["world_size"]), chunks, holders, writers)


def layout_from_keys(
    version: int,
    world_size: int,
    held: Mapping[int, Mapping[str, Sequence[int]]],
    writers: Mapping[str, int] | None = None,
) -> ShardLayout:
    """A layout from every rank's held chunks (rank -> key -> sizes) and, for a snapshot, its writers."""
    chunks: dict[str, Chunk] = {}
    holders: dict[str, list[int]] = {}
    for rank, keys in sorted(held.items()):
        for key, sizes in keys.items():
            c = _chunk_from_key(key, sizes)
            if chunks.setdefault(key, c) != c:
                raise ValueError(
                    f"chunk {key}: rank {rank} says sizes {list(sizes)}, another {list(chunks[key].sizes)}"
                )
            holders.setdefault(key, []).append(rank)
    for key in writers or {}:
        if key not in chunks:
            raise ValueError(f"stored chunk {key} is held by no rank")
    return ShardLayout(version, world_size, chunks, {k: tuple(v) for k, v in holders.items()}, dict(writers or {}))


@dataclass(frozen=True)
class ChunkRead:
    """One piece of a new member's state and where it comes from.

    `region` (global coordinates) of the stored chunk `old_key` (in rank `old_writer`'s file) goes
    into new rank `to_rank`'s chunk; source: `local` (already in its memory), `replica` (a surviving
    peer `from_rank` holds it in memory) or `checkpoint` (read from the snapshot).
    """

    to_rank: int
    region: Chunk
    old_key: str
    old_writer: int
    source: str
    from_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "to_rank": self.to_rank,
            "fqn": self.region.fqn,
            "offsets": list(self.region.offsets),
            "sizes": list(self.region.sizes),
            "old_key": self.old_key,
            "old_writer": self.old_writer,
            "source": self.source,
            "from_rank": self.from_rank,
        }


def plan_reshard(
    old: ShardLayout,
    new: ShardLayout,
    *,
    survivors: Mapping[int, int] | None = None,
    in_memory: bool = False,
) -> list[ChunkRead]:
    """What each new member must load: for every chunk it will hold, every overlapping stored chunk.

    survivors: old rank -> new rank. `in_memory` (the in-place path): a region a surviving holder
    still has in memory is `local` (the same rank) or `replica` (another survivor, lowest new rank);
    otherwise (and always on the restart path, where memory is gone) it is read from the checkpoint.
    Every element of every new chunk is covered exactly once when `old` covers the same tensors
    (`reshard_problems` checks it).
    """
    survivors = dict(survivors or {})
    by_fqn: dict[str, list[tuple[str, Chunk]]] = {}
    for k, c in sorted(old.chunks.items()):
        if old.writers.get(k, -1) >= 0 or not old.writers:
            by_fqn.setdefault(c.fqn, []).append((k, c))
    plan = []
    for nk, nc in sorted(new.chunks.items()):
        for to in new.holders.get(nk, ()):
            for ok, oc in by_fqn.get(nc.fqn, ()):
                region = nc.overlap(oc)
                if region is None:
                    continue
                writer = old.writers.get(ok, -1)
                source, peer = "checkpoint", None
                if in_memory:
                    live = sorted(survivors[r] for r in old.holders.get(ok, ()) if r in survivors)
                    if to in live:
                        source, peer = "local", to
                    elif live:
                        source, peer = "replica", live[0]
                plan.append(ChunkRead(to, region, ok, writer, source, peer))
    return plan


def reshard_problems(new: ShardLayout, plan: Sequence[ChunkRead]) -> list[str]:
    """A reshard plan is sound when it fills every element of every held new chunk exactly once."""
    need: Counter[tuple[int, str]] = Counter()
    for k, c in new.chunks.items():
        for r in new.holders.get(k, ()):
            need[(r, k)] = c.numel
    got: Counter[tuple[int, str]] = Counter()
    for t in plan:
        for k, c in new.chunks.items():
            if c.fqn == t.region.fqn and t.to_rank in new.holders.get(k, ()) and c.overlap(t.region) == t.region:
                got[(t.to_rank, k)] += t.region.numel
                break
    return [
        f"rank {r}: chunk {k} gets {got[(r, k)]} of its {n} elements"
        for (r, k), n in sorted(need.items())
        if got[(r, k)] != n
    ]


def _ranks(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def describe_reshard(
    old: ShardLayout,
    new: ShardLayout,
    plan: Sequence[ChunkRead],
    *,
    step: int,
    survivors: Mapping[int, int] | None = None,
    lost: Iterable[int] = (),
) -> list[str]:
    """The ownership change in words, one line per old rank, then a summary, e.g.

    "rank 2 (lost): its shards of 14 tensors: read from snapshot step 41 by ranks 0,1".
    survivors (old -> new rank) and lost (old ranks) only add "(now rank N)" / "(lost)".
    """
    survivors = dict(survivors or {})
    gone = set(lost)
    lines = [f"world {old.world_size} -> {new.world_size} (ownership map v{old.version} -> v{new.version})"]
    by_writer: dict[int, list[ChunkRead]] = {}
    for t in plan:
        by_writer.setdefault(t.old_writer, []).append(t)
    for w in sorted(by_writer):
        reads = by_writer[w]
        n_tensors = len({t.region.fqn for t in reads})
        who = f"rank {w}" + (f" (now rank {survivors[w]})" if w in survivors else " (lost)" if w in gone else "")
        parts = []
        for source, words in (
            ("checkpoint", f"read from snapshot step {step} by"),
            ("replica", "sent from a surviving replica to"),
            ("local", "kept in memory by"),
        ):
            to = [t.to_rank for t in reads if t.source == source]
            if to:
                parts.append(f"{words} {_ranks(to)}")
        lines.append(f"{who}'s shards of {n_tensors} tensors: {'; '.join(parts)}")
    moved = sum(t.region.numel for t in plan if t.source != "local")
    lines.append(f"{len(plan)} chunk reads, {moved} elements moved, {sum(t.region.numel for t in plan)} in all")
    return lines


# ---------------------------------------------------------------- the restart path: the certificate's view
# The certificate of a restart is issued before the new world has formed a group or built its model, so
# the new layout is predicted from the stored one (FSDP2's rule); the runtime checks the prediction
# against the real layout after the restore (`plan_digest`) and records whether it held.

INLINE_OWNERS = 4096  # an ownership map with more objects is certified by digest and counts only
PREDICTED_BASIS = "predicted: FSDP2 Shard(0) over the new world, replicated tensors on every rank"


def _fqn_chunks(layout: ShardLayout) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, c in sorted(layout.chunks.items()):
        out.setdefault(c.fqn, []).append(k)
    return out


def predict_layout(old: ShardLayout, world_size: int, version: int) -> ShardLayout | None:
    """The layout a world of `world_size` ranks will hold of the tensors `old` stores, by FSDP2's rule:
    a tensor sharded over dim 0 (one holder per chunk) is split into ceil(n / W)-row chunks (rank r
    holds rows r*s .. min(n, (r+1)*s); none when empty), a tensor every rank held stays on every
    rank. None when some tensor fits neither rule (HSDP replica groups, another placement)."""
    if world_size < 1:
        raise ValueError("the new world needs at least one rank")
    chunks: dict[str, Chunk] = {}
    holders: dict[str, tuple[int, ...]] = {}
    everyone = tuple(range(world_size))
    for fqn, keys in _fqn_chunks(old).items():
        cs = [old.chunks[k] for k in keys]
        held = [old.holders.get(k, ()) for k in keys]
        whole = len(cs) == 1 and all(o == 0 for o in cs[0].offsets)
        if whole and (not cs[0].sizes or len(held[0]) == old.world_size > 1):  # replicated (or a scalar)
            c = cs[0]
            chunks[c.key], holders[c.key] = c, everyone
            continue
        if any(len(h) != 1 for h in held) or any(any(o != 0 for o in c.offsets[1:]) for c in cs) or not cs[0].sizes:
            return None
        rest = cs[0].sizes[1:]
        if any(c.sizes[1:] != rest for c in cs):
            return None
        n = max(c.offsets[0] + c.sizes[0] for c in cs)
        if sum(c.sizes[0] for c in cs) != n:
            return None
        step = -(-n // world_size)
        for r in range(world_size):
            lo, hi = r * step, min(n, (r + 1) * step)
            if hi > lo:
                c = Chunk(fqn, (lo, *(0 for _ in rest)), (hi - lo, *rest))
                chunks[c.key], holders[c.key] = c, (r,)
    return ShardLayout(version, world_size, chunks, holders)


def same_holding(a: ShardLayout, b: ShardLayout) -> bool:
    """The same chunks held by the same ranks (empty chunks aside): nothing would move between them."""

    def held(x: ShardLayout) -> set[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        return {
            (k, x.chunks[k].sizes, tuple(h))
            for k, h in x.holders.items()
            if x.chunks[k].numel > 0 or not x.chunks[k].sizes
        }

    return a.world_size == b.world_size and held(a) == held(b)


def plan_digest(plan: Sequence[ChunkRead]) -> str:
    """SHA-256 of the canonical plan (in plan order): what the certificate binds and the runtime re-checks."""
    return sha256_hex(canonical_bytes([t.to_dict() for t in sorted(plan, key=_read_order)]))


def _read_order(t: ChunkRead) -> tuple[int, str, tuple[int, ...], str]:
    return (t.to_rank, t.region.fqn, t.region.offsets, t.old_key)


def ownership_record(omap: OwnershipMap) -> dict[str, Any]:
    """The ownership map as the certificate carries it: version, world, per-rank counts, digest, and the
    owners themselves when there are at most INLINE_OWNERS objects."""
    doc = omap.to_dict()
    rec: dict[str, Any] = {
        "version": omap.version,
        "world_size": omap.world_size,
        "objects": len(omap.owners),
        "by_rank": {str(r): n for r, n in sorted(omap.load().items())},
        "digest": sha256_hex(canonical_bytes(doc)),
    }
    if len(omap.owners) <= INLINE_OWNERS:
        rec["owners"] = doc["owners"]
    return rec


def reshard_record(
    old: ShardLayout,
    new: ShardLayout,
    plan: Sequence[ChunkRead],
    *,
    step: int,
    lost: Iterable[int] = (),
    basis: str = PREDICTED_BASIS,
) -> dict[str, Any]:
    """A restart's reshard plan as the certificate records it: per (old writer, new rank) pair what is read,
    the plan's digest and the words of `describe_reshard`."""
    pairs: dict[tuple[int, int, str], list[ChunkRead]] = {}
    for t in plan:
        pairs.setdefault((t.old_writer, t.to_rank, t.source), []).append(t)
    reads = [
        {
            "from_rank": w,
            "to_rank": to,
            "source": src,
            "tensors": len({t.region.fqn for t in ts}),
            "chunks": len(ts),
            "elements": sum(t.region.numel for t in ts),
        }
        for (w, to, src), ts in sorted(pairs.items())
    ]
    gone = sorted(set(lost))
    return {
        "from_world": old.world_size,
        "to_world": new.world_size,
        "from_version": old.version,
        "to_version": new.version,
        "step": step,
        "lost": gone,
        "basis": basis,
        "reads": reads,
        "plan_digest": plan_digest(plan),
        "problems": reshard_problems(new, plan)[:8],
        "lines": describe_reshard(old, new, plan, step=step, lost=gone),
    }
