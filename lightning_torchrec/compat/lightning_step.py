"""Lightning's step loop (lightning 2.0+): where a step stands, and its per-step work trimmed.

What the strategy reads of the running loop at each step: the batch's index and whether it is
the loader's last (:func:`batch_position`, :func:`is_last_batch`, the same for a step hook that
takes no ``batch_idx``), and whether a step got Lightning's ``dataloader_iter`` instead of a
batch (:func:`is_dataloader_iter`).

Two pieces of ``_TrainingEpochLoop`` run at every training step and do the same work each time:
reading ``training_step``'s signature, and dividing the step's loss by
``accumulate_grad_batches`` when that is 1. Both are replaced on the Trainer's own loop objects
(:func:`lighter_training_step`), for one fit (the undo restores Lightning's), with results equal
to Lightning's: the same keyword arguments, the same loss and gradients bit for bit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from lightning.pytorch.loops.fetchers import _DataFetcherWrapper
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor

__all__ = ["batch_position", "is_dataloader_iter", "is_last_batch", "lighter_training_step"]


def _running_loop(trainer: Any) -> Any:
    """The loop of the running stage (lightning 2.0+): training, validation, test or predict."""
    stage = str(trainer.state.stage.value) if trainer.state.stage is not None else ""
    fitting = str(trainer.state.fn.value) == "fit"
    if stage == "train":
        return trainer.fit_loop.epoch_loop
    if stage in ("validate", "sanity_check"):
        return trainer.fit_loop.epoch_loop.val_loop if fitting else trainer.validate_loop
    return trainer.test_loop if stage == "test" else trainer.predict_loop


def is_last_batch(trainer: Any) -> bool:
    """Whether the batch the running loop just fetched is its dataloader's last.

    Lightning's loops prefetch one batch and record the answer in
    ``loop.batch_progress.is_last_batch`` (lightning 2.0+) before the step runs.

    Args:
        trainer: the Trainer, inside a training, validation, test or predict step.

    Returns:
        True at the last batch of the running loop.
    """
    return bool(_running_loop(trainer).batch_progress.is_last_batch)


def batch_position(trainer: Any) -> tuple[int, bool]:
    """The running step's batch: its index in the epoch, and whether it is the loader's last.

    Both from one read of the running loop's ``batch_progress`` (lightning 2.0+), taken before
    the step runs and kept across a mid-epoch resume. In training the index is the
    ``batch_idx`` Lightning passes, also to a ``training_step(self, batch)`` that takes none (an
    evaluation loop counts across its dataloaders); the flag is :func:`is_last_batch`'s.

    Args:
        trainer: the Trainer, inside a training, validation, test or predict step.

    Returns:
        ``(index, last)``.
    """
    progress = _running_loop(trainer).batch_progress
    return int(progress.current.ready) - 1, bool(progress.is_last_batch)


def is_dataloader_iter(batch: Any) -> bool:
    """Whether a step got Lightning's ``dataloader_iter`` instead of a batch (lightning 2.0+).

    A step hook that takes ``dataloader_iter`` fetches its batches itself: the loop passes a
    ``_DataFetcherWrapper`` over the dataloader.

    Args:
        batch: the step's first argument.

    Returns:
        True for the wrapper.
    """
    return isinstance(batch, _DataFetcherWrapper)


class StepKwargs:
    """``_TrainingEpochLoop._build_kwargs`` reading ``training_step``'s signature once.

    Lightning calls ``inspect.getfullargspec`` on ``training_step`` at every batch to decide
    whether it takes ``batch_idx`` (15 us on an idle core). The answer depends only on the
    function, so it is kept per function object: a ``training_step`` replaced during the fit
    (another method, a function set on the instance) is read anew.
    """

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.takes_index: dict[Any, bool] = {}

    def __call__(self, kwargs: OrderedDict, batch: Any, batch_idx: int) -> OrderedDict:
        kwargs["batch"] = batch
        step = self.loop.trainer.lightning_module.training_step
        key = getattr(step, "__func__", step)
        try:
            takes = self.takes_index.get(key)
        except TypeError:  # an unhashable callable: read every time, as Lightning does
            takes = is_param_in_hook_signature(step, "batch_idx", min_args=2)
        else:
            if takes is None:
                takes = self.takes_index[key] = is_param_in_hook_signature(
                    step, "batch_idx", min_args=2
                )
        if takes:
            kwargs["batch_idx"] = batch_idx
        return kwargs


class UndividedClosureResult(ClosureResult):
    """``ClosureResult`` that does not divide a loss by 1.

    Lightning divides the loss ``training_step`` returns by ``accumulate_grad_batches`` at every
    step, 1 included: one more kernel in the forward and one more node in the backward (on CUDA,
    two launches a step), to multiply every gradient by exactly 1. With 1, a tensor loss is taken
    as it is; every other case (accumulation, a dict, None, a wrong type and its error) is
    Lightning's own.
    """

    @classmethod
    def from_training_step_output(cls, training_step_output: Any, normalize: int = 1) -> Any:
        """Lightning's ``ClosureResult.from_training_step_output``, without the division by 1.

        Args:
            training_step_output: what ``training_step`` returned.
            normalize: ``accumulate_grad_batches``.

        Returns:
            The closure's result, its ``loss`` a detached copy as in Lightning.
        """
        if normalize == 1 and isinstance(training_step_output, Tensor):
            return cls(training_step_output)
        return super().from_training_step_output(training_step_output, normalize)


def lighter_training_step(trainer: Any) -> Callable[[], None]:
    """Installs :class:`StepKwargs` and :class:`UndividedClosureResult`; returns the undo.

    Both go on the Trainer's own loop objects (``fit_loop.epoch_loop`` and its
    ``automatic_optimization``), never on Lightning's classes; a loop whose attributes differ
    from lightning 2.x's is left as it is.

    Args:
        trainer: the Trainer about to fit.

    Returns:
        A function that restores Lightning's own (call it in teardown).
    """
    loop = trainer.fit_loop.epoch_loop
    automatic = getattr(loop, "automatic_optimization", None)
    if not callable(getattr(loop, "_build_kwargs", None)) or automatic is None:
        return lambda: None
    if getattr(automatic, "output_result_cls", None) is not ClosureResult:
        return lambda: None
    vars(loop)["_build_kwargs"] = StepKwargs(loop)
    vars(automatic)["output_result_cls"] = UndividedClosureResult

    def undo() -> None:
        vars(loop).pop("_build_kwargs", None)
        vars(automatic).pop("output_result_cls", None)

    return undo
