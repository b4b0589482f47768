"""2 ranks: a plain shuffled map-style DataLoader resumes mid-epoch exactly, loading nothing twice.

``python mid_epoch_ranks.py OUT`` (Lightning relaunches it per rank). The training loader is
what users write: a dataset of single samples, ``DataLoader(shuffle=True, batch_size=4,
drop_last=True, num_workers=2, persistent_workers=True)`` (Lightning puts a shuffling
``DistributedSampler`` in), no ``state_dict``. Runs, each over ``EPOCHS`` epochs:

1. ``full``: uninterrupted, ``pipeline="sparse_dist"`` (it reads a batch ahead of the step),
   a checkpoint every ``EVERY`` steps;
2. ``resume4``: a fresh model and trainer resume from the step-4 checkpoint (mid first epoch);
3. ``resume8``: the same from step 8 (mid second epoch), pipelined;
4. ``cut``: a fit stopped by ``max_steps=CUT`` (mid first epoch, which Lightning ends as though
   it were over), then ``trainer.save_checkpoint``; ``resume_cut`` resumes from that.

Each rank writes ``{run}_rank{r}.pt``: every step's loss and sample ids, its local tables and
dense weights at the end. Every ``__getitem__`` call appends the sample id to
``OUT/calls/{run}_rank{r}_{pid}.txt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from factory import cpu_trainer, table_wise, tiny_dlrm  # sibling modules (script directory)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from rank_state import local_view
from torch.utils.data import DataLoader, Dataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import Batch, TorchRecStrategy

OUT = Path(sys.argv[1])
ROWS, SAMPLES, BATCH, EVERY, EPOCHS, CUT = 40, 50, 4, 4, 2, 3


class Samples(Dataset):
    """Sample ``i``: 13 dense features (the first is ``i``), one id per feature, a label."""

    def __init__(self, run: str) -> None:
        self.calls = OUT / "calls" / f"{run}_rank{os.environ.get('LOCAL_RANK', '0')}"

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with open(f"{self.calls}_{os.getpid()}.txt", "a") as f:
            f.write(f"{i}\n")
        g = torch.Generator().manual_seed(1000 + i)
        dense = torch.randn(13, generator=g)
        dense[0] = i
        return dense, torch.randint(0, ROWS, (2,), generator=g), torch.rand(1, generator=g).round()


def collate(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Batch:
    dense, ids, labels = (torch.stack(x) for x in zip(*samples, strict=True))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["cat_0", "cat_1"],
        values=ids.t().reshape(-1),
        lengths=torch.ones(ids.numel(), dtype=torch.int32),
    )
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels.squeeze(1))


class Recorder(Callback):
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps[trainer.global_step] = {
            "loss": outputs["loss"].detach().clone(),
            "ids": batch.dense_features[:, 0].long().tolist(),
            "epoch": trainer.current_epoch,
            "batch_idx": batch_idx,
        }


def run(
    tag: str,
    ckpt_path: Path | None = None,
    pipeline: str | None = None,
    max_steps: int = -1,
) -> L.Trainer:
    L.seed_everything(3)
    loader = DataLoader(
        Samples(tag),
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        num_workers=2,
        persistent_workers=True,  # epoch 2 reuses the workers (and their sampler iterator)
        collate_fn=collate,
    )
    model = tiny_dlrm(ROWS, 2, embedding_dim=4, dense_sizes=[8, 4], num_dense_features=13)
    recorder = Recorder()
    callbacks: list[Callback] = [recorder]
    if ckpt_path is None and max_steps < 0:
        callbacks.append(
            ModelCheckpoint(dirpath=OUT / "ckpts", every_n_train_steps=EVERY, save_top_k=-1)
        )
    trainer = cpu_trainer(
        TorchRecStrategy(constraints=table_wise(2), pipeline=pipeline),  # type: ignore[arg-type]
        devices=2,
        max_epochs=EPOCHS,
        max_steps=max_steps,
        limit_val_batches=0,
        callbacks=callbacks,
        enable_checkpointing=len(callbacks) > 1,
        default_root_dir=OUT,
    )
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    info = {
        "steps": recorder.steps,
        "batches_per_epoch": trainer.num_training_batches,
        "state": local_view(model.state_dict()),
    }
    torch.save(info, OUT / f"{tag}_rank{trainer.global_rank}.pt")
    return trainer


def main() -> None:
    (OUT / "calls").mkdir(parents=True, exist_ok=True)
    run("full", pipeline="sparse_dist")
    (ckpt4,) = (OUT / "ckpts").glob("*step=4.ckpt")
    (ckpt8,) = (OUT / "ckpts").glob("*step=8.ckpt")
    run("resume4", ckpt4)
    run("resume8", ckpt8, pipeline="sparse_dist")
    run("cut", max_steps=CUT).save_checkpoint(OUT / "cut.ckpt")
    run("resume_cut", OUT / "cut.ckpt")


if __name__ == "__main__":
    main()
