"""Unit tests of lightning_torchrec.distributed: ranks, the collective device, agree().

Without a process group every function decides locally. The multi-rank paths run in one process
as rank 0 (or 1) of a fake two-rank world: torch.distributed's functions are replaced by ones that
add what the other rank says.
"""

from __future__ import annotations

import atexit
import os
import warnings
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_torchrec.compat.elastic import warn_multi_agent_restarts
from lightning_torchrec.distributed import (
    agree,
    attempt_store,
    broadcast_from_rank0,
    collective_device,
    init_elastic_group,
    is_distributed,
    launch_agree,
    rank_and_world_size,
    ranks_where,
    shutdown,
    shutdown_at_exit,
)
from lightning_torchrec.errors import BatchValidationError, RankFailureError
from tests.helpers import one_rank_group  # noqa: F401 - a fixture

# ---------------------------------------------------------------- no process group


def test_without_a_process_group_everything_is_local() -> None:
    assert not dist.is_initialized()
    assert not is_distributed()
    assert rank_and_world_size() == (0, 1)
    assert collective_device() == torch.device("cpu")
    assert ranks_where(True) == [0]
    assert ranks_where(False) == []


def test_agree_without_a_process_group_raises_the_first_error() -> None:
    agree()
    agree(None, None)  # nobody failed: returns
    first, second = ValueError("bad batch"), KeyError("missing")
    with pytest.raises(ValueError, match="bad batch") as raised:
        agree(None, first, second)
    assert raised.value is first  # the error itself, not a copy
    with pytest.raises(KeyError, match="missing"):
        agree(None, None, second)


def test_broadcast_from_rank0_without_a_process_group_runs_fn_here() -> None:
    calls: list[int] = []

    def fn() -> dict[str, int]:
        calls.append(1)
        return {"plan": 7}

    assert broadcast_from_rank0(fn) == {"plan": 7}
    assert calls == [1]

    def fails() -> None:
        raise RuntimeError("planner exploded")

    with pytest.raises(RuntimeError, match="planner exploded"):
        broadcast_from_rank0(fails)


# ---------------------------------------------------------------- one-rank gloo group


@pytest.mark.usefixtures("one_rank_group")
def test_a_one_rank_group_is_not_distributed_and_decides_locally() -> None:
    assert dist.is_initialized() and not is_distributed()
    assert rank_and_world_size() == (0, 1)
    assert collective_device() == torch.device("cpu")  # gloo
    assert ranks_where(True) == [0]
    agree(None)
    with pytest.raises(ValueError, match="only rank"):
        agree(ValueError("only rank"))


# ---------------------------------------------------------------- a fake two-rank world


class FakeWorld:
    """This process as ``rank`` of a two-rank world; ``peer`` says what the other rank passes.

    ``peer_votes``: the other rank's flag per slot; ``peer_report``: the ``(type, message)`` it
    gathers (None: it did not fail in the agreed slot); ``from_rank0``: what rank 0 broadcasts.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rank: int = 0) -> None:
        self.rank, self.peer = rank, 1 - rank
        self.peer_votes: list[bool] = []
        self.peer_report: tuple[type[BaseException], str] | None = None
        self.from_rank0: Any = None
        self.all_reduces = self.gathers = self.started = self.waited = 0
        self.groups: list[Any] = []  # the group of each all_reduce, in order
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: self.rank)
        # The package asks the default group itself for its rank and size.
        group = SimpleNamespace(rank=lambda: self.rank, size=lambda: 2)
        monkeypatch.setattr(dist, "GroupMember", SimpleNamespace(WORLD=group))
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "all_gather_object", self.all_gather_object)
        monkeypatch.setattr(dist, "broadcast_object_list", self.broadcast_object_list)

    def all_reduce(self, votes: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.all_reduces += 1
        self.groups.append(kwargs.get("group"))
        assert votes.shape == (len(self.peer_votes), 2) and votes.dtype == torch.int32
        peer = torch.tensor(self.peer_votes, dtype=torch.int32)
        if not kwargs.get("async_op"):
            votes[:, self.peer] += peer
            return None
        self.started += 1
        world = self

        class Work:  # the peer's votes arrive when waited for
            def wait(self) -> bool:
                world.waited += 1
                votes[:, world.peer] += peer
                return True

        return Work()

    def all_gather_object(self, out: list, obj: Any, *args: Any, **kwargs: Any) -> None:
        self.gathers += 1
        out[self.rank], out[self.peer] = obj, self.peer_report

    def broadcast_object_list(self, box: list, src: int = 0, **kwargs: Any) -> None:
        assert src == 0
        if self.rank != 0:
            box[0] = self.from_rank0


def test_rank_and_world_size_come_from_the_default_group(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeWorld(monkeypatch, rank=1)
    assert is_distributed()
    assert rank_and_world_size() == (1, 2)


def test_collective_device_is_the_current_cuda_device_under_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeWorld(monkeypatch)
    assert collective_device() == torch.device("cpu")  # gloo
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert collective_device() == torch.device("cpu")


def test_ranks_where_lists_every_rank_that_voted_true(monkeypatch: pytest.MonkeyPatch) -> None:
    world = FakeWorld(monkeypatch)
    world.peer_votes = [True]
    assert ranks_where(True) == [0, 1]
    assert ranks_where(False) == [1]
    world.peer_votes = [False]
    assert ranks_where(True) == [0]
    assert ranks_where(False) == []


def test_agree_when_no_rank_failed_costs_one_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    world = FakeWorld(monkeypatch)
    world.peer_votes = [False, False]
    agree(None, None)
    assert (world.all_reduces, world.gathers) == (1, 0)


def test_agree_raises_the_other_ranks_error_type_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = FakeWorld(monkeypatch)
    world.peer_votes, world.peer_report = [True], (ValueError, "id 27 out of range")
    with pytest.raises(ValueError, match=r"^stopped because another rank failed: rank 1: id 27"):
        agree(None)
    assert world.gathers == 1


def test_agree_with_several_failing_ranks_chains_this_ranks_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = FakeWorld(monkeypatch)
    world.peer_votes, world.peer_report = [True], (ValueError, "theirs")
    mine = ValueError("mine")
    with pytest.raises(
        ValueError, match=r"several ranks failed: rank 0: mine; rank 1: theirs"
    ) as e:
        agree(mine)
    assert e.value is not mine and e.value.__cause__ is mine
    world.peer_votes, world.peer_report = [False], None
    with pytest.raises(ValueError, match="^mine$") as alone:
        agree(mine)  # only this rank failed: its own error
    assert alone.value is mine


def test_agree_decides_the_first_slot_in_which_some_rank_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = FakeWorld(monkeypatch)
    world.peer_votes, world.peer_report = [True, False], (KeyError, "peer's batch")
    with pytest.raises(KeyError, match="another rank failed: rank 1: peer's batch"):
        agree(None, ValueError("my loss"))  # slot 0 (the peer) wins over slot 1 (mine)
    world.peer_votes, world.peer_report = [False, True], None
    with pytest.raises(ValueError, match="my loss"):
        agree(None, ValueError("my loss"))


def test_agree_falls_back_to_rank_failure_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class NeedsTwoArguments(Exception):
        def __init__(self, code: int, text: str) -> None:
            super().__init__(f"{code}: {text}")

    world = FakeWorld(monkeypatch)
    world.peer_votes, world.peer_report = [True], (NeedsTwoArguments, "7: broken")
    with pytest.raises(RankFailureError, match="another rank failed: rank 1: 7: broken"):
        agree(None)


def test_broadcast_from_rank0_runs_fn_on_rank0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        return "rank 0's plan"

    world = FakeWorld(monkeypatch, rank=1)
    world.peer_votes, world.from_rank0 = [False], "rank 0's plan"
    assert broadcast_from_rank0(fn) == "rank 0's plan"
    assert calls == []
    world.rank, world.peer = 0, 1
    assert broadcast_from_rank0(fn) == "rank 0's plan"
    assert calls == [1]


def test_broadcast_from_rank0_raises_rank0s_error_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = FakeWorld(monkeypatch, rank=1)
    world.peer_votes, world.peer_report = [True], (ValueError, "planning failed")
    with pytest.raises(ValueError, match="another rank failed: rank 0: planning failed"):
        broadcast_from_rank0(lambda: pytest.fail("fn runs on rank 0 only"))


# ---------------------------------------------------------------- torchrun attempts


def test_outside_torchruns_shared_store_the_launcher_initialises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store(timedelta(seconds=5)) is None
    assert not init_elastic_group("gloo", 0, 1, timedelta(seconds=5), None)
    assert not dist.is_initialized()


def agent_store(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    """A store standing for torchrun's agent's, as its workers see it."""
    agent = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    return agent


def test_each_torchrun_attempt_writes_under_its_own_prefix_of_the_agents_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent = agent_store(monkeypatch)
    agent.set("rank_1", "dead attempt's address")  # what an attempt without prefix would read
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        store = attempt_store(timedelta(seconds=5))
        assert store is not None
        store.set("rank_1", f"attempt {attempt}")
    assert agent.get("lightning_torchrec/attempt_0/rank_1") == b"attempt 0"
    assert agent.get("lightning_torchrec/attempt_1/rank_1") == b"attempt 1"
    assert agent.get("rank_1") == b"dead attempt's address"


def test_a_group_made_in_the_attempts_store_is_destroyed_at_exit_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _agent = agent_store(monkeypatch)  # kept alive: the workers connect to it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    registered: list[Any] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(
        atexit, "unregister", lambda f: registered.remove(f) if f in registered else None
    )
    try:
        assert init_elastic_group("gloo", 0, 1, timedelta(seconds=5), None)
        assert dist.get_world_size() == 1
        assert not init_elastic_group("gloo", 0, 1, timedelta(seconds=5), None)  # up already
        shutdown_at_exit()
        shutdown_at_exit()
        assert registered == [shutdown]
    finally:
        shutdown()
    assert not dist.is_initialized()


#: The threads of a gloo group (workers, ``tcp`` loop) and of a ``TCPStore`` server.
DISTRIBUTED_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv", "pt_tcpstore")


def distributed_threads() -> set[int]:
    """The ids of this process's threads that belong to a process group or a store's server."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # it ended meanwhile
            continue
        if name in DISTRIBUTED_THREADS:
            found.add(int(tid))
    return found


def test_shutdown_leaves_no_thread_of_a_group_or_store_to_the_interpreters_exit() -> None:
    # As at the end of a fit: the store, the default group and a strategy's own gloo group held
    # only by a reference cycle (a Trainer, its strategy and loops), garbage nobody collected.
    before = distributed_threads()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    trainer: dict[str, Any] = {"store": store, "world": dist.group.WORLD}
    trainer["host_group"] = dist.new_group(backend="gloo")
    trainer["strategy"] = {"trainer": trainer}  # the cycle
    votes = torch.ones(2)
    dist.all_reduce(votes, group=trainer["host_group"])
    del store, trainer, votes
    started = distributed_threads() - before
    # gloo's tcp loop is named "gloo_tcp_loop" from torch 2.12 on (unnamed on 2.11).
    assert "pt_gloo_runloop" in {thread_name(t) for t in started}, started
    shutdown()
    assert not dist.is_initialized()
    # Destroyed, and their threads joined, now: not by the finalising interpreter.
    assert distributed_threads() & started == set()


def thread_name(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def test_a_vote_started_ahead_is_decided_later_with_the_same_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = FakeWorld(monkeypatch)
    world.peer_votes = [True, False, True]  # the peer's batch is bad; it flags "last"
    world.peer_report = (BatchValidationError, "rank 1, step 4: id 9 >= 8")
    decide = launch_agree(None, flags=[False, False])
    assert (world.started, world.waited, world.gathers) == (1, 0, 0)  # nothing waited for yet
    with pytest.raises(BatchValidationError, match="another rank failed: rank 1: rank 1, step 4"):
        decide()
    assert (world.all_reduces, world.waited, world.gathers) == (1, 1, 1)
    world.peer_votes = [False, False, True]
    assert launch_agree(None, flags=[True, False])() == [[0], [1]]
    assert (world.started, world.gathers) == (2, 1)  # still one collective per vote


def test_a_multi_agent_job_that_may_restart_is_told_to_give_rounds_their_own_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torchrun = {"TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "0"}
    agents = {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}
    for key, value in (torchrun | agents).items():
        monkeypatch.setenv(key, value)
    with pytest.warns(UserWarning, match="2 agents with --max-restarts 3.*TORCH_DISABLE_SHARE"):
        warn_multi_agent_restarts()
    for quiet in ({"GROUP_WORLD_SIZE": "1"}, {"TORCHELASTIC_MAX_RESTARTS": "0"}, {"RANK": "1"}):
        with monkeypatch.context() as m, warnings.catch_warnings():
            warnings.simplefilter("error")
            for key, value in quiet.items():
                m.setenv(key, value)
            warn_multi_agent_restarts()


@pytest.mark.usefixtures("one_rank_group")
def test_a_closed_run_lets_its_vote_group_go_though_its_strategy_lives_on() -> None:
    # A strategy keeps its last run's step runner (and its guard) while the Trainer lives; a
    # destroyed group still referenced there keeps its gloo threads running to the process's exit.
    import gc
    import weakref

    from torch import nn

    from lightning_torchrec.training.steps import StepMode, StepRunner

    group = dist.new_group(backend="gloo")
    runner = StepRunner(
        nn.Linear(1, 1),
        torch.device("cpu"),
        specs={},
        dense_width=None,
        group=group,
        mode=StepMode(ahead=True),
    )
    runner.start_fit()
    runner.guard.vote_ahead(None, batch_idx=0, last=False)  # a vote started: its handles held
    runner.after_step()
    seen = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    runner.close()
    gc.collect()
    assert seen() is None
    assert runner.guard.group is None
