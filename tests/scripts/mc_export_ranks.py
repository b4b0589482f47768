"""2 ranks: train the managed-collision click model (``mc_model``) to step ``STOP`` and save a
sharded checkpoint; record what the trained, sharded model answers in eval mode (no admission,
no eviction) for the export tests to compare the served artifact with.

argv[1]: the output directory. Each rank writes ``trained_rank{r}.pt``: ``lookup`` (the
embedding each probe id gets, ``mc_model.lookup``), ``logits`` for :func:`mc_model.probe_batch`
and ``held``: the raw ids each table's MCH module admitted on this rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from factory import cpu_trainer  # sibling module (script directory)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from mc_model import STOP, data, lookup, module, probe_batch, strategy  # sibling module
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from lightning_torchrec.compat.upstream import mch_held_ids

OUT = Path(sys.argv[1])


class Record(Callback):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *_: Any) -> None:
        if trainer.global_step != STOP:
            return
        model = pl_module.model_and_loss.model
        dense, kjt = probe_batch()
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(dense, kjt).detach().clone()
        finally:
            model.train(was)
        held = {
            name.rsplit(".", 1)[-1]: mch_held_ids(m).clone()
            for name, m in model.named_modules()
            if isinstance(m, MCHManagedCollisionModule)
        }
        self.record = {"lookup": lookup(pl_module), "logits": logits, "held": held}


def main() -> None:
    L.seed_everything(3)
    record = Record()
    trainer = cpu_trainer(
        strategy(),
        devices=2,
        max_steps=STOP,
        limit_val_batches=0,
        callbacks=[record, ModelCheckpoint(dirpath=OUT / "ckpt", every_n_train_steps=STOP)],
        enable_checkpointing=True,
        default_root_dir=OUT,
    )
    trainer.fit(module(), datamodule=data())
    torch.save(record.record, OUT / f"trained_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
