"""A failing rank's own error, told to the ranks that see it only as a dead peer.

A rank that raises alone (a bug in a user's hook, a file only it reads) leaves the other ranks
waiting inside a collective. They learn of it when its process exits and its sockets close
("Connection closed by peer"), or at the collective timeout, and without more would raise a
:class:`~lightning_torchrec.errors.PeerFailureError` that can only say "another rank probably
died". So, before it exits, the failing rank writes its error's type, message and step to the
job's store (:func:`post`; the store the ranks rendezvoused in, served by rank 0 or by torchrun's
agent), and a rank whose collective failed reads it (:func:`explain`): it raises an error of the
failing rank's type (when that type is importable here and takes a message) that is also a
``PeerFailureError``, saying which rank failed, where, and with what. A rank that died without
writing (killed, out of memory) still gives a plain ``PeerFailureError``.

Rank 0 is a special case where it serves the store itself (Lightning's and Fabric's own
launchers; under torchrun the agent serves it): its store dies with it, before the others can
read what it wrote, and gloo has no way to close rank 0's connections earlier (aborting or
shutting down its group leaves them open). So rank 0 also copies its reports to a file on its
host (:func:`local_copy`, named by ``MASTER_ADDR`` and ``MASTER_PORT``, in a folder only its
user can write), and a rank that cannot reach the store reads that file instead, when it was
written after its own process started. Ranks on the same host, as under those launchers, so
learn rank 0's error too; ranks on other hosts still see a plain ``PeerFailureError``. A rank whose
``trainer.should_stop`` ended its training writes that too (:func:`post_stop`): the others, still
training, then name it.

Reports are kept per *run* (a Trainer's ``fit``, ``validate``, ...; :func:`begin_run`): each
rank counts its runs in the store, and since every rank sets up the same runs in the same order,
the counts agree without a collective. A report written late (a slow ``on_exception``) lands
under its own run and never explains a later run's failure. Everything here is best effort: a
store that cannot be reached leaves the error as it was.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_torchrec.compat.c10d import default_store
from lightning_torchrec.errors import PeerFailureError

#: The store keys: each rank's run count, and each run's reports (one JSON line each).
RUNS_KEY, KEY = "lightning_torchrec/runs/{rank}", "lightning_torchrec/failures/{run}"
#: A meeting's keys: each rank's count of meetings in a run, and what each rank posted at one.
MEETINGS_KEY, MEETING_KEY = (
    "lightning_torchrec/meetings/{run}/{rank}",
    "lightning_torchrec/meeting/{run}/{index}/{rank}",
)
#: When this process loaded the module: a local copy written before it is another job's.
_LOADED = time.time()
#: What a report keeps of a long message: its head and its tail (a worker's error ends with it).
HEAD_CHARS, TAIL_CHARS = 300, 700


def _rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _run_key(store: Any, rank: int | None, step: int) -> str:
    """This rank's current run's report key, after adding ``step`` to its run count."""
    return KEY.format(run=store.add(RUNS_KEY.format(rank=_rank(rank)), step))


def begin_run(rank: int | None = None, store: Any = None) -> None:
    """Starts a run: reports written from now on are this run's. Call on every rank.

    Args:
        rank: this rank (default: the default group's).
        store: the store (default: the default process group's).
    """
    store = store if store is not None else default_store()
    if store is None:
        return
    if _rank(rank) == 0:  # a new run: the last run's reports explain none of its failures
        _clear_local_copy()
    try:
        _run_key(store, rank, 1)
    except Exception:  # noqa: BLE001 - best effort: a store that cannot be reached
        pass


def post(error: BaseException, where: str, rank: int | None = None, store: Any = None) -> None:
    """Writes this rank's error where its peers look when their collective fails.

    Errors that are themselves a peer's failure (:class:`PeerFailureError`) are not written:
    they are a consequence, not a cause. The same error is written once.

    Args:
        error: the exception this rank is failing with.
        where: where it was raised, for the peers' message (e.g. ``"global step 3"``).
        rank: this rank (default: the default group's).
        store: the store (default: the default process group's).
    """
    store = store if store is not None else default_store()
    if (
        store is None
        or isinstance(error, PeerFailureError)
        or getattr(error, "reported_to_peers", False)
    ):
        return
    kind, message = type(error), str(error)
    if len(message) > HEAD_CHARS + TAIL_CHARS:
        message = f"{message[:HEAD_CHARS]} [...] {message[-TAIL_CHARS:]}"
    report = {
        "rank": _rank(rank),
        "module": kind.__module__,
        "qualname": kind.__qualname__,
        "message": message,
        "where": where,
    }
    if _append(store, rank, report):
        error.reported_to_peers = True  # type: ignore[attr-defined]


def post_stop(where: str, rank: int | None = None, store: Any = None) -> None:
    """Writes that this rank ended its training early (``trainer.should_stop``).

    A rank whose ``should_stop`` was set alone ends its fit while the others start the next
    step; they then find it gone, and name it (the stop itself is not an error on this rank).

    Args:
        where: where it stopped (e.g. ``"global step 3"``).
        rank: this rank (default: the default group's).
        store: the store (default: the default process group's).
    """
    store = store if store is not None else default_store()
    if store is not None:
        message = (
            "trainer.should_stop was set on it; set it on every rank at the same step (e.g. "
            "agreed with trainer.strategy.reduce_boolean_decision)"
        )
        _append(
            store, rank, {"rank": _rank(rank), "stopped": True, "message": message, "where": where}
        )


def _append(store: Any, rank: int | None, report: dict[str, Any]) -> bool:
    alone = dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1
    if _rank(rank) == 0 and not alone:  # its store may die with it: see the module
        _copy_locally(report)
    try:
        store.append(_run_key(store, rank, 0), json.dumps(report) + "\n")
    except Exception:  # noqa: BLE001 - best effort: the peers then say "probably died"
        return False
    return True


def local_copy() -> Path | None:
    """Where rank 0 copies its reports on its host, or None without ``MASTER_PORT``.

    The file is named by the store's address (``MASTER_ADDR``, ``MASTER_PORT``), which every
    rank of a job started by Lightning's, Fabric's or torch's launchers knows without the store,
    in a folder of the temporary directory named by the user.

    Returns:
        The file's path (it exists only after rank 0 reported).
    """
    port = os.environ.get("MASTER_PORT")
    if not port:
        return None
    user = os.getuid() if hasattr(os, "getuid") else 0
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{os.environ.get('MASTER_ADDR', '')}-{port}")
    return Path(tempfile.gettempdir()) / f"lightning_torchrec-{user}" / f"failures-{name}.jsonl"


def _copy_locally(report: dict[str, Any]) -> None:
    path = local_copy()
    if path is None:
        return
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        if not _private(path.parent):
            return
        lines = path.read_text("utf-8") if path.exists() else ""
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(lines + json.dumps(report) + "\n", "utf-8")
        os.replace(partial, path)  # a peer reads the old copy or the new one, never half
    except OSError:  # best effort: the peers then say "probably died"
        pass


def _private(folder: Path) -> bool:
    """Whether only this user can write ``folder`` (a copy elsewhere could be anyone's)."""
    if not hasattr(os, "getuid"):
        return folder.is_dir()
    info = folder.lstat()
    return folder.is_dir() and info.st_uid == os.getuid() and not info.st_mode & 0o022


def _clear_local_copy() -> None:
    path = local_copy()
    try:
        if path is not None and _private(path.parent):
            path.unlink(missing_ok=True)
    except OSError:  # best effort, as the copy itself: a folder that is not ours is left alone
        pass


def _read_local_copy() -> list[str]:
    """The lines of rank 0's local copy, when it was written after this process started."""
    path = local_copy()
    try:
        if path is None or not _private(path.parent) or path.stat().st_mtime < _LOADED:
            return []
        return path.read_text("utf-8", "replace").splitlines()
    except OSError:
        return []


def read(rank: int | None = None, store: Any = None) -> list[dict[str, Any]]:
    """The reports written in this rank's current run, first written first.

    Args:
        rank: this rank (default: the default group's).
        store: the store (default: the default process group's).

    Returns:
        One dict per report (``rank``, ``module``, ``qualname``, ``message``, ``where``); empty
        when none was written or the store cannot be reached.
    """
    store = store if store is not None else default_store()
    if store is None:
        return []
    try:
        key = _run_key(store, rank, 0)
        if not store.check([key]):
            return []
        lines = bytes(store.get(key)).decode("utf-8", "replace").splitlines()
    except Exception:  # noqa: BLE001 - the rank holding the store died: its copy, if here
        lines = _read_local_copy()
    reports = []
    for line in lines:
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and isinstance(report.get("rank"), int):
            reports.append(report)
    return reports


def explain(
    failure: PeerFailureError, seen: str = "", rank: int | None = None, store: Any = None
) -> PeerFailureError:
    """``failure``, or, when a failing rank reported its error, an error that says which.

    Args:
        failure: the error for a collective that failed because a peer did.
        seen: how the failure showed on this rank (the collective's own error), for the message.
        rank: this rank (default: the default group's).
        store: the store (default: the default process group's).

    Returns:
        ``failure`` when no rank reported; else a ``PeerFailureError`` that is also of the first
        reporting rank's error type where it can be (see the module), whose message names every
        reporting rank, where it failed, and its error, then ``seen``.
    """
    reports = read(rank, store)
    if not reports:
        return failure
    errors = [r for r in reports if not r.get("stopped")]
    why = "failed" if errors else "stopped training alone"
    told = "; ".join(_told(r) for r in reports)
    text = f"stopped because another rank {why}: {told}"
    text += f" (seen here as: {seen})" if seen else ""
    return _as_peer_error(_resolve(errors[0]) if errors else None, text)


def _told(report: dict[str, Any]) -> str:
    where, message = report.get("where", "?"), report.get("message", "")
    if report.get("stopped"):
        return f"rank {report['rank']} stopped training at {where}: {message}"
    return f"rank {report['rank']} raised {report.get('qualname', '?')} at {where}: {message}"


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
        # Named as the user's type; its message read as given (KeyError's own repr-quotes it).
        names: dict[str, Any] = {"__module__": kind.__module__, "__qualname__": kind.__qualname__}
        names["__str__"] = Exception.__str__
        both = type(kind.__name__, (kind, PeerFailureError), {**names, "__reduce__": _reduce})
        error = both(text)
    except Exception:  # noqa: BLE001 - a type that takes other arguments, or cannot be mixed
        return PeerFailureError(text)
    return error if str(error) == text else PeerFailureError(text)


def meet(
    state: dict[str, Any],
    world: int,
    timeout: timedelta,
    rank: int | None = None,
    store: Any = None,
) -> list[dict[str, Any] | None]:
    """Posts this rank's ``state`` at the run's next meeting; waits, bounded, for every rank's.

    A meeting runs through the store, not a process group: it works when the ranks' collectives
    are out of step (a rank interrupted after starting one its peers never started), and every
    rank stops waiting after ``timeout`` on its own (a monitored barrier bounds rank 0's wait
    only). The ranks meet in the same order, so their meeting counts agree.

    Args:
        state: what this rank tells the others (JSON-serialisable).
        world: the number of ranks.
        timeout: the longest this rank waits.
        rank: this rank (default: the default group's).
        store: the store (default: the default process group's).

    Returns:
        Every rank's ``state`` by rank; None for a rank that did not post in time (and for every
        other rank when the store cannot be reached).
    """
    me = _rank(rank)
    alone: list[dict[str, Any] | None] = [state if r == me else None for r in range(world)]
    store = store if store is not None else default_store()
    if store is None:
        return alone
    try:
        run = store.add(RUNS_KEY.format(rank=me), 0)
        index = store.add(MEETINGS_KEY.format(run=run, rank=me), 1)
        keys = [MEETING_KEY.format(run=run, index=index, rank=r) for r in range(world)]
        store.set(keys[me], json.dumps(state))
        try:
            store.wait(keys, timeout)
        except Exception:  # noqa: BLE001 - who came is read below
            pass
        posts: list[dict[str, Any] | None] = []
        for key in keys:
            posts.append(json.loads(bytes(store.get(key))) if store.check([key]) else None)
    except Exception:  # noqa: BLE001 - the rank holding the store is gone
        return alone
    return posts
