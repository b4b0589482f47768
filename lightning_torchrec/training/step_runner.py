"""One owner for the steps of a sharded model: its guard, host batch, loaders and step object.

:class:`StepRunner` is built complete once, after the model is sharded, by either front end (the
Trainer's strategy, the Fabric strategy):

1. the host copy of the step's batch is held (:meth:`StepRunner.hold`) before it goes to the
   device, so the checks read host memory (no GPU-to-host synchronisation); where the front end
   changes batches after the loader (``transformed``), the step's own batch is checked;
2. the training step is one object of the run's mode (:mod:`~lightning_torchrec.training.steps`:
   unpipelined, sparse-dist, semi-sync), built at each fit's start; its one collective
   (:class:`~lightning_torchrec.training.step_guard.StepGuard`) decides the batch verdict, the
   previous step's loss and whether every rank is at its last batch;
3. evaluation steps run plainly or through a forward-only sparse-dist pipeline.

Every step's work runs under :func:`~lightning_torchrec.distributed.run_collective`, so a peer
that died gives a named :class:`~lightning_torchrec.errors.PeerFailureError`. Front ends (the
Trainer glue, a user's own loop) pass the step as a callable; nothing here knows Lightning.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_torchrec.compat.worker_fork import fork_safely
from lightning_torchrec.distributed import run_collective
from lightning_torchrec.sharding.features import FeatureSpec
from lightning_torchrec.training.device_checks import judged_next_step
from lightning_torchrec.training.pipeline_feed import epoch_ending
from lightning_torchrec.training.pipelines import SparseDistPipeline
from lightning_torchrec.training.step_guard import StepGuard, check_counts
from lightning_torchrec.training.steps import StepMode, StepPosition, TrainStep, UnpipelinedStep
from lightning_torchrec.training.worker_checks import check_in_workers

log = logging.getLogger(__name__)

#: When a training batch is checked (see :class:`StepRunner`).
BATCH_CHECKS = ("auto", "before_forward", "next_step")


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
            CUDA it carries the previous step's loss (this step's waits for the forward).
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
        """Releases the step's and the evaluation's batches and iterators (at teardown)."""
        self.step.release()
        if self.evaluation is not None:
            self.evaluation.release()
        self._host_batch = None
