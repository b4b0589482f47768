"""2-rank run with both norm callbacks, TensorBoard and CSV loggers, mixed sharding types.

At the end rank 0 gathers every full table (log_sharded_tensor_content) and saves the exact
values the callbacks should have logged at the last step; the test compares them with what the
loggers wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

# sibling module (script directory)
from factory import cpu_trainer, sharding_constraints, tiny_data, tiny_dlrm
from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_torchrec import (
    EmbeddingNormCallback,
    TorchRecStrategy,
    WeightNormCallback,
    log_sharded_tensor_content,
)
from lightning_torchrec.sharding.tables import embedding_tables

OUT = Path(sys.argv[1])
TYPES = {
    "t_cat_0": "table_wise",
    "t_cat_1": "table_wise",
    "t_cat_2": "column_wise",
    "t_cat_3": "data_parallel",
}


class SummaryCounts(Callback):
    """What the Trainer's ``ModelSummary`` callback would print, on every rank."""

    counts: dict[str, int] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (printer,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
        summary = printer._summary(trainer, pl_module)
        self.counts = dict(zip(summary.layer_names, summary.param_nums, strict=True))
        self.counts["total"] = summary.total_parameters


def main() -> None:
    L.seed_everything(1)
    data = tiny_data(64, 4, ids_per_feature=2, batch_size=32, train_batches=40)
    model = tiny_dlrm(data.num_embeddings_per_feature, embedding_dim=8, over_sizes=[8, 1])
    unsharded = {n: sum(p.numel() for p in m.parameters()) for n, m in model.named_modules()}
    summary = SummaryCounts()
    strategy = TorchRecStrategy(constraints=sharding_constraints(TYPES, min_partition=4))
    trainer = cpu_trainer(
        strategy,
        devices=2,
        max_steps=10,
        log_every_n_steps=5,
        limit_val_batches=0,
        logger=[TensorBoardLogger(OUT, name="tb"), CSVLogger(OUT, name="csv")],
        callbacks=[WeightNormCallback(), EmbeddingNormCallback(sample_size=1_000_000), summary],
        enable_model_summary=True,
    )
    trainer.fit(model, datamodule=data)
    expected: dict[str, float] = {}
    plan = None
    for key, table in embedding_tables(model).items():
        name = key.split(".")[-2]
        full = log_sharded_tensor_content(key, name, table)
        if trainer.is_global_zero:
            assert full is not None
            expected[f"model/l2_norm/{key}"] = float(full.norm())
            expected[f"embedding_norms/{name}-norm-mean"] = float(full.norm(dim=1).mean())
    if trainer.is_global_zero:
        for n, p in model.named_parameters():
            if "embedding_bags" not in n:
                expected[f"model/l2_norm/{n}"] = float(p.detach().norm())
        plan = {t.table: (t.sharding_type, t.ranks) for t in trainer.strategy.plan_summary.tables}
    torch.save(
        {
            "expected": expected,
            "plan": plan,
            "step": trainer.global_step,
            "unsharded": unsharded,
            "summary": summary.counts,
        },
        OUT / f"expected{'' if trainer.is_global_zero else '.rank1'}.pt",
    )


if __name__ == "__main__":
    main()
