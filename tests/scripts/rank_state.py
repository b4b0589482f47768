"""What one rank holds, copied for comparison across runs (shared by the multi-process scripts)."""

from __future__ import annotations

from typing import Any

import torch


def local_view(value: Any) -> Any:
    """Rank-local copy of a state value: ShardedTensor -> list of (offsets, shard)."""
    if hasattr(value, "local_shards"):
        return [
            (tuple(s.metadata.shard_offsets), s.tensor.detach().clone())
            for s in value.local_shards()
        ]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: local_view(v) for k, v in value.items()}
    return value


def kernel_lrs(opt: Any) -> list[float]:
    """The learning rate each fused kernel (TBE) under ``opt`` will use in its next backward."""
    from torchrec.optim.keyed import CombinedOptimizer

    if isinstance(opt, CombinedOptimizer):
        return [lr for _, o in opt.optimizers for lr in kernel_lrs(o)]
    return [opt._emb_module.get_learning_rate()]
