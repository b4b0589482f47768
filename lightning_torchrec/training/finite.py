"""What is finite: a step's loss of any shape, and the tensors of a (sharded) state dict.

:func:`loss_to_judge` picks, on the loss's device, the one number that tells whether a loss is
finite (copied to the host without waiting, read a step later); :func:`nonfinite_loss_error`
judges it; :func:`nonfinite_tensors` finds NaN/inf values in a (sharded) state dict, which
checkpoints refuse (``lightning_torchrec.checkpoint``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lightning_torchrec.compat.upstream import ShardedTensor
from lightning_torchrec.distributed import rank_and_world_size
from lightning_torchrec.errors import NonFiniteLossError
from lightning_torchrec.sharding.layout import shard_info


def loss_to_judge(loss: torch.Tensor) -> torch.Tensor:
    """The one number that judges a loss of any shape, picked on its device (no host read).

    The first non-finite element, else the first element (0 for an empty loss): the loss is
    finite exactly when that number is.

    Args:
        loss: the step's loss (a scalar, or any shape under manual optimization).

    Returns:
        A float32 tensor of one element on the loss's device.
    """
    flat = loss.reshape(-1).float()
    if not flat.numel():
        return flat.new_zeros(1)
    first_bad = torch.argmin(torch.isfinite(flat).to(torch.int8)).reshape(1)
    return flat.index_select(0, first_bad)


def nonfinite_loss_error(pending: tuple[int, torch.Tensor] | None) -> NonFiniteLossError | None:
    """The error for a recorded loss that is not finite.

    Args:
        pending: ``(global step, loss)`` as recorded (on the host), or None.

    Returns:
        The error naming the step, this rank and the value; None for a finite loss or none.
    """
    if pending is None:  # below: one read of a scalar loss (the usual case), else a reduction
        return None
    step, value = pending
    if math.isfinite(value.item()) if value.numel() == 1 else bool(value.isfinite().all()):
        return None
    rank, _ = rank_and_world_size()
    flat = value.reshape(-1)
    return NonFiniteLossError(
        f"non-finite training loss at global step {step} on rank(s) [{rank}] (this rank: "
        f"{float(flat[~flat.isfinite()][0])}). That step's update was applied, so the in-memory "
        "weights may be non-finite; checkpoints refuse non-finite values and the last one is "
        "intact. Check the batch (NaN features, extreme labels/weights) and lower the "
        "learning rate."
    )


def nonfinite_tensors(state: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Names of the tensors in a (sharded) state dict holding a NaN or inf, local shards only.

    Args:
        state: a state dict (nested mappings allowed); ShardedTensor and DTensor values are
            checked by their local shards.
        prefix: prepended to the names.

    Returns:
        The dotted names of the offending tensors.
    """
    bad: list[str] = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            bad += nonfinite_tensors(value, f"{name}.")
        elif isinstance(value, torch.Tensor | ShardedTensor):
            for shard in shard_info(value).shards:
                t = shard.tensor
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad.append(name)
                    break
    return bad
