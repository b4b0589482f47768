"""Trains on 2 forked ranks (the notebook start method) and reports what reached the parent."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from lightning_torchrec import DLRMClickModule, SyntheticClickData, WeightNormCallback


def main() -> None:
    out = Path(sys.argv[1])
    data = SyntheticClickData(
        num_embeddings=50, num_sparse_features=2, batch_size=16, train_batches=20, val_batches=2
    )
    model = DLRMClickModule(
        data.num_embeddings_per_feature,
        embedding_dim=4,
        dense_arch_layer_sizes=[4],
        over_arch_layer_sizes=[4, 1],
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="torchrec_notebook",
        max_steps=4,
        val_check_interval=4,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=out,
        callbacks=[WeightNormCallback(), WeightNormCallback(every_n_steps=2)],
    )
    trainer.fit(model, datamodule=data)
    torch.save(
        {
            "step": trainer.global_step,
            "auroc": float(trainer.callback_metrics["val/auroc"]),
            "state": trainer.state.status.value,
        },
        out / "parent.pt",
    )


if __name__ == "__main__":
    main()
