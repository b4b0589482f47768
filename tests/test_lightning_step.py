"""Lightning's step loop as the strategy reads it (``compat.lightning_step``)."""

from __future__ import annotations

import types
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback


class _Seen(Callback):
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if idx == 2:  # a training_step without batch_idx from here on

            def step(self: Any, batch: Any) -> Any:
                self.indices.append(None)
                return type(self).training_step(self, batch, -1)

            pl_module.training_step = types.MethodType(step, pl_module)


def test_a_training_step_replaced_mid_fit_gets_lightnings_arguments() -> None:
    from lightning_torchrec import TorchRecStrategy
    from tests.scripts.factory import cpu_trainer, table_wise, tiny_data, tiny_dlrm

    module = tiny_dlrm()
    module.indices = []  # type: ignore[attr-defined]
    real = type(module).training_step

    def recording(self: Any, batch: Any, batch_idx: int) -> Any:
        self.indices.append(batch_idx)
        return real(self, batch, batch_idx)

    module.training_step = types.MethodType(recording, module)  # type: ignore[method-assign]
    seen = _Seen()
    trainer = cpu_trainer(
        TorchRecStrategy(constraints=table_wise(2), log_plan=False),
        max_steps=5,
        callbacks=[seen],
    )
    trainer.fit(module, datamodule=tiny_data(train_batches=8))
    # Lightning reads the new step's signature: no batch_idx for it, through the strategy too.
    assert module.indices == [0, 1, None, None, None]  # type: ignore[attr-defined]


def test_steps_without_batch_idx_are_run_at_lightnings_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The runner's read-ahead, vote coverage and uneven-data counts follow the batch index: a
    # `training_step(self, batch)` (Lightning passes it no index) must not be run at index 0.
    from lightning_torchrec import TorchRecStrategy
    from lightning_torchrec.training.steps import StepRunner
    from tests.scripts.factory import cpu_trainer, table_wise, tiny_data, tiny_dlrm

    module = tiny_dlrm()
    cls = type(module)

    def without_index(real: Any) -> Any:
        return types.MethodType(lambda self, batch: real(self, batch, 0), module)

    module.training_step = without_index(cls.training_step)  # type: ignore[method-assign]
    module.validation_step = without_index(cls.validation_step)  # type: ignore[method-assign]
    indices: dict[str, list[int]] = {"train": [], "eval": []}
    train_step, eval_step = StepRunner.train_step, StepRunner.eval_step

    def train(self: StepRunner, batch: Any, batch_idx: int, *args: Any) -> Any:
        indices["train"].append(batch_idx)
        return train_step(self, batch, batch_idx, *args)

    def evaluate(self: StepRunner, batch: Any, stage: str, batch_idx: int, *args: Any) -> Any:
        indices["eval"].append(batch_idx)
        return eval_step(self, batch, stage, batch_idx, *args)

    monkeypatch.setattr(StepRunner, "train_step", train)
    monkeypatch.setattr(StepRunner, "eval_step", evaluate)
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False)
    trainer = cpu_trainer(strategy, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=tiny_data(train_batches=3, val_batches=2))
    assert indices == {"train": [0, 1, 2, 0, 1, 2], "eval": [0, 1, 0, 1]}
