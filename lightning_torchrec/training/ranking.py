"""Ranking metrics of next-item prediction: recall@k and NDCG@k, synchronised over ranks.

With one relevant item per sample (the next item), at 0-based rank ``r`` among the candidates:

* **recall@k** (the hit rate): 1 if ``r < k``, else 0;
* **NDCG@k**: ``1 / log2(r + 2)`` if ``r < k``, else 0 (the ideal DCG is 1).

Both are averaged over samples, weighted (padding samples have weight 0).
:class:`RankingMetrics` is a ``torchmetrics.Metric`` whose states are weighted sums and the
weight total, reduced by summing over the ranks, so its value is that of every sample of every
rank, whatever their split. :func:`popularity_ranks` ranks by training popularity: the baseline
every sequence model should beat.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torchmetrics import Metric

__all__ = ["RankingMetrics", "popularity_ranks", "ranking_values"]


def ranking_values(
    ranks: torch.Tensor, ks: Sequence[int], weights: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Recall@k and NDCG@k of given ranks, on plain tensors.

    Args:
        ranks: ``[N]`` 0-based ranks of each sample's target.
        ks: the cut-offs.
        weights: ``[N]`` sample weights, or None for 1.

    Returns:
        ``{"recall@k": ..., "ndcg@k": ...}`` (float64 scalars).
    """
    r = ranks.double()
    w = torch.ones_like(r) if weights is None else weights.double()
    total = w.sum()
    out = {}
    for k in ks:
        hit = (r < k).double()
        out[f"recall@{k}"] = (w * hit).sum() / total
        out[f"ndcg@{k}"] = (w * hit / torch.log2(r + 2)).sum() / total
    return out


class RankingMetrics(Metric):
    """Recall@k and NDCG@k over every sample of every rank.

    Args:
        ks: the cut-offs.
        **kwargs: passed to ``torchmetrics.Metric`` (``sync_on_compute``, ``process_group``).

    Raises:
        ValueError: for no cut-off or a cut-off below 1.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, ks: Sequence[int] = (10,), **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        if not ks or min(ks) < 1:
            raise ValueError(f"ks must be positive cut-offs, got {list(ks)}")
        self.ks = sorted(set(ks))
        zeros = torch.zeros(len(self.ks), dtype=torch.float64)
        self.add_state("hits", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("gains", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, ranks: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Adds a batch.

        Args:
            ranks: ``[B]`` 0-based ranks of each sample's target.
            weights: ``[B]`` sample weights, or None for 1.
        """
        r = ranks.detach().double().reshape(-1, 1)
        w = torch.ones_like(r) if weights is None else weights.detach().double().reshape(-1, 1)
        ks = torch.tensor(self.ks, dtype=torch.float64, device=r.device)
        hit = (r < ks).double() * w
        self.hits += hit.sum(0)
        self.gains += (hit / torch.log2(r + 2)).sum(0)
        self.total += w.sum()

    def compute(self) -> dict[str, torch.Tensor]:
        """The metrics over every sample seen (on every rank).

        Returns:
            ``{"recall@k": ..., "ndcg@k": ...}`` as float32 scalars (NaN before any sample).
        """
        out = {}
        for i, k in enumerate(self.ks):
            out[f"recall@{k}"] = (self.hits[i] / self.total).float()
            out[f"ndcg@{k}"] = (self.gains[i] / self.total).float()
        return out


def popularity_ranks(train_items: np.ndarray, targets: np.ndarray, num_items: int) -> np.ndarray:
    """Each target's 0-based rank when every user gets the same list: the most frequent first.

    Ties in frequency count against the target, as in
    :func:`lightning_torchrec.models.sequence.target_ranks`.

    Args:
        train_items: the items the popularity is counted on (item indices).
        targets: ``[N]`` the targets to rank.
        num_items: the catalogue size.

    Returns:
        ``[N]`` int64 ranks.
    """
    counts = np.bincount(train_items, minlength=num_items)
    less_popular = np.searchsorted(np.sort(counts), counts[targets], side="left")
    # The items at least as popular as the target, other than the target itself.
    return (num_items - less_popular - 1).astype(np.int64)
