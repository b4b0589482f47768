"""Exact resume and resharding on 2 ranks (run as a script; Lightning relaunches it).

Phases, all in one launch:
1. ``full``: 30 uninterrupted steps (3 epochs of 10 steps per rank), a checkpoint at each epoch end;
2. ``part``: a fresh run stopped after 20 steps (its epoch-end checkpoint is the resume point);
3. ``resume``: a fresh model and trainer resume that checkpoint and run to step 30;
4. ``cw``: a fresh model under a column-wise plan restores the table-wise checkpoint (weights
   only: ``load_optimizer_states=False``); loading its optimizer state too is attempted directly;
   the plain weights consolidated from the checkpoint are loaded into it as well;
5. ``kernels``: a model whose two tables pool differently (TorchRec gives each its own fused
   kernel on a rank holding both), with a ``LambdaLR`` on both optimizers, saves after 4 steps
   with both tables on rank 1 (rank 0 drives no kernel: it saves no fused hyper-parameters, no
   step counter, and a scheduler state of one group), then resumes with one table per rank to
   step 6 (``kernels_resume``); ``kernels.ckpt`` is also resumed on one rank by the test;
6. ``own``: the same tables, one per rank, each given an SGD of its own learning rate
   (``apply_optimizer_in_backward``, :data:`OWN_LRS`), save after 4 steps and resume to step 6
   (``own_resume``); ``own.ckpt`` is also resumed on one rank by the test.

Per-step losses, learning rates (dense, and the one each fused kernel uses) and local state
snapshots go to ``{phase}_*_rank{r}.pt`` in argv[1].
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

# sibling module (script directory)
from factory import (
    WIDE,
    adam,
    cpu_trainer,
    pooled_module,
    pooled_plan,
    table_wise,
    tiny_data,
    tiny_dlrm,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from rank_state import kernel_lrs, local_view  # sibling module (script directory)

from lightning_torchrec import DLRMClickModule, TorchRecStrategy
from lightning_torchrec.checkpoint import load_sharded
from lightning_torchrec.checkpoint.consolidate import consolidate, load_plain_weights
from lightning_torchrec.errors import CheckpointMismatchError
from lightning_torchrec.training.optim import optimizer_steps

OUT = Path(sys.argv[1])
#: The learning rates of the ``own`` phase's tables' own optimizers (t_cat_0, t_cat_1).
OWN_LRS = (0.1, 0.02)
TABLES = 4
EPOCHS, STOP_EPOCHS = 3, 2  # 10 steps per epoch and rank
STOP = 20
EBC = "model_and_loss.model.sparse_arch.embedding_bag_collection"


def snapshot(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
    snap: dict[str, Any] = {"model": local_view(module.state_dict()), "step": trainer.global_step}
    if trainer.optimizers:
        opt = trainer.optimizers[0]
        snap["optim"] = local_view(opt.state_dict()["state"])
        snap["lrs"] = [g["lr"] for g in opt.param_groups]
        snap["optimizer_steps"] = optimizer_steps(opt)
    return snap


class Recorder(Callback):
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.steps: dict[int, dict[str, Any]] = {}
        self.batches: dict[int, tuple[int, int, float]] = {}

    def _save(self, name: str, obj: Any, trainer: L.Trainer) -> None:
        torch.save(obj, OUT / f"{self.tag}_{name}_rank{trainer.global_rank}.pt")

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        opt = trainer.optimizers[0]
        self.steps[trainer.global_step + 1] = {
            "loss": loss.detach().clone(),
            "dense_lr": opt.param_groups[0]["lr"],
            "kernel_lrs": kernel_lrs(opt.fused),
        }

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batches[trainer.global_step + 1] = (
            trainer.current_epoch,
            batch_idx,
            float(batch.dense_features.sum()),
        )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save("start", snapshot(trainer, pl_module), trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save("end", snapshot(trainer, pl_module), trainer)
        self._save("steps", self.steps, trainer)
        self._save("batches", self.batches, trainer)


def make(tag: str, max_epochs: int, ckpt: ModelCheckpoint | None = None, **strategy: Any):
    L.seed_everything(11)
    data = tiny_data(40, TABLES, ids_per_feature=2, batch_size=64, train_batches=20, seed=5)
    model = tiny_dlrm(data.num_embeddings_per_feature, **WIDE, **adam(1e-2, halve_every=STOP))
    if "plan" not in strategy:
        strategy["constraints"] = table_wise(TABLES)
    recorder = Recorder(tag)
    trainer = cpu_trainer(
        TorchRecStrategy(fused_params={"learning_rate": 0.1}, log_plan=False, **strategy),
        devices=2,
        max_epochs=max_epochs,
        limit_val_batches=0,
        callbacks=[recorder] + ([ckpt] if ckpt else []),
        enable_checkpointing=ckpt is not None,
        default_root_dir=OUT,
    )
    return data, model, trainer


def epoch_checkpoints(name: str) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=OUT / name, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
    )


def column_wise_plan(model: DLRMClickModule) -> Any:
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    ebc = model.get_submodule(EBC)
    per_table = {
        f"t_cat_{i}": column_wise(ranks=[0, 1], compute_kernel="fused") for i in range(TABLES)
    }
    return ShardingPlan(
        {EBC: construct_module_sharding_plan(ebc, per_table, world_size=2, device_type="cpu")}
    )


def pooled_run(
    tag: str, ranks: list[int], steps: int, world: int = 2, own_lrs: tuple[float, ...] = ()
) -> tuple[Any, Any, Any]:
    L.seed_everything(11)
    data = tiny_data(40, 2, batch_size=16, train_batches=8, seed=2)
    module = pooled_module(own_lrs)
    trainer = cpu_trainer(
        TorchRecStrategy(
            plan=pooled_plan(module, ranks, world),
            fused_params=None if own_lrs else {"learning_rate": 0.1},
            log_plan=False,
        ),
        devices=world,
        max_steps=steps,
        limit_val_batches=0,
        callbacks=[Recorder(tag)],
        default_root_dir=OUT,
    )
    return data, module, trainer


def main() -> None:
    data, model, trainer = make("full", EPOCHS, epoch_checkpoints("full"))
    trainer.fit(model, datamodule=data)

    data, model, trainer = make("part", STOP_EPOCHS, epoch_checkpoints("part"))
    trainer.fit(model, datamodule=data)
    ckpt = OUT / "part" / f"epoch=1-step={STOP}.ckpt"

    data, model, trainer = make("resume", EPOCHS)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)

    rank = trainer.global_rank
    plain = OUT / "plain.safetensors"
    if rank == 0:
        consolidate(ckpt, plain)
    trainer.strategy.barrier()

    # Column-wise: restore (no steps: already at max_epochs) from the table-wise checkpoint.
    data, model, _ = make("cw", 1)
    data, model, trainer = make(
        "cw", STOP_EPOCHS, plan=column_wise_plan(model), load_optimizer_states=False
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    info: dict[str, Any] = {"plan": trainer.strategy.plan_summary}
    info["restored"] = snapshot(trainer, model)
    try:
        load_sharded(ckpt, model, [trainer.optimizers[0]])
        info["optimizer_load"] = "ok"
        info["after_optimizer_load"] = snapshot(trainer, model)
    except CheckpointMismatchError as err:
        info["optimizer_load"] = str(err)
    with torch.no_grad():
        for value in model.state_dict().values():
            for shard in getattr(value, "local_shards", list)():
                shard.tensor.zero_()
    info["plain_keys"] = load_plain_weights(model, plain)
    info["after_plain"] = snapshot(trainer, model)
    torch.save(info, OUT / f"cw_info_rank{rank}.pt")

    data, module, trainer = pooled_run("kernels_save", [1, 1], 4)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(OUT / "kernels.ckpt")
    data, module, trainer = pooled_run("kernels_resume", [0, 1], 6)
    trainer.fit(module, datamodule=data, ckpt_path=OUT / "kernels.ckpt")

    data, module, trainer = pooled_run("own_save", [0, 1], 4, own_lrs=OWN_LRS)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(OUT / "own.ckpt")
    data, module, trainer = pooled_run("own_resume", [0, 1], 6, own_lrs=OWN_LRS)
    trainer.fit(module, datamodule=data, ckpt_path=OUT / "own.ckpt")


if __name__ == "__main__":
    main()
