"""TorchRec's fused embedding optimizers, seen from their parameters and their kernels.

Two places where TorchRec keeps what the package needs under private names:

* ``torchrec.optim.apply_optimizer_in_backward`` (the TorchRec tutorial's way of giving a table
  its optimizer) leaves the optimizer on each parameter as ``_optimizer_classes`` and
  ``_optimizer_kwargs`` (torch 2.0+ through 2.14). TorchRec's sharders read them when they build
  a table's fused kernel (they win over the sharder's ``fused_params``), and its planner's
  storage estimate reads ``_optimizer_classes`` only.
* A fused optimizer's kernel is ``EmbeddingFusedOptimizer._emb_module`` (see
  :func:`~lightning_torchrec.compat.upstream.fused_kernels`); the tables a kernel holds are its
  public ``table_names`` (fbgemm 0.8+; None on kernels built without names).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torchrec.optim.keyed import CombinedOptimizer

from lightning_torchrec.compat.upstream import fused_kernels

__all__ = [
    "estimated_optimizers",
    "fused_groups_by_path",
    "fused_param_groups",
    "in_backward_optimizers",
    "kernel_tables",
    "kernel_values",
]

#: fbgemm's kernels whose update applies ``optimizer_args.momentum``, and those with Adam's betas.
_MOMENTUM_KINDS = {"lars_sgd", "ensemble_row_wise_adagrad", "madgrad"}
_BETAS_KINDS = {"adam", "partial_row_wise_adam", "lamb", "partial_row_wise_lamb"}
_CLASSES = "_optimizer_classes"
_KWARGS = "_optimizer_kwargs"


def in_backward_optimizers(param: Any) -> list[tuple[type, dict[str, Any]]]:
    """The in-backward optimizers ``apply_optimizer_in_backward`` gave a parameter.

    Args:
        param: a parameter (or anything else).

    Returns:
        ``(optimizer class, kwargs)`` pairs, in the order they were applied; empty for none.
    """
    classes = list(getattr(param, _CLASSES, None) or [])
    kwargs = list(getattr(param, _KWARGS, None) or [])
    kwargs += [{}] * (len(classes) - len(kwargs))
    return [(c, dict(k)) for c, k in zip(classes, kwargs, strict=False) if c is not None]


@contextlib.contextmanager
def estimated_optimizers(classes: dict[nn.Parameter, type]) -> Iterator[None]:
    """Shows TorchRec's planner the optimizer each table will train with, while planning.

    TorchRec's storage estimate counts optimizer state only for a parameter that carries
    ``_optimizer_classes``; a table trained by the sharders' ``fused_params`` carries none, so
    its state (Adagrad's: as large as the table) was left out of the plan. The attribute is set
    on the given parameters (which have none) and removed again on exit, before any sharder
    reads it.

    Args:
        classes: ``{parameter: optimizer class}`` for parameters without in-backward optimizers.

    Yields:
        None.
    """
    for param, cls in classes.items():
        setattr(param, _CLASSES, [cls])
    try:
        yield
    finally:
        for param in classes:
            if hasattr(param, _CLASSES):
                delattr(param, _CLASSES)


def kernel_tables(kernel: Any) -> list[str]:
    """The names of the tables a fused kernel (fbgemm TBE) holds.

    Args:
        kernel: the kernel.

    Returns:
        The names (a table sharded column-wise may appear more than once); empty when the
        kernel was built without names.
    """
    return list(getattr(kernel, "table_names", None) or [])


def fused_param_groups(optimizer: Any) -> list[tuple[dict[str, Any], Any]]:
    """Each param group of TorchRec's fused optimizers with the kernel it drives.

    Args:
        optimizer: a keyed optimizer (combined or fused) or anything else.

    Returns:
        ``(param group, fbgemm TBE)`` pairs, in ``param_groups`` order; empty for none.
    """
    return [(group, kernel) for _, group, kernel in fused_groups_by_path(optimizer)]


def fused_groups_by_path(optimizer: Any, path: str = "") -> list[tuple[str, dict[str, Any], Any]]:
    """:func:`fused_param_groups` with the module path each group's optimizer is keyed by.

    TorchRec's combined optimizers key their parts by module path (``""`` within a sharded
    collection); the path of a group joins the keys above it with dots.

    Args:
        optimizer: a keyed optimizer (combined or fused) or anything else.
        path: the path of ``optimizer`` itself.

    Returns:
        ``(path, param group, fbgemm TBE)`` triples, in ``param_groups`` order.
    """
    if isinstance(optimizer, CombinedOptimizer):
        return [
            found
            for key, inner in optimizer.optimizers
            for found in fused_groups_by_path(inner, ".".join(p for p in (path, key) if p))
        ]
    kernels = fused_kernels(optimizer)
    return [(path, group, kernels[0]) for group in optimizer.param_groups] if kernels else []


def kernel_values(kernel: Any) -> dict[str, Any]:
    """An fbgemm TBE's own momentum, betas, weight decay and eps (fixed when TorchRec built it).

    fbgemm keeps a momentum of 0.9 and betas of (0.9, 0.999) in every kernel's arguments, also
    where its update applies none (SGD, Adagrad): there the momentum reads 0.0 (and so does
    ``betas[0]``, which ``LearningRateMonitor`` logs as the momentum). An Adam-family kernel's
    momentum is its ``beta1``.

    Args:
        kernel: the TBE.

    Returns:
        ``{"momentum", "betas", "weight_decay", "eps"}``; empty for a kernel without
        ``optimizer_args``.
    """
    args = getattr(kernel, "optimizer_args", None)
    if args is None:
        return {}
    kind = getattr(getattr(kernel, "optimizer", None), "value", None)
    if kind in _BETAS_KINDS:
        first = float(args.beta1)
    else:
        first = float(args.momentum) if kind in _MOMENTUM_KINDS else 0.0
    return {
        "momentum": first,
        "betas": (first, float(args.beta2)),
        "weight_decay": float(args.weight_decay),
        "eps": float(args.eps),
    }
