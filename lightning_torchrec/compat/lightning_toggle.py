"""``LightningModule.toggle_optimizer`` that leaves some parameters alone (lightning 2.x).

Lightning's ``toggle_optimizer`` sets ``requires_grad=False`` on every parameter of the
Trainer's optimizers, then restores the toggled optimizer's, and records the states it found in
the module's ``_param_requires_grad_state``, which ``untoggle_optimizer`` reads back. A fused
embedding group's parameters are ``ShardedTensor`` views of kernel weights, which refuse the
assignment; :func:`toggle_leaving` is the same toggle without them (``untoggle_optimizer``
then leaves them alone too: they are not in the record).
"""

from __future__ import annotations

from typing import Any

__all__ = ["toggle_leaving"]


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
