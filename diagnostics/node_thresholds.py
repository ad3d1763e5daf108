"""Node-verdict thresholds: bundled defaults (`data/node-thresholds.yaml`) plus an optional override.

Validation is strict and names the key, because a typo in a cron sweep's config must fail loudly once
(exit 64) instead of silently disabling a check on 10,000 nodes.

Lazy imports (start-up time): yaml, only when a thresholds file is read (foundation.yamlfile).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gpuguard.foundation.errors import UsageError

SCHEMA = "gpuguard.node-thresholds/1"
DEFAULTS_PATH = Path(__file__).resolve().parent / "data" / "node-thresholds.yaml"
VERDICT_NAMES = ("healthy", "degraded", "reset", "drain")
CLOCK_REASONS = (
    "GpuIdle",
    "ApplicationsClocksSetting",
    "SwPowerCap",
    "HwSlowdown",
    "SyncBoost",
    "SwThermalSlowdown",
    "HwThermalSlowdown",
    "HwPowerBrakeSlowdown",
    "DisplayClockSetting",
)

# key -> kind. Kinds: codes (list of ints), count (int >= 0), count? (count or null), number,
# number? , verdict (one of VERDICT_NAMES), reasons (list of clock-event reason names).
SPEC: dict[str, dict[str, str]] = {
    "xid": {
        "drain": "codes",
        "reset": "codes",
        "degraded": "codes",
        "ignore": "codes",
        "repeat_degraded": "count?",
        "unknown_code": "verdict",
    },
    "ecc": {
        "volatile_uncorrected_reset": "count?",
        "aggregate_uncorrected_sram_drain": "count?",
        "aggregate_uncorrected_dram_drain": "count?",
        "volatile_corrected_degraded": "count?",
    },
    "row_remap": {"pending": "verdict", "failure": "verdict", "uncorrectable_degraded": "count?"},
    "retired_pages": {"pending": "verdict", "total_drain": "count?"},
    "temperature": {"slowdown_margin_c": "number", "degraded_c": "number?"},
    "clock_events": {"degraded": "reasons"},
    "pcie": {"width_below_max": "verdict", "gen_below_max": "verdict", "replay_degraded": "count?"},
    "nvlink": {
        "inactive": "verdict",
        "crc_degraded": "count?",
        "replay_degraded": "count?",
        "recovery_degraded": "count?",
    },
    "node": {"expected_gpus": "count?", "missing_gpu": "verdict", "gpu_lost": "verdict"},
}


@dataclass(frozen=True)
class Thresholds:
    """Validated thresholds: `t.get("ecc", "volatile_uncorrected_reset")`."""

    values: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    source: str = "defaults"

    def get(self, section: str, key: str) -> Any:
        return self.values[section][key]


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 40, 40


def _shown(value: Any) -> str:
    """A config value for an error message: a bounded repr (a few items, two levels), never a walk
    of the whole value (YAML aliases can make it a large shared-reference graph)."""
    return _REPR.repr(value)[:60]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(kind: str, value: Any, where: str) -> Any:
    optional = kind.endswith("?")
    if optional:
        if value is None:
            return None
        kind = kind[:-1]
    nullable = " or null" if optional else ""
    if kind == "count":
        if not _is_int(value) or value < 0:
            raise UsageError(f"{where}: expected a whole number >= 0{nullable}, got {_shown(value)}")
        return value
    if kind == "number":
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise UsageError(f"{where}: expected a number{nullable}, got {_shown(value)}")
        return float(value)
    if kind == "verdict":
        if value not in VERDICT_NAMES:
            raise UsageError(f"{where}: expected one of {', '.join(VERDICT_NAMES)}, got {_shown(value)}")
        return value
    if kind == "codes":
        if not isinstance(value, list) or not all(_is_int(c) and 0 <= c < 100000 for c in value):
            raise UsageError(f"{where}: expected a list of Xid codes (whole numbers), got {_shown(value)}")
        return tuple(value)
    if kind == "reasons":
        if not isinstance(value, list) or not all(isinstance(r, str) and r in CLOCK_REASONS for r in value):
            raise UsageError(
                f"{where}: expected a list of clock-event reasons from {', '.join(CLOCK_REASONS)}, got {_shown(value)}"
            )
        return tuple(value)
    raise AssertionError(kind)  # pragma: no cover - SPEC is static


def validate(
    doc: Any, base: Mapping[str, Mapping[str, Any]] | None = None, *, what: str = "thresholds", complete: bool = False
) -> dict[str, dict[str, Any]]:
    """Validate a thresholds mapping and merge it over `base`. Pure: data in, data out."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise UsageError(f"{what}: expected a mapping of sections, got {type(doc).__name__}")
    merged: dict[str, dict[str, Any]] = {s: dict((base or {}).get(s, {})) for s in SPEC}
    for section, body in doc.items():
        if section == "schema":
            if body != SCHEMA:
                raise UsageError(f"{what}: schema must be {SCHEMA!r}, got {_shown(body)}")
            continue
        if section not in SPEC:
            raise UsageError(f"{what}: unknown section {_shown(section)} (known: {', '.join(SPEC)})")
        if not isinstance(body, dict):
            raise UsageError(f"{what}: {section}: expected a mapping, got {type(body).__name__}")
        for key, value in body.items():
            if key not in SPEC[section]:
                raise UsageError(f"{what}: unknown key {section}.{key!s:.60} (known: {', '.join(SPEC[section])})")
            merged[section][key] = _check(SPEC[section][key], value, f"{what}: {section}.{key}")
    if complete:
        for section, keys in SPEC.items():
            for key in keys:
                if key not in merged[section]:
                    raise UsageError(f"{what}: missing key {section}.{key}")
    return merged


def _read_yaml(path: Path, what: str) -> Any:
    """The one YAML reader (size cap, regular files only, no repeated key, finite numbers, bounded
    aliases); a config that breaks a rule is a usage error (64) like any other bad config."""
    from gpuguard.foundation.yamlfile import load_yaml

    return load_yaml(path, what=what, error=UsageError)


def load(path: str | Path | None = None) -> Thresholds:
    """The bundled defaults, overridden by the YAML file at `path` when given."""
    defaults = validate(_read_yaml(DEFAULTS_PATH, "bundled thresholds"), what="bundled thresholds", complete=True)
    if path is None:
        return _freeze(defaults, "defaults")
    merged = validate(_read_yaml(Path(path), "a thresholds config"), defaults, what=f"config {path}")
    return _freeze(merged, str(path))


def _freeze(values: dict[str, dict[str, Any]], source: str) -> Thresholds:
    return Thresholds(MappingProxyType({s: MappingProxyType(v) for s, v in values.items()}), source)
