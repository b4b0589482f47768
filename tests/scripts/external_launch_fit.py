"""Trains a few steps in processes started outside Lightning (torchrun, SLURM's srun)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# sibling module (script directory)
from factory import cpu_trainer, table_wise, tiny_data, tiny_dlrm

from lightning_torchrec import TorchRecStrategy


def main() -> None:
    out = Path(sys.argv[1])
    data = tiny_data(50, batch_size=16, train_batches=20)
    model = tiny_dlrm(data.num_embeddings_per_feature)
    trainer = cpu_trainer(
        TorchRecStrategy(constraints=table_wise(2)), devices=2, max_steps=4, limit_val_batches=0
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
