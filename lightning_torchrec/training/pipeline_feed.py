"""The batches a train pipeline reads ahead of Lightning, and their checks before they travel.

A TorchRec pipeline reads batches before Lightning's step reaches them and starts their sparse
input all-to-all (and, semi-sync, their embedding lookup) steps early. A batch must be validated
and its verdict agreed by every rank *before* that happens, not at its own step: a malformed
batch on one rank can break a collective the others are already in. :class:`Lookahead` lets the
strategy read those batches first: at each step it returns the batches the coming ``progress()``
will send, so the step's one vote covers them.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any


class Lookahead:
    """An iterator over an epoch's batches that can be read ahead of its consumer (the pipeline).

    Args:
        batches: the pipeline's side of the epoch's batches.
    """

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches
        self._buffer: deque[Any] = deque()
        self._read = 0
        self._steps = 0
        self._unchecked: list[tuple[int, Any]] = []
        self._first_index: int | None = None

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self._buffer:
            return self._buffer.popleft()
        batch = next(self._batches)
        self._unchecked.append((self._read, batch))
        self._read += 1
        return batch

    def ahead(self, depth: int, batch_idx: int) -> list[tuple[int, Any]]:
        """Reads the batches the next step's ``progress()`` sends, and returns the new ones.

        Call once per step, before that step's ``progress()``.

        Args:
            depth: how many batches past the current one that ``progress()`` sends early (1 for
                sparse-dist, 2 for semi-sync).
            batch_idx: Lightning's index of the current batch in the epoch.

        Returns:
            ``(index in the epoch, batch)`` of every batch read since the last call (normally
            the one ``depth`` places ahead; at the first step, the first ``depth + 1``).
        """
        if self._first_index is None:
            self._first_index = batch_idx
        self._steps += 1
        while self._read < self._steps + depth:
            try:
                batch = next(self._batches)
            except StopIteration:
                break
            self._buffer.append(batch)
            self._unchecked.append((self._read, batch))
            self._read += 1
        found, self._unchecked = self._unchecked, []
        return [(self._first_index + position, batch) for position, batch in found]


class PipelineFeed:
    """A dataloader whose batches a pipeline reads ahead of Lightning.

    Everything but iteration is the wrapped loader's (``len``, ``sampler``, ``dataset``, ...).
    Once the pipeline is dropped (``active()`` False), iteration is the loader's own: no batch
    is buffered for a reader that will never come.

    Args:
        loader: the dataloader.
        on_epoch: called with the pipeline's :class:`Lookahead` whenever a new epoch's iterator
            is made.
        active: whether the pipeline still runs.
    """

    def __init__(
        self,
        loader: Any,
        on_epoch: Callable[[Lookahead], None],
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.loader = loader
        self.on_epoch = on_epoch
        self.active = active

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        if not self.active():
            return iter(self.loader)
        lightning_side, pipeline_side = itertools.tee(iter(self.loader), 2)
        self.on_epoch(Lookahead(pipeline_side))
        return lightning_side
