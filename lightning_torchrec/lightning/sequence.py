"""``SASRecModule``: next-item prediction on an ``EmbeddingCollection`` as a LightningModule."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import Metric

from lightning_torchrec.lightning.module import TorchRecModule, default_optimizer
from lightning_torchrec.models.sequence import sasrec_model
from lightning_torchrec.training.ranking import RankingMetrics


class EvalLoss(Metric):
    """The loss over every position of every evaluated history, on every rank.

    Each batch adds its loss times its ``loss_weight`` (the total weight of the positions the
    loss averages) and that weight; the states are summed over the ranks, so the value is the
    weighted mean cross-entropy over every real position of every rank, whatever their batches
    and their split: the training loss over the whole evaluation. Padding samples (weight 0)
    add nothing, and a batch of padding only adds 0 to both sums (no NaN).
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        zero = torch.zeros((), dtype=torch.float64)
        self.add_state("weighted", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("total", default=zero.clone(), dist_reduce_fx="sum")

    def update(self, loss: torch.Tensor, weight: torch.Tensor) -> None:
        """Adds a batch.

        Args:
            loss: the batch's weighted mean loss.
            weight: the total weight it averages over (0 adds nothing).
        """
        weight = weight.detach().double()
        # A weight of 0 adds 0, even for a non-finite loss of a batch of padding only.
        self.weighted += torch.where(weight > 0, loss.detach().double() * weight, 0.0)
        self.total += weight

    def compute(self) -> torch.Tensor:
        """The mean over every position seen (on every rank).

        Returns:
            A float32 scalar (NaN before any weight).
        """
        return (self.weighted / self.total).float()


class SASRecModule(TorchRecModule):
    """A SASRec-style sequence recommender, its item table on the meta device.

    Trains with a sampled softmax over every position of every history (see
    :mod:`lightning_torchrec.models.sequence`) and logs ``train/loss``, ``val/loss`` and
    ``test/loss``, and ``val/recall@k``, ``val/ndcg@k`` (and ``test/...``) for each cut-off in
    ``ks``: full-catalogue ranking, synchronised over the ranks
    (:class:`~lightning_torchrec.training.ranking.RankingMetrics`). ``val/loss`` and
    ``test/loss`` are the loss over every position of every evaluated history of every rank
    (:class:`EvalLoss`; padding samples do not count). Checkpoints, the combined
    optimizer and one-process loading are those of ``TorchRecModule``.

    Args:
        num_items: rows of the item table (the data module's ``num_items``).
        embedding_dim: width of the table and the transformer.
        max_length: longest history (the data module's ``max_length``).
        num_blocks: transformer blocks.
        num_heads: attention heads.
        dropout: dropout inside the blocks (0 keeps resumes bit-exact).
        init_scale: item rows start uniform in ``[-init_scale, init_scale]``.
        ks: the cut-offs of recall@k and NDCG@k.
        optimizer: builds the dense optimizer (the transformer).
        lr_scheduler: builds the LR scheduler (drives the fused embedding LR too), or None.
        lr_scheduler_interval: ``"step"`` or ``"epoch"``: when the scheduler steps.
    """

    def __init__(
        self,
        num_items: int,
        embedding_dim: int = 32,
        max_length: int = 20,
        num_blocks: int = 1,
        num_heads: int = 1,
        dropout: float = 0.0,
        init_scale: float = 0.1,
        ks: list[int] | None = None,
        optimizer: OptimizerCallable = default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scheduler_interval: str = "step",
    ) -> None:
        model = sasrec_model(
            num_items, embedding_dim, max_length, num_blocks, num_heads, dropout, init_scale
        )
        super().__init__(
            model,  # type: ignore[arg-type]
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            lr_scheduler_interval=lr_scheduler_interval,
            train_metrics_every_n_steps=0,
        )
        # The click metrics of TorchRecModule do not apply to next-item prediction.
        del self.val_auroc, self.test_auroc
        self.ks = sorted(set(ks or [10]))
        self.val_ranking = RankingMetrics(self.ks)
        self.test_ranking = RankingMetrics(self.ks)
        self.val_loss = EvalLoss()
        self.test_loss = EvalLoss()
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """One training step; logs ``train/loss``.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        loss, _ = self(batch)
        self._log_train_loss(loss, len(batch.labels), batch_idx)
        return loss

    def _rank_step(self, batch: Any, metric: RankingMetrics, loss_metric: EvalLoss) -> torch.Tensor:
        loss, outputs = self(batch)
        metric.update(outputs["ranks"], outputs["weights"])
        loss_metric.update(loss, outputs["loss_weight"])
        return loss

    def _log_ranking(self, stage: str, metric: RankingMetrics, loss_metric: EvalLoss) -> None:
        values = {"loss": loss_metric.compute(), **metric.compute()}
        metric.reset()
        loss_metric.reset()
        # Already global (the states were summed over the ranks); sync_dist averages equal
        # values and tells Lightning so.
        for name, value in values.items():
            bar = name == f"recall@{self.ks[0]}"
            self.log(f"{stage}/{name}", value, prog_bar=bar, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Adds the batch to ``val/loss`` and the ranking metrics.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        return self._rank_step(batch, self.val_ranking, self.val_loss)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Adds the batch to ``test/loss`` and the ranking metrics.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        return self._rank_step(batch, self.test_ranking, self.test_loss)

    def on_validation_epoch_end(self) -> None:
        """Logs ``val/loss``, ``val/recall@k`` and ``val/ndcg@k`` of the whole validation."""
        self._log_ranking("val", self.val_ranking, self.val_loss)

    def on_test_epoch_end(self) -> None:
        """Logs ``test/loss``, ``test/recall@k`` and ``test/ndcg@k`` of the whole test."""
        self._log_ranking("test", self.test_ranking, self.test_loss)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Scores of the batch's candidates after each history.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            ``[B, C]`` scores.
        """
        _, outputs = self(batch)
        return outputs["scores"]
