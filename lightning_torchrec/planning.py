"""Sharding plans and the ONE place that builds ``DistributedModelParallel``.

:func:`shard_model` runs the configuration checks, plans on rank 0 (one plan for every rank;
a planning failure is raised on every rank), wraps the model in ``DistributedModelParallel`` and
keeps the values of tables that were built whole. ``TorchRecStrategy`` and
:func:`maybe_shard_model` both call it, so both get the same default sharders (TorchRec's, with
the fused optimizer of :func:`default_fused_params`), topology and checks.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import (
    KernelConfig,
    ParameterConstraints,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan

from lightning_torchrec.compat import planner_topology
from lightning_torchrec.distributed import broadcast_from_rank0
from lightning_torchrec.layout import copy_into_shards
from lightning_torchrec.plan_summary import PlanSummary, summarize_plan
from lightning_torchrec.setup_checks import (
    check_constraints_for_device,
    check_constraints_match_model,
    check_fused_optimizer_for_device,
    check_plan,
    check_plan_matches_model,
    explain_planner_error,
    warn_materialized,
)
from lightning_torchrec.tables import (
    dense_bytes,
    embedding_tables,
    materialized_tables,
)

logger = logging.getLogger(__name__)

#: Compute kernels whose tables are updated in the backward pass by a fused optimizer.
FUSED_KERNELS = frozenset({"fused", "fused_uvm", "fused_uvm_caching", "key_value"})

#: TorchRec's planner heuristic: dense parameters cost about 6x their size (weights, optimizer
#: state, DDP buckets).
DENSE_MULTIPLIER = 6


def default_fused_params() -> dict[str, Any]:
    """Fused embedding optimizer settings that train recommendation tables well.

    Returns:
        Row-wise Adagrad with learning rate 0.01 (one accumulator per row: small state, robust
        to the skewed id frequencies of click data).
    """
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
    """TorchRec's default sharders, the training ones with the fused optimizer's settings.

    EBC, EC, feature-processed EBC and managed-collision EBC/EC sharders get ``fused_params``
    (merged over :func:`default_fused_params`); the rest of TorchRec's defaults are kept as is.

    Args:
        fused_params: fused optimizer settings (``optimizer``, ``learning_rate``, ...).

    Returns:
        The sharders.
    """
    params = resolve_fused_params(fused_params)
    ebc = EmbeddingBagCollectionSharder(fused_params=params)
    ec = EmbeddingCollectionSharder(fused_params=params)
    ours: list[Any] = [
        ebc,
        ec,
        FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ebc),
        ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=ebc),
        ManagedCollisionEmbeddingCollectionSharder(ec_sharder=ec),
    ]
    replaced = {type(s) for s in ours}
    return [*ours, *(s for s in get_default_sharders() if type(s) not in replaced)]


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
    return EmbeddingShardingPlanner(
        topology=topology, constraints=constraints, storage_reservation=reservation
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

    def resolved_sharders(self) -> list[ModuleSharder[nn.Module]]:
        """The sharders to use.

        Returns:
            ``sharders``, or the defaults with ``fused_params``.
        """
        return self.sharders if self.sharders is not None else default_sharders(self.fused_params)


class ShardedModel(NamedTuple):
    """What :func:`shard_model` built.

    Attributes:
        dmp: the ``DistributedModelParallel`` wrapping the model.
        plan: the sharding plan in use.
        summary: the plan, readably (computed before sharding replaced the table configs).
    """

    dmp: DistributedModelParallel
    plan: ShardingPlan
    summary: PlanSummary


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
    are materialised only as shards; tables built whole keep their values (with a warning).

    Args:
        model: the unsharded model (tables usually on the meta device).
        device: this rank's device.
        local_world_size: processes per node (default: ``LOCAL_WORLD_SIZE``, else the world size).
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
            :mod:`lightning_torchrec.setup_checks` (on every rank).
    """
    config = ShardingConfig(sharders, plan, constraints, fused_params, planner)
    world_size = dist.get_world_size()
    compute_device = "cuda" if device.type == "cuda" else "cpu"
    check_constraints_for_device(constraints, compute_device)
    check_constraints_match_model(constraints, model)
    if plan is not None:
        check_plan_matches_model(plan, model)
    sharders = config.resolved_sharders()
    check_fused_optimizer_for_device(sharders, compute_device)
    if plan is None:
        if planner is None:
            local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            topology = make_topology(world_size, local, compute_device)
            planner = make_planner(model, topology, constraints)
        plan = plan_collectively(planner, model, sharders, planner_topology(planner))
    check_plan(plan, world_size, compute_device)
    summary = summarize_plan(model, plan, world_size)
    materialized = materialized_tables(model)
    warn_materialized(materialized)
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
    return ShardedModel(dmp, plan, summary)


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
    with TorchRec's default sharders carrying :func:`default_fused_params`.

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
