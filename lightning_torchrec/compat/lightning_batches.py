"""Batches moved to the device as Lightning moves them, without its blocking copies (lightning 2.x).

Lightning's ``move_data_to_device`` walks a batch's collections and calls ``.to(device)`` on
what it finds; it passes ``non_blocking=True`` to bare tensors only.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.apply_func import (
    _BLOCKING_DEVICE_TYPES,
    _TransferableDataType,
    move_data_to_device,
)
from lightning_utilities.core.apply_func import apply_to_collection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Pipelineable

#: Batch types whose ``.to`` takes ``non_blocking`` (see :func:`move_batch`).
NON_BLOCKING_TYPES = (torch.Tensor, KeyedJaggedTensor, JaggedTensor, KeyedTensor, Pipelineable)


def move_batch(batch: Any, device: torch.device) -> Any:
    """Lightning's ``move_data_to_device``, with non-blocking copies of TorchRec's types too.

    Lightning (2.0+) passes ``non_blocking=True`` to bare tensors only: a ``KeyedJaggedTensor``
    in a dict or a user's dataclass is copied with ``kjt.to(device)``, which on CUDA waits for
    everything queued on the GPU before it (the previous step) at every step. Tensors and
    TorchRec's ``KeyedJaggedTensor``, ``JaggedTensor``, ``KeyedTensor`` and ``Pipelineable``
    batches take ``non_blocking=True`` to an accelerator; any other ``.to`` is called as
    Lightning calls it. Collections are walked as Lightning walks them
    (``_TransferableDataType``).

    Args:
        batch: the batch.
        device: the target device.

    Returns:
        The batch on ``device``.
    """
    if device.type in _BLOCKING_DEVICE_TYPES:
        return move_data_to_device(batch, device)

    def move(data: Any) -> Any:
        blocking = not isinstance(data, NON_BLOCKING_TYPES)
        moved = data.to(device) if blocking else data.to(device, non_blocking=True)
        return data if moved is None else moved  # a `.to` that forgot to return self

    return apply_to_collection(batch, dtype=_TransferableDataType, function=move)
