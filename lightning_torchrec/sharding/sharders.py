"""Sharders and the fused embedding optimizer's settings: what trains the sharded tables."""

from __future__ import annotations

from typing import Any

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from lightning_torchrec.sharding.capabilities import REDUCE_SCATTER_SHARDING_TYPES

#: Compute kernels whose tables are updated in the backward pass by a fused optimizer.
FUSED_KERNELS = frozenset({"fused", "fused_uvm", "fused_uvm_caching", "key_value"})


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


class TableKernels:
    """Mixin for TorchRec's managed-collision sharders: offer only kernels the device has.

    TorchRec's managed-collision sharders offer the UVM and key-value kernels on every device,
    so on CPU the planner picks ``fused_uvm`` and fails (``Unrecognized or unsupported compute
    kernel: fused_uvm``). With this mixin a sharder offers what its tables' sharder offers.
    """

    table_sharder: Any

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """The table sharder's kernels for this sharding type and device.

        Args:
            sharding_type: e.g. ``row_wise``.
            compute_device_type: ``cpu`` or ``cuda``.

        Returns:
            The kernel names.
        """
        return self.table_sharder.compute_kernels(sharding_type, compute_device_type)


class DeviceAwareMCECSharder(TableKernels, ManagedCollisionEmbeddingCollectionSharder):
    """TorchRec's managed-collision EC sharder, offering only kernels the device has.

    Args:
        ec_sharder: the sharder of the collection's tables.
    """

    def __init__(self, ec_sharder: EmbeddingCollectionSharder) -> None:
        super().__init__(ec_sharder=ec_sharder)
        self.table_sharder = ec_sharder


class DeviceAwareMCEBCSharder(TableKernels, ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's managed-collision EBC sharder, offering only kernels the device has.

    Args:
        ebc_sharder: the sharder of the collection's tables.
    """

    def __init__(self, ebc_sharder: EmbeddingBagCollectionSharder) -> None:
        super().__init__(ebc_sharder=ebc_sharder)
        self.table_sharder = ebc_sharder


class ReduceScatterEBCSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, offering its CUDA row-wise types on a CPU group that can run them.

    TorchRec's sharder offers ``row_wise``, ``table_row_wise`` and ``grid_shard`` on CUDA only;
    their output dist is a reduce-scatter, which gloo has on newer torch
    (:func:`~lightning_torchrec.sharding.capabilities.probe_reduce_scatter`). The managed-collision
    and feature-processed EBC sharders built on this one follow it.

    Args:
        fused_params: fused optimizer settings.
        cpu_reduce_scatter: whether the CPU group has a reduce-scatter.
    """

    def __init__(self, fused_params: dict[str, Any], cpu_reduce_scatter: bool) -> None:
        super().__init__(fused_params=fused_params)
        self.cpu_reduce_scatter = cpu_reduce_scatter

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TorchRec's types for the device, and on CPU its reduce-scatter ones where they run.

        Args:
            compute_device_type: ``cpu`` or ``cuda``.

        Returns:
            The sharding type names, TorchRec's order first.
        """
        types = list(super().sharding_types(compute_device_type))
        if compute_device_type == "cpu" and self.cpu_reduce_scatter:
            types += [
                t
                for t in super().sharding_types("cuda")
                if t in REDUCE_SCATTER_SHARDING_TYPES and t not in types
            ]
        return types


def default_sharders(
    fused_params: dict[str, Any] | None, *, cpu_reduce_scatter: bool = False
) -> list[ModuleSharder[nn.Module]]:
    """TorchRec's default sharders, the training ones with the fused optimizer's settings.

    EBC, EC, feature-processed EBC and managed-collision EBC/EC sharders get ``fused_params``
    (merged over :func:`default_fused_params`); the managed-collision ones offer only the
    kernels the device has (:class:`DeviceAwareMCECSharder`); the EBC sharder offers the
    reduce-scatter types on a CPU group that has one (:class:`ReduceScatterEBCSharder`); the
    rest of TorchRec's defaults are kept as is.

    Args:
        fused_params: fused optimizer settings (``optimizer``, ``learning_rate``, ...).
        cpu_reduce_scatter: whether the CPU process group has a reduce-scatter.

    Returns:
        The sharders.
    """
    params = resolve_fused_params(fused_params)
    ebc = ReduceScatterEBCSharder(params, cpu_reduce_scatter)
    ec = EmbeddingCollectionSharder(fused_params=params)
    ours: list[Any] = [
        ebc,
        ec,
        FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ebc),
        DeviceAwareMCEBCSharder(ebc),
        DeviceAwareMCECSharder(ec),
    ]
    replaced = {s.module_type for s in ours}
    return [*ours, *(s for s in get_default_sharders() if s.module_type not in replaced)]


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


def check_semi_sync_plan(plan: ShardingPlan | None) -> None:
    """Refuses a plan that TorchRec's semi-synchronous pipeline cannot train.

    The pipeline looks batch ``i + 1``'s embeddings up before batch ``i``'s update; only fused
    tables (updated inside their backward) allow that. A table with another kernel (every
    ``data_parallel`` table, which the planner picks for small tables on CPU) is updated in
    place by the dense optimizer after the look-up, and the next backward fails in autograd.

    Args:
        plan: the model's sharding plan (``DistributedModelParallel.plan``), or None.

    Raises:
        ValueError: naming every table that is not fused, with its sharding type and kernel.
    """
    if plan is None:
        return
    unfused = sorted(
        f"{table} ({ps.sharding_type}, kernel {ps.compute_kernel})"
        for module_plan in plan.plan.values()
        for table, ps in module_plan.items()  # type: ignore[attr-defined]
        if ps.compute_kernel not in FUSED_KERNELS
    )
    if unfused:
        raise ValueError(
            "pipeline='semi_sync' looks each batch's embeddings up before the previous batch's "
            "update, which only fused tables allow, but the plan leaves these tables to the "
            f"dense optimizer: {unfused}. Constrain them to a sharded type with the fused "
            "kernel, e.g. constraints={table: ParameterConstraints(sharding_types="
            "['table_wise'], compute_kernels=['fused'])}, or use pipeline='sparse_dist'."
        )
