"""What the coordinator that activated a generation tidies, right after its activation.

Both coordinators (the restart activator, the in-place switch coordinator) call `after_activation`
once their compare-and-swap succeeded, so etcd's keys stay bounded by the job's size, not by its
length or its failed activations:
- the in-place coordination keys of generations before the parent (nobody reads them again);
- the member-table chunks no stored certificate names (`Ledger.prune_chunks`: left by an activation
  that lost its race or stopped between its chunks and its transaction). The activator is the one
  place where no other activation is under way, which the directory backend's prune needs
  (docs/formats/ledger.md, "Pruning chunks").

Best effort: a failure is logged and the next activation prunes what is left.
"""

from __future__ import annotations

from typing import Any

from gpuguard.foundation.errors import GpuguardError, one_line
from gpuguard.recovery.runtime.context import Context


def after_activation(ctx: Context, ledger: Any, parent_generation: int) -> None:
    """Prune the coordination keys before `parent_generation` and the unnamed chunks."""
    ctx.coord.prune(parent_generation)
    try:
        pruned = ledger.prune_chunks()
    except GpuguardError as exc:
        ctx.log(f"unnamed certificate chunks not pruned: {one_line(exc)}")
        return
    if pruned:
        ctx.log(f"pruned {len(pruned)} certificate chunk(s) no certificate names (a lost or stopped activation's)")
