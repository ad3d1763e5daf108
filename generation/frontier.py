"""The frontier rule: how far the next generation may resume, from the ledger alone.

One rule, shared by the runtime's coordinators (restart and in place) and `gpu-recover restore`:
never past the last step *all* members of the parent generation committed, and never below the
parent's own certified frontier, which stays reachable whatever happened after it.
"""

from __future__ import annotations

from gpuguard.generation.records import Certificate


def frontier_limit(parent: Certificate | None, committed_by_all: int | None) -> int:
    """The newest step the next generation may start from (0 before any certificate)."""
    if parent is None:
        return 0
    return max(parent.frontier.step, committed_by_all if committed_by_all is not None else -1)
