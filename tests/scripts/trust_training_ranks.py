"""2-rank phases for the training promises (run as a script; Lightning relaunches it per rank).

``python trust_training_ranks.py OUT``; each phase writes ``{phase}_rank{r}.pt`` into OUT:

* ``order``: a model reading ``ebc(kjt).values()`` positionally trains under a plan mixing
  data-parallel, table-wise and column-wise tables, saves ``order.ckpt``, and predicts 4 held-out
  batches (2 per rank); the test predicts them again on one rank under another plan.
* ``weighted``: rank 1 feeds a KJT without weights to a weighted EBC at step 1.
* ``custom_norm``: ``WeightNormCallback`` with a per-rank callable writes to a CSV logger.
* ``uneven_sized``/``uneven_iterable``/``uneven_val``/``predict_uneven``: ranks get different
  numbers of batches (sized loaders, an iterable dataset, validation, predict);
  ``uneven_val_unchecked``: iterable validation data with ``validate_batches=False``.
* ``refit``: a second ``Trainer.fit`` on the same module (a fine-tune stage).
* ``ec``: an ``EmbeddingCollection`` model with the default plan on CPU.
* ``no_fused``: only data-parallel tables and a dense scheduler: no fused-LR warning.
"""

from __future__ import annotations

import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from factory import QUIET, table_wise, tiny_data, tiny_dlrm
from lightning.pytorch.loggers import CSVLogger
from positional import ROWS, Positional, data
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchrec import EmbeddingCollection
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import Batch, TorchRecStrategy, WeightNormCallback, dense_parameters

OUT = Path(sys.argv[1])
MIXED = {
    "t_cat_0": ParameterConstraints(sharding_types=["data_parallel"]),
    "t_cat_1": ParameterConstraints(sharding_types=["table_wise"]),
    "t_cat_2": ParameterConstraints(sharding_types=["column_wise"], min_partition=4),
    "t_cat_3": ParameterConstraints(sharding_types=["table_wise"]),
}


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def record(phase: str, **values: Any) -> None:
    torch.save(values, OUT / f"{phase}_rank{rank()}.pt")


def trainer(strategy: TorchRecStrategy, **kwargs: Any) -> L.Trainer:
    return L.Trainer(strategy=strategy, devices=2, **(QUIET | kwargs))


def expect_error(phase: str, run: Callable[[], Any]) -> None:
    """Runs a phase; an exception is recorded (type, message, time) instead of raised."""
    start = time.perf_counter()
    try:
        run()  # records its own results when it succeeds
        if not (OUT / f"{phase}_rank{rank()}.pt").exists():
            record(phase, error=None, message="", seconds=time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        record(
            phase,
            error=type(e).__name__,
            message=str(e),
            seconds=time.perf_counter() - start,
            trace=traceback.format_exc()[-3000:],
        )


def phase_order() -> None:
    L.seed_everything(3)
    dm = data(train_batches=20)
    model = Positional()
    strategy = TorchRecStrategy(constraints=MIXED, fused_params={"learning_rate": 0.5})
    t = trainer(strategy, max_steps=10)
    t.fit(model, datamodule=dm)
    t.save_checkpoint(OUT / "order.ckpt")
    loader = DataLoader(dm.dataset("predict"), batch_size=None)  # 4 batches: 2 per rank
    preds = t.predict(model, dataloaders=loader)
    plan = {p.table: p.sharding_type for p in strategy.plan_summary.tables}
    record("order", keys=model.keys_seen, preds=preds, plan=plan, error=None)


class WeightedBatches(Dataset):
    """Synthetic batches whose KJTs carry weights, except rank 1's batch 1."""

    def __init__(self) -> None:
        self.inner = data(train_batches=8).dataset("train")

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Batch:
        b = self.inner[i]
        kjt = b.sparse_features
        drop = rank() == 1 and i == 1
        weights = None if drop else torch.ones(kjt.values().numel())
        kjt = KeyedJaggedTensor(
            keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=weights
        )
        return Batch(b.dense_features, kjt, b.labels)


def phase_weighted() -> None:
    loader = DataLoader(WeightedBatches(), batch_size=None, shuffle=False)
    strategy = TorchRecStrategy(constraints=table_wise(4))
    expect_error(
        "weighted",
        lambda: trainer(strategy, max_steps=4, use_distributed_sampler=False).fit(
            Positional(weighted=True), loader
        ),
    )


def mean_abs(t: torch.Tensor) -> torch.Tensor:
    return t.abs().mean()


def phase_custom_norm() -> None:
    logger = CSVLogger(OUT, name="custom_norm", version=0)
    t = trainer(
        TorchRecStrategy(constraints=table_wise(2)),
        max_steps=4,
        logger=logger,
        callbacks=[WeightNormCallback(how_to_log=mean_abs, every_n_steps=2)],
    )
    t.fit(tiny_dlrm(ROWS), datamodule=tiny_data(ROWS, 2, batch_size=16))
    record("custom_norm", error=None, log_dir=logger.log_dir)


class PerRank(Dataset):
    """``counts[rank]`` synthetic batches on each rank."""

    def __init__(self, counts: list[int], split: str = "train") -> None:
        self.inner = data(train_batches=8, val_batches=8).dataset(split)
        self.n = counts[rank()]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Batch:
        return self.inner[i]


class PerRankIterable(IterableDataset):
    """An iterable (no ``len``) of ``counts[rank]`` batches."""

    def __init__(self, counts: list[int]) -> None:
        self.inner = data(train_batches=8).dataset("train")
        self.counts = counts

    def __iter__(self) -> Any:
        return (self.inner[i] for i in range(self.counts[rank()]))


def phase_uneven() -> None:
    def fit(train: Any, val: Any = None, **kwargs: Any) -> None:
        t = trainer(
            TorchRecStrategy(constraints=table_wise(4)),
            max_epochs=1,
            use_distributed_sampler=False,
            **kwargs,
        )
        t.fit(Positional(), DataLoader(train, batch_size=None), val)

    expect_error("uneven_sized", lambda: fit(PerRank([5, 3])))
    expect_error("uneven_iterable", lambda: fit(PerRankIterable([4, 2])))

    class WithVal(Positional):
        def validation_step(self, batch: Batch, batch_idx: int) -> None:
            self(batch)

    def fit_val() -> None:
        t = trainer(
            TorchRecStrategy(constraints=table_wise(4)), max_epochs=1, use_distributed_sampler=False
        )
        val = DataLoader(PerRank([2, 3], "val"), batch_size=None)
        t.fit(WithVal(), DataLoader(PerRank([2, 2]), batch_size=None), val)

    expect_error("uneven_val", fit_val)

    def fit_val_unchecked() -> None:  # no batch checks: the count vote stays (loss checks on)
        strategy = TorchRecStrategy(constraints=table_wise(4), validate_batches=False)
        t = trainer(strategy, max_epochs=1, use_distributed_sampler=False)
        val = DataLoader(PerRankIterable([3, 2]), batch_size=None)
        t.fit(WithVal(), DataLoader(PerRank([2, 2]), batch_size=None), val)

    expect_error("uneven_val_unchecked", fit_val_unchecked)

    def predict() -> None:
        t = trainer(TorchRecStrategy(constraints=table_wise(4)))
        t.predict(
            Positional(), DataLoader(data(test_batches=3).dataset("predict"), batch_size=None)
        )

    expect_error("predict_uneven", predict)


def phase_refit() -> None:
    model = tiny_dlrm(ROWS)
    dm = tiny_data(ROWS, 2, batch_size=16, train_batches=8)
    first = trainer(TorchRecStrategy(constraints=table_wise(2)), max_steps=3)
    first.fit(model, datamodule=dm)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}

    def second_stage() -> None:
        second = trainer(TorchRecStrategy(constraints=table_wise(2)), max_steps=2)
        second.fit(model, datamodule=dm)
        changed = [k for k, v in model.named_parameters() if not torch.equal(before[k], v)]
        record("refit", error=None, steps=second.global_step, changed=changed)

    expect_error("refit", second_stage)


class SequenceModel(L.LightningModule):
    """An ``EmbeddingCollection`` model: mean of each feature's sequence embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=f"t_cat_{i}",
                    embedding_dim=4,
                    num_embeddings=ROWS,
                    feature_names=[f"cat_{i}"],
                )
                for i in range(2)
            ],
            device=torch.device("meta"),
        )
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        out = self.ec(batch.sparse_features)
        size = len(batch.labels)
        pooled = []
        for jt in out.values():
            rows = torch.repeat_interleave(torch.arange(size), jt.lengths())
            sums = torch.zeros(size, 4).index_add(0, rows, jt.values())
            pooled.append(sums / jt.lengths().clamp_min(1).unsqueeze(1))
        logits = self.head(torch.cat(pooled, dim=1)).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(dense_parameters(self), lr=0.1)


def phase_ec() -> None:
    def fit() -> None:
        strategy = TorchRecStrategy()
        t = trainer(strategy, max_steps=3)
        t.fit(SequenceModel(), datamodule=tiny_data(ROWS, 2, batch_size=16))
        plan = {p.table: p.sharding_type for p in strategy.plan_summary.tables}
        record("ec", error=None, steps=t.global_step, plan=plan)

    expect_error("ec", fit)


class DenseScheduled(Positional):
    """A plain torch optimizer with a scheduler built on it (no combine_optimizers)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(dense_parameters(self), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


def phase_no_fused() -> None:
    dp = {f"t_cat_{i}": ParameterConstraints(sharding_types=["data_parallel"]) for i in range(4)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer(TorchRecStrategy(constraints=dp), max_steps=2)
        t.fit(DenseScheduled(), datamodule=data(train_batches=8))
    record("no_fused", error=None, warnings=[str(w.message) for w in caught], steps=t.global_step)


def main() -> None:
    for phase in (
        phase_order,
        phase_weighted,
        phase_custom_norm,
        phase_uneven,
        phase_refit,
        phase_ec,
        phase_no_fused,
    ):
        phase()


if __name__ == "__main__":
    main()
