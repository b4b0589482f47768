"""Resuming an epoch of an iterable dataset at the batch where a checkpoint left it.

The data modules of this package stream *batches* from an ``IterableDataset``: each rank (and each
DataLoader worker of it) reads its own part of the files, in a fixed order. A
:class:`ResumableDataLoader` remembers how many batches of the current epoch the training step has
consumed and hands that count to Lightning's checkpoint (Lightning 2.6 saves the state of any
train DataLoader with ``state_dict()``/``load_state_dict()`` in the fit loop's state). On resume
the dataset skips exactly those batches, so a run interrupted mid-epoch and resumed sees the same
batches, in the same order, as an uninterrupted run.

Counting what the *training step* consumed, not what the loader yielded, matters: Lightning
prefetches a batch ahead, so the loader has always yielded one more batch than was trained on when
a checkpoint is written. The data modules pass ``position`` (the fit loop's count of processed
batches); without it the loader falls back to its own count of yielded batches.

With ``num_workers = W`` the DataLoader takes batch ``k`` from worker ``k % W``. A dataset that
splits its batches into ``W`` *slots* (slot ``s`` holds batches ``s, s + W, ...``) resumes after
``k`` batches by giving worker ``w`` slot ``(w + k) % W`` and skipping that slot's consumed batches
(:func:`slot_and_skip`): the fresh workers then continue the global order exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def slot_and_skip(worker_id: int, num_workers: int, consumed: int) -> tuple[int, int]:
    """The slot a worker reads and how many of the slot's batches it skips on resume.

    Args:
        worker_id: the DataLoader worker (0 without workers).
        num_workers: the DataLoader's workers (1 without workers).
        consumed: batches of this epoch the rank already trained on.

    Returns:
        ``(slot, skip)``.
    """
    slot = (worker_id + consumed) % num_workers
    skip = consumed // num_workers + (1 if slot < consumed % num_workers else 0)
    return slot, skip


def worker_slot(consumed: int) -> tuple[int, int, int]:
    """:func:`slot_and_skip` for the calling DataLoader worker (or the main process).

    Args:
        consumed: batches of this epoch the rank already trained on.

    Returns:
        ``(slot, num_slots, skip)``.
    """
    info = get_worker_info()
    worker_id, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
    slot, skip = slot_and_skip(worker_id, num_workers, consumed)
    return slot, num_workers, skip


def trainer_position(trainer: Any) -> int | None:
    """Batches of the current epoch the trainer's training step has processed.

    Args:
        trainer: the Lightning Trainer, or None.

    Returns:
        The count (what a checkpoint written now has trained on in this epoch); None without a
        trainer.
    """
    if trainer is None:
        return None
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


class ResumableIterableDataset(IterableDataset):
    """Base of the streaming datasets: the number of batches to skip at the next iteration.

    Subclasses read ``self.start_batch`` in ``__iter__`` (through :func:`worker_slot`).
    ``state_dict()``/``load_state_dict()`` make it usable on its own, without Lightning.
    """

    start_batch: int = 0

    def state_dict(self) -> dict[str, int]:
        """The position to resume from.

        Returns:
            ``{"start_batch": n}``.
        """
        return {"start_batch": self.start_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skips the first ``state["start_batch"]`` batches at the next iteration.

        Args:
            state: from :meth:`state_dict` or a loader's state.
        """
        self.start_batch = int(state["start_batch"])


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`ResumableIterableDataset` whose position Lightning checkpoints.

    Args:
        dataset: the dataset (yields whole batches; ``batch_size`` is None).
        position: returns the batches of the current epoch the training step consumed (the
            data modules pass the fit loop's count), or None when it cannot tell; without it
            (or when it returns None) the loader counts the batches it yielded.
        **kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).

    Raises:
        TypeError: if ``dataset`` is not a :class:`ResumableIterableDataset`.
    """

    def __init__(
        self,
        dataset: ResumableIterableDataset,
        position: Callable[[], int | None] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dataset, ResumableIterableDataset):
            raise TypeError(
                f"ResumableDataLoader needs a ResumableIterableDataset, got {type(dataset)}"
            )
        kwargs.setdefault("batch_size", None)
        # Workers must see the skip set at each new iterator: no persistent workers.
        kwargs["persistent_workers"] = False
        super().__init__(dataset, **kwargs)
        self.position = position
        self.skip_next = 0
        self.yielded = 0

    def __iter__(self) -> Iterator[Any]:
        self.dataset.start_batch = self.skip_next
        self.yielded = self.skip_next
        self.skip_next = 0
        for batch in super().__iter__():
            self.yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The batches of the current epoch consumed so far.

        Returns:
            ``{"start_batch": n}``.
        """
        consumed = self.position() if self.position is not None else None
        return {"start_batch": int(self.yielded if consumed is None else consumed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Makes the next iteration start after ``state["start_batch"]`` batches.

        A position at or past the end of the epoch starts the next epoch from its beginning.

        Args:
            state: from :meth:`state_dict`.
        """
        start = int(state.get("start_batch", 0))
        self.skip_next = start if 0 < start < len(self) else 0


class ResumableDataModule(LightningDataModule):
    """The loaders the file-backed data modules share; subclasses define :meth:`dataset`.

    Training batches come from a :class:`ResumableDataLoader` (the position within the epoch is
    saved in checkpoints); validation and test batches from plain loaders. Every loader reads
    whole batches (``batch_size=None``) with ``num_workers`` workers.
    """

    num_workers: int = 0

    def dataset(self, stage: str, num_workers: int = 0) -> IterableDataset:
        """The dataset of one stage on this rank.

        Args:
            stage: ``train``, ``val`` or ``test``.
            num_workers: the workers that will read it.

        Returns:
            The dataset.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError

    def rank_and_world(self) -> tuple[int, int]:
        """This rank and the world size (``(0, 1)`` before a Trainer is attached).

        Returns:
            ``(rank, world_size)``.
        """
        trainer = self.trainer
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def train_dataloader(self) -> ResumableDataLoader:
        """Training batches; the position within the epoch is saved in checkpoints."""
        return ResumableDataLoader(
            self.dataset("train", self.num_workers),
            position=lambda: trainer_position(self.trainer),
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader[Any]:
        """Validation batches."""
        return DataLoader(self.dataset("val", self.num_workers), None, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader[Any]:
        """Test batches."""
        return DataLoader(
            self.dataset("test", self.num_workers), None, num_workers=self.num_workers
        )
