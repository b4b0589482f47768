"""The one place that knows how tensors are laid out over ranks.

:func:`shard_info` describes what this rank holds of: a plain tensor (dense parameters,
data-parallel tables: *replicated*, every rank holds all of it); a ``ShardedTensor`` (TorchRec's
model-parallel tables: zero, one or several pieces per rank); a ``DTensor`` (regular, or TorchRec's
``output_dtensor`` one whose local tensor is a ``LocalShardsWrapper``); TorchRec's
``TableBatchedEmbeddingSlice`` (the local view ``named_parameters()`` gives of a fused table; it has
no global metadata, so it counts as a plain tensor: use the ShardedTensor of a sharded table).
On top of it: copying whole tensors into this rank's shards, and gathering a whole table.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_torchrec.compat.upstream import (
    ShardedTensor,
    local_shape_and_global_offset,
    sharded_tensor_group,
)
from lightning_torchrec.distributed import collective_device, rank_and_world_size

logger = logging.getLogger(__name__)


class LocalShard(NamedTuple):
    """One piece of a tensor held by this rank.

    Attributes:
        tensor: The local data, detached, a plain ``torch.Tensor``.
        row_offset: Offset of ``tensor`` along dimension 0 of the global tensor.
        col_offset: Offset along dimension 1 (0 for tensors with fewer than 2 dimensions).
    """

    tensor: torch.Tensor
    row_offset: int
    col_offset: int


class ShardInfo(NamedTuple):
    """How a tensor is laid out, seen from this rank.

    Attributes:
        shards: The non-empty pieces held by this rank (empty when it holds none).
        global_shape: Shape of the whole tensor.
        replicated: Every rank holds the whole tensor: reduce it locally, never across ranks.
        counted: Whether this rank's pieces of a sharded tensor enter cross-rank sums; False
            on replicas of other ranks' pieces (2D-parallel replica groups but the first).
    """

    shards: list[LocalShard]
    global_shape: torch.Size
    replicated: bool
    counted: bool


def _offsets(offsets: Sequence[int]) -> tuple[int, int]:
    padded = [int(o) for o in offsets[:2]] + [0, 0]
    return padded[0], padded[1]


def _sharded_tensor_info(tensor: ShardedTensor) -> ShardInfo:
    shards = [
        LocalShard(s.tensor.detach(), *_offsets(s.metadata.shard_offsets))
        for s in tensor.local_shards()
        if s.tensor.numel() > 0
    ]
    counted = True
    pg = sharded_tensor_group(tensor)
    if pg is not None and dist.get_world_size(pg) < dist.get_world_size():
        # A ShardedTensor over a sub-group: the other groups are assumed to hold replicas
        # (TorchRec 2D parallel); only the group containing global rank 0 is counted.
        counted = 0 in dist.get_process_group_ranks(pg)
    return ShardInfo(shards, global_shape(tensor), replicated=False, counted=counted)


def _dtensor_info(tensor: DTensor) -> ShardInfo:
    mesh, placements = tensor.device_mesh, tensor.placements
    if any(p.is_partial() for p in placements):
        raise ValueError("A DTensor with Partial placements has no well-defined local shards.")
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not part of the mesh
        return ShardInfo([], tensor.shape, replicated=False, counted=False)
    with torch.no_grad():  # no-grad to_local() is the local tensor itself, not a view
        local = tensor.to_local()
    if hasattr(local, "local_shards") and hasattr(local, "local_offsets"):
        # A LocalShardsWrapper (torch's or TorchRec's) lists the pieces; placements say nothing
        # reliable (a table-wise table reads Replicate() yet lives on one rank). TorchRec's 2D
        # mesh is (replica, shard): count only the first replica group.
        shards = [
            LocalShard(t.detach(), *_offsets(o))
            for t, o in zip(local.local_shards(), local.local_offsets(), strict=False)
            if t.numel() > 0
        ]
        counted = all(c == 0 for c in coordinate[:-1])
        return ShardInfo(shards, tensor.shape, replicated=False, counted=counted)
    replicated = all(p.is_replicate() for p in placements)
    _, offset = local_shape_and_global_offset(tensor.shape, mesh, placements)
    shards = [LocalShard(local.detach(), *_offsets(offset))] if local.numel() > 0 else []
    counted = all(c == 0 for c, p in zip(coordinate, placements, strict=True) if p.is_replicate())
    return ShardInfo(shards, tensor.shape, replicated=replicated, counted=counted)


def global_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor, however it is laid out.

    ``ShardedTensor.size()`` goes through torch's deprecated ShardedTensor dispatch (a
    FutureWarning per call); its metadata holds the same size.

    Args:
        tensor: a plain tensor, ``ShardedTensor`` or ``DTensor``.

    Returns:
        The global shape.
    """
    if isinstance(tensor, ShardedTensor):
        return torch.Size(tensor.metadata().size)
    return tensor.shape


def global_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype of a plain tensor, ``ShardedTensor`` (its metadata's: no warning) or ``DTensor``.

    Args:
        tensor: the tensor.

    Returns:
        Its dtype.
    """
    if isinstance(tensor, ShardedTensor):
        return tensor.metadata().tensor_properties.dtype
    return tensor.dtype


def shard_info(tensor: torch.Tensor) -> ShardInfo:
    """Describe the pieces of ``tensor`` that this rank holds.

    Args:
        tensor: A plain tensor, ``TableBatchedEmbeddingSlice``, ``ShardedTensor`` or ``DTensor``.

    Returns:
        The local shards (non-empty ones only), the global shape and whether the tensor is
        replicated. A plain tensor is one replicated shard at offset ``(0, 0)``.

    Raises:
        ValueError: For a DTensor with ``Partial`` placements.
    """
    if isinstance(tensor, ShardedTensor):
        return _sharded_tensor_info(tensor)
    if isinstance(tensor, DTensor):
        return _dtensor_info(tensor)
    # detach() of a TableBatchedEmbeddingSlice (a Parameter) is a plain Tensor view.
    shards = [LocalShard(tensor.detach(), 0, 0)] if tensor.numel() > 0 else []
    return ShardInfo(shards, tensor.shape, replicated=True, counted=True)


def _assemble(shape: torch.Size, pieces: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    dtype = pieces[0][2].dtype if pieces else torch.float32
    full = torch.zeros(shape, dtype=dtype)
    for row, col, piece in pieces:
        index = [slice(row, row + piece.shape[0])] if piece.dim() else []
        if piece.dim() > 1:
            index.append(slice(col, col + piece.shape[1]))
        full[tuple(index)] = piece.cpu()
    return full


def _gather_shards_to_rank0(info: ShardInfo) -> list[tuple[int, int, torch.Tensor]] | None:
    """Gather every rank's pieces to rank 0 with one object all-gather and one tensor gather."""
    rank, world_size = rank_and_world_size()
    shards = info.shards if info.counted else []
    dtype = shards[0].tensor.dtype if shards else torch.float32
    wire = torch.float64 if dtype == torch.float64 or not dtype.is_floating_point else torch.float32
    meta = [(s.row_offset, s.col_offset, tuple(s.tensor.shape), s.tensor.dtype) for s in shards]
    metas: list[Any] = [None] * world_size
    dist.all_gather_object(metas, meta)
    lengths = [sum(int(torch.Size(m[2]).numel()) for m in ms) for ms in metas]
    device = collective_device()
    flat = torch.zeros(max(lengths), dtype=wire, device=device)
    if shards:
        local = torch.cat([s.tensor.reshape(-1).to(device=device, dtype=wire) for s in shards])
        flat[: local.numel()] = local
    buffers = [torch.empty_like(flat) for _ in range(world_size)] if rank == 0 else None
    dist.gather(flat, buffers, dst=0)
    if rank != 0:
        return None
    pieces = []
    for ms, buffer in zip(metas, buffers, strict=True):
        start = 0
        for row, col, shape, piece_dtype in ms:
            n = int(torch.Size(shape).numel())
            pieces.append((row, col, buffer[start : start + n].view(shape).to(piece_dtype)))
            start += n
    return pieces


def log_sharded_tensor_content(
    weight_name: str,
    table_name: str,
    weight_tensor: torch.Tensor,
    max_rows: int = 1_000_000,
) -> torch.Tensor | None:
    """Gather a whole (possibly sharded) table to rank 0, on the CPU, and log it.

    Collective when ``weight_tensor`` is sharded (call on every rank); any world size, gloo or NCCL.

    Args:
        weight_name: Name of the weight in the model (for the log).
        table_name: Name of the embedding table (for the log).
        weight_tensor: Plain tensor, ``ShardedTensor`` or ``DTensor`` (see :func:`shard_info`).
        max_rows: Refuse tables with more rows than this; raise it to gather a bigger table.

    Returns:
        The whole table on rank 0; None on the other ranks.

    Raises:
        ValueError: When the table has more than ``max_rows`` rows (on every rank, before any
            communication).
    """
    info = shard_info(weight_tensor)
    shape = info.global_shape
    rows = shape[0] if len(shape) else 1
    if rows > max_rows:
        cols = shape[1] if len(shape) > 1 else 1
        raise ValueError(
            f"{weight_name} (table {table_name}) has {rows} rows x {cols} columns "
            f"({shape.numel()} values), more than max_rows={max_rows}; "
            "pass a larger max_rows to gather it anyway."
        )
    rank, world_size = rank_and_world_size()
    pieces = [(s.row_offset, s.col_offset, s.tensor) for s in info.shards]
    if world_size > 1 and not info.replicated:
        pieces = _gather_shards_to_rank0(info)
    if rank != 0 or pieces is None:
        return None
    full = _assemble(shape, pieces)
    logger.info("%s (table %s), shape %s:\n%s", weight_name, table_name, tuple(shape), full)
    return full


@torch.no_grad()
def copy_into_shards(full_tables: dict[str, torch.Tensor], tables: dict[str, torch.Tensor]) -> None:
    """Copies whole tensors into this rank's shards of the same tensors (tables or dense).

    Args:
        full_tables: ``{key: whole tensor}`` (e.g. the values an unsharded module held).
        tables: ``{key: sharded or replicated tensor}`` of the sharded module, e.g.
            ``lightning_torchrec.sharding.tables.embedding_tables(module)`` or
            ``module.state_dict()``.

    Raises:
        KeyError: naming a key of ``full_tables`` the sharded module does not have.
        ValueError: naming a table whose shape differs.
    """
    for key, full in full_tables.items():
        if key not in tables:
            raise KeyError(f"table {key!r} is not in the sharded module")
        info = shard_info(tables[key])
        if tuple(info.global_shape) != tuple(full.shape):
            raise ValueError(
                f"table {key!r}: shape {tuple(full.shape)} does not match the sharded "
                f"table's {tuple(info.global_shape)}"
            )
        for s in info.shards:
            offsets = (s.row_offset, s.col_offset)[: s.tensor.dim()]
            index = tuple(slice(o, o + n) for o, n in zip(offsets, s.tensor.shape, strict=False))
            part = full[index] if index else full
            s.tensor.copy_(part.to(device=s.tensor.device, dtype=s.tensor.dtype))
