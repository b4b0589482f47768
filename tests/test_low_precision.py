"""Tables stored in fp16: planned on fused kernels, so the dense Adam never sees them.

TorchRec's planner makes small tables data-parallel; an fp16 data-parallel table is a parameter
of the dense optimizer, and Adam in fp16 (``eps`` rounds to 0) turns it into NaN at its first
step. One process, one gloo rank.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import DataType

from lightning_torchrec import ModelAndLoss, TorchRecModule, TorchRecStrategy
from lightning_torchrec.sharding.layout import shard_info
from lightning_torchrec.sharding.planning import shard_model
from lightning_torchrec.sharding.tables import embedding_tables
from tests.helpers import one_rank_group  # noqa: F401 - a fixture
from tests.scripts.factory import cpu_trainer, tiny_data

CPU = torch.device("cpu")
EBC = "model_and_loss.model.sparse_arch.embedding_bag_collection"


def fp16_dlrm(dtypes: tuple[DataType, DataType] = (DataType.FP16, DataType.FP32)) -> TorchRecModule:
    """A DLRM whose table ``t_cat_i`` is stored in ``dtypes[i]``; the dense optimizer is Adam."""
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t_cat_{i}",
            embedding_dim=8,
            num_embeddings=40,
            feature_names=[f"cat_{i}"],
            data_type=dtype,
        )
        for i, dtype in enumerate(dtypes)
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    return TorchRecModule(ModelAndLoss(dlrm), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))


@pytest.mark.usefixtures("one_rank_group")
def test_constraints_that_ask_for_data_parallel_are_kept_and_named() -> None:
    model = fp16_dlrm((DataType.FP16, DataType.FP16)).model_and_loss.model
    asked = {"t_cat_1": ParameterConstraints(sharding_types=["data_parallel"])}
    with pytest.warns(UserWarning, match=r"low-precision table\(s\) 't_cat_1' \(FP16, data_par"):
        sharded = shard_model(model, CPU, constraints=asked)
    plan = sharded.plan.plan["sparse_arch.embedding_bag_collection"]
    assert plan["t_cat_0"].compute_kernel == "fused"
    assert plan["t_cat_1"].sharding_type == "data_parallel"  # the user asked for it


@pytest.mark.usefixtures("one_rank_group")
def test_a_bf16_table_is_refused_on_cpu_before_planning_naming_it() -> None:
    """fbgemm's CPU kernels (fused and dense) have no bf16 forward: the first training step
    failed with a bare ``NotImplementedError`` that named no table."""
    model = fp16_dlrm((DataType.FP32, DataType.BF16)).model_and_loss.model
    with pytest.raises(ValueError, match=r"Table\(s\) \['t_cat_1'\] are stored in bf16"):
        shard_model(model, CPU)


@pytest.mark.usefixtures("one_rank_group")
def test_an_explicit_plan_with_an_fp16_table_on_the_dense_kernel_is_named() -> None:
    model = fp16_dlrm().model_and_loss.model
    ebc = model.sparse_arch.embedding_bag_collection
    per_table = {"t_cat_0": data_parallel(), "t_cat_1": data_parallel()}
    plan = ShardingPlan(
        {
            "sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
                ebc, per_param_sharding=per_table, local_size=1, world_size=1, device_type="cpu"
            )
        }
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shard_model(model, CPU, plan=plan)
    named = [str(w.message) for w in caught if "low-precision" in str(w.message)]
    assert len(named) == 1 and "'t_cat_0' (FP16" in named[0] and "t_cat_1" not in named[0]


# Last: the in-process Trainer leaves its process group to the file's end.
def test_an_fp16_table_is_planned_fused_and_trains_finite_under_a_dense_adam() -> None:
    module = fp16_dlrm()
    trainer = cpu_trainer(TorchRecStrategy(), max_steps=4, limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=tiny_data(40, 2, batch_size=16))
    assert not [w for w in caught if "low-precision" in str(w.message)]  # none left dense
    plan = trainer.strategy.sharding_plan.plan[EBC]
    assert plan["t_cat_0"].compute_kernel == "fused"  # fp16: kept off the dense optimizer
    assert plan["t_cat_1"].sharding_type == "data_parallel"  # fp32: the planner's choice stands
    tables = embedding_tables(trainer.strategy.model)
    fp16 = next(t for k, t in tables.items() if "t_cat_0" in k)
    rows = torch.cat([s.tensor.detach().flatten() for s in shard_info(fp16).shards])
    assert rows.dtype == torch.float16 and bool(torch.isfinite(rows).all())
    assert trainer.global_step == 4
