"""Resuming an epoch of an iterable dataset at the batch where a checkpoint left it.

The data modules of this package stream *batches* from an ``IterableDataset``: each rank (and each
DataLoader worker of it) reads its own part of the files, in a fixed order. Where in its epoch a
resumed run continues is decided in one place, the strategy's saved position (see
:mod:`lightning_torchrec.lightning.mid_epoch`): before the resumed epoch's iterator exists it calls
the training loader's resume hook, :meth:`ResumableDataLoader.resume_at`, with the batches of the
epoch already trained on (rescaled when the layout changed), and the dataset skips exactly those
batches, so a run interrupted mid-epoch and resumed sees the same batches, in the same order, as an
uninterrupted run. A loop of one's own (Fabric) calls ``resume_at`` itself with the count it saved.

With ``num_workers = W`` the DataLoader takes batch ``k`` from worker ``k % W``. A dataset that
splits its batches into ``W`` *slots* (slot ``s`` holds batches ``s, s + W, ...``) resumes after
``k`` batches by giving worker ``w`` slot ``(w + k) % W`` and skipping that slot's consumed batches
(:func:`slot_and_skip`): the fresh workers then continue the global order exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
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


class ResumableIterableDataset(IterableDataset):
    """Base of the streaming datasets: the number of batches to skip at the next iteration.

    Subclasses read ``self.start_batch`` in ``__iter__`` (through :func:`worker_slot`); a
    :class:`ResumableDataLoader` sets it for one iteration
    (:meth:`~ResumableDataLoader.resume_at`).
    """

    start_batch: int = 0

    def layout(self) -> dict[str, int]:
        """What the order of an epoch's batches depends on besides the data.

        A dataset with ``world_size``, ``num_slots`` (readers per rank: its DataLoader workers)
        and ``batch_size`` attributes returns them (the Criteo and Parquet readers); others none.
        A checkpoint written within an epoch records them (the strategy's position), and a resume
        under another layout skips as many rows instead of the same count of batches, with a
        warning (:func:`lightning_torchrec.lightning.mid_epoch.rescale`).

        Returns:
            ``{name: value}``, e.g. ``{"world_size": 2, "readers_per_rank": 1,
            "batch_size": 512}``; empty when the dataset lacks one of them.
        """
        names = {
            "world_size": "world_size",
            "readers_per_rank": "num_slots",
            "batch_size": "batch_size",
        }
        if not all(hasattr(self, attribute) for attribute in names.values()):
            return {}
        return {key: int(getattr(self, attribute)) for key, attribute in names.items()}


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`ResumableIterableDataset` that can start its next epoch late.

    It has the resume hook the strategy calls on a mid-epoch resume, :meth:`resume_at`, and
    tells the strategy the layout its order depends on, :meth:`resume_layout`. It has no
    ``state_dict()``: the position is the strategy's (one source for every loader), not a
    second count kept by Lightning.

    Args:
        dataset: the dataset (yields whole batches; ``batch_size`` is None).
        **kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).

    Raises:
        TypeError: if ``dataset`` is not a :class:`ResumableIterableDataset`.
    """

    def __init__(self, dataset: ResumableIterableDataset, **kwargs: Any) -> None:
        if not isinstance(dataset, ResumableIterableDataset):
            raise TypeError(
                f"ResumableDataLoader needs a ResumableIterableDataset, got {type(dataset)}"
            )
        kwargs.setdefault("batch_size", None)
        # Workers must see the skip set at each new iterator: no persistent workers.
        kwargs["persistent_workers"] = False
        super().__init__(dataset, **kwargs)
        self.skip_next = 0

    def resume_at(self, batches: int) -> None:
        """Makes the next iteration start after the epoch's first ``batches`` batches.

        Only that iteration is shortened (the dataset never reads the skipped ones: a Parquet
        reader skips whole row groups); the next one is whole. A count at or past the epoch's
        end makes the next iteration whole.

        Args:
            batches: batches of the epoch already trained on, in this loader's batches.

        Raises:
            ValueError: if ``batches`` is negative.
        """
        if batches < 0:
            raise ValueError(f"ResumableDataLoader.resume_at needs batches >= 0, got {batches}")
        self.skip_next = int(batches) if batches < len(self) else 0

    def resume_layout(self) -> dict[str, int]:
        """What the order of an epoch's batches depends on besides the data and world size.

        Returns:
            The dataset's :meth:`~ResumableIterableDataset.layout` without ``world_size`` (the
            strategy records the run's): ``readers_per_rank`` and ``batch_size``.
        """
        return {k: v for k, v in self.dataset.layout().items() if k != "world_size"}

    def __iter__(self) -> Iterator[Any]:
        self.dataset.start_batch, self.skip_next = self.skip_next, 0
        yield from super().__iter__()


class ResumableDataModule(LightningDataModule):
    """The loaders the file-backed data modules share; subclasses define :meth:`dataset`.

    Training batches come from a :class:`ResumableDataLoader` (a mid-epoch checkpoint resumes at
    its position through the loader's resume hook); validation and test batches from plain
    loaders. Every loader reads whole batches (``batch_size=None``) with ``num_workers`` workers.
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
        """This rank and the world size: the Trainer's, else the default process group's.

        Without a Trainer (a Fabric loop, a loop of one's own after ``init_process_group``) the
        process group's rank and size split the data; ``(0, 1)`` without either.

        Returns:
            ``(rank, world_size)``.
        """
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def train_dataloader(self) -> ResumableDataLoader:
        """Training batches; a mid-epoch checkpoint resumes at its position."""
        return ResumableDataLoader(
            self.dataset("train", self.num_workers), num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader[Any]:
        """Validation batches."""
        return DataLoader(self.dataset("val", self.num_workers), None, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader[Any]:
        """Test batches."""
        return DataLoader(
            self.dataset("test", self.num_workers), None, num_workers=self.num_workers
        )
