"""A failing rank's report in the job's store, and the error its peers raise from it."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch.distributed as dist

from lightning_torchrec import PeerFailureError
from lightning_torchrec.failure_reports import (
    HEAD_CHARS,
    KEY,
    TAIL_CHARS,
    begin_run,
    explain,
    post,
    post_stop,
    read,
)


class UserBug(ValueError):
    """A user's error type, importable by name."""


class NeedsTwoArguments(Exception):
    def __init__(self, a: str, b: str) -> None:
        super().__init__(a, b)


class DeadStore:
    """A store whose server has gone (the rank that held it died)."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any) -> Any:
            raise dist.DistNetworkError("Connection reset by peer")

        return fail


SEEN = PeerFailureError("a collective failed: another rank probably died")


def test_the_peer_raises_the_failing_ranks_type_which_is_also_a_peer_failure() -> None:
    store = dist.HashStore()
    assert explain(SEEN, rank=0, store=store) is SEEN  # nobody reported: a death, as before
    post(UserBug("bad row 7 in file part-3"), "global step 3 (train)", 1, store=store)
    error = explain(SEEN, "Connection closed by peer", rank=0, store=store)
    assert isinstance(error, UserBug) and isinstance(error, PeerFailureError)
    assert type(error).__name__ == "UserBug" and type(error).__module__ == __name__
    assert str(error) == (
        "stopped because another rank failed: rank 1 raised UserBug at global step 3 (train): "
        "bad row 7 in file part-3 (seen here as: Connection closed by peer)"
    )
    # The combined type exists only here: pickled (a launcher's queue), it is a PeerFailureError.
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is PeerFailureError and str(again) == str(error)


def test_several_reports_are_all_named_and_the_first_gives_the_type() -> None:
    store = dist.HashStore()
    post(KeyError("user_id"), "global step 5 (validate)", 2, store=store)
    post(UserBug("late"), "global step 5 (train)", 3, store=store)
    error = explain(SEEN, rank=0, store=store)
    assert isinstance(error, KeyError) and isinstance(error, PeerFailureError)
    assert "rank 2 raised KeyError at global step 5 (validate)" in str(error)
    assert "rank 3 raised UserBug at global step 5 (train): late" in str(error)


@pytest.mark.parametrize(
    "error",
    [
        KeyboardInterrupt(),  # not an Exception: said, not rebuilt
        NeedsTwoArguments("a", "b"),  # cannot be built from a message
        type("Local", (Exception,), {"__qualname__": "f.<locals>.Local"})("x"),  # not importable
    ],
)
def test_types_that_cannot_be_rebuilt_give_a_plain_peer_failure_naming_them(
    error: BaseException,
) -> None:
    store = dist.HashStore()
    post(error, "global step 2 (train)", 1, store=store)
    raised = explain(SEEN, rank=0, store=store)
    assert type(raised) is PeerFailureError
    assert f"rank 1 raised {type(error).__qualname__} at global step 2" in str(raised)


def test_consequences_are_not_reported_and_an_error_is_reported_once() -> None:
    store = dist.HashStore()
    post(PeerFailureError("my peer died"), "global step 1", 0, store=store)
    assert read(0, store) == []
    bug = UserBug("Caught in a DataLoader worker. Traceback: " + "x" * 5000 + " bad row 7")
    post(bug, "global step 1", 1, store=store)
    post(bug, "global step 1", 1, store=store)  # on_exception after a save's meeting
    (report,) = read(0, store)
    # A worker's traceback comes first and the message last: both ends are kept.
    assert report["message"].startswith("Caught in a DataLoader worker")
    assert report["message"].endswith("x bad row 7")
    assert len(report["message"]) == HEAD_CHARS + TAIL_CHARS + len(" [...] ")


def test_a_keyerrors_peer_message_is_not_quoted() -> None:
    store = dist.HashStore()
    post(KeyError("user_id"), "global step 2 (train)", 1, store=store)
    error = explain(SEEN, rank=0, store=store)
    assert isinstance(error, KeyError)
    assert str(error).startswith("stopped because another rank failed: rank 1 raised KeyError")


def test_a_report_written_late_never_explains_a_later_runs_failure() -> None:
    # Rank 1's slow on_exception wrote run 1's error after rank 0 had set up run 2.
    store = dist.HashStore()
    for rank in (0, 1):
        begin_run(rank, store=store)
    begin_run(0, store=store)  # rank 0 is in run 2
    post(UserBug("run 1's"), "global step 9", 1, store=store)  # rank 1 still in run 1
    assert read(0, store) == [] and explain(SEEN, rank=0, store=store) is SEEN
    begin_run(1, store=store)  # rank 1 reaches run 2 and fails there
    post(UserBug("run 2's"), "global step 1", 1, store=store)
    (report,) = read(0, store)
    assert report["message"] == "run 2's"


def test_damaged_or_unreachable_stores_leave_the_error_as_it_was() -> None:
    store = dist.HashStore()
    store.set(KEY.format(run=0), b"not json\n[1, 2]\n")
    assert read(0, store) == [] and explain(SEEN, rank=0, store=store) is SEEN
    dead = DeadStore()
    post(UserBug("x"), "global step 1", 1, store=dead)  # no error of its own
    begin_run(0, store=dead)
    assert explain(SEEN, rank=0, store=dead) is SEEN


def test_a_rank_that_stopped_alone_is_named_and_an_error_still_gives_the_type() -> None:
    store = dist.HashStore()
    post_stop("global step 3", 1, store=store)
    error = explain(SEEN, rank=0, store=store)
    assert type(error) is PeerFailureError
    assert str(error).startswith(
        "stopped because another rank stopped training alone: rank 1 stopped training at "
        "global step 3: trainer.should_stop was set on it"
    )
    post(UserBug("bad"), "global step 3 (train)", 2, store=store)
    error = explain(SEEN, rank=0, store=store)
    assert isinstance(error, UserBug) and "another rank failed" in str(error)


def test_the_strategy_reports_its_own_errors_never_a_dead_peers_bare_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A bare gloo error (a metric's own sync) reported as this rank's would have told a third
    # rank that this one failed.
    from lightning_torchrec import TorchRecStrategy
    from lightning_torchrec.training import run

    posted: list[BaseException] = []
    monkeypatch.setattr(run, "post", lambda error, *args: posted.append(error))
    strategy = TorchRecStrategy()
    bare = RuntimeError(
        "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    )
    strategy.on_exception(bare)
    assert len(posted) == 1 and isinstance(posted[0], PeerFailureError)
    bug = UserBug("mine")
    strategy.on_exception(bug)
    assert posted[1] is bug


def test_rank_zeros_report_is_read_from_its_hosts_copy_once_its_store_is_gone(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import time

    from lightning_torchrec import failure_reports

    # Lightning's and Fabric's launchers: rank 0 serves the store, which dies with it.
    monkeypatch.setattr(failure_reports.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29517")
    store = dist.HashStore()
    begin_run(0, store=store)
    post(UserBug("rank 0's loader read a bad row"), "global step 3 (train)", 0, store=store)
    # Once its store is gone, rank 1 reads the copy.
    error = explain(SEEN, rank=1, store=DeadStore())
    assert isinstance(error, UserBug) and isinstance(error, PeerFailureError)
    assert "rank 0 raised UserBug at global step 3 (train): rank 0's loader" in str(error)
    # Rank 0's next run starts from no report.
    begin_run(0, store=store)
    assert explain(SEEN, rank=1, store=DeadStore()) is SEEN
    # Another rank's report is in the store only; a live store is read, not the copy.
    post(UserBug("rank 2's own"), "global step 1 (train)", 2, store=store)
    path = failure_reports.local_copy()
    assert path is not None and not path.exists()
    post(UserBug("rank 0's own"), "global step 1 (train)", 0, store=store)
    assert "rank 2's own" in str(explain(SEEN, rank=1, store=store))
    assert "rank 2's own" not in str(explain(SEEN, rank=1, store=DeadStore()))
    # A copy written before this process started is another job's: ignored.
    old = time.time() - 3600
    os.utime(path, (old, old))
    monkeypatch.setattr(failure_reports, "_LOADED", old + 1)
    assert explain(SEEN, rank=1, store=DeadStore()) is SEEN
    os.utime(path, None)
    assert "rank 0's own" in str(explain(SEEN, rank=1, store=DeadStore()))
    # A folder others can write to could hold anyone's file: ignored, and not written to.
    path.parent.chmod(0o777)
    assert explain(SEEN, rank=1, store=DeadStore()) is SEEN
    path.unlink()
    post(UserBug("again"), "global step 2 (train)", 0, store=store)
    assert not path.exists()
    # Another job (another port) finds no copy.
    path.parent.chmod(0o700)
    monkeypatch.setenv("MASTER_PORT", "29518")
    assert explain(SEEN, rank=1, store=DeadStore()) is SEEN


def test_a_copy_that_cannot_be_removed_or_written_stops_no_run(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_torchrec import failure_reports

    monkeypatch.setattr(failure_reports.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("MASTER_PORT", "29519")
    path = failure_reports.local_copy()
    assert path is not None
    path.mkdir(parents=True)  # something in the copy's place that unlink cannot remove
    path.parent.chmod(0o700)
    store = dist.HashStore()
    begin_run(0, store=store)  # raised IsADirectoryError from the copy's removal
    post(UserBug("rank 0's own"), "global step 1 (train)", 0, store=store)
    assert "rank 0's own" in str(explain(SEEN, rank=0, store=store))  # the store still has it
    assert path.is_dir()
