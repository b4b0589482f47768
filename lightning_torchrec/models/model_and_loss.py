"""``ModelAndLoss``: a model and its loss in one ``nn.Module`` (the-algorithm-ml contract).

``forward(batch) -> (loss, outputs)`` with ``loss``, ``labels`` and ``weights`` in the outputs.
Plain torch: no Lightning, usable in any training loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: Smallest positive float32: keeps an all-zero-weight batch finite. A constant (not
#: ``torch.finfo(weights.dtype)``) so TorchRec's pipelines can trace the loss with torch.fx.
_TINY = torch.finfo(torch.float32).tiny

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
    return (per_sample * weights).sum() / weights.sum().clamp_min(_TINY)


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
