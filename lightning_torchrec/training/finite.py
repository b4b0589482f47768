"""What is finite in a (sharded) state dict: the NaN/inf values checkpoints refuse.

:func:`nonfinite_tensors` finds them, local shards only (``lightning_torchrec.checkpoint``); a
step's loss is judged by the step's vote (:mod:`~lightning_torchrec.training.step_guard`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_torchrec.compat.upstream import ShardedTensor
from lightning_torchrec.sharding.layout import shard_info


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
