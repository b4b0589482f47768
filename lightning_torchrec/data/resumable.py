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

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
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


def resume_position(trainer: Any) -> int | None:
    """Where a training loader resumes: :func:`trainer_position`, 0 once the epoch is complete.

    An epoch is complete when the training step processed all of the epoch's batches, which
    are the trainer's ``num_training_batches`` (``limit_train_batches`` may make them fewer
    than the loader's length): the next epoch then starts from its first batch. Lightning
    restores a loader's state even after a complete epoch when the fit is bounded by
    ``max_steps``, so a count equal to the limit would skip the next epoch's first batches.

    Args:
        trainer: the Lightning Trainer, or None.

    Returns:
        The batches of the current epoch to skip on resume; None without a trainer.
    """
    processed = trainer_position(trainer)
    if processed is None or processed < trainer.num_training_batches:
        return processed
    return 0


def restart_epoch_at(trainer: Any, batches: int) -> None:
    """Makes a fit loop restored within an epoch count ``batches`` of it as trained.

    A run resumed from a checkpoint written under another layout (another world size) skips
    another count of batches than the checkpoint's ranks trained: ``k`` batches per rank on
    ``W`` ranks are ``k * W / W'`` on ``W'``. Lightning restores its count of the epoch's batches
    (``k``) and ends the epoch when that count reaches ``num_training_batches``; left at ``k``
    when the loader skipped fewer, it would stop before the loader's last ``k - k * W / W'``
    batches, which no rank would ever train. Call it after the checkpoint's loop state is
    restored and before the epoch's loop starts (when the training loader is made or restored).

    Args:
        trainer: the Lightning Trainer, its loops restored from the checkpoint (None: no
            loop to tell).
        batches: the batches of the epoch this run's loader skips.
    """
    if trainer is None:
        return
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    # Saved at a batch's end, the last batch is processed but not completed: Lightning completes
    # it when the epoch's loop restarts. The same lag keeps that step right.
    behind = current.processed - current.completed
    current.ready = current.started = current.processed = batches
    current.completed = batches - behind


class ResumableIterableDataset(IterableDataset):
    """Base of the streaming datasets: the number of batches to skip at the next iteration.

    Subclasses read ``self.start_batch`` in ``__iter__`` (through :func:`worker_slot`).
    ``state_dict()``/``load_state_dict()`` make it usable on its own, without Lightning.
    """

    start_batch: int = 0

    def layout(self) -> dict[str, int]:
        """What the order of an epoch's batches depends on besides the data.

        A dataset with ``world_size``, ``num_slots`` (readers per rank: its DataLoader workers)
        and ``batch_size`` attributes returns them (the Criteo and Parquet readers); others none.
        A checkpoint written within an epoch records them, and a resume under another layout
        skips as many rows instead of the same count of batches, with a warning
        (:meth:`ResumableDataLoader.load_state_dict`).

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
        restart: called with the batches the resumed epoch skips when a checkpoint of another
            layout makes them another count than the checkpoint's (the data modules pass
            :func:`restart_epoch_at`, so that the fit loop counts the same and trains the
            epoch's last batches).
        **kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).

    Raises:
        TypeError: if ``dataset`` is not a :class:`ResumableIterableDataset`.
    """

    def __init__(
        self,
        dataset: ResumableIterableDataset,
        position: Callable[[], int | None] | None = None,
        restart: Callable[[int], None] | None = None,
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
        self.restart = restart
        self.skip_next = 0
        self.yielded = 0

    def __iter__(self) -> Iterator[Any]:
        self.dataset.start_batch = self.skip_next
        self.yielded = self.skip_next
        self.skip_next = 0
        for batch in super().__iter__():
            self.yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The batches of the current epoch consumed so far, and the layout they were read in.

        Returns:
            ``{"start_batch": n, "epoch_batches": len(self), "layout": {...}}`` (the dataset's
            :meth:`~ResumableIterableDataset.layout`; no ``layout`` when it has none).
        """
        consumed = self.position() if self.position is not None else None
        state: dict[str, Any] = {
            "start_batch": int(self.yielded if consumed is None else consumed),
            "epoch_batches": len(self),
        }
        layout = self.dataset.layout()
        return state | ({"layout": layout} if layout else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration start after ``state["start_batch"]`` batches.

        A position at or past the end of the epoch (the saved one's, when the state has its
        length) starts the next epoch from its beginning. A position within the epoch saved
        under another layout (number of ranks, readers per rank or batch size) than the
        dataset's cannot resume exactly: its batches come in another order. It skips as many
        rows as were trained on (``start * world_size * batch_size`` of the saved layout,
        divided by this one's), with a warning naming the change, as the strategy carries a
        map-style loader's position to another world size. Under the same layout, an epoch
        of another length than the saved one (files added or removed since) warns too.

        Args:
            state: from :meth:`state_dict`.
        """
        start = int(state.get("start_batch", 0))
        self.skip_next = 0
        if not 0 < start < int(state.get("epoch_batches", len(self))):
            return  # saved at an epoch's start or end: the next epoch is whole
        saved, now = state.get("layout"), self.dataset.layout()
        if isinstance(saved, dict):
            changed = {
                k: (saved[k], now[k]) for k in saved.keys() & now.keys() if saved[k] != now[k]
            }
            if changed:
                start = _rescaled(start, saved, now)
                differences = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(changed.items()))
                rank_zero_warn(
                    f"{type(self.dataset).__name__} resumes mid-epoch under another layout than "
                    f"the checkpoint's ({differences}): its batches come in another order, so "
                    f"this run skips {start} batches per rank, as many rows as were trained on, "
                    "but not the same rows (some of the epoch may be trained twice, some not "
                    "at all). Resume with the same ranks, DataLoader workers and batch size, or "
                    "from a checkpoint written at an epoch's end, for an exact resume."
                )
                if self.restart is not None and start < len(self):
                    self.restart(start)
            elif int(state.get("epoch_batches", len(self))) != len(self):
                rank_zero_warn(
                    f"{type(self.dataset).__name__} resumes mid-epoch after {start} batches of "
                    f"an epoch of {state['epoch_batches']}, but its files now give "
                    f"{len(self)} batches per epoch (files added, removed or rewritten since "
                    "the checkpoint): the batches it skips are not those trained on (some of "
                    "the epoch may be trained twice, some not at all). Resume with the same "
                    "data, or from a checkpoint written at an epoch's end, for an exact resume."
                )
        self.skip_next = start if start < len(self) else 0


def _rescaled(start: int, saved: dict[str, Any], now: dict[str, Any]) -> int:
    """``start`` batches per rank of the ``saved`` layout as batches of the ``now`` one."""
    try:
        per_step = [int(x["world_size"]) * int(x["batch_size"]) for x in (saved, now)]
    except (KeyError, TypeError, ValueError):
        return start  # a layout without those: the count as it is
    return start * per_step[0] // per_step[1] if min(per_step) > 0 else start


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
        """Training batches; the position within the epoch is saved in checkpoints."""
        return ResumableDataLoader(
            self.dataset("train", self.num_workers),
            position=lambda: resume_position(self.trainer),
            restart=lambda batches: restart_epoch_at(self.trainer, batches),
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
