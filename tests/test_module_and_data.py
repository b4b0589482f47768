"""Single-process unit tests: ModelAndLoss contract and the synthetic click data."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torchmetrics.functional.classification import binary_auroc

from lightning_torchrec import Batch, ModelAndLoss, SyntheticClickData
from lightning_torchrec.data import SyntheticClickDataset
from lightning_torchrec.models.dlrm import dlrm_tables
from lightning_torchrec.models.model_and_loss import weighted_bce_with_logits


def batch(weights: torch.Tensor | None = None) -> Batch:
    data = SyntheticClickData(num_embeddings=10, num_sparse_features=2, batch_size=6)
    b = data.dataset("train")[0]
    return Batch(b.dense_features, b.sparse_features, b.labels, weights)


class Linear(torch.nn.Module):
    def __init__(self, out: str = "tensor") -> None:
        super().__init__()
        self.lin = torch.nn.Linear(13, 1)
        self.out = out

    def forward(self, dense: torch.Tensor, sparse: object) -> object:
        logits = self.lin(dense)
        return {"logits": logits, "extra": 1} if self.out == "dict" else logits


def test_forward_returns_loss_and_outputs_with_labels_and_weights() -> None:
    b = batch()
    loss, out = ModelAndLoss(Linear())(b)
    assert set(out) >= {"logits", "loss", "labels", "weights"}
    assert out["loss"] is loss and torch.equal(out["labels"], b.labels)
    assert torch.equal(out["weights"], torch.ones(6))
    expected = F.binary_cross_entropy_with_logits(out["logits"].squeeze(-1), b.labels)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()


def test_sample_weights_weight_the_loss() -> None:
    w = torch.tensor([1.0, 0, 0, 0, 0, 3.0])
    b = batch(w)
    loss, out = ModelAndLoss(Linear())(b)
    per = F.binary_cross_entropy_with_logits(out["logits"].squeeze(-1), b.labels, reduction="none")
    assert loss.item() == pytest.approx(((per[0] + 3 * per[5]) / 4).item(), rel=1e-6)
    assert torch.equal(out["weights"], w)


def test_dict_model_output_and_dict_loss() -> None:
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> dict:
        main = weighted_bce_with_logits(logits, labels, weights)
        return {"loss": main, "aux": main * 0 + 2}

    loss, out = ModelAndLoss(Linear("dict"), loss_fn=loss_fn)(batch())
    assert out["extra"] == 1 and out["aux"].item() == 2 and out["loss"] is loss


def test_contract_errors_name_what_is_missing() -> None:
    class NoLogits(torch.nn.Module):
        def forward(self, dense: torch.Tensor, sparse: object) -> dict:
            return {"scores": dense}

    with pytest.raises(KeyError, match="'logits'"):
        ModelAndLoss(NoLogits())(batch())
    with pytest.raises(KeyError, match="'loss'"):
        ModelAndLoss(Linear(), loss_fn=lambda *a: {"total": a[0].sum()})(batch())


def test_unpack_batch_lets_a_model_take_the_whole_batch() -> None:
    class TakesBatch(torch.nn.Module):
        def forward(self, b: Batch) -> torch.Tensor:
            return b.dense_features[:, :1]

    loss, out = ModelAndLoss(TakesBatch(), unpack_batch=lambda b: (b,))(batch())
    assert out["logits"].shape == (6, 1) and loss.ndim == 0


def test_batches_are_deterministic_well_formed_and_split_dependent() -> None:
    dm = SyntheticClickData(num_embeddings_per_feature=[5, 50, 500], batch_size=64, seed=4)
    a, b = dm.dataset("train")[3], dm.dataset("train")[3]
    assert torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert not torch.equal(a.dense_features, dm.dataset("val")[3].dense_features)
    assert not torch.equal(a.dense_features, dm.dataset("train")[4].dense_features)
    kjt = a.sparse_features
    assert kjt.keys() == ["cat_0", "cat_1", "cat_2"]
    assert int(kjt.lengths().sum()) == kjt.values().numel()
    for key, rows in zip(kjt.keys(), [5, 50, 500], strict=True):
        ids = kjt[key].values()
        assert ids.min() >= 0 and ids.max() < rows
    assert set(a.labels.unique().tolist()) <= {0.0, 1.0}
    assert a.dense_features.shape == (64, 13) and len(a.labels) == 64
    cfgs = dlrm_tables(dm.num_embeddings_per_feature, 8)  # the DLRM's tables fit the data
    assert [(c.name, c.num_embeddings, c.feature_names) for c in cfgs] == [
        ("t_cat_0", 5, ["cat_0"]),
        ("t_cat_1", 50, ["cat_1"]),
        ("t_cat_2", 500, ["cat_2"]),
    ]


def test_labels_follow_the_hidden_rule_so_learning_is_measurable() -> None:
    ds = SyntheticClickDataset([100] * 4, num_batches=1, batch_size=20_000, ids_per_feature=2)
    b = ds[0]
    dense_only = binary_auroc(b.dense_features @ ds.dense_weights, b.labels.long())
    # Recompute the rule from the hidden vectors: it must predict much better than dense alone.
    kjt, n = b.sparse_features, len(b.labels)
    pooled = []
    for f, key in enumerate(kjt.keys()):
        jt = kjt[key]
        sample = torch.repeat_interleave(torch.arange(n), jt.lengths())
        sums = torch.zeros(n, ds.hidden_dim).index_add_(0, sample, ds.id_vectors(f, jt.values()))
        pooled.append(sums / jt.lengths().unsqueeze(1))
    h = torch.stack(pooled, 1)
    inter = (h @ h.transpose(1, 2)).triu(1).sum((1, 2))
    rule = binary_auroc(inter + b.dense_features @ ds.dense_weights, b.labels.long())
    assert 0.52 < dense_only < 0.65
    assert rule > dense_only + 0.15


def test_distributed_sampler_gives_ranks_disjoint_batches() -> None:
    from torch.utils.data import DistributedSampler

    ds = SyntheticClickData(train_batches=10).dataset("train")
    parts = [
        list(DistributedSampler(ds, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)
    ]
    assert set(parts[0]).isdisjoint(parts[1]) and sorted(parts[0] + parts[1]) == list(range(10))


@pytest.mark.parametrize(
    "bad", [dict(num_embeddings_per_feature=[0]), dict(num_batches=0), dict(split="nope")]
)
def test_bad_dataset_arguments_are_refused(bad: dict) -> None:
    kwargs = dict(num_embeddings_per_feature=[10], num_batches=1, batch_size=4) | bad
    with pytest.raises(ValueError):
        SyntheticClickDataset(**kwargs)


def test_batches_go_from_the_host_to_an_accelerator_without_blocking() -> None:
    from lightning_torchrec.data.batch import host_to_accelerator

    cpu, cuda, meta = torch.device("cpu"), torch.device("cuda", 0), torch.device("meta")
    # Lightning calls batch.to(device): from the host to a GPU, the copy must not block.
    assert host_to_accelerator(cpu, cuda)
    assert not host_to_accelerator(cuda, cpu)  # the host reads the result: block
    assert not host_to_accelerator(cpu, cpu) and not host_to_accelerator(cpu, meta)
    batch = SyntheticClickDataset([10, 10], num_batches=1, batch_size=4)[0]
    assert batch.to("cpu") is batch  # already there: no new batch, the KJT keeps its caches
    moved = batch.to("meta")
    assert moved is not batch and moved.sparse_features.device().type == "meta"
    assert moved.dense_features.device.type == "meta" and batch.labels.device.type == "cpu"


@pytest.mark.parametrize("bar", [False, True])
def test_train_loss_is_a_progress_bar_value_only_with_a_progress_bar(bar: bool) -> None:
    import lightning as L

    from lightning_torchrec import TorchRecStrategy
    from tests.scripts.factory import QUIET, table_wise, tiny_data, tiny_dlrm

    trainer = L.Trainer(
        strategy=TorchRecStrategy(constraints=table_wise(2), log_plan=False),
        devices=1,
        max_steps=2,
        limit_val_batches=0,
        **(QUIET | {"enable_progress_bar": bar}),
    )
    trainer.fit(tiny_dlrm(), datamodule=tiny_data())
    # Lightning reads progress-bar values every step: a GPU-to-host sync without a bar to show.
    assert ("train/loss" in trainer.progress_bar_metrics) is bar
    assert "train/loss" in trainer.callback_metrics


class _Refreshes(Callback):
    """The bar's count after each training batch, and whether ``train/loss`` was fresh then."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.fresh: list[bool] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        bar = trainer.progress_bar_callback.train_progress_bar
        self.counts.append(bar.n)
        shown = trainer.progress_bar_metrics.get("train/loss")
        self.fresh.append(shown == pytest.approx(float(outputs["loss"]), abs=1e-6))


@pytest.mark.parametrize("rate", [1, 3])
def test_the_loss_is_put_in_the_bar_at_the_batches_it_refreshes_after(rate: int) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import TQDMProgressBar

    from lightning_torchrec import TorchRecStrategy
    from tests.scripts.factory import QUIET, table_wise, tiny_data, tiny_dlrm

    seen = _Refreshes()
    bar = TQDMProgressBar(refresh_rate=rate)  # placed before the callback reading it
    trainer = L.Trainer(
        strategy=TorchRecStrategy(constraints=table_wise(2), log_plan=False),
        devices=1,
        max_epochs=1,
        limit_val_batches=0,
        callbacks=[bar, seen],
        **(QUIET | {"enable_progress_bar": True}),
    )
    trainer.fit(tiny_dlrm(), datamodule=tiny_data(train_batches=6))
    if rate == 1:  # Lightning's default bar, left as it is: a refresh at every batch
        assert seen.counts == [1, 2, 3, 4, 5, 6] and all(seen.fresh)
    else:  # every third batch, and the loss given to the bar for those only
        assert seen.counts == [0, 0, 3, 3, 3, 6]
        assert seen.fresh == [False, False, True, False, False, True]
    assert "_should_update" not in vars(bar)


def test_asking_whether_the_bar_refreshes_records_nothing() -> None:
    import lightning as L
    from lightning.pytorch.callbacks import TQDMProgressBar

    from lightning_torchrec.compat.lightning import progress_bar_refreshes

    trainer = L.Trainer(
        callbacks=[TQDMProgressBar(refresh_rate=3)], logger=False, enable_checkpointing=False
    )
    assert not progress_bar_refreshes(trainer, 0) and not progress_bar_refreshes(trainer, 1)
    assert progress_bar_refreshes(trainer, 2) and progress_bar_refreshes(trainer, 2)
    assert progress_bar_refreshes(trainer, 5)
    trainer.progress_bar_callback.disable()  # as on every rank but 0: no loss given to it
    assert not progress_bar_refreshes(trainer, 2)
    assert not progress_bar_refreshes(L.Trainer(enable_progress_bar=False, logger=False), 2)


def test_a_profiler_records_the_strategys_hooks() -> None:
    import lightning as L
    from lightning.pytorch.profilers import SimpleProfiler

    from lightning_torchrec import TorchRecStrategy
    from tests.scripts.factory import QUIET, table_wise, tiny_data, tiny_dlrm

    simple = SimpleProfiler()
    trainer = L.Trainer(
        strategy=TorchRecStrategy(constraints=table_wise(2), log_plan=False),
        devices=1,
        max_steps=3,
        limit_val_batches=0,
        profiler=simple,
        **QUIET,
    )
    trainer.fit(tiny_dlrm(), datamodule=tiny_data(train_batches=6))
    assert len(simple.recorded_durations["[Strategy]TorchRecStrategy.training_step"]) == 3


class _LossSeen(Callback):
    """Each step's returned loss, and the ``train/loss`` the Trainer holds after it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.held: list[float | None] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        held = trainer.callback_metrics.get("train/loss")
        self.held.append(None if held is None else float(held))


@pytest.mark.parametrize("case", ["cadence", "monitored", "every_step"])
def test_train_loss_is_logged_when_something_reads_it(case: str, tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from tests.scripts.factory import cpu_trainer, tiny_data, tiny_dlrm

    seen = _LossSeen()
    callbacks: list[Callback] = [seen]
    if case == "monitored":  # a monitor may read it at any step
        callbacks.append(ModelCheckpoint(tmp_path / "ckpt", monitor="train/loss", save_top_k=1))
    trainer = cpu_trainer(
        max_steps=7,
        log_every_n_steps=3,
        limit_val_batches=0,
        callbacks=callbacks,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=case == "monitored",
    )
    every = 1 if case == "every_step" else None
    trainer.fit(tiny_dlrm(train_loss_every_n_steps=every), datamodule=tiny_data())
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f)}
    # The loggers get each of their steps' own loss (steps 3 and 6); the Trainer holds the
    # last step's too (Lightning's loggers write it only at their cadence).
    assert rows == {s - 1: pytest.approx(seen.losses[s - 1], abs=1e-6) for s in (3, 6)}
    pairs = enumerate(zip(seen.held, seen.losses, strict=True))
    fresh = [i for i, (held, loss) in pairs if held == loss]
    assert fresh == (list(range(7)) if case != "cadence" else [2, 5, 6])
    with pytest.raises(ValueError, match="train_loss_every_n_steps"):
        tiny_dlrm(train_loss_every_n_steps=0)


def test_the_bar_gets_a_cpu_loss_without_self_log_and_no_loss_from_another_device() -> None:
    import lightning as L

    from tests.scripts.factory import QUIET, tiny_dlrm

    trainer = L.Trainer(
        max_steps=100, log_every_n_steps=50, **(QUIET | {"enable_progress_bar": True})
    )
    trainer.fit_loop.max_batches = 20  # as during a fit of 20 batches an epoch
    module = tiny_dlrm()
    module.trainer = trainer
    calls: list[tuple[str, dict]] = []
    module.log = lambda name, value, **kw: calls.append((name, kw))  # type: ignore[method-assign]
    # On CUDA the bar does not show the loss (a refresh would wait for the GPU), and nothing
    # else reads it at step 4: it is neither logged nor shown.
    module._log_train_loss(torch.tensor(0.5, device="meta"), 4, batch_idx=3)
    assert calls == [] and "train/loss" not in trainer.progress_bar_metrics
    # On the CPU the bar shows it, without self.log (0.75 ms a call in Lightning's results).
    module._log_train_loss(torch.tensor(0.5), 4, batch_idx=3)
    assert calls == [] and trainer.progress_bar_metrics["train/loss"] == 0.5
    module._log_train_loss(torch.tensor([0.5, 0.7]), 4, batch_idx=3)  # unreduced: not shown
    assert trainer.progress_bar_metrics["train/loss"] == 0.5
    # The epoch's last batch is logged for the loggers, and never with prog_bar (a logged bar
    # value would replace the one shown).
    module._log_train_loss(torch.tensor(0.25), 4, batch_idx=19)
    assert calls == [("train/loss", {"batch_size": 4})]
    assert trainer.progress_bar_metrics["train/loss"] == 0.25


def test_a_plateau_scheduler_given_as_the_modules_lr_scheduler_watches_its_monitor() -> None:
    # As LightningCLI builds it (`--model.lr_scheduler ReduceLROnPlateau`): the scheduler names
    # its metric; on val/loss it steps once per epoch.
    from lightning.pytorch.cli import ReduceLROnPlateau

    from tests.scripts.factory import cpu_trainer, tiny_data, tiny_dlrm

    def plateau(optimizer: Any) -> ReduceLROnPlateau:  # never better: halves at every check
        kwargs = dict(mode="max", patience=0, factor=0.5, threshold=10.0, threshold_mode="abs")
        return ReduceLROnPlateau(optimizer, monitor="val/loss", **kwargs)

    model = tiny_dlrm(lr_scheduler=plateau, lr_scheduler_interval="epoch")
    trainer = cpu_trainer(max_epochs=3, limit_val_batches=1)
    trainer.fit(model, datamodule=tiny_data())
    (config,) = trainer.lr_scheduler_configs
    assert config.monitor == "val/loss" and config.interval == "epoch"
    dense, fused = (g["lr"] for g in trainer.optimizers[0].param_groups)
    assert dense == pytest.approx(1e-3 / 4) and fused == pytest.approx(1e-2 / 4)


def test_a_plateau_scheduler_on_train_loss_gets_it_at_every_step() -> None:
    from lightning_torchrec import DLRMClickModule
    from tests.scripts.factory import cpu_trainer, tiny_data, tiny_dlrm

    class Plateau(DLRMClickModule):
        def configure_optimizers(self) -> Any:
            optimizer = super().configure_optimizers()
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            config = {"scheduler": scheduler, "interval": "step", "monitor": "train/loss"}
            return {"optimizer": optimizer, "lr_scheduler": config}

    trainer = cpu_trainer(max_steps=4, log_every_n_steps=50, limit_val_batches=0)
    # Lightning reads the monitored value after every step (and refuses a step without it).
    trainer.fit(tiny_dlrm(cls=Plateau), datamodule=tiny_data())
    assert trainer.global_step == 4
