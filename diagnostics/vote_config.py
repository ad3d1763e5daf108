"""The vote's thresholds: `diagnostics/data/vote.yaml` (or the user's file), read and checked.

Why a module of its own: the thresholds are read once, before any judging (a judge reads only its own
configuration), and every value is checked here so a wrong one fails with one line naming it, never a
vote that quietly uses it.

Lazy imports (start-up time): the YAML reader (yaml), only when the configuration is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from gpuguard.diagnostics.voters import VoteConfig
from gpuguard.foundation.errors import DataError

DATA = Path(__file__).resolve().parent / "data" / "vote.yaml"
VOTE_YAML_MAX_BYTES = 64 * 1024  # the packaged file is ~6 KiB
DEFAULT_CONFIG = VoteConfig()

# what each threshold may be (load_config refuses the rest with one line naming it)
_AT_LEAST_ONE = {"confirm_checks", "min_samples", "cohort_min_ranks", "comm_min_reports", "arrival_window"}
_AT_LEAST_ONE |= {"arrival_min_collectives", "outlier_cap_k", "impact_min_slowdown"}
_POSITIVE = {"check_interval_s", "bandwidth_bytes_s", "hang_k"}
_FRACTIONS = {"cohort_ratio", "mad_floor_frac", "cpu_progress_frac", "arrival_min_frac", "arrival_max_late_frac"}


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> VoteConfig:
    """The YAML thresholds (package default, or `path`), validated: unknown keys, non-numbers, non-finite or
    out-of-range values and integers given as fractions refuse (DataError, one line naming the key)."""
    import math

    from gpuguard.foundation.yamlfile import load_yaml

    p = Path(path) if path else DATA
    # the one YAML reader: a regular file under a size cap, no repeated key, finite numbers, bounded aliases
    doc = load_yaml(p, max_bytes=VOTE_YAML_MAX_BYTES, what="vote thresholds") or {}
    if not isinstance(doc, dict):
        raise DataError(f"{p}: expected a mapping of thresholds")
    doc = dict(doc.get("vote", doc))
    doc.update(overrides or {})
    known = {f.name: f for f in fields(VoteConfig)}
    kw: dict[str, Any] = {}
    for k, v in doc.items():
        if k not in known:
            raise DataError(f"{p}: unknown vote threshold {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise DataError(f"{p}: {k} must be a finite non-negative number, got {v!r}")
        if known[k].type in ("int", int):
            if v != int(v):
                raise DataError(f"{p}: {k} must be a whole number, got {v!r}")
            v = int(v)
        if k in _AT_LEAST_ONE and v < 1:
            raise DataError(f"{p}: {k} must be at least 1, got {v!r}")
        if k in _POSITIVE and v <= 0:
            raise DataError(f"{p}: {k} must be more than 0, got {v!r}")
        if k in _FRACTIONS and v > 1:
            raise DataError(f"{p}: {k} is a fraction (0 to 1), got {v!r}")
        kw[k] = v if isinstance(v, int) and known[k].type in ("int", int) else float(v)
    cfg = VoteConfig(**kw)
    if cfg.arrival_min_collectives > cfg.arrival_window:
        raise DataError(
            f"{p}: arrival_min_collectives ({cfg.arrival_min_collectives}) must not exceed arrival_window "
            f"({cfg.arrival_window}): the straggler could never be named"
        )
    if cfg.hang_floor_s > cfg.hang_cap_s:
        raise DataError(f"{p}: hang_floor_s ({cfg.hang_floor_s:g}) is above hang_cap_s ({cfg.hang_cap_s:g})")
    return cfg
