"""Checkpoints of one demo-like DLRM saved on 1, 2 and 3 ranks, for the export tests.

``python export_ranks.py OUT 2`` trains on 2 ranks (``t_cat_0`` column-wise, the other tables
table-wise) and saves ``OUT/ckpt_w2``. ``python export_ranks.py OUT W OUT/ckpt_w2`` (W = 1 or 3)
restores that checkpoint on W ranks under another plan (DCP reshards) without training further
and saves the same weights as ``OUT/ckpt_w{W}``. Lightning relaunches the script once per rank;
the tests call ``save(out, 1, source)`` in their own process instead of launching one rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L

from lightning_torchrec import TorchRecStrategy

try:  # run as a script: the sibling module
    from factory import adam, cpu_trainer, sharding_constraints, tiny_data, tiny_dlrm
except ImportError:  # imported by the tests (the 1-rank save runs in the test process)
    from tests.scripts.factory import adam, cpu_trainer, sharding_constraints, tiny_data, tiny_dlrm
#: Demo-like: tables of 200 rows, width 16, DLRM [64, 16] / [64, 1], 13 dense features.
ROWS, TABLES, DIM = 200, 4, 16
STEPS = 300


def data() -> L.LightningDataModule:
    return tiny_data(
        ROWS, TABLES, ids_per_feature=2, batch_size=128, train_batches=2 * STEPS, seed=0
    )


def save(out: Path, world: int, source: Path | None = None) -> Path:
    """Trains (``source`` None) or restores ``source`` on ``world`` ranks and saves.

    Returns:
        The checkpoint directory ``out/ckpt_w{world}``.
    """
    L.seed_everything(0, verbose=False)
    model = tiny_dlrm(
        ROWS, TABLES, embedding_dim=DIM, dense_sizes=[64, DIM], over_sizes=[64, 1], **adam(1e-2)
    )
    types = {f"t_cat_{i}": "table_wise" for i in range(TABLES)}
    if world > 1:
        types["t_cat_0"] = "column_wise"
    trainer = cpu_trainer(
        TorchRecStrategy(
            fused_params={"learning_rate": 0.3},
            constraints=sharding_constraints(types),
            log_plan=False,
        ),
        devices=world,
        max_steps=STEPS,
        limit_val_batches=0,
        default_root_dir=out,
    )
    trainer.fit(model, datamodule=data(), ckpt_path=source)
    trainer.save_checkpoint(out / f"ckpt_w{world}")
    return out / f"ckpt_w{world}"


if __name__ == "__main__":
    save(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)
