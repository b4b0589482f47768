"""Sharding-aware weight norms of a (possibly ``DistributedModelParallel``) model; no Lightning.

:func:`weights_to_log` reduces every parameter to a scalar. Tensors come from
:func:`lightning_torchrec.sharding.tables.model_tensors`: dense parameters and data-parallel
tables as plain (replicated) tensors, model-parallel tables as the ShardedTensors/DTensors their
modules keep, whose shards are views of the fused weights: no ``model.state_dict()``, no copy.
Collectives use the default group: every rank must call with the same arguments.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_torchrec.compat.upstream import foreach_norm
from lightning_torchrec.distributed import collective_device, rank_and_world_size
from lightning_torchrec.sharding.layout import ShardInfo, shard_info
from lightning_torchrec.sharding.tables import model_tensors


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


def _foreach_norms(tensors: list[torch.Tensor], ord: float, device: torch.device) -> torch.Tensor:
    """Norms of many tensors, batched in one foreach kernel, as float64 on ``device``."""
    out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    for double in (False, True):  # half precision is accumulated in float32
        idx = [i for i, t in enumerate(tensors) if (t.dtype == torch.float64) == double]
        if idx:
            dtype = None if double else torch.float32
            norms = foreach_norm([tensors[i] for i in idx], ord, dtype)
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


def is_whole_table_norm(fn: Callable[..., Any]) -> bool:
    """Whether :func:`weights_to_log` computes ``fn`` over whole tables across ranks.

    Args:
        fn: a callable given as ``how_to_log``.

    Returns:
        True for the built-in norms (the same value on every rank); False for other callables,
        whose values are per rank (``/rank{r}`` keys).
    """
    return bool(getattr(fn, "__hash__", None)) and fn in _BUILTIN


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _fn_label(fn: Callable[..., Any]) -> str:
    """The callable's qualified name (``module.<locals>.<lambda>``), or its repr."""
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if qualname and module else repr(fn)


class BadReturn(NamedTuple):
    """What a ``how_to_log`` callable returned instead of one number, for one logged key."""

    label: str  # the callable's qualified name
    kind: str  # "none", "type" (not a number) or "shape" (not one number)
    detail: str  # the type's name or the tensor's shape


def _as_number(
    fn: Callable[..., Any], tensor: torch.Tensor, one_number: bool
) -> torch.Tensor | BadReturn:
    """``fn(tensor)`` as a tensor (of one number if asked), or what was wrong with it."""
    value = fn(tensor)
    if value is None:
        return BadReturn(_fn_label(fn), "none", "None")
    try:
        result = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):  # str, dict, ragged list, object, ...
        return BadReturn(_fn_label(fn), "type", type(value).__name__)
    if result.is_complex():
        return BadReturn(_fn_label(fn), "type", f"{type(value).__name__} of {result.dtype}")
    if one_number and result.numel() != 1:
        return BadReturn(_fn_label(fn), "shape", repr(tuple(result.shape)))
    return result.detach()


def bad_return_error(
    bad: Mapping[str, BadReturn], where: str = "how_to_log", one_number: bool = True
) -> ValueError | TypeError:
    """The error for callables that did not reduce parameters to one number each.

    Args:
        bad: ``{logged key: what its callable returned}``, e.g. from :func:`reduce_weights`
            (merged over ranks where each rank had its own).
        where: how the message names the argument, e.g. ``"WeightNormCallback(how_to_log=...)"``.
        one_number: whether the callables had to return one number (else a number or a tensor).

    Returns:
        A ``TypeError`` when every bad value is of a type that is not a number (e.g. a ``str``),
        else a ``ValueError`` (``None``, several numbers or none); the message names each
        callable and the keys (parameters) it failed on.
    """
    parts = []
    for label in sorted({b.label for b in bad.values()}):
        mine = {k: b for k, b in sorted(bad.items()) if b.label == label}
        shapes = {k: b.detail for k, b in mine.items() if b.kind == "shape"}
        if shapes:
            listed = ", ".join(f"{k!r}: {v}" for k, v in shapes.items())
            parts.append(f"{label} returned tensors of these shapes: {{{listed}}}")
        nones = [k for k, b in mine.items() if b.kind == "none"]
        if nones:
            parts.append(f"{label} returned None (a missing return?) for: {nones}")
        types = {k: b.detail for k, b in mine.items() if b.kind == "type"}
        if types:
            parts.append(f"{label} returned values that are not numbers: {types}")
    wanted = (
        "one number (a number or a one-element tensor)" if one_number else "a number or a tensor"
    )
    message = f"{where} must reduce each parameter to {wanted}; " + "; ".join(parts)
    if all(b.kind == "type" for b in bad.values()):
        return TypeError(message)
    return ValueError(message)


def reduce_weights(
    model: nn.Module,
    how_to_log: Callable[[torch.Tensor], Any]
    | Mapping[str, Callable[[torch.Tensor], Any]]
    | None = None,
    one_number: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, BadReturn]]:
    """:func:`weights_to_log`, without raising when a callable returns anything but one number.

    For callers that must agree across ranks before raising (each rank sees its own shards).

    Args:
        model: as for :func:`weights_to_log`.
        how_to_log: as for :func:`weights_to_log`.
        one_number: whether a tensor of several numbers (or none) counts as a bad return.

    Returns:
        ``(values, bad)``: the values of :func:`weights_to_log` for the keys whose callable
        returned one number, and ``{key: BadReturn}`` for the others (see
        :func:`bad_return_error`).

    Raises:
        KeyError: When ``how_to_log`` names an unknown parameter (message lists close names).
        TypeError: When ``how_to_log`` is neither callable, a mapping nor None.
    """
    tensors = model_tensors(model)
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
    bad: dict[str, BadReturn] = {}
    for name, fn in selection:
        key = f"model/{_fn_name(fn)}/{name}"
        if key in values:
            out[key] = values[key]
            continue
        tensor = tensors[name][0]
        info = shard_info(tensor)
        if info.replicated:
            pieces = {key: tensor.detach()}
        elif len(info.shards) == 1:
            pieces = {f"{key}/rank{rank}": info.shards[0].tensor}
        else:
            pieces = {f"{key}/rank{rank}/shard{i}": s.tensor for i, s in enumerate(info.shards)}
        for piece_key, piece in pieces.items():
            result = _as_number(fn, piece, one_number)
            if isinstance(result, BadReturn):
                bad[piece_key] = result
            else:
                out[piece_key] = result
    return out, bad


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
    A callable returns a number or a tensor (several numbers are kept, as a tensor).

    Args:
        model: A plain model or a ``DistributedModelParallel`` (possibly inside another module).
        how_to_log: One callable for every parameter; or ``{parameter name: callable}`` for just
            those parameters (names as in the unwrapped model); None means :func:`l2_norm`.

    Returns:
        ``{"model/{fn.__name__}/{parameter name}[/rank{r}]": value}``; built-in norms are 0-dim
        float32 CPU tensors.

    Raises:
        KeyError: When ``how_to_log`` names an unknown parameter (message lists close names).
        TypeError: When ``how_to_log`` is neither callable, a mapping nor None; or when a
            callable returns something that is not a number (e.g. a ``str``), naming the callable
            and the parameters. Raised on this rank only, after the collectives.
        ValueError: When a callable returns None (naming the callable and the parameters; on
            this rank only, after the collectives).
    """
    out, bad = reduce_weights(model, how_to_log, one_number=False)
    if bad:
        raise bad_return_error(bad, one_number=False)
    return out
