"""Optional dependencies: torch is needed by the in-job runtime, the demos and the real benchmarks.

`pip install gpuguard` gives the doctor, the ledger and the operator actions without torch (a cron
sweep on 10,000 nodes must not pull a multi-GB wheel). A feature that needs torch asks for it here,
and a machine without it gets one line and exit 69 instead of a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gpuguard.foundation.errors import MissingDependencyError

RUNTIME_EXTRA = "pip install 'gpuguard[runtime]'"


def require_torch(feature: str) -> ModuleType:
    """The `torch` module, or MissingDependencyError naming `feature` and the extra to install."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise MissingDependencyError(f"{feature} needs torch, which is not installed: {RUNTIME_EXTRA}") from None
