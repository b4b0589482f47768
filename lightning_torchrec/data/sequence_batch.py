"""The batch of next-item prediction: jagged item histories, the next items, candidate items.

One ``KeyedJaggedTensor`` carries three features that all read the one item table:

* ``item_seq``: each sample's history, oldest first, at most the model's ``max_length`` items
  (the batch checks refuse a longer one, see :class:`~lightning_torchrec.models.sequence.SASRec`);
* ``item_target``: each sample's next item (one id per sample);
* ``item_candidates``: the items to score against, all on the first sample (the others have
  length 0): sampled negatives in training, the whole catalogue in evaluation. One shared list
  costs one lookup of its rows per batch, whatever the batch size.

Sending the targets and candidates through the same ``EmbeddingCollection`` lookup as the
histories is what lets any sharding plan (table-, row- or column-wise) serve them: no rank needs
the whole table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.data.batch import TensorFields

ITEM_SEQ = "item_seq"
ITEM_TARGET = "item_target"
ITEM_CANDIDATES = "item_candidates"
#: The features of a :class:`SequenceBatch`, in the order of its ``KeyedJaggedTensor``.
SEQUENCE_FEATURES = (ITEM_SEQ, ITEM_TARGET, ITEM_CANDIDATES)


@dataclass
class SequenceBatch(TensorFields):
    """A batch of item histories with their next items.

    Attributes:
        sparse_features: the ``item_seq``, ``item_target`` and ``item_candidates`` features.
        labels: ``[B]`` int64 next items (the ``item_target`` ids).
        weights: ``[B]`` sample weights (0 for padding samples of an evaluation), or None for 1.
    """

    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor
    weights: torch.Tensor | None = None


def sequence_batch(
    histories: Sequence[np.ndarray],
    targets: np.ndarray,
    candidates: np.ndarray,
    weights: np.ndarray | None = None,
) -> SequenceBatch:
    """Builds a :class:`SequenceBatch` from per-sample histories.

    Args:
        histories: each sample's item history (int64, oldest first, at least one item).
        targets: ``[B]`` each sample's next item.
        candidates: ``[C]`` the items to score against (all on the first sample).
        weights: ``[B]`` sample weights, or None for 1.

    Returns:
        The batch.

    Raises:
        ValueError: for an empty batch, an empty history or mismatched sizes.
    """
    size = len(histories)
    if size == 0 or len(targets) != size:
        raise ValueError(f"need as many targets as histories (>0), got {len(targets)}, {size}")
    seq_lengths = np.array([len(h) for h in histories], dtype=np.int32)
    if int(seq_lengths.min()) < 1:
        raise ValueError(f"history {int(np.argmin(seq_lengths))} of the batch is empty")
    cand_lengths = np.zeros(size, dtype=np.int32)
    cand_lengths[0] = len(candidates)
    values = np.concatenate([*histories, targets, candidates]).astype(np.int64)
    lengths = np.concatenate([seq_lengths, np.ones(size, dtype=np.int32), cand_lengths])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(SEQUENCE_FEATURES),
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(lengths),
    )
    return SequenceBatch(
        sparse_features=kjt,
        labels=torch.from_numpy(np.asarray(targets, dtype=np.int64)),
        weights=None if weights is None else torch.as_tensor(weights, dtype=torch.float32),
    )
