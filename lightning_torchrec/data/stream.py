"""A stream of time partitions as training data: ``PartitionStreamData``, one partition an epoch.

A *partition* is the data of one period (an hour, a day): a Parquet file, or a directory of
Parquet files (``hour=2026-11-29T04/part-*.parquet``). The stream trains its partitions in order,
one pass: **Lightning epoch e trains partition e** (``Trainer(max_epochs=-1)``), and the
validation at epoch e's end evaluates partition e + 1, which the model has not seen yet
(progressive evaluation; the sanity check before any training evaluates partition 0). Where the
partitions come from:

- a directory whose children are the partitions, ordered by name (``*.parquet`` files, and
  directories; names starting with ``.`` or ``_`` are ignored, as Spark and Hadoop write them).
  New partitions that appear while the fit runs are picked up. A directory counts only once it
  is complete: it holds the ``ready_marker`` (``_SUCCESS``, which Spark and Hadoop write last;
  ``None`` takes any directory). A file counts when it exists: write it under a hidden name and
  rename it (an atomic rename), so that no half-written file is ever seen;
- TorchRec's npy Criteo days (``day_{i}_{dense,sparse,labels}.npy``, the three present), by day
  number: :meth:`PartitionStreamData.criteo_days`;
- an ordered list of such paths (a day by its stem ``.../day_{i}``): they are the partitions, in
  that order, and the stream ends after the last. A listed partition that is absent is waited
  for, and refused once the wait is over (:class:`~lightning_torchrec.errors.PartitionError`).

**Waiting.** When the partition an epoch needs (or the next one, for validation) is not there,
the stream lists the source every ``poll_seconds`` for up to ``timeout_seconds``. Rank 0 lists
and decides, and every rank takes its decision (one ``broadcast_object_list`` on the default
process group, at the loader's iterator creation, which every rank reaches together). If no new
partition appeared in time the stream ends: one log line names the last partition and the wait,
the fit stops cleanly after the epoch of the last partition (the fit loop's ``max_epochs`` is
lowered to it; ``trainer.should_stop`` where no epoch is under way), and the loaders yield
nothing. The partition
after the one an epoch trains is waited for at that epoch's last batch (and by the validation at
its end), before the epoch's end hooks: a checkpoint or a delta written at an epoch's end comes
once the next partition is there or the stream has ended. A partition that
appears after a later one was taken (its name sorts before it) is skipped with one warning.

**Within a partition** the rows are one global order (files, then row groups, as the names sort):
global batch ``i`` is the rows ``[i * W * B, (i + 1) * W * B)`` on ``W`` ranks of ``B`` rows
each, rank ``r`` takes its ``B`` rows of it, and a rank's DataLoader workers take every
``num_workers``-th global batch. ``k`` batches per rank are therefore exactly the partition's
first ``k * W * B`` rows, whatever the world size, batch size or workers, and a checkpoint
written mid-partition resumes at that row under any of them
(:mod:`lightning_torchrec.lightning.mid_epoch`; the loader's hooks ``resume_rows``/``rows_done``).
Every rank reads every row group of the partition (it keeps only its rows): the price of an order
that does not depend on the layout. The tail of a partition smaller than one global batch is not
trained (a log line gives its row count).

**Bad input** is refused with :class:`~lightning_torchrec.errors.PartitionError` naming the
partition: a listed partition missing, a file that is not Parquet or is truncated, a column
missing or of the wrong type, other column names than the stream's first partition, a row group
that cannot be read.

The data module's ``state_dict`` (which Lightning keeps in checkpoints) holds the partitions
taken so far, so a resumed run maps each epoch to the same partition, whatever appeared since.
Without a Trainer (Fabric, a loop of one's own) the training loader iterates the next partition
at each iteration; :attr:`PartitionStreamData.ended` says when the stream ended.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from torch.utils.data import get_worker_info
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    DEFAULT_LABEL_NAME,
    INT_FEATURE_COUNT,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.data.batch import Batch
from lightning_torchrec.data.criteo_files import NPY_KINDS, reduce_ids, table_sizes_array
from lightning_torchrec.data.parquet import ParquetRows, expand_paths
from lightning_torchrec.data.parquet_columns import check_positive
from lightning_torchrec.data.resumable import ResumableDataLoader, ResumableIterableDataset
from lightning_torchrec.distributed import broadcast_from_rank0
from lightning_torchrec.errors import PartitionError

__all__ = [
    "READY_MARKER",
    "CriteoDayRows",
    "ParquetPartitionRows",
    "Partition",
    "PartitionStreamData",
    "PartitionStreamDataset",
    "PartitionStreamLoader",
    "list_partitions",
]

log = logging.getLogger(__name__)

#: The file that marks a partition directory complete (Spark's and Hadoop's ``_SUCCESS``).
READY_MARKER = "_SUCCESS"


@dataclass(frozen=True)
class Partition:
    """One partition of a stream.

    Attributes:
        index: its place in the stream (the epoch that trains it).
        name: its name (the file's name without ``.parquet``, or the directory's).
        path: the file or directory.
        files: its Parquet files, in order.
        num_rows: its rows (rank 0 counted them when it took the partition; 0: not counted).
    """

    index: int
    name: str
    path: str
    files: tuple[str, ...]
    num_rows: int = 0


def _name(path: Path) -> str:
    return path.name.removesuffix(".parquet") if path.is_file() else path.name


def _ready(path: Path, ready_marker: str | None) -> bool:
    if path.is_dir():
        return ready_marker is None or (path / ready_marker).is_file()
    if path.is_file():
        return True
    # a Criteo day: its stem, present when its three files are
    return all(Path(f"{path}_{kind}.npy").is_file() for kind in NPY_KINDS)


def _order(name: str, criteo: bool) -> tuple[int, str]:
    """The sort key of a partition's name: the name; a Criteo day by its number."""
    if not criteo:
        return (0, name)
    number = re.findall(r"\d+", name)
    return (int(number[-1]) if number else -1, name)


def list_partitions(
    source: str | Path, ready_marker: str | None = READY_MARKER, criteo: bool = False
) -> list[Path]:
    """The complete partitions of a directory, in order.

    Args:
        source: the directory.
        ready_marker: the file that marks a partition directory complete (None: any).
        criteo: list TorchRec's npy days (``day_{i}_{dense,sparse,labels}.npy``, the three
            present) by day number, as their stems ``source/day_{i}``; else ``*.parquet``
            files and complete directories by name.

    Returns:
        The partitions, names starting with ``.`` or ``_`` left out.
    """
    found = []
    for child in Path(source).iterdir():
        if child.name.startswith((".", "_")):
            continue
        if criteo:
            if child.name.endswith("_dense.npy"):
                stem = child.with_name(child.name.removesuffix("_dense.npy"))
                if _ready(stem, ready_marker):
                    found.append(stem)
        elif child.is_dir() or child.name.endswith(".parquet"):
            if _ready(child, ready_marker):
                found.append(child)
    return sorted(found, key=lambda path: _order(_name(path), criteo))


class ParquetPartitionRows:
    """Rows ``[low, high)`` of a partition's Parquet files as batches (one row group cached).

    Args:
        rows: the partition's files (:class:`~lightning_torchrec.data.parquet.ParquetRows`).
        name: the partition's name, for errors.
    """

    def __init__(self, rows: ParquetRows, name: str) -> None:
        self.rows = rows
        self.name = name
        self.starts = [0]
        for *_, count in rows.row_groups:
            self.starts.append(self.starts[-1] + count)
        self.num_rows = self.starts[-1]
        self.columns = rows.file_columns
        self._opened: dict[int, Any] = {}
        self._cache: dict[int, pa.Table] = {}

    def batch(self, low: int, high: int) -> Batch:
        """The batch of rows ``[low, high)``.

        Args:
            low: the first row.
            high: the row after the last.

        Returns:
            The batch.

        Raises:
            PartitionError: naming the partition, file and row group, when a row group
                cannot be read.
        """
        pieces = []
        group = bisect_right(self.starts, low) - 1
        while low < high:
            if group not in self._cache:
                try:
                    table = self.rows.read_group(group, self._opened)
                except ValueError as e:
                    raise PartitionError(f"partition {self.name!r}: {e}") from e
                self._cache = {group: table}  # one row group in memory
            end = min(high, self.starts[group + 1])
            pieces.append(self._cache[group].slice(low - self.starts[group], end - low))
            low, group = end, group + 1
        return self.rows.batch_of(pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces))


class CriteoDayRows:
    """Rows ``[low, high)`` of one of TorchRec's npy days as batches, memory-mapped.

    The day's files are those :mod:`lightning_torchrec.data.criteo` reads (dense ``[N, 13]``,
    sparse ``[N, 26]``, labels ``[N, 1]``); ids are taken modulo the table sizes as the unsigned
    values raw int64 ids hold (:func:`~lightning_torchrec.data.criteo_files.reduce_ids`). The
    sparse features are TorchRec's ``cat_0 ... cat_25``, one id each.

    Args:
        stem: the day's stem (``.../day_{i}``).
        num_embeddings_per_feature: the table sizes (None: the ids as stored).

    Raises:
        ValueError: naming the file, for one that is not an npy array or of another shape.
    """

    def __init__(self, stem: str, num_embeddings_per_feature: Sequence[int] | None) -> None:
        self.arrays = {}
        for kind, width in (("dense", INT_FEATURE_COUNT), ("sparse", CAT_FEATURE_COUNT)):
            self.arrays[kind] = self._load(f"{stem}_{kind}.npy", width)
        self.arrays["labels"] = self._load(f"{stem}_labels.npy", 1)
        self.num_rows = len(self.arrays["dense"])
        for kind, array in self.arrays.items():
            if len(array) != self.num_rows:
                raise ValueError(
                    f"{stem}_{kind}.npy has {len(array)} rows, {stem}_dense.npy {self.num_rows}"
                )
        self.sizes = table_sizes_array(num_embeddings_per_feature)
        self.columns = [["dense", "labels", "sparse"]]

    @staticmethod
    def _load(path: str, width: int) -> np.ndarray:
        try:
            array = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: not a readable npy file: {e}") from e
        if array.ndim != 2 or array.shape[1] != width:
            raise ValueError(f"{path}: shape {array.shape}, expected [rows, {width}]")
        return array

    def batch(self, low: int, high: int) -> Batch:
        """The batch of rows ``[low, high)``.

        Args:
            low: the first row.
            high: the row after the last.

        Returns:
            The batch.
        """
        ids = np.asarray(self.arrays["sparse"][low:high])
        if self.sizes is not None:
            ids = reduce_ids(ids, self.sizes)
        values = np.ascontiguousarray(ids.astype(np.int64).T).reshape(-1)  # feature-major
        return Batch(
            dense_features=torch.from_numpy(np.array(self.arrays["dense"][low:high], np.float32)),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=list(DEFAULT_CAT_NAMES),
                values=torch.from_numpy(values),
                lengths=torch.ones(len(values), dtype=torch.int32),
            ),
            labels=torch.from_numpy(np.array(self.arrays["labels"][low:high, 0], np.float32)),
        )


class PartitionStreamDataset(ResumableIterableDataset):
    """The batches of one partition on one rank (see the module docstring).

    The loader sets :attr:`partition` and :attr:`start_row` before each iteration.

    Args:
        dense_columns: numeric columns, in order, forming ``dense_features``.
        sparse_columns: id columns (lists of integers, or integers), one sparse feature each.
        label_column: the 0/1 label column.
        weight_column: a sample-weight column, or None.
        batch_size: samples per batch on each rank.
        rank: this process's rank.
        world_size: the number of ranks.
        feature_names: the KJT keys of the sparse columns (default: the column names).
        num_embeddings_per_feature: ids are taken modulo these table sizes (None: as stored).
        criteo: the partitions are TorchRec's npy days (:class:`CriteoDayRows`; the columns
            are then unused).
    """

    def __init__(
        self,
        dense_columns: Sequence[str],
        sparse_columns: Sequence[str],
        label_column: str,
        weight_column: str | None = None,
        batch_size: int = 512,
        rank: int = 0,
        world_size: int = 1,
        feature_names: Sequence[str] | None = None,
        num_embeddings_per_feature: Sequence[int] | None = None,
        criteo: bool = False,
    ) -> None:
        check_positive("batch_size", batch_size)
        self.columns = {
            "dense_columns": list(dense_columns),
            "sparse_columns": list(sparse_columns),
            "label_column": label_column,
            "weight_column": weight_column,
            "feature_names": list(feature_names or sparse_columns),
            "num_embeddings_per_feature": (
                None if num_embeddings_per_feature is None else list(num_embeddings_per_feature)
            ),
        }
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.criteo = criteo
        self.partition: Partition | None = None
        self.start_row = 0

    def layout(self) -> dict[str, int]:
        """What the order depends on: nothing but the rows (one global order).

        Returns:
            ``world_size`` and ``batch_size`` (a resume converts them to rows exactly).
        """
        return {"world_size": self.world_size, "batch_size": self.batch_size}

    def rows(self, partition: Partition) -> ParquetPartitionRows | CriteoDayRows:
        """The reader of a partition.

        Args:
            partition: the partition.

        Returns:
            Its rows.

        Raises:
            PartitionError: naming the partition, for a file that is not Parquet (or is
                truncated), a missing column or one of the wrong type; for a Criteo day, a file
                that is not an npy array of the day's shape.
        """
        try:
            if self.criteo:
                return CriteoDayRows(partition.path, self.columns["num_embeddings_per_feature"])
            return ParquetPartitionRows(
                ParquetRows(list(partition.files), **self.columns), partition.name
            )
        except (ValueError, OSError) as e:
            raise PartitionError(f"partition {partition.name!r} ({partition.path}): {e}") from e

    def __iter__(self) -> Iterator[Batch]:
        partition = self.partition
        if partition is None:
            return
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        reader = self.rows(partition)
        step = self.world_size * self.batch_size
        for j in range(worker, (reader.num_rows - self.start_row) // step, workers):
            low = self.start_row + j * step + self.rank * self.batch_size
            yield reader.batch(low, low + self.batch_size)


class PartitionStreamLoader(ResumableDataLoader):
    """The DataLoader of a stream's training or validation batches: one partition an iteration.

    At each iteration's start (in the main process, every rank together) it asks its data module
    for the partition: the Trainer's epoch for training, the next one for validation (see
    :class:`PartitionStreamData`). It has no length (partitions differ in rows). Its resume
    hooks, which :mod:`lightning_torchrec.lightning.mid_epoch` calls, count in the partition's
    rows: :meth:`resume_rows` and :meth:`rows_done`; :meth:`resume_at` takes batches of this
    loader.

    Args:
        data: the data module.
        dataset: its dataset on this rank.
        stage: ``"train"`` or ``"val"``.
        **kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).
    """

    def __init__(
        self,
        data: PartitionStreamData,
        dataset: PartitionStreamDataset,
        stage: str,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.data = data
        self.stage = stage
        self.epoch: int | None = None
        self.partition: Partition | None = None
        self._resume: tuple[int, int] = (0, 0)  # (rows, batches) the next iteration skips
        self._started: tuple[int, int] = (0, 0)  # what the current iteration skipped

    def __len__(self) -> int:
        raise TypeError("a stream's partitions differ in length")

    @property
    def rows_per_step(self) -> int:
        """Rows the ranks train on together in one step: ``world_size * batch_size``."""
        dataset = self.dataset
        assert isinstance(dataset, PartitionStreamDataset)
        return dataset.world_size * dataset.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Makes the next iteration read partition ``epoch`` (else the Trainer's epoch).

        Args:
            epoch: the partition's index.
        """
        self.epoch = int(epoch)

    def resume_rows(self, rows: int) -> int:
        """Makes the next iteration start at row ``rows`` of its partition (those trained on).

        Args:
            rows: rows of the partition already trained on, by any world and batch size.

        Returns:
            The batches per rank of this loader those rows make, rounded down (what the fit
            loop counts as done).

        Raises:
            ValueError: if ``rows`` is negative.
        """
        if rows < 0:
            raise ValueError(f"PartitionStreamLoader.resume_rows needs rows >= 0, got {rows}")
        self._resume = (int(rows), int(rows) // self.rows_per_step)
        return self._resume[1]

    def resume_at(self, batches: int) -> None:
        """Makes the next iteration start after ``batches`` batches of this loader.

        Args:
            batches: batches per rank of the partition already trained on.

        Raises:
            ValueError: if ``batches`` is negative.
        """
        if batches < 0:
            raise ValueError(f"PartitionStreamLoader.resume_at needs batches >= 0, got {batches}")
        self.resume_rows(batches * self.rows_per_step)

    def rows_done(self, batches: int) -> int:
        """The rows of the current partition trained on after ``batches`` batches per rank.

        Args:
            batches: the batches of the current iteration's epoch counted as done (those the
                iteration skipped included).

        Returns:
            The rows.
        """
        rows, skipped = self._started
        return rows + (int(batches) - skipped) * self.rows_per_step

    def resume_layout(self) -> dict[str, int]:
        """What the order depends on besides the world size: the batch size.

        Returns:
            ``{"batch_size": B}``.
        """
        dataset = self.dataset
        assert isinstance(dataset, PartitionStreamDataset)
        return {"batch_size": dataset.batch_size}

    def __iter__(self) -> Iterator[Any]:
        self.dataset.start_batch = 0
        self._started, self._resume = self._resume, (0, 0)
        index = self.data.index_for(self)
        if self.stage == "train" and self._started[0] > 0:
            partition = self.data.partition(index)
            dataset = self.dataset
            assert isinstance(dataset, PartitionStreamDataset)
            if partition is not None and (
                self._started[0] + self.rows_per_step > partition.num_rows
            ):
                # Resumed after the partition's last batch: Lightning ends this epoch without
                # reading and reads the next epoch from this iterator.
                index, self._started = index + 1, (0, 0)
        return self._batches(index)

    def _batches(self, index: int) -> Iterator[Any]:
        partition = self.data.partition(index)
        self.partition = partition
        if self.stage == "train":
            self.data.trained_index = index
        else:
            self.data.evaluating = partition
        dataset = self.dataset
        assert isinstance(dataset, PartitionStreamDataset)
        dataset.partition, dataset.start_row = partition, self._started[0]
        if partition is None:
            self.data.stop_fit()
            return
        self.data.note_tail(partition, dataset, self.stage)
        yield from super(ResumableDataLoader, self).__iter__()
        if self.stage == "train":
            # The next partition is taken (or the stream ends) within this epoch, at its last
            # fetch, so that the epoch after the stream's last partition is never started.
            try:
                if self.data.partition(index + 1) is None:
                    self.data.stop_fit(after=index)
            except PartitionError:
                pass  # raised where the partition is needed, when the next epoch asks again


class PartitionStreamData(LightningDataModule):
    """A stream of time partitions as training data (see the module docstring).

    Args:
        source: a directory of partitions (files ``*.parquet`` and directories, ordered by
            name), or an ordered list of partition paths.
        dense_columns: numeric columns forming ``dense_features``.
        sparse_columns: id columns (lists of integers, or integers), one sparse feature each.
        label_column: the 0/1 label column.
        weight_column: a sample-weight column, or None.
        batch_size: samples per batch on each rank.
        num_workers: DataLoader workers per rank.
        feature_names: KJT keys of the sparse columns (default: the column names).
        num_embeddings_per_feature: table sizes; ids are taken modulo these (None: as stored).
        ready_marker: the file that marks a partition directory complete (None: any directory
            is complete).
        poll_seconds: seconds between two listings while waiting for a partition.
        timeout_seconds: how long to wait for the next partition before the stream ends (0:
            train what is there, then end).
        criteo: the partitions are TorchRec's npy days (see :meth:`criteo_days`).

    Raises:
        ValueError: for a batch size below 1, a negative wait, or a source directory that
            does not exist.
    """

    def __init__(
        self,
        source: str | Path | Sequence[str | Path],
        dense_columns: list[str],
        sparse_columns: list[str],
        label_column: str,
        weight_column: str | None = None,
        batch_size: int = 512,
        num_workers: int = 0,
        feature_names: list[str] | None = None,
        num_embeddings_per_feature: list[int] | None = None,
        ready_marker: str | None = READY_MARKER,
        poll_seconds: float = 10.0,
        timeout_seconds: float = 0.0,
        criteo: bool = False,
    ) -> None:
        super().__init__()
        check_positive("batch_size", batch_size)
        if poll_seconds <= 0 or timeout_seconds < 0:
            raise ValueError(
                f"poll_seconds must be > 0 and timeout_seconds >= 0, got {poll_seconds} and "
                f"{timeout_seconds}"
            )
        if isinstance(source, str | Path):
            if not Path(source).is_dir():
                raise ValueError(f"partition source {source} is not a directory")
            self.source: Path | list[Path] = Path(source)
        else:
            self.source = [Path(p) for p in source]
        self.dense_columns = list(dense_columns)
        self.sparse_columns = list(sparse_columns)
        self.label_column = label_column
        self.weight_column = weight_column
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.feature_names = list(feature_names or sparse_columns)
        self.num_embeddings_per_feature = num_embeddings_per_feature
        self.num_dense_features = len(self.dense_columns)
        self.ready_marker = ready_marker
        self.criteo = criteo
        self.poll_seconds = float(poll_seconds)
        self.timeout_seconds = float(timeout_seconds)
        #: The partitions taken so far, by index (epoch).
        self.partitions: list[Partition] = []
        #: Why the stream ended (a sentence), or None while it goes on.
        self.ended: str | None = None
        #: The partition the validation loader iterates (or last iterated), or None.
        self.evaluating: Partition | None = None
        #: The epoch the training loader iterates (or last iterated); -1 before the first.
        self.trained_index = -1
        self._restored: list[dict[str, str]] = []
        self._first_columns: list[str] | None = None
        self._skipped: set[str] = set()
        self._tails: set[tuple[str, str]] = set()
        #: Rank 0, while it waits for the next partition: when the wait ends (monotonic clock).
        self._deadline: float | None = None

    @property
    def current_partition(self) -> str | None:
        """The name of the partition the training loader iterates (or last iterated).

        A delta published at a partition's end names it (``DeltaPublisher``).
        """
        if 0 <= self.trained_index < len(self.partitions):
            return self.partitions[self.trained_index].name
        return None

    @classmethod
    def criteo_days(
        cls,
        source: str | Path | Sequence[str | Path],
        num_embeddings_per_feature: Sequence[int] | int | None = None,
        batch_size: int = 512,
        num_workers: int = 0,
        poll_seconds: float = 10.0,
        timeout_seconds: float = 0.0,
    ) -> PartitionStreamData:
        """A stream of TorchRec's npy Criteo days, one a partition, by day number.

        A day ``day_{i}`` (``day_{i}_{dense,sparse,labels}.npy``, written by
        ``python -m lightning_torchrec.criteo preprocess``) counts once its three files exist:
        write them under other names and rename them, labels last.

        Args:
            source: a directory of days, or an ordered list of day stems (``.../day_3``).
            num_embeddings_per_feature: 26 table sizes, or one for all (None: ids as stored).
            batch_size: samples per batch on each rank.
            num_workers: DataLoader workers per rank.
            poll_seconds: seconds between two listings while waiting for a day.
            timeout_seconds: how long to wait for the next day before the stream ends.

        Returns:
            The data module (``num_dense_features`` 13, features ``cat_0 ... cat_25``).
        """
        sizes = table_sizes_array(num_embeddings_per_feature)
        return cls(
            source,
            list(DEFAULT_INT_NAMES),
            list(DEFAULT_CAT_NAMES),
            DEFAULT_LABEL_NAME,
            batch_size=batch_size,
            num_workers=num_workers,
            num_embeddings_per_feature=None if sizes is None else sizes.tolist(),
            ready_marker=None,
            poll_seconds=poll_seconds,
            timeout_seconds=timeout_seconds,
            criteo=True,
        )

    # ------------------------------------------------------------------ loaders
    def rank_and_world(self) -> tuple[int, int]:
        """This rank and the world size: the Trainer's, else the default process group's.

        Returns:
            ``(rank, world_size)``; ``(0, 1)`` without either.
        """
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def setup(self, stage: str) -> None:
        """Opens the stream again for each ``fit`` or ``validate`` (new partitions may be there).

        Args:
            stage: Lightning's stage.
        """
        self.ended = None

    def dataset(self) -> PartitionStreamDataset:
        """The dataset on this rank (its loader sets the partition of each iteration).

        Returns:
            The dataset.
        """
        rank, world = self.rank_and_world()
        return PartitionStreamDataset(
            self.dense_columns,
            self.sparse_columns,
            self.label_column,
            self.weight_column,
            batch_size=self.batch_size,
            rank=rank,
            world_size=world,
            feature_names=self.feature_names,
            num_embeddings_per_feature=self.num_embeddings_per_feature,
            criteo=self.criteo,
        )

    def train_dataloader(self) -> PartitionStreamLoader:
        """Training batches: partition e at epoch e (a mid-partition checkpoint: from its row)."""
        return PartitionStreamLoader(self, self.dataset(), "train", num_workers=self.num_workers)

    def val_dataloader(self) -> PartitionStreamLoader:
        """Validation batches: the partition after the one trained (partition 0 before any)."""
        return PartitionStreamLoader(self, self.dataset(), "val", num_workers=self.num_workers)

    def index_for(self, loader: PartitionStreamLoader) -> int:
        """The partition a loader's next iteration reads.

        Training: the Trainer's epoch (without a Trainer: the loader's :meth:`set_epoch`, else
        the one after the last trained). Validation: the one after the epoch being trained
        (the sanity check before training, and ``trainer.validate``: the first not trained).

        Args:
            loader: the loader.

        Returns:
            The index.
        """
        trainer = self.trainer
        if loader.stage == "train":
            if loader.epoch is not None:
                index, loader.epoch = loader.epoch, None
                return index
            return trainer.current_epoch if trainer is not None else self.trained_index + 1
        if trainer is not None:
            # Within a fit: the partition after the epoch's (the sanity check: the epoch's own).
            # trainer.validate(): the first partition not trained (current_epoch counts those).
            fitting = trainer.state.fn == "fit" and not trainer.sanity_checking  # TrainerFn.FITTING
            return trainer.current_epoch + (1 if fitting else 0)
        return self.trained_index + 1

    def stop_fit(self, after: int | None = None) -> None:
        """Stops the Trainer's fit cleanly once the stream ended (nothing without a Trainer).

        Args:
            after: the epoch the fit ends after: its batches are all trained (the fit loop's
                ``max_epochs`` is lowered to it; ``should_stop`` would end the epoch at its
                next batch, before the batches a step has read ahead). None: now
                (``should_stop``; the epoch has no batch to train).
        """
        trainer = self.trainer
        if trainer is None:
            return
        if after is None:
            trainer.should_stop = True
            return
        cap = trainer.fit_loop.max_epochs
        if cap is None or cap < 0 or cap > after + 1:
            trainer.fit_loop.max_epochs = after + 1

    def note_tail(self, partition: Partition, dataset: PartitionStreamDataset, stage: str) -> None:
        """Logs once per partition and stage the rows that do not fill one global batch."""
        if (partition.name, stage) in self._tails or dataset.rank != 0:
            return
        self._tails.add((partition.name, stage))
        rows = partition.num_rows
        step = dataset.world_size * dataset.batch_size
        if rows % step:
            log.info(
                "partition %r: its last %d of %d rows fill no global batch of %d (%d ranks x %d) "
                "and are not %s",
                partition.name,
                rows % step,
                rows,
                step,
                dataset.world_size,
                dataset.batch_size,
                "trained on" if stage == "train" else "evaluated",
            )

    # ------------------------------------------------------------------ the stream
    def partition(self, index: int) -> Partition | None:
        """Partition ``index`` of the stream, waited for when it has not appeared yet.

        Collective when the default process group is initialised: every rank calls it with the
        same index; rank 0 lists the source and decides, the others take its decision.

        Args:
            index: the partition's place (0 for the first).

        Returns:
            The partition, or None when the stream ended before it (logged once).

        Raises:
            PartitionError: naming the partition, when it is missing or cannot be trained on.
        """
        while len(self.partitions) <= index and self.ended is None:
            # One look at the source a round, rank 0's, its error raised on every rank; the
            # ranks wait between rounds together, so no collective lasts longer than a poll.
            decision = broadcast_from_rank0(self._decide)
            if "wait" in decision:
                time.sleep(decision["wait"])
                continue
            self._deadline = None
            if "error" in decision:
                raise PartitionError(decision["error"])
            if "end" in decision:
                self.ended = decision["end"]
                if self.rank_and_world()[0] == 0:
                    log.info("%s", self.ended)
                break
            self._first_columns = self._first_columns or decision["columns"]
            self.partitions.append(
                Partition(
                    len(self.partitions),
                    decision["name"],
                    decision["path"],
                    decision["files"],
                    decision["num_rows"],
                )
            )
        return self.partitions[index] if index < len(self.partitions) else None

    def _decide(self) -> dict[str, Any]:
        """Rank 0: the next partition (checked), the stream's end, an error, or a wait."""
        index = len(self.partitions)
        if index < len(self._restored):  # taken before the checkpoint: the same one again
            saved = self._restored[index]
            path = Path(saved["path"])
            if not _ready(path, self.ready_marker):
                return {
                    "error": f"partition {saved['name']!r} ({path}), taken by epoch {index} "
                    "before the checkpoint, is missing"
                }
            return self._check(saved["name"], path)
        found = self._next_present()
        if isinstance(found, dict):
            return found
        if found is not None:
            return self._check(found[0], found[1])
        if self._deadline is None:
            self._deadline = time.monotonic() + self.timeout_seconds
        left = self._deadline - time.monotonic()
        return self._end_of_wait() if left <= 0 else {"wait": min(self.poll_seconds, left)}

    def _next_present(self) -> tuple[str, Path] | dict[str, Any] | None:
        """Rank 0: the next partition present, the end of a list, or None (none yet)."""
        index = len(self.partitions)
        if isinstance(self.source, list):
            if index >= len(self.source):
                return {
                    "end": f"partition stream ended after its last listed partition "
                    f"{self.partitions[-1].name if self.partitions else None!r}"
                }
            path = self.source[index]
            return (_name(path), path) if _ready(path, self.ready_marker) else None
        last = self.partitions[-1].name if self.partitions else None
        taken = {p.name for p in self.partitions}
        for path in list_partitions(self.source, self.ready_marker, self.criteo):
            name = _name(path)
            if name in taken:
                continue
            if last is not None and _order(name, self.criteo) < _order(last, self.criteo):
                if name not in self._skipped:
                    self._skipped.add(name)
                    warnings.warn(
                        f"partition {name!r} ({path}) appeared after partition {last!r}, which "
                        "sorts after it, was taken: it is skipped (the stream trains its "
                        "partitions in order, once)",
                        UserWarning,
                        stacklevel=2,
                    )
                continue
            return name, path
        return None

    def _end_of_wait(self) -> dict[str, str]:
        """Rank 0, nothing new in time: a listed partition is missing; a directory's stream ends."""
        wait = f"within {self.timeout_seconds:g} s"
        if isinstance(self.source, list):
            path = self.source[len(self.partitions)]
            return {"error": f"partition {_name(path)!r} ({path}) is missing (waited {wait})"}
        last = repr(self.partitions[-1].name) if self.partitions else "(none)"
        return {
            "end": f"partition stream ended: no partition after {last} appeared in "
            f"{self.source} {wait}; the fit stops"
        }

    def _check(self, name: str, path: Path) -> dict[str, Any]:
        """Rank 0: a partition's files, checked (readable, columns as the first partition's)."""
        where = f"partition {name!r} ({path})"
        try:
            files = [str(path)] if self.criteo else [str(f) for f in expand_paths(str(path))]
        except FileNotFoundError:
            return {"error": f"{where} holds no Parquet file"}
        dataset = self.dataset()
        try:
            reader = dataset.rows(Partition(len(self.partitions), name, str(path), tuple(files)))
        except PartitionError as e:
            return {"error": str(e)}
        columns = sorted(reader.columns[0])
        for file, found in zip(files, reader.columns, strict=True):
            want = self._first_columns or columns
            if sorted(found) != want:
                extra, missing = sorted(set(found) - set(want)), sorted(set(want) - set(found))
                return {
                    "error": f"{where}: {file} has other columns than the stream's first "
                    f"partition (added: {extra}, missing: {missing})"
                }
        return {
            "name": name,
            "path": str(path),
            "files": tuple(files),
            "columns": columns,
            "num_rows": reader.num_rows,
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The partitions taken so far (Lightning keeps this in checkpoints).

        Returns:
            ``{"partitions": [{"name": ..., "path": ...}, ...], "columns": [...]}``.
        """
        taken = [{"name": p.name, "path": p.path} for p in self.partitions]
        taken += self._restored[len(taken) :]  # restored, not needed again yet
        return {"partitions": taken, "columns": self._first_columns}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Maps each epoch to the partition it had before the checkpoint.

        Args:
            state_dict: from :meth:`state_dict`.
        """
        self._restored = [dict(p) for p in state_dict.get("partitions", [])]
        self._first_columns = state_dict.get("columns")
        self.partitions, self.ended = [], None
