"""Writes small click-log files in real formats, with a learnable hidden rule (deterministic).

* ``OUT/criteo/day_0 ... day_{D-1}``: the Criteo click-log format (label, 13 integer features,
  26 categorical features as 32-bit hex, tab-separated, empty fields for missing values);
* ``OUT/parquet/part-{i}.parquet``: ``label`` (int8), ``weight`` (float32), ``dense_0 ...
  dense_12`` (float32), ``cat_0 ... cat_7`` (lists of int64 ids, 1 to 3 per sample).

The click probability is ``sigmoid(sum of hidden values of some categorical ids + a weaker
dense term - 1)``, so a DLRM whose tables learn beats the dense-only baseline. Same arguments,
same bytes.

Usage::

    python scripts/make_click_files.py OUT [--rows-per-day 50000] [--days 2]
        [--parquet-rows 50000] [--parquet-files 4] [--row-group-size 4096]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

NUM_INT, NUM_CAT, NUM_PARQUET_CAT = 13, 26, 8
VOCAB = 400  # distinct ids per categorical feature
CHUNK = 100_000  # rows generated at a time (bounds the memory for large files)


def _hidden(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rule = np.random.default_rng(seed)
    # hidden value per (feature, vocabulary index); only the first 8 features carry signal
    values = rule.normal(0.0, 1.0, (NUM_CAT, VOCAB)) * (np.arange(NUM_CAT) < 8)[:, None]
    hex_ids = rule.integers(0, 2**32, (NUM_CAT, VOCAB), dtype=np.uint64)
    dense_w = rule.normal(0.0, 0.3, NUM_INT)
    return values, hex_ids, dense_w


def _chunk(rng: np.random.Generator, n: int, seed: int) -> dict[str, np.ndarray]:
    values, hex_ids, dense_w = _hidden(seed)
    vocab_index = np.minimum((VOCAB * rng.random((n, NUM_CAT)) ** 2).astype(np.int64), VOCAB - 1)
    dense = rng.geometric(0.05, (n, NUM_INT)) - 1
    dense[:, 1] -= rng.integers(0, 3, n)  # Criteo's I2 has small negative values
    signal = values[np.arange(NUM_CAT), vocab_index].sum(axis=1) / np.sqrt(8)
    logit = 1.5 * signal + np.log1p(np.maximum(dense, 0)) @ dense_w / 4 - 1.0
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    return {
        "labels": labels,
        "dense": dense,
        "dense_missing": rng.random((n, NUM_INT)) < 0.1,
        "vocab_index": vocab_index,
        "cat_missing": rng.random((n, NUM_CAT)) < 0.03,
        "hex_ids": hex_ids,
    }


def write_criteo_day(path: Path, rows: int, seed: int, day: int) -> None:
    """One Criteo-format day file of ``rows`` rows.

    Args:
        path: the file.
        rows: its rows.
        seed: the hidden rule's seed.
        day: the day number (different samples per day).
    """
    rng = np.random.default_rng([seed, day])
    hex_text = None
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    with pacsv.CSVWriter(path, _criteo_schema(), write_options=options) as writer:
        for start in range(0, rows, CHUNK):
            c = _chunk(rng, min(CHUNK, rows - start), seed)
            if hex_text is None:
                hex_text = np.array([[f"{int(x):08x}" for x in row] for row in c["hex_ids"]])
            columns = [pa.array(c["labels"])]
            columns += [
                pa.array(c["dense"][:, j], mask=c["dense_missing"][:, j]) for j in range(NUM_INT)
            ]
            columns += [
                pa.array(
                    np.where(c["cat_missing"][:, j], "", hex_text[j][c["vocab_index"][:, j]]),
                    type=pa.string(),
                )
                for j in range(NUM_CAT)
            ]
            writer.write_table(pa.Table.from_arrays(columns, schema=_criteo_schema()))


def _criteo_schema() -> pa.Schema:
    return pa.schema(
        [("label", pa.int64())]
        + [(f"int_{j}", pa.int64()) for j in range(NUM_INT)]
        + [(f"cat_{j}", pa.string()) for j in range(NUM_CAT)]
    )


def write_parquet(out: Path, rows: int, files: int, row_group_size: int, seed: int) -> None:
    """A Parquet dataset of ``files`` files with ``rows`` rows in all.

    Args:
        out: the directory.
        rows: rows over all files.
        files: number of files.
        row_group_size: rows per row group.
        seed: the hidden rule's seed.
    """
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 1_000])
    per_file = [rows // files + (i < rows % files) for i in range(files)]
    for i, n in enumerate(per_file):
        c = _chunk(rng, n, seed)
        lengths = rng.integers(1, 4, (n, NUM_PARQUET_CAT))
        table = {"label": pa.array(c["labels"].astype(np.int8))}
        table["weight"] = pa.array(rng.uniform(0.5, 1.5, n).astype(np.float32))
        dense = np.log1p(np.maximum(c["dense"], 0)).astype(np.float32)
        for j in range(NUM_INT):
            table[f"dense_{j}"] = pa.array(dense[:, j])
        for j in range(NUM_PARQUET_CAT):
            # the first id carries the rule; the others are popular "noise" ids
            extra = np.minimum((VOCAB * rng.random(int(lengths[:, j].sum())) ** 3), VOCAB - 1)
            ids = extra.astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths[:, j])])
            ids[offsets[:-1]] = c["vocab_index"][:, j]
            table[f"cat_{j}"] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), ids)
        pq.write_table(
            pa.table(table), out / f"part-{i:03d}.parquet", row_group_size=row_group_size
        )


def main(argv: list[str] | None = None) -> None:
    """Writes the files (see the module docstring).

    Args:
        argv: command-line arguments (defaults to ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows-per-day", type=int, default=50_000)
    parser.add_argument("--days", type=int, default=2)
    parser.add_argument("--parquet-rows", type=int, default=50_000)
    parser.add_argument("--parquet-files", type=int, default=4)
    parser.add_argument("--row-group-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    criteo = args.out / "criteo"
    criteo.mkdir(parents=True, exist_ok=True)
    for day in range(args.days):
        write_criteo_day(criteo / f"day_{day}", args.rows_per_day, args.seed, day)
    if args.parquet_rows > 0:
        write_parquet(
            args.out / "parquet",
            args.parquet_rows,
            args.parquet_files,
            args.row_group_size,
            args.seed,
        )
    print(f"wrote {args.days} Criteo day(s) of {args.rows_per_day} rows to {criteo}")
    if args.parquet_rows > 0:
        print(f"wrote {args.parquet_rows} rows in {args.parquet_files} Parquet files")


if __name__ == "__main__":
    main()
