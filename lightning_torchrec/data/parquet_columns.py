"""The columns of ``ParquetClickData``'s files: their checks and their conversion to one schema.

A file's columns are checked against the roles the data module gives them (dense, sparse,
label, weight) when the module is built; the rows read are then cast to one schema (float32
numbers without nulls, int64 ids modulo the table sizes), so that files whose columns differ in
width or nullability mix in a batch. :mod:`lightning_torchrec.data.parquet` streams the files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

__all__ = [
    "bag_values",
    "check_positive",
    "check_schema",
    "id_column",
    "is_bag",
    "number_column",
    "number_tensor",
]


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def is_bag(t: pa.DataType) -> bool:
    """Whether a column type holds lists (bags of ids).

    Args:
        t: the Arrow type.

    Returns:
        True for ``list`` and ``large_list`` types.
    """
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_ids(t: pa.DataType) -> bool:
    return pa.types.is_integer(t.value_type if is_bag(t) else t)


def check_positive(name: str, values: Sequence[int] | int) -> None:
    """Refuses a size (or sizes) that is not a positive integer, naming it.

    Args:
        name: the argument, for the error.
        values: one size, or several.

    Raises:
        ValueError: if a value is not an integer of 1 or more.
    """
    for i, v in enumerate([values] if isinstance(values, int) else list(values)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            where = name if isinstance(values, int) else f"{name}[{i}]"
            raise ValueError(f"{where} must be a positive integer, got {v!r}")


def check_schema(
    path: Path,
    schema: pa.Schema,
    dense: Sequence[str],
    sparse: Sequence[str],
    label: str,
    weight: str | None,
) -> None:
    """Checks that a file has every column its role needs, of a type the role can read.

    Args:
        path: the file, for errors.
        schema: its Arrow schema.
        dense: the dense columns.
        sparse: the sparse (id) columns.
        label: the label column.
        weight: the weight column, or None.

    Raises:
        ValueError: naming the file, the role and the column, for a missing column or one of
            the wrong type.
    """
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


def id_column(array: pa.ChunkedArray, size: int | None, where: str, bags: bool) -> pa.Array:
    """An id column as int64 ids modulo ``size``, without nulls.

    Args:
        array: the column as read.
        size: the feature's table size (None: ids as stored).
        where: the file, row group and column, for errors.
        bags: whether the feature is read as bags (some file holds it as lists).

    Returns:
        A large list array (a null list is empty) if ``bags`` or the column holds lists, else
        int64 (a null id is 0).

    Raises:
        ValueError: naming ``where`` and the id, for a uint64 id above ``2**63 - 1`` without
            ``size``.
    """
    arr = array.combine_chunks()
    if not is_bag(arr.type):
        values = _reduce(pc.fill_null(arr, 0).to_numpy(), size, where)
        if not bags:
            return pa.array(values)
        offsets = np.arange(len(arr) + 1, dtype=np.int64)
    else:
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
        values = _reduce(pc.fill_null(arr.flatten(), 0).to_numpy(), size, where)
        offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def bag_values(array: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """The ids and bag lengths of an id column made by :func:`id_column`.

    Args:
        array: the column.

    Returns:
        ``(values int64, lengths int32)``.
    """
    arr = array.combine_chunks()
    if not is_bag(arr.type):
        return arr.to_numpy(), np.ones(len(arr), np.int32)
    return arr.flatten().to_numpy(), pc.list_value_length(arr).to_numpy().astype(np.int32)


def number_column(array: pa.ChunkedArray) -> pa.Array:
    """A number column as one float32 array without nulls (null is 0).

    Integers are rounded to the nearest float32, as ``torch.tensor(ids).float()`` would: Arrow's
    default (safe) cast refuses any integer above ``2**24`` that float32 cannot hold exactly (a
    count or a timestamp feature), with an error naming neither the file nor the column.

    Args:
        array: the column.

    Returns:
        The float32 array.
    """
    return pc.fill_null(array.cast(pa.float32(), safe=False), 0.0).combine_chunks()


def number_tensor(array: pa.ChunkedArray) -> torch.Tensor:
    """A number column as a float32 tensor sharing the Arrow buffer (no copy).

    ``torch.from_numpy`` of Arrow's read-only NumPy view would warn that the tensor is writable
    while its memory is not; DLPack hands the buffer over instead. That buffer is the row
    group's own (decoded from the file) or the cast's: nothing else reads these rows.

    Args:
        array: the column.

    Returns:
        The float32 tensor.
    """
    return torch.from_dlpack(number_column(array))
