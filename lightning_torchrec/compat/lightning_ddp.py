"""Manual optimization's gradient sync for the dense DDP inside a DMP (lightning 2.x).

Under manual optimization ``training_step`` calls ``manual_backward`` inside the model's forward,
before DDP's forward has prepared its reducer for a backward: DDP would skip that backward's
gradient all-reduce and prepare for a backward that never comes. Lightning's ``DDPStrategy``
handles this for the DDP it wraps the module in: its forward redirection
(``_DDPForwardRedirection``) turns DDP's own preparation off after the inner forward, and its
``pre_backward`` prepares the reducer before each ``manual_backward``, and its
``post_backward`` launches the all-reduce of a static graph's first backward (DDP's own trigger
for it is added at the end of its forward, after this backward). All of it looks for a
``DistributedDataParallel`` at the strategy's ``model``, which here is the DMP; the DDP over the
dense modules is inside it (``data_parallel_wrapper``; TorchRec's default one has a static
graph). These helpers apply Lightning's handling to that DDP.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DistributedModelParallel, get_module


def dense_ddp(model: nn.Module | None) -> DistributedDataParallel | None:
    """The DDP wrapper of the dense modules inside a DMP (or ``model`` itself when a DDP).

    Args:
        model: the strategy's model (a DMP), or None.

    Returns:
        The DDP, or None (one rank without data-parallel wrapper, another wrapper).
    """
    inner = get_module(model) if isinstance(model, DistributedModelParallel) else model
    return inner if isinstance(inner, DistributedDataParallel) else None


class DMPForwardRedirection(_DDPForwardRedirection):
    """Lightning's DDP forward redirection, applied to the DDP inside the DMP."""

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: Any) -> None:
        """Turns the dense DDP's own backward preparation off (manual optimization).

        Args:
            wrapper_module: the DMP.
            original_module: the LightningModule.
        """
        if original_module.automatic_optimization:  # every training step: nothing to do
            return
        inner = dense_ddp(wrapper_module)
        if inner is not None:
            super().on_after_inner_forward(inner, original_module)

    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: Any) -> None:
        """Turns it back on after the forward (manual optimization).

        Args:
            wrapper_module: the DMP.
            original_module: the LightningModule.
        """
        if original_module.automatic_optimization:  # every training step: nothing to do
            return
        inner = dense_ddp(wrapper_module)
        if inner is not None:
            super().on_after_outer_forward(inner, original_module)


def prepare_manual_backward(model: nn.Module | None, loss: torch.Tensor) -> None:
    """Prepares the dense DDP's reducer for a ``manual_backward`` of ``loss``.

    Args:
        model: the strategy's model (a DMP).
        loss: the loss about to be backpropagated.
    """
    inner = dense_ddp(model)
    if inner is not None:
        prepare_for_backward(inner, loss)


def flush_first_static_backward(model: nn.Module | None, flushed: Any) -> Any:
    """All-reduces the first ``manual_backward``'s gradients of a static-graph dense DDP.

    A static-graph DDP records which gradients its first backward produces and reduces them all
    at its end, from a hook its forward adds to the forward's output; a ``manual_backward``
    runs before that. Lightning's ``DDPStrategy.post_backward`` launches the reduction itself.

    Args:
        model: the strategy's model (a DMP).
        flushed: the dense DDP this was done for already (once per DDP), or None.

    Returns:
        The dense DDP it has now been done for (or ``flushed`` when there was nothing to do).
    """
    inner = dense_ddp(model)
    if inner is None or inner is flushed or not getattr(inner, "static_graph", False):
        return flushed
    inner.reducer._delay_all_reduce()
    return inner
