"""``SASRecModule``: next-item prediction on an ``EmbeddingCollection`` as a LightningModule."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_torchrec.lightning.module import TorchRecModule, default_optimizer
from lightning_torchrec.models.sequence import sasrec_model
from lightning_torchrec.training.ranking import RankingMetrics


class SASRecModule(TorchRecModule):
    """A SASRec-style sequence recommender, its item table on the meta device.

    Trains with a sampled softmax over every position of every history (see
    :mod:`lightning_torchrec.models.sequence`) and logs ``train/loss``, ``val/loss`` and
    ``test/loss``, and ``val/recall@k``, ``val/ndcg@k`` (and ``test/...``) for each cut-off in
    ``ks``: full-catalogue ranking, synchronised over the ranks
    (:class:`~lightning_torchrec.training.ranking.RankingMetrics`). Checkpoints, the combined
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
    ) -> None:
        model = sasrec_model(
            num_items, embedding_dim, max_length, num_blocks, num_heads, dropout, init_scale
        )
        super().__init__(
            model,  # type: ignore[arg-type]
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            train_metrics_every_n_steps=0,
        )
        # The click metrics of TorchRecModule do not apply to next-item prediction.
        del self.val_auroc, self.test_auroc
        self.ks = sorted(set(ks or [10]))
        self.val_ranking = RankingMetrics(self.ks)
        self.test_ranking = RankingMetrics(self.ks)
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

    def _rank_step(self, batch: Any, stage: str, metric: RankingMetrics) -> torch.Tensor:
        loss, outputs = self(batch)
        metric.update(outputs["ranks"], outputs["weights"])
        n = int(outputs["weights"].sum())
        self.log(f"{stage}/loss", loss, sync_dist=True, batch_size=max(n, 1))
        return loss

    def _log_ranking(self, stage: str, metric: RankingMetrics) -> None:
        values = metric.compute()
        metric.reset()
        # Already global (the states were summed over the ranks); sync_dist averages equal
        # values and tells Lightning so.
        for name, value in values.items():
            bar = name == f"recall@{self.ks[0]}"
            self.log(f"{stage}/{name}", value, prog_bar=bar, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Logs ``val/loss`` and updates the ranking metrics.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        return self._rank_step(batch, "val", self.val_ranking)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Logs ``test/loss`` and updates the ranking metrics.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        return self._rank_step(batch, "test", self.test_ranking)

    def on_validation_epoch_end(self) -> None:
        """Logs ``val/recall@k`` and ``val/ndcg@k`` of the whole validation."""
        self._log_ranking("val", self.val_ranking)

    def on_test_epoch_end(self) -> None:
        """Logs ``test/recall@k`` and ``test/ndcg@k`` of the whole test."""
        self._log_ranking("test", self.test_ranking)

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
