"""``LightningModule.toggle_optimizer`` made to work with fused tables (lightning 2.x).

Lightning's ``toggle_optimizer`` sets ``requires_grad=False`` on every parameter of the
Trainer's optimizers, then restores the toggled optimizer's, and records the states it found in
the module's ``_param_requires_grad_state``, which ``untoggle_optimizer`` reads back. A fused
embedding group's parameters are ``ShardedTensor`` views of kernel weights, which refuse the
assignment; :func:`toggle_leaving` is the same toggle without them (``untoggle_optimizer``
then leaves them alone too: they are not in the record). :func:`guard_toggles` puts it on a
module for a manual-optimization fit.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_torchrec.compat.fused import kernel_tables

__all__ = ["guard_toggles", "toggle_leaving"]


def toggle_leaving(module: Any, optimizer: Any, kept: set[int]) -> None:
    """Lightning's ``toggle_optimizer(optimizer)``, with the parameters in ``kept`` untouched.

    Args:
        module: the LightningModule (attached to a Trainer).
        optimizer: the optimizer to toggle (a ``LightningOptimizer`` or the one it wraps).
        kept: ``id()`` of the parameters whose ``requires_grad`` is neither read nor set.
    """
    state: dict[Any, bool] = {}
    for opt in module.trainer.optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                if id(param) in kept or param in state:
                    continue
                state[param] = param.requires_grad
                param.requires_grad = False
    for group in getattr(optimizer, "optimizer", optimizer).param_groups:
        for param in group["params"]:
            if param in state:
                param.requires_grad = state[param]
    module._param_requires_grad_state = state


def guard_toggles(module: Any) -> Any:
    """Makes ``module.toggle_optimizer`` work with fused tables; returns what undoes it.

    Lightning's ``toggle_optimizer`` freezes every other optimizer's parameters: the fused
    tables' (combined into the first optimizer) refuse it with an unnamed torch error, and
    could not be frozen anyway, since their kernels update them in the backward of any loss
    that reaches them. Toggling the optimizer that holds them is Lightning's toggle with the
    tables left trainable; toggling another is refused, naming them. A module with its own
    ``toggle_optimizer`` keeps it.

    Args:
        module: the LightningModule about to train (manual optimization).

    Returns:
        A function that gives the module Lightning's ``toggle_optimizer`` back.
    """
    if type(module).toggle_optimizer is not L.LightningModule.toggle_optimizer:
        return lambda: None

    def toggle(optimizer: Any) -> None:
        holder = next(
            (o for o in module.trainer.optimizers if getattr(o, "fused", None) is not None), None
        )
        if holder is None:
            return L.LightningModule.toggle_optimizer(module, optimizer)
        inner = getattr(optimizer, "optimizer", optimizer)
        if inner is not holder:
            tables = [t for _, kernel in holder.fused_groups() for t in kernel_tables(kernel)]
            optimizers = list(module.trainer.optimizers)
            where = optimizers.index(inner) if inner in optimizers else "?"
            name = type(getattr(inner, "dense_optimizer", inner)).__name__
            raise ValueError(
                f"toggle_optimizer of optimizer {where} ({name}) cannot freeze the fused "
                f"embedding tables {sorted(set(tables))} of optimizer 0: their kernels update "
                "them inside the backward of any loss that reaches them. Detach the embeddings "
                "from this optimizer's loss instead, or toggle only optimizer 0."
            )
        fused = {id(p) for group in holder.fused.param_groups for p in group["params"]}
        toggle_leaving(module, optimizer, fused)

    vars(module)["toggle_optimizer"] = toggle
    return lambda: vars(module).pop("toggle_optimizer", None)
