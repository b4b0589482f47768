"""Managed-collision tables: the sharders offer kernels the device has, plan checks find the
tables inside a ``ManagedCollisionEmbeddingCollection``, and raw ids pass the batch checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import (
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor

from lightning_torchrec.lightning.mc_callbacks import ManagedCollisionStatsCallback
from lightning_torchrec.sharding.sharders import (
    DeviceAwareMCEBCSharder,
    DeviceAwareMCECSharder,
    default_sharders,
)
from lightning_torchrec.sharding.tables import feature_specs, module_table_configs
from lightning_torchrec.training.mc_stats import ManagedCollisionCounts

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


def test_counts_follow_admissions_and_evictions() -> None:
    mch = MCHManagedCollisionModule(
        zch_size=5,  # 4 slots for ids: TorchRec keeps the last row for ids it did not admit
        device=torch.device("cpu"),
        eviction_policy=LRU_EvictionPolicy(),
        eviction_interval=1,
        input_hash_size=RAW_BOUND,
    )
    model = nn.ModuleDict({"t0": mch})
    counts = ManagedCollisionCounts(model)
    assert counts.tables == ["t0"]

    def feed(ids: list[int]) -> dict[str, int]:
        values = torch.tensor(ids, dtype=torch.int64)
        mch({"f0": JaggedTensor(values=values, lengths=torch.ones(len(ids), dtype=torch.int32))})
        return counts()["t0"]

    assert feed([2**39 + 1, 2**39 + 2, 2**39 + 3]) == {"open_slots": 1, "admitted": 3, "evicted": 0}
    assert feed([2**39 + 1, 2**39 + 2, 2**39 + 3]) == {"open_slots": 1, "admitted": 0, "evicted": 0}
    got = feed([7, 8, 9])  # 3 new ids for 1 open slot: the least recently used make room
    assert got == {"open_slots": 0, "admitted": 3, "evicted": 2}


def test_stats_callback_refuses_a_model_without_managed_collision_or_no_logger() -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        ManagedCollisionStatsCallback(every_n_steps=0)
    callback = ManagedCollisionStatsCallback()
    trainer = SimpleNamespace(loggers=[], global_step=0)
    with pytest.raises(MisconfigurationException, match="logger=False"):
        callback.on_train_start(trainer, mc_model())  # type: ignore[arg-type]
    trainer.loggers = [CSVLogger("unused")]
    with pytest.raises(MisconfigurationException, match="no MCHManagedCollisionModule"):
        callback.on_train_start(trainer, nn.Linear(2, 2))  # type: ignore[arg-type]
    callback.on_train_start(trainer, mc_model())  # type: ignore[arg-type]
