"""Managed-collision state loads only onto the row-wise layout it was saved with.

TorchRec shards a managed-collision table row-wise only, and its state with it: each rank's
managed-collision module holds the raw ids of its bucket of the id range (sorted), the global
row of each, the eviction metadata (``state_dict`` ShardedTensors, one shard per rank), and keeps
its last row for every id of its bucket it has not admitted. On another layout that state does
not carry over: loaded on one rank, a 2-rank checkpoint keeps every admitted id's row, but the
ids that rank 0's shard had not admitted move from its row to rank 1's, and rank 0's row is
never used again; loaded on more ranks, each shard would hold ids of another bucket (TorchRec
stops at its state check, after the tensors were read into the model). So
:func:`check_managed_collision_layout` refuses such a load before anything is read.

The saved layout needs no record of its own: DCP's metadata lists each saved shard of a
managed-collision buffer as one chunk (in every checkpoint of such a model, older ones too).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_torchrec.checkpoint.common import MODEL_KEY
from lightning_torchrec.compat.upstream import ShardedTensor, managed_collision_table
from lightning_torchrec.errors import ManagedCollisionLayoutError

#: Row ranges ``[start, end)`` of a tensor's pieces, sorted.
Rows = tuple[tuple[int, int], ...]


def row_ranges(value: Any) -> Rows | None:
    """The row ranges of a tensor's pieces over every rank (dimension 0), sorted.

    Args:
        value: a ``ShardedTensor`` (its global metadata: every rank's shards) or a plain tensor
            (one piece).

    Returns:
        The non-empty ranges; None for anything else (a DTensor, a scalar, not a tensor).
    """
    if isinstance(value, ShardedTensor):
        shards = value.metadata().shards_metadata
        return tuple(
            sorted(
                (s.shard_offsets[0], s.shard_offsets[0] + s.shard_sizes[0])
                for s in shards
                if s.shard_sizes[0] > 0
            )
        )
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
        return ((0, value.shape[0]),) if value.shape[0] > 0 else ()
    return None


def saved_row_ranges(entry: TensorStorageMetadata) -> Rows:
    """The row ranges of a saved tensor's chunks (one per saved shard), sorted.

    Args:
        entry: the tensor's entry in DCP's metadata.

    Returns:
        The non-empty ranges.
    """
    return tuple(
        sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in entry.chunks if c.sizes[0] > 0)
    )


def _show(rows: Rows) -> str:
    return " ".join(f"[{a}, {b})" for a, b in rows)


def _ranks(rows: Rows) -> str:
    return f"{len(rows)} rank{'s' if len(rows) != 1 else ''}"


def check_managed_collision_layout(
    path: str | Path, state: Mapping[str, Any], metadata: Metadata
) -> None:
    """Refuses a checkpoint whose managed-collision state was sharded over other rows per rank.

    Local (every rank reaches the same verdict: both layouts are global); the caller agrees it.

    Args:
        path: the checkpoint, for the message.
        state: the load target, flat (DCP's dotted keys, e.g. ``"state_dict.model.mc..."``).
        metadata: the checkpoint's DCP metadata.

    Raises:
        ManagedCollisionLayoutError: naming each such table, its module, the saved and current
            row-wise shards and how many ranks each has.
    """
    stored = metadata.state_dict_metadata
    found: dict[str, tuple[str, Rows, Rows]] = {}
    for key, value in state.items():
        table = managed_collision_table(key)
        entry = stored.get(key)
        if table is None or table in found or not isinstance(entry, TensorStorageMetadata):
            continue
        current = row_ranges(value)
        saved = saved_row_ranges(entry)
        if current is None or current == saved or len(entry.size) == 0:
            continue
        if sum(b - a for a, b in current) != entry.size[0]:
            continue  # another size: the shape check names it
        found[table] = (key.rsplit(".", 1)[0].removeprefix(f"{MODEL_KEY}."), saved, current)
    if not found:
        return
    lines = [
        f"Refusing to load {path}: its managed-collision tables were sharded row-wise over other "
        "rows per rank than this model's, and their state does not carry over:"
    ]
    for table, (module, saved, current) in sorted(found.items()):
        lines.append(
            f"- table {table!r} (module {module}): saved by {_ranks(saved)} as rows "
            f"{_show(saved)}, now {_ranks(current)} with rows {_show(current)}"
        )
    first = next(iter(found.values()))
    lines.append(
        "Each rank's managed-collision module holds the raw ids of its bucket of the id range "
        "and one row for the ids of that bucket it has not admitted: on another layout, ids "
        "would look up another shard's row or land in a shard that does not hold them. Nothing "
        f"was loaded. Load it on {_ranks(first[1])} (the saved layout)."
    )
    raise ManagedCollisionLayoutError("\n".join(lines))
