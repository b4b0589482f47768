"""The steps of a sharded model: their owner, and one object per mode, chosen once per run.

:class:`StepRunner` is built complete once, after the model is sharded, by either front end (the
Trainer's strategy, the Fabric strategy). It holds the host copy of the step's batch before it
goes to the device (:meth:`StepRunner.hold`: the checks read host memory, no GPU-to-host
synchronisation; where the front end changes batches after the loader, ``transformed``, the
step's own batch is checked), prepares the loaders (checks in their workers, reading ahead),
runs evaluation steps plainly or through a forward-only sparse-dist pipeline, and hands each
training step to the run's step object.

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
(:meth:`StepRunner.switch`), never a flag. Every step's work runs under
:func:`~lightning_torchrec.distributed.run_collective`, so a peer that died gives a named
:class:`~lightning_torchrec.errors.PeerFailureError`. Front ends pass the step as a callable;
nothing here knows Lightning.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_torchrec.compat.worker_fork import fork_safely
from lightning_torchrec.distributed import run_collective
from lightning_torchrec.errors import StopRequested
from lightning_torchrec.sharding.features import FeatureSpec
from lightning_torchrec.sharding.sharders import check_semi_sync_plan
from lightning_torchrec.training.device_checks import judged_next_step
from lightning_torchrec.training.pipelines import (
    Peek,
    PipelineConfig,
    PipelineFeed,
    SemiSyncPipeline,
    SparseDistPipeline,
    epoch_ending,
)
from lightning_torchrec.training.step_guard import StepGuard, check_counts
from lightning_torchrec.training.worker_checks import check_in_workers

log = logging.getLogger(__name__)

#: When a training batch is checked (see :class:`StepRunner`).
BATCH_CHECKS = ("auto", "before_forward", "next_step")


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
        loss_after_vote: with the vote ahead, whether it carries the previous step's loss and
            this step's is recorded after it (where the host runs ahead of the device:
            :func:`host_runs_ahead`), instead of this step's loss before it.
    """

    pipeline: str | None = None
    ahead: bool = False
    start_batch: int = 0
    asked: bool = True
    loss_after_vote: bool = False

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


def host_runs_ahead(device: torch.device) -> bool:
    """Whether the host queues work on ``device`` and runs ahead of it (CUDA).

    There, reading a result (a step's loss) makes the host wait until the device has finished
    everything queued before it; on the CPU a result is ready when its op returns.

    Args:
        device: the rank's device.

    Returns:
        True on CUDA.
    """
    return device.type == "cuda"


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
    It starts right after the forward; where the host runs ahead of the device
    (:func:`host_runs_ahead`) it carries the previous step's loss (``loss_after_vote``), since
    reading this one would hold the host until the device finished the forward.

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
    after = ahead and host_runs_ahead(device)
    return StepMode(pipeline, ahead, config.start_batch, config.kind != "auto", after)


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
        # The run's choice (StepMode.loss_after_vote): on CUDA the vote ahead carries the
        # previous step's loss, since reading this one would hold the host until the forward ends.
        self.loss_after_vote = ahead and runner.mode.loss_after_vote
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
    training.pipelines.Peek`), so the vote on the next batch runs during this step.

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


class StepRunner:
    """Runs the training and evaluation steps of one sharded model.

    Args:
        model: the ``DistributedModelParallel``.
        device: the rank's device.
        specs: what each sparse feature may hold (from the unsharded model).
        dense_width: the dense input width, or None.
        validate_batches: True checks every batch, an int ``N`` the first ``N`` steps, False none.
        on_nonfinite_loss: ``"raise"`` or ``"ignore"``.
        mode: how training steps run (:func:`~lightning_torchrec.training.steps.choose_mode`):
            the pipeline and the vote ahead. With the vote ahead, a step's vote on the next step
            starts after its forward and is decided after the step (:meth:`after_step`, which
            the front end must then call on every rank after every training step), so the vote
            runs while the backward does. The batches it covers are read one step early: the
            next step's batch, or with a pipeline the ones its next ``progress()`` sends. On
            CUDA it carries the previous step's loss (this step's waits for the forward; the
            mode's ``loss_after_vote``).
        global_step: returns the number of finished training steps.
        timeout: the collective timeout (for messages).
        group: the process group the votes run on (a gloo group keeps them on the host). Where
            the default group is a gloo one too, the votes ahead run on it instead: a rank
            decides one after its backward, whose collectives each peer joins only after
            starting its part, so a hung peer holds the others there (under ``timeout``), never
            at that vote; on CPU ranks the default group runs them cheaper
            (``docs/benchmarks.md``).
        batch_checks: when an unpipelined training batch that no DataLoader worker checked is
            checked: ``"before_forward"`` (its ids read on the host), ``"next_step"`` (on its
            device, judged at the next step's vote; see
            :mod:`~lightning_torchrec.training.device_checks`), or ``"auto"``: ``"next_step"``
            on CUDA where a bad batch cannot break its own step first (see
            :func:`~lightning_torchrec.training.device_checks.judged_next_step`),
            ``"before_forward"`` otherwise and on the CPU (where both read the same memory).
        transformed: the front end changes each batch between the loader and the step (e.g. a
            LightningModule's batch hooks): each step checks the batch it is given (on its
            device), not a host copy (:meth:`hold` keeps none) nor a DataLoader worker's
            verdict; no vote ahead, and no pipeline (it would train on the loader's batches).

    Raises:
        ValueError: for an unknown ``batch_checks``, or a ``transformed`` runner with a
            pipeline or the vote ahead.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        specs: dict[str, FeatureSpec],
        dense_width: int | None,
        validate_batches: bool | int = True,
        on_nonfinite_loss: str = "raise",
        mode: StepMode | None = None,
        global_step: Callable[[], int] = lambda: 0,
        timeout: Any = None,
        group: Any = None,
        batch_checks: str = "auto",
        transformed: bool = False,
    ) -> None:
        if batch_checks not in BATCH_CHECKS:
            raise ValueError(f"batch_checks must be one of {BATCH_CHECKS}, got {batch_checks!r}")
        mode = mode or StepMode()
        if transformed and (mode.pipeline is not None or mode.ahead):
            raise ValueError(
                f"pipeline={mode.pipeline!r} (vote ahead: {mode.ahead}) trains on the loader's "
                "batches: use pipeline=None without the vote ahead"
            )
        deferred = judged_next_step(batch_checks, device, specs or {}, model)
        if mode.ahead and mode.pipeline is None and deferred:
            raise ValueError("an unpipelined step checked on the device cannot vote ahead")
        self.model, self.device, self.mode = model, device, mode
        #: The pipeline of the run (evaluation runs a forward-only one where it is not None).
        self.pipeline = mode.pipeline
        self.global_step, self.timeout = global_step, timeout
        self.guard = StepGuard(
            on_nonfinite_loss,
            device,
            validate_batches,
            specs=specs,
            dense_width=dense_width,
            group=group,
            token=None if transformed else uuid.uuid4().hex,  # no worker saw the step's batch
            deferred=deferred,
        )
        #: The training step object (a plain one until a fit starts: :meth:`start_fit`).
        self.step: TrainStep = UnpipelinedStep(self, ahead=False)
        self.evaluation: SparseDistPipeline | None = None
        self._host_batch: Any = None
        self.transformed = transformed

    @property
    def vote_ahead(self) -> bool:
        """Whether the current training step object votes ahead."""
        return self.step.ahead

    def switch(self, step: TrainStep, why: str) -> None:
        """Trains with another step object from the next step on (a run-time fallback).

        Args:
            step: the new step object.
            why: what made the switch necessary (logged at INFO level).
        """
        old = self.step
        log.info(
            "training switches from the %s step to the %s step: %s",
            old.pipeline or "unpipelined",
            step.pipeline or "unpipelined",
            why,
        )
        self.step = step

    # ------------------------------------------------------------------ data
    def collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn``, which enters collectives; a peer that died raises ``PeerFailureError``.

        Args:
            fn: the call.
            *args: its positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            What ``fn`` returned.
        """
        return run_collective(fn, *args, timeout=self.timeout, **kwargs)

    def check_counts(self, stage: str, count: float) -> None:
        """Refuses, on every rank, known batch counts that differ between ranks. Collective.

        Args:
            stage: ``"training"``, ``"validation"``, ``"test"`` or ``"predict"``.
            count: this rank's number of batches (``inf`` when unknown).
        """
        self.collective(check_counts, count, stage)

    def feed(self, loader: Any, training: bool) -> Any:
        """Prepares a dataloader: checks in its workers, and reads ahead for the step.

        Its workers, when forked, start after gloo's threads gave the GIL back
        (:func:`~lightning_torchrec.compat.worker_fork.fork_safely`).

        Args:
            loader: a training or evaluation dataloader.
            training: whether it is the training dataloader.

        Returns:
            The loader to iterate (wrapped when the step or the evaluation reads ahead).
        """
        fork_safely(loader)
        if self.guard.validate_batches is not False and self.guard.token is not None:
            guard = self.guard
            check_in_workers(loader, guard.specs, guard.dense_width, str(guard.token))
        if training:
            return self.step.feed(loader)
        if self.pipeline is None:
            return loader
        if self.evaluation is None:
            self.evaluation = SparseDistPipeline(self.model, self.device, self.mode.asked)
        return self.evaluation.feed(loader)

    def hold(self, batch: Any, training: bool) -> bool:
        """Keeps the host copy of the coming step's batch for the checks.

        Args:
            batch: the batch as the loader made it (on the host).
            training: whether it is a training batch.

        Returns:
            True when the stage's pipeline copies batches to the device itself (the caller
            then passes ``batch`` on unmoved). None is held for a ``transformed`` runner.
        """
        self._host_batch = None if self.transformed else batch
        if training:
            return self.step.pipeline is not None
        return self.evaluation is not None

    def _checked(self, batch: Any) -> Any:
        host, self._host_batch = self._host_batch, None
        return batch if host is None else host

    # ------------------------------------------------------------------ steps
    def train_step(
        self,
        batch: Any,
        batch_idx: int,
        step: int,
        last: bool,
        run: Callable[[Any], Any],
        move: Callable[[Any], Any],
        stop: bool = False,
    ) -> Any:
        """One training step, by the run's step object (:mod:`~lightning_torchrec.training.steps`).

        Args:
            batch: the step's batch as the front end has it (on the device, or the host batch
                when a pipeline copies it).
            batch_idx: its index in the epoch.
            step: the global step.
            last: whether this rank has no batch after this one in the epoch.
            run: runs the training step's forward on a device batch and returns its output.
            move: copies a host batch to the device (when a pipeline falls back).
            stop: whether this rank asks every rank to stop before this step (it received a
                signal); decided in the step's vote when ``guard.carries_stop`` is set.

        Returns:
            What ``run`` returned.

        Raises:
            StopRequested: on every rank, before the forward, when some rank asked to stop.
        """
        at = StepPosition(batch_idx, step, last, stop)
        return self.step.train(batch, self._checked(batch), at, run, move)

    def after_step(self) -> None:
        """Decides the vote a training step started (with the vote ahead). Collective.

        Raises:
            StopRequested: on every rank when some rank asked to stop.
        """
        self.step.after_step()

    def after_backward(self) -> None:
        """After the backward of a training step: semi-sync's table update of that batch."""
        self.step.after_backward()

    def eval_step(
        self,
        batch: Any,
        stage: str,
        batch_idx: int,
        last: bool,
        run: Callable[[Any], Any],
        move: Callable[[Any], Any],
    ) -> Any:
        """One validation, test or predict step (see :meth:`train_step`).

        Args:
            batch: the step's batch as the front end has it.
            stage: ``"validation"``, ``"test"`` or ``"predict"``.
            batch_idx: its index.
            last: whether this rank has no batch after this one.
            run: runs the step on a device batch.
            move: copies a host batch to the device.

        Returns:
            What ``run`` returned.
        """
        host = self._checked(batch)
        pipeline = self.evaluation
        ahead = pipeline.ahead(batch_idx) if pipeline is not None else None
        at, ending = epoch_ending(pipeline, batch_idx, last)
        self.collective(self.guard.before_eval_step, host, stage, at, ending, ahead)
        if pipeline is None:
            return self.collective(run, batch)
        output, usable = self.collective(pipeline.run, run, lambda: run(move(host)))
        if not usable:
            self.evaluation = None
        return output

    def settle(self) -> None:
        """Judges a pending batch verdict on every rank (before a checkpoint is written)."""
        self.collective(self.guard.settle)

    def explain(self) -> None:
        """Decides a started vote on every rank: a NaN loss it carries raises its named error."""
        self.collective(self.guard.decide_ahead)

    # ------------------------------------------------------------------ stages
    def start_fit(self) -> None:
        """A new step object of the run's mode for a new fit (a new pipeline, if any)."""
        self.step = self.mode.build(self)

    def end_fit(self) -> None:
        """Judges the last step's loss (collective) and releases the training step's pipeline."""
        self.collective(self.guard.flush)
        self.step.release()  # a later fit, validate or predict: the modules' own forwards

    def start_evaluation(self) -> None:
        """Before evaluation: the sharded modules run their own forwards again."""
        self.step.detach()

    def end_evaluation(self) -> None:
        """After evaluation: releases the evaluation pipeline's batches and iterator."""
        if self.evaluation is not None:
            self.evaluation.release()

    def close(self) -> None:
        """Releases the step's and the evaluation's batches and iterators, and the vote's group.

        Call at the end of the run (teardown): the runner votes no more after it.
        """
        self.step.release()
        if self.evaluation is not None:
            self.evaluation.release()
        self._host_batch = None
        self.guard.release()
