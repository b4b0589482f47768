"""Criteo click logs on disk: parsing the TSV format and streaming it into TorchRec's npy layout.

The Criteo click-log format (the 1TB day files ``day_0 ... day_23`` and the Kaggle ``train.txt``)
has one sample per line, tab-separated: the label, 13 integer features and 26 categorical
features as 32-bit hex strings; any field may be empty. :func:`preprocess` converts such files to
TorchRec's binary layout (``day_{i}_dense.npy`` float32 ``[N, 13]``, ``day_{i}_sparse.npy``
``[N, 26]``, ``day_{i}_labels.npy`` int32 ``[N, 1]``), streaming (memory bounded by one block of
the input, whatever the file size). :mod:`lightning_torchrec.data.criteo` reads the result.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    DEFAULT_LABEL_NAME,
    INT_FEATURE_COUNT,
)

#: ASCII code -> hex digit value; 255 for anything that is not a hex digit.
_HEX = np.full(256, 255, dtype=np.uint8)


for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i


for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


NPY_KINDS = ("dense", "sparse", "labels")


#: An integer field as pyarrow parses it (empty is 0), if within int64's range.
_INT = re.compile(rb"(-?[0-9]{1,19})?")


MARKER = "lightning_torchrec_preprocess.json"


def _hex_column(
    array: pa.Array | pa.ChunkedArray, name: str, source: str = "", first_line: int = 1
) -> np.ndarray:
    """Parses a string column of hex ids (empty or null is 0) without Python objects.

    The ids come back as int64 holding the bits of the uint64 value: one of 16 hex digits
    above ``2**63 - 1`` is negative; ``ids.view(np.uint64)`` is its value (see :func:`reduce_ids`).
    A bad id is named by its line (row 0 is line ``first_line`` of the file ``source``).
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    array = pc.fill_null(array.cast(pa.string()), "")
    n = len(array)
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32)[array.offset : array.offset + n + 1]
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None and data_buf.size else None
    )
    starts = offsets[:-1].astype(np.int64)
    lengths = np.diff(offsets)

    def bad_row(row: int, why: str) -> ValueError:
        text = bytes(data[starts[row] : starts[row] + lengths[row]]) if data is not None else b""
        at = f"{source}, line {first_line + row}" if source else f"row {row}"
        return ValueError(f"{at}: column {name} holds {text.decode(errors='replace')!r}: {why}")

    if n and int(lengths.max(initial=0)) > 16:
        raise bad_row(int(np.flatnonzero(lengths > 16)[0]), "ids longer than 16 hex digits")
    values = np.zeros(n, dtype=np.uint64)
    if data is None:
        return values.astype(np.int64)
    for j in range(int(lengths.max(initial=0))):
        valid = j < lengths
        digits = _HEX[data[np.minimum(starts + j, len(data) - 1)]]
        if np.any(valid & (digits == 255)):
            raise bad_row(int(np.flatnonzero(valid & (digits == 255))[0]), "not a hex id")
        values = np.where(valid, values * np.uint64(16) + digits.astype(np.uint64), values)
    return values.view(np.int64)


def reduce_ids(ids: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Ids modulo table sizes, as int64; int64 ids are taken as the uint64 values they hold.

    A 16-hex-digit id above ``2**63 - 1`` is stored as a negative int64 (the same 64 bits);
    its modulo is that of the unsigned value, ``int(hex_id, 16) % size``, not of the negative.

    Args:
        ids: ``[..., F]`` int64 ids (as :func:`parse_tsv` yields them) or smaller integers.
        sizes: ``[F]`` positive table sizes, broadcast against ``ids``.

    Returns:
        ``ids % sizes`` in ``[0, size)``, int64.
    """
    if ids.dtype != np.int64:
        return ids % sizes.astype(np.int64)
    return (ids.view(np.uint64) % sizes.astype(np.uint64)).view(np.int64)


def _int_column(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return pc.fill_null(array.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)


def _num_columns(path: Path) -> int:
    with path.open("rb") as f:
        first = f.readline().rstrip(b"\r\n")
    return len(first.split(b"\t"))


def parse_tsv(
    path: str | Path, block_size: int = 16 << 20
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Streams a Criteo TSV file as raw arrays, one block of the file at a time.

    Files with 39 columns (the Kaggle test file) have no label; their labels are -1, as in
    TorchRec's ``tsv_to_npys``.

    Args:
        path: the TSV file.
        block_size: bytes of the file parsed at a time (bounds the memory).

    Yields:
        ``(labels int32 [n], dense int64 [n, 13], sparse int64 [n, 26])`` with TorchRec's
        parsing: empty fields are 0, categorical ids are 32-bit hex (one of 16 hex digits above
        ``2**63 - 1`` is negative: its bits, see :func:`reduce_ids`).

    Raises:
        ValueError: for a file with neither 40 nor 39 columns, or a malformed line, naming the
            file and the line (and the column of a bad field).
    """
    path = Path(path)
    ncols = _num_columns(path)
    has_label = ncols == 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
    if not has_label and ncols != INT_FEATURE_COUNT + CAT_FEATURE_COUNT:
        raise ValueError(
            f"{path}: expected 40 tab-separated columns (label, 13 integer, 26 categorical), "
            f"found {ncols}"
        )
    names = ([DEFAULT_LABEL_NAME] if has_label else []) + DEFAULT_INT_NAMES + DEFAULT_CAT_NAMES
    types = {n: pa.int64() for n in DEFAULT_INT_NAMES} | {n: pa.string() for n in DEFAULT_CAT_NAMES}
    if has_label:
        types[DEFAULT_LABEL_NAME] = pa.int64()
    read_options = pacsv.ReadOptions(column_names=names, use_threads=True)
    parse_options = pacsv.ParseOptions(delimiter="\t", quote_char=False)
    convert_options = pacsv.ConvertOptions(column_types=types, strings_can_be_null=False)
    first_line = 1  # the file's line number of the block's first line
    # Cut the file into blocks at line ends and parse each block on its own: pyarrow's
    # streaming reader reads ahead, up to the whole file.
    for block in _line_blocks(path, block_size):
        read_options.block_size = len(block) + 1
        try:
            table = pacsv.read_csv(
                pa.py_buffer(block),
                read_options=read_options,
                parse_options=parse_options,
                convert_options=convert_options,
            ).combine_chunks()
        except pa.ArrowInvalid as e:
            raise ValueError(f"{path}, {_bad_line(block, first_line, names, e)}") from e
        n, block_line = table.num_rows, first_line
        first_line += n
        if n != block.count(b"\n") + (not block.endswith(b"\n")):  # pyarrow skips blank lines
            raise ValueError(f"{path}, {_bad_line(block, block_line, names, 'blank line')}")
        if n == 0:
            continue
        labels = (
            _int_column(table.column(DEFAULT_LABEL_NAME)).astype(np.int32)
            if has_label
            else np.full(n, -1, dtype=np.int32)
        )
        dense = np.stack([_int_column(table.column(c)) for c in DEFAULT_INT_NAMES], axis=1)
        sparse = np.stack(
            [_hex_column(table.column(c), c, str(path), block_line) for c in DEFAULT_CAT_NAMES],
            axis=1,
        )
        yield labels, dense, sparse


def _bad_line(block: bytes, first_line: int, names: Sequence[str], error: object) -> str:
    """Which line of a block pyarrow refused, and why (the block's first line is ``first_line``)."""
    lines = block.split(b"\n")
    for i, line in enumerate(lines[:-1] if block.endswith(b"\n") else lines):
        fields = line.rstrip(b"\r").split(b"\t")
        at = f"line {first_line + i}"
        if len(fields) != len(names):
            blank = " (a blank line)" if fields == [b""] else ""
            return f"{at}: expected {len(names)} tab-separated columns, found {len(fields)}{blank}"
        for name, field in zip(names, fields, strict=True):
            ok = _INT.fullmatch(field) and -(2**63) <= int(field or b"0") < 2**63
            if name not in DEFAULT_CAT_NAMES and not ok:
                return f"{at}: column {name} holds {field.decode(errors='replace')!r}, not an int64"
    return f"lines {first_line}-{first_line + len(lines) - 1}: {error}"


def _line_blocks(path: Path, block_size: int) -> Iterator[bytes]:
    """The file in blocks of about ``block_size`` bytes, each ending at a line end."""
    tail = b""
    with path.open("rb") as f:
        while data := f.read(block_size):
            data = tail + data
            cut = data.rfind(b"\n") + 1
            block, tail = data[:cut], data[cut:]
            if block:
                yield block
    if tail.strip():
        yield tail


def _count_rows(path: Path) -> int:
    rows, last = 0, b"\n"
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            rows += chunk.count(b"\n")
            last = chunk[-1:]
    return rows + (last != b"\n")


def table_sizes_array(
    num_embeddings_per_feature: Sequence[int] | int | None,
) -> np.ndarray | None:
    """The table size of each of Criteo's sparse features, as ids are taken modulo them.

    Args:
        num_embeddings_per_feature: one size per feature, one size for all, or None.

    Returns:
        An ``int64`` array of ``CAT_FEATURE_COUNT`` sizes, or None (ids kept as they are).
    """
    if num_embeddings_per_feature is None:
        return None
    if isinstance(num_embeddings_per_feature, int):
        num_embeddings_per_feature = [num_embeddings_per_feature] * CAT_FEATURE_COUNT
    sizes = np.asarray(list(num_embeddings_per_feature), dtype=np.int64)
    if sizes.shape != (CAT_FEATURE_COUNT,) or (sizes < 1).any():
        raise ValueError(
            f"num_embeddings_per_feature needs {CAT_FEATURE_COUNT} positive sizes (or one for "
            f"all), got {list(num_embeddings_per_feature)}"
        )
    return sizes


class _NpyWriter:
    """Writes one day's three npy files row block by row block (header first, shape known)."""

    def __init__(self, out_dir: Path, day: int, rows: int, sparse_dtype: np.dtype) -> None:
        self.files = {}
        widths = {"dense": INT_FEATURE_COUNT, "sparse": CAT_FEATURE_COUNT, "labels": 1}
        dtypes = {"dense": np.float32, "sparse": sparse_dtype, "labels": np.int32}
        for kind in NPY_KINDS:
            f = (out_dir / f"day_{day}_{kind}.npy").open("wb")
            header = {
                "descr": np.lib.format.dtype_to_descr(np.dtype(dtypes[kind])),
                "fortran_order": False,
                "shape": (rows, widths[kind]),
            }
            np.lib.format.write_array_header_1_0(f, header)
            self.files[kind] = f
        self.dtypes = dtypes
        self.remaining = rows
        self.name = out_dir / f"day_{day}"

    def write(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> None:
        for kind, arr in (("dense", dense), ("sparse", sparse), ("labels", labels)):
            self.files[kind].write(np.ascontiguousarray(arr, dtype=self.dtypes[kind]).tobytes())
        self.remaining -= len(labels)

    def close(self, failed: bool = False) -> None:
        for f in self.files.values():
            f.close()
        if failed:  # a malformed input: no day of header-only files is left behind
            for f in self.files.values():
                Path(f.name).unlink(missing_ok=True)
        elif self.remaining:
            raise ValueError(
                f"{self.name}: {self.remaining} rows fewer than the input's lines (blank lines?)"
            )


def remove_other_days(out_dir: Path, written: Sequence[Path]) -> list[Path]:
    """Removes the npy days of ``out_dir`` that a preprocessing did not write.

    Such days are left by an earlier preprocessing of other inputs or ``rows_per_file``: a
    reader of the directory would take them for training days, and the last for the
    validation day.

    Args:
        out_dir: the preprocessing's output directory.
        written: the stems it wrote (:func:`preprocess`'s result).

    Returns:
        The files removed.
    """
    keep = {f"{Path(stem).name}_{kind}.npy" for stem in written for kind in NPY_KINDS}
    stale = [
        f
        for f in sorted(out_dir.glob("day_*.npy"))
        if re.fullmatch(r"day_\d+_(dense|sparse|labels)\.npy", f.name) and f.name not in keep
    ]
    for f in stale:
        f.unlink()
    return stale


def preprocess(
    in_files: Sequence[str | Path],
    out_dir: str | Path,
    num_embeddings_per_feature: Sequence[int] | int | None = None,
    rows_per_file: int | None = None,
    block_size: int = 16 << 20,
) -> list[Path]:
    """Converts Criteo TSV files to TorchRec's npy layout, streaming.

    Each input file becomes one day ``day_{i}`` (numbered in the order given), or, with
    ``rows_per_file``, consecutive days of that many rows (to split the Kaggle ``train.txt``
    into training days and a last day for validation and test).

    Args:
        in_files: Criteo TSV files, in order.
        out_dir: where ``day_{i}_{dense,sparse,labels}.npy`` go (created).
        num_embeddings_per_feature: table sizes (26, or one for all): ids are stored modulo
            these, as int32. None keeps the raw 32-bit ids as int64.
        rows_per_file: rows per output day; None keeps one day per input file.
        block_size: bytes of input parsed at a time (bounds the memory).

    Returns:
        The stems ``out_dir/day_{i}`` written.

    Raises:
        ValueError: for bad table sizes, an empty input or a malformed file (the days written
            so far are removed: no half-written day is left).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hashes = table_sizes_array(num_embeddings_per_feature)
    sparse_dtype = np.dtype(np.int64 if hashes is None or hashes.max() > 2**31 else np.int32)
    counts = [_count_rows(Path(p)) for p in in_files]
    if rows_per_file is None:
        day_rows = [c for c in counts if c > 0]
    else:
        total = sum(counts)
        day_rows = [min(rows_per_file, total - s) for s in range(0, total, rows_per_file)]
    if not day_rows:
        raise ValueError(f"no rows in {list(map(str, in_files))}")
    day, writer = 0, None
    written = []

    def next_writer() -> _NpyWriter:
        nonlocal day
        w = _NpyWriter(out_dir, day, day_rows[day], sparse_dtype)
        written.append(out_dir / f"day_{day}")
        day += 1
        return w

    try:
        for path, count in zip(in_files, counts, strict=True):
            if count == 0:
                continue
            if rows_per_file is None:
                writer = next_writer()
            for labels, dense, sparse in parse_tsv(path, block_size=block_size):
                dense = np.log1p(np.maximum(dense, 0)).astype(np.float32)
                sparse = sparse if hashes is None else reduce_ids(sparse, hashes)
                start = 0
                while start < len(labels):
                    if writer is None or writer.remaining == 0:
                        if writer is not None:
                            writer.close()
                        writer = next_writer()
                    stop = start + min(writer.remaining, len(labels) - start)
                    writer.write(dense[start:stop], sparse[start:stop], labels[start:stop, None])
                    start = stop
            if rows_per_file is None and writer is not None:
                writer, done = None, writer
                done.close()
        if writer is not None:
            writer.close()
    except BaseException:  # the days this call wrote (complete or not) are removed
        if writer is not None:
            writer.close(failed=True)
        for stem in written:
            for kind in NPY_KINDS:
                Path(f"{stem}_{kind}.npy").unlink(missing_ok=True)
        raise
    return written
