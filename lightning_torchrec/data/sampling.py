"""Samplers: setting the epoch Lightning restored before the first iterator exists."""

from __future__ import annotations

from typing import Any


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """Sets ``epoch`` on every sampler of ``dataloader`` that has ``set_epoch``.

    Args:
        dataloader: a DataLoader (or anything with ``sampler``/``batch_sampler``).
        epoch: the epoch about to be iterated.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), batch_sampler):
        for s in (sampler, getattr(sampler, "sampler", None)):
            if callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)
