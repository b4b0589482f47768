"""A Fabric rank that fails alone tells the others what it raised, before its process ends.

A Fabric loop is the user's own: an error that one rank raises in it (a bug in its loss code, a
file only it reads) never passes through the strategy, and the other ranks, left waiting in the
step's collectives, would only learn that "another rank probably died". The Trainer's strategy
writes such an error to the job's store from its ``on_exception`` hook
(:mod:`~lightning_torchrec.failure_reports`); a loop of the user's own has no such hook, so the
strategy reports at the point where Python itself handles an error nobody caught:

* a script (``fabric.launch()``, ``torchrun``, ``srun``): while set up, the strategy is part of
  ``sys.excepthook`` (:class:`FailureHook`). Python calls it for an uncaught error before the
  traceback is printed and before the process group is torn down at exit, so the report is in
  the store before the peers' collectives fail. It is taken out at ``teardown`` (or when the
  strategy is garbage-collected); an error that the loop catches is not a failure and is not
  reported (the loop may report it itself with the strategy's ``report_failure``);
* a function launched with ``start_method="spawn"``/``"fork"`` (notebooks): torch's process
  wrapper catches the error before ``sys.excepthook`` could see it, so the strategy's launcher
  reports it (:class:`~lightning_torchrec.compat.lightning_fabric.ReportingLauncher`).

The peers then raise an error of the failing rank's type that is also a ``PeerFailureError``,
naming the rank, the Fabric step and the error, wherever they wait: the step's checks, the
backward, ``fabric.barrier``/``broadcast``/``all_reduce``/``all_gather`` or a checkpoint.
"""

from __future__ import annotations

import sys
import weakref
from types import TracebackType
from typing import Any


class FailureHook:
    """``sys.excepthook`` while a strategy is set up: reports the error, then hands it on.

    It holds the strategy weakly (the hook never keeps it alive) and calls the hook it replaced,
    which prints the traceback as before.

    Args:
        strategy: the strategy that reports (its ``report_failure``).
        previous: the hook it replaced.
    """

    def __init__(self, strategy: Any, previous: Any) -> None:
        self.strategy: Any = weakref.ref(strategy)
        self.previous = previous

    def __call__(
        self, kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> None:
        """Reports ``error`` through the strategy (if it is still set up), then prints it.

        Args:
            kind: the error's type.
            error: the error no one caught.
            tb: its traceback.
        """
        strategy = self.strategy() if self.strategy is not None else None
        if strategy is not None:
            try:
                strategy.report_failure(error)
            except Exception:  # noqa: BLE001 - best effort: the traceback must still be printed
                pass
        self.previous(kind, error, tb)

    def remove(self) -> None:
        """Takes the hook out of ``sys.excepthook`` (a pass-through where another wraps it)."""
        self.strategy = None
        if sys.excepthook is self:
            sys.excepthook = self.previous


def install_failure_hook(strategy: Any) -> FailureHook:
    """Puts ``strategy``'s :class:`FailureHook` in ``sys.excepthook``, until it is removed.

    Taken out at the strategy's ``teardown``, or when the strategy is garbage-collected.

    Args:
        strategy: the strategy that reports (its ``report_failure``).

    Returns:
        The hook (call its ``remove()``).
    """
    hook = FailureHook(strategy, sys.excepthook)
    sys.excepthook = hook
    weakref.finalize(strategy, hook.remove)  # a strategy never torn down: out when collected
    return hook
