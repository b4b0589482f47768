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

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.data.batch import Batch
from lightning_torchrec.data.resumable import (
    ResumableDataModule,
    ResumableIterableDataset,
    worker_slot,
)

__all__ = ["ParquetClickData", "ParquetClickDataset", "expand_paths"]


def expand_paths(paths: str | Sequence[str]) -> list[Path]:
    """Parquet files from files, directories (their ``*.parquet``, sorted) and glob patterns.

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
        elif any(c in str(p) for c in "*?["):
            found = sorted(Path(f) for f in glob.glob(str(p)))
        else:
            found = [path] if path.exists() else []
        if not found:
            raise FileNotFoundError(f"no Parquet files at {p}")
        files.extend(found)
    return files


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_bag(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_ids(t: pa.DataType) -> bool:
    return pa.types.is_integer(t.value_type if _is_bag(t) else t)


def _check_schema(
    path: Path,
    schema: pa.Schema,
    dense: Sequence[str],
    sparse: Sequence[str],
    label: str,
    weight: str | None,
) -> None:
    names = set(schema.names)
    wanted = [(c, "dense") for c in dense] + [(c, "sparse") for c in sparse] + [(label, "label")]
    wanted += [(weight, "weight")] if weight is not None else []
    for column, role in wanted:
        if column not in names:
            raise ValueError(
                f"{path}: {role} column {column!r} is missing (columns: {sorted(names)})"
            )
        t = schema.field(column).type
        ok = _is_ids(t) if role == "sparse" else _is_number(t)
        if not ok:
            expected = "a list of integer ids or an integer id" if role == "sparse" else "a number"
            raise ValueError(f"{path}: {role} column {column!r} must be {expected}, got {t}")


def _reduce(values: np.ndarray, size: int | None, where: str) -> np.ndarray:
    """Ids as int64 modulo ``size`` (None: as is); uint64 ids are reduced as uint64, not wrapped."""
    if values.dtype == np.uint64:
        if size is not None:
            return (values % np.uint64(size)).astype(np.int64)
        too_big = values > np.uint64(np.iinfo(np.int64).max)
        if too_big.any():
            raise ValueError(
                f"{where} holds id {int(values[too_big][0])}, above the int64 maximum "
                "2**63 - 1: pass num_embeddings_per_feature to take ids modulo the table sizes"
            )
    values = values.astype(np.int64)
    return values if size is None else values % size


def _ids(array: pa.ChunkedArray, size: int | None, where: str, bags: bool) -> pa.Array:
    """An id column as int64 ids modulo ``size``, without nulls.

    A large list array (a null list is empty) if ``bags`` or the column holds lists, else int64.
    """
    arr = array.combine_chunks()
    if not _is_bag(arr.type):
        values = _reduce(pc.fill_null(arr, 0).to_numpy(), size, where)
        if not bags:
            return pa.array(values)
        offsets = np.arange(len(arr) + 1, dtype=np.int64)
    else:
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
        values = _reduce(pc.fill_null(arr.flatten(), 0).to_numpy(), size, where)
        offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def _bag_values(array: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values int64, lengths int32) of an id column made by :func:`_ids`."""
    arr = array.combine_chunks()
    if not _is_bag(arr.type):
        return arr.to_numpy(), np.ones(len(arr), np.int32)
    return arr.flatten().to_numpy(), pc.list_value_length(arr).to_numpy().astype(np.int32)


def _number(array: pa.ChunkedArray) -> pa.Array:
    """A number column as one float32 array without nulls (null is 0)."""
    return pc.fill_null(array.cast(pa.float32()), 0.0).combine_chunks()


def _number_tensor(array: pa.ChunkedArray) -> torch.Tensor:
    """A number column as a float32 tensor sharing the Arrow buffer (no copy).

    ``torch.from_numpy`` of Arrow's read-only NumPy view would warn that the tensor is writable
    while its memory is not; DLPack hands the buffer over instead. That buffer is the row
    group's own (decoded from the file) or the cast's: nothing else reads these rows.
    """
    return torch.from_dlpack(_number(array))


class ParquetClickDataset(ResumableIterableDataset):
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
            or when the files have fewer rows than one batch per reader.
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
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_slots = max(num_workers, 1)
        self.row_groups: list[tuple[int, int, int]] = []  # (file, row group, rows)
        # A sparse column is read as bags (jagged) if any file holds it as lists.
        self.bags = [False] * len(self.sparse_columns)
        for i, path in enumerate(self.files):
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
            _check_schema(
                path, schema, self.dense_columns, self.sparse_columns, label_column, weight_column
            )
            for f, column in enumerate(self.sparse_columns):
                self.bags[f] |= _is_bag(schema.field(column).type)
            self.row_groups += [
                (i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
            ]
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
        return self._batch(self._normalise(table, source))

    def _normalise(self, table: pa.Table, source: str) -> pa.Table:
        """Rows in the dataset's one schema, whatever the file's widths and nullability.

        Numbers become float32 (null is 0), ids int64 modulo the table sizes (null lists are
        empty bags, null ids 0): row groups of differently typed files concatenate.
        """
        columns = {c: _number(table.column(c)) for c in self.dense_columns}
        for f, c in enumerate(self.sparse_columns):
            size = None if self.hashes is None else self.hashes[f]
            where = f"{source}: sparse column {c!r}"
            columns[c] = _ids(table.column(c), size, where, self.bags[f])
        for c in [self.label_column] + ([self.weight_column] if self.weight_column else []):
            columns[c] = _number(table.column(c))
        return pa.table(columns)

    def _batch(self, rows: pa.Table) -> Batch:
        """The batch of rows made by :meth:`_normalise`."""
        # np.stack copies the columns into one writable [batch, dense] array.
        dense = np.stack([_number(rows.column(c)).to_numpy() for c in self.dense_columns], 1)
        ids = [_bag_values(rows.column(c)) for c in self.sparse_columns]
        weights = _number_tensor(rows.column(self.weight_column)) if self.weight_column else None
        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=self.feature_names,
                values=torch.from_numpy(np.concatenate([v for v, _ in ids])),
                lengths=torch.from_numpy(np.concatenate([n for _, n in ids])),
            ),
            labels=_number_tensor(rows.column(self.label_column)),
            weights=weights,
        )

    def __iter__(self) -> Iterator[Batch]:
        slot, num_slots, skip = worker_slot(self.start_batch)
        if num_slots != self.num_slots:
            raise RuntimeError(
                f"dataset built for {self.num_slots} readers per rank, iterated by {num_slots}: "
                "pass the DataLoader's num_workers to the dataset"
            )
        reader = self.rank * num_slots + slot
        groups = self.row_groups[reader :: self.world_size * num_slots]
        to_skip = skip * self.batch_size  # rows already trained on
        produced = skip
        pending: pa.Table | None = None
        opened: dict[int, pq.ParquetFile] = {}
        for file_index, group, rows in groups:
            if produced >= self.batches_per_slot:
                break
            if to_skip >= rows:  # never read a row group the resumed run skips whole
                to_skip -= rows
                continue
            if file_index not in opened:
                opened.clear()
                opened[file_index] = pq.ParquetFile(self.files[file_index])
            table = opened[file_index].read_row_group(group, columns=self.columns())
            if to_skip:
                table, to_skip = table.slice(to_skip), 0
            # One schema for every file's rows: a batch may span two files.
            table = self._normalise(table, f"{self.files[file_index]} (row group {group})")
            pending = table if pending is None else pa.concat_tables([pending, table])
            while pending.num_rows >= self.batch_size and produced < self.batches_per_slot:
                yield self._batch(pending.slice(0, self.batch_size))
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
