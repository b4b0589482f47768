"""A LightningModule's batch hooks on 2 ranks under the default ``pipeline="auto"`` (a script).

``python batch_hooks_ranks.py OUT``: each rank writes ``{tag}_rank{r}.pt``:

* ``hashed``: the loader's ids reach ``2 * ROWS - 1``; ``on_after_batch_transfer`` hashes them
  into the tables (``% ROWS``). Fit with validation in between, then predict: the pipeline in
  use, the hook's calls per stage, and per step whether it got the hook's batch.
* ``copied`` and ``plain``: the same fit with a hook that returns a copy of the batch, and
  without a hook (``"auto"`` then pipelines): every step's loss and the local state.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from factory import QUIET, ROWS, table_wise, tiny_data, tiny_dlrm
from rank_state import local_view
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import DLRMClickModule, TorchRecStrategy

OUT = Path(sys.argv[1])


def stage_of(trainer: L.Trainer) -> str:
    return "train" if trainer.training else "val" if trainer.validating else "predict"


class Recording(DLRMClickModule):
    """Counts its hook's calls per stage; keeps the hook's last batch and each step's loss."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = {"train": 0, "val": 0, "predict": 0}
        self.made: Any = None
        self.not_made = 0  # training steps that did not get the hook's batch
        self.max_id = 0
        self.losses: list[torch.Tensor] = []

    def change(self, batch: Any) -> Any:
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.calls[stage_of(self.trainer)] += 1
        self.made = self.change(batch)
        return self.made

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.not_made += batch is not self.made
        self.max_id = max(self.max_id, int(batch.sparse_features.values().max()))
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss


class Hashing(Recording):
    def change(self, batch: Any) -> Any:
        kjt = batch.sparse_features
        ids = KeyedJaggedTensor(kjt.keys(), kjt.values() % ROWS, lengths=kjt.lengths())
        return dataclasses.replace(batch, sparse_features=ids)


class Copying(Recording):
    def change(self, batch: Any) -> Any:
        return dataclasses.replace(batch)


class Plain(DLRMClickModule):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss


def run(tag: str, cls: type[DLRMClickModule], rows: int) -> None:
    L.seed_everything(3)
    data = tiny_data(rows, train_batches=12, val_batches=4)
    model = tiny_dlrm(cls=cls)
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False)  # pipeline="auto"
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        max_steps=6,
        val_check_interval=3,
        limit_val_batches=2,
        **QUIET,
    )
    # Loaders, not the DataModule: Lightning warns that the module's hook overrides its own.
    trainer.fit(model, data.train_dataloader(), data.val_dataloader())
    result: dict[str, Any] = {
        "pipeline": strategy.pipeline_in_use,
        "steps": trainer.global_step,
        "losses": model.losses,
        "state": local_view(model.state_dict()),
    }
    if isinstance(model, Recording):
        predictions = trainer.predict(model, data.val_dataloader())
        result.update(
            calls=model.calls,
            not_made=model.not_made,
            max_id=model.max_id,
            predictions=len(predictions or []),
        )
    torch.save(result, OUT / f"{tag}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    run("hashed", Hashing, 2 * ROWS)
    run("copied", Copying, ROWS)
    run("plain", Plain, ROWS)
