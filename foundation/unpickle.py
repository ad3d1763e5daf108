"""The one restricted unpickler: pickles from outside are data, never code.

gpuguard reads three pickled formats it does not write: Flight Recorder dumps (plain containers),
DCP checkpoint metadata (a handful of torch dataclasses) and torchrun's rendezvous state (two
dataclasses and datetimes). `pickle.load` would run whatever callable a tampered file names; this
unpickler resolves a global only when the caller's `resolve` admits it, and refuses persistent ids.

Bounded, too. A pickle's memo lets a tiny file name one object many times: a list holding the same
list twice, nested 60 levels, is under 2 KB on disk (and loads in microseconds) but is 2**60 nodes
to every later walk (`repr`, `==`, a recursive copy, a format check). So every load measures what a
walk of the result would visit and refuses (`Unbounded`, a `Refused`) more than
`node_budget(size)` nodes, more than `MAX_DEPTH` levels, or a reference cycle (which is endless depth).

Why after the C load and not an opcode pre-scan: any pure-Python pass over the opcodes
(`pickletools.genops`, a counting `pickle._Unpickler`) costs 5-20x the C load of a real dump
(2,000 entries: 142 k opcodes, 74 ms for genops against 4-13 ms to load), and the load itself is
cheap and linear in the input even for the attack (the C unpickler keeps one object per memo
slot; it never unfolds). The measure is a level-by-level walk of the *unfolded* tree with
`gc.get_referents` over whole levels, at C speed (about 1 ms for that dump, never a Python step
per object), stopped the moment it passes the budget: refusing the 2**60 DAG costs a few ms.
Error messages never show a loaded value: `brief` says what it is without a repr.

Bounded in time, too, where the caller reads through workers: a tuple DAG used as a dict key
or set member is hashed inside the C load, and tuple hashes are not cached, so the hash unfolds it
(24 levels: 0.5 s; 60 levels: no end, from a file under 1 KB) before any check after the load can
run. The C hash never returns to the interpreter, so no signal handler, thread or opcode hook can
stop it in the process; a refusal that can be reported has to come from another process. So the
loads run in forked workers (`foundation.workers.map_with_deadlines` for many files,
`restricted_loads_within` for one, which counts the child's CPU time), each killed at its own
deadline (`load_deadline`: 1 s plus 1 s per 2 MiB). Why not a targeted opcode check before the load instead: any Python pass over the
opcodes costs the 74 ms above per real dump, and which memo slot feeds which SETITEM key is only
known by simulating the stack; a worker costs one fork per reader process.
"""

from __future__ import annotations

import gc
import io
import pickle
from collections.abc import Callable, Iterable, Mapping
from itertools import compress
from typing import IO, Any

Resolver = Callable[[str, str], Any]
"""(module, name) -> the object to use, or None to refuse it."""

MAX_DEPTH = 100
"""Nesting levels: Flight Recorder dumps have 5, DCP metadata and rendezvous state fewer than 10."""
MAX_NODES = 20_000_000
"""Never more nodes than this, whatever the input size (the walk's lists cost 8 bytes a node)."""
MIN_NODES = 1_000_000
"""Every pickle may unfold to this many nodes, however small it is."""
NODES_PER_BYTE = 64
"""Unfolded nodes allowed per input byte: a real 2,000-entry dump is 0.2 (412 KB, 84 k nodes), its
shared frame dicts 4; only shared references reach more, and exponentially more."""

_CONTAINERS = frozenset({list, tuple, dict, set, frozenset})


class Refused(pickle.UnpicklingError):
    """The pickle names something the caller did not admit, or would unfold without bound."""


class Unbounded(Refused):
    """The loaded object would take a walk without bound: too many nodes unfolded, too deep, cyclic."""


def admit(table: Mapping[tuple[str, str], Any]) -> Resolver:
    """A resolver that admits exactly the (module, name) pairs of `table`, mapped to its values."""
    return lambda module, name: table.get((module, name))


def node_budget(size: int | None) -> int:
    """The most nodes a pickle of `size` bytes may unfold into (`MAX_NODES` when the size is unknown)."""
    if size is None:
        return MAX_NODES
    return min(MAX_NODES, max(MIN_NODES, NODES_PER_BYTE * size))


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` whose every global lookup goes through `resolve` (None: admit nothing) and
    whose `load` refuses a result that would unfold without bound (`Unbounded`)."""

    def __init__(self, file: IO[bytes], resolve: Resolver | None = None, *, what: str = "this pickle") -> None:
        super().__init__(file)
        self._file = file
        self._resolve = resolve
        self._what = what
        self._admitted: list[Any] = []

    def find_class(self, module: str, name: str) -> Any:
        obj = self._resolve(module, name) if self._resolve is not None else None
        if obj is None:
            raise Refused(f"{_cut(module)}.{_cut(name)} is not allowed in {self._what}")
        self._admitted.append(obj)
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise Refused(f"{self._what} uses a persistent id")

    def load(self) -> Any:
        start = _tell(self._file)
        obj = super().load()
        end = _tell(self._file)
        size = end - start if start is not None and end is not None and end >= start else None
        keep = None
        if self._admitted:  # instances of admitted classes are walked too; type objects never
            keep = _CONTAINERS | {c for c in self._admitted if isinstance(c, type) and c is not type}
        check_bounded(obj, max_nodes=node_budget(size), keep=keep, what=self._what)
        return obj


def restricted_loads(data: bytes, resolve: Resolver | None = None, *, what: str = "this pickle") -> Any:
    """`pickle.loads` through `RestrictedUnpickler` (raises `pickle.UnpicklingError` and friends)."""
    return RestrictedUnpickler(io.BytesIO(data), resolve, what=what).load()


def check_bounded(
    obj: Any,
    *,
    max_nodes: int = MAX_NODES,
    max_depth: int = MAX_DEPTH,
    keep: Iterable[type] | None = None,
    what: str = "this pickle",
) -> int:
    """The number of nodes of `obj` unfolded into a tree (what `repr` or `==` would visit), or `Unbounded`.

    Walks the unfolded tree a level at a time (`gc.get_referents` of a whole level: C speed) and
    stops as soon as it passes `max_nodes` or `max_depth` (a cycle never ends, so it is "too deep").
    `keep`: the types whose referents are walked (None: every object, right only for what an
    unpickler builds without any class lookup: built-in containers and scalars, whose referents
    are exactly their items); anything else counts as one node.
    """
    kept = None if keep is None else frozenset(keep).__contains__
    level: list[Any] = [obj]
    total = 1
    for depth in range(max_depth + 1):
        if kept is not None:
            level = list(compress(level, map(kept, map(type, level))))
        level = gc.get_referents(*level)
        if not level:
            return total
        if depth == max_depth:
            raise Unbounded(f"{what} nests deeper than {max_depth} levels or refers to itself (a reference cycle)")
        total += len(level)
        if total > max_nodes:
            raise Unbounded(
                f"{what} unfolds into more than {max_nodes:,} objects through shared references "
                f"(a walk of it would not end)"
            )
    return total  # pragma: no cover - the loop returns or raises


def brief(value: Any) -> str:
    """A loaded value for an error message without its repr (a repr of a loaded container can unfold
    a shared-reference DAG): a short str, a number, bool or None as itself, anything else by type."""
    kind = type(value)
    if kind is str:
        return repr(value[:60] + ("..." if len(value) > 60 else ""))
    if kind is int:
        return repr(value) if value.bit_length() < 128 else "a huge integer"
    if kind in (float, bool) or value is None:
        return repr(value)
    return f"a {kind.__name__}"


# ----------------------------------------------------------------------------------------------
# A deadline around the load

LOAD_BASE_S = 1.0
"""Every untrusted load may take this long, however small (a real 412 KB dump loads in 4-13 ms)."""
LOAD_BYTES_PER_S = 2 << 20
"""... plus a second per 2 MiB of input: 15x slower than the slowest real dump measured (412 KB
loaded and converted in 13 ms, 31 MB/s), so a big real dump on a crowded host is never refused."""


def load_deadline(size: int | None) -> float:
    """Seconds a reader may spend on an untrusted input of `size` bytes (unknown: as for 0)."""
    return LOAD_BASE_S + max(0, size or 0) / LOAD_BYTES_PER_S


def _cut(text: str) -> str:
    return text if len(text) <= 80 else text[:80] + "..."


def _tell(file: Any) -> int | None:
    try:
        pos = file.tell()
    except (AttributeError, OSError, ValueError):
        return None
    return pos if isinstance(pos, int) else None
