"""Sharding plans and the ONE place that builds ``DistributedModelParallel``.

:func:`shard_model` runs the configuration checks, plans on rank 0 (one plan for every rank;
a planning failure is raised on every rank), wraps the model in ``DistributedModelParallel`` and
keeps the values of tables that were built whole, and makes every sharded embedding module
return its outputs in the unsharded module's key order
(:mod:`lightning_torchrec.sharding.key_order`), so a model computes the same function under every
plan and world size. ``TorchRecStrategy`` and :func:`maybe_shard_model` both call it, so both get
the same default sharders (TorchRec's, with the fused optimizer of
:func:`~lightning_torchrec.sharding.sharders.default_fused_params`), topology and checks.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import (
    ParameterConstraints,
)
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan

from lightning_torchrec.compat.fused import estimated_optimizers, fused_param_groups, kernel_tables
from lightning_torchrec.compat.upstream import planner_topology
from lightning_torchrec.distributed import broadcast_from_rank0
from lightning_torchrec.sharding.capabilities import probe_reduce_scatter
from lightning_torchrec.sharding.features import FeatureSpec, feature_specs
from lightning_torchrec.sharding.key_order import keep_key_order
from lightning_torchrec.sharding.layout import copy_into_shards
from lightning_torchrec.sharding.low_precision import (
    check_low_precision_for_device,
    dense_low_precision_warning,
    low_precision_constraints,
    low_precision_tables,
)
from lightning_torchrec.sharding.nodes import local_world_size_env, resolve_local_world_size
from lightning_torchrec.sharding.plan_summary import PlanSummary, summarize_plan
from lightning_torchrec.sharding.planner import (
    make_planner,
    make_topology,
)
from lightning_torchrec.sharding.reuse import attach, check_reusable, recorded
from lightning_torchrec.sharding.setup_checks import (
    check_constraints_for_device,
    check_constraints_match_model,
    check_fused_optimizer_for_device,
    check_plan,
    check_plan_matches_model,
    device_constraints,
    explain_planner_error,
    warn_materialized,
)
from lightning_torchrec.sharding.sharders import default_sharders
from lightning_torchrec.sharding.table_optimizers import (
    check_plan_kernels,
    check_table_optimizers,
    estimate_classes,
    fused_constraints,
    precedence_note,
    table_optimizers,
)
from lightning_torchrec.sharding.tables import (
    dense_width,
    embedding_modules,
    embedding_tables,
    materialized_tables,
    table_configs,
    unwrap,
)

logger = logging.getLogger(__name__)


def plan_collectively(
    planner: Any, model: nn.Module, sharders: list[Any], topology: Any = None
) -> ShardingPlan:
    """Plans on rank 0 and gives the plan to every rank; a failure is raised on every rank.

    TorchRec's ``collective_plan`` leaves the other ranks waiting in the broadcast until the
    collective timeout when planning fails on rank 0.

    Args:
        planner: an ``EmbeddingShardingPlanner``.
        model: the unsharded model.
        sharders: the sharders.
        topology: the planner's topology, to explain a failure.

    Returns:
        The plan, the same on every rank.

    Raises:
        ValueError: on every rank when planning failed, with the bytes needed and offered.
    """

    def plan() -> ShardingPlan:
        try:
            return planner.plan(model, sharders)
        except Exception as e:
            raise ValueError(explain_planner_error(e, model, topology)) from e

    return broadcast_from_rank0(plan)


@dataclass(frozen=True)
class ShardingConfig:
    """How to shard: the arguments of :func:`shard_model`, checked once.

    Attributes:
        sharders: TorchRec sharders; None: :func:`default_sharders` with ``fused_params``.
        plan: a ready ``ShardingPlan``; skips planning.
        constraints: ``{table name: ParameterConstraints}`` for the planner.
        fused_params: fused embedding optimizer settings for the default sharders.
        planner: a planner to use instead of :func:`make_planner`'s.

    Raises:
        ValueError: for ``sharders`` with ``fused_params``, or ``plan`` with ``constraints`` or
            ``planner``.
    """

    sharders: list[ModuleSharder[nn.Module]] | None = None
    plan: ShardingPlan | None = None
    constraints: dict[str, ParameterConstraints] | None = None
    fused_params: dict[str, Any] | None = None
    planner: EmbeddingShardingPlanner | None = None

    def __post_init__(self) -> None:
        if self.sharders is not None and self.fused_params is not None:
            raise ValueError(
                "Pass `fused_params` to your sharders (e.g. "
                "EmbeddingBagCollectionSharder(fused_params=...)) or pass no sharders; "
                "fused_params only configure the default sharders."
            )
        if self.plan is not None and (self.constraints is not None or self.planner is not None):
            raise ValueError("`constraints` and `planner` make a plan; a plan was given: pass one.")

    def resolved_sharders(
        self, *, cpu_reduce_scatter: bool = False
    ) -> list[ModuleSharder[nn.Module]]:
        """The sharders to use.

        Args:
            cpu_reduce_scatter: whether the CPU process group has a reduce-scatter (the default
                EBC sharder then offers the row-wise types).

        Returns:
            ``sharders``, or the defaults with ``fused_params``.
        """
        if self.sharders is not None:
            return self.sharders
        return default_sharders(self.fused_params, cpu_reduce_scatter=cpu_reduce_scatter)


class ShardedModel(NamedTuple):
    """What :func:`shard_model` built.

    Attributes:
        dmp: the ``DistributedModelParallel`` wrapping the model.
        plan: the sharding plan in use.
        summary: the plan, readably (computed before sharding replaced the table configs).
        feature_specs: what each sparse feature may hold (from the unsharded tables).
        dense_width: the dense input width the model declares, or None.
        own_optimizers: the tables given an optimizer of their own with
            ``apply_optimizer_in_backward``.
    """

    dmp: DistributedModelParallel
    plan: ShardingPlan
    summary: PlanSummary
    feature_specs: dict[str, FeatureSpec]
    dense_width: int | None
    own_optimizers: frozenset[str] = frozenset()


def _reuse(sharded: ShardedModel, fused_params: dict[str, Any] | None) -> ShardedModel:
    """The model sharded by an earlier call, with a new fused learning rate if one is given."""
    lr = (fused_params or {}).get("learning_rate")
    if lr is not None:
        optimizer = sharded.dmp.fused_optimizer
        own = sharded.own_optimizers  # tables keep the learning rate of their own optimizer
        kept = {id(g) for g, k in fused_param_groups(optimizer) if own & set(kernel_tables(k))}
        for group in optimizer.param_groups:
            if id(group) not in kept:
                group["lr"] = lr
    logger.info("The model was sharded before in this process: reusing its sharding.")
    return sharded


def shard_model(
    model: nn.Module,
    device: torch.device,
    *,
    local_world_size: int | None = None,
    plan: ShardingPlan | None = None,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    constraints: dict[str, ParameterConstraints] | None = None,
    fused_params: dict[str, Any] | None = None,
    planner: EmbeddingShardingPlanner | None = None,
    data_parallel_wrapper: DataParallelWrapper | None = None,
) -> ShardedModel:
    """Checks the configuration, plans (unless ``plan`` is given) and wraps ``model`` in DMP.

    Collective: call on every rank of the default process group. Tables built on the meta device
    are materialised only as shards; tables built whole keep their values (with a warning). A
    module is sharded once: a later call (a second ``Trainer.fit``, a fine-tune stage) reuses
    its sharding (kept on the module, freed with it; see :mod:`.reuse`), applying a new fused
    ``learning_rate`` if one is given.

    Args:
        model: the unsharded model (tables usually on the meta device).
        device: this rank's device.
        local_world_size: processes per node (default: ``LOCAL_WORLD_SIZE``, else the world
            size); the planner places ``table_row_wise`` and grid shards within a node of this
            many ranks, and TorchRec's node groups are built for it (see
            :mod:`~lightning_torchrec.sharding.nodes`).
        plan: a ready ``ShardingPlan``; skips planning.
        sharders: TorchRec sharders; default :func:`default_sharders` with ``fused_params``.
        constraints: ``{table name: ParameterConstraints}`` for the planner.
        fused_params: fused embedding optimizer settings for the default sharders.
        planner: a planner to use instead of :func:`make_planner`'s.
        data_parallel_wrapper: how DMP wraps the dense part.

    Returns:
        The DMP, the plan and its summary.

    Raises:
        ValueError: for ``sharders`` with ``fused_params``, ``plan`` with ``constraints`` or
            ``planner``, and every configuration error of
            :mod:`lightning_torchrec.sharding.setup_checks` (on every rank).
        ShardingConflictError: when the model was sharded before with other arguments.
    """
    config = ShardingConfig(sharders, plan, constraints, fused_params, planner)
    record = recorded(model)
    if record is not None:
        check_reusable(record, config)
        return _reuse(record.sharded, fused_params)
    world_size = dist.get_world_size()
    compute_device = "cuda" if device.type == "cuda" else "cpu"
    # One probe per sharding, on every rank: may this CPU group run the row-wise types?
    reduce_scatter = compute_device == "cpu" and probe_reduce_scatter()
    check_constraints_for_device(constraints, compute_device, model, reduce_scatter=reduce_scatter)
    check_constraints_match_model(constraints, model)
    check_low_precision_for_device(low_precision_tables(model), compute_device)
    if plan is not None:
        check_plan_matches_model(plan, model)
    own = table_optimizers(model)  # apply_optimizer_in_backward's, over fused_params
    check_table_optimizers(own, compute_device)
    sharders = config.resolved_sharders(cpu_reduce_scatter=reduce_scatter)
    tables = list(table_configs(model))
    if set(tables) - set(own):
        check_fused_optimizer_for_device(sharders, compute_device)
    local = resolve_local_world_size(local_world_size, world_size)
    if plan is None:
        if planner is None:
            topology = make_topology(world_size, local, compute_device)
            narrowed = device_constraints(
                model, constraints, compute_device, reduce_scatter=reduce_scatter
            )
            narrowed = low_precision_constraints(narrowed, low_precision_tables(model))
            planner = make_planner(model, topology, fused_constraints(narrowed, own))
        with estimated_optimizers(estimate_classes(model, own, sharders)):
            plan = plan_collectively(planner, model, sharders, planner_topology(planner))
    check_plan(plan, world_size, compute_device, model, reduce_scatter=reduce_scatter)
    check_plan_kernels(plan, own)
    for note in (
        precedence_note(own, tables, fused_params),
        dense_low_precision_warning(plan, low_precision_tables(model)),
    ):
        if note and dist.get_rank() == 0:
            warnings.warn(note, UserWarning, stacklevel=2)
    summary = summarize_plan(model, plan, world_size, local)
    modules = embedding_modules(model)  # before DMP replaces them with sharded ones
    specs = feature_specs(model)
    materialized = materialized_tables(model)
    warn_materialized(materialized)
    with local_world_size_env(local):  # table_row_wise's node groups follow the plan's nodes
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=device,
            plan=plan,
            sharders=sharders,
            data_parallel_wrapper=data_parallel_wrapper,
        )
    if materialized:
        # DistributedModelParallel re-initialises shards; keep the values the user built.
        copy_into_shards(materialized, embedding_tables(model))
    inner = unwrap(dmp)
    for path, configs in modules.items():
        keep_key_order(inner.get_submodule(path) if path else inner, configs)
    sharded = ShardedModel(dmp, plan, summary, specs, dense_width(model), frozenset(own))
    attach(model, sharded, config)
    return sharded


def maybe_shard_model(
    model: nn.Module,
    device: torch.device,
    *,
    plan: ShardingPlan | None = None,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    constraints: dict[str, ParameterConstraints] | None = None,
    fused_params: dict[str, Any] | None = None,
) -> nn.Module:
    """Wraps ``model`` in ``DistributedModelParallel`` when ``torch.distributed`` is initialised.

    The same path as ``TorchRecStrategy`` (:func:`shard_model`): rank 0 plans for
    ``world_size`` ranks, ``LOCAL_WORLD_SIZE`` per host (default: all on one), on ``device.type``,
    with TorchRec's default sharders carrying
    :func:`~lightning_torchrec.sharding.sharders.default_fused_params`.

    Args:
        model: the model, typically with embedding modules on the ``meta`` device.
        device: this rank's device (``cpu`` or ``cuda:N``).
        plan: a ready ``ShardingPlan``; skips planning.
        sharders: TorchRec module sharders.
        constraints: ``{table name: ParameterConstraints}`` for the planner.
        fused_params: fused-optimizer settings for the default sharders.

    Returns:
        The ``DistributedModelParallel`` model, or ``model`` itself without a process group.

    Raises:
        ValueError: see :func:`shard_model`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        logger.info("torch.distributed is not initialised: the model is not sharded.")
        return model
    sharded = shard_model(
        model,
        device,
        plan=plan,
        sharders=sharders,
        constraints=constraints,
        fused_params=fused_params,
    )
    logger.info("Sharding the model with plan:\n%s", sharded.summary.to_markdown())
    return sharded.dmp
