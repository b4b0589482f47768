"""2 ranks: Criteo and Parquet data modules resume mid-epoch exactly; metrics are logged.

One launch (run as a script; Lightning relaunches it per rank). argv[1]: the output directory,
argv[2]: a directory made by ``scripts/make_click_files.py``. For each data module:

1. an uninterrupted fit of ``STEPS`` steps (over two epochs), checkpointing every ``EVERY``
   steps, recording every step's loss and batch fingerprint, then ``validate`` (metrics);
2. fresh model and trainer resume from the checkpoints at ``EVERY`` (mid first epoch) and
   ``3 * EVERY`` (mid second epoch) and run to ``STEPS``, recording the same;
3. (Parquet) the same resumes with ``pipeline="sparse_dist"`` (``piped_resume{step}``).

Each rank writes ``{data}_{run}_rank{r}.pt``.
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
from lightning_torchrec.data import CriteoDataModule, ParquetClickData

OUT, FILES = Path(sys.argv[1]), Path(sys.argv[2])
EVERY, STEPS, ROWS = 5, 18, 50


class Recorder(Callback):
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps[trainer.global_step] = {
            "loss": outputs["loss"].detach().clone(),
            "epoch": trainer.current_epoch,
            "batch_idx": batch_idx,
            "fingerprint": batch.dense_features.sum().item()
            + batch.sparse_features.values().sum().item(),
        }


def make_data(kind: str) -> L.LightningDataModule:
    if kind == "criteo":
        return CriteoDataModule(
            str(FILES / "criteo"),
            num_embeddings=ROWS,
            batch_size=128,
            cache_dir=str(OUT / "criteo_npy"),
        )
    files = sorted((FILES / "parquet").glob("*.parquet"))
    return ParquetClickData(
        [str(f) for f in files[:-1]],
        dense_columns=[f"dense_{i}" for i in range(13)],
        sparse_columns=[f"cat_{i}" for i in range(8)],
        label_column="label",
        weight_column="weight",
        val_paths=[str(files[-1])],
        batch_size=128,
        num_workers=2,
        num_embeddings_per_feature=[ROWS] * 8,
    )


def run(
    kind: str, tag: str, ckpt_path: Path | None = None, pipeline: str | None = None
) -> L.Trainer:
    L.seed_everything(11)
    data = make_data(kind)
    tables = len(data.num_embeddings_per_feature)
    model = tiny_dlrm(ROWS, tables, embedding_dim=4, dense_sizes=[8, 4], num_dense_features=13)
    recorder = Recorder()
    callbacks: list[Callback] = [recorder]
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(dirpath=OUT / f"{kind}_ckpts", every_n_train_steps=EVERY, save_top_k=-1)
        )
    trainer = cpu_trainer(
        TorchRecStrategy(constraints=table_wise(tables), pipeline=pipeline),  # type: ignore[arg-type]
        devices=2,
        max_steps=STEPS,
        limit_val_batches=0,
        log_every_n_steps=3,
        callbacks=callbacks,
        enable_checkpointing=ckpt_path is None,
        default_root_dir=OUT,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    info: dict[str, Any] = {
        "steps": recorder.steps,
        "batches_per_epoch": trainer.num_training_batches,
        "train_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    if ckpt_path is None:
        trainer = cpu_trainer(TorchRecStrategy(constraints=table_wise(tables)), devices=2)
        trainer.validate(model, datamodule=data, verbose=False)
        info["val"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        info["ckpts"] = sorted(p.name for p in (OUT / f"{kind}_ckpts").iterdir())
    torch.save(info, OUT / f"{kind}_{tag}_rank{trainer.global_rank}.pt")
    return trainer


def main() -> None:
    for kind in ("criteo", "parquet"):
        run(kind, "full")
        ckpts = OUT / f"{kind}_ckpts"
        for step in (EVERY, 3 * EVERY):
            (path,) = ckpts.glob(f"*step={step}.ckpt")
            run(kind, f"resume{step}", path)
            if kind == "parquet":  # a pipelined resume, then multi-worker loaders fork again
                run("parquet", f"piped_resume{step}", path, pipeline="sparse_dist")


if __name__ == "__main__":
    main()
