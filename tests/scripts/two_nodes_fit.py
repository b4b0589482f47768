"""Two torchrun agents of 2 ranks as two nodes; the checkpoint resumes on one node of 2 ranks.

argv[1]: the output directory; argv[2]: ``train`` (``Trainer(num_nodes=2, devices=2)``, 4 steps,
then ``OUT/four.ckpt``) or ``resume`` (one agent, ``Trainer(devices=2)``: resumes from it to
step 6, saving ``OUT/resumed.ckpt`` as training starts, before any step). Each rank writes
``{phase}_rank{r}.pt``: its global, local and node rank, the plan summary, its table shards.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from factory import WIDE, cpu_trainer, table_wise, tiny_data, tiny_dlrm  # sibling module
from lightning.pytorch.callbacks import Callback
from rank_state import local_view

from lightning_torchrec import TorchRecStrategy

OUT, PHASE = Path(sys.argv[1]), sys.argv[2]
TABLES, ROWS = 4, 60


class SaveAtStart(Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        trainer.save_checkpoint(OUT / "resumed.ckpt")


def main() -> None:
    L.seed_everything(0)
    data = tiny_data(ROWS, TABLES, batch_size=16, train_batches=24)
    model = tiny_dlrm(ROWS, TABLES, **WIDE)
    strategy = TorchRecStrategy(constraints=table_wise(TABLES))
    if PHASE == "train":
        trainer = cpu_trainer(strategy, devices=2, num_nodes=2, max_steps=4, limit_val_batches=0)
        trainer.fit(model, datamodule=data)
        trainer.save_checkpoint(OUT / "four.ckpt")
    else:
        trainer = cpu_trainer(
            strategy, devices=2, max_steps=6, limit_val_batches=0, callbacks=[SaveAtStart()]
        )
        trainer.fit(model, datamodule=data, ckpt_path=OUT / "four.ckpt")
    summary = trainer.strategy.plan_summary
    torch.save(
        {
            "ranks": (trainer.global_rank, trainer.local_rank, trainer.node_rank),
            "world": trainer.world_size,
            "step": trainer.global_step,
            "nodes": summary.num_nodes,
            "plan": summary.to_markdown(),
            "owners": {t.table: t.ranks for t in summary.tables},
            "model": local_view(trainer.strategy.dmp.state_dict()),
        },
        OUT / f"{PHASE}_rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
