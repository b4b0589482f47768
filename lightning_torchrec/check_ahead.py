"""Batch checks off the step's critical path: run on a background thread as batches are drawn.

Validating a batch reads every id (on GPU runs with large batches, millions per step), on the
host. Lightning draws batch ``i + 1`` from the dataloader while step ``i`` runs (its fetcher
prefetches one batch to know which is last), and a train pipeline reads further ahead: so the
check of a batch can run on a second thread while the current step runs, and the step that
needs the verdict only collects it. :class:`CheckAhead` wraps the dataloaders
(:meth:`CheckAhead.feed`); the strategy's per-step vote asks :meth:`CheckAhead.take` for a
batch's verdict and checks synchronously any batch it has not seen (a batch replaced by a
``on_before_batch_transfer`` hook, say). The verdict is agreed by all ranks before the batch
travels, exactly as a synchronous check's.

A batch is checked as it was when it left the dataloader: change batches in the dataset or
``on_before_batch_transfer`` (which returns a new batch), not in place in a later hook. A new
iterator of a wrapped loader waits for running checks first: its worker processes are forked
while the check thread is idle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

#: Pending checks kept at most (batches drawn but never stepped on, e.g. after ``max_steps``).
LIMIT = 64


class CheckAhead:
    """Runs ``check(batch)`` on a background thread for every batch a wrapped loader yields.

    Args:
        check: returns a problem description for a bad batch, or None for a good one.
    """

    def __init__(self, check: Callable[[Any], str | None]) -> None:
        self._check = check
        self._pool: ThreadPoolExecutor | None = None
        self._pending: OrderedDict[int, tuple[Any, Future[str | None]]] = OrderedDict()

    def submit(self, batch: Any) -> None:
        """Starts checking ``batch`` in the background.

        Args:
            batch: a batch just drawn from a dataloader.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lightning_torchrec-checks")
        # The batch is held with its future, so its id is not reused while pending.
        self._pending[id(batch)] = (batch, self._pool.submit(self._check, batch))
        while len(self._pending) > LIMIT:
            self._pending.popitem(last=False)

    def take(self, batch: Any) -> tuple[bool, str | None]:
        """The verdict on ``batch``, waiting for its check if it still runs.

        Args:
            batch: a batch a wrapped loader yielded.

        Returns:
            ``(True, problem or None)``; ``(False, None)`` for a batch never submitted.

        Raises:
            Exception: whatever the check itself raised (not a verdict: a bug to see).
        """
        entry = self._pending.pop(id(batch), None)
        if entry is None or entry[0] is not batch:
            return False, None
        return True, entry[1].result()

    def wait_idle(self) -> None:
        """Waits until no check runs (before a dataloader forks its worker processes)."""
        wait([future for _, future in self._pending.values()])

    def clear(self) -> None:
        """Forgets every pending check (a new stage starts)."""
        self._pending.clear()

    def close(self) -> None:
        """Stops the background thread."""
        self.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def feed(self, loader: Any) -> CheckedLoader:
        """Wraps a dataloader so every batch it yields is checked in the background.

        Args:
            loader: the dataloader.

        Returns:
            The wrapped loader.
        """
        return CheckedLoader(loader, self)


class CheckedLoader:
    """A dataloader whose batches :class:`CheckAhead` checks as they are drawn.

    Everything but iteration is the wrapped loader's (``len``, ``sampler``, ``dataset``,
    ``state_dict``, ...).

    Args:
        loader: the dataloader.
        checks: the checker.
    """

    def __init__(self, loader: Any, checks: CheckAhead) -> None:
        self.loader = loader
        self.checks = checks

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        # A new iterator may fork worker processes: never while the check thread is inside
        # torch (a forked child would inherit the locks it holds).
        self.checks.wait_idle()
        for batch in self.loader:
            self.checks.submit(batch)
            yield batch
