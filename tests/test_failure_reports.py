"""A failing rank's report in the job's store, and the error its peers raise from it."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch.distributed as dist

from lightning_torchrec import PeerFailureError
from lightning_torchrec.failure_reports import KEY, MESSAGE_CHARS, clear, explain, post, read


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
    assert explain(SEEN, store=store) is SEEN  # nobody reported: a death, as before
    post(UserBug("bad row 7 in file part-3"), 1, "global step 3 (train)", store=store)
    error = explain(SEEN, "Connection closed by peer", store=store)
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
    post(KeyError("user_id"), 2, "global step 5 (validate)", store=store)
    post(UserBug("late"), 3, "global step 5 (train)", store=store)
    error = explain(SEEN, store=store)
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
    post(error, 1, "global step 2 (train)", store=store)
    raised = explain(SEEN, store=store)
    assert type(raised) is PeerFailureError
    assert f"rank 1 raised {type(error).__qualname__} at global step 2" in str(raised)


def test_consequences_are_not_reported_and_an_error_is_reported_once() -> None:
    store = dist.HashStore()
    post(PeerFailureError("my peer died"), 0, "global step 1", store=store)
    assert read(store) == []
    bug = UserBug("x" * (2 * MESSAGE_CHARS))
    post(bug, 1, "global step 1", store=store)
    post(bug, 1, "global step 1", store=store)  # on_exception after a save's meeting
    (report,) = read(store)
    assert len(report["message"]) == MESSAGE_CHARS


def test_rank_0_clears_an_earlier_runs_reports_at_setup() -> None:
    store = dist.HashStore()
    post(UserBug("the last run's"), 1, "global step 9", store=store)
    clear(1, store=store)  # only rank 0 clears
    assert len(read(store)) == 1
    clear(0, store=store)
    assert read(store) == [] and explain(SEEN, store=store) is SEEN


def test_damaged_or_unreachable_stores_leave_the_error_as_it_was() -> None:
    store = dist.HashStore()
    store.set(KEY, b"not json\n[1, 2]\n")
    assert read(store) == [] and explain(SEEN, store=store) is SEEN
    dead = DeadStore()
    post(UserBug("x"), 1, "global step 1", store=dead)  # no error of its own
    clear(0, store=dead)
    assert explain(SEEN, store=dead) is SEEN
