"""Norm callbacks in one process: cadence, loggers, errors, accumulation, validate-only runs."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import (
    EmbeddingNormCallback,
    ModelAndLoss,
    TorchRecModule,
    TorchRecStrategy,
    WeightNormCallback,
)
from lightning_torchrec.training.norms import l1_norm
from tests.scripts.factory import cpu_trainer, table_wise, tiny_data, tiny_dlrm


class RecordingLogger(Logger):
    """Keeps every log_metrics call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((int(step or 0), dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def steps_with(self, prefix: str) -> list[int]:
        return [s for s, m in self.calls if any(k.startswith(prefix) for k in m)]

    def last(self, prefix: str) -> dict[str, float]:
        return [
            {k: v for k, v in m.items() if k.startswith(prefix)}
            for _, m in self.calls
            if any(k.startswith(prefix) for k in m)
        ][-1]


def fit(callbacks: list, loggers: Any = None, **kwargs: Any) -> tuple[L.Trainer, Any]:
    model = tiny_dlrm()
    defaults: dict[str, Any] = dict(
        max_steps=6,
        logger=loggers if loggers is not None else [],
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer = cpu_trainer(**(defaults | kwargs))
    trainer.fit(model, datamodule=tiny_data())
    return trainer, model


def test_cadence_every_logger_and_exact_values() -> None:
    a, b = RecordingLogger(), RecordingLogger()
    _, model = fit(
        [WeightNormCallback(every_n_steps=2), EmbeddingNormCallback(every_n_steps=3)],
        loggers=[a, b],
    )
    assert a.steps_with("model/") == [2, 4, 6]
    assert a.steps_with("embedding_norms/") == [3, 6]
    assert a.calls == b.calls, "every attached logger gets the same points"
    weights = a.last("model/")
    for name, p in model.named_parameters():
        assert weights[f"model/l2_norm/{name}"] == pytest.approx(float(p.detach().norm()), rel=1e-5)
    tables = a.last("embedding_norms/")
    assert set(tables) == {
        f"embedding_norms/t_cat_{i}-norm-{s}" for i in range(2) for s in ("0", "mean")
    }


def test_default_cadence_follows_log_every_n_steps() -> None:
    log = RecordingLogger()
    fit([WeightNormCallback()], loggers=[log], log_every_n_steps=3)
    assert log.steps_with("model/") == [3, 6]


def test_dict_mode_and_custom_function() -> None:
    log = RecordingLogger()
    name = "model_and_loss.model.over_arch.model.1.bias"
    _, model = fit([WeightNormCallback({name: l1_norm}, every_n_steps=6)], loggers=[log])
    assert log.last("model/") == {
        f"model/l1_norm/{name}": pytest.approx(
            float(model.get_parameter(name).detach().abs().sum())
        )
    }


def test_unknown_names_fail_at_start_with_close_names() -> None:
    with pytest.raises(KeyError, match="t_cat_1"):
        fit([EmbeddingNormCallback(tables=["t_cat_9", "t_cat_1"][:1])], loggers=[RecordingLogger()])
    with pytest.raises(KeyError, match="over_arch"):
        fit(
            [WeightNormCallback({"model_and_loss.model.over_arch.model.1.bais": l1_norm})],
            loggers=[RecordingLogger()],
        )


def test_no_logger_fails_at_start() -> None:
    with pytest.raises(MisconfigurationException, match="attach a logger"):
        fit([EmbeddingNormCallback()], loggers=False)


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError):
        WeightNormCallback(every_n_steps=0)
    with pytest.raises(ValueError):
        EmbeddingNormCallback(sample_size=0)
    with pytest.raises(TypeError):
        WeightNormCallback(how_to_log=3)  # type: ignore[arg-type]


def test_gradient_accumulation_logs_each_step_once() -> None:
    log = RecordingLogger()
    strategy = TorchRecStrategy(constraints=table_wise(2), allow_fused_gradient_accumulation=True)
    fit(
        [WeightNormCallback(every_n_steps=1)],
        loggers=[log],
        strategy=strategy,
        accumulate_grad_batches=2,
        max_steps=3,
    )
    assert log.steps_with("model/") == [1, 2, 3]


def test_fast_dev_run_works() -> None:
    trainer, _ = fit(
        [WeightNormCallback(), EmbeddingNormCallback()],
        loggers=[RecordingLogger()],
        fast_dev_run=2,
        max_steps=-1,
    )
    assert trainer.global_step == 2


def test_validation_only_run_logs_once_at_its_step() -> None:
    log = RecordingLogger()
    trainer = cpu_trainer(
        logger=[log],
        limit_val_batches=1,
        callbacks=[WeightNormCallback(), EmbeddingNormCallback()],
    )
    trainer.validate(tiny_dlrm(), datamodule=tiny_data(), verbose=False)
    assert log.steps_with("model/") == [0]
    assert log.steps_with("embedding_norms/") == [0]
    assert all(torch.isfinite(torch.tensor(v)) for v in log.last("embedding_norms/").values())


def test_resumed_run_logs_no_duplicate_or_stale_points(tmp_path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    first = RecordingLogger()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    fit(
        [WeightNormCallback(every_n_steps=2), ckpt],
        loggers=[first],
        max_steps=4,
        enable_checkpointing=True,
    )
    assert first.steps_with("model/") == [2, 4]
    resumed = RecordingLogger()
    trainer = cpu_trainer(
        max_steps=8,
        logger=[resumed],
        default_root_dir=tmp_path,
        limit_val_batches=0,
        callbacks=[WeightNormCallback(every_n_steps=2)],
    )
    trainer.fit(tiny_dlrm(), datamodule=tiny_data(), ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    assert resumed.steps_with("model/") == [6, 8]


def test_nonfinite_norms_are_reported_as_such() -> None:
    from lightning_torchrec.sharding.layout import shard_info
    from lightning_torchrec.sharding.tables import embedding_tables

    class Poison(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                with torch.no_grad():
                    pl_module.model_and_loss.model.over_arch.model[1].bias.fill_(float("nan"))
                    table = embedding_tables(pl_module)[
                        "model_and_loss.model.sparse_arch.embedding_bag_collection"
                        ".embedding_bags.t_cat_0.weight"
                    ]
                    shard_info(table).shards[0].tensor.fill_(float("inf"))

    log = RecordingLogger()
    callbacks = [
        Poison(),
        WeightNormCallback(every_n_steps=2),
        EmbeddingNormCallback(every_n_steps=2),
    ]
    strategy = TorchRecStrategy(constraints=table_wise(2), check_finite_checkpoints=False)
    with pytest.warns(UserWarning, match="Non-finite norms at step 2"):
        fit(callbacks, loggers=[log], max_steps=2, strategy=strategy)
    weights, tables = log.last("model/"), log.last("embedding_norms/")
    assert math.isnan(weights["model/l2_norm/model_and_loss.model.over_arch.model.1.bias"])
    assert math.isinf(tables["embedding_norms/t_cat_0-norm-mean"])
    assert math.isfinite(tables["embedding_norms/t_cat_1-norm-mean"])


def test_the_last_step_is_logged_when_max_steps_or_max_epochs_end_the_fit() -> None:
    for stop in ({"max_steps": 7}, {"max_steps": -1, "max_epochs": 1, "limit_train_batches": 7}):
        logger = RecordingLogger()
        callbacks = [WeightNormCallback(every_n_steps=5), EmbeddingNormCallback(every_n_steps=5)]
        fit(callbacks, [logger], **stop)
        assert logger.steps_with("model/") == [5, 7], stop
        assert logger.steps_with("embedding_norms/") == [5, 7], stop


class TwoCollections(torch.nn.Module):
    """Two EBCs whose tables share the name ``t0`` (unique within each collection)."""

    def __init__(self) -> None:
        super().__init__()
        self.user, self.item = (
            EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=200,
                                           feature_names=[feature])],
                device=torch.device("meta"),
            )
            for feature in ("cat_0", "cat_1")
        )  # fmt: skip
        self.over = torch.nn.Linear(13 + 8, 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        u = self.user(KeyedJaggedTensor.from_jt_dict({"cat_0": kjt["cat_0"]}))
        i = self.item(KeyedJaggedTensor.from_jt_dict({"cat_1": kjt["cat_1"]}))
        return self.over(torch.cat([dense, u["cat_0"], i["cat_1"]], 1)).squeeze(1)


def test_tables_of_one_name_in_two_collections_are_both_logged() -> None:
    logger = RecordingLogger()
    module = TorchRecModule(ModelAndLoss(TwoCollections()), train_metrics_every_n_steps=0)
    trainer = cpu_trainer(
        TorchRecStrategy(log_plan=False),
        max_steps=2,
        logger=[logger],
        limit_val_batches=0,
        callbacks=[EmbeddingNormCallback(every_n_steps=2)],
    )
    trainer.fit(module, datamodule=tiny_data())
    logged = logger.last("embedding_norms/")
    keys = {
        "model_and_loss.model.user.embedding_bags.t0",
        "model_and_loss.model.item.embedding_bags.t0",
    }
    assert set(logged) == {f"embedding_norms/{k}-norm-{s}" for k in keys for s in ("0", "mean")}
    assert len(set(logged.values())) == 2  # two tables, two values
    with pytest.raises(KeyError, match="several collections have"):
        EmbeddingNormCallback(tables=["t0"])._prepare(trainer, module)


def test_log_every_n_steps_zero_logs_the_last_step_only() -> None:
    """Trainer(log_every_n_steps=0) turns the cadence off (it divided by zero at step 1)."""
    log = RecordingLogger()
    fit([WeightNormCallback(), EmbeddingNormCallback()], loggers=[log], log_every_n_steps=0)
    assert log.steps_with("model/") == [6]
    assert log.steps_with("embedding_norms/") == [6]


def test_a_callable_returning_several_numbers_is_refused_naming_the_parameters() -> None:
    weight = r"'model/<lambda>/model_and_loss\.model\.over_arch\.model\.1\.weight': \(4,\)"
    with pytest.raises(ValueError, match=rf"to one number.*{weight}"):
        fit(
            [WeightNormCallback(lambda t: t.abs().mean(0), every_n_steps=1)],
            loggers=[RecordingLogger()],
            max_steps=1,
        )


def test_a_sample_size_written_as_a_float_samples_that_many_rows() -> None:
    """sample_size=50.0 on 200-row tables failed at the first logging step (a float slice)."""
    log = RecordingLogger()
    fit([EmbeddingNormCallback(sample_size=50.0, every_n_steps=6)], loggers=[log])
    assert set(log.last("embedding_norms/")) == {
        f"embedding_norms/t_cat_{i}-norm-{s}" for i in range(2) for s in ("0", "mean")
    }
    with pytest.raises(TypeError, match="whole number of rows"):
        EmbeddingNormCallback(sample_size=2.5)


def test_a_callable_returning_none_is_refused_naming_it_and_the_parameters() -> None:
    """It failed in torch.as_tensor with "Could not infer dtype of NoneType", naming nothing."""
    bias = r"'model/forgot_return/model_and_loss\.model\.over_arch\.model\.1\.bias'"
    with pytest.raises(ValueError, match=rf"to one number.*test_callbacks\.forgot_return .*{bias}"):
        fit([WeightNormCallback(forgot_return, every_n_steps=1)], [RecordingLogger()], max_steps=1)
    with pytest.raises(TypeError, match=r"to one number.*not numbers: \{'model/<lambda>/.*'str'"):
        fit(
            [WeightNormCallback(lambda t: "0.5", every_n_steps=1)], [RecordingLogger()], max_steps=1
        )


def forgot_return(tensor: torch.Tensor) -> None:
    """A reduction without its ``return``."""
    tensor.norm()


def test_tables_that_select_nothing_or_a_table_twice_are_refused() -> None:
    """tables=[] logged nothing, "t_cat_0" became ['t', '_', ...], and duplicates were merged."""
    with pytest.raises(
        ValueError, match=r"tables=\[\]\) selects no table; tables=None means every"
    ):
        EmbeddingNormCallback(tables=[])
    with pytest.raises(TypeError, match=r"one string, not a list.*write tables=\['t_cat_0'\]"):
        EmbeddingNormCallback(tables="t_cat_0")
    with pytest.raises(ValueError, match=r"names these tables twice: \['t_cat_1'\]"):
        EmbeddingNormCallback(tables=["t_cat_1", "t_cat_0", "t_cat_1"])
    key = "model_and_loss.model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"
    alias = EmbeddingNormCallback(tables=["t_cat_0", key])
    with pytest.raises(ValueError, match=rf"more than once: {{'t_cat_0': \['t_cat_0', '{key}'\]}}"):
        alias._prepare(None, tiny_dlrm())  # type: ignore[arg-type]
    assert EmbeddingNormCallback(tables=("t_cat_0",)).tables == ["t_cat_0"]
