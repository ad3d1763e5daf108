"""Entry-point plugin registry: collectors, outputs (notifiers) and recovery actions.

The built-in outputs are found through the same entry points as a third-party package's, so the
path that loads them is the path every plugin takes. A plugin that fails to import, to construct or
to run is reported and skipped: a broken notifier must never take a cron sweep down.

Lazy imports (start-up time): importlib.metadata, only when plugins are listed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GROUPS = ("gpuguard.collectors", "gpuguard.outputs", "gpuguard.actions")


@dataclass(frozen=True)
class PluginInfo:
    group: str
    name: str
    target: str  # "module:attr"
    distribution: str | None
    version: str | None
    status: str  # ok | failed | not-loaded
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "name": self.name,
            "target": self.target,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
        }


@dataclass(frozen=True)
class PluginResult:
    """What running one plugin produced (or why it did not)."""

    group: str
    name: str
    status: str  # ok | failed
    message: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "name": self.name,
            "status": self.status,
            "message": self.message,
            "seconds": round(self.seconds, 4),
        }


def _entry_points(group: str) -> list[Any]:
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group=group)}  # later distributions do not duplicate names
    return sorted(eps.values(), key=lambda ep: ep.name)


def _describe(group: str, ep: Any, status: str, error: str | None = None) -> PluginInfo:
    dist = getattr(ep, "dist", None)
    return PluginInfo(
        group, ep.name, ep.value, getattr(dist, "name", None), getattr(dist, "version", None), status, error
    )


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def discover(groups: tuple[str, ...] = GROUPS, *, load: bool = True) -> list[PluginInfo]:
    """Every installed plugin; with `load`, each is imported to say whether it works."""
    found: list[PluginInfo] = []
    for group in groups:
        for ep in _entry_points(group):
            if not load:
                found.append(_describe(group, ep, "not-loaded"))
                continue
            try:
                ep.load()
            except Exception as exc:  # noqa: BLE001 - any failure of third-party code is a report
                found.append(_describe(group, ep, "failed", _error(exc)))
            else:
                found.append(_describe(group, ep, "ok"))
    return found


def load(group: str, names: list[str] | None = None) -> tuple[dict[str, Any], list[PluginInfo]]:
    """Load the plugins of `group` (only `names` when given): ({name: object}, failures).

    A name that is not installed is a failure too (reported, not raised).
    """
    loaded: dict[str, Any] = {}
    failures: list[PluginInfo] = []
    eps = {ep.name: ep for ep in _entry_points(group)}
    for name in names if names is not None else list(eps):
        ep = eps.get(name)
        if ep is None:
            failures.append(
                PluginInfo(
                    group, name, "", None, None, "failed", f"no such plugin (installed: {', '.join(eps) or 'none'})"
                )
            )
            continue
        try:
            loaded[name] = ep.load()
        except Exception as exc:  # noqa: BLE001
            failures.append(_describe(group, ep, "failed", _error(exc)))
    return loaded, failures


def run_safely(group: str, name: str, fn: Callable[[], Any]) -> PluginResult:
    """Call one plugin; its exception becomes a failed result, never the caller's crash."""
    start = time.monotonic()
    try:
        message = fn()
    except Exception as exc:  # noqa: BLE001 - isolation is the point
        return PluginResult(group, name, "failed", _error(exc), time.monotonic() - start)
    return PluginResult(group, name, "ok", str(message or "ok")[:300], time.monotonic() - start)
