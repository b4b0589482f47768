"""Tables given an optimizer of their own with ``apply_optimizer_in_backward``.

The TorchRec tutorial gives tables their optimizer this way, before
``DistributedModelParallel``: ``apply_optimizer_in_backward(torch.optim.SGD,
ebc.parameters(), {"lr": 0.02})``. TorchRec then builds such a table's fused kernel with the
parameter's optimizer and settings, over the sharders' ``fused_params``
(``TorchRecStrategy(fused_params=...)`` applies to the other tables only). What this module
makes hold under the strategy:

* the optimizer must be one TorchRec fuses and, on CPU, one fbgemm's CPU kernels implement:
  checked before planning, on every rank, naming the table (TorchRec raised ``Cannot cast ...
  to an EmbOptimType`` naming no table, and fbgemm an ``AssertionError`` inside
  ``DistributedModelParallel`` on the ranks holding the table only);
* such tables are planned on fused kernels only. On a data-parallel (dense kernel) table the
  in-backward optimizer was dropped without a word and the dense optimizer trained the table;
  an explicit plan doing that is refused, naming the table;
* when ``fused_params`` were given, or some tables have no optimizer of their own, one warning
  says which tables train with which optimizer;
* the planner's memory estimate counts the fused optimizer's state of every table (TorchRec's
  counts it only for tables with an in-backward optimizer).

Learning rates that differ between tables are kept per table by checkpoints
(:mod:`lightning_torchrec.checkpoint.hyper_params`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torchrec.optim as trec_optim
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

from lightning_torchrec.compat.fused import in_backward_optimizers
from lightning_torchrec.sharding.setup_checks import CPU_FUSED_OPTIMIZERS
from lightning_torchrec.sharding.sharders import FUSED_KERNELS
from lightning_torchrec.sharding.tables import embedding_tables, table_of_key

#: What TorchRec fuses into its embedding kernels (``optimizer_type_to_emb_opt_type``).
FUSABLE = (
    "torch.optim.SGD, Adagrad or Adam, or torchrec.optim's SGD, Adagrad, RowWiseAdagrad, Adam, "
    "PartialRowWiseAdam, LarsSGD, LAMB or PartialRowWiseLAMB"
)
CPU_FUSABLE = "torch.optim.SGD, torch.optim.Adagrad or torchrec.optim.RowWiseAdagrad"
#: The fused kernels' optimizers that apply a momentum (the others ignore one).
_MOMENTUM_KINDS = {EmbOptimType.LARS_SGD.value}
DATA_PARALLEL = ShardingType.DATA_PARALLEL.value
_SHARDING_TYPES = [t.value for t in ShardingType]

#: The optimizer class whose state TorchRec's storage estimate sizes like each fused optimizer's.
_ESTIMATE_AS: dict[EmbOptimType, type] = {
    EmbOptimType.EXACT_SGD: torch.optim.SGD,
    EmbOptimType.EXACT_ADAGRAD: torch.optim.Adagrad,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: trec_optim.RowWiseAdagrad,
    EmbOptimType.ADAM: torch.optim.Adam,
    EmbOptimType.PARTIAL_ROWWISE_ADAM: trec_optim.PartialRowWiseAdam,
}


@dataclasses.dataclass(frozen=True)
class TableOptimizer:
    """The optimizer a table was given with ``apply_optimizer_in_backward``.

    Attributes:
        table: the table's name.
        optimizer: the optimizer class.
        kwargs: its settings (``{"lr": 0.02}``).
    """

    table: str
    optimizer: type
    kwargs: dict[str, Any]

    def describe(self) -> str:
        """E.g. ``SGD(lr=0.02)``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.optimizer.__name__}({args})"


def table_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every table parameter of an unsharded model, by table name.

    Args:
        model: the unsharded model (tables may be on the meta device).

    Returns:
        ``{table name: weight}`` in model order.
    """
    found: dict[str, nn.Parameter] = {}
    for key, param in embedding_tables(model).items():
        found.setdefault(table_of_key(key), param)
    return found


def table_optimizers(model: nn.Module) -> dict[str, TableOptimizer]:
    """The tables of ``model`` that have an in-backward optimizer of their own.

    Args:
        model: the unsharded model.

    Returns:
        ``{table name: its optimizer}``; empty when no table has one.

    Raises:
        ValueError: for a table given more than one (a fused kernel applies one).
    """
    found = {}
    for table, param in table_parameters(model).items():
        given = in_backward_optimizers(param)
        if len(given) > 1:
            names = [cls.__name__ for cls, _ in given]
            raise ValueError(
                f"Table {table!r} was given {len(given)} optimizers with "
                f"apply_optimizer_in_backward ({names}); its fused kernel applies one. Give "
                "each table one optimizer."
            )
        if given:
            found[table] = TableOptimizer(table, *given[0])
    return found


def check_table_optimizers(found: dict[str, TableOptimizer], compute_device: str) -> None:
    """Refuses in-backward optimizers TorchRec cannot fuse, or the device's kernels cannot run.

    Args:
        found: from :func:`table_optimizers`.
        compute_device: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: naming the table, its optimizer and the ones that work.
    """
    for t in found.values():
        try:
            kind = optimizer_type_to_emb_opt_type(t.optimizer)
        except ValueError:
            raise ValueError(
                f"Table {t.table!r} was given {t.describe()} with apply_optimizer_in_backward, "
                f"which TorchRec cannot fuse into its embedding kernels; use {FUSABLE}."
            ) from None
        if compute_device == "cpu" and kind is not None and kind.value not in CPU_FUSED_OPTIMIZERS:
            raise ValueError(
                f"Table {t.table!r} was given {t.describe()} with apply_optimizer_in_backward "
                f"(fused as {kind.value}), which fbgemm's CPU kernels do not implement; on CPU "
                f"use {CPU_FUSABLE}."
            )
        problem = _settings_problem(t, getattr(kind, "value", ""))
        if problem:
            raise ValueError(
                f"Table {t.table!r} was given {t.describe()} with apply_optimizer_in_backward: "
                f"{problem}. Its fused kernel applies the learning rate (and eps); leave the "
                "other settings out, or let the dense optimizer train the table."
            )


def _settings_problem(t: TableOptimizer, kind: str) -> str:
    """What of an in-backward optimizer's settings its fused kernel rejects or ignores."""
    # TorchRec passes every setting on to fbgemm's kernel, which fails on those it does not take.
    taken = set(inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters)
    rejected = sorted(k for k in t.kwargs if k != "lr" and k not in taken)
    if rejected:
        return f"fbgemm's embedding kernels take no {rejected} (even at their defaults)"
    defaults = {
        k: p.default
        for k, p in inspect.signature(t.optimizer.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    ignored = []
    for key in ("momentum", "weight_decay"):
        value = t.kwargs.get(key, defaults.get(key, 0))
        if value in (0, None, defaults.get(key, 0)):
            continue
        if key == "momentum" and kind not in _MOMENTUM_KINDS:
            ignored.append(f"{key}={value!r}")
        if key == "weight_decay" and "weight_decay_mode" not in t.kwargs:
            ignored.append(f"{key}={value!r} (without a weight_decay_mode)")
    return f"its fused kernel ignores {', '.join(ignored)}" if ignored else ""


def fused_constraints(
    constraints: dict[str, ParameterConstraints] | None, found: dict[str, TableOptimizer]
) -> dict[str, ParameterConstraints] | None:
    """Planner constraints that keep tables with their own optimizer on fused kernels.

    A data-parallel table runs on the dense kernel, which drops the in-backward optimizer.
    A user's own ``compute_kernels`` and ``sharding_types`` are narrowed, never widened.

    Args:
        constraints: the constraints to plan with.
        found: from :func:`table_optimizers`.

    Returns:
        The constraints (``constraints`` itself when no table has its own optimizer).

    Raises:
        ValueError: naming a table whose constraints allow no fused kernel.
    """
    if not found:
        return constraints
    out = dict(constraints or {})
    for table, t in found.items():
        given = out.get(table)
        asked = list(given.compute_kernels or []) if given is not None else []
        kept = [k for k in asked or sorted(FUSED_KERNELS) if k in FUSED_KERNELS]
        types = list(given.sharding_types or []) if given is not None else []
        model_parallel = [x for x in types or _SHARDING_TYPES if x != DATA_PARALLEL]
        if not kept or not model_parallel:
            allowed = f"compute kernels {asked}" if not kept else "data_parallel sharding only"
            raise ValueError(
                f"Table {table!r} was given {t.describe()} with apply_optimizer_in_backward, "
                f"which only a fused kernel applies, but its constraints allow {allowed}. "
                "Allow a fused kernel (e.g. ParameterConstraints(compute_kernels=['fused'])), "
                "or remove the in-backward optimizer and let the dense optimizer train it."
            )
        out[table] = (
            dataclasses.replace(given, compute_kernels=kept, sharding_types=model_parallel)
            if given is not None
            else ParameterConstraints(compute_kernels=kept, sharding_types=model_parallel)
        )
    return out


def check_plan_kernels(plan: ShardingPlan, found: dict[str, TableOptimizer]) -> None:
    """Refuses a plan that puts a table with its own optimizer on a non-fused kernel.

    Args:
        plan: the plan.
        found: from :func:`table_optimizers`.

    Raises:
        ValueError: naming the table, its kernel and its optimizer.
    """
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            kernel = sharding.compute_kernel
            if table in found and kernel not in FUSED_KERNELS:
                raise ValueError(
                    f"The plan puts table {table!r} on the {kernel!r} kernel "
                    f"({sharding.sharding_type}), which would drop the optimizer it was given "
                    f"with apply_optimizer_in_backward ({found[table].describe()}) and train it "
                    "with the dense optimizer. Plan it on a fused kernel."
                )


def precedence_note(
    found: dict[str, TableOptimizer], tables: list[str], fused_params: dict[str, Any] | None
) -> str | None:
    """Which tables train with their own optimizer and which with ``fused_params``.

    Args:
        found: from :func:`table_optimizers`.
        tables: every table of the model.
        fused_params: the strategy's ``fused_params`` as the user gave them (None: defaults).

    Returns:
        The note, or None when there is nothing to say (no table has its own optimizer, or
        every table does and no ``fused_params`` were given).
    """
    others = [t for t in tables if t not in found]
    if not found or (fused_params is None and not others):
        return None
    own = "; ".join(f"{t!r}: {o.describe()}" for t, o in found.items())
    note = (
        f"Tables given their own optimizer with apply_optimizer_in_backward train with it: {own}."
    )
    if fused_params is not None:
        note += (
            " It wins over TorchRecStrategy(fused_params=...) (TorchRec's precedence), which "
            f"applies to the other tables only: {others}."
        )
    else:
        note += f" The other tables {others} train with the strategy's fused_params."
    return note


def estimate_classes(
    model: nn.Module, found: dict[str, TableOptimizer], sharders: list[Any]
) -> dict[nn.Parameter, type]:
    """For the planner's estimate: the optimizer class each other table's state is sized as.

    Args:
        model: the unsharded model.
        found: from :func:`table_optimizers`.
        sharders: the sharders (their ``fused_params["optimizer"]``).

    Returns:
        ``{table parameter: optimizer class}`` for the tables without an optimizer of their own
        (empty when the sharders name no optimizer the estimate knows).
    """
    kinds = [(getattr(s, "fused_params", None) or {}).get("optimizer") for s in sharders]
    cls = next((_ESTIMATE_AS[k] for k in kinds if k in _ESTIMATE_AS), None)
    if cls is None:
        return {}
    return {p: cls for t, p in table_parameters(model).items() if t not in found}
