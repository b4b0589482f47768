"""Learnable synthetic click data: labels follow a hidden rule over the ids and dense features.

Each sparse feature ``cat_i`` draws ids from a skewed (popularity-like) distribution over its
table. Every id has a hidden vector in [-1, 1]^k given by integer hashes of (feature, id, seed),
so tables of any size cost no memory. With ``h_f`` the mean hidden vector of feature ``f``'s ids
in a sample, the click probability is
``sigmoid(strength * (sum over feature pairs of <h_f, h_g>, scaled to unit std) + dense @ w + b)``:
pairwise interactions of pooled embeddings, exactly what DLRM's interaction layer computes.
A model whose tables learn reaches an AUROC well above what the (weaker) dense signal allows.

Batch ``i`` of a split depends only on ``(seed, split, i)``: runs are reproducible, and each rank
reads the batches its ``DistributedSampler`` hands it (Lightning adds one automatically).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.data.batch import Batch

_MASK32 = 0xFFFFFFFF
_SPLIT_OFFSETS = {"train": 0, "val": 1_000_003, "test": 2_000_029, "predict": 3_000_017}


def _hash_unit(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """Maps int64 ids to pseudo-random floats in [-1, 1] with a 32-bit integer hash."""
    x = (ids.to(torch.int64) + salt) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    return x.to(torch.float32) / float(_MASK32) * 2.0 - 1.0


def only_item(items: list[Batch]) -> Batch:
    """The ``collate_fn`` of a loader of whole batches read one at a time (``batch_size=1``).

    Args:
        items: the one batch the sampler chose.

    Returns:
        That batch.
    """
    (batch,) = items
    return batch


class SyntheticClickDataset(Dataset[Batch]):
    """A map-style dataset of whole batches of synthetic clicks (use ``batch_size=None``).

    Args:
        num_embeddings_per_feature: rows of the table each sparse feature reads.
        num_batches: number of batches in the split.
        batch_size: samples per batch.
        num_dense_features: width of the dense features.
        ids_per_feature: mean number of ids per feature and sample (lengths are uniform in
            ``[1, 2 * ids_per_feature - 1]``).
        seed: fixes the hidden rule and the samples.
        split: one of ``train``, ``val``, ``test``, ``predict`` (different samples, same rule).
        signal_strength: how strongly the ids drive the click probability.
        skew: ids are ``floor(rows * u ** skew)``; larger means a few ids dominate.
        hidden_dim: width ``k`` of the hidden id vectors.

    Raises:
        ValueError: for empty tables, non-positive sizes or an unknown split.
    """

    def __init__(
        self,
        num_embeddings_per_feature: Sequence[int],
        num_batches: int,
        batch_size: int,
        num_dense_features: int = 13,
        ids_per_feature: int = 4,
        seed: int = 0,
        split: str = "train",
        signal_strength: float = 2.0,
        skew: float = 2.0,
        hidden_dim: int = 4,
    ) -> None:
        if split not in _SPLIT_OFFSETS:
            raise ValueError(f"split must be one of {sorted(_SPLIT_OFFSETS)}, got {split!r}")
        for i, rows in enumerate(num_embeddings_per_feature):
            if rows < 1:
                raise ValueError(f"table of feature cat_{i} must have at least 1 row, got {rows}")
        for name, value in (("num_batches", num_batches), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if num_dense_features < 1 or ids_per_feature < 1:
            raise ValueError("num_dense_features and ids_per_feature must be positive")
        self.num_embeddings_per_feature = list(num_embeddings_per_feature)
        self.feature_names = [f"cat_{i}" for i in range(len(self.num_embeddings_per_feature))]
        self.num_batches = num_batches
        self.batch_size = batch_size
        self.num_dense_features = num_dense_features
        self.ids_per_feature = ids_per_feature
        self.seed = seed
        self.split = split
        self.signal_strength = signal_strength
        self.skew = skew
        self.hidden_dim = hidden_dim
        rule = torch.Generator().manual_seed(seed)
        # Dense features carry a weaker signal than the ids, so learning shows in the tables.
        self.dense_weights = (
            0.5 * torch.randn(num_dense_features, generator=rule) / math.sqrt(num_dense_features)
        )
        self.bias = -0.5

    def __len__(self) -> int:
        return self.num_batches

    def id_vectors(self, feature_index: int, ids: torch.Tensor) -> torch.Tensor:
        """The hidden vector in [-1, 1]^k of each id of one feature.

        Args:
            feature_index: which sparse feature.
            ids: int64 ids, shape ``[n]``.

        Returns:
            Float vectors, shape ``[n, k]``.
        """
        base = self.seed * 1_000_003 + feature_index * 7_919
        return torch.stack(
            [_hash_unit(ids, salt=(base + j * 104_729) & _MASK32) for j in range(self.hidden_dim)],
            dim=1,
        )

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range for {self.num_batches} batches")
        g = torch.Generator().manual_seed(
            self.seed * 7_777_777 + _SPLIT_OFFSETS[self.split] + index
        )
        b = self.batch_size
        dense = torch.randn(b, self.num_dense_features, generator=g)
        logit = dense @ self.dense_weights + self.bias
        lengths, values, pooled = [], [], []
        for f, rows in enumerate(self.num_embeddings_per_feature):
            lens = torch.randint(1, 2 * self.ids_per_feature, (b,), generator=g)
            u = torch.rand(int(lens.sum()), generator=g)
            ids = torch.clamp((rows * u.pow(self.skew)).long(), max=rows - 1)
            sample = torch.repeat_interleave(torch.arange(b), lens)
            sums = torch.zeros(b, self.hidden_dim).index_add_(0, sample, self.id_vectors(f, ids))
            pooled.append(sums / lens.unsqueeze(1))
            lengths.append(lens)
            values.append(ids)
        h = torch.stack(pooled, dim=1)  # [B, F, k]
        gram = h @ h.transpose(1, 2)
        n_feat = h.shape[1]
        pairs = torch.triu_indices(n_feat, n_feat, offset=1)
        interaction = gram[:, pairs[0], pairs[1]].sum(dim=1)
        if n_feat > 1:
            logit = logit + self.signal_strength * interaction / interaction.std().clamp_min(1e-6)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.feature_names,
            values=torch.cat(values),
            lengths=torch.cat(lengths).to(torch.int32),
        )
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


class SyntheticClickData(LightningDataModule):
    """Lightning data module of learnable synthetic click data for DLRM-style models.

    Every feature ``cat_i`` reads its own table of ``num_embeddings`` rows (or the per-feature
    sizes in ``num_embeddings_per_feature``). Lightning's ``DistributedSampler`` gives each rank
    its own batches.

    Args:
        num_embeddings: rows of every table (ignored when ``num_embeddings_per_feature`` is set).
        num_sparse_features: number of sparse features (tables).
        num_embeddings_per_feature: explicit table sizes, one per feature.
        num_dense_features: width of the dense features.
        ids_per_feature: mean ids per feature and sample.
        batch_size: samples per batch on each rank.
        train_batches: batches in the training split (over all ranks).
        val_batches: batches in the validation split.
        test_batches: batches in the test split.
        seed: fixes the hidden rule and every sample.
        signal_strength: how strongly ids drive clicks.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        num_embeddings: int = 10_000,
        num_sparse_features: int = 8,
        num_embeddings_per_feature: list[int] | None = None,
        num_dense_features: int = 13,
        ids_per_feature: int = 4,
        batch_size: int = 512,
        train_batches: int = 400,
        val_batches: int = 40,
        test_batches: int = 40,
        seed: int = 0,
        signal_strength: float = 2.0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.num_embeddings_per_feature = (
            list(num_embeddings_per_feature)
            if num_embeddings_per_feature is not None
            else [num_embeddings] * num_sparse_features
        )
        self.feature_names = [f"cat_{i}" for i in range(len(self.num_embeddings_per_feature))]
        self.num_dense_features = num_dense_features
        self.ids_per_feature = ids_per_feature
        self.batch_size = batch_size
        self.split_batches = {"train": train_batches, "val": val_batches, "test": test_batches}
        self.seed = seed
        self.signal_strength = signal_strength
        self.num_workers = num_workers

    def dataset(self, split: str) -> SyntheticClickDataset:
        """The dataset of one split.

        Args:
            split: ``train``, ``val``, ``test`` or ``predict`` (``predict`` uses the test size).

        Returns:
            The dataset.
        """
        return SyntheticClickDataset(
            self.num_embeddings_per_feature,
            num_batches=self.split_batches["test" if split == "predict" else split],
            batch_size=self.batch_size,
            num_dense_features=self.num_dense_features,
            ids_per_feature=self.ids_per_feature,
            seed=self.seed,
            split=split,
            signal_strength=self.signal_strength,
        )

    def _loader(self, split: str, shuffle: bool) -> DataLoader[Batch]:
        return DataLoader(
            self.dataset(split),
            batch_size=None,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader[Batch]:
        """Shuffled training batches (Lightning adds the per-rank sampler)."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader[Batch]:
        """Validation batches."""
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader[Batch]:
        """Test batches."""
        return self._loader("test", shuffle=False)

    def predict_dataloader(self) -> DataLoader[Batch]:
        """Prediction batches (the test samples).

        Read through a batch sampler of one whole batch at a time, so Lightning records which
        batches each rank predicted: a ``BasePredictionWriter`` gets ``batch_indices`` ``[k]``
        for the dataset's batch ``k`` (with ``batch_size=None`` there is no batch sampler and
        Lightning passes none).
        """
        return DataLoader(
            self.dataset("predict"),
            batch_size=1,
            shuffle=False,
            collate_fn=only_item,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
