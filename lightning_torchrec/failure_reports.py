"""A failing rank's own error, told to the ranks that see it only as a dead peer.

A rank that raises alone (a bug in a user's hook, a file only it reads) leaves the other ranks
waiting inside a collective. They learn of it when its process exits and its sockets close
("Connection closed by peer"), or at the collective timeout, and without more would raise a
:class:`~lightning_torchrec.errors.PeerFailureError` that can only say "another rank probably
died". So, before it exits, the failing rank writes its error's type, message and step under one
key of the job's store (:func:`post`; the store the ranks rendezvoused in, served by rank 0 or by
torchrun's agent), and a rank whose collective failed reads it (:func:`explain`): it raises an
error of the failing rank's type (when that type is importable here and takes a message) that is
also a ``PeerFailureError``, saying which rank failed, where, and with what. A rank that died
without writing (killed, out of memory) still gives a plain ``PeerFailureError``.

The key is cleared by rank 0 when a run sets up (:func:`clear`, before the set-up's
collectives), so a later run in the same processes never reads an earlier run's failure.
Everything here is best effort: a store that cannot be reached leaves the error as it was.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from lightning_torchrec.compat.c10d import default_store
from lightning_torchrec.errors import PeerFailureError

#: The store key the failing ranks append their reports to (one JSON line each).
KEY = "lightning_torchrec/failures"
#: The longest message kept from a report.
MESSAGE_CHARS = 1000


def clear(rank: int, store: Any = None) -> None:
    """Forgets earlier runs' reports. Call on every rank before the run's first collective.

    Args:
        rank: this rank (only rank 0 clears).
        store: the store (default: the default process group's).
    """
    store = store if store is not None else default_store()
    if rank != 0 or store is None:
        return
    try:
        store.delete_key(KEY)
    except Exception:  # noqa: BLE001 - best effort: a store that cannot be reached
        pass


def post(error: BaseException, rank: int, where: str, store: Any = None) -> None:
    """Writes this rank's error where its peers look when their collective fails.

    Errors that are themselves a peer's failure (:class:`PeerFailureError`) are not written:
    they are a consequence, not a cause. The same error is written once.

    Args:
        error: the exception this rank is failing with.
        rank: this rank.
        where: where it was raised, for the peers' message (e.g. ``"global step 3"``).
        store: the store (default: the default process group's).
    """
    store = store if store is not None else default_store()
    if (
        store is None
        or isinstance(error, PeerFailureError)
        or getattr(error, "reported_to_peers", False)
    ):
        return
    kind = type(error)
    report = {
        "rank": rank,
        "module": kind.__module__,
        "qualname": kind.__qualname__,
        "message": str(error)[:MESSAGE_CHARS],
        "where": where,
    }
    try:
        store.append(KEY, json.dumps(report) + "\n")
        error.reported_to_peers = True  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - best effort: the peers then say "probably died"
        pass


def read(store: Any = None) -> list[dict[str, Any]]:
    """The reports written since the run set up, first written first.

    Args:
        store: the store (default: the default process group's).

    Returns:
        One dict per report (``rank``, ``module``, ``qualname``, ``message``, ``where``); empty
        when none was written or the store cannot be reached.
    """
    store = store if store is not None else default_store()
    if store is None:
        return []
    try:
        if not store.check([KEY]):
            return []
        lines = bytes(store.get(KEY)).decode("utf-8", "replace").splitlines()
    except Exception:  # noqa: BLE001 - best effort: the rank holding the store died too
        return []
    reports = []
    for line in lines:
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and isinstance(report.get("rank"), int):
            reports.append(report)
    return reports


def explain(failure: PeerFailureError, seen: str = "", store: Any = None) -> PeerFailureError:
    """``failure``, or, when a failing rank reported its error, an error that says which.

    Args:
        failure: the error for a collective that failed because a peer did.
        seen: how the failure showed on this rank (the collective's own error), for the message.
        store: the store (default: the default process group's).

    Returns:
        ``failure`` when no rank reported; else a ``PeerFailureError`` that is also of the first
        reporting rank's error type where it can be (see the module), whose message names every
        reporting rank, where it failed, and its error, then ``seen``.
    """
    reports = read(store)
    if not reports:
        return failure
    told = "; ".join(
        f"rank {r['rank']} raised {r.get('qualname', '?')} at {r.get('where', '?')}: "
        f"{r.get('message', '')}"
        for r in reports
    )
    text = f"stopped because another rank failed: {told}" + (
        f" (seen here as: {seen})" if seen else ""
    )
    return _as_peer_error(_resolve(reports[0]), text)


def _resolve(report: dict[str, Any]) -> type | None:
    """The report's error type when its module is already imported here (nothing is imported)."""
    found: Any = sys.modules.get(str(report.get("module")))
    for part in str(report.get("qualname", "")).split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


def _reduce(error: BaseException) -> tuple[type, tuple[str]]:
    return PeerFailureError, (str(error),)  # the combined class is not importable by name


def _as_peer_error(kind: type | None, text: str) -> PeerFailureError:
    """A ``PeerFailureError`` that is also a ``kind`` (when ``kind`` allows it)."""
    if kind is None or not issubclass(kind, Exception) or issubclass(kind, PeerFailureError):
        return PeerFailureError(text)
    try:
        names = {"__module__": kind.__module__, "__qualname__": kind.__qualname__}
        both = type(kind.__name__, (kind, PeerFailureError), {**names, "__reduce__": _reduce})
        error = both(text)
    except Exception:  # noqa: BLE001 - a type that takes other arguments, or cannot be mixed
        return PeerFailureError(text)
    return error if error.args[:1] == (text,) else PeerFailureError(text)
