"""2 ranks: a managed-collision EmbeddingCollection takes raw 64-bit ids, trains row-wise, and a
sharded checkpoint resumes its remapping state and table bit for bit.

One launch (run as a script; Lightning relaunches it per rank). argv[1]: the output directory;
argv[2]: a checkpoint of the same model written by one rank. Phases:

1. ``full``: ``STEPS`` steps with a checkpoint at ``STOP``;
2. ``from_one_rank``: a fresh model loads the one-rank checkpoint; records what each rank raised
   and its local state after (nothing may have been loaded);
3. ``resumed``: a fresh model resumes the step-``STOP`` checkpoint and runs to ``STEPS``.

``full`` and ``resumed`` record, after every step, the loss and this rank's local state (its
row-wise shard of each table, the MCH modules' buffers: sorted raw ids, their rows, LFU counts),
plus the open slots of each table's shard, and the id -> embedding mapping (``mc_model.lookup``)
at ``STOP`` (for ``resumed``: as it starts); each rank writes ``{run}_rank{r}.pt``.
``ManagedCollisionStatsCallback`` logs every step to a capturing logger (rank 0 keeps what it
wrote; every rank keeps its last values). The fused optimizer is ``exact_sgd``:
with row-wise Adagrad, an admission resets the row's optimizer state through an fbgemm operator
that has no CPU kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from factory import Capture, cpu_trainer  # sibling module (script directory)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from mc_model import STEPS, STOP, data, lookup, module, strategy  # sibling module
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from lightning_torchrec import ManagedCollisionStatsCallback
from lightning_torchrec.compat.upstream import ShardedTensor
from lightning_torchrec.errors import ManagedCollisionLayoutError

OUT = Path(sys.argv[1])


def local_state(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in module.state_dict().items():
        if isinstance(v, ShardedTensor):
            v = torch.cat([s.tensor for s in v.local_shards()]) if v.local_shards() else None
        elif isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
    return out


def open_slots(module: nn.Module) -> dict[str, int]:
    return {
        name.rsplit(".", 1)[-1]: int(m.open_slots())
        for name, m in module.named_modules()
        if isinstance(m, MCHManagedCollisionModule)
    }


class Recorder(Callback):
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.steps[trainer.global_step] = {"state": local_state(pl_module)}
        if trainer.global_step == STOP:  # resumed: the mapping it starts from (eval forward)
            self.steps[STOP]["lookup"] = lookup(pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps[trainer.global_step] = {
            "loss": outputs["loss"].detach().clone(),
            "state": local_state(pl_module),
            "open_slots": open_slots(pl_module),
        }
        if trainer.global_step == STOP:  # an eval forward: admits nothing, evicts nothing
            self.steps[STOP]["lookup"] = lookup(pl_module)


def run(ckpt: Path | None = None, model: Any = None) -> tuple[L.Trainer, Recorder]:
    L.seed_everything(3)
    recorder = Recorder()
    callbacks: list[Callback] = [recorder, ManagedCollisionStatsCallback(every_n_steps=1)]
    if ckpt is None:
        callbacks.append(
            ModelCheckpoint(dirpath=OUT / "ckpt", every_n_train_steps=STOP, save_top_k=-1)
        )
    trainer = cpu_trainer(
        strategy(),
        devices=2,
        max_steps=STEPS,
        limit_val_batches=0,
        callbacks=callbacks,
        enable_checkpointing=ckpt is None,
        default_root_dir=OUT,
        logger=Capture(),
    )
    trainer.fit(module() if model is None else model, datamodule=data(), ckpt_path=ckpt)
    return trainer, recorder


def logged(trainer: L.Trainer) -> dict[str, Any]:
    stats = next(c for c in trainer.callbacks if isinstance(c, ManagedCollisionStatsCallback))
    assert isinstance(trainer.logger, Capture)
    return {"logged": trainer.logger.metrics, "last": stats.last_values}


def main() -> None:
    trainer, recorder = run()
    rank = trainer.global_rank
    summary = trainer.strategy.plan_summary
    torch.save(
        {"steps": recorder.steps, "plan": summary, **logged(trainer)}, OUT / f"full_rank{rank}.pt"
    )
    model = module()
    try:  # another world size: refused on every rank before anything is read
        run(Path(sys.argv[2]), model)
        refused: dict[str, Any] = {"error": None}
    except ManagedCollisionLayoutError as err:
        refused = {"error": type(err).__name__, "message": str(err)}
    refused["state"] = local_state(model)
    torch.save(refused, OUT / f"from_one_rank_rank{rank}.pt")
    ckpt = next((OUT / "ckpt").glob(f"*step={STOP}.ckpt"))
    trainer, recorder = run(ckpt)
    torch.save({"steps": recorder.steps, **logged(trainer)}, OUT / f"resumed_rank{rank}.pt")


if __name__ == "__main__":
    main()
