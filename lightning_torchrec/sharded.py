"""The one place that knows how tensors are laid out over ranks.

:func:`shard_info` describes what this rank holds of: a plain tensor (dense parameters,
data-parallel tables: *replicated*, every rank holds all of it); a ``ShardedTensor`` (TorchRec's
model-parallel tables: zero, one or several pieces per rank); a ``DTensor`` (regular, or TorchRec's
``output_dtensor`` one whose local tensor is a ``LocalShardsWrapper``); TorchRec's
``TableBatchedEmbeddingSlice`` (the local view ``named_parameters()`` gives of a fused table; it has
no global metadata, so it counts as a plain tensor: use the ShardedTensor of a sharded table).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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


def rank_and_world_size() -> tuple[int, int]:
    """Return this process's rank and the world size.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` when ``torch.distributed`` is not initialised.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collective_device() -> torch.device:
    """Return the device that tensors given to collectives of the default group must live on.

    Returns:
        The current CUDA device when the default backend is NCCL, else the CPU.
    """
    nccl = dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend())
    if nccl and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    pg = getattr(tensor, "_process_group", None)
    if pg is not None and dist.get_world_size(pg) < dist.get_world_size():
        # A ShardedTensor over a sub-group: the other groups are assumed to hold replicas
        # (TorchRec 2D parallel); only the group containing global rank 0 is counted.
        counted = 0 in dist.get_process_group_ranks(pg)
    return ShardInfo(shards, tensor.size(), replicated=False, counted=counted)


def _dtensor_info(tensor: DTensor) -> ShardInfo:
    mesh, placements = tensor.device_mesh, tensor.placements
    if any(p.is_partial() for p in placements):
        raise ValueError("A DTensor with Partial placements has no well-defined local shards.")
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not part of the mesh
        return ShardInfo([], tensor.shape, replicated=False, counted=False)
    local = tensor._local_tensor
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
    _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    shards = [LocalShard(local.detach(), *_offsets(offset))] if local.numel() > 0 else []
    counted = all(c == 0 for c, p in zip(coordinate, placements, strict=True) if p.is_replicate())
    return ShardInfo(shards, tensor.shape, replicated=replicated, counted=counted)


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


def local_shards(tensor: torch.Tensor) -> list[LocalShard]:
    """Return the non-empty pieces of ``tensor`` held by this rank.

    Args:
        tensor: Any tensor accepted by :func:`shard_info`.

    Returns:
        ``(tensor, row_offset, col_offset)`` tuples; empty when this rank holds nothing.
    """
    return shard_info(tensor).shards


def _sample_positions(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct positions in ``[0, n)``, uniform without replacement, sorted; O(k) memory."""
    if k >= n:
        return torch.arange(n)
    if n <= 4 * k:
        return torch.randperm(n, generator=generator)[:k].sort().values
    chosen = torch.zeros(0, dtype=torch.long)
    while chosen.numel() < k:  # distinct values of uniform draws: a uniform subset (symmetry)
        draws = torch.randint(n, (2 * (k - chosen.numel()) + 16,), generator=generator)
        chosen = torch.unique(torch.cat([chosen, draws]))
    keep = torch.randperm(chosen.numel(), generator=generator)[:k]
    return chosen[keep].sort().values


def sampled_row_norms(
    shards: list[LocalShard], sample_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, int]:
    """L2 norms of a uniform sample (without replacement) of this rank's rows of a 2-D table.

    A row's norm combines every local shard holding that row (the columns held on this rank).
    Only the sampled rows are read (``index_select``) unless all rows of a shard are sampled.

    Args:
        shards: This rank's shards of one table (see :func:`local_shards`).
        sample_size: Most rows to sample.
        generator: CPU generator the sample is drawn with.

    Returns:
        The norms (float64, sorted by row) and the number of distinct local rows.

    Raises:
        ValueError: When a shard is not 2-D.
    """
    if any(s.tensor.dim() != 2 for s in shards):
        raise ValueError("Row norms need 2-D embedding tables.")
    if not shards:
        return torch.zeros(0, dtype=torch.float64), 0
    spans: list[list[int]] = []  # union of the local row ranges, merged and sorted
    for lo, hi in sorted({(s.row_offset, s.row_offset + s.tensor.shape[0]) for s in shards}):
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    lengths = torch.tensor([hi - lo for lo, hi in spans], dtype=torch.long)
    n_rows = int(lengths.sum())
    positions = _sample_positions(n_rows, min(sample_size, n_rows), generator)
    ends = lengths.cumsum(0)
    span = torch.searchsorted(ends, positions, right=True)
    starts = torch.tensor([lo for lo, _ in spans], dtype=torch.long)
    rows = positions - (ends - lengths)[span] + starts[span]  # global row ids, sorted
    return row_squares(shards, rows).sqrt(), n_rows


def row_squares(shards: list[LocalShard], rows: torch.Tensor) -> torch.Tensor:
    """Squared L2 norms of the parts of global rows ``rows`` held in ``shards`` (0 elsewhere).

    Summed over ranks, this gives the squared norm of whole rows, whatever the sharding.

    Args:
        shards: This rank's shards of one 2-D table.
        rows: Sorted global row ids.

    Returns:
        float64 squares, one per row, on the shards' device (CPU when there are none).
    """
    device = shards[0].tensor.device if shards else torch.device("cpu")
    squares = torch.zeros(rows.numel(), dtype=torch.float64, device=device)
    for s in shards:
        lo, hi = s.row_offset, s.row_offset + s.tensor.shape[0]
        a, b = int(torch.searchsorted(rows, lo)), int(torch.searchsorted(rows, hi))
        if a == b:
            continue
        block = s.tensor
        if b - a < hi - lo:
            block = block.index_select(0, (rows[a:b] - lo).to(block.device))
        dtype = None if block.dtype == torch.float64 else torch.float32
        norms = torch.linalg.vector_norm(block, dim=1, dtype=dtype)
        squares[a:b] += norms.to(device=device, dtype=torch.float64).square()
    return squares


def _default_sharders(fused_params: dict[str, Any] | None) -> list[Any]:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import get_default_sharders

    if fused_params is None:
        return get_default_sharders()
    replace = {
        EmbeddingBagCollectionSharder: EmbeddingBagCollectionSharder(fused_params=fused_params),
        EmbeddingCollectionSharder: EmbeddingCollectionSharder(fused_params=fused_params),
    }
    return [replace.get(type(s), s) for s in get_default_sharders()]


def maybe_shard_model(
    model: nn.Module,
    device: torch.device,
    *,
    plan: Any | None = None,
    sharders: list[Any] | None = None,
    constraints: dict[str, Any] | None = None,
    fused_params: dict[str, Any] | None = None,
) -> nn.Module:
    """Wrap ``model`` in ``DistributedModelParallel`` when ``torch.distributed`` is initialised.

    Without ``plan``, ``EmbeddingShardingPlanner.collective_plan`` (rank 0's plan for every rank)
    plans for ``world_size`` ranks, ``LOCAL_WORLD_SIZE`` per host, on ``device.type``.

    Args:
        model: The model, typically with embedding modules on the ``meta`` device.
        device: This rank's device (``cpu`` or ``cuda:N``).
        plan: A ready ``ShardingPlan``; skips planning.
        sharders: TorchRec module sharders; default: TorchRec's default sharders.
        constraints: ``{table name: ParameterConstraints}`` for the planner.
        fused_params: Fused-optimizer parameters for the default EBC/EC sharders.

    Returns:
        The ``DistributedModelParallel`` model, or ``model`` itself in a single process.

    Raises:
        ValueError: When ``fused_params`` comes with ``sharders`` or ``constraints`` with ``plan``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        logger.info("torch.distributed is not initialised: the model is not sharded.")
        return model
    if sharders is not None and fused_params is not None:
        raise ValueError("Pass fused_params or sharders, not both: set them on your sharders.")
    if plan is not None and constraints is not None:
        raise ValueError("constraints are only used to make a plan; a plan was given.")
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    from lightning_torchrec.planning import make_topology, plan_collectively

    if sharders is None:
        sharders = _default_sharders(fused_params)
    if plan is None:
        world_size = dist.get_world_size()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        topology = make_topology(world_size, local_world_size, device.type)
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
        # Rank 0 plans; a planning error reaches every rank instead of leaving them waiting.
        plan = plan_collectively(planner, model, sharders, dist.GroupMember.WORLD, topology)
    logger.info("Sharding the model with plan:\n%s", plan)
    return DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders)


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
            ``lightning_torchrec.norms.embedding_tables(module)`` or ``module.state_dict()``.

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
