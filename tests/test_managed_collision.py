"""Managed-collision tables: the sharders offer kernels the device has, plan checks find the
tables inside a ``ManagedCollisionEmbeddingCollection``, and raw ids pass the batch checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.utils.data import DataLoader
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import (
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from lightning_torchrec import EmbeddingNormCallback, WeightNormCallback
from lightning_torchrec.checkpoint.mc_layout import (
    check_managed_collision_layout,
    row_ranges,
    saved_row_ranges,
)
from lightning_torchrec.compat.upstream import managed_collision_table
from lightning_torchrec.data.batch import Batch
from lightning_torchrec.errors import (
    BatchValidationError,
    CheckpointMismatchError,
    ManagedCollisionLayoutError,
)
from lightning_torchrec.lightning.mc_callbacks import ManagedCollisionStatsCallback
from lightning_torchrec.sharding.features import feature_specs
from lightning_torchrec.sharding.sharders import (
    DeviceAwareMCEBCSharder,
    DeviceAwareMCECSharder,
    default_sharders,
)
from lightning_torchrec.sharding.tables import embedding_tables, module_table_configs, table_of_key
from lightning_torchrec.training.batch_checks import check_batch
from lightning_torchrec.training.device_checks import DeferredVerdict
from lightning_torchrec.training.mc_stats import ManagedCollisionCounts
from tests.scripts.factory import Capture, cpu_trainer
from tests.scripts.mc_model import data as mc_data
from tests.scripts.mc_model import module as mc_module
from tests.scripts.mc_model import strategy as mc_strategy

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


def _raw_batches(dtype: torch.dtype) -> list[Batch]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.full((16,), 2, dtype=torch.int32)
    return [
        Batch(
            torch.randn(8, 13, generator=gen),
            KeyedJaggedTensor(
                keys=["cat_0", "cat_1"],
                values=torch.randint(0, 2**31 - 1, (32,), generator=gen).to(dtype),
                lengths=lengths,
            ),
            torch.randint(0, 2, (8,), generator=gen).float(),
        )
        for _ in range(3)
    ]


def test_int32_raw_ids_are_refused_by_name_before_torchrec_remaps_them() -> None:
    # They failed inside TorchRec's remapping with a bare dtype RuntimeError, mid-step.
    specs = feature_specs(mc_model())
    assert specs["f0"].managed
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([5, 7]), lengths=torch.tensor([1, 1]))
    assert check_batch(kjt, specs, None, "rank 0, step 0") is None
    narrow = KeyedJaggedTensor(keys=["f0"], values=kjt.values().int(), lengths=kjt.lengths())
    found = check_batch(narrow, specs, None, "rank 1, step 4")
    assert isinstance(found, BatchValidationError)
    assert str(found).startswith("rank 1, step 4: sparse feature(s) ['f0'] hold ids of dtype ")
    assert "managed-collision table(s) ['t0']" in str(found)
    deferred = DeferredVerdict(specs, None)
    deferred.submit(narrow, "rank 1, step 4")
    assert str(deferred.verdict()) == str(found)
    trainer = cpu_trainer(mc_strategy(), max_steps=3, limit_val_batches=0)
    with pytest.raises(BatchValidationError, match=r"rank 0, step 0: .*dtype torch.int32"):
        trainer.fit(mc_module(), DataLoader(_raw_batches(torch.int32), batch_size=None))
    trainer = cpu_trainer(mc_strategy(), max_steps=3, limit_val_batches=0)
    trainer.fit(mc_module(), DataLoader(_raw_batches(torch.int64), batch_size=None))
    assert trainer.global_step == 3


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


def saved_as(model: nn.Module, *shards: tuple[int, int]) -> Metadata:
    """DCP metadata of ``model``'s state saved with each 1-D entry in ``shards`` row ranges."""
    entries = {}
    for key, value in model.state_dict().items():
        ranges = shards if value.dim() == 1 and len(value) == 32 else ((0, len(value)),)
        chunks = [ChunkStorageMetadata(torch.Size([a]), torch.Size([b - a])) for a, b in ranges]
        props = TensorProperties(dtype=value.dtype)
        entries[f"state_dict.{key}"] = TensorStorageMetadata(props, value.shape, chunks)
    return Metadata(state_dict_metadata=entries)


def flat(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"state_dict.{k}": v for k, v in model.state_dict().items()}


def test_managed_collision_entries_are_found_by_table() -> None:
    keys = list(mc_model().state_dict())
    mc = {k: managed_collision_table(k) for k in keys if managed_collision_table(k)}
    assert set(mc.values()) == {"t0"}
    assert any(k.endswith("._mch_sorted_raw_ids") for k in mc)
    assert managed_collision_table("mc._embedding_module.embeddings.t0.weight") is None


def test_row_ranges_of_a_plain_tensor_and_saved_chunks() -> None:
    assert row_ranges(torch.zeros(32)) == ((0, 32),)
    assert row_ranges(torch.zeros(())) is None and row_ranges("not a tensor") is None
    entry = saved_as(mc_model(), (16, 32), (0, 16)).state_dict_metadata
    key = next(k for k in entry if k.endswith("_mch_sorted_raw_ids"))
    assert saved_row_ranges(entry[key]) == ((0, 16), (16, 32))


def test_managed_collision_state_of_another_layout_is_refused_naming_the_table() -> None:
    model = mc_model()
    check_managed_collision_layout("ck", flat(model), saved_as(model, (0, 32)))  # same: fine
    with pytest.raises(ManagedCollisionLayoutError) as err:
        check_managed_collision_layout("ck", flat(model), saved_as(model, (0, 16), (16, 32)))
    msg = str(err.value)
    assert "Refusing to load ck" in msg
    assert (
        "table 't0' (module mc._managed_collision_collection._managed_collision_modules.t0): "
        "saved by 2 ranks as rows [0, 16) [16, 32), now 1 rank with rows [0, 32)"
    ) in msg
    assert "Load it on 2 ranks" in msg and isinstance(err.value, CheckpointMismatchError)


def test_layout_check_leaves_other_entries_and_other_sizes_to_the_shape_check() -> None:
    model = mc_model()
    meta = saved_as(model, (0, 16), (16, 32))
    # Only managed-collision entries count: a plain 32-row tensor saved in two chunks is fine.
    other = {"state_dict.dense.weight": torch.zeros(32)}
    meta.state_dict_metadata["state_dict.dense.weight"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([32]),
        [ChunkStorageMetadata(torch.Size([a]), torch.Size([16])) for a in (0, 16)],
    )
    state = flat(model)
    refused = {k for k in state if k.endswith("_mch_sorted_raw_ids")}
    smaller = {k: torch.zeros(8, dtype=v.dtype) if k in refused else v for k, v in state.items()}
    with pytest.raises(ManagedCollisionLayoutError):  # the other MCH buffers still differ
        check_managed_collision_layout("ck", {**other, **smaller}, meta)
    only = {k: v for k, v in smaller.items() if k in refused}
    check_managed_collision_layout("ck", {**other, **only}, meta)  # another size: not this check


def test_norm_callbacks_see_the_tables_of_a_sharded_managed_collision_model() -> None:
    # The sharded collection keeps its remapping state as sharded 1-D integer tensors: they are
    # no tables, for embedding_tables nor for the norm callbacks.
    logger = Capture()
    callbacks = [WeightNormCallback(every_n_steps=2), EmbeddingNormCallback(every_n_steps=2)]
    trainer = cpu_trainer(
        mc_strategy(), max_steps=2, limit_val_batches=0, callbacks=callbacks, logger=logger
    )
    model = mc_module()
    trainer.fit(model, datamodule=mc_data())
    tables = embedding_tables(model)
    assert sorted(table_of_key(k) for k in tables) == ["t_cat_0", "t_cat_1"], list(tables)
    logged = {k for metrics in logger.metrics.values() for k in metrics}
    assert {f"embedding_norms/t_cat_{i}-norm-mean" for i in range(2)} <= set(logged)
    assert sum(k.startswith("model/l2_norm/") and "t_cat_" in k for k in logged) == 2
