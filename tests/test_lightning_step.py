"""Lightning's per-step work the strategy trims (``compat.lightning_step``): same results."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_torchrec.compat.lightning_step import StepKwargs, UndividedClosureResult


class _Loop:
    """What :class:`StepKwargs` reads of a training epoch loop."""

    def __init__(self, module: Any) -> None:
        self.trainer = types.SimpleNamespace(lightning_module=module)


class _Module:
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return batch


def test_step_kwargs_read_each_training_step_once_and_anew_when_it_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning_torchrec.compat.lightning_step as trims

    reads: list[Any] = []
    real = trims.is_param_in_hook_signature

    def counted(fx: Any, *args: Any, **kwargs: Any) -> bool:
        reads.append(fx)
        return real(fx, *args, **kwargs)

    monkeypatch.setattr(trims, "is_param_in_hook_signature", counted)
    module = _Module()
    build = StepKwargs(_Loop(module))
    for i in range(3):
        assert dict(build(trims.OrderedDict(), "b", i)) == {"batch": "b", "batch_idx": i}
    assert len(reads) == 1

    module.training_step = lambda batch: batch  # type: ignore[method-assign]  # no batch_idx
    assert dict(build(trims.OrderedDict(), "b", 3)) == {"batch": "b"}
    assert dict(build(trims.OrderedDict(), "b", 4)) == {"batch": "b"}
    assert len(reads) == 2

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, batch: Any, batch_idx: int) -> Any:
            return batch

    module.training_step = Unhashable()  # type: ignore[method-assign]
    assert dict(build(trims.OrderedDict(), "b", 5)) == {"batch": "b", "batch_idx": 5}
    assert dict(build(trims.OrderedDict(), "b", 6)) == {"batch": "b", "batch_idx": 6}
    assert len(reads) == 4  # read every time, as Lightning does


def test_a_loss_is_not_divided_by_one_and_everything_else_is_lightnings() -> None:
    weight = torch.tensor([1.5, -2.0], requires_grad=True)
    loss = (weight * torch.tensor([0.3, 0.7])).sum()
    result = UndividedClosureResult.from_training_step_output(loss, 1)
    assert result.closure_loss is loss  # no DivBackward node, no kernel
    assert result.loss is not None and result.loss.data_ptr() != loss.data_ptr()
    assert not result.loss.requires_grad and torch.equal(result.loss, loss.detach())

    for normalize in (2, 3):
        ours = UndividedClosureResult.from_training_step_output(loss, normalize)
        theirs = ClosureResult.from_training_step_output(loss, normalize)
        assert torch.equal(ours.closure_loss, theirs.closure_loss)
        assert ours.closure_loss is not loss
    as_dict = UndividedClosureResult.from_training_step_output({"loss": loss, "n": 4}, 1)
    assert torch.equal(as_dict.closure_loss, loss) and as_dict.extra == {"n": 4}
    assert UndividedClosureResult.from_training_step_output(None, 1).closure_loss is None
    with pytest.raises(MisconfigurationException, match="must return a Tensor"):
        UndividedClosureResult.from_training_step_output("loss", 1)


class _Seen(Callback):
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        loop = trainer.fit_loop.epoch_loop
        self.kinds.append(loop.automatic_optimization.output_result_cls.__name__)
        if idx == 2:  # a training_step without batch_idx from here on

            def step(self: Any, batch: Any) -> Any:
                self.indices.append(None)
                return type(self).training_step(self, batch, -1)

            pl_module.training_step = types.MethodType(step, pl_module)


def test_a_fit_gets_lightnings_arguments_and_teardown_gives_lightning_its_loop_back() -> None:
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
    assert module.indices == [0, 1, None, None, None]  # type: ignore[attr-defined]
    assert seen.kinds == ["UndividedClosureResult"] * 5
    loop = trainer.fit_loop.epoch_loop
    assert "_build_kwargs" not in vars(loop)
    assert loop.automatic_optimization.output_result_cls is ClosureResult


def test_steps_without_batch_idx_are_run_at_lightnings_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The runner's read-ahead, vote coverage and uneven-data counts follow the batch index: a
    # `training_step(self, batch)` (Lightning passes it no index) must not be run at index 0.
    from lightning_torchrec import TorchRecStrategy
    from lightning_torchrec.training.step_runner import StepRunner
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
