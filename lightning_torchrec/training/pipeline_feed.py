"""The batches a train pipeline reads ahead of Lightning, and their checks before they travel.

A TorchRec pipeline reads batches before Lightning's step reaches them and starts their sparse
input all-to-all (and, semi-sync, their embedding lookup) steps early. A batch must be validated
and its verdict agreed by every rank *before* that happens, not at its own step: a malformed
batch on one rank can break a collective the others are already in. :class:`Lookahead` lets the
strategy read those batches first: at each step it returns the batches the coming ``progress()``
will send, so the step's one vote covers them. :class:`Peek` reads one batch ahead for the
unpipelined step, whose vote on the next batch runs during the current step.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any


class Split:
    """One iterator read from two sides, each side getting every item once, in order.

    Unlike ``itertools.tee``, which frees its items in blocks of 57, an item is held only until
    both sides have taken it: a side reading ahead holds one batch or two, not a block of them.
    A side that is dropped (a pipeline given up, a reader no longer needed) stops holding items
    for itself: the other side goes on alone.

    Args:
        source: the iterator to share.
    """

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._waiting: tuple[deque[Any], deque[Any]] = (deque(), deque())
        self._dropped = [False, False]
        self._ended = False

    def sides(self) -> tuple[Iterator[Any], Iterator[Any]]:
        """The two sides.

        Returns:
            Two iterators over the source's items.
        """
        return _Side(self, 0), _Side(self, 1)

    def take(self, side: int) -> Any:
        """The next item of ``side``.

        Args:
            side: 0 or 1.

        Returns:
            The item.

        Raises:
            StopIteration: after the source's last item.
        """
        mine = self._waiting[side]
        if mine:
            return mine.popleft()
        if self._ended:
            raise StopIteration
        try:
            item = next(self._source)
        except StopIteration:
            self._ended = True
            raise
        if not self._dropped[1 - side]:
            self._waiting[1 - side].append(item)
        return item

    def drop(self, side: int) -> None:
        """Forgets ``side``: what it has not taken is released, and nothing more is kept for it.

        Args:
            side: 0 or 1.
        """
        self._dropped[side] = True
        self._waiting[side].clear()

    def close(self) -> None:
        """Ends the source now, for both sides (at the end of a stage).

        A multi-worker loader's iterator left to the garbage collector (this object sits in
        reference cycles with the strategy) is finalized after its queues: its workers never
        get the word to exit, and its shutdown waits 5 s for each before killing it. Ended
        here, its workers exit at once. A generator source (a loader whose ``__iter__``
        yields) is closed, which ends the iterator it holds.
        """
        source, self._source = self._source, iter(())
        self._ended = True
        for waiting in self._waiting:
            waiting.clear()
        if inspect.isgenerator(source):
            source.close()


class _Side:
    def __init__(self, split: Split, side: int) -> None:
        self._split, self._side = split, side

    def __iter__(self) -> _Side:
        return self

    def __next__(self) -> Any:
        return self._split.take(self._side)

    def __del__(self) -> None:
        self._split.drop(self._side)

    def close(self) -> None:
        self._split.close()


class _Reader:
    """What reads one side of an epoch's batches ahead of Lightning."""

    _batches: Iterator[Any]

    def close(self) -> None:
        """Ends the epoch's iterator, for both sides (see :meth:`Split.close`)."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


class Lookahead(_Reader):
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
        #: Whether :meth:`ahead` found the epoch's end (fewer batches than it reads ahead).
        self.exhausted = False

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

        Call once per step, before that step's ``progress()`` (or, voting ahead, after the
        previous step's forward).

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
                self.exhausted = True
                break
            self._buffer.append(batch)
            self._unchecked.append((self._read, batch))
            self._read += 1
        found, self._unchecked = self._unchecked, []
        return [(self._first_index + position, batch) for position, batch in found]


class Peek(_Reader):
    """An epoch's batches read one step ahead of their consumer, and kept by it alone.

    Args:
        batches: the reader's side of the epoch's batches (the consumer has the other side).
    """

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches
        self._first: int | None = None
        self._read = 0
        self._last: Any = None
        self._ended = False

    def after(self, batch_idx: int) -> tuple[bool, Any]:
        """Reads up to the batch after ``batch_idx`` (the current one).

        Call at each step: batches passed over are dropped here, so none is held twice.

        Args:
            batch_idx: Lightning's index of the current batch in the epoch.

        Returns:
            ``(True, batch)`` with the next batch, or ``(False, None)`` at the epoch's end.
        """
        if self._first is None:
            self._first = batch_idx
        wanted = batch_idx - self._first + 1
        while not self._ended and self._read <= wanted:
            try:
                self._last = next(self._batches)
            except StopIteration:
                self._ended, self._last = True, None
            self._read += 1
        return (False, None) if self._ended else (True, self._last)


class PipelineFeed:
    """A dataloader whose batches a pipeline reads ahead of Lightning.

    Everything but iteration is the wrapped loader's (``len``, ``sampler``, ``dataset``, ...).
    Once the pipeline is dropped (``active()`` False), iteration is the loader's own: no batch
    is buffered for a reader that will never come.

    Args:
        loader: the dataloader.
        on_epoch: called with the reader's side (``reader(batches)``) whenever a new epoch's
            iterator is made.
        active: whether the reader still reads.
        reader: what reads ahead: :class:`Lookahead` (a pipeline) or :class:`Peek`.
    """

    def __init__(
        self,
        loader: Any,
        on_epoch: Callable[[Any], None],
        active: Callable[[], bool] = lambda: True,
        reader: Callable[[Iterator[Any]], Any] = Lookahead,
    ) -> None:
        self.loader = loader
        self.on_epoch = on_epoch
        self.active = active
        self.reader = reader

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        if not self.active():
            return iter(self.loader)
        lightning_side, reader_side = Split(iter(self.loader)).sides()
        self.on_epoch(self.reader(reader_side))
        return lightning_side


def epoch_ending(pipeline: Any, batch_idx: int, last: bool, steps: int = 0) -> tuple[int, bool]:
    """What the vote for the step ``steps`` after ``batch_idx``'s says of the epoch's end.

    The flag must be the same on every rank, else ``UnevenDataError`` names the flagged ranks
    as having ``index + 1`` batches. Unpipelined: Lightning's "no batch after this one". A
    pipeline's ``progress()`` sends the batch ``depth`` places ahead (sparse-dist 1, semi-sync
    2): a rank whose epoch ends before it (its read-ahead found the end) is flagged, as having
    that many, before any rank sends it (a batch only some ranks send mismatches collectives).

    Args:
        pipeline: the stage's pipeline (its ``depth`` and ``exhausted``), or None.
        batch_idx: the current batch's index in the epoch.
        last: whether this rank has no batch after the current one.
        steps: how many steps after the current one the vote is for.

    Returns:
        ``(index, flag)``: the batch index the message counts to, and this rank's flag.
    """
    if pipeline is None:
        return batch_idx, last
    return batch_idx + steps + pipeline.depth - 1, last or pipeline.exhausted
