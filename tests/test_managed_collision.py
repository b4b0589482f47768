"""Managed-collision tables: the sharders offer kernels the device has, plan checks find the
tables inside a ``ManagedCollisionEmbeddingCollection``, and raw ids pass the batch checks."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import (
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

from lightning_torchrec.sharding.sharders import (
    DeviceAwareMCEBCSharder,
    DeviceAwareMCECSharder,
    default_sharders,
)
from lightning_torchrec.sharding.tables import feature_specs, module_table_configs

RAW_BOUND = 2**40


def mc_model() -> nn.Module:
    tables = [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=32, feature_names=["f0"])]
    mch = MCHManagedCollisionModule(
        zch_size=32,
        device=torch.device("cpu"),
        eviction_policy=LRU_EvictionPolicy(),
        eviction_interval=2,
        input_hash_size=RAW_BOUND,
        buckets=2,
    )
    model = nn.Module()
    model.mc = ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(tables, device=torch.device("meta")),
        ManagedCollisionCollection({"t0": mch}, tables),
    )
    return model


def test_managed_collision_sharders_offer_only_cpu_kernels_on_cpu() -> None:
    sharders = default_sharders(None)
    mc = [s for s in sharders if isinstance(s, (DeviceAwareMCECSharder, DeviceAwareMCEBCSharder))]
    assert len(mc) == 2
    for sharder in mc:
        assert sharder.compute_kernels("row_wise", "cpu") == ["fused"]
        assert "fused_uvm" in sharder.compute_kernels("row_wise", "cuda")
    # TorchRec's own managed-collision sharders are replaced, not kept beside these.
    assert len({s.module_type for s in sharders}) == len(sharders)


def test_plan_checks_see_the_tables_inside_a_managed_collision_collection() -> None:
    configs = module_table_configs(mc_model(), "mc")
    assert list(configs) == ["t0"] and isinstance(configs["t0"], EmbeddingConfig)


def test_raw_ids_are_bounded_by_the_collision_module_not_the_rows() -> None:
    spec = feature_specs(mc_model())["f0"]
    assert (spec.table, spec.num_embeddings) == ("t0", RAW_BOUND)
