"""gpuguard: diagnose, certify and recover distributed GPU training jobs launched with torchrun.

Kept import-light on purpose: `gpu-doctor` runs from cron on every node and must never pay for
`import torch`. Heavy modules are imported lazily where they are used.
"""

__version__ = "0.1.0"
