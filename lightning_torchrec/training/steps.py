"""A training step, one object per mode, chosen once when a run is set up.

:func:`choose_mode` decides, in one place and once per run, how its training steps run
(:class:`StepMode`): without a train pipeline (:class:`UnpipelinedStep`), through TorchRec's
sparse-dist pipeline (:class:`SparseDistStep`) or its semi-sync one (:class:`SemiSyncStep`),
and whether each step starts the vote on the next one while it runs (the vote ahead). Each step
object reads top to bottom, as TorchRec's ``TrainPipelineSparseDist.progress()`` does:

1. **before the forward**: the step's vote (:class:`~lightning_torchrec.training.step_guard.
   StepGuard`): the batch's verdict (or, pipelined, the verdicts of the batches this
   ``progress()`` sends early), the previous step's loss, the epoch's end on every rank, a stop
   request. Skipped when the previous step's vote ahead already decided it;
2. **the forward**: the front end's step on the device batch (through the pipeline, which starts
   the next batch's input all-to-all first);
3. **after the forward**: the loss recorded (judged at the next vote, without a GPU-to-host
   wait), and with the vote ahead the next step's vote started, to be decided after the update
   (:meth:`TrainStep.after_step`);
4. **after the backward**: semi-sync's table update (:meth:`TrainStep.after_backward`).

A model TorchRec cannot pipeline, found at its first step, and a fit that iterates two training
loaders at once each switch the run to another step object: one named, logged switch
(:meth:`~lightning_torchrec.training.step_runner.StepRunner.switch`), never a flag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_torchrec.errors import StopRequested
from lightning_torchrec.sharding.sharders import check_semi_sync_plan
from lightning_torchrec.training.pipeline_feed import Peek, PipelineFeed, epoch_ending
from lightning_torchrec.training.pipelines import (
    PipelineConfig,
    SemiSyncPipeline,
    SparseDistPipeline,
)

#: The run a step object steps: a :class:`~lightning_torchrec.training.step_runner.StepRunner`
#: (its ``model``, ``device``, ``guard``, ``global_step``, ``collective`` and ``switch``).
StepRunner = Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepPosition:
    """Where a training step is: what the vote and the loss are told about it.

    Attributes:
        batch_idx: the batch's index in the epoch.
        step: the global step (finished training steps).
        last: whether this rank has no batch after this one in the epoch.
        stop: whether this rank asks every rank to stop before this step (it received a signal).
    """

    batch_idx: int
    step: int
    last: bool
    stop: bool = False


@dataclass(frozen=True)
class StepMode:
    """How a run's training steps run, decided once by :func:`choose_mode`.

    Attributes:
        pipeline: ``None``, ``"sparse_dist"`` or ``"semi_sync"``.
        ahead: whether each training step starts the vote on the next one (see
            :class:`TrainStep`).
        start_batch: ``"semi_sync"``'s first semi-synchronous global step.
        asked: whether the user named the pipeline (a model it cannot pipeline then gets a
            warning; under ``"auto"``, an INFO line).
    """

    pipeline: str | None = None
    ahead: bool = False
    start_batch: int = 0
    asked: bool = True

    def build(self, runner: StepRunner) -> TrainStep:
        """The step object of this mode.

        Args:
            runner: the run it steps (its model, device, guard and collectives).

        Returns:
            A new :class:`UnpipelinedStep`, :class:`SparseDistStep` or :class:`SemiSyncStep`.
        """
        if self.pipeline == "semi_sync":
            return SemiSyncStep(runner, self)
        if self.pipeline == "sparse_dist":
            return SparseDistStep(runner, self)
        return UnpipelinedStep(runner, self.ahead)


def check_pipeline_batches(pipeline: str, hooks: Sequence[str]) -> None:
    """Refuses a named train pipeline for a model whose batch hooks change its batches.

    Args:
        pipeline: the pipeline asked for by name.
        hooks: the overridden hooks that change each batch after the loader (e.g.
            ``"MyModule.on_after_batch_transfer"``).

    Raises:
        ValueError: naming the hooks, when there are any.
    """
    if hooks:
        raise ValueError(
            f"pipeline={pipeline!r} cannot run with {', '.join(hooks)}: the pipeline reads the "
            "DataLoader's batches itself and would train on them without the hook's changes. "
            "Move the transformation into the dataset or the DataLoader's collate_fn, or use "
            "TorchRecStrategy(pipeline=None) (pipeline='auto' trains without a pipeline then)."
        )


def check_accumulation(factor: int, source: str, fused: bool, allowed: bool, piped: bool) -> None:
    """Refuses gradient accumulation that fused tables or a train pipeline cannot honour.

    Args:
        factor: the accumulation factor.
        source: what sets it, for the message.
        fused: whether the model has fused tables.
        allowed: ``TorchRecStrategy(allow_fused_gradient_accumulation=...)``.
        piped: whether a train pipeline runs.

    Raises:
        ValueError: for accumulation with a pipeline, or with fused tables without the opt-in.
    """
    if factor <= 1:
        return
    if piped:
        raise ValueError(
            f"{source} cannot combine with a train pipeline: the pipeline runs the next "
            "batch's input all-to-all against every update. Use pipeline=None to accumulate, "
            "or a larger batch."
        )
    if fused and not allowed:
        raise ValueError(
            f"{source} does not apply to fused embedding tables: they update at every backward "
            "pass. Use a larger batch, or pass "
            "TorchRecStrategy(allow_fused_gradient_accumulation=True) to accumulate only the "
            "dense gradients."
        )


def choose_mode(
    config: PipelineConfig,
    device: torch.device,
    *,
    world_size: int = 1,
    vote_ahead: bool = False,
    fitting: bool = True,
    hooks: Sequence[str] = (),
    accumulation: tuple[int, str] = (1, ""),
    deferred: bool = False,
) -> StepMode:
    """The one decision of how a run's training steps run: the pipeline and the vote ahead.

    ``"auto"`` is ``"sparse_dist"`` where it is faster: on CUDA (the next batch's copy and input
    all-to-all overlap this batch's compute; measured faster than unpipelined at batch 65536 on
    an H100), and on CPU ranks whose steps vote ahead (the input all-to-all overlaps the vote;
    measured 2.6 ms a step faster at the benchmark size). With a vote before each forward, or on
    one rank, the unpipelined step is as fast or faster (``docs/benchmarks.md``); all give
    bit-equal results. ``"auto"`` runs no pipeline, with an INFO line saying why, where hooks
    change each batch after the loader (a pipeline would train on the loader's batches) or the
    fit accumulates gradients; a pipeline named by the user is refused there instead.

    The vote ahead checks the next batch as the loader made it, so it runs only where the step
    trains on exactly that batch (no ``hooks``), when fitting on more than one rank, and, without
    a pipeline, where the step's batch is checked on the host (not ``deferred`` to the device).

    Args:
        config: the strategy's pipeline configuration.
        device: the rank's device.
        world_size: the number of ranks (one rank has no vote to run ahead).
        vote_ahead: the strategy's ``vote_ahead``.
        fitting: whether the run is a fit (else only the evaluation pipeline matters).
        hooks: the hooks that change each batch between the loader and the step.
        accumulation: ``(factor, source)`` of the fit's gradient accumulation.
        deferred: whether unpipelined batches are checked on the device a step later.

    Returns:
        The mode.

    Raises:
        ValueError: for a named pipeline with batch hooks, or with gradient accumulation.
    """
    ahead = vote_ahead and fitting and world_size > 1 and not hooks
    pipeline = config.kind
    if pipeline == "auto":
        why = None
        if hooks:
            why = (
                f"{', '.join(hooks)} change(s) each batch after the DataLoader, and a pipeline "
                "would train on the loader's batches unchanged"
            )
        elif device.type == "cuda" or ahead:
            if fitting and accumulation[0] > 1:
                why = "gradient accumulation needs the unpipelined step"
        faster = device.type == "cuda" or ahead
        pipeline = "sparse_dist" if faster and why is None else None
        if why is not None:
            log.info("pipeline='auto' trains without a pipeline: %s", why)
    elif pipeline is not None:
        check_pipeline_batches(pipeline, hooks)
        if fitting:
            check_accumulation(*accumulation, fused=False, allowed=True, piped=True)
    ahead = ahead and (pipeline is not None or not deferred)
    return StepMode(pipeline, ahead, config.start_batch, config.kind != "auto")


class TrainStep:
    """What every training step mode shares: the vote, the loss, the vote ahead.

    Args:
        runner: the run it steps.
        ahead: whether each step starts the vote on the next one (see :class:`StepMode`).
    """

    #: The pipeline this step trains through (None: none).
    pipeline: str | None = None

    def __init__(self, runner: StepRunner, ahead: bool) -> None:
        self.runner, self.guard = runner, runner.guard
        self.ahead = ahead
        # On CUDA the vote ahead starts right after the forward: it carries the previous step's
        # loss, since reading this one would hold the host until the GPU finished the forward.
        self.loss_after_vote = ahead and runner.device.type == "cuda"
        #: The batch index whose vote the last vote ahead decided (its step skips its own).
        self.covered: int | None = None

    def feed(self, loader: Any) -> Any:
        """The training dataloader as this step reads it.

        Args:
            loader: the training dataloader.

        Returns:
            The loader to iterate.
        """
        return loader

    def train(
        self, batch: Any, host: Any, at: StepPosition, run: Callable[[Any], Any], move: Any
    ) -> Any:
        """One training step (see the module docstring).

        Args:
            batch: the step's batch as the front end has it.
            host: its host copy, checked by the vote (``batch`` itself when none was held).
            at: where the step is.
            run: runs the front end's training step on a device batch; returns its output.
            move: copies a host batch to the device.

        Returns:
            What ``run`` returned.
        """
        raise NotImplementedError

    def _vote(self, host: Any, batch: Any, at: StepPosition) -> None:
        """Before the forward: the step's vote, unless the last vote ahead decided it."""
        covered, self.covered = self.covered == at.batch_idx, None
        stopping = self.runner.collective(self.guard.decide_ahead) or []  # normally decided
        if not covered:
            sent, index, ending = self._sent(at)
            stopping = self.runner.collective(
                self.guard.before_training_step, host, at.step, index, ending, sent, batch, at.stop
            )
        if stopping:
            raise StopRequested(stopping)

    def _sent(self, at: StepPosition) -> tuple[Any, int, bool]:
        """What this step's vote judges: the batches sent early, and the epoch's end."""
        return None, at.batch_idx, at.last

    def _after_forward(self, output: Any, at: StepPosition) -> None:
        """After the forward: the loss recorded, the next step's vote started."""
        if not self.loss_after_vote:
            self.guard.record_loss(output, at.step)
        if self.ahead:
            self._vote_next(at)
        if self.loss_after_vote:
            self.guard.record_loss(output, at.step)

    def _vote_next(self, at: StepPosition) -> None:
        """Starts the next step's vote (decided in :meth:`after_step`)."""

    def after_backward(self) -> None:
        """After the backward of a training step (semi-sync's table update; else nothing)."""

    def after_step(self) -> None:
        """Decides the vote this step started (with the vote ahead). Collective.

        Call on every rank at the same point after every training step (after its update;
        other collectives may run before it, e.g. a checkpoint of this step).

        Raises:
            StopRequested: on every rank when some rank asked to stop.
        """
        stopping = self.runner.collective(self.guard.decide_ahead)
        if stopping:
            self.covered = None
            raise StopRequested(stopping)

    def detach(self) -> None:
        """Before evaluation: the sharded modules run their own forwards again."""

    def release(self) -> None:
        """At the end of a fit: the batches and iterators this step holds are let go."""


class UnpipelinedStep(TrainStep):
    """``pipeline=None``: the vote, then the forward on the step's own batch.

    With the vote ahead the training loader is read one batch ahead (:class:`~lightning_torchrec.
    training.pipeline_feed.Peek`), so the vote on the next batch runs during this step.

    Args:
        runner: the run it steps.
        ahead: whether each step starts the vote on the next one.
    """

    def __init__(self, runner: StepRunner, ahead: bool) -> None:
        super().__init__(runner, ahead)
        self._peek: Peek | None = None
        self._stepped = False  # whether a step ran since the last epoch's iterator

    def feed(self, loader: Any) -> Any:  # noqa: D102 (TrainStep's)
        if not self.ahead:
            return loader
        return PipelineFeed(loader, self._new_epoch, lambda: self.runner.step is self, Peek)

    def _new_epoch(self, peek: Peek) -> None:
        if self._peek is not None and not self._stepped:
            # A second training loader in the same epoch (Lightning combines them): the batch the
            # step gets is made of both, which no reader of one loader sees.
            self.runner.switch(
                UnpipelinedStep(self.runner, ahead=False),
                "the fit iterates two training loaders at once, so the vote on each step runs "
                "before its forward",
            )
        self._peek, self.covered, self._stepped = peek, None, False

    def train(  # noqa: D102 (TrainStep's)
        self, batch: Any, host: Any, at: StepPosition, run: Callable[[Any], Any], move: Any
    ) -> Any:
        self._stepped = True
        self._vote(host, batch, at)
        output = self.runner.collective(run, batch)
        self._after_forward(output, at)
        return output

    def _vote_next(self, at: StepPosition) -> None:
        if self._peek is None:
            return
        found, upcoming = self._peek.after(at.batch_idx)
        done = at.last or not found
        error = None if done else self.guard.verdict_of(upcoming, at.step + 1)
        self.runner.collective(self.guard.vote_ahead, error, at.batch_idx, done, at.stop)
        self.covered = None if done else at.batch_idx + 1

    def release(self) -> None:  # noqa: D102 (TrainStep's)
        if self._peek is not None:  # its workers exit now (see ``Split.close``)
            self._peek.close()
        self._peek = None


class SparseDistStep(TrainStep):
    """``pipeline="sparse_dist"``: the step through TorchRec's ``TrainPipelineSparseDist``.

    Its vote judges the batches the step's ``progress()`` sends before their own step (the next
    batch's input all-to-all starts before this batch's forward).

    Args:
        runner: the run it steps.
        mode: the run's mode (its ``ahead``, ``asked`` and semi-sync's ``start_batch``).
    """

    pipeline = "sparse_dist"

    def __init__(self, runner: StepRunner, mode: StepMode) -> None:
        super().__init__(runner, mode.ahead)
        self.driver = self._driver(runner, mode)

    def _driver(self, runner: StepRunner, mode: StepMode) -> SparseDistPipeline:
        return SparseDistPipeline(runner.model, runner.device, mode.asked)

    def feed(self, loader: Any) -> Any:  # noqa: D102 (TrainStep's)
        return self.driver.feed(loader)

    def _sent(self, at: StepPosition) -> tuple[Any, int, bool]:
        index, ending = epoch_ending(self.driver, at.batch_idx, at.last)
        return self.driver.ahead(at.batch_idx), index, ending

    def train(  # noqa: D102 (TrainStep's)
        self, batch: Any, host: Any, at: StepPosition, run: Callable[[Any], Any], move: Any
    ) -> Any:
        self._vote(host, batch, at)
        if self.driver.checked:
            output = self.runner.collective(self.driver.train_step, run)
        else:  # the first step: TorchRec traces the model; it may not be able to pipeline it
            output, usable = self.runner.collective(self.driver.run, run, lambda: run(move(host)))
            if not usable:  # unpipelined from now on, with no batch read ahead to vote on
                why = "TorchRec's train pipeline cannot pipeline this model (see the warning)"
                self.runner.switch(UnpipelinedStep(self.runner, ahead=False), why)
                self.guard.record_loss(output, at.step)
                return output
        self._after_forward(output, at)
        return output

    def _vote_next(self, at: StepPosition) -> None:
        # The batches the next step's progress() sends early, read and checked now.
        sent = [] if at.last else self.driver.ahead(at.batch_idx + 1)
        error = self.guard.verdict_of(None, at.step + 1, sent) if sent else None
        index, ending = epoch_ending(self.driver, at.batch_idx, at.last, 1)
        self.runner.collective(self.guard.vote_ahead, error, index, ending, at.stop)
        self.covered = None if at.last else at.batch_idx + 1

    def detach(self) -> None:  # noqa: D102 (TrainStep's)
        self.driver.detach()  # it re-attaches at its next step

    def release(self) -> None:  # noqa: D102 (TrainStep's)
        self.driver.release()


class SemiSyncStep(SparseDistStep):
    """``pipeline="semi_sync"``: TorchRec's ``TrainPipelineSemiSync``, its table update last.

    From ``start_batch`` on, the embeddings of batch ``i + 1`` are looked up before batch ``i``'s
    table update, so their all-to-all overlaps the backward; the tables' update runs after the
    front end's backward (:meth:`after_backward`).

    Args:
        runner: the run it steps.
        mode: the run's mode.
    """

    pipeline = "semi_sync"

    def _driver(self, runner: StepRunner, mode: StepMode) -> SparseDistPipeline:
        check_semi_sync_plan(getattr(runner.model, "plan", None))
        return SemiSyncPipeline(
            runner.model, runner.device, mode.start_batch, runner.global_step, mode.asked
        )

    def after_backward(self) -> None:
        """The tables' backward and fused update of the batch whose backward just ran."""
        self.runner.collective(self.driver.after_backward)
