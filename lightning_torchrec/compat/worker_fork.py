"""DataLoader workers forked next to gloo's threads without a deadlocked child (CPython < 3.12).

CPython up to 3.11 (3.11.7 here) re-initialises the interpreter's thread-list lock in a forked
child only after it has used it (python/cpython#112275, fixed in 3.12): a child forked while
another thread holds that lock waits for it forever, before it runs any Python. Gloo's worker
threads take the lock when they release the tensors of a collective that just finished: a
tensor whose Python object is freed there needs the GIL, and the thread first makes itself a
Python thread state, under that lock. A ``DataLoader`` with ``num_workers > 0`` forks its
workers right after the collectives that start each stage (Lightning's and the strategy's), so
now and then one worker never starts and its rank waits for a batch while the others wait in
the next collective. Measured with ``benchmarks/fork_race.py`` (2 gloo ranks, a process started
right after each ``all_gather_object``): 5 of 30,000 children hung.

:func:`fork_safely` gives a loader that would fork its workers a fork context whose processes
first release the GIL for :data:`QUIET_S` (:class:`QuietForkContext`): a gloo thread that is
about to release a finished collective's tensors does so, and gives its thread state back,
before the fork. In the same measurement none of 30,000 children hung. Workers start as before
(forked, with the parent's memory); only the start of each one waits those milliseconds (also
on a 3.11 release that carries the fix). On CPython 3.12 and later, and on other interpreters,
loaders are left alone.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from multiprocessing.context import ForkContext, ForkProcess
from typing import Any

#: Whether this interpreter can deadlock a child forked while a thread makes its thread state.
AFFECTED = sys.implementation.name == "cpython" and sys.version_info < (3, 12)

#: How long a worker's start releases the GIL before its fork (seconds).
QUIET_S = 0.005


class QuietForkProcess(ForkProcess):
    """A forked process that lets other threads give the GIL back before the fork."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 (multiprocessing's name)
        time.sleep(QUIET_S)  # releases the GIL: a gloo thread waiting for it finishes first
        return ForkProcess._Popen(process_obj)


class QuietForkContext(ForkContext):
    """``multiprocessing``'s fork context, with :class:`QuietForkProcess` processes."""

    Process = QuietForkProcess


def _forks(loader: Any) -> bool:
    context = getattr(loader, "multiprocessing_context", None)
    if context is None:  # the loader uses the process's start method (the platform's default)
        method = multiprocessing.get_start_method(allow_none=True)
        return (method or multiprocessing.get_all_start_methods()[0]) == "fork"
    return type(context) is ForkContext


def fork_safely(loader: Any) -> bool:
    """Makes ``loader`` fork its workers after other threads gave the GIL back (see the module).

    Only a ``DataLoader`` with ``num_workers > 0`` whose workers would be forked (its context is
    ``"fork"``, or unset where fork is the start method) is changed, and only on an
    :data:`AFFECTED` interpreter.

    Args:
        loader: a ``torch.utils.data.DataLoader`` (anything else is left alone).

    Returns:
        Whether the loader now forks through :class:`QuietForkContext`.
    """
    if not AFFECTED or getattr(loader, "num_workers", 0) <= 0:
        return False
    if isinstance(getattr(loader, "multiprocessing_context", None), QuietForkContext):
        return True
    if not _forks(loader):
        return False
    try:
        loader.multiprocessing_context = QuietForkContext()
    except (AttributeError, ValueError, TypeError):  # a loader that refuses a context
        return False
    return True
