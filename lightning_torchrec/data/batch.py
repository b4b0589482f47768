"""The batch type the module and the demo use: TorchRec's ``Batch`` plus optional sample weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


def _device(value: object) -> torch.device | None:
    """Where a tensor or a TorchRec tensor type lives (``device`` is a method on the latter)."""
    device = getattr(value, "device", None)
    return device() if callable(device) else device


def host_to_accelerator(source: torch.device, target: torch.device) -> bool:
    """Whether a copy from ``source`` to ``target`` goes from the host to an accelerator.

    Args:
        source: where the tensors are.
        target: where they go.

    Returns:
        True for a CPU-to-accelerator copy (safe to issue without blocking).
    """
    return source.type == "cpu" and target.type not in ("cpu", "meta")


class TensorFields(Pipelineable):
    """Device moves, streams and pinning for a dataclass batch whose fields are tensors or KJTs.

    A field may be None (e.g. no sample weights); it stays None.
    """

    def _fields(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def _map(self, fn: Callable[[object], object]) -> TensorFields:
        return type(self)(**{k: None if v is None else fn(v) for k, v in self._fields().items()})

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> TensorFields:
        """Moves every tensor of the batch to ``device``.

        Args:
            device: the target device.
            non_blocking: passed to ``Tensor.to``; None (the default) means True from the host
                to an accelerator and False otherwise. Lightning moves a batch with
                ``batch.to(device)``: a blocking copy would make the host wait for the GPU
                queue at every step, while a non-blocking one from pinned memory is queued
                before the step's kernels on the same stream.

        Returns:
            A new batch on ``device``, or this batch when all of it is there already (as
            ``Tensor.to`` does: no new objects, and a KeyedJaggedTensor keeps its cached
            offsets).
        """
        target, fields = torch.device(device), self._fields()
        if all(v is None or _device(v) == target for v in fields.values()):
            return self
        if non_blocking is None:
            labels = fields["labels"]
            assert isinstance(labels, torch.Tensor)
            non_blocking = host_to_accelerator(labels.device, target)
        return self._map(lambda t: t.to(device=device, non_blocking=non_blocking))  # type: ignore[attr-defined]

    def record_stream(self, stream: torch.Stream) -> None:
        """Marks every tensor as used by ``stream`` (for TorchRec's pipelined training).

        Args:
            stream: the CUDA stream.
        """
        for value in self._fields().values():
            if value is not None:
                value.record_stream(stream)  # type: ignore[attr-defined]

    def pin_memory(self) -> TensorFields:
        """Returns a copy of the batch in pinned host memory.

        Returns:
            The pinned batch, with the attributes set on this one (e.g. the verdict a DataLoader
            worker attached, see ``lightning_torchrec.training.worker_checks``).
        """
        pinned = self._map(lambda t: t.pin_memory())  # type: ignore[attr-defined]
        fields = self._fields()
        vars(pinned).update({k: v for k, v in vars(self).items() if k not in fields})
        return pinned


@dataclass
class Batch(TensorFields):
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
