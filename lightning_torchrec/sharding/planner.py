"""TorchRec's planner as the strategy builds it: topology, storage reservation, enumerator.

:func:`make_topology` passes the processes per node explicitly, :func:`make_planner` reserves
memory for the dense part from the model's own parameters, and :class:`StableEnumerator` makes
the planner's choice the same on every launch.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
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
from torchrec.distributed.types import ModuleSharder, ShardingType

from lightning_torchrec.sharding.tables import dense_bytes

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
