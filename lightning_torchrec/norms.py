"""Sharding-aware weight norms of a (possibly ``DistributedModelParallel``) model; no Lightning.

Tensors come from ``named_parameters`` (dense parameters, data-parallel tables: plain, replicated)
and, for model-parallel tables, from the ShardedTensors/DTensors that TorchRec's sharded embedding
modules keep for their state-dict hook (``_model_parallel_name_to_sharded_tensor``/``_dtensor``),
whose shards are views of the fused weights: no ``model.state_dict()``, no copy. Another TorchRec
``ShardedModule`` falls back to its own ``state_dict()`` (rebuilds ShardedTensor metadata per call).
Collectives use the default group: every rank must call with the same arguments.
"""

from __future__ import annotations

import difflib
import math
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollectionInterface,
    EmbeddingCollectionInterface,
)

from lightning_torchrec.sharded import (
    ShardInfo,
    _sample_positions,
    collective_device,
    rank_and_world_size,
    row_squares,
    sampled_row_norms,
    shard_info,
)

_TABLE_KEY = re.compile(r"(?:^|\.)(?:embedding_bags|embeddings)\.[^.]+\.weight$")
_EMBEDDING_MODULES = (EmbeddingBagCollectionInterface, EmbeddingCollectionInterface)


def l2_norm(tensor: torch.Tensor) -> torch.Tensor:
    """L2 (Frobenius) norm of all entries: the default of :func:`weights_to_log`.

    Args:
        tensor: Any tensor.

    Returns:
        A 0-dim tensor.
    """
    return torch.linalg.vector_norm(tensor)


def l1_norm(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of absolute values of all entries.

    Args:
        tensor: Any tensor.

    Returns:
        A 0-dim tensor.
    """
    return torch.linalg.vector_norm(tensor, ord=1)


def max_norm(tensor: torch.Tensor) -> torch.Tensor:
    """Largest absolute value (infinity norm of all entries).

    Args:
        tensor: A non-empty tensor.

    Returns:
        A 0-dim tensor.
    """
    return torch.linalg.vector_norm(tensor, ord=math.inf)


# Norms computed on the whole table across ranks; any other callable runs per rank.
_BUILTIN: dict[Any, str] = {
    l2_norm: "l2",
    torch.norm: "l2",
    torch.linalg.norm: "l2",
    torch.linalg.vector_norm: "l2",
    l1_norm: "l1",
    max_norm: "max",
}
_ORD = {"l2": 2.0, "l1": 1.0, "max": math.inf}


def _unwrap(module: nn.Module) -> nn.Module:
    if isinstance(module, DistributedModelParallel):
        return module._dmp_wrapped_module
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return module.module
    return getattr(module, "_orig_mod", module)  # torch.compile's OptimizedModule


def _sharded_views(module: nn.Module) -> dict[str, torch.Tensor] | None:
    sharded = getattr(module, "_model_parallel_name_to_sharded_tensor", None)
    dtensors = getattr(module, "_model_parallel_name_to_dtensor", None)
    if isinstance(sharded, dict) and isinstance(dtensors, dict):
        container = "embedding_bags" if hasattr(module, "embedding_bags") else "embeddings"
        return {f"{container}.{t}.weight": v for t, v in {**sharded, **dtensors}.items()}
    if isinstance(module, ShardedModule):
        state = module.state_dict(keep_vars=True)  # the costly fallback, see module docstring
        return {k: v for k, v in state.items() if isinstance(v, ShardedTensor | DTensor)}
    return None


def _model_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    """``{unwrapped name: (tensor, is embedding table)}``, each tensor once, in model order."""
    out: dict[str, tuple[torch.Tensor, bool]] = {}
    seen: set[int] = set()

    def add(name: str, tensor: torch.Tensor, is_table: bool) -> None:
        if id(tensor) not in seen and name not in out:
            seen.add(id(tensor))
            out[name] = (tensor, is_table)

    def walk(module: nn.Module, prefix: str) -> None:
        inner = _unwrap(module)
        if inner is not module:
            walk(inner, prefix)
            return
        views = _sharded_views(module)
        if views is not None or isinstance(module, _EMBEDDING_MODULES):
            views = views or {}
            for name, view in views.items():
                add(prefix + name, view, True)
            for name, param in module.named_parameters():
                if name not in views:  # skips the local TBE slices of sharded tables
                    add(prefix + name, param, bool(_TABLE_KEY.search(name)))
            return
        for name, param in module.named_parameters(recurse=False):
            add(prefix + name, param, False)
        for name, child in module.named_children():
            walk(child, f"{prefix}{name}.")

    walk(model, "")
    return out


def embedding_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every EBC/EC table of ``model`` by its state-dict key, without calling ``state_dict()``.

    Args:
        model: A plain model or a ``DistributedModelParallel`` (possibly inside another module).

    Returns:
        ``{state-dict key: ShardedTensor/DTensor (model-parallel) or plain tensor}``, usable as
        ``model_state_dict`` of :func:`log_ebc_norms`; wrapper prefixes are stripped.
    """
    return {name: t for name, (t, is_table) in _model_tensors(model).items() if is_table}


def embedding_table_names(model: nn.Module) -> list[str]:
    """State-dict keys of every EBC/EC table of ``model``, e.g. for :func:`log_ebc_norms`.

    Args:
        model: A plain model or a ``DistributedModelParallel``.

    Returns:
        The keys, in model order.
    """
    return list(embedding_tables(model))


def _foreach_norms(tensors: list[torch.Tensor], ord: float, device: torch.device) -> torch.Tensor:
    """Norms of many tensors, batched with ``torch._foreach_norm``, as float64 on ``device``."""
    out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    for double in (False, True):  # half precision is accumulated in float32
        idx = [i for i, t in enumerate(tensors) if (t.dtype == torch.float64) == double]
        if idx:
            dtype = None if double else torch.float32
            norms = torch._foreach_norm([tensors[i] for i in idx], ord, dtype=dtype)
            out[idx] = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms])
    return out


def _builtin_norms(items: list[tuple[str, str, ShardInfo]]) -> list[torch.Tensor]:
    """Whole-table norms; one SUM all-reduce (and one MAX if needed) for all sharded items."""
    device = collective_device()
    _, world_size = rank_and_world_size()
    partial = torch.zeros(len(items), dtype=torch.float64, device=device)
    for kind in sorted({kind for _, kind, _ in items}):
        pieces, owners = [], []
        for i, (_, k, info) in enumerate(items):
            if k == kind and (info.replicated or info.counted):
                pieces += [s.tensor for s in info.shards]
                owners += [i] * len(info.shards)
        norms = _foreach_norms(pieces, _ORD[kind], device)
        index = torch.tensor(owners, dtype=torch.long, device=device)
        if kind == "max":
            partial.scatter_reduce_(0, index, norms, reduce="amax")  # norms >= 0 = the zeros
        else:
            partial.index_add_(0, index, norms.square() if kind == "l2" else norms)
    if world_size > 1:
        for op, kinds in ((dist.ReduceOp.SUM, ("l1", "l2")), (dist.ReduceOp.MAX, ("max",))):
            mask = [kind in kinds and not info.replicated for _, kind, info in items]
            if any(mask):  # the same on every rank: it depends on the model only
                sel = torch.tensor(mask, dtype=torch.bool, device=device)
                buffer = partial[sel]
                dist.all_reduce(buffer, op=op)
                partial[sel] = buffer
    is_l2 = torch.tensor([kind == "l2" for _, kind, _ in items], dtype=torch.bool, device=device)
    return list(torch.where(is_l2, partial.sqrt(), partial).float().cpu().unbind())


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def weights_to_log(
    model: nn.Module,
    how_to_log: Callable[[torch.Tensor], Any]
    | Mapping[str, Callable[[torch.Tensor], Any]]
    | None = None,
) -> dict[str, torch.Tensor]:
    """Reduce the model's parameters to scalars worth logging (collective: call on every rank).

    Built-in norms (:func:`l2_norm`, :func:`l1_norm`, :func:`max_norm`; ``torch.norm``,
    ``torch.linalg.norm``, ``torch.linalg.vector_norm`` as L2) give the norm of the WHOLE table:
    partial sums (maxima) of local shards, all-reduced once for all parameters together; replicated
    tensors (dense parameters, data-parallel tables) are reduced locally, counted once. Any other
    callable sees the local shard of a sharded table: the value is PER RANK, keyed ``/rank{r}``
    (``/rank{r}/shard{i}`` on a rank holding several shards; no key on a rank holding none).

    Args:
        model: A plain model or a ``DistributedModelParallel`` (possibly inside another module).
        how_to_log: One callable for every parameter; or ``{parameter name: callable}`` for just
            those parameters (names as in the unwrapped model); None means :func:`l2_norm`.

    Returns:
        ``{"model/{fn.__name__}/{parameter name}[/rank{r}]": value}``; built-in norms are 0-dim
        float32 CPU tensors.

    Raises:
        KeyError: When ``how_to_log`` names an unknown parameter (message lists close names).
        TypeError: When ``how_to_log`` is neither callable, a mapping nor None.
    """
    tensors = _model_tensors(model)
    if how_to_log is None or callable(how_to_log):
        fn = how_to_log or l2_norm
        selection = [(name, fn) for name in tensors]
    elif isinstance(how_to_log, Mapping):
        unknown = [name for name in how_to_log if name not in tensors]
        if unknown:
            hints = [f"{n!r} (close: {difflib.get_close_matches(n, tensors)})" for n in unknown]
            raise KeyError(f"how_to_log names unknown parameters: {'; '.join(hints)}")
        selection = [(name, how_to_log[name]) for name in tensors if name in how_to_log]
    else:
        raise TypeError(f"how_to_log must be a callable or a mapping, not {type(how_to_log)}")
    rank, _ = rank_and_world_size()
    builtin = [
        (f"model/{_fn_name(fn)}/{name}", kind, shard_info(tensors[name][0]))
        for name, fn in selection
        if (kind := _BUILTIN.get(fn) if getattr(fn, "__hash__", None) else None)
    ]
    values = dict(zip([key for key, _, _ in builtin], _builtin_norms(builtin), strict=True))
    out: dict[str, torch.Tensor] = {}
    for name, fn in selection:
        key = f"model/{_fn_name(fn)}/{name}"
        if key in values:
            out[key] = values[key]
            continue
        tensor = tensors[name][0]
        info = shard_info(tensor)
        if info.replicated:
            out[key] = torch.as_tensor(fn(tensor.detach())).detach()
        elif len(info.shards) == 1:
            out[f"{key}/rank{rank}"] = torch.as_tensor(fn(info.shards[0].tensor)).detach()
        else:
            for i, shard in enumerate(info.shards):
                out[f"{key}/rank{rank}/shard{i}"] = torch.as_tensor(fn(shard.tensor)).detach()
    return out


def _seed(seed: int, key: str, rank: int | None) -> int:
    # Replicated tables (rank None) sample the same rows on every rank.
    return (seed * 1_000_003 + zlib.crc32(f"{key}|{rank}".encode())) % (2**63)


def log_ebc_norms(
    model_state_dict: Mapping[str, torch.Tensor],
    ebc_keys: Iterable[str],
    sample_size: int = 4_000_000,
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
            :func:`embedding_tables`; ShardedTensors, DTensors or plain 2-D tensors.
        ebc_keys: Keys to log, e.g. from :func:`embedding_table_names`.
        sample_size: Most rows read per table and rank.
        seed: Seed of the row sampling (mixed with the key and, for sharded tables, the rank).

    Returns:
        ``{"{key}-norm-{rank}": value}`` for every rank (-1 where that rank holds no row of the
        table) and ``{"{key}-norm-mean": value}``: the mean norm of WHOLE rows over a sample of
        at most ``sample_size`` global rows that every rank agrees on (exact for any sharding:
        the parts of a row on several ranks are combined with one all-reduce for all tables;
        replicated tables counted once; -1 for an empty table). 0-dim float32 CPU tensors.

    Raises:
        ValueError: When ``sample_size < 1`` or a table is not 2-D.
        KeyError: When a key is missing from ``model_state_dict`` on every rank.
    """
    if sample_size < 1:
        raise ValueError(f"sample_size must be >= 1, got {sample_size}")
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
        rows = _sample_positions(n_rows, min(sample_size, n_rows), generator)
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
