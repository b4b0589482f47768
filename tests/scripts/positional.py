"""A model that reads its pooled embeddings positionally (``head(ebc(kjt).values())``).

Shared by tests/scripts/trust_training_ranks.py (as a sibling module) and the tests (as
``tests.scripts.positional``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_torchrec import Batch, SyntheticClickData, dense_parameters

ROWS = 20
DIMS = [4, 8, 8, 12]  # different widths: a positional misread changes the function


class Positional(L.LightningModule):
    """Reads the pooled embeddings positionally: ``head(ebc(kjt).values())``."""

    def __init__(self, weighted: bool = False) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t_cat_{i}",
                    embedding_dim=d,
                    num_embeddings=ROWS,
                    feature_names=[f"cat_{i}"],
                )
                for i, d in enumerate(DIMS)
            ],
            is_weighted=weighted,
            device=torch.device("meta"),
        )
        self.head = torch.nn.Linear(sum(DIMS), 1)
        self.keys_seen: list[str] = []

    def forward(self, batch: Batch) -> torch.Tensor:
        kt = self.ebc(batch.sparse_features)
        self.keys_seen = list(kt.keys())
        return self.head(kt.values()).squeeze(-1)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.binary_cross_entropy_with_logits(self(batch), batch.labels)

    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return torch.sigmoid(self(batch))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(dense_parameters(self), lr=0.1)


def data(**kwargs: Any) -> SyntheticClickData:
    """Synthetic clicks for :class:`Positional`: 4 features of ``ROWS`` ids, batches of 16."""
    kwargs = {"train_batches": 8, "val_batches": 2, "test_batches": 4} | kwargs
    return SyntheticClickData(
        num_embeddings=ROWS, num_sparse_features=4, batch_size=16, seed=1, **kwargs
    )
