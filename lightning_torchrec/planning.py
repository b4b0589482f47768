"""Sharding plans: topology from the Trainer, sharders with fused params, checks, summaries."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.types import (
    KernelConfig,
    ParameterConstraints,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, data_type_to_dtype

#: Sharding types that need CUDA: gloo has no reduce-scatter for row-wise output dist.
CUDA_ONLY_SHARDING_TYPES = frozenset({"row_wise", "table_row_wise", "grid_shard"})
#: Compute kernels whose tables are updated in the backward pass by a fused optimizer.
FUSED_KERNELS = frozenset({"fused", "fused_uvm", "fused_uvm_caching", "key_value"})


def default_fused_params() -> dict[str, Any]:
    """Fused embedding optimizer settings that train recommendation tables well.

    Returns:
        Row-wise Adagrad with learning rate 0.01 (one accumulator per row: small state, robust
        to the skewed id frequencies of click data).
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01, "eps": 1e-8}


def resolve_fused_params(fused_params: dict[str, Any] | None) -> dict[str, Any]:
    """User fused params over the defaults; ``optimizer`` may be given by name.

    Args:
        fused_params: e.g. ``{"learning_rate": 0.1}`` or
            ``{"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.1}``.

    Returns:
        Complete fused params.

    Raises:
        ValueError: for an unknown optimizer name, listing the known ones.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    params = {**default_fused_params(), **(fused_params or {})}
    opt = params["optimizer"]
    if isinstance(opt, str):
        by_name = {o.value: o for o in EmbOptimType} | {o.name.lower(): o for o in EmbOptimType}
        if opt.lower() not in by_name:
            raise ValueError(
                f"Unknown fused optimizer {opt!r}; known: {sorted(o.value for o in EmbOptimType)}"
            )
        params["optimizer"] = by_name[opt.lower()]
    return params


def default_sharders(fused_params: dict[str, Any] | None) -> list[ModuleSharder[nn.Module]]:
    """Sharders for ``EmbeddingBagCollection`` and ``EmbeddingCollection`` with fused params.

    Args:
        fused_params: fused optimizer settings (``optimizer``, ``learning_rate``, ...), merged
            over :func:`default_fused_params`.

    Returns:
        The sharders.
    """
    params = resolve_fused_params(fused_params)
    return [
        EmbeddingBagCollectionSharder(fused_params=params),  # type: ignore[list-item]
        EmbeddingCollectionSharder(fused_params=params),  # type: ignore[list-item]
    ]


def make_topology(
    world_size: int,
    local_world_size: int,
    compute_device: str,
    **trainer_config: Any,
) -> Topology:
    """A planner ``Topology`` for the Trainer's processes.

    Lightning's launcher does not set ``LOCAL_WORLD_SIZE``; without it TorchRec assumes 8 local
    devices, so it is passed explicitly.

    Args:
        world_size: total number of processes.
        local_world_size: processes per node.
        compute_device: ``"cpu"`` or ``"cuda"``.
        **trainer_config: further ``TrainerConfig`` fields (e.g. ``hbm_cap_bytes``).

    Returns:
        The topology.
    """
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=world_size, local_world_size=local_world_size, **trainer_config
        ),
        kernel_config=KernelConfig(compute_device=compute_device),
    )


def check_constraints_for_device(
    constraints: dict[str, ParameterConstraints] | None, compute_device: str
) -> None:
    """Refuses sharding types the compute device cannot run.

    Args:
        constraints: per-table planner constraints.
        compute_device: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: naming the table, when a CUDA-only type is the only choice on CPU.
    """
    if compute_device == "cuda" or not constraints:
        return
    for table, c in constraints.items():
        types = set(c.sharding_types or ())
        if types and types <= CUDA_ONLY_SHARDING_TYPES:
            raise ValueError(
                f"Table {table!r} is constrained to {sorted(types)} sharding, which needs CUDA "
                "(gloo has no reduce-scatter). On CPU use table_wise, column_wise, "
                "table_column_wise or data_parallel, e.g. "
                "ParameterConstraints(sharding_types=['table_wise'])."
            )


def embedding_table_names(model: nn.Module) -> list[str]:
    """Names of every table of the TorchRec embedding modules in ``model`` (unsharded).

    Args:
        model: a model holding ``EmbeddingBagCollection``/``EmbeddingCollection`` modules.

    Returns:
        The table names, in module order.
    """
    names: list[str] = []
    for module in model.modules():
        getter = getattr(module, "embedding_bag_configs", None) or getattr(
            module, "embedding_configs", None
        )
        if callable(getter):
            names.extend(c.name for c in getter())
    return names


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
    import difflib

    tables = embedding_table_names(model)
    unknown = sorted(set(constraints) - set(tables))
    if unknown:
        hints = {u: difflib.get_close_matches(u, tables, n=3) for u in unknown}
        raise ValueError(
            f"`constraints` name tables the model does not have: {unknown} "
            f"(closest: {hints}). The model's tables are {tables}."
        )


def check_plan(plan: ShardingPlan, world_size: int, compute_device: str) -> None:
    """Refuses a plan that cannot run on this world size and device.

    Args:
        plan: the sharding plan.
        world_size: number of processes.
        compute_device: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: naming the table, for CUDA-only sharding types on CPU or ranks outside the
            world.
    """
    for module_path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():  # type: ignore[attr-defined]
            where = f"table {table!r} of module {module_path!r}"
            if compute_device != "cuda" and ps.sharding_type in CUDA_ONLY_SHARDING_TYPES:
                raise ValueError(
                    f"The plan shards {where} {ps.sharding_type}, which needs CUDA (gloo has no "
                    "reduce-scatter). On CPU use table_wise, column_wise, table_column_wise or "
                    "data_parallel."
                )
            bad = [r for r in (ps.ranks or []) if not 0 <= r < world_size]
            if bad:
                raise ValueError(
                    f"The plan places {where} on ranks {bad}, but the world has {world_size} "
                    "ranks. Re-plan for this world size, or pass no plan to let the planner plan."
                )


def has_fused_tables(plan: ShardingPlan) -> bool:
    """Whether any table in ``plan`` uses a fused (in-backward) compute kernel.

    Args:
        plan: the sharding plan.

    Returns:
        True when some table is fused.
    """
    return any(
        ps.compute_kernel in FUSED_KERNELS
        for module_plan in plan.plan.values()
        for ps in module_plan.values()  # type: ignore[attr-defined]
    )


@dataclass
class TablePlacement:
    """Where one table went.

    Attributes:
        module: path of the embedding module.
        table: table name.
        sharding_type: e.g. ``table_wise``.
        compute_kernel: e.g. ``fused``.
        ranks: ranks holding a part of it.
        shape: ``(rows, dim)``.
        bytes_per_rank: weight bytes each rank holds.
    """

    module: str
    table: str
    sharding_type: str
    compute_kernel: str
    ranks: list[int]
    shape: tuple[int, int]
    bytes_per_rank: dict[int, int] = field(default_factory=dict)


@dataclass
class PlanSummary:
    """A readable account of a sharding plan.

    Attributes:
        world_size: number of ranks.
        tables: one placement per table.
    """

    world_size: int
    tables: list[TablePlacement]

    @property
    def bytes_per_rank(self) -> list[int]:
        """Table weight bytes per rank (optimizer state not included)."""
        totals = [0] * self.world_size
        for t in self.tables:
            for rank, n in t.bytes_per_rank.items():
                totals[rank] += n
        return totals

    def to_markdown(self) -> str:
        """The plan as a Markdown table, then the bytes per rank.

        Returns:
            Markdown text.
        """
        lines = [
            "| table | module | sharding | kernel | ranks | rows x dim |",
            "|---|---|---|---|---|---|",
        ]
        for t in self.tables:
            ranks = ",".join(map(str, t.ranks))
            lines.append(
                f"| {t.table} | {t.module} | {t.sharding_type} | {t.compute_kernel} | "
                f"{ranks} | {t.shape[0]} x {t.shape[1]} |"
            )
        lines += ["", "| rank | table bytes |", "|---|---|"]
        lines += [f"| {r} | {_human(b)} |" for r, b in enumerate(self.bytes_per_rank)]
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _table_configs(model: nn.Module, module_path: str) -> dict[str, BaseEmbeddingConfig]:
    module = model.get_submodule(module_path) if module_path else model
    getter = getattr(module, "embedding_bag_configs", None) or getattr(
        module, "embedding_configs", None
    )
    return {c.name: c for c in getter()} if getter is not None else {}


def summarize_plan(model: nn.Module, plan: ShardingPlan, world_size: int) -> PlanSummary:
    """Describes ``plan`` for ``model`` (call before sharding; the model may be on meta).

    Args:
        model: the unsharded model the plan was made for.
        plan: its sharding plan.
        world_size: number of ranks.

    Returns:
        The summary.
    """
    tables = []
    for module_path, module_plan in plan.plan.items():
        configs = _table_configs(model, module_path)
        for name, ps in module_plan.items():  # type: ignore[attr-defined]
            cfg = configs.get(name)
            rows, dim = (cfg.num_embeddings, cfg.embedding_dim) if cfg else (0, 0)
            elem = (
                torch.tensor([], dtype=data_type_to_dtype(cfg.data_type)).element_size()
                if cfg
                else 4
            )
            per_rank: dict[int, int] = {}
            spec = ps.sharding_spec
            if spec is not None and hasattr(spec, "shards"):
                for shard in spec.shards:
                    rank = shard.placement.rank()
                    per_rank[rank] = per_rank.get(rank, 0) + math.prod(shard.shard_sizes) * elem
            else:
                for rank in ps.ranks or range(world_size):
                    per_rank[rank] = rows * dim * elem
            tables.append(
                TablePlacement(
                    module=module_path,
                    table=name,
                    sharding_type=ps.sharding_type,
                    compute_kernel=ps.compute_kernel,
                    ranks=sorted(per_rank) if per_rank else list(ps.ranks or []),
                    shape=(rows, dim),
                    bytes_per_rank=per_rank,
                )
            )
    return PlanSummary(world_size=world_size, tables=tables)


def check_plan_matches_model(plan: ShardingPlan, model: nn.Module) -> None:
    """Refuses an explicit plan naming modules or tables the model does not have.

    Args:
        plan: the user's sharding plan.
        model: the unsharded model.

    Raises:
        ValueError: naming the unknown module paths or tables and the model's own.
    """
    for module_path, module_plan in plan.plan.items():
        try:
            configs = _table_configs(model, module_path)
        except AttributeError:
            configs = {}
        unknown = sorted(set(module_plan) - set(configs))  # type: ignore[arg-type]
        if unknown:
            raise ValueError(
                f"The plan shards tables {unknown} of module {module_path!r}, which the model "
                f"does not have (its tables there: {sorted(configs)}; all tables: "
                f"{embedding_table_names(model)}). Re-plan for this model, or pass no plan."
            )


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


def _table_bytes(model: nn.Module) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for module in model.modules():
        getter = getattr(module, "embedding_bag_configs", None) or getattr(
            module, "embedding_configs", None
        )
        if callable(getter):
            for c in getter():
                elem = torch.tensor([], dtype=data_type_to_dtype(c.data_type)).element_size()
                sizes[c.name] = c.num_embeddings * c.embedding_dim * elem
    return sizes


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
    sizes = sorted(_table_bytes(model).items(), key=lambda kv: -kv[1])
    need = sum(b for _, b in sizes)
    largest = ", ".join(f"{t}: {_human(b)}" for t, b in sizes[:3])
    lines = [
        f"Sharding planning failed ({type(error).__name__}). The tables need {_human(need)} "
        f"({need} bytes) for their weights alone, before optimizer state (largest: {largest})."
    ]
    devices = getattr(topology, "devices", None)
    if devices:
        kind = "hbm" if getattr(topology, "compute_device", "cpu") == "cuda" else "ddr"
        caps = [getattr(d.storage, kind) for d in devices]
        lines.append(
            f"Each of the {len(caps)} ranks offers {_human(min(caps))} ({min(caps)} bytes) of "
            f"{kind}, {_human(sum(caps))} in all; the planner also reserves a share for dense "
            "parameters and activations."
        )
    lines.append(
        "Fixes: more ranks, fewer rows (hash ids into smaller tables), a smaller embedding_dim "
        "or data_type=DataType.FP16, or a planner Topology with the real memory (ddr_cap/hbm_cap)."
    )
    lines.append(f"Planner said: {str(error).strip()[:2000]}")
    return "\n".join(lines)


def plan_collectively(
    planner: Any, model: nn.Module, sharders: list[Any], pg: Any, topology: Any = None
) -> ShardingPlan:
    """Plans on rank 0 and broadcasts the plan, or the failure: every rank raises together.

    TorchRec's ``collective_plan`` leaves the other ranks waiting in the broadcast until the
    collective timeout when planning fails on rank 0.

    Args:
        planner: an ``EmbeddingShardingPlanner``.
        model: the unsharded model.
        sharders: the sharders.
        pg: the process group.
        topology: the planner's topology, to explain a failure.

    Returns:
        The plan, the same on every rank.

    Raises:
        ValueError: on every rank when planning failed, with :func:`explain_planner_error`.
    """
    from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result

    def plan_or_message() -> Any:
        try:
            return planner.plan(model, sharders)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            return ("error", explain_planner_error(e, model, topology))

    result = invoke_on_rank_and_broadcast_result(pg, 0, plan_or_message)
    if isinstance(result, tuple) and result and result[0] == "error":
        raise ValueError(result[1])
    return result
