"""Batches moved to an accelerator by the Trainer glue (one process, no accelerator needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.compat.lightning_batches import move_batch


class OwnTo:
    """A user's type whose ``to`` takes the device only."""

    def __init__(self) -> None:
        self.moved_to: Any = None

    def to(self, device: torch.device) -> OwnTo:
        self.moved_to = device
        return self


@dataclass
class UserBatch:
    features: KeyedJaggedTensor
    extra: OwnTo


def test_torchrec_batches_move_to_an_accelerator_without_blocking(monkeypatch) -> None:
    """Lightning copied a KJT in a dict or a user's dataclass with a blocking ``kjt.to(device)``:
    on CUDA that waits for the previous step's kernels at every step."""
    calls: list[dict] = []
    original = KeyedJaggedTensor.to

    def spy(self: KeyedJaggedTensor, *args: Any, **kwargs: Any) -> KeyedJaggedTensor:
        calls.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KeyedJaggedTensor, "to", spy)
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    own = OwnTo()
    batch = {"user": UserBatch(kjt, own), "labels": torch.ones(2)}
    moved = move_batch(batch, torch.device("meta"))
    assert calls == [{"non_blocking": True}]
    assert moved["user"].features.values().device.type == "meta"
    assert moved["labels"].device.type == "meta" and own.moved_to == torch.device("meta")
    calls.clear()
    on_cpu = move_batch(batch, torch.device("cpu"))  # Lightning's own path: nothing to wait for
    assert calls == [{}] and on_cpu["user"].features is not None
