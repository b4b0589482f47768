"""Configuration checks run at setup, before any training step; each error says the fix.

Batches are checked per step by :mod:`lightning_torchrec.training.batch_checks`; these check the
configuration once: constraints, plans, fused optimizers, precision and fit settings.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

from lightning_torchrec.sharding.capabilities import (
    missing_collective_note,
    reduce_scatter_types,
)
from lightning_torchrec.sharding.features import managed_input_sizes
from lightning_torchrec.sharding.tables import (
    human_bytes,
    module_table_configs,
    table_bytes,
    table_configs,
)

#: The types of :data:`~lightning_torchrec.sharding.capabilities.REDUCE_SCATTER_SHARDING_TYPES`
#: run on CPU only where the stack's gloo has a reduce-scatter
#: (:func:`~lightning_torchrec.sharding.capabilities.probe_reduce_scatter`), except ``row_wise``
#: for ``EmbeddingCollection`` tables: their sequence output dist is an all-to-all, which every
#: gloo has (trained, checkpointed and resumed on 2 CPU ranks in the tests).
CPU_SEQUENCE_ROW_WISE = "row_wise"
#: What a user may use instead, on a CPU stack without a reduce-scatter.
_CPU_FALLBACK = "table_wise, column_wise, table_column_wise or data_parallel"


def sequence_tables(model: nn.Module | None) -> set[str]:
    """The names of the model's ``EmbeddingCollection`` tables (``EmbeddingConfig``).

    Args:
        model: the unsharded model, or None.

    Returns:
        The table names (empty without a model).
    """
    if model is None:
        return set()
    return {name for name, cfg in table_configs(model).items() if isinstance(cfg, EmbeddingConfig)}


def check_constraints_for_device(
    constraints: dict[str, ParameterConstraints] | None,
    compute_device: str,
    model: nn.Module | None = None,
    *,
    reduce_scatter: bool = False,
) -> None:
    """Refuses sharding types the compute device cannot run.

    Args:
        constraints: per-table planner constraints.
        compute_device: ``"cpu"`` or ``"cuda"``.
        model: the unsharded model, to recognise ``EmbeddingCollection`` tables (which may be
            row-wise on CPU); None treats every table as an ``EmbeddingBagCollection``'s.
        reduce_scatter: whether the process group has a reduce-scatter (then CPU runs every
            type of ``REDUCE_SCATTER_SHARDING_TYPES``).

    Raises:
        ValueError: naming the table, when a reduce-scatter type is the only choice on a CPU
            stack without one.
    """
    refused = reduce_scatter_types(compute_device, reduce_scatter)
    if not refused or not constraints:
        return
    sequence = sequence_tables(model)
    for table, c in constraints.items():
        types = set(c.sharding_types or ())
        if table in sequence:
            types.discard(CPU_SEQUENCE_ROW_WISE)
            if not types:
                continue
        if types and types <= refused:
            raise ValueError(
                f"Table {table!r} is constrained to {sorted(types)} sharding, which "
                f"{missing_collective_note()}. On this CPU stack use {_CPU_FALLBACK}, e.g. "
                "ParameterConstraints(sharding_types=['table_wise'])."
            )


def check_constraints_match_model(
    constraints: dict[str, ParameterConstraints] | None, model: nn.Module
) -> None:
    """Refuses constraints for tables the model does not have (the planner ignores them).

    Args:
        constraints: per-table planner constraints.
        model: the unsharded model.

    Raises:
        ValueError: naming the unknown tables and the closest existing ones.
    """
    if not constraints:
        return

    tables = list(table_configs(model))
    unknown = sorted(set(constraints) - set(tables))
    if unknown:
        hints = {u: difflib.get_close_matches(u, tables, n=3) for u in unknown}
        raise ValueError(
            f"`constraints` name tables the model does not have: {unknown} "
            f"(closest: {hints}). The model's tables are {tables}."
        )


def check_plan(
    plan: ShardingPlan,
    world_size: int,
    compute_device: str,
    model: nn.Module | None = None,
    *,
    reduce_scatter: bool = False,
) -> None:
    """Refuses a plan that cannot run on this world size and device.

    Args:
        plan: the sharding plan.
        world_size: number of processes.
        compute_device: ``"cpu"`` or ``"cuda"``.
        model: the unsharded model, to recognise ``EmbeddingCollection`` tables and towers.
        reduce_scatter: whether the process group has a reduce-scatter.

    Raises:
        ValueError: naming the table, for reduce-scatter sharding types on a CPU stack without
            one, data-parallel ``EmbeddingCollection`` tables on CPU, towers on CPU, or ranks
            outside the world.
    """
    refused = reduce_scatter_types(compute_device, reduce_scatter)
    if model is not None and compute_device != "cuda":
        check_no_towers(plan, model)
    for module_path, module_plan in plan.plan.items():
        configs = module_table_configs(model, module_path) if model is not None else {}
        for table, ps in module_plan.items():  # type: ignore[attr-defined]
            where = f"table {table!r} of module {module_path!r}"
            sequence = isinstance(configs.get(table), EmbeddingConfig)
            if compute_device != "cuda" and sequence and ps.sharding_type == "data_parallel":
                raise ValueError(
                    f"The plan shards {where} (an EmbeddingCollection table) data_parallel, "
                    "which TorchRec cannot run on CPU (its data-parallel sequence lookup fails in "
                    "split_with_sizes). Use table_wise, column_wise or table_column_wise."
                )
            row_wise_sequence = sequence and ps.sharding_type == CPU_SEQUENCE_ROW_WISE
            if ps.sharding_type in refused and not row_wise_sequence:
                raise ValueError(
                    f"The plan shards {where} {ps.sharding_type}, which "
                    f"{missing_collective_note()}. On this CPU stack use {_CPU_FALLBACK}."
                )
            bad = [r for r in (ps.ranks or []) if not 0 <= r < world_size]
            if bad:
                raise ValueError(
                    f"The plan places {where} on ranks {bad}, but the world has {world_size} "
                    "ranks. Re-plan for this world size, or pass no plan to let the planner plan."
                )


def check_no_towers(plan: ShardingPlan, model: nn.Module) -> None:
    """Refuses TorchRec's tower sharding on CPU, naming the tower.

    TorchRec's tower sharders wrap each tower's interaction in
    ``DistributedDataParallel(device_ids=[device])``, which DDP refuses for a CPU module.

    Args:
        plan: the sharding plan.
        model: the unsharded model.

    Raises:
        ValueError: naming the first module the plan shards as a tower.
    """
    for module_path in plan.plan:
        try:
            module = model.get_submodule(module_path)
        except AttributeError:
            continue  # check_plan_matches_model names unknown modules
        if isinstance(module, (EmbeddingTower, EmbeddingTowerCollection)):
            raise ValueError(
                f"The plan shards {module_path!r} as a {type(module).__name__}, which needs "
                "CUDA: TorchRec's tower sharders wrap each tower's interaction in "
                "DistributedDataParallel(device_ids=[device]), which DDP refuses on CPU. On CPU "
                "leave out EmbeddingTowerSharder/EmbeddingTowerCollectionSharder, so the tables "
                "inside the towers are sharded as plain embedding collections."
            )


def check_plan_matches_model(plan: ShardingPlan, model: nn.Module) -> None:
    """Refuses an explicit plan naming modules or tables the model does not have.

    Args:
        plan: the user's sharding plan.
        model: the unsharded model.

    Raises:
        ValueError: naming the unknown module paths or tables and the model's own.
    """
    for module_path, module_plan in plan.plan.items():
        configs = module_table_configs(model, module_path)
        unknown = sorted(set(module_plan) - set(configs))  # type: ignore[arg-type]
        if unknown:
            raise ValueError(
                f"The plan shards tables {unknown} of module {module_path!r}, which the model "
                f"does not have (its tables there: {sorted(configs)}; all tables: "
                f"{list(table_configs(model))}). Re-plan for this model, or pass no plan."
            )


#: Sharding types each kind of table can run on any CPU stack (TorchRec's data-parallel sequence
#: lookup fails on CPU). The planner is offered these; an ``EmbeddingCollection`` table may also
#: be constrained to ``row_wise`` explicitly.
CPU_SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise", "data_parallel")
CPU_SEQUENCE_SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise")
#: Accepted for bag tables too where the group has a reduce-scatter, when asked for (constraints
#: or a plan), as TorchRec's CPU sharder does not offer them itself: the default plan stays
#: TorchRec's. A managed-collision bag table, which TorchRec shards row-wise only, is offered
#: ``row_wise`` there.
CPU_REDUCE_SCATTER_TYPES = ("row_wise", "table_row_wise", "grid_shard")


def device_constraints(
    model: nn.Module,
    constraints: dict[str, ParameterConstraints] | None,
    compute_device: str,
    *,
    reduce_scatter: bool = False,
) -> dict[str, ParameterConstraints] | None:
    """Planner constraints that keep every table to sharding types the device can run.

    On CPU, the planner would otherwise pick row-wise types (e.g. for every
    ``EmbeddingCollection`` table) that the strategy must then refuse. A user's own
    ``sharding_types`` are narrowed, never widened.

    Args:
        model: the unsharded model.
        constraints: the user's per-table constraints.
        compute_device: ``"cpu"`` or ``"cuda"``.
        reduce_scatter: whether the process group has a reduce-scatter: then bag tables may
            ask for ``row_wise``, ``table_row_wise`` and ``grid_shard``, and managed-collision
            bag tables are offered ``row_wise``.

    Returns:
        The constraints to plan with (``constraints`` itself on CUDA).

    Raises:
        ValueError: naming a table whose constraints leave no type the device can run.
    """
    if compute_device == "cuda":
        return constraints
    out = dict(constraints or {})
    managed = set(managed_input_sizes(model)) if reduce_scatter else set()
    for name, cfg in table_configs(model).items():
        sequence = isinstance(cfg, EmbeddingConfig)
        allowed = CPU_SEQUENCE_SHARDING_TYPES if sequence else CPU_SHARDING_TYPES
        if name in managed and not sequence:
            allowed = (*allowed, "row_wise")
        given = out.get(name)
        wanted = list(given.sharding_types or allowed) if given is not None else list(allowed)
        asked = given is not None and given.sharding_types is not None
        if sequence:
            accepted = (*allowed, CPU_SEQUENCE_ROW_WISE) if asked else allowed
        else:
            extra = CPU_REDUCE_SCATTER_TYPES if asked and reduce_scatter else ()
            accepted = (*allowed, *extra)
        kept = [t for t in wanted if t in accepted]
        if not kept:
            raise ValueError(
                f"Table {name!r} is constrained to {sorted(wanted)} sharding, which cannot run on "
                f"CPU for this table; use one of {list(allowed)}."
            )
        out[name] = (
            dataclasses.replace(given, sharding_types=kept)
            if given is not None
            else ParameterConstraints(sharding_types=kept)
        )
    return out


#: Fused optimizers fbgemm's CPU kernels implement (others fail deep inside DMP construction).
CPU_FUSED_OPTIMIZERS = frozenset(
    {"exact_sgd", "exact_adagrad", "exact_row_wise_adagrad", "ema_in_place_row_wise_adagrad"}
)


def check_fused_optimizer_for_device(sharders: list[Any], compute_device: str) -> None:
    """Refuses fused optimizers that the device's embedding kernels do not implement.

    Args:
        sharders: the sharders (their ``fused_params["optimizer"]`` is checked).
        compute_device: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: naming the optimizer and the supported ones (fbgemm would only fail with
            an ``AssertionError`` while building the sharded model).
    """
    if compute_device == "cuda":
        return
    for sharder in sharders:
        opt = (getattr(sharder, "fused_params", None) or {}).get("optimizer")
        name = getattr(opt, "value", opt)
        if isinstance(name, str) and name.lower() not in CPU_FUSED_OPTIMIZERS:
            raise ValueError(
                f"Fused embedding optimizer {name!r} (in {type(sharder).__name__}) is not "
                f"supported on CPU; use one of {sorted(CPU_FUSED_OPTIMIZERS)}, e.g. "
                "TorchRecStrategy(fused_params={'optimizer': 'exact_row_wise_adagrad'}). ADAM "
                "and the partial row-wise variants need CUDA."
            )


def explain_planner_error(error: BaseException, model: nn.Module, topology: Any) -> str:
    """Explains a planner failure with the bytes the tables need and the devices offer.

    Args:
        error: what the planner raised.
        model: the unsharded model.
        topology: the planner's ``Topology`` (None when unknown).

    Returns:
        A message with the weight bytes per table (largest first), the capacity per rank and
        the usual fixes, then the planner's own message.
    """
    sizes = sorted(
        ((n, table_bytes(c)) for n, c in table_configs(model).items()), key=lambda kv: -kv[1]
    )
    need = sum(b for _, b in sizes)
    largest = ", ".join(f"{t}: {human_bytes(b)}" for t, b in sizes[:3])
    lines = [
        f"Sharding planning failed ({type(error).__name__}). The tables need {human_bytes(need)} "
        f"({need} bytes) for their weights alone, before optimizer state (largest: {largest})."
    ]
    devices = getattr(topology, "devices", None)
    if devices:
        kind = "hbm" if getattr(topology, "compute_device", "cpu") == "cuda" else "ddr"
        caps = [getattr(d.storage, kind) for d in devices]
        lines.append(
            f"Each of the {len(caps)} ranks offers {human_bytes(min(caps))} ({min(caps)} bytes) of "
            f"{kind}, {human_bytes(sum(caps))} in all; the planner also reserves a share for dense "
            "parameters and activations."
        )
    lines.append(
        "Fixes: more ranks, fewer rows (hash ids into smaller tables), a smaller embedding_dim "
        "or data_type=DataType.FP16, or a planner Topology with the real memory (ddr_cap/hbm_cap)."
    )
    lines.append(f"Planner said: {str(error).strip()[:2000]}")
    return "\n".join(lines)


def warn_materialized(tables: dict[str, torch.Tensor]) -> None:
    """Warns that tables were built whole on every rank instead of on the meta device.

    Args:
        tables: from :func:`lightning_torchrec.sharding.tables.materialized_tables`.
    """
    if tables:
        size = sum(t.numel() * t.element_size() for t in tables.values())
        rank_zero_warn(
            f"{len(tables)} embedding tables ({human_bytes(size)}) were built whole on every "
            "rank before sharding; their values are copied into the shards. Build them on the "
            "meta device (EmbeddingBagCollection(..., device=torch.device('meta'))) so no rank "
            "ever holds a table it does not own."
        )
