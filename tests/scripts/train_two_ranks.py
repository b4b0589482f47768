"""A 2-rank Lightning run for the multi-process tests (run as a script; Lightning relaunches it).

Phases, all in one launch to pay the process start-up once:
1. ``trainer.validate`` before any training (shards the model; AUROC at initialisation);
2. ``trainer.fit`` with the same trainer for ``STEPS`` steps, checkpointing every ``CKPT_EVERY``
   steps; snapshots of each rank's local state at every save and at the end;
3. a fresh model and trainer resume from the first checkpoint; snapshot right after restore;
4. a fresh model and trainer run a standalone ``validate`` from the last checkpoint;
5. ``manual``: the same few steps with automatic and with manual optimization (``Manual``),
   recording each rank's losses and dense weights.

Each rank writes ``{phase}_rank{r}.pt`` files into the output directory given as argv[1].
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

# sibling module (script directory)
from factory import WIDE, adam, cpu_trainer, table_wise, tiny_data, tiny_dlrm
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from rank_state import local_view  # sibling module (script directory)

from lightning_torchrec import DLRMClickModule, TorchRecStrategy
from lightning_torchrec.training.optim import DenseAndFusedOptimizer

STEPS = 120
CKPT_EVERY = 60
OUT = Path(sys.argv[1])


def snapshot(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
    snap: dict[str, Any] = {"model": local_view(module.state_dict()), "step": trainer.global_step}
    if trainer.optimizers:
        opt = trainer.optimizers[0]
        assert isinstance(opt, DenseAndFusedOptimizer), type(opt)
        snap["optim"] = local_view(opt.state_dict()["state"])
        snap["lrs"] = [g["lr"] for g in opt.param_groups]
    return snap


class Recorder(Callback):
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.aurocs: list[float] = []

    def _save(self, name: str, obj: Any, trainer: L.Trainer) -> None:
        torch.save(obj, OUT / f"{name}_rank{trainer.global_rank}.pt")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(f"{self.tag}_fitstart", snapshot(trainer, pl_module), trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(f"{self.tag}_trainstart", snapshot(trainer, pl_module), trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, ckpt: dict) -> None:
        self._save(f"{self.tag}_saved{trainer.global_step}", snapshot(trainer, pl_module), trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        auroc = trainer.callback_metrics.get("val/auroc")
        if auroc is not None and not trainer.sanity_checking:
            self.aurocs.append(float(auroc))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(f"{self.tag}_end", snapshot(trainer, pl_module), trainer)


class Manual(DLRMClickModule):
    """Manual optimization of the combined optimizer: the automatic step, by hand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss, _ = self(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        loss = args[1]
        self.losses.append(float(loss["loss"] if isinstance(loss, dict) else loss))


def manual_phase(data: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in (DLRMClickModule, Manual):
        L.seed_everything(11)
        model = tiny_dlrm(data.num_embeddings_per_feature, cls=cls, **WIDE, **adam(1e-2))
        losses = Losses()
        strategy = TorchRecStrategy(constraints=table_wise(4), log_plan=False)
        trainer = cpu_trainer(strategy, devices=2, max_steps=4, limit_val_batches=0)
        trainer.callbacks.append(losses)
        trainer.fit(model, datamodule=data)
        dense = {k: v for k, v in local_view(model.state_dict()).items() if "arch.model" in k}
        out[cls.__name__] = {"losses": losses.losses, "dense": dense}
    return out


def make(tag: str, max_steps: int, ckpt: ModelCheckpoint | None = None):
    data = tiny_data(
        50, 4, ids_per_feature=2, batch_size=256, train_batches=400, val_batches=8, seed=3
    )
    model = tiny_dlrm(data.num_embeddings_per_feature, **WIDE, **adam(1e-2, halve_every=40))
    recorder = Recorder(tag)
    strategy = TorchRecStrategy(
        fused_params={"optimizer": _adagrad(), "learning_rate": 0.2}, constraints=table_wise(4)
    )
    trainer = cpu_trainer(
        strategy,
        devices=2,
        max_steps=max_steps,
        val_check_interval=CKPT_EVERY,
        callbacks=[recorder] + ([ckpt] if ckpt else []),
        enable_checkpointing=ckpt is not None,
        default_root_dir=OUT,
    )
    return data, model, trainer, recorder


def _adagrad() -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return EmbOptimType.EXACT_ROWWISE_ADAGRAD


def main() -> None:
    L.seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=OUT / "ckpts", every_n_train_steps=CKPT_EVERY, save_top_k=-1)
    data, model, trainer, recorder = make("fit", STEPS, ckpt)
    before = trainer.validate(model, datamodule=data, verbose=False)[0]["val/auroc"]
    trainer.fit(model, datamodule=data)
    rank = trainer.global_rank
    torch.save(
        {
            "auroc_before": before,
            "aurocs": recorder.aurocs,
            "plan": trainer.strategy.plan_summary,
            "ckpts": sorted(str(p) for p in (OUT / "ckpts").iterdir()),
        },
        OUT / f"fit_info_rank{rank}.pt",
    )
    first = OUT / "ckpts" / f"epoch=0-step={CKPT_EVERY}.ckpt"
    last = OUT / "ckpts" / f"epoch=0-step={STEPS}.ckpt"

    data, model, trainer, recorder = make("resume", CKPT_EVERY + 5)
    trainer.fit(model, datamodule=data, ckpt_path=first)

    data, model, trainer, recorder = make("validate", 1)
    auroc = trainer.validate(model, datamodule=data, ckpt_path=last, verbose=False)[0]["val/auroc"]
    torch.save({"auroc": auroc}, OUT / f"validate_info_rank{rank}.pt")
    torch.save(manual_phase(data), OUT / f"manual_rank{rank}.pt")


if __name__ == "__main__":
    main()
