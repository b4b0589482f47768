"""2 ranks: a managed-collision EmbeddingCollection takes raw 64-bit ids, trains row-wise, and a
sharded checkpoint resumes its remapping state and table bit for bit.

One launch (run as a script; Lightning relaunches it per rank). argv[1]: the output directory.
Phases:

1. ``full``: ``STEPS`` steps with a checkpoint at ``STOP``;
2. ``resumed``: a fresh model resumes that checkpoint and runs to ``STEPS``.

Both record, after every step, the loss and this rank's local state (its row-wise shard of each
table, the MCH modules' buffers: sorted raw ids, their rows, LFU counts), plus the open slots of
each table's shard; each rank writes ``{run}_rank{r}.pt``. ``ManagedCollisionStatsCallback``
logs every step to a capturing logger (rank 0 keeps what it wrote; every rank keeps its last
values). The fused optimizer is ``exact_sgd``:
with row-wise Adagrad, an admission resets the row's optimizer state through an fbgemm operator
that has no CPU kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from factory import cpu_trainer  # sibling module (script directory)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import (
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import ManagedCollisionStatsCallback, SyntheticClickData, TorchRecStrategy
from lightning_torchrec.compat.upstream import ShardedTensor
from lightning_torchrec.data.batch import Batch
from lightning_torchrec.data.synthetic import SyntheticClickDataset
from lightning_torchrec.lightning.module import TorchRecModule
from lightning_torchrec.models.model_and_loss import ModelAndLoss

OUT = Path(sys.argv[1])
STEPS, STOP = 8, 4
ROWS, ZCH, DIM, FEATURES = 200, 32, 4, 2  # 200 distinct ids per feature for 32 rows: evictions
#: Odd, so ``id -> id * MULT mod 2**40`` is one-to-one: the ids spread over [0, 2**40).
MULT, SPAN = 0x9E3779B97F4A7C15 % 2**40 | 1, 2**40


class RawIds(SyntheticClickDataset):
    def __getitem__(self, index: int) -> Batch:
        b = super().__getitem__(index)
        kjt = b.sparse_features
        raw = ((kjt.values() + 1) * MULT) % SPAN
        return Batch(
            b.dense_features,
            KeyedJaggedTensor(keys=kjt.keys(), values=raw, lengths=kjt.lengths()),
            b.labels,
        )


class RawIdData(SyntheticClickData):
    def dataset(self, split: str) -> RawIds:
        d = super().dataset(split)
        return RawIds(
            d.num_embeddings_per_feature,
            num_batches=d.num_batches,
            batch_size=d.batch_size,
            num_dense_features=d.num_dense_features,
            ids_per_feature=d.ids_per_feature,
            seed=d.seed,
            split=split,
            signal_strength=d.signal_strength,
        )


class MCClick(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingConfig(
                name=f"t_cat_{i}",
                embedding_dim=DIM,
                num_embeddings=ZCH,
                feature_names=[f"cat_{i}"],
                # Evicted rows are re-initialised with init_fn; a random one draws from the
                # global RNG, which the checkpoint does not hold, so resume would part there.
                init_fn=nn.init.zeros_,
            )
            for i in range(FEATURES)
        ]
        mc = ManagedCollisionCollection(
            {
                t.name: MCHManagedCollisionModule(
                    zch_size=ZCH,
                    device=torch.device("cpu"),
                    eviction_policy=LFU_EvictionPolicy(),
                    eviction_interval=2,
                    input_hash_size=SPAN,  # the raw-id range, split evenly over the ranks
                    buckets=2,
                    name=t.name,
                )
                for t in tables
            },
            tables,
        )
        self.mc_ec = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables, device=torch.device("meta")), mc
        )
        self.over = nn.Linear(13 + FEATURES * DIM, 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out, _ = self.mc_ec(kjt)
        pooled = []
        for f in range(FEATURES):
            jt = out[f"cat_{f}"]
            lens = jt.lengths()
            sample = torch.repeat_interleave(torch.arange(len(lens)), lens)
            sums = torch.zeros(len(lens), DIM).index_add_(0, sample, jt.values())
            pooled.append(sums / lens.clamp_min(1).unsqueeze(1))
        return self.over(torch.cat([dense, *pooled], dim=1)).squeeze(1)


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

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps[trainer.global_step] = {
            "loss": outputs["loss"].detach().clone(),
            "state": local_state(pl_module),
            "open_slots": open_slots(pl_module),
        }


class Capture(Logger):
    """Keeps every logged metric: ``{step: {name: value}}``."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.setdefault(int(step or 0), {}).update(metrics)


def run(ckpt: Path | None = None) -> tuple[L.Trainer, Recorder]:
    L.seed_everything(3)
    data = RawIdData(
        num_embeddings=ROWS, num_sparse_features=FEATURES, batch_size=32, train_batches=16
    )
    model = TorchRecModule(
        ModelAndLoss(MCClick()), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2)
    )
    strategy = TorchRecStrategy(
        constraints={
            f"t_cat_{i}": ParameterConstraints(sharding_types=["row_wise"]) for i in range(FEATURES)
        },
        fused_params={"optimizer": "exact_sgd", "learning_rate": 0.1},
        log_plan=False,
    )
    recorder = Recorder()
    callbacks: list[Callback] = [recorder, ManagedCollisionStatsCallback(every_n_steps=1)]
    if ckpt is None:
        callbacks.append(
            ModelCheckpoint(dirpath=OUT / "ckpt", every_n_train_steps=STOP, save_top_k=-1)
        )
    trainer = cpu_trainer(
        strategy,
        devices=2,
        max_steps=STEPS,
        limit_val_batches=0,
        callbacks=callbacks,
        enable_checkpointing=ckpt is None,
        default_root_dir=OUT,
        logger=Capture(),
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
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
    ckpt = next((OUT / "ckpt").glob(f"*step={STOP}.ckpt"))
    trainer, recorder = run(ckpt)
    torch.save({"steps": recorder.steps, **logged(trainer)}, OUT / f"resumed_rank{rank}.pt")


if __name__ == "__main__":
    main()
