"""The one restricted unpickler: pickles from outside are data, never code.

gpuguard reads three pickled formats it does not write: Flight Recorder dumps (plain containers),
DCP checkpoint metadata (a handful of torch dataclasses) and torchrun's rendezvous state (two
dataclasses and datetimes). `pickle.load` would run whatever callable a tampered file names; this
unpickler resolves a global only when the caller's `resolve` admits it, and refuses persistent ids.

A pickle's memo lets a tiny file name one object many times: a list holding the same list twice,
nested 60 levels, is 1.8 KB on disk and 2**60 elements to any walk (`repr`, `==`, `hash`, a
recursive copy). `check_bounded` measures what a walk would visit, counting each object once
(by id), and refuses a loaded object whose unfolded tree exceeds `MAX_NODES` or `MAX_DEPTH`, or
that holds a cycle; callers never `repr` a loaded object for an error message either.
"""

from __future__ import annotations

import io
import itertools
import pickle
from collections.abc import Callable, Mapping
from typing import IO, Any

Resolver = Callable[[str, str], Any]
"""(module, name) -> the object to use, or None to refuse it."""


MAX_NODES = 10_000_000
"""Containers and scalars of the unfolded tree: a 2,000-entry Flight Recorder dump is ~0.2 M."""
MAX_DEPTH = 100
"""Nesting levels: Flight Recorder dumps have 5, DCP metadata and rendezvous state fewer than 10."""


class Refused(pickle.UnpicklingError):
    """The pickle names something the caller did not admit."""


class Unbounded(pickle.UnpicklingError):
    """The loaded object would take a walk without bound: too many nodes unfolded, too deep, cyclic."""


def admit(table: Mapping[tuple[str, str], Any]) -> Resolver:
    """A resolver that admits exactly the (module, name) pairs of `table`, mapped to its values."""
    return lambda module, name: table.get((module, name))


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` whose every global lookup goes through `resolve` (None: admit nothing)."""

    def __init__(self, file: IO[bytes], resolve: Resolver | None = None, *, what: str = "this pickle") -> None:
        super().__init__(file)
        self._resolve = resolve
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        obj = self._resolve(module, name) if self._resolve is not None else None
        if obj is None:
            raise Refused(f"{module}.{name} is not allowed in {self._what}")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise Refused(f"{self._what} uses a persistent id")


def restricted_loads(data: bytes, resolve: Resolver | None = None, *, what: str = "this pickle") -> Any:
    """`pickle.loads` through `RestrictedUnpickler` (raises `pickle.UnpicklingError` and friends)."""
    return RestrictedUnpickler(io.BytesIO(data), resolve, what=what).load()


_CONTAINERS = frozenset({list, tuple, dict, set, frozenset})
_IS_CONTAINER = _CONTAINERS.__contains__


def _open(obj: Any) -> list[Any]:
    """[obj, an iterator over its container children, 1 + its scalar children]: scalars counted at C speed."""
    items: Any = [*obj.keys(), *obj.values()] if type(obj) is dict else obj
    kids = list(itertools.compress(items, map(_IS_CONTAINER, map(type, items))))
    return [obj, iter(kids), 1 + len(items) - len(kids)]


def check_bounded(obj: Any, *, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> int:
    """The size of `obj` unfolded into a tree (what `repr` or `==` would visit), or `Unbounded`.

    Linear in the distinct objects and references: each container is walked once and its unfolded
    size is remembered by id, so a shared-reference DAG costs its size on disk, not its unfolding.
    Containers are the built-in list, tuple, dict, set and frozenset (what an unpickler builds
    without a class lookup); anything else counts as one node.
    """
    if type(obj) not in _CONTAINERS:
        return 1
    too_many = f"unfolds into more than {max_nodes:,} nodes (shared references)"
    done: dict[int, int] = {}
    on_path = {id(obj)}
    stack: list[list[Any]] = [_open(obj)]
    while stack:
        frame = stack[-1]
        for child in frame[1]:
            known = done.get(id(child))
            if known is not None:
                frame[2] += known
                if frame[2] > max_nodes:
                    raise Unbounded(too_many)
                continue
            if id(child) in on_path:
                raise Unbounded("holds a reference cycle")
            if len(stack) >= max_depth:
                raise Unbounded(f"nests deeper than {max_depth} levels")
            on_path.add(id(child))
            stack.append(_open(child))
            break
        else:
            stack.pop()
            on_path.discard(id(frame[0]))
            done[id(frame[0])] = frame[2]
            if not stack:
                return int(frame[2])
            stack[-1][2] += frame[2]
            if stack[-1][2] > max_nodes:
                raise Unbounded(too_many)
            continue
        if frame[2] > max_nodes:
            raise Unbounded(too_many)
    return 1  # not reached: the root's frame returns
