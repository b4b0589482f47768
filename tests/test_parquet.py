"""ParquetClickData: column mapping, jagged ids, errors naming the column, ranks, resume."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lightning_torchrec.data.parquet import ParquetClickData, ParquetClickDataset
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
        loader.load_state_dict({"start_batch": 9})
        rest = [b for b in loader]
        assert len(rest) == len(full) - 9
        for b, want in zip(rest, full[9:], strict=True):
            assert torch.equal(b.dense_features, want)
            assert int(b.sparse_features["a"].values().max()) < 7
            assert int(b.sparse_features["b"].values().max()) < 5
