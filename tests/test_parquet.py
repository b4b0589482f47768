"""ParquetClickData: column mapping, jagged ids, errors naming the column, ranks, resume."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lightning_torchrec.data.parquet import ParquetClickData, ParquetClickDataset, expand_paths
from lightning_torchrec.data.resumable import ResumableDataLoader

DENSE, SPARSE = ["d0", "d1"], ["a", "b"]


def write(tmp_path: Path, files: int = 3, rows: int = 100, group: int = 16) -> list[dict]:
    """Files whose row ``i`` has a = [i] * (i % 3 + 1), b = i, d0 = i, d1 = -i, label i % 2."""
    reference = []
    for f in range(files):
        start = f * rows
        i = np.arange(start, start + rows)
        a = [[int(x)] * (int(x) % 3 + 1) for x in i]
        a[5] = None  # a null list is an empty bag
        table = pa.table(
            {
                "d0": pa.array(i.astype(np.float64)),
                "d1": pa.array(-i.astype(np.int32)),
                "a": pa.array(a, pa.list_(pa.int64())),
                "b": pa.array(i.astype(np.int32)),
                "label": pa.array((i % 2).astype(np.int8)),
                "w": pa.array(np.full(rows, 0.5, np.float32)),
                "text": pa.array([str(x) for x in i]),
            }
        )
        pq.write_table(table, tmp_path / f"part-{f}.parquet", row_group_size=group)
        reference += [{"i": int(x), "a": a[k] or []} for k, x in enumerate(i)]
    return reference


def test_columns_map_to_the_batch(tmp_path: Path) -> None:
    ref = write(tmp_path)
    ds = ParquetClickDataset(str(tmp_path), DENSE, SPARSE, "label", "w", batch_size=20)
    batches = list(ds)
    # one reader: the row groups of all files in order; 300 rows -> 15 batches
    assert len(batches) == len(ds) == 15
    rows = torch.cat([b.dense_features for b in batches])
    assert torch.equal(rows[:, 0], torch.arange(300, dtype=torch.float32))
    assert torch.equal(rows[:, 1], -torch.arange(300, dtype=torch.float32))
    b0 = batches[0]
    assert b0.sparse_features.keys() == ["a", "b"]
    assert torch.equal(b0.labels, torch.arange(20) % 2 * 1.0)
    assert torch.equal(b0.weights, torch.full((20,), 0.5))
    a = b0.sparse_features["a"]
    assert a.lengths().tolist() == [len(r["a"]) for r in ref[:20]]
    assert a.values().tolist() == [x for r in ref[:20] for x in r["a"]]
    assert b0.sparse_features["b"].values().tolist() == list(range(20))


def test_batches_are_made_without_a_warning(tmp_path: Path) -> None:
    """Labels and weights take Arrow's buffers over (DLPack) instead of torch.from_numpy's
    read-only views, which warn; they are writable without touching other batches."""
    write(tmp_path, files=1)
    ds = ParquetClickDataset(str(tmp_path), DENSE, SPARSE, "label", "w", batch_size=20)
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch warns once per process otherwise
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(ds)
    finally:
        torch.set_warn_always(warn_always)
    assert [str(w.message) for w in caught] == []
    batches[0].labels.add_(10)
    batches[0].weights.mul_(2)
    assert torch.equal(batches[1].labels, torch.arange(20, 40) % 2 * 1.0)
    assert torch.equal(batches[1].weights, torch.full((20,), 0.5))


def test_missing_or_wrong_columns_are_named(tmp_path: Path) -> None:
    write(tmp_path, files=1)
    with pytest.raises(ValueError, match="sparse column 'c' is missing"):
        ParquetClickDataset(str(tmp_path), DENSE, ["a", "c"], "label")
    with pytest.raises(ValueError, match="dense column 'text' must be a number, got string"):
        ParquetClickDataset(str(tmp_path), ["text"], SPARSE, "label")
    with pytest.raises(ValueError, match="sparse column 'd0' must be a list of integer ids"):
        ParquetClickDataset(str(tmp_path), DENSE, ["d0"], "label")
    with pytest.raises(ValueError, match="weight column 'nope' is missing"):
        ParquetClickData(str(tmp_path), DENSE, SPARSE, "label", weight_column="nope")
    with pytest.raises(FileNotFoundError, match="no Parquet files"):
        ParquetClickDataset(str(tmp_path / "none"), DENSE, SPARSE, "label")
    with pytest.raises(ValueError, match="fewer than 1000 rows"):
        ParquetClickDataset(str(tmp_path), DENSE, SPARSE, "label", batch_size=1000)


def test_ranks_and_workers_get_their_row_groups_and_equal_counts(tmp_path: Path) -> None:
    write(tmp_path, files=3, rows=100, group=16)  # 7 row groups per file (6 x 16 + 4)
    seen = []
    counts = []
    for rank in range(2):
        ds = ParquetClickDataset(
            str(tmp_path),
            DENSE,
            SPARSE,
            "label",
            batch_size=8,
            rank=rank,
            world_size=2,
            num_workers=2,
        )
        got = list(ResumableDataLoader(ds, num_workers=2))
        counts.append(len(got))
        assert len(got) == len(ds)
        seen += [int(x) for b in got for x in b.dense_features[:, 0]]
    assert counts[0] == counts[1]
    assert len(seen) == len(set(seen))  # no sample read twice


def test_resume_with_hashing(tmp_path: Path) -> None:
    write(tmp_path, files=2, rows=64, group=10)
    for workers in (0, 2):

        def make(workers: int = workers) -> ParquetClickDataset:
            return ParquetClickDataset(
                str(tmp_path),
                DENSE,
                SPARSE,
                "label",
                batch_size=4,
                num_workers=workers,
                num_embeddings_per_feature=[7, 5],
            )

        full = [b.dense_features for b in ResumableDataLoader(make(), num_workers=workers)]
        loader = ResumableDataLoader(make(), num_workers=workers)
        loader.resume_at(9)
        rest = [b for b in loader]
        assert len(rest) == len(full) - 9
        for b, want in zip(rest, full[9:], strict=True):
            assert torch.equal(b.dense_features, want)
            assert int(b.sparse_features["a"].values().max()) < 7
            assert int(b.sparse_features["b"].values().max()) < 5
        assert len(list(loader)) == len(full)  # only the resumed iteration is shortened
        loader.resume_at(len(full))  # at the epoch's end: the next one is whole
        assert len(list(loader)) == len(full)
        with pytest.raises(ValueError, match="batches >= 0, got -1"):
            loader.resume_at(-1)


def test_files_of_different_types_mix_in_a_batch(tmp_path: Path) -> None:
    """Each file valid alone, their types differ (widths, NOT NULL, list kinds, one id or a
    list): a batch spanning both is the rows cast to float32 / int64, as for uniform files."""
    i0, i1 = np.arange(10), np.arange(10, 20)
    first = pa.table(
        {
            "d0": pa.array(i0 * 1.0),
            "a": pa.array([[int(x), int(x) + 1] for x in i0], pa.list_(pa.int64())),
            "b": pa.array(i0),  # one id per row here, bags in the other file
            "label": pa.array(i0 % 2),
        }
    )
    first = first.cast(pa.schema([pa.field(f.name, f.type, nullable=False) for f in first.schema]))
    second = pa.table(
        {
            "d0": pa.array(i1.astype(np.int16)),
            "a": pa.array([[int(x)] for x in i1], pa.large_list(pa.int32())),
            "b": pa.array([[int(x)] * 2 for x in i1], pa.list_(pa.uint8())),
            "label": pa.array((i1 % 2).astype(np.int32)),
        }
    )
    pq.write_table(first, tmp_path / "part-0.parquet", row_group_size=6)
    pq.write_table(second, tmp_path / "part-1.parquet", row_group_size=6)
    data = ParquetClickData(str(tmp_path), ["d0"], ["a", "b"], "label", batch_size=8)
    batches = list(data.train_dataloader())
    assert len(batches) == 2
    spanning = batches[1]  # rows 8..15: 2 of the first file, 6 of the second
    assert torch.equal(spanning.dense_features[:, 0], torch.arange(8.0, 16.0))
    assert torch.equal(spanning.labels, torch.arange(8, 16) % 2 * 1.0)
    a, b = spanning.sparse_features["a"], spanning.sparse_features["b"]
    assert a.lengths().tolist() == [2, 2] + [1] * 6
    assert a.values().tolist() == [8, 9, 9, 10, *range(10, 16)]
    assert b.lengths().tolist() == [1, 1] + [2] * 6
    assert b.values().tolist() == [8, 9] + [x for x in range(10, 16) for _ in range(2)]
    assert spanning.sparse_features.values().dtype == torch.int64
    loader = data.train_dataloader()
    loader.resume_at(1)  # resumed mid-epoch: the spanning batch next
    (resumed,) = list(loader)
    assert torch.equal(resumed.dense_features, spanning.dense_features)
    assert torch.equal(resumed.sparse_features.values(), spanning.sparse_features.values())


def test_uint64_ids_are_reduced_unsigned_or_refused(tmp_path: Path) -> None:
    """64-bit hashed ids above 2**63 - 1: ``id % rows`` of the unsigned value, never wrapped."""
    ids = [2**63 + 5, 2**64 - 1, 12345678901234567890, 7]
    table = pa.table(
        {
            "d0": np.zeros(4),
            "a": pa.array(ids, pa.uint64()),
            "b": pa.array([[x, 3] for x in ids], pa.list_(pa.uint64())),
            "label": [0, 1, 0, 1],
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    ds = ParquetClickDataset(
        str(tmp_path), ["d0"], SPARSE, "label", batch_size=4, num_embeddings_per_feature=[1000, 7]
    )
    kjt = next(iter(ds)).sparse_features
    assert kjt["a"].values().tolist() == [x % 1000 for x in ids] == [813, 615, 890, 7]
    assert kjt["b"].values().tolist() == [v for x in ids for v in (x % 7, 3)]
    raw = ParquetClickDataset(str(tmp_path), ["d0"], SPARSE, "label", batch_size=4)
    with pytest.raises(
        ValueError, match=r"p.parquet .*sparse column 'a' holds id 9223372036854775813"
    ):
        next(iter(raw))
    fits = pa.table({"d0": np.zeros(4), "a": pa.array([2**63 - 1, 0, 1, 2], pa.uint64())})
    pq.write_table(fits.append_column("label", pa.array([0, 1, 0, 1])), tmp_path / "p.parquet")
    ds = ParquetClickDataset(str(tmp_path), ["d0"], ["a"], "label", batch_size=4)
    assert next(iter(ds)).sparse_features.values().tolist() == [2**63 - 1, 0, 1, 2]


def test_validation_and_test_files_are_checked_when_the_module_is_built(tmp_path: Path) -> None:
    good = pa.table({"d0": np.zeros(4), "a": pa.array([1, 2, 3, 4]), "label": [0, 1, 0, 1]})
    pq.write_table(good, tmp_path / "train.parquet")
    pq.write_table(good.drop_columns(["a"]), tmp_path / "val.parquet")
    train = str(tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"val.parquet.*'a'"):
        ParquetClickData(
            train, ["d0"], ["a"], "label", val_paths=str(tmp_path / "val.parquet"), batch_size=2
        )
    with pytest.raises((ValueError, FileNotFoundError), match="nothing"):
        ParquetClickData(
            train, ["d0"], ["a"], "label", test_paths=str(tmp_path / "nothing*"), batch_size=2
        )
    ParquetClickData(train, ["d0"], ["a"], "label", val_paths=train, test_paths=train, batch_size=2)


def test_large_integer_dense_label_and_weight_columns_are_read(tmp_path: Path) -> None:
    """int64/uint64 numbers above 2**24 (counts, timestamps) round to float32, as documented for
    "any number type"; Arrow's safe cast refused them with an error naming no file or column."""
    big = [123456789, 2**40 + 1, 16777217, 5]
    table = pa.table(
        {
            "d0": pa.array(big, pa.int64()),
            "a": pa.array([1, 2, 3, 4]),
            "label": pa.array([0, 1, 0, 1], pa.int64()),
            "w": pa.array([2**63 + 5, 1, 2, 3], pa.uint64()),
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    ds = ParquetClickDataset(str(tmp_path), ["d0"], ["a"], "label", "w", batch_size=4)
    batch = next(iter(ds))
    assert batch.dense_features[:, 0].tolist() == [float(np.float32(x)) for x in big]
    assert batch.weights is not None and batch.weights[0] == float(np.float32(2**63 + 5))


def test_a_truncated_or_corrupt_file_is_named(tmp_path: Path) -> None:
    """pyarrow's errors ("Parquet magic bytes not found in footer", "Couldn't deserialize
    thrift") name no file: among many files (one still being copied) the culprit was unknown."""
    table = pa.table({"d0": [1.0, 2.0], "a": [1, 2], "label": [0, 1]})
    pq.write_table(table, tmp_path / "good.parquet")
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[:-30])
    with pytest.raises(ValueError, match=r"cut.parquet: not a readable Parquet file: .*magic"):
        ParquetClickDataset(str(tmp_path), ["d0"], ["a"], "label", batch_size=1)
    (tmp_path / "cut.parquet").unlink()
    (tmp_path / "pages.parquet").write_bytes(bytes(b ^ 0xFF for b in data[:60]) + data[60:])
    dataset = ParquetClickDataset(
        str(tmp_path / "pages.parquet"), ["d0"], ["a"], "label", batch_size=1
    )
    with pytest.raises(ValueError, match=r"pages.parquet \(row group 0\): cannot be read"):
        next(iter(dataset))


def test_a_file_without_dense_columns_gives_an_empty_dense_width(tmp_path: Path) -> None:
    """``dense_columns=[]`` (a model of ids only) failed at the first batch with NumPy's bare
    "need at least one array to stack"."""
    pq.write_table(pa.table({"a": [1, 2, 3], "label": [0, 1, 0]}), tmp_path / "p.parquet")
    data = ParquetClickData(str(tmp_path), [], ["a"], "label", batch_size=3)
    batch = next(iter(data.train_dataloader()))
    assert batch.dense_features.shape == (3, 0) and batch.dense_features.dtype == torch.float32
    assert batch.sparse_features["a"].values().tolist() == [1, 2, 3]


def test_a_file_named_with_glob_characters_is_found(tmp_path: Path) -> None:
    """``clicks[2024].parquet`` was taken for a glob pattern (matching ``clicks2.parquet``...),
    so the existing file was refused: 'no Parquet files at ...'."""
    table = pa.table({"d0": [1.0, 2.0], "a": [1, 2], "label": [0, 1]})
    pq.write_table(table, tmp_path / "clicks[2024].parquet")
    data = ParquetClickData(
        str(tmp_path / "clicks[2024].parquet"), ["d0"], ["a"], "label", batch_size=2
    )
    assert len(data.train_dataloader()) == 1
    pq.write_table(table, tmp_path / "p1.parquet")
    assert expand_paths(str(tmp_path / "p[0-9].parquet")) == [tmp_path / "p1.parquet"]
