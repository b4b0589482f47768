r"""Criteo click logs: streaming TSV-to-npy preprocessing and a resumable ``CriteoDataModule``.

The Criteo click-log format (the 1TB day files ``day_0 ... day_23`` and the Kaggle ``train.txt``)
has one sample per line, tab-separated: the label, 13 integer features and 26 categorical
features as 32-bit hex strings; any field may be empty. This module

* converts such files to TorchRec's binary layout (``day_{i}_dense.npy`` float32 ``[N, 13]``,
  ``day_{i}_sparse.npy`` ``[N, 26]``, ``day_{i}_labels.npy`` int32 ``[N, 1]``), streaming
  (memory bounded by one block of the input, whatever the file size). Fields are parsed as
  TorchRec's ``BinaryCriteoUtils.tsv_to_npys`` parses them (empty is 0, categoricals are base
  16); categorical ids are reduced modulo the table sizes as TorchRec's DLRM example does
  (``id % num_embeddings``), or kept raw (``raw_ids=True``, for managed-collision tables that
  remap raw ids themselves), and dense values become ``log(1 + max(x, 0))`` (DLRM's transform;
  ``tsv_to_npys`` instead shifts by the file's minimum, which a stream cannot know in advance);
* reads the npy files with TorchRec's ``InMemoryBinaryCriteoIterDataPipe`` (memory-mapped, each
  rank, and each DataLoader worker of it, takes its own batches), with an exact mid-epoch resume.

Command line::

    python -m lightning_torchrec.data.criteo preprocess IN_DIR OUT_DIR \\
        --num-embeddings-per-feature 40000000 [--rows-per-file N]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    INT_FEATURE_COUNT,
    BinaryCriteoUtils,
    InMemoryBinaryCriteoIterDataPipe,
)

from lightning_torchrec.data.batch import Batch
from lightning_torchrec.data.criteo_files import (
    MARKER,
    NPY_KINDS,
    parse_tsv,
    preprocess,
    remove_other_days,
    table_sizes_array,
)
from lightning_torchrec.data.criteo_ids import check_raw_days, raw_ids_of, reduced_ids_of
from lightning_torchrec.data.resumable import (
    ResumableDataModule,
    ResumableIterableDataset,
    worker_slot,
)

__all__ = [
    "CriteoDataModule",
    "CriteoIterableDataset",
    "find_day_files",
    "parse_tsv",
    "preprocess",
]


class CriteoIterableDataset(ResumableIterableDataset):
    """Batches of one stage of TorchRec npy days, read by ``InMemoryBinaryCriteoIterDataPipe``.

    The files are memory-mapped, and TorchRec's reader deals batch ``j`` to reader ``j % R``:
    here the readers are the ``world_size * num_workers`` (rank, worker) pairs, so each rank and
    worker touches only the rows of its own batches. Every rank gets the same number of batches
    (the remainder that does not fill a batch on every reader is dropped).

    Args:
        stage: ``train`` (all days given), ``val`` or ``test`` (first or second half of the
            single day given), as in TorchRec.
        days: the day stems (``.../day_{i}``).
        batch_size: samples per batch.
        rank: this process's rank.
        world_size: the number of ranks.
        num_workers: the DataLoader workers that will iterate this dataset (0 or more).
        num_embeddings_per_feature: ids are taken modulo these table sizes when read (raw
            int64 ids as the unsigned values they hold, see :func:`reduce_ids`).
        raw_ids: yield the stored ids unchanged, as ``int64`` (for managed-collision tables,
            which remap raw ids themselves); ``num_embeddings_per_feature`` must then be None.

    Raises:
        ValueError: for an empty stage, ``val``/``test`` with more than one day, ``raw_ids``
            with table sizes or with days whose ids were reduced when preprocessed (not int64),
            a batch size or table size below 1, or a stage without one batch per reader.
    """

    def __init__(
        self,
        stage: str,
        days: Sequence[Path],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        num_embeddings_per_feature: Sequence[int] | None = None,
        raw_ids: bool = False,
    ) -> None:
        if not days:
            raise ValueError(f"no Criteo days for stage {stage!r}")
        if stage in ("val", "test") and len(days) != 1:
            raise ValueError(f"stage {stage!r} reads one day (TorchRec's layout), got {len(days)}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        table_sizes_array(num_embeddings_per_feature)  # 26 positive sizes, or None
        self.stage = stage
        self.paths = {k: [f"{d}_{k}.npy" for d in days] for k in NPY_KINDS}
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_slots = max(num_workers, 1)
        self.hashes = (
            None if num_embeddings_per_feature is None else list(num_embeddings_per_feature)
        )
        self.raw_ids = raw_ids
        if raw_ids:
            check_raw_days(self.paths["sparse"], self.hashes)
        # Raw int64 ids are reduced here, as uint64: TorchRec's reader would take the modulo of
        # a 16-hex-digit id above 2**63 - 1 from its negative int64, a wrong row.
        self.reduce_here = self.hashes is not None and any(
            np.load(p, mmap_mode="r").dtype == np.int64 for p in self.paths["sparse"]
        )
        rows = [BinaryCriteoUtils.get_shape_from_npy(p)[0] for p in self.paths["dense"]]
        if stage == "val":
            rows = [math.ceil(rows[0] / 2)]
        elif stage == "test":
            rows = [rows[0] - math.ceil(rows[0] / 2)]
        readers = world_size * self.num_slots
        self.batches_per_slot = sum(rows) // batch_size // readers
        self.num_rows = sum(rows)
        if self.batches_per_slot == 0:
            raise ValueError(
                f"Criteo stage {stage!r} ({self.num_rows} rows of {days[0]}...) gives each of "
                f"{world_size} ranks x {self.num_slots} workers no batch of {batch_size} rows: "
                "use more rows, a smaller batch or fewer workers"
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
        # TorchRec's reader reseeds NumPy's global generator; keep the caller's stream intact.
        numpy_state = np.random.get_state()
        pipe = InMemoryBinaryCriteoIterDataPipe(
            self.stage,
            self.paths["dense"],
            self.paths["sparse"],
            self.paths["labels"],
            batch_size=self.batch_size,
            rank=self.rank * num_slots + slot,
            world_size=self.world_size * num_slots,
            drop_last=True,
            mmap_mode=True,
            hashes=None if self.reduce_here else self.hashes,
        )
        np.random.set_state(numpy_state)
        # TorchRec wraps its read-only memory maps with torch.from_numpy (compat.upstream
        # filters its warning): the dense rows are cloned, the labels converted, before use.
        for i, b in enumerate(pipe):
            if i < skip:
                continue
            sparse = raw_ids_of(b.sparse_features) if self.raw_ids else b.sparse_features
            if self.reduce_here:
                sparse = reduced_ids_of(sparse, np.asarray(self.hashes, dtype=np.int64))
            yield Batch(
                dense_features=b.dense_features.clone(),
                sparse_features=sparse,
                labels=b.labels.to(torch.float32),
            )


class CriteoDataModule(ResumableDataModule):
    """Criteo click logs (TSV day files, Kaggle ``train.txt``, or TorchRec npy days).

    ``path`` holds either TorchRec npy days (``day_{i}_{dense,sparse,labels}.npy``) or Criteo
    TSV files; TSV files are preprocessed once (:func:`preprocess`, on local rank 0 of each node)
    into ``cache_dir``. The last day is split in half for validation and test (TorchRec's
    layout); the days before it are the training set. Sparse features are ``cat_0 ... cat_25``,
    dense width 13, as in TorchRec's DLRM. Training resumes mid-epoch exactly from a checkpoint.

    Args:
        path: the data directory.
        num_embeddings: rows of every table (when ``num_embeddings_per_feature`` is None).
        num_embeddings_per_feature: rows of each of the 26 tables; ids are taken modulo these.
        batch_size: samples per batch on each rank.
        num_workers: DataLoader workers per rank.
        cache_dir: where preprocessed TSV files go (default ``path/npy``).
        rows_per_file: preprocessing splits the input into days of this many rows (use it for a
            single file such as ``train.txt``); None keeps one day per file.
        raw_ids: pass the raw ids (Criteo's hashed ids, ``int64``, non-negative) through
            unchanged instead of taking them modulo the table sizes: for a model whose tables
            remap raw ids (``ManagedCollisionEmbeddingCollection``). The table sizes are then
            only the model's, not applied to the ids.
    """

    def __init__(
        self,
        path: str,
        num_embeddings: int = 10_000,
        num_embeddings_per_feature: list[int] | None = None,
        batch_size: int = 512,
        num_workers: int = 0,
        cache_dir: str | None = None,
        rows_per_file: int | None = None,
        raw_ids: bool = False,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.num_embeddings_per_feature = (
            list(num_embeddings_per_feature)
            if num_embeddings_per_feature is not None
            else [num_embeddings] * CAT_FEATURE_COUNT
        )
        table_sizes_array(self.num_embeddings_per_feature)
        self.num_dense_features = INT_FEATURE_COUNT
        self.feature_names = list(DEFAULT_CAT_NAMES)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir) if cache_dir is not None else self.path / "npy"
        self.rows_per_file = rows_per_file
        self.raw_ids = raw_ids

    @property
    def npy_dir(self) -> Path:
        """The directory of the npy days the module reads."""
        return self.path if find_day_files(self.path) else self.cache_dir

    def prepare_data(self) -> None:
        """Preprocesses TSV files into ``cache_dir`` unless npy days are there already.

        A new conversion (other files, sizes or ``rows_per_file``) removes the cache's days it
        does not write: left there, they would be read as training and validation days.

        Raises:
            FileNotFoundError: if ``path`` has neither npy days nor Criteo TSV files.
        """
        if find_day_files(self.path):
            return
        tsv = find_tsv_files(self.path)
        if not tsv:
            raise FileNotFoundError(
                f"{self.path} has neither TorchRec npy days (day_N_dense.npy, ...) nor Criteo "
                "TSV files (day_N, *.tsv, train.txt)"
            )
        settings = {
            "files": [str(p) for p in tsv],
            "sizes": [p.stat().st_size for p in tsv],
            "rows_per_file": self.rows_per_file,
        }
        marker = self.cache_dir / MARKER
        if marker.exists() and json.loads(marker.read_text()) == settings:
            return
        # Raw ids (int64) are kept: the reader takes them modulo the table sizes, so one
        # preprocessing serves any table sizes.
        written = preprocess(tsv, self.cache_dir, None, rows_per_file=self.rows_per_file)
        remove_other_days(self.cache_dir, written)  # an earlier conversion's extra days
        marker.write_text(json.dumps(settings))

    def _days(self) -> list[Path]:
        days = find_day_files(self.npy_dir)
        if not days and find_tsv_files(self.path):
            raise ValueError(
                f"{self.path} holds Criteo TSV files that are not preprocessed yet: call "
                "prepare_data() first (the Trainer does), then setup()"
            )
        if len(days) < 2:
            raise ValueError(
                f"{self.npy_dir} has {len(days)} day(s): Criteo needs training days and a last "
                "day for validation and test (split one file with rows_per_file)"
            )
        return days

    def dataset(self, stage: str, num_workers: int = 0) -> CriteoIterableDataset:
        """The dataset of one stage on this rank.

        Args:
            stage: ``train``, ``val`` or ``test``.
            num_workers: the workers that will read it.

        Returns:
            The dataset.
        """
        days = self._days()
        rank, world = self.rank_and_world()
        return CriteoIterableDataset(
            stage,
            days[:-1] if stage == "train" else days[-1:],
            batch_size=self.batch_size,
            rank=rank,
            world_size=world,
            num_workers=num_workers,
            num_embeddings_per_feature=None if self.raw_ids else self.num_embeddings_per_feature,
            raw_ids=self.raw_ids,
        )


def find_day_files(path: str | Path) -> list[Path]:
    """The TorchRec npy days in a directory, by day number.

    Args:
        path: a directory holding ``day_{i}_{dense,sparse,labels}.npy`` triples.

    Returns:
        The stems ``path/day_{i}``, ordered by ``i``.

    Raises:
        FileNotFoundError: if a day lacks one of its three files.
    """
    path = Path(path)
    days = []
    for dense in path.glob("*_dense.npy"):
        stem = dense.name.removesuffix("_dense.npy")
        for kind in NPY_KINDS:
            if not (path / f"{stem}_{kind}.npy").exists():
                raise FileNotFoundError(f"{path / f'{stem}_{kind}.npy'} is missing")
        number = re.findall(r"\d+", stem)
        days.append((int(number[-1]) if number else -1, stem))
    return [path / stem for _, stem in sorted(days)]


def find_tsv_files(path: str | Path) -> list[Path]:
    """The Criteo TSV files of a directory: ``day_{i}`` (by day), ``*.tsv``, ``train.txt``.

    Args:
        path: the directory.

    Returns:
        The files, days first in day order.
    """
    path = Path(path)
    days = sorted(
        (p for p in path.iterdir() if p.is_file() and re.fullmatch(r"day_\d+(\.tsv)?", p.name)),
        key=lambda p: int(re.findall(r"\d+", p.name)[0]),
    )
    others = sorted(p for p in path.glob("*.tsv") if p not in days)
    kaggle = [path / "train.txt"] if (path / "train.txt").is_file() else []
    return days + others + kaggle


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    """``python -m lightning_torchrec.criteo preprocess IN OUT_DIR [options]``.

    A malformed or empty input exits with status 2 and the error on one line, leaving no day
    of it in ``OUT_DIR``.

    Args:
        argv: the arguments (defaults to ``sys.argv[1:]``).
        prog: the command's name in its messages.
    """
    parser = argparse.ArgumentParser(prog=prog or "python -m lightning_torchrec.criteo")
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preprocess", help="Criteo TSV files -> TorchRec npy days (streaming)")
    pre.add_argument("input", help="a directory of day_N / *.tsv / train.txt files, or one file")
    pre.add_argument("out_dir")
    pre.add_argument(
        "--num-embeddings-per-feature",
        default=None,
        help="table sizes: one number for all 26 features, or 26 comma-separated numbers; "
        "ids are stored modulo these (omit to keep the raw 32-bit ids)",
    )
    pre.add_argument("--rows-per-file", type=int, default=None, help="rows per output day")
    pre.add_argument("--block-size-mb", type=int, default=16, help="input parsed per step")
    args = parser.parse_args(argv)
    source = Path(args.input)
    files = find_tsv_files(source) if source.is_dir() else [source]
    sizes: list[int] | int | None = None
    if args.num_embeddings_per_feature is not None:
        parts = [int(x) for x in args.num_embeddings_per_feature.split(",")]
        sizes = parts[0] if len(parts) == 1 else parts
    try:
        written = preprocess(
            files,
            args.out_dir,
            sizes,
            rows_per_file=args.rows_per_file,
            block_size=args.block_size_mb << 20,
        )
    except (ValueError, OSError) as err:  # the input's mistake: one line, no traceback
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        parser.exit(2, f"{parser.prog}: error: {type(err).__name__}: {text}\n")
    for stem in written:
        rows = BinaryCriteoUtils.get_shape_from_npy(f"{stem}_dense.npy")[0]
        print(f"{stem}_{{dense,sparse,labels}}.npy: {rows} rows")


if __name__ == "__main__":
    main()
