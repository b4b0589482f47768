"""2 ranks: the sequence model trains, resumes mid-epoch exactly and reshards its item table.

One launch (run as a script; Lightning relaunches it per rank). argv[1]: the output directory
(it holds the generated ``ratings.dat``). Phases:

1. ``full``: table-wise, ``STEPS`` steps over two epochs, a checkpoint at ``STOP`` (mid second
   epoch), then ``validate`` (the loss, recall@10 and NDCG@10 over both ranks, which hold
   different numbers of users);
2. ``rw``: a fresh model constrained to row-wise sharding resumes that checkpoint (optimizer
   state too) and runs to ``STEPS``;
3. ``cw``: a fresh model under a column-wise plan (two column shards) resumes it with
   ``load_optimizer_states=False`` and runs to ``STEPS``;
4. ``long``: a fresh fit in which rank 1's second batch holds a history longer than
   ``max_length``: each rank records the error it stopped with.

Every run records per-step losses and the whole item table (looked up through the sharded
collection, so it does not depend on the plan) after each step and at the start; each rank writes
``{run}_rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from factory import cpu_trainer  # sibling module (script directory)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
from torchrec.distributed.types import ShardingPlan

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.data.movielens import write_cycle_ratings
from lightning_torchrec.data.sequence_batch import sequence_batch
from lightning_torchrec.data.sequences import MovieLensSequenceData
from lightning_torchrec.lightning.sequence import SASRecModule

OUT = Path(sys.argv[1])
STEPS, STOP = 10, 7  # 5 steps per epoch and rank: the checkpoint is mid second epoch
EC = "model_and_loss.model.item_embeddings"


def whole_table(module: SASRecModule) -> torch.Tensor:
    """Every item's row, looked up through the (sharded) collection: plan-independent."""
    n = module.hparams["num_items"]
    batch = sequence_batch([np.arange(n)], np.zeros(1, dtype=np.int64), np.zeros(0, np.int64))
    with torch.no_grad():
        ec = module.get_submodule(EC)
        return ec(batch.sparse_features)["item_seq"].values().detach().clone()


class Recorder(Callback):
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.steps[trainer.global_step] = {"table": whole_table(pl_module), "start": True}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps[trainer.global_step] = {
            "loss": outputs["loss"].detach().clone(),
            "batch": batch.sparse_features.values().clone(),
            "table": whole_table(pl_module),
            "dense": {k: v.detach().clone() for k, v in pl_module.named_parameters()},
        }


def column_wise_plan(model: SASRecModule) -> ShardingPlan:
    gen = column_wise(ranks=[0, 1], compute_kernel="fused")
    ec = model.get_submodule(EC)
    return ShardingPlan(
        {EC: construct_module_sharding_plan(ec, {"t_item": gen}, world_size=2, device_type="cpu")}
    )


def run(tag: str, ckpt: Path | None = None) -> tuple[L.Trainer, SASRecModule, Recorder]:
    L.seed_everything(3)
    data = MovieLensSequenceData(str(OUT / "ratings.dat"), max_length=8, batch_size=16)
    model = SASRecModule(
        data.num_items,
        embedding_dim=8,
        max_length=8,
        num_heads=2,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
    )
    if tag == "cw":
        strategy = TorchRecStrategy(
            plan=column_wise_plan(model), log_plan=False, load_optimizer_states=False
        )
    else:
        kind = "row_wise" if tag == "rw" else "table_wise"
        strategy = TorchRecStrategy(
            constraints={"t_item": ParameterConstraints(sharding_types=[kind])}, log_plan=False
        )
    recorder = Recorder()
    callbacks: list[Callback] = [recorder]
    if ckpt is None:
        callbacks.append(
            ModelCheckpoint(dirpath=OUT / "ckpt", every_n_train_steps=STOP, save_top_k=-1)
        )
    trainer = cpu_trainer(
        strategy,
        devices=2,
        max_steps=STEPS,
        limit_val_batches=None,
        val_check_interval=None,
        check_val_every_n_epoch=100,
        callbacks=callbacks,
        enable_checkpointing=ckpt is None,
        default_root_dir=OUT,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    return trainer, model, recorder


class LongHistoryOnRankOne(L.LightningDataModule):
    """Three batches per rank; rank 1's second holds a 12-item history (``max_length`` is 8)."""

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        rng = np.random.default_rng(rank)
        batches = []
        for step in range(3):
            longest = 12 if step == 1 and rank == 1 else 4
            histories = [rng.integers(0, 40, longest if i == 0 else 4) for i in range(4)]
            batches.append(
                sequence_batch(histories, rng.integers(0, 40, 4), rng.integers(0, 40, 10))
            )
        return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def long_history() -> dict[str, Any]:
    L.seed_everything(3)
    model = SASRecModule(40, embedding_dim=8, max_length=8, num_heads=2)
    trainer = cpu_trainer(
        TorchRecStrategy(log_plan=False),
        devices=2,
        max_steps=3,
        limit_val_batches=0,
        enable_checkpointing=False,
        default_root_dir=OUT,
        use_distributed_sampler=False,
    )
    result: dict[str, Any] = {"error": None, "message": ""}
    try:
        trainer.fit(model, datamodule=LongHistoryOnRankOne())
    except Exception as e:  # recorded for the parent's assertions
        result = {"error": type(e).__name__, "message": str(e)}
    result["global_step"] = trainer.global_step
    return result


def main() -> None:
    if os.environ.get("LOCAL_RANK", "0") == "0" and not (OUT / "ratings.dat").exists():
        write_cycle_ratings(OUT / "ratings.dat", num_users=160, num_items=40, max_length=20)
    trainer, model, recorder = run("full")
    rank = trainer.global_rank
    # Evaluation batches of 60: rank 0 gets 100 users, rank 1 60 and then a padding sample.
    data = MovieLensSequenceData(
        str(OUT / "ratings.dat"), max_length=8, batch_size=16, eval_batch_size=60
    )
    metrics = trainer.validate(model, datamodule=data, verbose=False)
    # This rank's own val ranks and losses, run again outside Lightning: the test combines
    # both ranks'.
    with torch.no_grad():
        results = [model(batch) for batch in data.dataset("val")]
    outputs = [o for _, o in results]
    torch.save(
        {
            "steps": recorder.steps,
            "plan": trainer.strategy.plan_summary,
            "val": metrics[0],
            "val_ranks": torch.cat([o["ranks"] for o in outputs]),
            "val_weights": torch.cat([o["weights"] for o in outputs]),
            "val_losses": torch.stack([loss.double() for loss, _ in results]),
            "val_loss_weights": torch.stack([o["loss_weight"].double() for o in outputs]),
        },
        OUT / f"full_rank{rank}.pt",
    )
    ckpt = next((OUT / "ckpt").glob(f"*step={STOP}.ckpt"))
    for tag in ("rw", "cw"):
        trainer, model, recorder = run(tag, ckpt)
        torch.save(
            {"steps": recorder.steps, "plan": trainer.strategy.plan_summary},
            OUT / f"{tag}_rank{rank}.pt",
        )
    torch.save(long_history(), OUT / f"long_rank{rank}.pt")


if __name__ == "__main__":
    main()
    # The failed last phase leaves gloo's threads behind: shut the group down before the exit
    # (as tests/scripts/faults_two_ranks.py does).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
