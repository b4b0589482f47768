"""The sparse ids of Criteo batches: raw ids checked, or reduced modulo the table sizes.

:class:`~lightning_torchrec.data.criteo.CriteoIterableDataset` reads TorchRec's npy days with
TorchRec's reader; the ids of a raw day (int64, as preprocessed without table sizes) are either
passed through unchanged (``raw_ids=True``, checked here) or reduced here as the unsigned values
they hold (TorchRec's reader would reduce a negative int64 as the negative number).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.data.criteo_files import reduce_ids
from lightning_torchrec.errors import BatchValidationError

__all__ = ["check_raw_days", "raw_ids_of", "reduced_ids_of"]


def check_raw_days(sparse_files: Sequence[str], hashes: Sequence[int] | None) -> None:
    """Refuses ``raw_ids`` with table sizes, or with days whose ids were reduced on disk.

    Args:
        sparse_files: the days' ``*_sparse.npy`` files.
        hashes: the table sizes given, or None.

    Raises:
        ValueError: for table sizes, or naming a file whose ids are not raw int64 ids.
    """
    if hashes is not None:
        raise ValueError(
            "raw_ids=True yields the stored ids unchanged: pass num_embeddings_per_feature=None "
            f"(got table sizes {list(hashes)[:3]}...)"
        )
    for path in sparse_files:
        dtype = np.load(path, mmap_mode="r").dtype
        if dtype != np.int64:
            raise ValueError(
                f"raw_ids=True needs raw int64 ids, but {path} holds {dtype} ids (reduced modulo "
                "table sizes when preprocessed): preprocess without num_embeddings_per_feature"
            )


def reduced_ids_of(kjt: KeyedJaggedTensor, sizes: np.ndarray) -> KeyedJaggedTensor:
    """The batch with its ids (one per sample and feature) modulo the features' table sizes.

    Args:
        kjt: the batch's sparse features (one id per sample and feature, raw int64 ids).
        sizes: ``[F]`` table sizes.

    Returns:
        The features with ids in ``[0, size)``, reduced as unsigned values.
    """
    ids = reduce_ids(kjt.values().numpy().reshape(len(sizes), -1), sizes[:, None])
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=torch.from_numpy(ids.reshape(-1)),
        lengths=kjt.lengths(),
        offsets=kjt.offsets(),
        stride=kjt.stride(),
        length_per_key=kjt.length_per_key(),
        offset_per_key=kjt.offset_per_key(),
    )


def raw_ids_of(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The batch's raw ids; a negative one (a hex id of 64 bits) is refused, naming it.

    Args:
        kjt: the batch's sparse features.

    Returns:
        ``kjt`` unchanged.

    Raises:
        BatchValidationError: naming the feature and the id, for a negative id.
    """
    values = kjt.values()
    if values.numel() and int(values.min()) < 0:
        offsets = kjt.offset_per_key()
        first = int(torch.nonzero(values < 0)[0])
        key = next(k for k, end in zip(kjt.keys(), offsets[1:], strict=True) if first < end)
        raise BatchValidationError(
            f"feature {key}: raw id {int(values[first])} is negative (a hex id above 2**63 - 1); "
            "raw ids must be non-negative int64"
        )
    return kjt
