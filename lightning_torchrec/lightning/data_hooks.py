"""The data hooks of ``TorchRecStrategy``: even batch counts, loaders fed, resumed epochs.

Sharded tables run collectives in every step, so a rank with fewer batches would leave the others
waiting: known batch counts are compared when training, validation, test and predict start
(unknown ones batch by batch, in the step's collective). Dataloaders are handed to the train and
evaluation pipelines when a pipeline runs (and their workers check the batches they make), the
restored epoch reaches the sampler before the first iterator exists, and a run resumed from a
mid-epoch checkpoint skips the batches trained on (:mod:`lightning_torchrec.lightning.mid_epoch`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_torchrec.compat.lightning import processed_epochs
from lightning_torchrec.lightning.mid_epoch import resume_in_epoch
from lightning_torchrec.training.step_runner import StepRunner


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """Sets ``epoch`` on every sampler of ``dataloader`` that has ``set_epoch``.

    Args:
        dataloader: a DataLoader (or anything with ``sampler``/``batch_sampler``).
        epoch: the epoch about to be iterated.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), batch_sampler):
        for s in (sampler, getattr(sampler, "sampler", None)):
            if callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)


class DataHooks:
    """Mixin for ``TorchRecStrategy`` (which provides the annotated attributes)."""

    lightning_module: Any
    is_global_zero: bool
    _runner: StepRunner | None
    #: The position a mid-epoch checkpoint being resumed was written at (set by
    #: ``load_checkpoint``), until training starts.
    _resume_position: dict[str, int] | None = None

    def _check_batch_counts(self, stage: str, count: float) -> None:
        if self._runner is not None:
            self._runner.check_counts(stage, count)

    def _end_evaluation(self) -> None:
        if self._runner is not None:
            self._runner.end_evaluation()

    @override
    def on_train_start(self) -> None:
        self._resume_position = None  # the training loaders are made: a reload starts whole
        self._check_batch_counts("training", self.lightning_module.trainer.num_training_batches)

    @override
    def on_validation_start(self) -> None:
        if self._runner is not None:  # evaluation runs the sharded modules' own forwards
            self._runner.start_evaluation()
        self._check_batch_counts("validation", sum(self.lightning_module.trainer.num_val_batches))

    @override
    def on_validation_end(self) -> None:
        self._end_evaluation()

    @override
    def on_test_end(self) -> None:
        self._end_evaluation()

    @override
    def on_predict_end(self) -> None:
        self._end_evaluation()

    @override
    def on_test_start(self) -> None:
        self._check_batch_counts("test", sum(self.lightning_module.trainer.num_test_batches))

    @override
    def on_predict_start(self) -> None:
        self._check_batch_counts("predict", sum(self.lightning_module.trainer.num_predict_batches))

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # Lightning creates the first epoch's iterator before it sets the sampler's epoch and does
        # not re-create it after a resume: a run resumed at epoch e would replay epoch 0's
        # shuffle. Setting the restored epoch here (after the checkpoint is loaded, before the
        # iterator exists) makes resumed runs see the same order as uninterrupted ones.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            set_sampler_epoch(dataloader, processed_epochs(trainer))
            if trainer.training and self._resume_position is not None:
                # Before the pipeline wraps it: its sampler skips what was trained on.
                resume_in_epoch(dataloader, self._resume_position, trainer, self.is_global_zero)
        if trainer is not None and self._runner is not None:
            # Checks in the loader's workers; the stage's pipeline reads ahead.
            return self._runner.feed(dataloader, trainer.training)
        return dataloader
