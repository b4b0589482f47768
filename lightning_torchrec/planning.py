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
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, data_type_to_dtype

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
        lines += [f"| {r} | {human_bytes(b)} |" for r, b in enumerate(self.bytes_per_rank)]
        return "\n".join(lines)


def human_bytes(n: int) -> str:
    """``n`` bytes for people, e.g. ``2.4 MiB``.

    Args:
        n: a byte count.

    Returns:
        The text.
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def table_configs(model: nn.Module, module_path: str) -> dict[str, BaseEmbeddingConfig]:
    """The table configs of the embedding module at ``module_path`` (``""``: ``model``).

    Args:
        model: the unsharded model.
        module_path: a submodule path, as in a sharding plan.

    Returns:
        ``{table name: config}``; empty for a module without table configs.
    """
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
        configs = table_configs(model, module_path)
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

    from lightning_torchrec.checks import explain_planner_error

    def plan_or_message() -> Any:
        try:
            return planner.plan(model, sharders)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            return ("error", explain_planner_error(e, model, topology))

    result = invoke_on_rank_and_broadcast_result(pg, 0, plan_or_message)
    if isinstance(result, tuple) and result and result[0] == "error":
        raise ValueError(result[1])
    return result


def log_plan(summary: PlanSummary, trainer: Any) -> None:
    """Prints the plan and writes it to the loggers (TensorBoard text, ``sharding_plan.md``).

    Call on rank 0.

    Args:
        summary: the plan summary.
        trainer: the Trainer, for its loggers.
    """
    from pathlib import Path

    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    text = summary.to_markdown()
    rank_zero_info(f"TorchRec sharding plan ({summary.world_size} ranks):\n{text}")
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("torchrec/sharding_plan", text, global_step=0)
        log_dir = getattr(logger, "log_dir", None)
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "sharding_plan.md").write_text(text + "\n")
