"""``ModelAndLoss`` (the-algorithm-ml contract) and the LightningModule built on it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics.classification import BinaryAUROC

from lightning_torchrec.optim import combine_optimizers, dense_parameters

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | Mapping[str, Any]"]


def weighted_bce_with_logits(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted mean binary cross-entropy on logits.

    Args:
        logits: ``[B]`` or ``[B, 1]`` logits.
        labels: ``[B]`` labels in {0, 1}.
        weights: ``[B]`` sample weights.

    Returns:
        The scalar loss ``sum(w * bce) / sum(w)``.
    """
    per_sample = F.binary_cross_entropy_with_logits(
        logits.reshape(labels.shape), labels, reduction="none"
    )
    return (per_sample * weights).sum() / weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)


def dense_and_sparse(batch: Any) -> tuple[Any, ...]:
    """Model inputs of TorchRec's DLRM family: ``(dense_features, sparse_features)``.

    Args:
        batch: a batch with ``dense_features`` and ``sparse_features``.

    Returns:
        The positional arguments for the model.
    """
    return batch.dense_features, batch.sparse_features


class ModelAndLoss(nn.Module):
    """Wraps a model and its loss, as the-algorithm-ml's ``ModelAndLoss``.

    ``forward(batch)`` runs the model, computes the loss and returns ``(loss, outputs)`` where
    ``outputs`` holds the model's outputs (``logits`` when the model returns a tensor) plus
    ``loss``, ``labels`` and ``weights``. A loss function may return a mapping with ``"loss"``
    (other entries are copied into ``outputs``).

    Args:
        model: the model, e.g. ``torchrec.models.dlrm.DLRM`` with tables on the meta device.
        loss_fn: ``loss_fn(logits, labels, weights)``; defaults to weighted BCE on logits.
        unpack_batch: turns a batch into the model's positional inputs; defaults to
            ``(batch.dense_features, batch.sparse_features)``. Use ``lambda b: (b,)`` for a
            model that takes the whole batch.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn = weighted_bce_with_logits,
        unpack_batch: Callable[[Any], tuple[Any, ...]] = dense_and_sparse,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.unpack_batch = unpack_batch

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """Runs the model and the loss on one batch.

        Args:
            batch: a batch with ``labels`` and optionally ``weights`` (None means 1).

        Returns:
            ``(loss, outputs)``.

        Raises:
            KeyError: if the model's output mapping has no ``logits`` or the loss mapping no
                ``loss``.
        """
        out = self.model(*self.unpack_batch(batch))
        outputs: dict[str, Any] = dict(out) if isinstance(out, Mapping) else {"logits": out}
        if "logits" not in outputs:
            raise KeyError(f"the model returned {sorted(outputs)}; ModelAndLoss needs 'logits'")
        labels = batch.labels
        weights = getattr(batch, "weights", None)
        if weights is None:
            weights = torch.ones_like(labels, dtype=torch.float32)
        losses = self.loss_fn(outputs["logits"], labels.float(), weights.float())
        if isinstance(losses, Mapping):
            if "loss" not in losses:
                raise KeyError(f"the loss function returned {sorted(losses)}; it needs 'loss'")
            outputs.update(losses)
            loss = losses["loss"]
        else:
            loss = losses
        outputs.update({"loss": loss, "labels": labels, "weights": weights})
        return loss, outputs


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


class TorchRecModule(L.LightningModule):
    """A LightningModule for click models built on ``ModelAndLoss``.

    Trains, validates and tests; logs ``train/loss``, ``val/loss``, ``val/auroc``,
    ``test/loss`` and ``test/auroc`` (AUROC from torchmetrics, synchronised across ranks). The
    dense optimizer and LR schedule are arguments, so no subclass is needed; under
    ``TorchRecStrategy`` the scheduler drives the fused embedding learning rate too.

    Args:
        model_and_loss: the wrapped model and loss.
        optimizer: builds the dense optimizer from the dense parameters (fused tables are
            excluded automatically). Defaults to Adam with lr 1e-3.
        lr_scheduler: builds an LR scheduler from the combined optimizer, or None.
        lr_scheduler_interval: ``"step"`` or ``"epoch"``.
    """

    def __init__(
        self,
        model_and_loss: ModelAndLoss,
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scheduler_interval: str = "step",
    ) -> None:
        super().__init__()
        self.model_and_loss = model_and_loss
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.lr_scheduler_interval = lr_scheduler_interval
        self.val_auroc = BinaryAUROC()
        self.test_auroc = BinaryAUROC()

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """Runs ``ModelAndLoss`` on a batch.

        Args:
            batch: the batch.

        Returns:
            ``(loss, outputs)``.
        """
        return self.model_and_loss(batch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """One training step; logs ``train/loss``.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        loss, _ = self(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch.labels))
        return loss

    def _eval_step(self, batch: Any, stage: str, auroc: BinaryAUROC) -> torch.Tensor:
        loss, outputs = self(batch)
        probs = torch.sigmoid(outputs["logits"].detach().reshape(batch.labels.shape).float())
        auroc.update(probs, batch.labels.long())
        n = len(batch.labels)
        self.log(f"{stage}/loss", loss, sync_dist=True, batch_size=n)
        self.log(f"{stage}/auroc", auroc, prog_bar=stage == "val", batch_size=n)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Logs ``val/loss`` and ``val/auroc``.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        return self._eval_step(batch, "val", self.val_auroc)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Logs ``test/loss`` and ``test/auroc``.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        return self._eval_step(batch, "test", self.test_auroc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Click probabilities for a batch.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            ``[B]`` probabilities.
        """
        _, outputs = self(batch)
        return torch.sigmoid(outputs["logits"].reshape(-1))

    def configure_optimizers(self) -> Any:
        """Dense optimizer on the dense parameters, combined with the fused embedding optimizer.

        Returns:
            The optimizer, and the LR scheduler config when one was given.
        """
        dense = self.optimizer_factory(dense_parameters(self))
        optimizer = combine_optimizers(dense, self)
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.lr_scheduler_interval},
        }
