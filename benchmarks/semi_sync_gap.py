"""Benchmark: how far semi-sync training drifts from synchronous training.

On 2 gloo ranks, the demo DLRM on the demo's synthetic clicks (same seed, data and optimizers),
trained ``--steps`` steps with ``pipeline=None`` and with ``pipeline="semi_sync"`` from step
``--start`` (the tables are read one update late from there), then validated. Reports the
per-step loss gap (max and mean of |semi - sync|, and of the 20-step moving averages) and the
validation metrics of both. Run: ``python -m benchmarks.semi_sync_gap``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from benchmarks.common import RESULTS, write_result

SEED = 1234


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        self.losses.append(float(loss.detach()))


def train(pipeline: str | None, steps: int, start: int, quick: bool) -> dict[str, Any]:
    """One fit and validation; the per-step losses (this rank) and validation metrics."""
    from lightning_torchrec import DLRMClickModule, SyntheticClickData, TorchRecStrategy

    L.seed_everything(SEED, verbose=False)
    # The demo's model and data (``make demo``): 8 tables of 200 rows, 2 ids per feature.
    tables, batch = (4, 64) if quick else (8, 512)
    data = SyntheticClickData(
        num_embeddings=200,
        num_sparse_features=tables,
        ids_per_feature=2,
        batch_size=batch,
        train_batches=steps * 2,
        val_batches=4 if quick else 20,
        seed=SEED,
    )
    model = DLRMClickModule([200] * tables, train_metrics_every_n_steps=0)
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TorchRecStrategy(
            fused_params={"learning_rate": 0.1},  # the demo's
            pipeline=pipeline,  # type: ignore[arg-type]
            pipeline_options={"start_batch": start} if pipeline else None,
            log_plan=False,
        ),
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tempfile.mkdtemp(prefix="bench_semi_"),
        callbacks=[losses],
    )
    trainer.fit(model, datamodule=data)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TorchRecStrategy(log_plan=False),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(model, datamodule=data, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    return {"losses": losses.losses, "val": metrics}


def moving(values: torch.Tensor, window: int) -> torch.Tensor:
    """Moving averages over ``window`` steps."""
    return values.unfold(0, window, 1).mean(dim=1)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--start", type=int, default=0, help="semi-sync from this step")
    args = p.parse_args(argv)
    steps = 12 if args.quick else args.steps
    torch.set_num_threads(1)
    sync = train(None, steps, args.start, args.quick)
    semi = train("semi_sync", steps, args.start, args.quick)
    a, b = torch.tensor(sync["losses"]), torch.tensor(semi["losses"])
    gap = (a - b).abs()
    window = min(20, steps)
    smooth = (moving(a, window) - moving(b, window)).abs()
    result: dict[str, Any] = {
        "world_size": 2,
        "steps": steps,
        "semi_sync_from_step": args.start,
        "rank0_loss_gap": {
            "max": float(gap.max()),
            "mean": float(gap.mean()),
            "max_moving_average": float(smooth.max()),
            "moving_average_window": window,
            "mean_loss_sync": float(a.mean()),
        },
        "last_window_mean_loss": {
            "sync": float(a[-window:].mean()),
            "semi_sync": float(b[-window:].mean()),
        },
        "val": {"sync": sync["val"], "semi_sync": semi["val"]},
    }
    if dist.get_rank() != 0:
        return None
    write_result("semi_sync_gap", result, args.out)
    return result


if __name__ == "__main__":
    main()
