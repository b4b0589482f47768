"""The step's owner and the pipeline chosen by default (one process)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lightning_torchrec import DLRMClickModule, TorchRecStrategy
from lightning_torchrec.errors import NonFiniteLossError
from lightning_torchrec.lightning.trainer_setup import batch_hooks
from lightning_torchrec.sharding.features import FeatureSpec
from lightning_torchrec.training.pipelines import SEMI_SYNC_START_BATCH, Peek, PipelineConfig, Split
from lightning_torchrec.training.steps import (
    StepMode,
    StepRunner,
    UnpipelinedStep,
    choose_mode,
    host_runs_ahead,
)
from tests.scripts.factory import cpu_trainer, table_wise, tiny_data, tiny_dlrm


def test_pipeline_options_are_parsed_once_with_their_defaults() -> None:
    assert PipelineConfig.parse("semi_sync", None).start_batch == SEMI_SYNC_START_BATCH
    assert PipelineConfig.parse("semi_sync", {"start_batch": 3}).start_batch == 3
    assert PipelineConfig.parse(None, None).kind is None
    with pytest.raises(ValueError, match="pipeline must be one of"):
        PipelineConfig.parse("fast", None)
    with pytest.raises(ValueError, match=r"pipeline_options\['start_batch'\] is not an option"):
        PipelineConfig.parse("auto", {"start_batch": 1})


def test_auto_is_sparse_dist_where_it_is_faster(caplog: pytest.LogCaptureFixture) -> None:
    auto = PipelineConfig.parse("auto", None)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_mode(auto, cpu) == StepMode(None, False, SEMI_SYNC_START_BATCH, asked=False)
    ahead = {"world_size": 2, "vote_ahead": True}
    assert choose_mode(auto, cpu, **ahead) == StepMode("sparse_dist", True, 900, asked=False)
    assert choose_mode(auto, cpu, **ahead, fitting=False).pipeline is None  # evaluation only
    accumulating = choose_mode(auto, cpu, **ahead, accumulation=(2, "a"))
    assert accumulating == StepMode(None, True, 900, False)
    assert choose_mode(auto, cuda) == StepMode("sparse_dist", False, 900, asked=False)
    with caplog.at_level(logging.INFO, logger="lightning_torchrec.training.steps"):
        assert choose_mode(auto, cuda, accumulation=(2, "a")).pipeline is None
    assert "pipeline='auto' trains without a pipeline: gradient accumulation" in caplog.text
    named = PipelineConfig.parse("sparse_dist", None)
    assert choose_mode(named, cpu) == StepMode("sparse_dist", False, 900, asked=True)
    with pytest.raises(ValueError, match="cannot combine with a train pipeline"):
        choose_mode(named, cpu, accumulation=(2, "accumulate_grad_batches=2"))
    assert choose_mode(named, cpu, fitting=False, accumulation=(2, "a")).pipeline == "sparse_dist"
    # A batch checked on its device a step later cannot be voted on ahead of its step; the
    # batches a pipeline sends early are read on the host, so a pipelined step still can.
    plain = PipelineConfig.parse(None, None)
    assert not choose_mode(plain, cuda, **ahead, deferred=True).ahead
    assert choose_mode(plain, cuda, **ahead).ahead
    assert choose_mode(named, cuda, **ahead, deferred=True).ahead


def test_the_default_strategy_trains_unpipelined_on_cpu_with_a_complete_runner() -> None:
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False)
    assert strategy.pipeline == "auto"
    trainer = cpu_trainer(strategy, max_steps=3, accumulate_grad_batches=1)
    trainer.fit(tiny_dlrm(), datamodule=tiny_data())
    runner = strategy._runner
    assert strategy.pipeline_in_use is None and type(runner.step) is UnpipelinedStep
    assert runner.guard.specs and runner.guard.token  # built complete at setup
    strategy.validate_batches = 5
    assert runner.guard.validate_batches == 5  # the setting reaches the running guard


class Item:
    def __init__(self, n: int) -> None:
        self.n = n


def tracked(count: int, refs: list[weakref.ref]) -> Iterator[Item]:
    """A loader's iterator: it keeps nothing it has given out; ``refs`` sees every item."""
    for n in range(count):
        item = Item(n)
        refs.append(weakref.ref(item))
        yield item
        del item


def test_peek_reads_the_next_batch_and_holds_nothing_the_consumer_has_passed() -> None:
    refs: list[weakref.ref] = []
    consumer, reader = Split(tracked(6, refs)).sides()
    peek = Peek(reader)
    seen = []
    for batch_idx, batch in enumerate(consumer):
        if batch_idx == 2:
            continue  # a step that did not peek: the next call catches up
        found, upcoming = peek.after(batch_idx)
        seen.append((found, upcoming.n if found else None))
        assert found == (batch_idx < 5) and (not found or upcoming.n == batch.n + 1)
        del batch, upcoming
        gc.collect()
        assert [r() is None for r in refs[:batch_idx]] == [True] * batch_idx
    assert seen == [(True, 1), (True, 2), (True, 4), (True, 5), (False, None)]


def test_split_gives_each_side_every_item_once_in_order() -> None:
    left, right = Split(iter(range(5))).sides()
    assert [next(right), next(right), next(right)] == [0, 1, 2]  # one side reads ahead
    assert list(left) == [0, 1, 2, 3, 4]
    assert list(right) == [3, 4]
    assert list(left) == list(right) == []  # ended for both


def test_a_dropped_side_holds_nothing_while_the_other_reads_on() -> None:
    refs: list[weakref.ref] = []
    consumer, reader = Split(tracked(50, refs)).sides()
    peek = Peek(reader)
    assert peek.after(0)[1].n == 1 and next(consumer).n == 0
    # The reader is given up (a pipeline TorchRec cannot trace, the vote ahead switched off):
    # the rest of the epoch must not pile up for it.
    del peek, reader
    for batch in consumer:
        del batch
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


def test_peek_counts_from_the_first_batch_it_is_asked_about() -> None:
    consumer, reader = Split(iter("abc")).sides()
    peek = Peek(reader)
    assert next(consumer) == "a"
    assert peek.after(7) == (True, "b")  # a resumed epoch: its first batch has index 7
    assert peek.after(8) == (True, "c")
    assert peek.after(9) == (False, None)


def test_the_vote_runs_ahead_only_where_the_step_checks_the_loaders_own_batch() -> None:
    class Fit:
        def __init__(self, module: object, datamodule: object = None) -> None:
            self.lightning_module, self.datamodule = module, datamodule

    class Builds(DLRMClickModule):  # builds the batch the step gets: another object
        def on_before_batch_transfer(self, batch: object, dataloader_idx: int) -> object:
            return batch

    def votes_ahead(asked: bool, world_size: int, fit: Fit) -> bool:
        auto, cpu = PipelineConfig.parse("auto", None), torch.device("cpu")
        hooks = batch_hooks(fit)
        return choose_mode(auto, cpu, world_size=world_size, vote_ahead=asked, hooks=hooks).ahead

    plain = tiny_dlrm()
    assert votes_ahead(True, 2, Fit(plain))
    assert not votes_ahead(False, 2, Fit(plain)) and not votes_ahead(True, 1, Fit(plain))
    assert not votes_ahead(True, 2, Fit(tiny_dlrm(cls=Builds)))


def test_a_second_training_loader_puts_the_vote_back_before_the_forward() -> None:
    def runner() -> StepRunner:
        return StepRunner(
            nn.Linear(1, 1),
            torch.device("cpu"),
            specs={},
            dense_width=None,
            validate_batches=False,
            mode=StepMode(ahead=True),
        )

    one = runner()
    one.start_fit()
    feed = one.feed([1, 2, 3], True)
    assert list(feed) == [1, 2, 3] and one.vote_ahead
    one.step._stepped = True  # a step ran: the next iterator is the next epoch's
    assert list(feed) == [1, 2, 3] and one.vote_ahead
    two = runner()
    two.start_fit()
    first, second = two.feed([1, 2], True), two.feed([3, 4], True)
    assert list(zip(first, second, strict=True)) == [(1, 3), (2, 4)]  # as Lightning combines
    assert not two.vote_ahead


def test_auto_checks_a_model_with_a_per_sample_limit_before_its_forward_on_cuda() -> None:
    # Judged a step later, a too-long sample reached the position-weighted forward first: a
    # device-side assert on the GPU before any verdict.
    def deferred(specs: dict) -> bool:
        runner = StepRunner(nn.Linear(1, 1), torch.device("cuda"), specs=specs, dense_width=None)
        return runner.guard.deferred is not None

    plain = FeatureSpec("f", "t", 10)
    assert deferred({"f": plain})
    assert not deferred({"f": dataclasses.replace(plain, max_ids=3)})


def test_on_cuda_the_vote_ahead_carries_the_previous_steps_loss() -> None:
    # The vote ahead starts right after the forward: on CUDA, reading that step's loss would
    # hold the host until the GPU finished the forward. The mode names that choice, and the CPU
    # runs either order through the same code.
    def stopped_after(loss_after_vote: bool) -> int:
        runner = StepRunner(
            nn.Linear(1, 1),
            torch.device("cpu"),
            specs={},
            dense_width=None,
            validate_batches=False,
            batch_checks="before_forward",
            mode=StepMode(ahead=True, loss_after_vote=loss_after_vote),
        )
        runner.start_fit()
        losses = [torch.tensor(0.5), torch.tensor(float("nan")), torch.tensor(0.5)]
        step = -1
        with pytest.raises(NonFiniteLossError, match="at global step 1 "):
            for step, batch in enumerate(runner.feed([0, 1, 2], True)):
                runner.train_step(batch, step, step, step == 2, losses.__getitem__, print)
                runner.after_step()
        return step

    assert stopped_after(False) == 1  # decided after the step of the NaN loss
    assert stopped_after(True) == 2  # one step later: no wait for the forward's end
    auto, ahead = PipelineConfig.parse("auto", None), {"world_size": 2, "vote_ahead": True}
    assert host_runs_ahead(torch.device("cuda")) and not host_runs_ahead(torch.device("cpu"))
    assert choose_mode(auto, torch.device("cuda"), **ahead).loss_after_vote
    assert not choose_mode(auto, torch.device("cpu"), **ahead).loss_after_vote
    assert not choose_mode(auto, torch.device("cuda")).loss_after_vote  # no vote ahead
