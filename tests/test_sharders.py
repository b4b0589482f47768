"""Unit tests of sharding.sharders: fused optimizer settings, sharders, fused plans."""

from __future__ import annotations

import pytest
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)

from lightning_torchrec.sharding.sharders import (
    DeviceAwareMCEBCSharder,
    DeviceAwareMCECSharder,
    ReduceScatterEBCSharder,
    default_fused_params,
    default_sharders,
    has_fused_tables,
    resolve_fused_params,
)

ADAGRAD = EmbOptimType.EXACT_ROWWISE_ADAGRAD


def test_fused_params_merge_over_the_defaults() -> None:
    assert default_fused_params() == {"optimizer": ADAGRAD, "learning_rate": 0.01, "eps": 1e-8}
    assert resolve_fused_params(None) == default_fused_params()
    mine = {"learning_rate": 0.3}
    assert resolve_fused_params(mine) == {"optimizer": ADAGRAD, "learning_rate": 0.3, "eps": 1e-8}
    assert mine == {"learning_rate": 0.3}  # not modified


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("exact_rowwise_adagrad", ADAGRAD),  # the enum member's name
        ("exact_row_wise_adagrad", ADAGRAD),  # its value
        ("EXACT_SGD", EmbOptimType.EXACT_SGD),
    ],
)
def test_fused_optimizer_by_name(name: str, expected: EmbOptimType) -> None:
    assert resolve_fused_params({"optimizer": name})["optimizer"] is expected


def test_unknown_fused_optimizer_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"Unknown fused optimizer 'adamw2'; known: \[.*'exact_sgd'"
    ):
        default_sharders({"optimizer": "adamw2"})


def test_default_sharders_carry_the_fused_params() -> None:
    sharders = default_sharders({"learning_rate": 0.3})
    assert [type(s) for s in sharders[:5]] == [
        ReduceScatterEBCSharder,
        EmbeddingCollectionSharder,
        FeatureProcessedEmbeddingBagCollectionSharder,
        DeviceAwareMCEBCSharder,
        DeviceAwareMCECSharder,
    ]
    assert isinstance(sharders[0], EmbeddingBagCollectionSharder)
    assert isinstance(sharders[3], ManagedCollisionEmbeddingBagCollectionSharder)
    assert isinstance(sharders[4], ManagedCollisionEmbeddingCollectionSharder)
    expected = {"optimizer": ADAGRAD, "learning_rate": 0.3, "eps": 1e-8}
    for sharder in sharders[:5]:
        assert sharder.fused_params == expected, type(sharder).__name__
    # TorchRec's other default sharders are kept, one per module type.
    modules = [s.module_type for s in sharders]
    assert len(modules) == len(set(modules))
    assert {s.module_type for s in get_default_sharders()} <= set(modules)


def test_the_ebc_sharder_offers_row_wise_types_on_cpu_only_where_gloo_can_reduce_scatter() -> None:
    torchrec_cpu = EmbeddingBagCollectionSharder().sharding_types("cpu")
    assert "row_wise" not in torchrec_cpu
    without, with_rs = (
        default_sharders(None, cpu_reduce_scatter=rs)[0].sharding_types("cpu")
        for rs in (False, True)
    )
    assert without == torchrec_cpu
    assert with_rs == [*torchrec_cpu, "row_wise", "table_row_wise", "grid_shard"]
    mc_with, mc_without = (default_sharders(None, cpu_reduce_scatter=rs)[3] for rs in (True, False))
    assert isinstance(mc_with, ManagedCollisionEmbeddingBagCollectionSharder)
    assert mc_with.sharding_types("cpu") == ["row_wise"]  # managed collision is row-wise only
    assert mc_without.sharding_types("cpu") == []
    cuda = default_sharders(None)[0].sharding_types("cuda")
    assert cuda == EmbeddingBagCollectionSharder().sharding_types("cuda")


def test_has_fused_tables() -> None:
    def plan(*kernels: str) -> ShardingPlan:
        tables = {
            f"t{i}": ParameterSharding(sharding_type="table_wise", compute_kernel=k, ranks=[0])
            for i, k in enumerate(kernels)
        }
        return ShardingPlan({"ebc": EmbeddingModuleShardingPlan(tables)})

    assert has_fused_tables(plan("dense", "fused"))
    assert has_fused_tables(plan("fused_uvm_caching"))
    assert not has_fused_tables(plan("dense", "dense"))
    assert not has_fused_tables(ShardingPlan({}))
