"""Pipelined and unpipelined training on 2 ranks (run as a script; Lightning relaunches it).

``python pipeline_ranks.py OUT``: the same model, data and seed trained with
``TorchRecStrategy(pipeline=None)``, ``pipeline="sparse_dist"``, ``"semi_sync"`` with a
``start_batch`` past the end (synchronous throughout: ``semi_sync_late``) and ``"semi_sync"``
from step ``SEMI_FROM`` for ``STEPS`` steps with validation every ``VAL_EVERY`` steps, then
predict the validation batches; each rank writes ``{tag}_rank{r}.pt`` with every step's loss,
the validation losses, the predictions and its local state at the end. Then the Trainer against
TorchRec's own pipelined loops (``torchrec_{pipeline}_rank{r}.pt``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from factory import QUIET, WIDE, table_wise, tiny_data, tiny_dlrm
from lightning.pytorch.callbacks import Callback
from rank_state import local_view

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.compat.pipelines import pipelined_modules

OUT = Path(sys.argv[1])
STEPS, VAL_EVERY, SEMI_FROM = 60, 20, 10


class Losses(Callback):
    def __init__(self) -> None:
        self.train: list[torch.Tensor] = []
        self.val: list[float] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        self.train.append(loss.detach().clone())

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.val.append(float(trainer.callback_metrics["val/loss"]))


def run(pipeline: str | None, options: dict[str, Any] | None = None, tag: str = "") -> None:
    L.seed_everything(5)
    data = tiny_data(50, 4, batch_size=64, train_batches=40, val_batches=4, ids_per_feature=2)
    model = tiny_dlrm(50, 4, **WIDE)
    losses = Losses()
    strategy = TorchRecStrategy(
        constraints=table_wise(4),
        fused_params={"learning_rate": 0.1},
        pipeline=pipeline,
        pipeline_options=options,
    )
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        max_steps=STEPS,
        val_check_interval=VAL_EVERY,
        callbacks=[losses],
        **QUIET,
    )
    trainer.fit(model, datamodule=data)
    training = getattr(strategy._runner.step, "driver", None)  # the fit's; predict builds its own
    preds = trainer.predict(model, dataloaders=data.val_dataloader())
    evaluating = strategy._runner.evaluation
    torch.save(
        {
            "train": losses.train,
            "val": losses.val,
            "state": local_view(model.state_dict()),
            "steps": trainer.global_step,
            "preds": preds,
            "eval_pipelined": len(pipelined_modules(evaluating._pipeline)) if evaluating else 0,
            "unpipelined": training.unpipelined() if training else None,
            "pipelined": len(pipelined_modules(training._pipeline)) if training else 0,
        },
        OUT / f"{tag or pipeline}_rank{trainer.global_rank}.pt",
    )


class CopyRawWeights(Callback):
    """Starts the Lightning model from the raw loop's weights; records each step's loss."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.losses: list[torch.Tensor] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        assert self.raw.copy_weights_to(pl_module) > 0

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach().clone())


def against_torchrec(pipeline: str = "sparse_dist", steps: int = 30) -> None:
    """The Trainer with ``pipeline=...`` against TorchRec's own pipelined loop.

    The raw loop (``benchmarks.harness.RawLoop``: DMP, dense Adam + fused row-wise Adagrad,
    ``ModelAndLoss``) is driven by ``TrainPipelineSparseDist.progress`` (or
    ``TrainPipelineSemiSync.progress`` from batch ``SEMI_FROM``, with the pipeline's CPU
    stream fixes) from the same starting weights over the same batches.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from benchmarks.common import ModelSize
    from benchmarks.harness import (
        FUSED,
        SEED,
        RawLoop,
        dataset,
        dlrm_module,
        rank_sampler,
        table_wise,
    )
    from lightning_torchrec.compat.pipelines import StagedSemiSync

    size = ModelSize.tiny()
    data = dataset(size, 2 * (steps + 4))
    data.prepare(list(rank_sampler(data, dist.get_rank(), dist.get_world_size())))
    L.seed_everything(SEED, verbose=False)
    raw = RawLoop(size, data)
    copy = CopyRawWeights(raw)
    options = {"start_batch": SEMI_FROM} if pipeline == "semi_sync" else None
    strategy = TorchRecStrategy(
        fused_params=FUSED,
        constraints=table_wise(size),
        pipeline=pipeline,  # type: ignore[arg-type]
        pipeline_options=options,
        log_plan=False,
    )
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=steps, callbacks=[copy], **QUIET)
    trainer.fit(dlrm_module(size), train_dataloaders=DataLoader(data, batch_size=None))
    cpu = torch.device("cpu")
    loop = (
        StagedSemiSync(raw.model, raw.optimizer, cpu, start_batch=SEMI_FROM)
        if pipeline == "semi_sync"
        else TrainPipelineSparseDist(raw.model, raw.optimizer, cpu)
    )
    raw_losses = [loop.progress(raw.batches)["loss"].detach().clone() for _ in range(steps)]
    torch.save(
        {"lightning": copy.losses, "torchrec": raw_losses},
        OUT / f"torchrec_{pipeline}_rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    run(None)
    run("sparse_dist")
    run("semi_sync", {"start_batch": 10_000}, "semi_sync_late")
    run("semi_sync", {"start_batch": SEMI_FROM})
    against_torchrec("sparse_dist")
    against_torchrec("semi_sync")
