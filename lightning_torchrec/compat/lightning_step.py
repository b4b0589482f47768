"""Lightning's step loop (lightning 2.0+): where a step stands.

What the strategy reads of the running loop at each step: the batch's index and whether it is
the loader's last (:func:`batch_position`, :func:`is_last_batch`, the same for a step hook that
takes no ``batch_idx``), and whether a step got Lightning's ``dataloader_iter`` instead of a
batch (:func:`is_dataloader_iter`). Nothing here changes the loop: it is only read.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loops.fetchers import _DataFetcherWrapper

__all__ = ["batch_position", "is_dataloader_iter", "is_last_batch"]


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
