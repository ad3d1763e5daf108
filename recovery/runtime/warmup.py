"""Imports a training process pays anyway, paid before this process holds a lease.

Why: the lease's keepalive and self-fence are threads of the training process (`host_lease`), so
they need the GIL. torch imports `torch._dynamo` lazily, on the first optimizer a script builds
(`Optimizer.__init__` is wrapped by `torch._disable_dynamo`): seconds of module code on the main
thread. On a crowded host (a CPU hog of 2 x cores beside the job: `bench/hosts.py --load`) that
import starved both threads past the fence margin, and healthy workers fenced themselves before
their first step. Imported before the lease starts, it costs the script nothing it would not pay
a moment later, and the lease's threads never compete with it.
"""

from __future__ import annotations

import importlib

# what a training script imports, through torch, after it made its runtime (seconds under load)
HEAVY_IMPORTS = ("torch._dynamo",)


def import_heavy_modules() -> tuple[str, ...]:
    """Import `HEAVY_IMPORTS`; the names that failed (a torch build without them) are skipped and returned."""
    failed = []
    for name in HEAVY_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional speed-up: torch without it still trains
            failed.append(name)
    return tuple(failed)
