"""The one restricted unpickler: pickles from outside are data, never code.

gpuguard reads three pickled formats it does not write: Flight Recorder dumps (plain containers),
DCP checkpoint metadata (a handful of torch dataclasses) and torchrun's rendezvous state (two
dataclasses and datetimes). `pickle.load` would run whatever callable a tampered file names; this
unpickler resolves a global only when the caller's `resolve` admits it, and refuses persistent ids.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import IO, Any

Resolver = Callable[[str, str], Any]
"""(module, name) -> the object to use, or None to refuse it."""


class Refused(pickle.UnpicklingError):
    """The pickle names something the caller did not admit."""


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
