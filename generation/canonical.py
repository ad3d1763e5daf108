"""Canonical encoding: one byte string per value, so a digest or a signature means one thing.

Sorted keys, compact separators, UTF-8 (no escapes to flip), integers for integral numbers.
A float that holds an integer is written as that integer; NaN and infinities are refused
(they have no portable JSON form). Times in records are carried as decimal strings (see
`records.encode_time`) so they round-trip exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from gpuguard.foundation.boundedread import json_depth_problem

_PLAIN = (str, int, bool, type(None))


def normalize(value: Any) -> Any:
    """The JSON value that `value` canonically stands for (tuples -> lists, integral floats -> ints)."""
    t = type(value)
    if t in _PLAIN:
        return value
    if t is float:
        if not math.isfinite(value):
            raise ValueError(f"non-finite number {value!r} has no canonical form")
        return int(value) if value.is_integer() else value
    if t is list or t is tuple:  # one comprehension, no second pass: 100,000-member tables go through here
        return [v if type(v) in _PLAIN else normalize(v) for v in value]
    if t is dict or isinstance(value, Mapping):
        for k in value:
            if type(k) is not str:
                raise TypeError(f"canonical mappings need string keys, got {type(k).__name__}")
        # in key order: the encoder then writes them as they come (sorting 100,000 keys alone is
        # several times cheaper than the encoder's sort of (key, value) pairs)
        return {k: v if type(v) in _PLAIN else normalize(v) for k in sorted(value) for v in (value[k],)}
    if isinstance(value, (bool, int, str)):  # subclasses (IntEnum, str enums): their plain value
        return (bool if isinstance(value, bool) else int if isinstance(value, int) else str)(value)
    if isinstance(value, float):
        return normalize(float(value))
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    raise TypeError(f"{type(value).__name__} has no canonical encoding")


def canonical_bytes(value: Any) -> bytes:
    """The canonical encoding of a JSON-like value."""
    return json.dumps(  # normalize() put every mapping's keys in order
        normalize(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest(value: Any) -> str:
    """SHA-256 (hex) of the canonical encoding."""
    return sha256_hex(canonical_bytes(value))


def parse_canonical(data: bytes) -> Any:
    """Parse bytes that must be exactly the canonical encoding of what they contain.

    Raises ValueError when the bytes are not JSON or not in canonical form (a flipped byte that
    still parses, e.g. a changed escape or added space, is caught here, not silently accepted).
    """
    problem = json_depth_problem(
        data
    )  # before the parser: a 10,000-deep record is a ValueError, never a RecursionError
    if problem is not None:
        raise ValueError(f"not valid JSON: {problem}")
    try:
        text = data.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_non_integral)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    # What the parser returns holds only dicts with string keys, lists, strings, ints, bools, None
    # and (non-integral) floats: `normalize` would only sort the keys, so the encoder does it here,
    # with no second walk over a 100,000-member table.
    again = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    if again.encode("utf-8") != data:
        raise ValueError("not in canonical form")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _non_integral(text: str) -> float:
    """A number with a fraction or exponent: canonical only when it is not integral (`1.0` is `1`)."""
    value = float(text)
    if value.is_integer():
        raise ValueError(f"{text} is an integer written as a float: not canonical")
    return value
