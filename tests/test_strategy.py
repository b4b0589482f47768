"""Single-process (world size 1) tests of TorchRecStrategy: refusals, generic modules, LR push."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.plugins.precision import MixedPrecision
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from lightning_torchrec import (
    DenseAndFusedOptimizer,
    TorchRecStrategy,
    dense_parameters,
)
from tests.scripts.factory import (
    ROWS,
    cpu_trainer,
    sharding_constraints,
    table_wise,
    tiny_data,
    tiny_dlrm,
)
from tests.scripts.rank_state import kernel_lrs

ITEM_USER = ["item_table", "user_table"]


def trainer(strategy: Any = None, **kwargs: Any) -> L.Trainer:
    return cpu_trainer(strategy, **({"max_steps": 3, "limit_val_batches": 0} | kwargs))


def tbe_learning_rates(module: L.LightningModule) -> list[float]:
    """The learning rate each fused kernel (TBE) will use in its next backward."""
    fused = module.trainer.optimizers[0].fused
    return kernel_lrs(fused) if fused is not None else []


def test_strategy_by_name_trains() -> None:
    model = tiny_dlrm()
    t = trainer(strategy="torchrec")
    assert isinstance(t.strategy, TorchRecStrategy)
    t.fit(model, datamodule=tiny_data())
    assert t.global_step == 3
    assert isinstance(t.optimizers[0], DenseAndFusedOptimizer)


def _gloo_without_reduce_scatter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes this process's gloo behave as one before torch 2.2: no reduce-scatter."""
    import torch.distributed as dist

    def missing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

    monkeypatch.setattr(dist, "reduce_scatter_tensor", missing)


def test_row_wise_on_cpu_runs_where_gloo_can_and_is_refused_naming_the_table_where_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    constraints = sharding_constraints({"t_cat_1": "row_wise"})
    t = trainer(TorchRecStrategy(constraints=constraints))
    t.fit(tiny_dlrm(), datamodule=tiny_data())  # this stack's gloo has a reduce-scatter
    assert t.global_step == 3
    assert t.strategy.plan_summary is not None
    assert "| t_cat_1 |" in (md := t.strategy.plan_summary.to_markdown()) and "row_wise" in md
    _gloo_without_reduce_scatter(monkeypatch)
    strategy = TorchRecStrategy(constraints=constraints)
    with pytest.raises(ValueError, match=r"'t_cat_1'.*needs CUDA or a gloo with.*table_wise"):
        trainer(strategy).fit(tiny_dlrm(), datamodule=tiny_data())


def test_explicit_row_wise_plan_is_refused_where_gloo_has_no_reduce_scatter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchrec.distributed.planner.types import Topology

    from lightning_torchrec.sharding.planning import default_sharders, make_planner

    model, row_wise = tiny_dlrm(), sharding_constraints({"t_cat_0": "row_wise"})
    topology = Topology(world_size=2, compute_device="cuda", local_world_size=2)
    plan = make_planner(model, topology, row_wise).plan(model, default_sharders(None))
    _gloo_without_reduce_scatter(monkeypatch)
    with pytest.raises(ValueError, match="needs CUDA"):
        trainer(TorchRecStrategy(plan=plan)).fit(tiny_dlrm(), datamodule=tiny_data())


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_whole_model_precisions_are_refused(precision: str) -> None:
    with pytest.raises(ValueError, match="bf16-mixed"):
        trainer(precision=precision).fit(tiny_dlrm(), datamodule=tiny_data())


def test_fp16_grad_scaler_with_fused_tables_is_refused() -> None:
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="scaled"):
        trainer(plugins=[scaler]).fit(tiny_dlrm(), datamodule=tiny_data())


def test_bf16_mixed_trains() -> None:
    t = trainer(precision="bf16-mixed")
    t.fit(tiny_dlrm(), datamodule=tiny_data())
    assert t.global_step == 3


def test_gradient_accumulation_with_fused_tables_needs_opt_in() -> None:
    with pytest.raises(ValueError, match="allow_fused_gradient_accumulation=True"):
        trainer(accumulate_grad_batches=2).fit(tiny_dlrm(), datamodule=tiny_data())
    strategy = TorchRecStrategy(constraints=table_wise(2), allow_fused_gradient_accumulation=True)
    t = trainer(strategy, accumulate_grad_batches=2, max_steps=2)
    t.fit(tiny_dlrm(), datamodule=tiny_data())
    assert t.global_step == 2


def test_sharders_and_fused_params_together_are_refused() -> None:
    from lightning_torchrec.sharding.planning import default_sharders

    with pytest.raises(ValueError, match="fused_params"):
        TorchRecStrategy(sharders=default_sharders(None), fused_params={"learning_rate": 0.1})


class PlainEBCModule(L.LightningModule):
    """A user's own LightningModule: not built on TorchRecModule, plain torch optimizer."""

    def __init__(self, dense_only: bool = True) -> None:
        super().__init__()
        self.dense_only = dense_only
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="item_table", embedding_dim=4, num_embeddings=ROWS, feature_names=["cat_0"]
                ),
                EmbeddingBagConfig(
                    name="user_table", embedding_dim=4, num_embeddings=ROWS, feature_names=["cat_1"]
                ),
            ],
            device=torch.device("meta"),
        )
        self.head = torch.nn.Linear(8 + 13, 1)
        self.seen_lrs: list[tuple[float, list[float]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.trainer.optimizers[0]
        fused_lrs = tbe_learning_rates(self)
        self.seen_lrs.append((opt.param_groups[-1]["lr"], fused_lrs))
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.head(torch.cat([pooled, batch.dense_features], dim=1)).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.ebc(batch.sparse_features).values()

    def configure_optimizers(self) -> Any:
        params = dense_parameters(self) if self.dense_only else self.parameters()
        opt = torch.optim.SGD(params, lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_any_lightning_module_with_ebc_trains_and_gets_a_combined_optimizer() -> None:
    model = PlainEBCModule()
    t = trainer(strategy=TorchRecStrategy(constraints=table_wise(ITEM_USER)))
    head_before = model.head.weight.detach().clone()
    with pytest.warns(UserWarning, match="drives the dense optimizer only"):
        t.fit(model, datamodule=tiny_data())
    assert [kernel for _, kernel in model.seen_lrs] == [pytest.approx([0.01])] * 3
    opt = t.optimizers[0]
    assert isinstance(opt, DenseAndFusedOptimizer) and opt.fused is not None
    assert not torch.equal(head_before, model.head.weight)
    # The scheduler drove the dense LR; the fused LR stayed at the strategy's default.
    assert opt.dense_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_dense_optimizer_holding_tables_is_refused_naming_them() -> None:
    strategy = TorchRecStrategy(constraints=table_wise(ITEM_USER))
    with pytest.raises(ValueError, match=r"ebc\.embedding_bags\.item_table\.weight.*dense_param"):
        trainer(strategy).fit(PlainEBCModule(dense_only=False), datamodule=tiny_data())


def test_constraints_for_unknown_tables_are_refused_with_close_names() -> None:
    strategy = TorchRecStrategy(constraints=table_wise(["item_tabel"]))
    with pytest.raises(ValueError, match=r"\['item_tabel'\].*'item_table'"):
        trainer(strategy).fit(PlainEBCModule(), datamodule=tiny_data())


def test_scheduled_fused_lr_reaches_the_kernel_before_each_forward() -> None:
    class Scheduled(PlainEBCModule):
        def configure_optimizers(self) -> Any:
            from lightning_torchrec import combine_optimizers

            opt = combine_optimizers(torch.optim.SGD(dense_parameters(self), lr=0.1), self)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    model = Scheduled()
    t = trainer(
        strategy=TorchRecStrategy(
            fused_params={"learning_rate": 0.4, "optimizer": _rowwise_adagrad()},
            constraints=table_wise(ITEM_USER),
        ),
        max_steps=4,
    )
    t.fit(model, datamodule=tiny_data())
    expected = [0.4, 0.2, 0.1, 0.05]
    assert [group_lr for group_lr, _ in model.seen_lrs] == pytest.approx(expected)
    # What the kernel uses in this step's backward equals the scheduled LR of this step.
    assert [kernel[0] for _, kernel in model.seen_lrs] == pytest.approx(expected)


def _rowwise_adagrad() -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return EmbOptimType.EXACT_ROWWISE_ADAGRAD


def test_validate_and_predict_without_fit_shard_the_model() -> None:
    model, dm = tiny_dlrm(), tiny_data()
    t = trainer(limit_val_batches=2)
    metrics = t.validate(model, datamodule=dm, verbose=False)[0]
    assert 0.0 <= metrics["val/auroc"] <= 1.0
    dmp = t.strategy.dmp
    preds = t.predict(model, datamodule=dm)
    assert t.strategy.dmp is dmp, "the model is sharded once and reused"
    assert len(preds) == 2 and preds[0].shape == (32,)
    assert ((preds[0] > 0) & (preds[0] < 1)).all()


class Writer(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__("batch_and_epoch")
        self.batches: list[Any] = []
        self.epoch: Any = None

    def write_on_batch_end(self, trainer: Any, module: Any, prediction: Any, *args: Any) -> None:
        self.batches.append(args[0])  # batch_indices

    def write_on_epoch_end(self, trainer: Any, module: Any, predictions: Any, indices: Any) -> None:
        self.epoch = indices


def test_a_prediction_writer_gets_the_index_of_each_synthetic_batch() -> None:
    # Whole batches: Lightning records indices only through a batch sampler (one batch each).
    dm, writer = tiny_data(test_batches=3), Writer()
    preds = trainer(callbacks=[writer]).predict(tiny_dlrm(), datamodule=dm)
    assert writer.batches == [[0], [1], [2]] and writer.epoch == [[[0], [1], [2]]]
    expected = [dm.dataset("predict")[k] for k in range(3)]
    assert [p.shape[0] for p in preds] == [b.labels.shape[0] for b in expected]


def test_tables_built_off_meta_keep_their_values_in_the_shards() -> None:
    from lightning_torchrec.sharding.layout import shard_info
    from lightning_torchrec.sharding.tables import embedding_tables

    model = PlainEBCModule()
    cfgs = model.ebc.embedding_bag_configs()
    model.ebc = EmbeddingBagCollection(tables=cfgs)  # materialised on CPU
    with torch.no_grad():
        for i, p in enumerate(model.ebc.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + 1000 * i)
    full = {k: t.detach().clone() for k, t in embedding_tables(model).items()}
    strategy = TorchRecStrategy(
        constraints={
            **sharding_constraints({"item_table": "column_wise"}, min_partition=2),
            **table_wise(["user_table"]),
        }
    )
    t = trainer(strategy, max_steps=1)
    with pytest.warns(UserWarning, match="built whole on every rank"):
        t.predict(model, datamodule=tiny_data())  # shards without training
    for key, table in embedding_tables(model).items():
        info = shard_info(table)
        for s in info.shards:
            rows, cols = s.tensor.shape
            expected = full[key][
                s.row_offset : s.row_offset + rows, s.col_offset : s.col_offset + cols
            ]
            assert torch.equal(s.tensor, expected), key


def test_data_parallel_tables_train_exactly_like_torch() -> None:
    """fbgemm warns its CPU dense lookup lacks an autograd kernel; the update is still exact."""
    import copy

    from lightning_torchrec.sharding.tables import embedding_tables

    class DP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name="dp", embedding_dim=4, num_embeddings=ROWS, feature_names=["cat_0"]
                    )
                ]
            )
            with torch.no_grad():
                w = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(0))
                self.ebc.embedding_bags["dp"].weight.copy_(w)
            self.head = torch.nn.Linear(4, 1)

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            logits = self.head(self.ebc(b.sparse_features).values()).squeeze(-1)
            return torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(dense_parameters(self), lr=1.0)

    dataset = tiny_data(num_tables=1).dataset("train")
    model = DP()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=1.0)
    for i in range(2):
        opt.zero_grad()
        reference.training_step(dataset[i], i).backward()
        opt.step()

    loader = torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False)
    strategy = TorchRecStrategy(constraints=sharding_constraints({"dp": "data_parallel"}))
    with pytest.warns(UserWarning, match="built whole on every rank"):  # values set above
        trainer(strategy, max_steps=2, use_distributed_sampler=False).fit(model, loader)
    (table,) = embedding_tables(model).values()
    expected = reference.ebc.embedding_bags["dp"].weight
    torch.testing.assert_close(table.detach(), expected.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(model.head.weight, reference.head.weight, rtol=0, atol=1e-6)


class _Toggling(L.LightningModule):
    """Lightning's manual pattern for two optimizers: toggle each around its own step."""

    def __init__(self, toggled: int) -> None:
        super().__init__()
        from tests.scripts.positional import Positional

        self.model = Positional()
        self.toggled = toggled
        self.automatic_optimization = False
        self.frozen: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()[self.toggled]  # type: ignore[index]
        self.toggle_optimizer(opt)
        self.frozen.append(self.model.head.bias.requires_grad)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.model(batch), batch.labels)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        self.untoggle_optimizer(opt)

    def configure_optimizers(self) -> Any:
        head = self.model.head
        return [torch.optim.SGD([head.weight], lr=0.1), torch.optim.SGD([head.bias], lr=0.1)]


def test_toggle_optimizer_leaves_fused_tables_trainable_and_refuses_to_freeze_them() -> None:
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

    from tests.scripts.positional import data

    def fit(toggled: int) -> _Toggling:
        module = _Toggling(toggled)
        # toggling changes which dense parameters each backward uses
        wrapper = DefaultDataParallelWrapper(static_graph=False, find_unused_parameters=True)
        strategy = TorchRecStrategy(
            constraints=table_wise(4), log_plan=False, data_parallel_wrapper=wrapper
        )
        cpu_trainer(strategy, max_steps=3).fit(module, datamodule=data())
        return module

    module = fit(0)  # the optimizer holding the fused tables: Lightning's toggle
    assert module.frozen == [False] * 3 and module.model.head.bias.requires_grad
    with pytest.raises(ValueError, match=r"optimizer 1 \(SGD\) cannot freeze .*'t_cat_3'"):
        fit(1)


def test_a_step_that_fetches_its_own_batches_is_refused_unless_it_runs_unchecked() -> None:
    from tests.scripts.positional import Positional, data

    class FromIterator(Positional):
        def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
            batch, _, _ = next(dataloader_iter)
            return super().training_step(batch, 0)

    def fit(**kwargs: Any) -> L.Trainer:
        strategy = TorchRecStrategy(constraints=table_wise(4), log_plan=False, **kwargs)
        trainer = cpu_trainer(strategy, max_steps=3, limit_val_batches=0)
        trainer.fit(FromIterator(), datamodule=data())
        return trainer

    # It used to fail as a batch "holding no KeyedJaggedTensor" (a pipeline: a bare TypeError).
    with pytest.raises(ValueError, match=r"training_step\(self, dataloader_iter\) fetches"):
        fit()
    assert fit(validate_batches=False, pipeline=None).global_step == 3
