"""The batch type the module and the demo use: TorchRec's ``Batch`` plus optional sample weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


def host_to_accelerator(source: torch.device, target: torch.device) -> bool:
    """Whether a copy from ``source`` to ``target`` goes from the host to an accelerator.

    Args:
        source: where the tensors are.
        target: where they go.

    Returns:
        True for a CPU-to-accelerator copy (safe to issue without blocking).
    """
    return source.type == "cpu" and target.type not in ("cpu", "meta")


@dataclass
class Batch(Pipelineable):
    """A recommendation batch in TorchRec's layout, with optional per-sample weights.

    It has the fields of ``torchrec.datasets.utils.Batch`` (so TorchRec models and train
    pipelines accept it) and the ``weights`` field of the-algorithm-ml's batches.

    Attributes:
        dense_features: ``[B, num_dense]`` float features.
        sparse_features: ids per sparse feature, ``[F x B x L]``.
        labels: ``[B]`` click labels (0/1, any float dtype).
        weights: ``[B]`` sample weights for the loss, or None for weight 1.
    """

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor
    weights: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> Batch:
        """Moves every tensor of the batch to ``device``.

        Args:
            device: the target device.
            non_blocking: passed to ``Tensor.to``; None (the default) means True from the host
                to an accelerator and False otherwise. Lightning moves a batch with
                ``batch.to(device)``: a blocking copy would make the host wait for the GPU
                queue at every step, while a non-blocking one from pinned memory is queued
                before the step's kernels on the same stream.

        Returns:
            A new batch on ``device``.
        """
        if non_blocking is None:
            non_blocking = host_to_accelerator(self.dense_features.device, torch.device(device))
        return Batch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            weights=None
            if self.weights is None
            else self.weights.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        """Marks every tensor as used by ``stream`` (for TorchRec's pipelined training).

        Args:
            stream: the CUDA stream.
        """
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)
        if self.weights is not None:
            self.weights.record_stream(stream)

    def pin_memory(self) -> Batch:
        """Returns a copy of the batch in pinned host memory.

        Returns:
            The pinned batch, with the attributes set on this one (e.g. the verdict a DataLoader
            worker attached, see ``lightning_torchrec.training.worker_checks``).
        """
        pinned = Batch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
            weights=None if self.weights is None else self.weights.pin_memory(),
        )
        fields = {f.name for f in dataclasses.fields(self)}
        vars(pinned).update({k: v for k, v in vars(self).items() if k not in fields})
        return pinned
