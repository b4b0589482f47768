"""Trains a few steps in processes started outside Lightning (torchrun, SLURM's srun)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torchrec.distributed.planner.types import ParameterConstraints

from lightning_torchrec import DLRMClickModule, SyntheticClickData, TorchRecStrategy


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
    strategy = TorchRecStrategy(
        constraints={
            f"t_cat_{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(2)
        }
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)
    torch.save(
        {
            "env": type(trainer.strategy.cluster_environment).__name__,
            "launched_by": os.environ.get("TORCHELASTIC_RUN_ID"),
            "rank": trainer.global_rank,
            "world": trainer.world_size,
            "step": trainer.global_step,
            "plan": [(t.table, t.ranks) for t in trainer.strategy.plan_summary.tables],
        },
        out / f"run_rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
