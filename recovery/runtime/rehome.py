"""The layout-preserving in-place shrink of HSDP: the survivors keep their model and move it to the new world's mesh.

When whole HSDP replicas are lost, every surviving replica still holds all the shards, each survivor
the same shard as before: nothing needs to move. The FSDP2 model and its optimizer stay as they are
(the same parameters, the same optimizer state, no `build()`). The iteration the failure broke is
reset first (FSDP2's `reset_iter_state`: every group resharded, in-flight work and gradients
discarded); then only what refers to the failed world's device mesh changes: each `FSDPParamGroup`'s and `FSDPParam`'s mesh info (whose process
groups are those of the mesh), the sharding spec of each sharded parameter and the spec of every
optimizer state DTensor. `new_mesh` makes the (replicas, shard) mesh over the new world, with the
failed mesh's device type and dimension names; `rehome` points the model and optimizer at it.

Supported: FSDP2 / HSDP by `fully_shard` on one mesh, `model` being the root FSDP module, each parameter group resharding after forward
to its own mesh (the default) or not at all; anything else (TP/EP meshes, another post-forward mesh)
raises ValueError and the runtime rebuilds the model instead (same shards: 0 elements move either way).

Lazy imports (start-up time): torch, only in the functions that run inside a training process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any


def _groups(model: Any) -> Iterator[Any]:
    """Every FSDP2 parameter group of the model (`fully_shard`'s state on each module)."""
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is not None:
            yield from get_state()._fsdp_param_groups


def replica_mesh(model: Any) -> Any:
    """The one (replicate, shard) device mesh the model's FSDP2 groups use, each resharding after
    forward to it or not at all (what `rehome` can move); ValueError otherwise."""
    groups = list(_groups(model))
    meshes = {id(g.mesh_info.mesh): g.mesh_info for g in groups}
    if len(meshes) != 1:
        raise ValueError(f"the model's FSDP2 groups use {len(meshes)} device meshes, not one")
    for g in groups:
        if g.post_forward_mesh_info is not None and g.post_forward_mesh_info is not g.mesh_info:
            raise ValueError(f"{g._module_fqn or 'the root'}: reshards after forward to another mesh")
    if not hasattr(model, "reset_iter_state"):  # torch >= 2.13: the recovery of a failed iteration
        raise ValueError("this FSDP2 cannot reset a failed iteration (no reset_iter_state on the root module)")
    info = next(iter(meshes.values()))
    if info.spmd_mesh is not None or info.mesh.ndim != 2 or info.replicate_mesh_dim != 0 or info.shard_mesh_dim != 1:
        raise ValueError("the model is not HSDP on a (replicate, shard) mesh")
    return info.mesh


def replica_size(model: Any) -> int | None:
    """Ranks per HSDP replica (the shard dimension), or None when the model is not HSDP on one mesh."""
    try:
        return int(replica_mesh(model).size(1))
    except ValueError:
        return None


def new_mesh(old: Any, world: int) -> Any:
    """The (world / shard, shard) mesh over the new world, named and typed as `old`."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - lazy: torch only where used

    shard = int(old.size(1))
    if world % shard:
        raise ValueError(f"a world of {world} is not whole replicas of {shard}")
    return init_device_mesh(old.device_type, (world // shard, shard), mesh_dim_names=old.mesh_dim_names)


def rehome(model: Any, optimizer: Any, mesh: Any) -> int:
    """Point the model's FSDP2 groups, its sharded parameters and the optimizer's DTensor state at
    `mesh` (same shape per replica: every local shard stays as it is). Returns the tensors re-pointed."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - lazy: torch only where used
    from torch.distributed.tensor._dtensor_spec import DTensorSpec  # noqa: PLC0415 - lazy: torch only where used

    old = replica_mesh(model)  # checks everything before anything changes
    groups = list(_groups(model))
    # the failed iteration: FSDP2 may have stopped mid-forward or mid-backward (unsharded parameters
    # registered, partial gradients). An all-gather of the failed group never completes: drop it, then
    # FSDP2's own recovery reshards every group and clears its trackers; its gradients are discarded.
    for g in groups:
        g._all_gather_result = None
    model.reset_iter_state()
    for param in model.parameters():
        param.grad = None

    def moved(spec: Any) -> Any:
        return DTensorSpec(mesh, spec.placements, tensor_meta=spec.tensor_meta)

    count = 0
    for g in groups:
        info = dataclasses.replace(g.mesh_info, mesh=mesh)  # its process groups: the new mesh's
        post = None if g.post_forward_mesh_info is None else info
        g.mesh_info, g.post_forward_mesh_info = info, post
        for p in g.fsdp_params:
            p.mesh_info, p.post_forward_mesh_info, p._spmd_mesh = info, post, mesh
            p._sharding_spec = moved(p._sharding_spec)
            p.sharded_param._spec = p._sharding_spec
            grad = p.sharded_param.grad  # kept by a `zero_grad(set_to_none=False)`
            if isinstance(grad, DTensor):
                grad._spec = moved(grad._spec)
            count += 1
    for per_param in optimizer.state.values() if optimizer is not None else ():
        for value in per_param.values():
            if isinstance(value, DTensor) and (value._spec.mesh is old or value._spec.mesh == old):
                value._spec = moved(value._spec)
                count += 1
    return count
