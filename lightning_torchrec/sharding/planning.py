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
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import (
    KernelConfig,
    ParameterConstraints,
    ShardingOption,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan, ShardingType

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
    dense_bytes,
    dense_width,
    embedding_modules,
    embedding_tables,
    materialized_tables,
    table_configs,
    unwrap,
)

logger = logging.getLogger(__name__)

#: TorchRec's planner heuristic: dense parameters cost about 6x their size (weights, optimizer
#: state, DDP buckets).
DENSE_MULTIPLIER = 6


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


class StableEnumerator(EmbeddingEnumerator):
    """TorchRec's enumerator, listing each table's options in one order on every launch.

    TorchRec intersects a table's constrained sharding types and compute kernels with the
    sharder's through Python sets, so their order follows string hash randomisation; options
    of equal estimated cost (``table_wise`` and a one-block ``table_column_wise``) then win by
    that order, and the same model got a different plan from launch to launch. This lists each
    table's options in the sharder's own order of types and kernels, as TorchRec does for an
    unconstrained table. The planner's choice among them is unchanged otherwise.

    Args:
        topology: the planner's topology.
        batch_size: the planner's batch size.
        constraints: per-table planner constraints.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = BATCH_SIZE,
        constraints: dict[str, ParameterConstraints] | None = None,
    ) -> None:
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints)
        self.device_type: str = topology.compute_device

    def enumerate(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
    ) -> list[ShardingOption]:
        """TorchRec's options, each table's in the sharder's order.

        Args:
            module: the model.
            sharders: the sharders.

        Returns:
            The options, tables in TorchRec's order.
        """
        options = super().enumerate(module, sharders)
        by_type = {sharder_name(s.module_type): s for s in sharders}
        device = self.device_type
        tables: dict[tuple[str, str], int] = {}

        def key(option: ShardingOption) -> tuple[int, int, int]:
            table = tables.setdefault((option.path, option.name), len(tables))
            sharder = by_type.get(sharder_name(type(option.module[1])))
            types = sharder.sharding_types(device) if sharder is not None else []
            kernels = (
                sharder.compute_kernels(option.sharding_type, device) if sharder is not None else []
            )
            return (
                table,
                _rank(types, option.sharding_type, _SHARDING_TYPE_ORDER),
                _rank(kernels, option.compute_kernel, _KERNEL_ORDER),
            )

        return sorted(options, key=key)


#: Fallback orders for names a sharder does not list: TorchRec's enum order.
_SHARDING_TYPE_ORDER = tuple(t.value for t in ShardingType)
_KERNEL_ORDER = tuple(k.value for k in EmbeddingComputeKernel)


def _rank(first: list[str], name: str, then: tuple[str, ...]) -> int:
    if name in first:
        return first.index(name)
    return len(first) + (then.index(name) if name in then else len(then))


def make_planner(
    model: nn.Module,
    topology: Topology,
    constraints: dict[str, ParameterConstraints] | None = None,
) -> EmbeddingShardingPlanner:
    """TorchRec's planner, reserving memory for the dense part from the model's own parameters.

    TorchRec's default reservation guesses the dense size by materialising nothing (a wrong
    guess for meta models, with a warning) unless it is given ``dense_tensor_estimate``; this
    passes ``DENSE_MULTIPLIER`` times the bytes of the parameters and buffers outside the
    embedding modules.

    Args:
        model: the unsharded model.
        topology: from :func:`make_topology`.
        constraints: per-table planner constraints.

    Returns:
        The planner.
    """
    with warnings.catch_warnings():
        # TorchRec 1.8+ warns on every construction, even with the estimate it asks for.
        warnings.filterwarnings("ignore", "HeuristicalStorageReservation", FutureWarning)
        reservation = HeuristicalStorageReservation(
            percentage=0.15, dense_tensor_estimate=max(DENSE_MULTIPLIER * dense_bytes(model), 1)
        )
    enumerator = StableEnumerator(topology=topology, batch_size=BATCH_SIZE, constraints=constraints)
    return EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        storage_reservation=reservation,
        enumerator=enumerator,
    )


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
