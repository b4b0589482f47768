"""Trains on 2 forked ranks (the notebook start method) and reports what reached the parent."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# sibling module (script directory)
from factory import cpu_trainer, tiny_data, tiny_dlrm

from lightning_torchrec import WeightNormCallback


def main() -> None:
    out = Path(sys.argv[1])
    data = tiny_data(50, batch_size=16, train_batches=20)
    model = tiny_dlrm(data.num_embeddings_per_feature)
    trainer = cpu_trainer(
        "torchrec_notebook",
        devices=2,
        max_steps=4,
        val_check_interval=4,
        logger=True,  # Lightning's default loggers: the norm callbacks need one
        num_sanity_val_steps=2,  # Lightning's default: the forked ranks run the sanity check too
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
