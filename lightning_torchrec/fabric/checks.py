"""The optimizers of a Fabric loop, built before sharding and combined with the fused one after."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_torchrec.sharding.tables import unwrap
from lightning_torchrec.training.optim import (
    DenseAndFusedOptimizer,
    combine_optimizers,
    combine_with_schedulers,
    dense_named_parameters,
)


def adopt_sharded_parameters(optimizer: Optimizer, module: nn.Module) -> None:
    """Points an optimizer built on the unsharded model at the sharded model's parameters.

    ``fabric.setup(model, optimizer)`` gets an optimizer over ``dense_parameters(model)`` of the
    unsharded model: it holds the unsharded tables, which sharding replaces. They are removed;
    when any was, the dense parameters that sharding created (data-parallel tables) join the
    first param group. Dense layers are the same objects before and after sharding.

    Args:
        optimizer: a fresh optimizer (no state yet).
        module: the sharded module.
    """
    live = {id(p) for p in module.parameters()}
    held: set[int] = set()
    removed = False
    for group in optimizer.param_groups:
        kept = [p for p in group["params"] if id(p) in live]
        removed = removed or len(kept) < len(group["params"])
        group["params"] = kept
        held.update(id(p) for p in kept)
    if removed:
        new = [p for _, p in dense_named_parameters(module) if id(p) not in held]
        optimizer.param_groups[0]["params"].extend(new)


def combine_fabric_optimizer(
    optimizer: Optimizer, module: nn.Module, drives_tables: bool, scheduler: Any = None
) -> DenseAndFusedOptimizer:
    """An optimizer of a Fabric loop keyed by parameter name, with the fused optimizer or not.

    One optimizer drives the fused tables. Combined with each optimizer, the fused param groups
    would sit in all of them: a scheduler of each would scale the embedding learning rate once
    per optimizer and step, and a checkpoint would hold the fused state once per optimizer. As
    the Trainer does with the optimizers of ``configure_optimizers``, the first one set up
    drives them and the others are keyed dense-only.

    Args:
        optimizer: an optimizer over dense parameters of the sharded ``module`` (or one
            combined already, returned as it is).
        module: the sharded module.
        drives_tables: whether it is the first optimizer set up for ``module``.
        scheduler: an LR scheduler built on ``optimizer`` (a warning says that it cannot
            drive the fused learning rate), or None.

    Returns:
        The ``DenseAndFusedOptimizer`` (without fused part unless ``drives_tables``).

    Raises:
        ValueError: if the optimizer holds fused embedding-table parameters.
    """
    if drives_tables:
        combined = combine_with_schedulers(optimizer, module, [scheduler] if scheduler else [])
    else:
        combined = combine_optimizers(optimizer, module, with_fused=False)
    assert isinstance(combined, DenseAndFusedOptimizer)
    return combined


def adopted_optimizers(
    optimizers: list[Optimizer], module: nn.Module, first: bool, scheduler: Any = None
) -> list[DenseAndFusedOptimizer]:
    """``fabric.setup(model, *optimizers)``'s optimizers, moved onto the sharded model.

    Args:
        optimizers: fresh optimizers over ``dense_parameters`` of the unsharded model
            (:func:`adopt_sharded_parameters`).
        module: the sharded module (the ``DistributedModelParallel``).
        first: whether no optimizer was set up for ``module`` before (the first of
            ``optimizers`` then drives the fused tables, see :func:`combine_fabric_optimizer`).
        scheduler: the LR scheduler ``fabric.setup`` got, or None.

    Returns:
        The combined optimizers, in the same order.
    """
    for optimizer in optimizers:  # built on the unsharded model: its tables are gone now
        adopt_sharded_parameters(optimizer, module)
    return [
        combine_fabric_optimizer(o, unwrap(module), first and i == 0, scheduler)
        for i, o in enumerate(optimizers)
    ]
