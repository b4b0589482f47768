"""Batch checks in DataLoader workers: the same verdicts, made where the batch is made.

One process; the workers are real forked processes of a real ``DataLoader``.
"""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.errors import BatchValidationError
from lightning_torchrec.training import step_guard
from lightning_torchrec.training.batch_checks import UNCHECKED, worker_verdict
from lightning_torchrec.training.worker_checks import CheckingCollate, check_in_workers
from tests.scripts.factory import cpu_trainer, table_wise
from tests.test_validation import SPECS, _Batches, batch, model


def test_collate_attaches_the_verdict_a_token_reads_once() -> None:
    collate = CheckingCollate(lambda b: b, SPECS, 3, token="model-a")
    good, bad = collate(batch()), collate(batch(values=torch.tensor([1, 2, 3, 20])))
    assert worker_verdict(good, "model-a") is None
    problem = worker_verdict(bad, "model-a")
    assert "'cat_1'" in problem and "'t_cat_1'" in problem and "id 20" in problem
    assert worker_verdict(bad, "model-a") is UNCHECKED  # read once
    other = collate(batch(values=torch.tensor([1, 2, 3, 20])))
    assert worker_verdict(other, "model-b") is UNCHECKED  # another model's verdict: not trusted
    plain = CheckingCollate(lambda b: {"batch": b}, SPECS, 3, token="model-a")(batch())
    assert worker_verdict(plain, "model-a") is UNCHECKED  # a dict carries no verdict


def test_only_loaders_with_workers_are_wrapped_and_rewrapping_keeps_the_original() -> None:
    data = _Batches(bad_at=-1)
    assert not check_in_workers(DataLoader(data, batch_size=None), SPECS, 3, "t")
    loader = DataLoader(data, batch_size=None, num_workers=2)
    original = loader.collate_fn
    assert check_in_workers(loader, SPECS, 3, "t1") and check_in_workers(loader, SPECS, 3, "t2")
    assert loader.collate_fn.collate is original and loader.collate_fn.token == "t2"


def _fit_with_workers(bad_at: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = []
    real = step_guard.check_batch

    def counted(*args, **kwargs):  # runs only in this (the training) process
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(step_guard, "check_batch", counted)
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False)
    trainer = cpu_trainer(strategy, max_steps=6, use_distributed_sampler=False)
    loader = DataLoader(
        _Batches(bad_at), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    trainer.fit(model(), loader)
    return calls


def test_workers_check_and_the_training_process_only_reads_verdicts(monkeypatch) -> None:
    assert _fit_with_workers(-1, monkeypatch) == []


def test_a_bad_batch_found_by_a_worker_stops_training_with_the_same_message(monkeypatch) -> None:
    with pytest.raises(BatchValidationError, match=r"rank 0, step 2: feature 'cat_1'.*id 1000"):
        _fit_with_workers(2, monkeypatch)


class _YieldingLoader(DataLoader):
    """A loader whose ``__iter__`` is a generator, as the package's resumable loaders are."""

    def __iter__(self):  # noqa: ANN204
        yield from super().__iter__()


@pytest.mark.parametrize(
    ("pipeline", "loader_cls"),
    [(None, DataLoader), ("sparse_dist", DataLoader), ("sparse_dist", _YieldingLoader)],
)
def test_workers_of_a_fit_stopped_mid_epoch_exit_before_the_fit_returns(
    pipeline: str | None, loader_cls: type[DataLoader]
) -> None:
    # The strategy's read-ahead held the epoch's iterator in a reference cycle: the garbage
    # collector finalized its queues first, so its workers never got the word to exit and the
    # shutdown waited 5 s for each before killing it (10 s per fit with 2 workers).
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False, pipeline=pipeline)
    trainer = cpu_trainer(strategy, max_steps=3, use_distributed_sampler=False)
    loader = loader_cls(
        _Batches(bad_at=-1), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    gc.disable()  # nothing but the strategy's own collection at teardown runs
    try:
        trainer.fit(model(), loader)
        assert trainer.global_step == 3  # of 6 batches
        assert multiprocessing.active_children() == []
    finally:
        gc.enable()
