"""Resuming an epoch of a map-style DataLoader after its first batches, without loading them.

A map-style ``DataLoader`` draws each epoch's batches from its *index sampler*: the batch sampler
(``batch_size`` given, or ``batch_sampler=``) or, with ``batch_size=None``, the sampler whose
every index is a whole batch. :class:`SkipBatches` wraps that index sampler so that its next
iteration leaves out its first ``k`` index batches: the dataset's ``__getitem__`` is never called
for them, the workers are never sent them, and the epoch goes on with batch ``k`` exactly as an
uninterrupted epoch would (the wrapped sampler is iterated in full, so a shuffle seeded by the
epoch draws the same permutation). Only that one iteration is shortened: the next epoch is whole.

:func:`skip_batches` installs the wrapper in a DataLoader that has not made its epoch's iterator
yet. The Trainer glue does this when a run resumes from a mid-epoch checkpoint (see
``docs/data.md``, "Mid-epoch resume of any DataLoader").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler


class SkipBatches(Sampler[Any]):
    """An index sampler whose next iteration leaves out its first ``skip`` items.

    Its length stays the wrapped sampler's (the whole epoch's): the training loop counts the
    skipped batches among the epoch's done ones.

    Args:
        batches: the DataLoader's batch sampler (lists of indices), or its sampler when every
            index is a whole batch.
        skip: how many of the next iteration's first items to leave out (each later
            iteration is whole).

    Raises:
        ValueError: if ``skip`` is negative.
    """

    def __init__(self, batches: Iterable[Any], skip: int) -> None:
        if skip < 0:
            raise ValueError(f"SkipBatches needs skip >= 0, got {skip}")
        self.batches = batches
        self.skip = int(skip)

    @property
    def sampler(self) -> Any:
        """The sampler under the wrapped one (what Lightning sets the epoch on)."""
        return getattr(self.batches, "sampler", self.batches)

    def set_epoch(self, epoch: int) -> None:
        """Passes the epoch on to the wrapped sampler, when it takes one.

        Args:
            epoch: the epoch about to be iterated.
        """
        set_epoch = getattr(self.batches, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        # A generator: the skip goes to the first iterator that is *read*. A DataLoader's
        # iterator asks its sampler for an iterator twice when made and reads only the second.
        skip, self.skip = self.skip, 0
        # The skipped items are index lists drawn from the wrapped sampler; nothing is loaded.
        yield from itertools.islice(iter(self.batches), skip, None)


def index_sampler_name(loader: Any) -> str | None:
    """Which attribute of a DataLoader holds the sampler its epochs' batches are drawn from.

    Args:
        loader: anything Lightning may train on.

    Returns:
        ``"batch_sampler"`` or ``"sampler"``; None for anything but a map-style
        ``DataLoader`` (an ``IterableDataset`` has no sampler to skip in).
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    return "batch_sampler" if loader.batch_sampler is not None else "sampler"


def skip_batches(loader: Any, count: int) -> bool:
    """Makes the next iteration of a map-style DataLoader start at its batch ``count``.

    Call it before the epoch's iterator is made. The loader's batch sampler (or, for
    ``batch_size=None``, its sampler) is wrapped in :class:`SkipBatches`; a wrapper installed
    before is replaced.

    Args:
        loader: the training DataLoader.
        count: batches of the epoch already trained on.

    Returns:
        True when the loader now skips them; False for a loader it cannot skip in (not a
        map-style ``DataLoader``, or one whose sampler cannot be replaced).
    """
    name = index_sampler_name(loader)
    if name is None:
        return False
    current = getattr(loader, name)
    if isinstance(current, SkipBatches):
        current = current.batches
    try:
        # DataLoader.__setattr__ refuses a new sampler once built, so that an iterator in flight
        # keeps its own; none exists yet (and a persistent one re-reads it at its next epoch).
        object.__setattr__(loader, name, SkipBatches(current, count))
    except (AttributeError, TypeError):  # a subclass with a read-only sampler
        return False
    return True
