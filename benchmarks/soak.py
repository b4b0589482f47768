"""Soak: thousands of CPU steps with both norm callbacks and periodic sharded checkpoints.

Reports resident memory (RSS) after warm-up and at the end (goal: growth <= 5%), open file
descriptors and threads at start and end. Single process (world size 1) so the figures are one
process's; ``python -m benchmarks.soak --steps 3000``. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_torchrec import (
    DLRMClickModule,
    EmbeddingNormCallback,
    SyntheticClickData,
    TorchRecStrategy,
    WeightNormCallback,
)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def resources() -> dict[str, Any]:
    return {
        "rss_mib": round(rss_mib(), 1),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
    }


class Probe(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.samples: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.samples["start"] = resources()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.samples["after_warmup"] = resources()

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.samples["end"] = resources()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--ckpt-every", type=int, default=250)
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="soak_"))
    data = SyntheticClickData(
        num_embeddings=1000,
        num_sparse_features=4,
        batch_size=128,
        train_batches=500,
        val_batches=2,
        seed=0,
    )
    model = DLRMClickModule(data.num_embeddings_per_feature, embedding_dim=16)
    probe = Probe(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,
        logger=CSVLogger(out),
        default_root_dir=out,
        strategy=TorchRecStrategy(log_plan=False),
        callbacks=[
            probe,
            WeightNormCallback(),
            EmbeddingNormCallback(),
            ModelCheckpoint(
                dirpath=out / "ckpts",
                every_n_train_steps=args.ckpt_every,
                save_top_k=2,
                monitor="step",
                mode="max",
            ),
        ],
    )
    trainer.fit(model, datamodule=data)
    s = probe.samples
    growth = 100 * (s["end"]["rss_mib"] / s["after_warmup"]["rss_mib"] - 1)
    print(f"steps={trainer.global_step} ckpt_every={args.ckpt_every} out={out}")
    for k, v in s.items():
        print(f"{k:>13}: {v}")
    print(f"RSS growth after warm-up: {growth:+.2f}% (goal <= 5%)")


if __name__ == "__main__":
    main()
