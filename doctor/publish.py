"""Publishing a node document: the Prometheus textfile, the webhook and the output plugins, within a budget.

Why here: the sweep and the watcher publish the same way after every judgement, and a crashing or
slow output must never stop the other outputs nor hold the state directory's lock past the budget.
Every output runs through `plugins.registry.run_safely`, so each one's outcome is a `PluginResult`
(ok, failed, or skipped when the budget is spent), never an exception.

It imports nothing heavy itself: `plugins.outputs` imports prometheus_client and requests only when
that output runs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuguard.foundation.errors import UnavailableError
from gpuguard.plugins import outputs as builtin
from gpuguard.plugins.registry import PluginResult, load, run_safely

GROUP = "gpuguard.outputs"


@dataclass(frozen=True)
class PublishOptions:
    """Where a node document goes: the textfile, the webhook (unhealthy or just recovered), plugins."""

    textfile: str | None = None
    webhook: str | None = None
    webhook_timeout: float = 5.0
    webhook_retries: int = 2
    budget: float = 30.0  # seconds all outputs together may take
    outputs: tuple[str, ...] = ()  # extra gpuguard.outputs plugins, in order, without repeats
    output_options: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


def write_textfile(path: str, doc: Mapping[str, Any]) -> str:
    """The Prometheus textfile, replaced atomically (`plugins.outputs.write_textfile`: never through a
    link, never into a missing directory, as root never into a directory another user controls)."""
    builtin.write_textfile(path, doc, what="--textfile")
    return path


def webhook_due(verdict: str, previous: str | None) -> bool:
    """The webhook fires while the node is unhealthy, and once when it has just recovered."""
    return verdict != "healthy" or previous not in (None, "healthy")


def publish(doc: Mapping[str, Any], previous: str | None, options: PublishOptions) -> list[PluginResult]:
    """The textfile, the webhook (when due), then the plugins, in that order, within `options.budget`."""
    deadline = time.monotonic() + options.budget
    results: list[PluginResult] = []
    textfile, webhook = options.textfile, options.webhook
    if textfile:
        results.append(run_safely(GROUP, "prometheus", lambda: write_textfile(textfile, doc)))
    verdict = str(doc.get("verdict"))
    if webhook and webhook_due(verdict, previous):
        left = max(0.1, deadline - time.monotonic())
        payload = builtin.webhook_payload(doc)
        results.append(
            run_safely(
                GROUP,
                "webhook",
                lambda: builtin.post_webhook(
                    webhook, payload, timeout=options.webhook_timeout, retries=options.webhook_retries, budget=left
                ),
            )
        )
    if options.outputs:
        plugins, failures = load(GROUP, list(options.outputs))
        for f in failures:
            results.append(PluginResult(f.group, f.name, "failed", f.error or "failed to load", 0.0))
        for name, cls in plugins.items():
            if time.monotonic() > deadline:
                results.append(run_safely(GROUP, name, _budget_spent))
                continue
            opts = dict(options.output_options.get(name, {}))
            results.append(run_safely(GROUP, name, functools.partial(_emit, cls, opts, doc)))
    return results


def _budget_spent() -> str:
    raise UnavailableError("output budget spent before this plugin ran")


def _emit(cls: Any, opts: dict[str, Any], doc: Mapping[str, Any]) -> Any:
    return cls(opts).emit(doc)
