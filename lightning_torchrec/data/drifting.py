"""Generated hourly click partitions whose click rule drifts: what online training is for.

Each sparse feature ``c<f>`` draws one id per sample from a skewed (popularity-like) distribution
over its table. Every id has a score that turns with time: at partition ``t`` it is
``a[id] * cos(w * t) + b[id] * sin(w * t)`` (``a``, ``b`` fixed random per id, ``w`` the drift per
partition), so after ``pi / (2 w)`` partitions an id's score is unrelated to the one it started
with. The click probability is ``sigmoid(strength * mean of the sample's id scores * sqrt(F) +
dense @ v + bias)``. A model trained up to partition ``t`` predicts partition ``t + 1`` well; a
model left at partition 0 predicts it worse and worse: freshness pays.

Partition ``t`` depends only on ``(seed, t)``: a writer thread can produce the stream while a
trainer reads it, and two runs see the same data. :meth:`DriftingClicks.write` writes a partition
as a Parquet directory named by its hour (``hour=2026-11-29T04``): written under a hidden name,
renamed, then marked complete with a ``_SUCCESS`` file.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lightning_torchrec.data.stream import READY_MARKER

__all__ = ["DriftingClicks"]


class DriftingClicks:
    """Hourly click partitions under a drifting rule (see the module docstring).

    Args:
        num_embeddings: rows of each feature's table.
        num_sparse_features: sparse features (columns ``c0``, ``c1``, ...).
        num_dense_features: dense features (columns ``d0``, ``d1``, ...).
        rows_per_partition: samples in each partition.
        drift: the angle (radians) the id scores turn by per partition.
        strength: how strongly the ids drive the click probability.
        skew: ids are ``floor(rows * u ** skew)``; larger means a few ids dominate.
        seed: fixes the rule and the samples.
        start: the hour of partition 0.

    Raises:
        ValueError: for a non-positive size.
    """

    def __init__(
        self,
        num_embeddings: int = 2000,
        num_sparse_features: int = 4,
        num_dense_features: int = 13,
        rows_per_partition: int = 4096,
        drift: float = math.pi / 10,
        strength: float = 2.0,
        skew: float = 3.0,
        seed: int = 0,
        start: dt.datetime = dt.datetime(2026, 11, 29),
    ) -> None:
        for name, value in (
            ("num_embeddings", num_embeddings),
            ("num_sparse_features", num_sparse_features),
            ("rows_per_partition", rows_per_partition),
        ):
            if value < 1:
                raise ValueError(f"DriftingClicks needs {name} >= 1, got {value}")
        if num_dense_features < 0:
            raise ValueError(
                f"DriftingClicks needs num_dense_features >= 0, got {num_dense_features}"
            )
        self.num_embeddings = num_embeddings
        self.num_sparse_features = num_sparse_features
        self.num_dense_features = num_dense_features
        self.rows_per_partition = rows_per_partition
        self.drift = drift
        self.strength = strength
        self.skew = skew
        self.seed = seed
        self.start = start
        rng = np.random.default_rng(seed)
        shape = (num_sparse_features, num_embeddings)
        self._a = rng.standard_normal(shape).astype(np.float32)
        self._b = rng.standard_normal(shape).astype(np.float32)
        self._v = (
            rng.standard_normal(num_dense_features) / max(num_dense_features, 1) ** 0.5
        ).astype(np.float32)

    @property
    def dense_columns(self) -> list[str]:
        """The dense feature columns, in order."""
        return [f"d{i}" for i in range(self.num_dense_features)]

    @property
    def sparse_columns(self) -> list[str]:
        """The id columns, in order (one id per sample each)."""
        return [f"c{f}" for f in range(self.num_sparse_features)]

    def name(self, t: int) -> str:
        """The directory name of partition ``t``: its hour.

        Args:
            t: the partition's index.

        Returns:
            ``hour=YYYY-MM-DDTHH``.
        """
        return f"hour={(self.start + dt.timedelta(hours=t)).strftime('%Y-%m-%dT%H')}"

    def scores(self, t: int) -> np.ndarray:
        """Every id's score at partition ``t``.

        Args:
            t: the partition's index.

        Returns:
            ``float32 [features, rows]``.
        """
        angle = self.drift * t
        return self._a * math.cos(angle) + self._b * math.sin(angle)

    def table(self, t: int) -> pa.Table:
        """The samples of partition ``t``.

        Args:
            t: the partition's index.

        Returns:
            Columns ``d*`` (float32), ``c*`` (int64) and ``label`` (float32 0/1).
        """
        rng = np.random.default_rng([self.seed, t])
        n, rows = self.rows_per_partition, self.num_embeddings
        u = rng.random((self.num_sparse_features, n))
        ids = np.minimum((rows * u**self.skew).astype(np.int64), rows - 1)
        dense = rng.standard_normal((n, self.num_dense_features)).astype(np.float32)
        scores = np.take_along_axis(self.scores(t), ids, axis=1).mean(0)
        logit = self.strength * scores * self.num_sparse_features**0.5 + dense @ self._v - 1.0
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        columns = {c: dense[:, i] for i, c in enumerate(self.dense_columns)}
        columns |= {c: ids[f] for f, c in enumerate(self.sparse_columns)}
        columns["label"] = labels
        return pa.table(columns)

    def write(self, root: str | os.PathLike[str], t: int, row_group_size: int = 1024) -> Path:
        """Writes partition ``t`` under ``root`` so that it appears complete at once.

        Args:
            root: the stream's directory (created if missing).
            t: the partition's index.
            row_group_size: rows per Parquet row group.

        Returns:
            The partition's directory.
        """
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        final = root / self.name(t)
        hidden = root / f".{self.name(t)}.writing"
        hidden.mkdir(exist_ok=True)
        pq.write_table(self.table(t), hidden / "part-00000.parquet", row_group_size=row_group_size)
        os.replace(hidden, final)
        (final / READY_MARKER).touch()  # last: a reader never sees a marked, unfinished partition
        return final
