"""Click data from Parquet files, streamed with pyarrow: ``ParquetClickData``.

Row groups are the unit of work: they are dealt round-robin to the ``world_size * num_workers``
readers (each rank's DataLoader workers), each reader streams its row groups one at a time (the
memory holds one row group and a partial batch) and cuts them into batches. Every reader yields
the same number of batches (the smallest reader's count; the rest is dropped), so every rank
gets the same number of batches per epoch. List columns become jagged ids (one bag per sample),
integer columns one id per sample. Row groups are cast to one schema (float32 numbers, int64
ids), so files whose columns differ in width or nullability mix in a batch. The order is fixed
(files, then row groups, as given), and a checkpoint written mid-epoch resumes exactly.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.data.batch import Batch
from lightning_torchrec.data.parquet_columns import (
    bag_values,
    check_positive,
    check_schema,
    id_column,
    is_bag,
    number_column,
    number_tensor,
)
from lightning_torchrec.data.resumable import (
    ResumableDataModule,
    ResumableIterableDataset,
    worker_slot,
)

__all__ = ["ParquetClickData", "ParquetClickDataset", "ParquetRows", "expand_paths"]


def expand_paths(paths: str | Sequence[str]) -> list[Path]:
    """Parquet files from files, directories (their ``*.parquet``, sorted) and glob patterns.

    A path that exists is taken as it is, even when its name holds ``*``, ``?`` or ``[``.

    Args:
        paths: one path or pattern, or several.

    Returns:
        The files, in order.

    Raises:
        FileNotFoundError: if a path matches nothing.
    """
    files: list[Path] = []
    for p in [paths] if isinstance(paths, str | Path) else paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(path.glob("*.parquet"))
        elif path.exists():  # a file named with glob characters ("clicks[2024].parquet")
            found = [path]
        elif any(c in str(p) for c in "*?["):
            found = sorted(Path(f) for f in glob.glob(str(p)))
        else:
            found = []
        if not found:
            raise FileNotFoundError(f"no Parquet files at {p}")
        files.extend(found)
    return files


class ParquetRows:
    """The rows of Parquet files as batches: their columns checked, their row groups listed.

    What :class:`ParquetClickDataset` and the partitions of a stream
    (:mod:`lightning_torchrec.data.stream`) share: the files' columns are checked against their
    roles when it is built, :attr:`row_groups` lists ``(file, row group, rows)`` in order,
    :meth:`read_group` reads one row group in the one schema (numbers float32, ids int64 modulo
    the table sizes) and :meth:`to_batch` turns rows into a :class:`Batch`. How row groups are
    dealt to readers is the user's.

    Args:
        paths: Parquet files, directories or glob patterns.
        dense_columns: numeric columns, in order, forming ``dense_features``.
        sparse_columns: id columns (lists of integers, or integers), one sparse feature each.
        label_column: the 0/1 label column.
        weight_column: a sample-weight column, or None.
        feature_names: the KJT keys of the sparse columns (default: the column names).
        num_embeddings_per_feature: ids are taken modulo these table sizes (None: as stored).

    Raises:
        ValueError: naming the file and column, for a missing column or one of the wrong type,
            naming the file for one that is not Parquet (or is truncated), or for a table size
            below 1.
    """

    def __init__(
        self,
        paths: str | Sequence[str],
        dense_columns: Sequence[str],
        sparse_columns: Sequence[str],
        label_column: str,
        weight_column: str | None = None,
        feature_names: Sequence[str] | None = None,
        num_embeddings_per_feature: Sequence[int] | None = None,
    ) -> None:
        self.files = expand_paths(paths)
        self.dense_columns = list(dense_columns)
        self.sparse_columns = list(sparse_columns)
        self.label_column = label_column
        self.weight_column = weight_column
        self.feature_names = list(feature_names or sparse_columns)
        if len(self.feature_names) != len(self.sparse_columns):
            raise ValueError("feature_names needs one name per sparse column")
        self.hashes = (
            None if num_embeddings_per_feature is None else list(num_embeddings_per_feature)
        )
        if self.hashes is not None and len(self.hashes) != len(self.sparse_columns):
            raise ValueError("num_embeddings_per_feature needs one size per sparse column")
        if self.hashes is not None:
            check_positive("num_embeddings_per_feature", self.hashes)
        self.row_groups: list[tuple[int, int, int]] = []  # (file, row group, rows)
        #: Every file's column names, in the order of the files.
        self.file_columns: list[list[str]] = []
        # A sparse column is read as bags (jagged) if any file holds it as lists.
        self.bags = [False] * len(self.sparse_columns)
        for i, path in enumerate(self.files):
            try:
                meta = pq.read_metadata(path)
            except (pa.ArrowException, OSError) as e:  # pyarrow's messages name no file
                raise ValueError(f"{path}: not a readable Parquet file: {e}") from e
            schema = meta.schema.to_arrow_schema()
            check_schema(
                path, schema, self.dense_columns, self.sparse_columns, label_column, weight_column
            )
            self.file_columns.append(list(schema.names))
            for f, column in enumerate(self.sparse_columns):
                self.bags[f] |= is_bag(schema.field(column).type)
            self.row_groups += [
                (i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
            ]

    @property
    def num_rows(self) -> int:
        """The rows of all files."""
        return sum(rows for *_, rows in self.row_groups)

    def columns(self) -> list[str]:
        """The columns read.

        Returns:
            Dense, sparse, label and weight columns.
        """
        extra = [self.weight_column] if self.weight_column else []
        return self.dense_columns + self.sparse_columns + [self.label_column] + extra

    def to_batch(self, table: pa.Table, source: str = "table") -> Batch:
        """Converts rows (a table with :meth:`columns`) to a batch.

        Args:
            table: the rows.
            source: where the rows come from, for errors.

        Returns:
            The batch.

        Raises:
            ValueError: naming the source, column and id, for an id above ``2**63 - 1`` (uint64).
        """
        return self.batch_of(self._normalise(table, source))

    def _normalise(self, table: pa.Table, source: str) -> pa.Table:
        """Rows in the dataset's one schema, whatever the file's widths and nullability.

        Numbers become float32 (null is 0), ids int64 modulo the table sizes (null lists are
        empty bags, null ids 0): row groups of differently typed files concatenate.
        """
        columns = {c: number_column(table.column(c)) for c in self.dense_columns}
        for f, c in enumerate(self.sparse_columns):
            size = None if self.hashes is None else self.hashes[f]
            where = f"{source}: sparse column {c!r}"
            columns[c] = id_column(table.column(c), size, where, self.bags[f])
        for c in [self.label_column] + ([self.weight_column] if self.weight_column else []):
            columns[c] = number_column(table.column(c))
        return pa.table(columns)

    def batch_of(self, rows: pa.Table) -> Batch:
        """The batch of rows in the one schema (from :meth:`read_group`).

        Args:
            rows: the rows.

        Returns:
            The batch.
        """
        # np.stack copies the columns into one writable [batch, dense] array ([batch, 0] for a
        # model of sparse features only: np.stack of no column fails).
        columns = [number_column(rows.column(c)).to_numpy() for c in self.dense_columns]
        dense = np.stack(columns, 1) if columns else np.zeros((rows.num_rows, 0), np.float32)
        ids = [bag_values(rows.column(c)) for c in self.sparse_columns]
        weights = number_tensor(rows.column(self.weight_column)) if self.weight_column else None
        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=self.feature_names,
                values=torch.from_numpy(np.concatenate([v for v, _ in ids])),
                lengths=torch.from_numpy(np.concatenate([n for _, n in ids])),
            ),
            labels=number_tensor(rows.column(self.label_column)),
            weights=weights,
        )

    def read_group(self, index: int, opened: dict[int, Any] | None = None) -> pa.Table:
        """One row group of :attr:`row_groups`, in the one schema (see :meth:`to_batch`).

        Args:
            index: the row group's place in :attr:`row_groups`.
            opened: a cache of the last file opened, kept by the caller across calls.

        Returns:
            Its rows, normalised.

        Raises:
            ValueError: naming the file and row group, when it cannot be read (a corrupt page)
                or holds an id above ``2**63 - 1`` without table sizes.
        """
        table, where = self._read_raw(index, {} if opened is None else opened)
        return self._normalise(table, where)

    def _read_raw(self, index: int, opened: dict[int, Any]) -> tuple[pa.Table, str]:
        """A row group's columns as stored, and its name for errors."""
        file_index, group, _ = self.row_groups[index]
        where = f"{self.files[file_index]} (row group {group})"
        try:
            if file_index not in opened:
                opened.clear()
                opened[file_index] = pq.ParquetFile(self.files[file_index])
            return opened[file_index].read_row_group(group, columns=self.columns()), where
        except (pa.ArrowException, OSError) as e:  # a corrupt page: name the row group
            raise ValueError(f"{where}: cannot be read: {e}") from e


class ParquetClickDataset(ParquetRows, ResumableIterableDataset):
    """Batches of click samples streamed from Parquet row groups (see the module docstring).

    Args:
        paths: Parquet files, directories or glob patterns.
        dense_columns: numeric columns, in order, forming ``dense_features``.
        sparse_columns: id columns (lists of integers, or integers), one sparse feature each.
        label_column: the 0/1 label column.
        weight_column: a sample-weight column, or None.
        batch_size: samples per batch.
        rank: this process's rank.
        world_size: the number of ranks.
        num_workers: the DataLoader workers that will iterate this dataset.
        feature_names: the KJT keys of the sparse columns (default: the column names).
        num_embeddings_per_feature: ids are taken modulo these table sizes (None: as stored).

    Raises:
        ValueError: naming the file and column, for a missing column or one of the wrong type,
            naming the file for one that is not Parquet (or is truncated), when the files have
            fewer rows than one batch per reader, or for a table size or batch size below 1.
            A row group that cannot be read fails when it is read, naming the file and group.
    """

    def __init__(
        self,
        paths: str | Sequence[str],
        dense_columns: Sequence[str],
        sparse_columns: Sequence[str],
        label_column: str,
        weight_column: str | None = None,
        batch_size: int = 512,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        feature_names: Sequence[str] | None = None,
        num_embeddings_per_feature: Sequence[int] | None = None,
    ) -> None:
        ParquetRows.__init__(
            self,
            paths,
            dense_columns,
            sparse_columns,
            label_column,
            weight_column,
            feature_names,
            num_embeddings_per_feature,
        )
        check_positive("batch_size", batch_size)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_slots = max(num_workers, 1)
        readers = world_size * self.num_slots
        rows = [sum(r for *_, r in self.row_groups[s::readers]) for s in range(readers)]
        self.batches_per_slot = min(rows) // batch_size
        if self.batches_per_slot == 0:
            raise ValueError(
                f"{len(self.row_groups)} row groups ({sum(rows)} rows) give a reader of "
                f"{world_size} ranks x {self.num_slots} workers fewer than {batch_size} rows: "
                "write smaller row groups, or use a smaller batch or fewer workers"
            )

    def __len__(self) -> int:
        return self.batches_per_slot * self.num_slots

    def __iter__(self) -> Iterator[Batch]:
        slot, num_slots, skip = worker_slot(self.start_batch)
        if num_slots != self.num_slots:
            raise RuntimeError(
                f"dataset built for {self.num_slots} readers per rank, iterated by {num_slots}: "
                "pass the DataLoader's num_workers to the dataset"
            )
        reader = self.rank * num_slots + slot
        to_skip = skip * self.batch_size  # rows already trained on
        produced = skip
        pending: pa.Table | None = None
        opened: dict[int, Any] = {}
        for index in range(reader, len(self.row_groups), self.world_size * num_slots):
            rows = self.row_groups[index][2]
            if produced >= self.batches_per_slot:
                break
            if to_skip >= rows:  # never read a row group the resumed run skips whole
                to_skip -= rows
                continue
            table, where = self._read_raw(index, opened)
            if to_skip:
                table, to_skip = table.slice(to_skip), 0
            # One schema for every file's rows: a batch may span two files.
            table = self._normalise(table, where)
            pending = table if pending is None else pa.concat_tables([pending, table])
            while pending.num_rows >= self.batch_size and produced < self.batches_per_slot:
                yield self.batch_of(pending.slice(0, self.batch_size))
                pending = pending.slice(self.batch_size)
                produced += 1


class ParquetClickData(ResumableDataModule):
    """Lightning data module of click data in Parquet files (see :class:`ParquetClickDataset`).

    Args:
        paths: training files, directories or glob patterns.
        dense_columns: numeric columns forming ``dense_features``.
        sparse_columns: id columns (lists of integers, or integers), one sparse feature each.
        label_column: the 0/1 label column.
        weight_column: a sample-weight column, or None.
        val_paths: validation files (None: no validation).
        test_paths: test files (None: no test).
        batch_size: samples per batch on each rank.
        num_workers: DataLoader workers per rank.
        feature_names: KJT keys of the sparse columns (default: the column names).
        num_embeddings_per_feature: table sizes; ids are taken modulo these (None: as stored;
            then the model's tables must cover the largest id).
    """

    def __init__(
        self,
        paths: str | list[str],
        dense_columns: list[str],
        sparse_columns: list[str],
        label_column: str,
        weight_column: str | None = None,
        val_paths: str | list[str] | None = None,
        test_paths: str | list[str] | None = None,
        batch_size: int = 512,
        num_workers: int = 0,
        feature_names: list[str] | None = None,
        num_embeddings_per_feature: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.paths = {"train": paths, "val": val_paths, "test": test_paths}
        self.dense_columns = list(dense_columns)
        self.sparse_columns = list(sparse_columns)
        self.label_column = label_column
        self.weight_column = weight_column
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.feature_names = list(feature_names or sparse_columns)
        self.num_embeddings_per_feature = num_embeddings_per_feature
        self.num_dense_features = len(self.dense_columns)
        # Checks the columns of every stage's files now, not at the stage's first batch.
        for stage in [stage for stage, given in self.paths.items() if given is not None]:
            self.dataset(stage)

    def val_dataloader(self) -> DataLoader[Any] | list[Any]:
        """Validation batches; none without ``val_paths`` (``fit`` then skips validation)."""
        return super().val_dataloader() if self.paths["val"] is not None else []

    def dataset(self, stage: str, num_workers: int = 0) -> ParquetClickDataset:
        """The dataset of one stage on this rank.

        Args:
            stage: ``train``, ``val`` or ``test``.
            num_workers: the workers that will read it.

        Returns:
            The dataset.

        Raises:
            ValueError: if the stage has no paths.
        """
        paths = self.paths[stage]
        if paths is None:
            raise ValueError(f"ParquetClickData has no paths for stage {stage!r}")
        rank, world = self.rank_and_world()
        return ParquetClickDataset(
            paths,
            self.dense_columns,
            self.sparse_columns,
            self.label_column,
            self.weight_column,
            batch_size=self.batch_size,
            rank=rank,
            world_size=world,
            num_workers=num_workers,
            feature_names=self.feature_names,
            num_embeddings_per_feature=self.num_embeddings_per_feature,
        )
