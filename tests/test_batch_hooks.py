"""LightningModule/DataModule batch hooks, and gradient accumulation set after setup (one rank).

A module overriding ``on_before_batch_transfer``, ``transfer_batch_to_device`` or
``on_after_batch_transfer`` trains and evaluates on the batches as its hooks leave them, and
the batch checks judge those batches: under ``pipeline="auto"`` it trains without a pipeline, a
named pipeline is refused at setup. A ``GradientAccumulationScheduler`` meets the refusals of
``accumulate_grad_batches``, at setup; a change made later is refused at the next step.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import DLRMClickModule, SyntheticClickData, TorchRecStrategy
from lightning_torchrec.errors import BatchValidationError
from lightning_torchrec.lightning.trainer_setup import BATCH_HOOKS, accumulation, batch_hooks
from lightning_torchrec.training.pipelines import PipelineConfig
from lightning_torchrec.training.steps import StepMode, StepRunner, choose_mode
from tests.helpers import assert_same, load_ranks, run_script
from tests.scripts.factory import ROWS, cpu_trainer, table_wise, tiny_data, tiny_dlrm

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def shifted(batch: Any, fn: Any) -> Any:
    """``batch`` with ``fn`` applied to its sparse ids (a new batch object)."""
    kjt = batch.sparse_features
    ids = KeyedJaggedTensor(keys=kjt.keys(), values=fn(kjt.values()), lengths=kjt.lengths())
    return dataclasses.replace(batch, sparse_features=ids)


class Recording(DLRMClickModule):
    """Records, per stage, the batches its hook made and those its steps got."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.made: list[Any] = []
        self.got: list[Any] = []

    def hooked(self, batch: Any) -> Any:
        self.made.append(shifted(batch, lambda v: v % ROWS))  # hashes ids into the tables
        return self.made[-1]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.got.append(batch)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.got.append(batch)
        return super().validation_step(batch, batch_idx)


class AfterTransfer(Recording):
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.hooked(batch)


class Transfer(Recording):
    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        return self.hooked(super().transfer_batch_to_device(batch, device, dataloader_idx))


class BeforeTransfer(Recording):
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.hooked(batch)


class Breaks(DLRMClickModule):
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return shifted(batch, lambda v: v + ROWS)  # every id out of its table


class BreaksData(SyntheticClickData):
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return shifted(batch, lambda v: v + ROWS)


@pytest.mark.parametrize("cls", [AfterTransfer, Transfer, BeforeTransfer])
def test_the_step_trains_and_is_checked_on_the_batch_the_hooks_left(cls: type) -> None:
    model = tiny_dlrm(cls=cls)
    strategy = TorchRecStrategy(constraints=table_wise(2), pipeline=None, log_plan=False)
    trainer = cpu_trainer(strategy, max_steps=4, limit_val_batches=2, val_check_interval=2)
    # The loader's ids reach 2 * ROWS - 1; only the hook's `% ROWS` puts them in the tables.
    data = tiny_data(2 * ROWS)  # its loaders (a DataModule's hooks would stand in for the model's)
    trainer.fit(model, data.train_dataloader(), data.val_dataloader())
    assert trainer.global_step == 4
    assert strategy._runner.transformed and strategy.pipeline_in_use is None
    assert len(model.got) == 4 + 2 * 2  # training steps, then two validations of two batches
    assert len(model.made) == len(model.got)  # the hook ran for every batch, every stage
    for made, got in zip(model.made, model.got, strict=True):
        assert got is made  # the step got the hook's batch
        assert int(got.sparse_features.values().max()) < ROWS


@pytest.mark.parametrize("validate", [False, True])
def test_ids_a_hook_breaks_are_refused_naming_the_feature(validate: bool) -> None:
    strategy = TorchRecStrategy(constraints=table_wise(2), pipeline=None, log_plan=False)
    trainer = cpu_trainer(strategy, max_steps=2, limit_val_batches=1 if validate else 0)
    with pytest.raises(BatchValidationError, match=r"feature 'cat_0'.*>= num_embeddings=200"):
        if validate:  # the DataModule's hook, in evaluation
            data = BreaksData(num_embeddings=ROWS, num_sparse_features=2, val_batches=2)
            trainer.validate(tiny_dlrm(), datamodule=data)
        else:
            trainer.fit(tiny_dlrm(cls=Breaks), tiny_data().train_dataloader())


def fit_settings(module: Any, datamodule: Any = None, **kwargs: Any) -> SimpleNamespace:
    defaults = dict(callbacks=[], accumulate_grad_batches=1)
    return SimpleNamespace(lightning_module=module, datamodule=datamodule, **(defaults | kwargs))


def pipeline_for(
    config: PipelineConfig, device: torch.device, fit: Any, fitting: bool, ahead: bool = False
) -> str | None:
    """The pipeline the strategy's one decision gives a fit with ``fit``'s settings."""
    hooks, accumulates = batch_hooks(fit), accumulation(fit)
    world = {"world_size": 2, "vote_ahead": True} if ahead else {}
    return choose_mode(
        config, device, fitting=fitting, hooks=hooks, accumulation=accumulates, **world
    ).pipeline


def votes_ahead(fit: Any) -> bool:
    auto = PipelineConfig.parse("auto", None)
    hooks = batch_hooks(fit)
    return choose_mode(auto, CPU, world_size=2, vote_ahead=True, hooks=hooks).ahead


@pytest.mark.parametrize("cls", [AfterTransfer, Transfer, BeforeTransfer])
def test_auto_trains_without_a_pipeline_for_a_hooked_module(
    cls: type, caplog: pytest.LogCaptureFixture
) -> None:
    auto = PipelineConfig.parse("auto", None)
    plain = fit_settings(tiny_dlrm())
    assert batch_hooks(plain) == []  # the package's own modules keep the held host batch
    assert pipeline_for(auto, CPU, plain, True, ahead=True) == "sparse_dist"
    assert pipeline_for(auto, CUDA, plain, False) == "sparse_dist"
    hooked = fit_settings(tiny_dlrm(cls=cls))
    (hook,) = [h for h in BATCH_HOOKS if h in cls.__dict__]
    assert batch_hooks(hooked) == [f"{cls.__name__}.{hook}"]
    assert votes_ahead(plain) and not votes_ahead(hooked)
    with caplog.at_level(logging.INFO, logger="lightning_torchrec.training.steps"):
        assert pipeline_for(auto, CPU, hooked, True, ahead=True) is None
        assert pipeline_for(auto, CUDA, hooked, False) is None  # evaluation too
    assert f"pipeline='auto' trains without a pipeline: {cls.__name__}.{hook}" in caplog.text
    datamodule = fit_settings(tiny_dlrm(), BreaksData())
    assert batch_hooks(datamodule) == ["BreaksData.on_before_batch_transfer"]
    assert pipeline_for(auto, CUDA, datamodule, True, ahead=True) is None


@pytest.mark.parametrize("pipeline", ["sparse_dist", "semi_sync"])
def test_a_named_pipeline_with_a_batch_hook_is_refused_naming_it(pipeline: str) -> None:
    strategy = TorchRecStrategy(constraints=table_wise(2), pipeline=pipeline, log_plan=False)
    model = tiny_dlrm(cls=AfterTransfer)
    with pytest.raises(
        ValueError,
        match=rf"pipeline='{pipeline}' cannot run with AfterTransfer.on_after_batch_transfer.*"
        r"collate_fn.*pipeline=None",
    ):
        cpu_trainer(strategy, max_steps=2).fit(model, datamodule=tiny_data())
    assert model.made == []
    named = PipelineConfig.parse(pipeline, None)
    with pytest.raises(ValueError, match="Transfer.transfer_batch_to_device"):  # evaluation too
        pipeline_for(named, CPU, fit_settings(tiny_dlrm(cls=Transfer)), False)


def test_a_transformed_runner_checks_the_steps_own_batch() -> None:
    def runner(**kwargs: Any) -> StepRunner:
        return StepRunner(torch.nn.Linear(1, 1), CPU, specs={}, dense_width=None, **kwargs)

    plain, hooked = runner(mode=StepMode(ahead=True)), runner(transformed=True)
    plain.start_fit()
    hooked.start_fit()
    assert plain.vote_ahead and plain.guard.token
    assert not hooked.vote_ahead and hooked.guard.token is None  # no worker verdict trusted
    loader = torch.utils.data.DataLoader(range(4), num_workers=1)
    collate = loader.collate_fn
    hooked.feed(loader, True)
    assert loader.collate_fn is collate  # its workers check nothing
    assert hooked.hold("host batch", True) is False and hooked._checked("step batch") == (
        "step batch"
    )
    for mode in (StepMode("sparse_dist"), StepMode(ahead=True)):
        with pytest.raises(ValueError, match="use pipeline=None without the vote ahead"):
            runner(transformed=True, mode=mode)


def accumulating(strategy: TorchRecStrategy, *callbacks: Callback) -> L.Trainer:
    return cpu_trainer(strategy, max_epochs=2, limit_val_batches=0, callbacks=list(callbacks))


def test_an_accumulation_scheduler_meets_the_refusals_at_setup() -> None:
    scheduler = GradientAccumulationScheduler({1: 4})
    strategy = TorchRecStrategy(constraints=table_wise(2), pipeline=None, log_plan=False)
    with pytest.raises(
        ValueError,
        match=r"GradientAccumulationScheduler\(\{0: 1, 1: 4\}\) \(accumulate_grad_batches=4 "
        r"from epoch 1\) does not apply.*allow_fused_gradient_accumulation=True",
    ):
        accumulating(strategy, scheduler).fit(tiny_dlrm(), datamodule=tiny_data())
    for pipeline in ("sparse_dist", "semi_sync"):
        strategy = TorchRecStrategy(
            constraints=table_wise(2),
            pipeline=pipeline,
            allow_fused_gradient_accumulation=True,
            log_plan=False,
        )
        trainer = accumulating(strategy, GradientAccumulationScheduler({1: 4}))
        with pytest.raises(ValueError, match=r"epoch 1\) cannot combine with a train pipeline"):
            trainer.fit(tiny_dlrm(), datamodule=tiny_data())
    auto = PipelineConfig.parse("auto", None)
    settings = fit_settings(tiny_dlrm(), callbacks=[GradientAccumulationScheduler({2: 3})])
    assert pipeline_for(auto, CPU, settings, True, ahead=True) is None


def test_an_accumulation_scheduler_trains_with_the_opt_in() -> None:
    strategy = TorchRecStrategy(
        constraints=table_wise(2),
        pipeline=None,
        allow_fused_gradient_accumulation=True,
        log_plan=False,
    )
    trainer = accumulating(strategy, GradientAccumulationScheduler({1: 4}))
    trainer.fit(tiny_dlrm(), datamodule=tiny_data())
    assert trainer.global_step == 8 + 8 // 4


class Accumulates(Callback):
    """Turns gradient accumulation on at epoch 1, behind the strategy's back."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            trainer.accumulate_grad_batches = 2


def test_accumulation_changed_during_the_fit_is_refused_at_the_next_step() -> None:
    strategy = TorchRecStrategy(constraints=table_wise(2), pipeline=None, log_plan=False)
    trainer = accumulating(strategy, Accumulates())
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2 \(set at epoch 1\) does not"):
        trainer.fit(tiny_dlrm(), datamodule=tiny_data())
    assert trainer.global_step == 8  # the first epoch, then refused before the next forward


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("batch_hooks")
    run_script("batch_hooks_ranks.py", str(out), timeout=300)
    return out


def test_two_ranks_under_auto_run_the_hooks_on_every_batch_unpipelined(two_ranks: Path) -> None:
    for r in load_ranks(two_ranks, "hashed"):
        assert r["pipeline"] is None and r["steps"] == 6
        # Six steps, two validations of this rank's two batches, predict on them.
        assert r["calls"] == {"train": 6, "val": 4, "predict": 2}
        assert r["predictions"] == 2
        assert r["not_made"] == 0 and r["max_id"] < ROWS  # trained on the hook's batches


def test_two_ranks_train_the_hooks_batches_as_the_pipelined_fast_path_would(
    two_ranks: Path,
) -> None:
    copied, plain = load_ranks(two_ranks, "copied"), load_ranks(two_ranks, "plain")
    for rank in range(2):
        assert copied[rank]["pipeline"] is None and plain[rank]["pipeline"] == "sparse_dist"
        assert copied[rank]["not_made"] == 0
        assert_same(copied[rank]["losses"], plain[rank]["losses"], f"rank{rank}/losses")
        assert_same(copied[rank]["state"], plain[rank]["state"], f"rank{rank}/state")
