"""One task of a 2-rank SLURM job: trains through Lightning's ``SLURMEnvironment``.

Started by ``srun`` in the batch script of ``scripts/test_cluster.sh`` (``make test-cluster``)::

    python -m tests.cluster.slurm_fit OUT FILES

``OUT`` is the run's ``default_root_dir`` (where Lightning writes ``hpc_ckpt_*.ckpt`` on the
requeue signal and looks for it when the requeued job starts); ``FILES`` a directory made by
``scripts/make_click_files.py``. Every attempt of the job (``SLURM_RESTART_COUNT``) writes, per
rank, ``attempt{n}_rank{r}.pt``: the checkpoint it resumed from, the loss and batch fingerprint
of every step it trained and, when it reaches ``max_steps``, the rank's shards of every weight
and optimizer state. Rank 0 writes the last finished step to ``OUT/progress`` so the driver knows
when to send the signal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.data import ParquetClickData
from lightning_torchrec.training.optim import keyed_optimizer
from tests.scripts.factory import QUIET, table_wise, tiny_dlrm
from tests.scripts.rank_state import local_view

ROWS, TABLES, STEPS = 100, 8, int(os.environ.get("CLUSTER_STEPS", "120"))


class Recorder(Callback):
    """Every step's loss and batch fingerprint; rank 0 publishes its progress."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps[trainer.global_step] = {
            "loss": outputs["loss"].detach().clone(),
            "epoch": trainer.current_epoch,
            "fingerprint": batch.dense_features.sum().item()
            + batch.sparse_features.values().sum().item(),
        }
        if trainer.is_global_zero:
            tmp = self.out / "progress.tmp"
            tmp.write_text(str(trainer.global_step))
            tmp.replace(self.out / "progress")


def main() -> None:
    out, files = Path(sys.argv[1]), Path(sys.argv[2])
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    parquet = sorted((files / "parquet").glob("*.parquet"))
    data = ParquetClickData(
        [str(f) for f in parquet],
        dense_columns=[f"dense_{i}" for i in range(13)],
        sparse_columns=[f"cat_{i}" for i in range(TABLES)],
        label_column="label",
        weight_column="weight",
        batch_size=64,
        num_embeddings_per_feature=[ROWS] * TABLES,
    )
    L.seed_everything(7)
    model = tiny_dlrm(ROWS, TABLES, embedding_dim=4, dense_sizes=[8, 4], num_dense_features=13)
    recorder = Recorder(out)
    trainer = L.Trainer(
        **QUIET,
        num_nodes=1,
        devices=2,
        strategy=TorchRecStrategy(constraints=table_wise(TABLES)),
        plugins=[SLURMEnvironment(auto_requeue=True)],
        max_steps=STEPS,
        limit_val_batches=0,
        callbacks=[recorder],
        default_root_dir=out,
    )
    env = trainer.strategy.cluster_environment
    rank = trainer.global_rank
    record: dict[str, Any] = {
        "environment": type(env).__name__,
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "ranks": (rank, trainer.local_rank, trainer.node_rank, trainer.world_size),
    }
    try:
        trainer.fit(model, datamodule=data)
    finally:
        record["resumed_from"] = trainer.ckpt_path and Path(trainer.ckpt_path).name
        record["steps"] = recorder.steps
        record["global_step"] = trainer.global_step
        if trainer.global_step == STEPS:
            record["weights"] = local_view(model.state_dict())
            record["optimizer"] = local_view(keyed_optimizer(trainer.optimizers[0]).state_dict())
        torch.save(record, out / f"attempt{attempt}_rank{rank}.pt")


if __name__ == "__main__":
    main()
