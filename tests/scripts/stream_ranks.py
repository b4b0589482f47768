"""2 ranks train a stream of partitions, checkpointing every step (``tests/test_stream.py``).

``python stream_ranks.py OUT DATA`` (Lightning relaunches it per rank): batches of 4 rows per
rank, ``max_epochs=-1`` over the partitions in ``DATA``; each rank writes ``full_rank{r}.pt``:
the rows of every step's batch. Checkpoints go to ``OUT/ckpts``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from factory import cpu_trainer, table_wise, tiny_dlrm  # sibling module (script directory)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.data import PartitionStreamData

OUT, DATA = Path(sys.argv[1]), Path(sys.argv[2])


class Rows(Callback):
    def __init__(self) -> None:
        self.rows: list[list[int]] = []

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.rows.append([round(float(x) * 1000) for x in batch.dense_features[:, 0]])


def main() -> None:
    L.seed_everything(3)
    data = PartitionStreamData(DATA, ["d0"], ["cat_0", "cat_1"], "label", batch_size=4)
    rows = Rows()
    every = ModelCheckpoint(dirpath=OUT / "ckpts", every_n_train_steps=1, save_top_k=-1)
    trainer = cpu_trainer(
        TorchRecStrategy(constraints=table_wise(2), log_plan=False),
        devices=2,
        max_epochs=-1,
        limit_val_batches=0,
        callbacks=[rows, every],
        enable_checkpointing=True,
        default_root_dir=OUT,
    )
    trainer.fit(tiny_dlrm(7, 2, num_dense_features=1), datamodule=data)
    torch.save({"rows": rows.rows}, OUT / f"full_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
