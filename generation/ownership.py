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
