"""Recovery: the in-job runtime, operator actions, runbooks.

`gpuguard.recovery.Runtime` is the training-side entry point; it is resolved lazily so
that torch-free users of this package (gpu-doctor, gpu-recover) never import the runtime.

`gpuguard.recovery.fault_tolerant` wraps an existing loop in the runtime with a few lines
(`recovery.runtime.adopt`).

Lazy imports (start-up time): the runtime, only when `gpuguard.recovery.Runtime` is used.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("Runtime", "TrainState", "FencedError", "ActivationRefused"):
        from gpuguard.recovery.runtime import runtime

        return getattr(runtime, name)
    if name in ("fault_tolerant", "FaultTolerant", "RunSummary"):
        from gpuguard.recovery.runtime import adopt

        return getattr(adopt, name)
    raise AttributeError(f"module 'gpuguard.recovery' has no attribute {name!r}")
