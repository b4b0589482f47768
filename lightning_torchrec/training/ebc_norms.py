"""Sampled mean row norms of embedding tables (the ``log_ebc_norms`` semantics); no Lightning.

Per table and rank, the mean L2 norm of a uniform sample of that rank's rows (only the sampled rows
are read), all-gathered; and the mean norm of WHOLE rows over a sample every rank agrees on, exact
for any sharding. Collectives use the default group: every rank must call with the same arguments.
"""

from __future__ import annotations

import difflib
import math
import zlib
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from lightning_torchrec.distributed import collective_device, rank_and_world_size
from lightning_torchrec.sharding.layout import LocalShard, shard_info


def sample_positions(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
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
    positions = sample_positions(n_rows, min(sample_size, n_rows), generator)
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


def as_sample_size(sample_size: float) -> int:
    """A number of rows to sample: an int, or a float without fraction such as ``4e6``.

    A float reached ``torch.randperm(n)[:k]`` only on tables with more rows than it, so it
    failed at the first logging step, on the ranks holding such tables only.

    Args:
        sample_size: the requested number of rows.

    Returns:
        It as an int.

    Raises:
        TypeError: for a fraction, a bool or a non-number.
        ValueError: when it is below 1.
    """
    if isinstance(sample_size, float) and sample_size.is_integer():
        sample_size = int(sample_size)
    if isinstance(sample_size, bool) or not isinstance(sample_size, int):
        raise TypeError(f"sample_size must be a whole number of rows, got {sample_size!r}")
    if sample_size < 1:
        raise ValueError(f"sample_size must be >= 1, got {sample_size}")
    return sample_size


def _seed(seed: int, key: str, rank: int | None) -> int:
    # Replicated tables (rank None) sample the same rows on every rank.
    return (seed * 1_000_003 + zlib.crc32(f"{key}|{rank}".encode())) % (2**63)


def log_ebc_norms(
    model_state_dict: Mapping[str, torch.Tensor],
    ebc_keys: Iterable[str],
    sample_size: float = 4_000_000,
    *,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Mean L2 row norm of embedding tables, per rank and overall (collective on every rank).

    Per rank and key: the mean L2 norm of a uniform sample without replacement (deterministic
    given ``seed``) of at most ``sample_size`` LOCAL rows; only sampled rows are read. A row's norm
    is over the columns held on this rank: for a table split by columns, per-rank values are over
    local columns.

    Args:
        model_state_dict: ``{key: tensor}``: ``model.state_dict()`` or, cheaper,
            :func:`lightning_torchrec.sharding.tables.embedding_tables`; ShardedTensors, DTensors or
            plain 2-D tensors.
        ebc_keys: Keys to log, e.g. ``list(embedding_tables(model))``.
        sample_size: Most rows read per table and rank.
        seed: Seed of the row sampling (mixed with the key and, for sharded tables, the rank).

    Returns:
        ``{"{key}-norm-{rank}": value}`` for every rank (-1 where that rank holds no row of the
        table) and ``{"{key}-norm-mean": value}``: the mean norm of WHOLE rows over a sample of
        at most ``sample_size`` global rows that every rank agrees on (exact for any sharding:
        the parts of a row on several ranks are combined with one all-reduce for all tables;
        replicated tables counted once; -1 for an empty table). 0-dim float32 CPU tensors.

    Raises:
        ValueError: When ``sample_size < 1`` or a table is not 2-D (naming it, on every rank).
        TypeError: When ``sample_size`` is not a whole number (``4e6`` is).
        KeyError: When a key is missing from ``model_state_dict`` on every rank.
    """
    sample_size = as_sample_size(sample_size)
    keys = list(ebc_keys)
    rank, world_size = rank_and_world_size()
    device = collective_device()
    rows = []  # per key: mean, row-count weight, replicated, present
    for key in keys:
        tensor = model_state_dict.get(key)
        if tensor is None:
            rows.append(
                torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64, device=device)
            )
            continue
        info = shard_info(tensor)
        # The global shape: every rank holding the key raises. No rows at all is -1, not 2-D.
        if len(info.global_shape) != 2 and math.prod(info.global_shape) > 0:
            raise ValueError(
                f"ebc_keys names {key!r} of shape {tuple(info.global_shape)}: row norms need "
                "2-D embedding tables"
            )
        stream = _seed(seed, key, None if info.replicated else rank)
        generator = torch.Generator().manual_seed(stream)
        norms, n_rows = sampled_row_norms(info.shards, sample_size, generator)
        mean = norms.mean() if n_rows else torch.tensor(-1.0, dtype=torch.float64)
        weight = float(n_rows) if info.replicated or info.counted else 0.0
        cols = info.global_shape[1] if len(info.global_shape) > 1 else 1
        split = any(sh.tensor.dim() > 1 and sh.tensor.shape[1] < cols for sh in info.shards)
        extra = torch.tensor(
            [weight, float(info.replicated), 1.0, float(split)], dtype=torch.float64
        )
        rows.append(torch.cat([mean.reshape(1).to(device), extra.to(device)]))
    stats = torch.stack(rows) if rows else torch.zeros(0, 5, dtype=torch.float64, device=device)
    gathered = [stats]
    if world_size > 1:
        gathered = [torch.empty_like(stats) for _ in range(world_size)]
        dist.all_gather(gathered, stats)
    every = torch.stack(gathered).cpu()  # (world_size, keys, [mean, rows, repl, present, split])
    missing = [key for i, key in enumerate(keys) if not every[:, i, 3].any()]
    if missing:
        close = {k: difflib.get_close_matches(k, list(model_state_dict), n=3) for k in missing}
        raise KeyError(f"ebc_keys not in model_state_dict on any rank (close names): {close}")
    out: dict[str, torch.Tensor] = {}
    for i, key in enumerate(keys):
        means = every[:, i, 0]
        out.update({f"{key}-norm-{r}": means[r].float() for r in range(world_size)})
    out.update(_global_means(model_state_dict, keys, every, sample_size, seed, device))
    return out


def _global_means(
    model_state_dict: Mapping[str, torch.Tensor],
    keys: list[str],
    every: torch.Tensor,
    sample_size: int,
    seed: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Mean norm of whole rows per table.

    Where every rank holds whole rows (table-wise, row-wise, replicated), the row-weighted mean
    of the per-rank means is exact and free. A table split by columns on some rank needs more:
    ranks agree on a sample of global rows, each adds the squared norms of the parts it holds,
    and one all-reduce (all such tables together) gives whole-row squared norms.
    """
    out: dict[str, torch.Tensor] = {}
    sharded: list[tuple[str, torch.Tensor]] = []
    parts: list[torch.Tensor] = []
    distributed = dist.is_available() and dist.is_initialized()
    for i, key in enumerate(keys):
        means, weights, replicated = every[:, i, 0], every[:, i, 1], every[:, i, 2]
        if not (distributed and every[:, i, 4].any()) or replicated.any():
            holders = (weights > 0).nonzero().flatten()[: 1 if replicated.any() else None]
            if holders.numel():
                overall = (means[holders] * weights[holders]).sum() / weights[holders].sum()
                out[f"{key}-norm-mean"] = overall.float()
            else:
                out[f"{key}-norm-mean"] = _NONE
            continue
        tensor = model_state_dict.get(key)
        info = shard_info(tensor) if tensor is not None else None
        n_rows = int(info.global_shape[0]) if info is not None else 0
        n_rows = int(_max_over_ranks(n_rows, device))
        generator = torch.Generator().manual_seed(_seed(seed, key, None))
        rows = sample_positions(n_rows, min(sample_size, n_rows), generator)
        squares = row_squares(info.shards if info is not None else [], rows)
        sharded.append((key, rows))
        parts.append(squares.to(device))
    if parts:
        total = torch.cat(parts)
        dist.all_reduce(total)
        offset = 0
        for key, rows in sharded:
            chunk = total[offset : offset + rows.numel()].cpu()
            offset += rows.numel()
            out[f"{key}-norm-mean"] = chunk.sqrt().mean().float() if rows.numel() else _NONE
    return out


_NONE = torch.tensor(-1.0)


def _max_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
