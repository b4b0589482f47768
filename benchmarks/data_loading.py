"""Data loading: throughput of the Criteo and Parquet loaders against training, and memory.

1. Writes a Criteo-format day file of ``--rows`` rows (and a smaller one) with
   ``scripts/make_click_files.py``, then preprocesses each in a fresh process
   (``python -m lightning_torchrec.data.criteo preprocess``) and records that process's peak RSS:
   streaming means the peak does not grow with the file.
2. Streams the preprocessed npy through ``CriteoIterableDataset`` in a fresh process and
   records its peak *anonymous* RSS (the npy files are memory-mapped: their pages are file
   cache, counted in RSS while resident but reclaimable, so the anonymous part is what bounds
   the process).
3. Loader throughput (samples/s, one rank's share, ``num_workers`` 0, 1 and 2) for Criteo and
   Parquet, against the training throughput of the demo model (DLRM, 26 tables of 1000 x 16,
   batch 256) on one process: the loader must produce batches faster than training takes them.

Run: ``python -m benchmarks.data_loading [--rows 2000000] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks.common import RESULTS, write_result
from lightning_torchrec import DLRMClickModule, TorchRecStrategy
from lightning_torchrec.data import (
    CriteoIterableDataset,
    ParquetClickDataset,
    ResumableDataLoader,
)
from lightning_torchrec.data.criteo import find_day_files

ROOT = Path(__file__).resolve().parents[1]
BATCH = 256


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child_stream(npy_dir: str) -> None:
    """Fresh process: iterate every training batch of the npy day; print memory as JSON."""
    days = find_day_files(npy_dir)
    ds = CriteoIterableDataset("train", days, BATCH, num_embeddings_per_feature=[1000] * 26)
    base_anon = _status_kib("RssAnon")
    peak_anon, n = base_anon, 0
    for i, batch in enumerate(ds):
        n += len(batch.labels)
        if i % 200 == 0:
            peak_anon = max(peak_anon, _status_kib("RssAnon"))
    peak_anon = max(peak_anon, _status_kib("RssAnon"))
    print(
        json.dumps(
            {
                "samples": n,
                "anon_rss_before_mib": base_anon / 1024,
                "peak_anon_rss_mib": peak_anon / 1024,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def _run_child(*args: str) -> tuple[float, dict[str, Any] | None]:
    """Runs a command in a fresh process; returns its wall time and parsed JSON (last line)."""
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return wall, json.loads(last) if last.startswith("{") else None


def preprocess_memory(tsv: Path, out: Path) -> dict[str, Any]:
    """Peak RSS of the preprocessing command on ``tsv`` (a fresh process, measured by itself)."""
    code = (
        "import json, resource, sys; from lightning_torchrec.data.criteo import main; "
        "main(sys.argv[1:]); "
        "print(json.dumps({'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss"
        " / 1024}))"
    )
    wall, info = _run_child(
        sys.executable,
        "-c",
        code,
        "preprocess",
        str(tsv),
        str(out),
        "--num-embeddings-per-feature",
        "1000",
    )
    rows = sum(1 for _ in tsv.open("rb"))
    idle_code = (
        "import json, resource; import lightning_torchrec.data.criteo; "
        "print(json.dumps({'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss"
        " / 1024}))"
    )
    _, idle = _run_child(sys.executable, "-c", idle_code)
    assert info is not None and idle is not None
    return {
        "rows": rows,
        "file_mib": tsv.stat().st_size / 2**20,
        "seconds": wall,
        "rows_per_s": rows / wall,
        "peak_rss_mib": info["peak_rss_mib"],
        "import_only_peak_rss_mib": idle["peak_rss_mib"],
    }


def loader_rate(make: Any, workers: int, max_batches: int) -> float:
    """Samples/s of one rank's loader (first batches excluded: worker start-up)."""
    loader = ResumableDataLoader(make(workers), num_workers=workers)
    n, t0 = 0, None
    for i, batch in enumerate(loader):
        if i == 5:
            t0, n = time.perf_counter(), 0
        n += len(batch.labels)
        if i >= max_batches:
            break
    assert t0 is not None
    return n / (time.perf_counter() - t0)


class _Timer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.t0, self.samples = warmup, 0.0, 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if trainer.global_step > self.warmup:
            self.samples += len(batch.labels)

    def rate(self) -> float:
        return self.samples / (time.perf_counter() - self.t0)


def training_rate(batches: list[Any], steps: int) -> float:
    """Samples/s the demo model trains on one process (batches already in memory)."""
    L.seed_everything(0)
    model = DLRMClickModule([1000] * 26, num_dense_features=13, embedding_dim=16)
    timer = _Timer(warmup=10)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=TorchRecStrategy(fused_params={"learning_rate": 0.1}),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(model, DataLoader(batches, batch_size=None))
    return timer.rate()


def main() -> None:
    """Runs the benchmark and writes ``results/data_loading.json``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the large file")
    parser.add_argument("--small-rows", type=int, default=200_000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    parser.add_argument("--child-stream", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-batches", type=int, default=600)
    parser.add_argument("--train-steps", type=int, default=60)
    args = parser.parse_args()
    if args.child_stream:
        child_stream(args.child_stream)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="data_loading_"))
    result: dict[str, Any] = {"batch_size": BATCH, "preprocess": {}, "stream": {}}
    for rows in (args.small_rows, args.rows):
        d = work / f"rows{rows}"
        if not (d / "criteo" / "day_0").exists():
            subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "make_click_files.py"), str(d),
                 "--rows-per-day", str(rows), "--days", "1", "--parquet-rows",
                 str(min(rows, 400_000)), "--parquet-files", "4", "--row-group-size", "16384"],
                check=True, capture_output=True,
            )  # fmt: skip
        result["preprocess"][rows] = preprocess_memory(d / "criteo" / "day_0", d / "npy")
        _, stream = _run_child(
            sys.executable, "-m", "benchmarks.data_loading", "--child-stream", str(d / "npy")
        )
        result["stream"][rows] = stream
        print(rows, result["preprocess"][rows], stream, flush=True)

    big = work / f"rows{args.rows}"
    days = find_day_files(big / "npy")
    parquet = sorted((big / "parquet").glob("*.parquet"))

    def criteo(workers: int) -> CriteoIterableDataset:
        return CriteoIterableDataset(
            "train", days, BATCH, num_workers=workers, num_embeddings_per_feature=[1000] * 26
        )

    def parquet_ds(workers: int) -> ParquetClickDataset:
        return ParquetClickDataset(
            [str(p) for p in parquet],
            [f"dense_{i}" for i in range(13)],
            [f"cat_{i}" for i in range(8)],
            "label",
            "weight",
            batch_size=BATCH,
            num_workers=workers,
            num_embeddings_per_feature=[1000] * 8,
        )

    result["loader_samples_per_s"] = {
        name: {w: loader_rate(make, w, args.max_batches) for w in (0, 1, 2)}
        for name, make in (("criteo", criteo), ("parquet", parquet_ds))
    }
    print(result["loader_samples_per_s"], flush=True)
    batches = [b for _, b in zip(range(args.train_steps + 5), criteo(0), strict=False)]
    result["train_samples_per_s_one_process"] = training_rate(batches, args.train_steps)
    slowest = min(min(v.values()) for v in result["loader_samples_per_s"].values())
    result["slowest_loader_over_training"] = slowest / result["train_samples_per_s_one_process"]
    torch.set_printoptions(precision=3)
    print(json.dumps(result, indent=1, default=str))
    write_result("data_loading", result, args.out)


if __name__ == "__main__":
    main()
