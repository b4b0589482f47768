"""Loaders that fork their workers do it after other threads gave the GIL back (CPython < 3.12)."""

from __future__ import annotations

import multiprocessing
import sys
import threading
from multiprocessing.context import ForkContext, ForkProcess

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_torchrec.compat.worker_fork import AFFECTED, QuietForkContext, fork_safely
from lightning_torchrec.fabric import TorchRecFabricStrategy
from lightning_torchrec.training.steps import StepRunner

pytestmark = pytest.mark.skipif(not AFFECTED, reason="the interpreter re-inits the lock itself")


def _loader(**kwargs: object) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(12.0)), batch_size=3, **kwargs)


def test_a_forking_loader_gets_the_quiet_fork_and_yields_the_same_batches() -> None:
    plain, quiet = _loader(num_workers=2), _loader(num_workers=2)
    assert fork_safely(quiet)
    assert isinstance(quiet.multiprocessing_context, QuietForkContext)
    assert fork_safely(quiet) and isinstance(quiet.multiprocessing_context, QuietForkContext)
    got = [b[0].tolist() for b in quiet]  # two forked workers
    assert got == [b[0].tolist() for b in plain] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    named = _loader(num_workers=1, multiprocessing_context="fork")
    assert fork_safely(named) and isinstance(named.multiprocessing_context, QuietForkContext)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_loaders_that_do_not_fork_or_have_no_workers_are_left_alone(context: str) -> None:
    other = _loader(num_workers=1, multiprocessing_context=context)
    assert not fork_safely(other)
    assert type(other.multiprocessing_context) is not QuietForkContext
    inline = _loader(num_workers=0)
    assert not fork_safely(inline) and inline.multiprocessing_context is None
    assert not fork_safely([1, 2, 3])  # not a DataLoader


def test_the_process_start_method_decides_for_a_loader_without_a_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "spawn")
    assert not fork_safely(_loader(num_workers=1))
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "fork")
    assert fork_safely(_loader(num_workers=1))


def test_the_fork_waits_with_the_gil_released_until_a_waiting_thread_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A thread that waits for the GIL when a worker starts runs before the fork: it stands for a
    # gloo thread about to release a finished collective's tensors. With a long switch interval
    # it gets the GIL only when this thread releases it.
    order: list[str] = []
    ready, go = threading.Event(), threading.Event()

    def waiting() -> None:
        ready.set()
        go.wait()
        order.append("thread")

    def fork(process_obj: object) -> object:
        order.append("fork")
        return plain_popen(process_obj)

    plain_popen = ForkProcess._Popen
    monkeypatch.setattr(ForkProcess, "_Popen", staticmethod(fork))
    thread = threading.Thread(target=waiting)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        thread.start()
        ready.wait()
        go.set()
        child = QuietForkContext().Process(target=int)
        child.start()
    finally:
        sys.setswitchinterval(interval)
    child.join(30)
    thread.join()
    assert child.exitcode == 0
    assert order == ["thread", "fork"]
    assert ForkContext.Process is ForkProcess  # the standard library's context is untouched


def test_the_step_runner_makes_every_loader_it_feeds_fork_quietly() -> None:
    runner = StepRunner(
        nn.Linear(1, 1), torch.device("cpu"), specs={}, dense_width=None, validate_batches=False
    )
    train, val = _loader(num_workers=1), _loader(num_workers=1)
    assert runner.feed(train, True) is train and runner.feed(val, False) is val
    assert isinstance(train.multiprocessing_context, QuietForkContext)
    assert isinstance(val.multiprocessing_context, QuietForkContext)


def test_fabric_setup_dataloaders_makes_a_forking_loader_fork_quietly() -> None:
    loader = _loader(num_workers=1)
    assert TorchRecFabricStrategy().process_dataloader(loader) is loader
    assert isinstance(loader.multiprocessing_context, QuietForkContext)
