"""Online training end to end on 2 ranks (run as a script; Lightning relaunches it).

A stream of drifting partitions (``argv[1]/stream``, written by the test) is trained one
partition an epoch by ``PartitionStreamData`` with ``t_cat_0`` row-wise and ``t_cat_1``
table-wise; ``DeltaPublisher`` publishes every 4 steps and at each partition's end into
``argv[1]/deltas``; after each publish a full checkpoint ``argv[1]/full-<step>`` is saved (the test
exports it and compares the served model with it).

``argv[2]``:

- ``first``: saves ``argv[1]/resume`` at step 10 and stops at step 13, as a killed run would
  (its delta of step 12 follows the checkpoint it will be resumed from);
- ``second``: resumes from ``argv[1]/resume`` and trains to the stream's end.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
from factory import QUIET, sharding_constraints, tiny_dlrm

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.data import PartitionStreamData
from lightning_torchrec.data.drifting import DriftingClicks
from lightning_torchrec.lightning import DeltaPublisher

# Read only when run: the test imports ``clicks`` from here.
OUT = Path(sys.argv[1]) if __name__ == "__main__" else Path()
PHASE = sys.argv[2] if __name__ == "__main__" else ""
ROWS, TABLES, DENSE = 300, 2, 13
RESUME_STEP, KILL_STEP = 10, 13


def clicks() -> DriftingClicks:
    """The stream's generator (the test writes its partitions with the same one)."""
    return DriftingClicks(
        num_embeddings=ROWS, num_sparse_features=TABLES, rows_per_partition=512, seed=3
    )


class SaveAfterPublish(L.Callback):
    """A full checkpoint after each delta (and the resume point of the first phase)."""

    def __init__(self, publisher: DeltaPublisher) -> None:
        self.publisher = publisher
        self.seen = 0

    def _save(self, trainer: L.Trainer) -> None:
        if len(self.publisher.published) > self.seen:
            self.seen = len(self.publisher.published)
            trainer.save_checkpoint(OUT / f"full-{trainer.global_step}")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._save(trainer)
        if PHASE == "first" and trainer.global_step == RESUME_STEP:
            trainer.save_checkpoint(OUT / "resume")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer)


def main() -> None:
    L.seed_everything(0, verbose=False)
    generator = clicks()
    data = PartitionStreamData(
        OUT / "stream",
        generator.dense_columns,
        generator.sparse_columns,
        "label",
        batch_size=32,
        feature_names=[f"cat_{i}" for i in range(TABLES)],
        num_embeddings_per_feature=[ROWS] * TABLES,
        timeout_seconds=0,
    )
    model = tiny_dlrm(ROWS, TABLES, embedding_dim=8, num_dense_features=DENSE)
    publisher = DeltaPublisher(OUT / "deltas", every_n_steps=4, at_partition_end=True)
    strategy = TorchRecStrategy(
        constraints=sharding_constraints({"t_cat_0": "row_wise", "t_cat_1": "table_wise"})
    )
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        **(QUIET | {"max_epochs": -1, "max_steps": KILL_STEP if PHASE == "first" else -1}),
        callbacks=[publisher, SaveAfterPublish(publisher)],
    )
    resume = OUT / "resume" if PHASE == "second" else None
    trainer.fit(model, datamodule=data, ckpt_path=resume)


if __name__ == "__main__":
    main()
