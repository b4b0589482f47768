"""Next-item prediction data from MovieLens rating files, with leave-last-out evaluation.

Each user's time-ordered items (:func:`~lightning_torchrec.data.movielens.read_ratings`) are split
the usual way for sequential recommenders: the last item is the test target, the second-last the
validation target, and everything before is for training. A sample is a history (the items
before the target, truncated to the last ``max_length``) and its target:

* train: the history before the third-last item, targeting it (users with at least 4 items);
* val: the history before the second-last item, targeting it;
* test: the history before the last item, targeting it.

Training batches are shuffled afresh each epoch (from ``seed`` and the epoch), cut into
``batch_size`` samples (the last partial batch is dropped), and dealt round-robin to the ranks
(every rank gets the same number). Each carries ``num_negatives`` uniformly sampled candidate
items, drawn from ``(seed, epoch, batch)``: a checkpoint written mid-epoch resumes at the next
batch, with the same negatives, exactly (see :mod:`lightning_torchrec.data.resumable`).

Evaluation batches hold every user once, in order, dealt round-robin to the ranks; the candidates
are the whole catalogue (full ranking, no sampled metrics). Ranks run the same number of batches
(the sharded lookup is a collective); a rank short of users gets a padding sample of weight 0,
which neither the loss nor the ranking metrics count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from lightning_torchrec.data.movielens import UserSequences, read_ratings
from lightning_torchrec.data.resumable import (
    ResumableDataLoader,
    ResumableDataModule,
    ResumableIterableDataset,
    worker_slot,
)
from lightning_torchrec.data.sequence_batch import SequenceBatch, sequence_batch

__all__ = [
    "MovieLensSequenceData",
    "NextItemEvalDataset",
    "NextItemTrainDataset",
    "leave_last_out",
]

#: How far from each user's end a split's target is.
_TARGET_FROM_END = {"train": 3, "val": 2, "test": 1}


def leave_last_out(sequences: UserSequences, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Where each sample of a split starts and where its target is, in ``sequences.items``.

    Args:
        sequences: the users' sequences.
        split: ``train``, ``val`` or ``test``.

    Returns:
        ``(starts, targets)``: sample ``s``'s history is ``items[starts[s]:targets[s]]``
        (before truncation) and its target ``items[targets[s]]``.

    Raises:
        ValueError: for an unknown split.
    """
    if split not in _TARGET_FROM_END:
        raise ValueError(f"split must be one of {sorted(_TARGET_FROM_END)}, got {split!r}")
    starts = sequences.offsets[:-1]
    targets = sequences.offsets[1:] - _TARGET_FROM_END[split]
    keep = targets - starts >= 1
    return starts[keep], targets[keep]


def check_positive(**values: Any) -> None:
    """Refuses a size argument that is not a positive integer, naming it.

    Args:
        **values: the arguments by name, e.g. ``batch_size=128``.

    Raises:
        ValueError: for a value that is not an ``int`` of at least 1 (``batch_size=0`` divided by
            zero, ``num_negatives=0`` gave a loss of 0 that trains nothing, and a negative
            ``eval_batch_size`` an evaluation of no user at all).
    """
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


class _Samples:
    """Histories and targets of one split, truncated to ``max_length``, as batches."""

    def __init__(self, sequences: UserSequences, split: str, max_length: int) -> None:
        check_positive(max_length=max_length)
        self.items = sequences.items
        self.num_items = sequences.num_items
        starts, self.targets = leave_last_out(sequences, split)
        self.starts = np.maximum(starts, self.targets - max_length)

    def __len__(self) -> int:
        return len(self.targets)

    def batch(
        self, rows: np.ndarray, candidates: np.ndarray, weights: np.ndarray | None = None
    ) -> SequenceBatch:
        histories = [self.items[self.starts[r] : self.targets[r]] for r in rows]
        return sequence_batch(histories, self.items[self.targets[rows]], candidates, weights)


class NextItemTrainDataset(ResumableIterableDataset):
    """Shuffled training batches of one rank, with sampled negatives; resumes mid-epoch.

    Args:
        sequences: the users' sequences.
        batch_size: samples per batch.
        max_length: longest history.
        num_negatives: uniformly drawn candidate items per batch.
        seed: fixes the order of each epoch and the negatives.
        rank: this rank.
        world_size: ranks.

    Raises:
        ValueError: if ``batch_size``, ``max_length`` or ``num_negatives`` is not a positive
            integer, or the split has too few samples for one batch per rank.
    """

    #: The epoch the next iteration serves (the data module sets it from the trainer).
    epoch: int = 0

    def __init__(
        self,
        sequences: UserSequences,
        batch_size: int,
        max_length: int,
        num_negatives: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        check_positive(batch_size=batch_size, num_negatives=num_negatives)
        self.samples = _Samples(sequences, "train", max_length)
        self.batch_size = batch_size
        self.num_negatives = num_negatives
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_batches = len(self.samples) // batch_size // world_size
        if self.num_batches < 1:
            raise ValueError(
                f"{len(self.samples)} training samples make no batch of {batch_size} per rank "
                f"on {world_size} ranks; lower batch_size"
            )

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[SequenceBatch]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.samples))
        slot, num_slots, skip = worker_slot(self.start_batch)
        for local in range(slot + skip * num_slots, self.num_batches, num_slots):
            index = local * self.world_size + self.rank
            rows = order[index * self.batch_size : (index + 1) * self.batch_size]
            negatives = np.random.default_rng([self.seed, self.epoch, index, 1]).integers(
                0, self.samples.num_items, self.num_negatives
            )
            yield self.samples.batch(rows, negatives)


class NextItemEvalDataset(IterableDataset):
    """Evaluation batches of one rank: every user once, the whole catalogue as candidates.

    Args:
        sequences: the users' sequences.
        split: ``val`` or ``test``.
        batch_size: samples per batch.
        max_length: longest history.
        rank: this rank.
        world_size: ranks.

    Raises:
        ValueError: if ``batch_size`` or ``max_length`` is not a positive integer.
    """

    def __init__(
        self,
        sequences: UserSequences,
        split: str,
        batch_size: int,
        max_length: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        check_positive(batch_size=batch_size)
        self.samples = _Samples(sequences, split, max_length)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        per_round = batch_size * world_size
        self.num_batches = max(1, -(-len(self.samples) // per_round))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[SequenceBatch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        catalogue = np.arange(self.samples.num_items)
        for local in range(worker, self.num_batches, workers):
            index = local * self.world_size + self.rank
            rows = np.arange(index * self.batch_size, (index + 1) * self.batch_size)
            rows = rows[rows < len(self.samples)]
            if len(rows):
                yield self.samples.batch(rows, catalogue, np.ones(len(rows), dtype=np.float32))
            else:
                yield self.samples.batch(np.zeros(1, dtype=np.int64), catalogue, np.zeros(1))


class _EpochLoader(ResumableDataLoader):
    """A :class:`ResumableDataLoader` that tells its dataset which epoch it serves.

    ``epoch`` returns the Trainer's epoch, or None without a Trainer: then each pass over the
    loader is the next epoch, the first one 0 (a Fabric loop's ``for epoch ...: for batch in
    loader``).
    """

    def __init__(
        self, dataset: NextItemTrainDataset, epoch: Callable[[], int | None], **kwargs: Any
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.epoch = epoch
        self.passes = 0

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch()
        self.dataset.epoch = self.passes if epoch is None else epoch
        self.passes += 1
        yield from super().__iter__()


def _ratings_file(path: Path) -> Path:
    if path.is_dir():
        for name in ("ratings.dat", "ratings.csv"):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path} holds neither ratings.dat nor ratings.csv")
    return path


class MovieLensSequenceData(ResumableDataModule):
    """Next-item prediction on a MovieLens ratings file, leave-last-out.

    The file is read when the module is built (every rank reads it), so ``num_items`` is known
    before the model is: the item table needs ``num_items`` rows.

    Args:
        path: a ``ratings.dat`` or ``ratings.csv`` file, or a directory holding one.
        max_length: longest history of a sample (older items are dropped).
        batch_size: training samples per batch and rank.
        eval_batch_size: evaluation samples per batch and rank (None: ``batch_size``).
        num_negatives: uniformly sampled candidate items per training batch.
        min_interactions: users with fewer interactions are dropped (at least 3).
        seed: fixes each epoch's order and the negatives.
        num_workers: DataLoader workers.

    Raises:
        FileNotFoundError: if there is no ratings file at ``path``.
        ValueError: for a file of another layout, ``min_interactions < 3``, or a size
            (``max_length``, ``batch_size``, ``eval_batch_size``, ``num_negatives``) that is not
            a positive integer.
    """

    def __init__(
        self,
        path: str,
        max_length: int = 20,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_negatives: int = 128,
        min_interactions: int = 3,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if min_interactions < 3:
            raise ValueError(f"leave-last-out needs min_interactions >= 3, got {min_interactions}")
        sizes = dict(max_length=max_length, batch_size=batch_size, num_negatives=num_negatives)
        check_positive(
            **sizes, **({} if eval_batch_size is None else {"eval_batch_size": eval_batch_size})
        )
        self.path = _ratings_file(Path(path))
        self.sequences = read_ratings(self.path, min_interactions)
        self.num_items = self.sequences.num_items
        self.max_length = max_length
        self.batch_size = batch_size
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        self.num_negatives = num_negatives
        self.seed = seed
        self.num_workers = num_workers

    def dataset(self, stage: str, num_workers: int = 0) -> IterableDataset:
        """The dataset of one stage on this rank.

        Args:
            stage: ``train``, ``val`` or ``test``.
            num_workers: the workers that will read it (unused: the datasets split by worker).

        Returns:
            The dataset.
        """
        rank, world = self.rank_and_world()
        if stage == "train":
            return NextItemTrainDataset(
                self.sequences,
                self.batch_size,
                self.max_length,
                self.num_negatives,
                self.seed,
                rank,
                world,
            )
        return NextItemEvalDataset(
            self.sequences, stage, self.eval_batch_size, self.max_length, rank, world
        )

    def train_dataloader(self) -> ResumableDataLoader:
        """Training batches; a mid-epoch checkpoint resumes at its position."""
        return _EpochLoader(
            self.dataset("train"),  # type: ignore[arg-type]
            epoch=lambda: None if self.trainer is None else self.trainer.current_epoch,
            num_workers=self.num_workers,
        )
