"""Optional dependencies: torch is needed by the in-job runtime, the demos and the real benchmarks.

`pip install gpuguard` gives the doctor, the ledger and the operator actions without torch (a cron
sweep on 10,000 nodes must not pull a multi-GB wheel). A feature that needs torch asks for it here,
and a machine without it gets one line and exit 69 instead of a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from gpuguard.foundation.errors import MissingDependencyError

RUNTIME_EXTRA = "pip install 'gpuguard[runtime]'"


def check_torch(feature: str) -> None:
    """Raise MissingDependencyError (exit 69) naming `feature` when torch is not installed.

    Looks torch up without importing it: a command whose torch work happens in child processes (the
    demo's workers) must not pay ~1 s for `import torch` in the parent just to ask.
    """
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise MissingDependencyError(f"{feature} needs torch, which is not installed: {RUNTIME_EXTRA}")


def require_torch(feature: str) -> ModuleType:
    """The `torch` module, or MissingDependencyError naming `feature` and the extra to install."""
    check_torch(feature)
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise MissingDependencyError(f"{feature} needs torch, which cannot be imported: {RUNTIME_EXTRA}") from None
