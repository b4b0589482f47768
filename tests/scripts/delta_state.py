"""The state a delta chain must restore, gathered whole on every rank (tests and scripts)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_torchrec.checkpoint.delta import inference_part, model_tables
from lightning_torchrec.distributed import all_gather
from lightning_torchrec.sharding.layout import global_shape, shard_info
from lightning_torchrec.training.optim import keyed_optimizer


def _pieces(tensor: torch.Tensor) -> tuple[tuple[int, ...], list[Any]]:
    info = shard_info(tensor)
    shards = info.shards
    if info.replicated:  # every rank holds it: rank 0's copy is the one kept
        shards = shards if torch.distributed.get_rank() == 0 else []
    shape = tuple(int(s) for s in global_shape(tensor))
    return shape, [(s.row_offset, s.col_offset, s.tensor.clone()) for s in shards]


def chain_state(module: Any, optimizer: Any = None) -> dict[str, torch.Tensor]:
    """Tables (``table/rows``), their fused optimizer rows (``table/state/name``) and the
    inference model's dense state (by its names), each whole, on every rank (collective)."""
    tables = model_tables(module)
    local = {f"{name}/rows": _pieces(t.tensor) for name, t in tables.items()}
    for name, tensor in inference_part(module).state_dict().items():
        if not any(name.endswith(f".{t}.weight") for t in tables):
            local[f"dense/{name}"] = _pieces(tensor)
    if optimizer is not None:
        for key, states in keyed_optimizer(optimizer).state_dict()["state"].items():
            table = next((t for t in tables.values() if key.endswith(t.key)), None)
            for state, value in states.items():
                if table is not None and hasattr(value, "local_shards"):
                    local[f"{table.name}/state/{state}"] = _pieces(value)
    out: dict[str, torch.Tensor] = {}
    for share in all_gather(local):
        for name, (shape, pieces) in share.items():
            full = out.setdefault(name, torch.zeros(shape, dtype=torch.float32))
            for row, col, piece in pieces:
                index = [slice(row, row + piece.shape[0])]
                if piece.dim() > 1:
                    index.append(slice(col, col + piece.shape[1]))
                full[tuple(index)] = piece.float()
    return out
