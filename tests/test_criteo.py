"""Criteo TSV -> npy -> batches: TorchRec's parsing, the streaming preprocessing, the reader."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils

from lightning_torchrec.data.criteo import (
    CriteoDataModule,
    CriteoIterableDataset,
    find_day_files,
    parse_tsv,
    preprocess,
)
from lightning_torchrec.data.resumable import ResumableDataLoader, slot_and_skip
from lightning_torchrec.errors import BatchValidationError
from tests.helpers import clean_env, load_ranks, run_script, warning_lines

ROOT = Path(__file__).resolve().parents[1]
SIZES = [97 + 13 * i for i in range(26)]


@pytest.fixture(scope="module")
def criteo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("clicks")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_click_files.py"),
            str(out),
            "--rows-per-day",
            "3001",
            "--days",
            "2",
            "--parquet-rows",
            "0",
        ],
        check=True,
        capture_output=True,
    )
    return out / "criteo"


def direct_parse(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row by row with the csv module: the reference."""
    labels, dense, sparse = [], [], []
    with path.open() as f:
        for row in csv.reader(f, delimiter="\t"):
            labels.append(int(row[0] or 0))
            dense.append([int(x or 0) for x in row[1:14]])
            sparse.append([int(x or "0", 16) for x in row[14:40]])
    return np.array(labels), np.array(dense), np.array(sparse, dtype=np.int64)


def test_parse_matches_torchrec_tsv_to_npys(criteo_dir: Path, tmp_path: Path) -> None:
    day = criteo_dir / "day_0"
    names = [str(tmp_path / f"{k}.npy") for k in ("dense", "sparse", "labels")]
    BinaryCriteoUtils.tsv_to_npys(str(day), *names)
    t_dense, t_sparse, t_labels = (np.load(n) for n in names)
    blocks = list(parse_tsv(day, block_size=64 << 10))
    assert len(blocks) > 1  # the streaming path really streams
    labels = np.concatenate([b[0] for b in blocks])
    dense = np.concatenate([b[1] for b in blocks])
    sparse = np.concatenate([b[2] for b in blocks])
    np.testing.assert_array_equal(sparse, t_sparse)
    np.testing.assert_array_equal(labels, t_labels[:, 0])
    # tsv_to_npys stores log(x - min + 2); undo it to compare the raw integers
    shift = int(dense.min()) - 2
    np.testing.assert_array_equal(np.rint(np.exp(t_dense.astype(np.float64))) + shift, dense)
    ref = direct_parse(day)
    for got, want in zip((labels, dense, sparse), ref, strict=True):
        np.testing.assert_array_equal(got, want)


def test_preprocess_then_batches_equal_direct_parse(criteo_dir: Path, tmp_path: Path) -> None:
    days = preprocess([criteo_dir / "day_0", criteo_dir / "day_1"], tmp_path, SIZES)
    assert days == [tmp_path / "day_0", tmp_path / "day_1"] == find_day_files(tmp_path)
    assert np.load(tmp_path / "day_0_sparse.npy").dtype == np.int32
    labels, dense, sparse = direct_parse(criteo_dir / "day_0")
    ds = CriteoIterableDataset("train", days[:1], batch_size=256)
    batches = list(ds)
    assert len(batches) == len(ds) == 3001 // 256
    n = 256 * len(batches)
    got_dense = torch.cat([b.dense_features for b in batches])
    want_dense = np.log1p(np.maximum(dense[:n], 0)).astype(np.float32)
    np.testing.assert_array_equal(got_dense.numpy(), want_dense)
    np.testing.assert_array_equal(torch.cat([b.labels for b in batches]).numpy(), labels[:n])
    for f in range(26):
        ids = torch.cat([b.sparse_features[f"cat_{f}"].values() for b in batches])
        np.testing.assert_array_equal(ids.numpy(), sparse[:n, f] % SIZES[f])
    kjt = batches[0].sparse_features
    assert kjt.keys()[:2] == ["cat_0", "cat_1"] and kjt.stride() == 256


def test_raw_ids_are_hashed_when_read(criteo_dir: Path, tmp_path: Path) -> None:
    days = preprocess([criteo_dir / "day_0"], tmp_path, None)
    assert np.load(tmp_path / "day_0_sparse.npy").dtype == np.int64
    sparse = direct_parse(criteo_dir / "day_0")[2]
    ds = CriteoIterableDataset("train", days, 100, num_embeddings_per_feature=SIZES)
    first = next(iter(ds))
    np.testing.assert_array_equal(first.sparse_features["cat_3"].values(), sparse[:100, 3] % 136)


def test_rows_per_file_splits_and_val_test_halves(criteo_dir: Path, tmp_path: Path) -> None:
    days = preprocess([criteo_dir / "day_0"], tmp_path, 1000, rows_per_file=1000)
    rows = [BinaryCriteoUtils.get_shape_from_npy(f"{d}_labels.npy")[0] for d in days]
    assert rows == [1000, 1000, 1000, 1]
    last = preprocess([criteo_dir / "day_1"], tmp_path / "v", 1000)
    val = CriteoIterableDataset("val", last, 100)
    test = CriteoIterableDataset("test", last, 100)
    assert (len(val), len(test)) == (15, 15)  # halves of 3001 rows: 1501 and 1500
    labels = direct_parse(criteo_dir / "day_1")[0]
    got = torch.cat([b.labels for b in test]).numpy()
    np.testing.assert_array_equal(got, labels[1501 : 1501 + 1500])


def test_ranks_and_workers_split_the_batches(criteo_dir: Path, tmp_path: Path) -> None:
    days = preprocess([criteo_dir / "day_0"], tmp_path, 1000)
    whole = [b.labels for b in CriteoIterableDataset("train", days, 50)]
    assert len(whole) == 60
    per_rank = [list(CriteoIterableDataset("train", days, 50, r, 2)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 30
    for r in range(2):
        for i, b in enumerate(per_rank[r]):
            assert torch.equal(b.labels, whole[2 * i + r])
    ds = CriteoIterableDataset("train", days, 50, rank=1, world_size=2, num_workers=2)
    loader = ResumableDataLoader(ds, num_workers=2)
    got = [b.labels for b in loader]
    assert len(got) == len(loader) == 30  # 60 // 4 readers = 15 batches each, 2 readers here
    for i, labels in enumerate(got):  # worker w is reader 2 * 1 + w of 4
        assert torch.equal(labels, whole[4 * (i // 2) + 2 + i % 2])


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_mid_epoch(criteo_dir: Path, tmp_path: Path, workers: int) -> None:
    days = preprocess([criteo_dir / "day_0"], tmp_path, 1000)
    loader = ResumableDataLoader(
        CriteoIterableDataset("train", days, 100, num_workers=workers), num_workers=workers
    )
    full = [b.labels for b in loader]
    assert loader.resume_layout() == {"readers_per_rank": max(workers, 1), "batch_size": 100}
    fresh = ResumableDataLoader(
        CriteoIterableDataset("train", days, 100, num_workers=workers), num_workers=workers
    )
    fresh.resume_at(7)  # the strategy's call on a resume 7 batches into the epoch
    rest = [b.labels for b in fresh]
    assert len(rest) == len(full) - 7
    for a, b in zip(rest, full[7:], strict=True):
        assert torch.equal(a, b)
    assert len([b for b in fresh]) == len(full)  # the next epoch starts from the beginning


def test_slot_and_skip_continue_the_global_order() -> None:
    for workers in (1, 2, 3):
        for consumed in range(8):
            order = []
            for w in range(workers):
                slot, skip = slot_and_skip(w, workers, consumed)
                order.append(slot + workers * skip)  # the worker's first global batch
            assert order == list(range(consumed, consumed + workers))


def test_bad_files_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "day_0"
    bad.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="expected 40 tab-separated columns"):
        next(parse_tsv(bad))
    row = ["1"] + ["0"] * 13 + ["0a"] * 25 + ["zz"]
    bad.write_text("\t".join(row) + "\n")
    with pytest.raises(ValueError, match="cat_25"):
        next(parse_tsv(bad))
    kaggle_test = tmp_path / "test.tsv"
    kaggle_test.write_text("\t".join(row[1:-1] + ["ff"]) + "\n")
    labels, _, sparse = next(parse_tsv(kaggle_test))
    assert labels.tolist() == [-1] and sparse[0, -1] == 255
    with pytest.raises(ValueError, match="26 positive sizes"):
        CriteoDataModule(str(tmp_path), num_embeddings_per_feature=[5, 5])


def test_data_module_preprocesses_tsv_once(criteo_dir: Path, tmp_path: Path) -> None:
    dm = CriteoDataModule(
        str(criteo_dir), num_embeddings=500, batch_size=128, cache_dir=str(tmp_path / "cache")
    )
    with pytest.raises(ValueError, match="TSV files that are not preprocessed yet: call prepare"):
        dm.train_dataloader()
    dm.prepare_data()
    mtime = (tmp_path / "cache" / "day_0_dense.npy").stat().st_mtime_ns
    dm.prepare_data()
    assert (tmp_path / "cache" / "day_0_dense.npy").stat().st_mtime_ns == mtime
    assert len(dm.train_dataloader()) == 3001 // 128
    assert len(dm.val_dataloader()) == 1501 // 128
    batch = next(iter(dm.train_dataloader()))
    assert int(batch.sparse_features.values().max()) < 500
    with pytest.raises(FileNotFoundError, match="neither TorchRec npy days"):
        CriteoDataModule(str(tmp_path / "cache" / "..")).prepare_data()


def test_raw_ids_pass_through_unchanged(criteo_dir: Path, tmp_path: Path) -> None:
    def first_batch(raw_ids: bool) -> torch.Tensor:
        dm = CriteoDataModule(
            str(criteo_dir),
            num_embeddings_per_feature=SIZES,
            batch_size=100,
            cache_dir=str(tmp_path / "cache"),
            raw_ids=raw_ids,
        )
        dm.prepare_data()
        return next(iter(dm.train_dataloader())).sparse_features

    raw, hashed = first_batch(True), first_batch(False)
    sparse = direct_parse(criteo_dir / "day_0")[2]
    assert raw.values().dtype == torch.int64 and raw.keys() == hashed.keys()
    assert int(raw.values().max()) >= 2**31  # the 32-bit hex ids, not row numbers
    assert int(raw.values().min()) >= 0
    for f in range(26):
        got = raw[f"cat_{f}"].values()
        np.testing.assert_array_equal(got.numpy(), sparse[:100, f])
        assert torch.equal(got % SIZES[f], hashed[f"cat_{f}"].values().to(torch.int64))


def test_raw_ids_refuse_reduced_days_and_negative_ids(criteo_dir: Path, tmp_path: Path) -> None:
    reduced = preprocess([criteo_dir / "day_0"], tmp_path / "reduced", SIZES)
    with pytest.raises(ValueError, match="day_0_sparse.npy holds int32 ids"):
        CriteoIterableDataset("train", reduced, 100, raw_ids=True)
    raw = preprocess([criteo_dir / "day_0"], tmp_path / "raw", None)
    with pytest.raises(ValueError, match="num_embeddings_per_feature=None"):
        CriteoIterableDataset("train", raw, 100, num_embeddings_per_feature=SIZES, raw_ids=True)
    # A 64-bit hex id above 2**63 - 1 has no non-negative int64: named, not passed on.
    row = ["1"] + ["0"] * 13 + ["0a"] * 26
    row[14 + 5] = "ffffffffffffffff"
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "day_0").write_text("\n".join(["\t".join(row)] * 4) + "\n")
    days = preprocess([tmp_path / "wide" / "day_0"], tmp_path / "wide_npy", None)
    with pytest.raises(BatchValidationError, match="feature cat_5: raw id -1 is negative"):
        next(iter(CriteoIterableDataset("train", days, 4, raw_ids=True)))


def test_64_bit_hex_ids_are_reduced_as_unsigned(tmp_path: Path) -> None:
    """A 16-hex-digit id above 2**63 - 1 is ``int(hex, 16) % size``, whether the modulo is
    taken when preprocessing or when reading raw int64 days (where it is stored negative)."""
    hex_ids = ["ffffffffffffffff", "8000000000000005", "7fffffffffffffff", "0000000a"]
    rows = ["\t".join(["1"] + ["1"] * 13 + [h] * 26) for h in hex_ids]
    (tmp_path / "tsv").mkdir()
    (tmp_path / "tsv" / "day_0").write_text("\n".join(rows) + "\n")
    want = np.array([[int(h, 16) % size for size in SIZES] for h in hex_ids])
    assert want[:2, 0].tolist() == [(2**64 - 1) % 97, (2**63 + 5) % 97] == [60, 84]
    reduced = preprocess([tmp_path / "tsv" / "day_0"], tmp_path / "reduced", SIZES)
    np.testing.assert_array_equal(np.load(tmp_path / "reduced" / "day_0_sparse.npy"), want)
    raw = preprocess([tmp_path / "tsv" / "day_0"], tmp_path / "raw", None)
    stored = np.load(tmp_path / "raw" / "day_0_sparse.npy")
    assert stored.view(np.uint64)[:, 0].tolist() == [int(h, 16) for h in hex_ids]
    for days in (reduced, raw):
        batch = next(
            iter(CriteoIterableDataset("train", days, 4, num_embeddings_per_feature=SIZES))
        )
        for f in range(26):
            np.testing.assert_array_equal(batch.sparse_features[f"cat_{f}"].values(), want[:, f])


@pytest.fixture(scope="module")
def click_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Criteo days of 3000 rows and a Parquet dataset of 4000 rows (250-row groups)."""
    files = tmp_path_factory.mktemp("files")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_click_files.py"),
            str(files),
            "--rows-per-day",
            "3000",
            "--parquet-rows",
            "4000",
            "--parquet-files",
            "4",
            "--row-group-size",
            "250",
        ],
        check=True,
        capture_output=True,
    )
    return files


@pytest.fixture(scope="module")
def resumed(click_files: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank launch: Criteo and Parquet fits, and resumes from mid-epoch checkpoints."""
    files = click_files
    out = tmp_path_factory.mktemp("resume")
    run_script("data_resume.py", str(out), str(files), timeout=240)
    return out


@pytest.mark.parametrize("kind", ["criteo", "parquet"])
def test_two_ranks_resume_mid_epoch_bit_exact(resumed: Path, kind: str) -> None:
    full = load_ranks(resumed, f"{kind}_full")
    # every rank gets the same number of batches (the strategy's uneven-data check passed)
    per_epoch = 11 if kind == "criteo" else 10
    assert full[0]["batches_per_epoch"] == full[1]["batches_per_epoch"] == per_epoch
    for step in (5, 15):
        res = load_ranks(resumed, f"{kind}_resume{step}")
        for rank in range(2):
            steps = res[rank]["steps"]
            assert sorted(steps) == list(range(step + 1, 19))
            for s in steps:
                want = full[rank]["steps"][s]
                assert steps[s]["fingerprint"] == want["fingerprint"], (rank, s)
                assert torch.equal(steps[s]["loss"], want["loss"]), (rank, s)
    if kind == "parquet":  # resuming into a train pipeline: the same steps, bit for bit
        for step in (5, 15):
            for rank, res in enumerate(load_ranks(resumed, f"parquet_piped_resume{step}")):
                assert sorted(res["steps"]) == list(range(step + 1, 19))
                for s, got in res["steps"].items():
                    want = full[rank]["steps"][s]
                    assert got["fingerprint"] == want["fingerprint"], (rank, s)
                    assert torch.equal(got["loss"], want["loss"]), (rank, s)
    # the second resume is in the second epoch
    assert full[0]["steps"][16]["epoch"] == 1
    # different ranks trained on different batches
    assert full[0]["steps"][1]["fingerprint"] != full[1]["steps"][1]["fingerprint"]


@pytest.mark.parametrize("kind", ["criteo", "parquet"])
def test_two_ranks_log_rec_metrics(resumed: Path, kind: str) -> None:
    full = load_ranks(resumed, f"{kind}_full")
    for key in ("val/ne", "val/calibration", "val/auprc", "val/auroc", "val/loss"):
        assert np.isfinite(full[0]["val"][key]), key
        assert full[0]["val"][key] == full[1]["val"][key]  # synchronised
    for key in (
        "train/ne_window",
        "train/ne_lifetime",
        "train/calibration_window",
        "train/auroc_window",
        "train/auprc_window",
    ):
        assert key in full[0]["train_metrics"], sorted(full[0]["train_metrics"])
        assert full[0]["train_metrics"][key] == full[1]["train_metrics"][key]


def test_demo_trains_on_criteo_files_and_reports_metrics(click_files: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_torchrec.demo",
            "fit",
            "--data",
            "criteo",
            "--data.path",
            str(click_files / "criteo"),
            "--data.cache_dir",
            str(tmp_path / "npy"),
            "--data.batch_size",
            "128",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # --data criteo is taken out of the arguments without LightningCLI's "args given twice"
    # warning; the iterable loaders' length warning is Lightning's (compat.upstream).
    assert warning_lines(proc.stderr) == [], proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("final validation"))
    for name in ("AUROC", "NE", "calibration", "AUPRC"):
        assert name in line, line
    # one pass over 3000 rows (11 steps of 2 x 128 samples): above chance, barely
    words = line.removeprefix("final validation ").replace(",", "").split()
    values = dict(zip(words[::2], words[1::2], strict=True))
    assert float(values["AUROC"]) > 0.5 and 0 < float(values["NE"]) < 1.2, line


def test_preprocess_command_runs_as_documented(criteo_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_torchrec.criteo", "preprocess", str(criteo_dir)]
        + [str(tmp_path / "npy"), "--num-embeddings-per-feature", "500"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert "day_1_{dense,sparse,labels}.npy: 3001 rows" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr  # runpy's "found in sys.modules" one
    sparse = np.load(tmp_path / "npy" / "day_0_sparse.npy")
    assert sparse.dtype == np.int32 and int(sparse.max()) < 500
