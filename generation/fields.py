"""How the ledger's records read and write their fields: strict types, no unknown keys, exact times.

Shared by the certificate (`records.py`) and its member table (`members.py`), so every record
refuses a renamed key or a boolean posing as an integer in the same words.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


def encode_time(t: float) -> str:
    """A time as a decimal string: exact round-trip, no float in the canonical bytes."""
    return repr(float(t))


def decode_time(s: Any) -> float:
    if not isinstance(s, str):
        raise ValueError(f"time must be a decimal string, got {type(s).__name__}")
    return float(s)


_PLAIN = (str, int, float, bool, type(None))  # leaves: no call per leaf (100,000-entry maps come through here)


def freeze(value: Any) -> Any:
    """Deep-freeze a JSON-like value so a frozen record cannot be mutated through it."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: v if type(v) in _PLAIN else freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(v if type(v) in _PLAIN else freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: v if type(v) in _PLAIN else thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [v if type(v) in _PLAIN else thaw(v) for v in value]
    return value


def is_int(v: Any) -> bool:
    """A JSON integer: a boolean is not one, even though Python says so."""
    return isinstance(v, int) and not isinstance(v, bool)


def need(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise ValueError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
        raise ValueError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


def only(d: Mapping[str, Any], fields: set[str], where: str) -> None:
    """Refuse unknown or missing fields: a renamed key must not silently become a default."""
    if d.keys() == fields:
        return
    extra, missing = sorted(set(d) - fields), sorted(fields - set(d))
    if extra:
        raise ValueError(f"{where}: unknown field(s) {', '.join(extra)}")
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
