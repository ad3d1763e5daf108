"""How the runtime refuses: two exceptions, and the one way a process leaves when it must not go on.

A refusal is not a crash: the certificate did not admit this incarnation, a commit was fenced by a
newer generation, the in-place switch could not happen. The process prints one line naming its
rank and incarnation and exits with status 4 (`EXIT_REFUSED`), with no traceback, so the operator
reads why and torchrun (or the restart path) takes over.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from gpuguard.foundation.errors import EXIT_REFUSED, RefusedError


class FencedError(RefusedError):
    """This incarnation's generation is no longer the active one: its writes are dropped."""


class ActivationRefused(RefusedError):
    """A member could not verify the certificate (or activation failed): it must not start."""


def leave(rank: int, incarnation_id: str, verb: str, why: object, code: int = EXIT_REFUSED) -> NoReturn:
    """Print `gpuguard: rank R (incarnation I) VERB: WHY` and exit 4 at once (no cleanup runs: a
    refused or fenced process must not write anything more, and its group sockets die with it).
    `code` 0: a survivor the next generation does not need (HSDP's layout kept without its replica)
    ends well, so its torchrun agent restarts nothing."""
    print(f"gpuguard: rank {rank} (incarnation {incarnation_id[:12]}) {verb}: {why}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(code)
