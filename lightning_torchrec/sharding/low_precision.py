"""Tables stored in fp16 or bf16 are planned on fused kernels.

``EmbeddingBagConfig(data_type=DataType.FP16)`` halves a table's memory. On a fused kernel the
table's optimizer state stays fp32 (fbgemm keeps it so) and the table trains well. TorchRec's
planner, though, makes small tables data-parallel, on the dense kernel: the table is then an
ordinary fp16 parameter of the dense optimizer from ``configure_optimizers``. In fp16, Adam's
``eps=1e-8`` and Adagrad's ``1e-10`` round to 0 and small squared gradients underflow, so the
first ``optimizer.step()`` turns the table's rows into NaN and inf (a raw TorchRec loop does the
same: it is PyTorch's optimizers in fp16). What this module makes hold:

* a low-precision table the user did not pin to data-parallel or to a non-fused kernel is
  planned on a fused kernel (its other constraints are narrowed, never widened);
* a plan that still puts one on the dense kernel (the user's constraints, plan or planner asked
  for it) gets one warning naming the tables: a dense optimizer without ``eps`` (SGD) trains
  them, an ``eps`` one does not.
* a bf16 table on CPU is refused before planning, naming it: fbgemm's CPU kernels have no bf16
  forward.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import DataType

from lightning_torchrec.sharding.sharders import FUSED_KERNELS
from lightning_torchrec.sharding.tables import table_configs

#: Table dtypes in which PyTorch's dense optimizers underflow.
LOW_PRECISION = frozenset({DataType.FP16, DataType.BF16})
_DATA_PARALLEL = ShardingType.DATA_PARALLEL.value
_MODEL_PARALLEL = [t.value for t in ShardingType if t.value != _DATA_PARALLEL]


def low_precision_tables(model: nn.Module) -> dict[str, str]:
    """The tables of a model stored in fp16 or bf16.

    Args:
        model: the unsharded model.

    Returns:
        ``{table name: dtype name}`` (e.g. ``{"t_cat_0": "FP16"}``).
    """
    return {
        name: cfg.data_type.name
        for name, cfg in table_configs(model).items()
        if cfg.data_type in LOW_PRECISION
    }


def check_low_precision_for_device(tables: dict[str, str], compute_device: str) -> None:
    """Refuses bf16 tables on CPU, whose embedding kernels (fused and dense) have no bf16 forward.

    Args:
        tables: from :func:`low_precision_tables`.
        compute_device: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: on CPU, naming the bf16 tables (fbgemm fails only at the first forward,
            with ``"split_embedding_cpu_forward_1" not implemented for 'BFloat16'``).
    """
    bf16 = sorted(table for table, dtype in tables.items() if dtype == DataType.BF16.name)
    if compute_device == "cpu" and bf16:
        raise ValueError(
            f"Table(s) {bf16} are stored in bf16 (data_type=DataType.BF16), which fbgemm's CPU "
            "embedding kernels do not implement: their first forward would fail. On CPU store "
            "them in DataType.FP16 or DataType.FP32."
        )


def low_precision_constraints(
    constraints: dict[str, ParameterConstraints] | None, tables: dict[str, str]
) -> dict[str, ParameterConstraints] | None:
    """Planner constraints that keep low-precision tables on fused kernels.

    A table whose constraints allow only data-parallel sharding or only non-fused kernels keeps
    them (the user asked; :func:`dense_low_precision_warning` names it after planning).

    Args:
        constraints: the constraints to plan with.
        tables: from :func:`low_precision_tables`.

    Returns:
        The constraints (``constraints`` itself when there is no low-precision table).
    """
    if not tables:
        return constraints
    out = dict(constraints or {})
    for table in tables:
        given = out.get(table)
        kernels = list(given.compute_kernels or []) if given is not None else []
        types = list(given.sharding_types or []) if given is not None else []
        kept = [k for k in kernels or sorted(FUSED_KERNELS) if k in FUSED_KERNELS]
        model_parallel = [t for t in types or _MODEL_PARALLEL if t != _DATA_PARALLEL]
        if not kept or not model_parallel:
            continue
        out[table] = (
            dataclasses.replace(given, compute_kernels=kept, sharding_types=model_parallel)
            if given is not None
            else ParameterConstraints(compute_kernels=kept, sharding_types=model_parallel)
        )
    return out


def dense_low_precision_warning(plan: ShardingPlan, tables: dict[str, str]) -> str | None:
    """Names the low-precision tables a plan puts on a non-fused kernel.

    Args:
        plan: the plan.
        tables: from :func:`low_precision_tables`.

    Returns:
        The warning's text, or None when every low-precision table is on a fused kernel.
    """
    dense = sorted(
        f"{table!r} ({tables[table]}, {sharding.sharding_type}, kernel {sharding.compute_kernel})"
        for module_plan in plan.plan.values()
        for table, sharding in module_plan.items()  # type: ignore[attr-defined]
        if table in tables and sharding.compute_kernel not in FUSED_KERNELS
    )
    if not dense:
        return None
    return (
        f"The plan puts low-precision table(s) {', '.join(dense)} on a non-fused kernel: the "
        "dense optimizer from configure_optimizers updates them in that precision, where the "
        "eps of Adam, AdamW or Adagrad rounds to 0 and the first step turns their rows into "
        "NaN. Plan them on a fused kernel (which keeps the optimizer state in fp32), train them "
        "with a dense optimizer without eps (SGD), or store them in fp32."
    )
