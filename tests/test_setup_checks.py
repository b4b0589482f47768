"""Unit tests of sharding.setup_checks: refusals name their culprit; good input passes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, ModelPruning, StochasticWeightAveraging
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)

from lightning_torchrec.lightning.trainer_setup import (
    check_fused_training,
    check_sync_batchnorm,
)
from lightning_torchrec.sharding.planning import make_planner, make_topology
from lightning_torchrec.sharding.setup_checks import (
    check_constraints_for_device,
    check_constraints_match_model,
    check_fused_optimizer_for_device,
    check_plan,
    check_plan_matches_model,
    explain_planner_error,
    warn_materialized,
)
from lightning_torchrec.sharding.sharders import default_sharders
from lightning_torchrec.training.run import check_precision
from tests.scripts.factory import (
    cpu_trainer,
    sharding_constraints,
    table_wise,
    tiny_data,
    tiny_dlrm,
)

EBC = "model_and_loss.model.sparse_arch.embedding_bag_collection"


def plan_of(tables: dict[str, ParameterSharding], module: str = EBC) -> ShardingPlan:
    return ShardingPlan({module: EmbeddingModuleShardingPlan(tables)})


def sharding(kind: str = "table_wise", ranks: list[int] | None = None) -> ParameterSharding:
    return ParameterSharding(sharding_type=kind, compute_kernel="fused", ranks=ranks or [0])


# ---------------------------------------------------------------- constraints


def test_cuda_only_constraints_on_cpu_are_refused_naming_the_table() -> None:
    row_wise = sharding_constraints({"t_cat_0": "table_wise", "t_cat_1": "row_wise"})
    with pytest.raises(ValueError, match=r"Table 't_cat_1'.*\['row_wise'\].*needs CUDA"):
        check_constraints_for_device(row_wise, "cpu")
    check_constraints_for_device(row_wise, "cuda")
    check_constraints_for_device(None, "cpu")
    check_constraints_for_device(table_wise(2), "cpu")
    # A CPU-capable type among the choices leaves the planner a way out.
    mixed = sharding_constraints({"t_cat_0": "row_wise"})
    mixed["t_cat_0"].sharding_types = ["row_wise", "table_wise"]
    check_constraints_for_device(mixed, "cpu")


def test_constraints_for_unknown_tables_are_refused_with_close_names() -> None:
    model = tiny_dlrm(10)
    with pytest.raises(ValueError, match=r"\['t_cta_1'\] \(closest: \{'t_cta_1': \['t_cat_1'"):
        check_constraints_match_model(table_wise(["t_cat_0", "t_cta_1"]), model)
    check_constraints_match_model(table_wise(2), model)
    check_constraints_match_model(None, model)


# ---------------------------------------------------------------- plans


def test_explicit_row_wise_plan_and_plan_for_other_world_are_refused() -> None:
    model, row_wise = tiny_dlrm(), sharding_constraints({"t_cat_0": "row_wise"})
    topology = Topology(world_size=2, compute_device="cuda", local_world_size=2)
    plan = make_planner(model, topology, row_wise).plan(model, default_sharders(None))
    with pytest.raises(ValueError, match=r"'t_cat_0'.*row_wise, which needs CUDA"):
        check_plan(plan, world_size=2, compute_device="cpu")
    with pytest.raises(ValueError, match=r"on ranks \[1\].*world has 1 ranks"):
        check_plan(plan, world_size=1, compute_device="cuda")
    check_plan(plan, world_size=2, compute_device="cuda")


def test_check_plan_names_table_and_module() -> None:
    plan = plan_of({"t_cat_0": sharding(), "t_cat_1": sharding(ranks=[3])})
    with pytest.raises(ValueError, match=rf"table 't_cat_1' of module '{EBC}' on ranks \[3\]"):
        check_plan(plan, world_size=2, compute_device="cpu")
    check_plan(plan, world_size=4, compute_device="cpu")
    check_plan(plan_of({"t_cat_0": sharding("column_wise", [0, 1])}), 2, "cpu")


def test_plan_for_tables_the_model_does_not_have() -> None:
    plan = plan_of({"t_user": sharding()})
    with pytest.raises(ValueError, match=r"tables \['t_user'\].*t_cat_0"):
        check_plan_matches_model(plan, tiny_dlrm(10))
    elsewhere = plan_of({"t_cat_0": sharding()}, module="model_and_loss.model.ebc")
    with pytest.raises(
        ValueError, match=r"module 'model_and_loss\.model\.ebc'.*tables there: \[\]"
    ):
        check_plan_matches_model(elsewhere, tiny_dlrm(10))
    check_plan_matches_model(plan_of({"t_cat_1": sharding()}), tiny_dlrm(10))


# ---------------------------------------------------------------- fused optimizers


def test_fused_adam_on_cpu_is_refused_at_setup() -> None:
    with pytest.raises(ValueError, match="'adam'.*not supported on CPU"):
        check_fused_optimizer_for_device(default_sharders({"optimizer": "adam"}), "cpu")
    check_fused_optimizer_for_device(default_sharders({"optimizer": "adam"}), "cuda")


def test_fused_optimizer_refusal_names_the_sharder_and_the_cpu_ones() -> None:
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": "partial_rowwise_adam"})
    with pytest.raises(
        ValueError, match=r"in EmbeddingBagCollectionSharder.*exact_row_wise_adagrad"
    ):
        check_fused_optimizer_for_device([sharder], "cpu")
    check_fused_optimizer_for_device(default_sharders(None), "cpu")  # row-wise Adagrad
    check_fused_optimizer_for_device(default_sharders({"optimizer": "exact_sgd"}), "cpu")
    check_fused_optimizer_for_device([EmbeddingBagCollectionSharder()], "cpu")  # no fused params


# ---------------------------------------------------------------- planner errors


def test_tables_too_large_explained_in_bytes() -> None:
    model = tiny_dlrm([10, 40_000_000_000])
    topology = make_topology(2, 2, "cpu")
    with pytest.raises(Exception) as planner_error:
        make_planner(model, topology).plan(model, default_sharders(None))
    msg = explain_planner_error(planner_error.value, model, topology)
    assert "640000000160 bytes" in msg  # 4e10 x 4 x fp32 + 10 x 4 x fp32
    assert "t_cat_1: 596.0 GiB" in msg and "Each of the 2 ranks offers" in msg
    assert "Planner said: Unable to find a plan" in msg


def test_planner_error_without_a_topology_still_gives_the_bytes() -> None:
    msg = explain_planner_error(RuntimeError("no room"), tiny_dlrm([10, 30]), None)
    lines = msg.splitlines()
    assert lines[0].startswith("Sharding planning failed (RuntimeError). The tables need 640 B")
    assert "(largest: t_cat_1: 480 B, t_cat_0: 160 B)" in lines[0]
    assert not any("ranks offers" in line for line in lines)
    assert lines[-1] == "Planner said: no room"


# ---------------------------------------------------------------- precision and fit settings


@pytest.mark.parametrize(
    "plugin", [HalfPrecision("bf16-true"), HalfPrecision("16-true"), DoublePrecision()]
)
def test_whole_model_precisions_are_refused_naming_them(plugin: Precision) -> None:
    with pytest.raises(ValueError, match=rf"precision='{plugin.precision}'.*bf16-mixed"):
        check_precision(plugin, fused_tables=False)


def test_mixed_and_full_precision_pass() -> None:
    for fused in (False, True):
        check_precision(Precision(), fused)
        check_precision(MixedPrecision("bf16-mixed", "cpu"), fused)


def test_a_grad_scaler_with_fused_tables_is_refused() -> None:
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="'16-mixed' uses a gradient scaler.*scaled"):
        check_precision(scaled, fused_tables=True)
    check_precision(scaled, fused_tables=False)  # mixed precision itself is fine


def fit_settings(accumulate: int = 1, clip: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        precision_plugin=Precision(), accumulate_grad_batches=accumulate, gradient_clip_val=clip
    )


def test_fused_training_refuses_accumulation_without_opt_in() -> None:
    with pytest.raises(ValueError, match="accumulate_grad_batches=4.*allow_fused_gradient"):
        check_fused_training(fit_settings(accumulate=4), False)
    check_fused_training(fit_settings(accumulate=4), True)
    check_fused_training(fit_settings(), False)
    scaled = fit_settings()
    scaled.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="gradient scaler"):
        check_fused_training(scaled, True)


def test_fused_training_warns_that_clipping_skips_the_tables() -> None:
    with pytest.warns(UserWarning, match="Gradient clipping reaches the dense parameters only"):
        check_fused_training(fit_settings(clip=1.0), False)


def test_sync_batchnorm_is_refused_on_cpu() -> None:
    with pytest.raises(ValueError, match="sync_batchnorm=True.*GPUs only"):
        check_sync_batchnorm(torch.device("cpu"))
    check_sync_batchnorm(torch.device("cuda", 0))


def test_materialized_tables_are_warned_about_with_their_size() -> None:
    with pytest.warns(UserWarning, match=r"2 embedding tables \(240 B\) were built whole"):
        warn_materialized({"a": torch.zeros(10, 4), "b": torch.zeros(5, 4)})


def test_no_materialized_tables_no_warning(recwarn: pytest.WarningsRecorder) -> None:
    warn_materialized({})
    assert not recwarn.list


def _ec_model() -> torch.nn.Module:
    from torchrec import EmbeddingCollection
    from torchrec.modules.embedding_configs import EmbeddingConfig

    class Seq(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(
                        name="seq", embedding_dim=4, num_embeddings=10, feature_names=["s"]
                    )
                ],
                device=torch.device("meta"),
            )
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name="bag", embedding_dim=4, num_embeddings=10, feature_names=["b"]
                    )
                ],
                device=torch.device("meta"),
            )

    return Seq()


def test_cpu_planning_offers_only_what_each_table_can_run() -> None:
    from lightning_torchrec.sharding.setup_checks import device_constraints

    model = _ec_model()
    out = device_constraints(model, None, "cpu")
    assert out is not None
    assert out["seq"].sharding_types == ["table_wise", "column_wise", "table_column_wise"]
    assert "data_parallel" in out["bag"].sharding_types
    assert "row_wise" not in out["bag"].sharding_types
    mine = {"bag": ParameterConstraints(sharding_types=["row_wise", "table_wise"])}
    assert device_constraints(model, mine, "cpu")["bag"].sharding_types == ["table_wise"]
    assert device_constraints(model, mine, "cuda") is mine
    # where gloo has a reduce-scatter: row-wise types when asked; the default offer unchanged
    rs = device_constraints(model, mine, "cpu", reduce_scatter=True)
    assert rs["bag"].sharding_types == ["row_wise", "table_wise"]
    assert device_constraints(model, None, "cpu", reduce_scatter=True) == out
    grid = {"bag": ParameterConstraints(sharding_types=["grid_shard", "table_row_wise"])}
    assert device_constraints(model, grid, "cpu", reduce_scatter=True)["bag"].sharding_types == [
        "grid_shard",
        "table_row_wise",
    ]
    with pytest.raises(ValueError, match=r"'bag'.*cannot run on CPU"):
        device_constraints(model, grid, "cpu")
    with pytest.raises(ValueError, match=r"'seq'.*cannot run on CPU"):
        device_constraints(
            model, {"seq": ParameterConstraints(sharding_types=["data_parallel"])}, "cpu"
        )


def test_an_explicit_data_parallel_embedding_collection_plan_is_refused_on_cpu() -> None:
    model = _ec_model()
    data_parallel = ParameterSharding(
        sharding_type="data_parallel", compute_kernel="dense", ranks=[0]
    )
    plan = ShardingPlan({"ec": EmbeddingModuleShardingPlan({"seq": data_parallel})})
    with pytest.raises(ValueError, match=r"'seq' of module 'ec' \(an EmbeddingCollection table\)"):
        check_plan(plan, 1, "cpu", model)
    check_plan(plan, 1, "cuda", model)  # the refusal is about CPU


def test_stochastic_weight_averaging_is_refused_naming_it(tmp_path) -> None:
    swa = StochasticWeightAveraging(swa_lrs=0.01)
    trainer = cpu_trainer(max_steps=2, callbacks=[swa], default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="StochasticWeightAveraging keeps an averaged deep copy"):
        trainer.fit(tiny_dlrm(), datamodule=tiny_data(200, 2, batch_size=16, train_batches=4))


class FreezeDense(BaseFinetuning):
    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.model_and_loss.model.dense_arch)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        pass


def test_base_finetuning_with_fused_tables_is_refused_naming_it(tmp_path) -> None:
    trainer = cpu_trainer(max_steps=2, callbacks=[FreezeDense()], default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="FreezeDense \\(a BaseFinetuning\\) records the"):
        trainer.fit(tiny_dlrm(), datamodule=tiny_data(200, 2, batch_size=16, train_batches=4))


def test_model_pruning_of_tables_is_refused_naming_them_and_dense_pruning_trains(tmp_path) -> None:
    # The default targets every weight: it trained a whole epoch, then failed on meta tensors.
    data = tiny_data(200, 2, batch_size=16, train_batches=4)
    pruning = ModelPruning("l1_unstructured", amount=0.5)
    trainer = cpu_trainer(max_epochs=1, callbacks=[pruning], default_root_dir=tmp_path)
    tables = rf"'{EBC}.embedding_bags.t_cat_0.weight', '{EBC}.embedding_bags.t_cat_1.weight'"
    with pytest.raises(
        ValueError, match=rf"ModelPruning would prune embedding-table .*\[{tables}\]"
    ):
        trainer.fit(tiny_dlrm(), datamodule=data)
    model = tiny_dlrm()
    layer = model.model_and_loss.model.over_arch.model[-1]
    pruning = ModelPruning("l1_unstructured", parameters_to_prune=[(layer, "weight")], amount=0.5)
    trainer = cpu_trainer(max_epochs=1, callbacks=[pruning], default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    assert int((layer.weight == 0).sum()) >= layer.weight.numel() // 2


def test_tower_sharding_is_refused_on_cpu_naming_the_tower() -> None:
    """TorchRec's tower sharders wrap each tower in DDP(device_ids=[device]): CUDA only."""
    from torchrec.modules.embedding_tower import EmbeddingTower

    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])
    ]
    model = nn.Module()
    model.tower_0 = EmbeddingTower(
        EmbeddingBagCollection(tables=tables, device=torch.device("meta")), nn.Identity()
    )
    plan = plan_of({"t0": sharding()}, module="tower_0")
    with pytest.raises(ValueError, match=r"'tower_0' as a EmbeddingTower, which needs CUDA"):
        check_plan(plan, 2, "cpu", model)
    check_plan(plan, 2, "cuda", model)
    check_plan(plan_of({"t0": sharding()}, module="tower_0.embedding"), 2, "cpu", model)
