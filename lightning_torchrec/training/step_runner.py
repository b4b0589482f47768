"""One owner for the step of a sharded model: its verdict, host batch, read-ahead and pipelines.

:class:`StepRunner` is built complete once, after the model is sharded, and is the only place
that knows how a step runs:

1. the host copy of the step's batch is held (:meth:`StepRunner.hold`) before it goes to the
   device, so the checks read host memory (no GPU-to-host synchronisation); where the front end
   changes batches after the loader (``transformed``), the step's own batch is checked;
2. one collective per step (:class:`~lightning_torchrec.training.step_guard.StepGuard`) decides
   the batch verdict (the batches a pipeline sends early, or a DataLoader worker's verdict),
   the previous step's loss and whether every rank is at its last batch;
3. the step runs: through the stage's train pipeline
   (:mod:`~lightning_torchrec.training.pipelines`), or plainly;
4. after the backward, semi-sync's table update (:meth:`StepRunner.after_backward`).

Every step's work runs under :func:`~lightning_torchrec.distributed.run_collective`, so a peer
that died gives a named :class:`~lightning_torchrec.errors.PeerFailureError`. Front ends (the
Trainer glue, a user's own loop) pass the step as a callable; nothing here knows Lightning.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_torchrec.compat.worker_fork import fork_safely
from lightning_torchrec.distributed import run_collective
from lightning_torchrec.errors import StopRequested
from lightning_torchrec.sharding.features import FeatureSpec
from lightning_torchrec.sharding.sharders import check_semi_sync_plan
from lightning_torchrec.training.device_checks import judged_next_step
from lightning_torchrec.training.pipeline_feed import Peek, PipelineFeed, epoch_ending
from lightning_torchrec.training.pipelines import SemiSyncPipeline, SparseDistPipeline
from lightning_torchrec.training.step_guard import StepGuard
from lightning_torchrec.training.uneven_data import check_counts
from lightning_torchrec.training.worker_checks import check_in_workers

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
        pipeline: ``None``, ``"sparse_dist"`` or ``"semi_sync"`` (already resolved).
        start_batch: ``"semi_sync"``'s first semi-synchronous global step.
        asked: whether the user named the pipeline (else it came from ``"auto"``).
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
        vote_ahead: for steps whose batches are checked on the host (pipelined, or unpipelined
            with host checks): start each step's vote on the next step right after the forward
            and decide it after the step (:meth:`after_step`, which the front end must then call
            on every rank after every training step), so the vote runs while the backward does
            instead of stopping the step. The batches the vote covers are read one step early:
            the next step's batch, or with a pipeline the ones its next ``progress()`` sends.
            On CUDA it carries the previous step's loss (this step's waits for the forward).
        transformed: the front end changes each batch between the loader and the step (e.g. a
            LightningModule's batch hooks): each step checks the batch it is given (on its
            device), not a host copy (:meth:`hold` keeps none) nor a DataLoader worker's
            verdict; no vote ahead, and no pipeline (it would train on the loader's batches).
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
        pipeline: str | None = None,
        start_batch: int = 0,
        asked: bool = True,
        global_step: Callable[[], int] = lambda: 0,
        timeout: Any = None,
        group: Any = None,
        batch_checks: str = "auto",
        vote_ahead: bool = False,
        transformed: bool = False,
    ) -> None:
        if batch_checks not in BATCH_CHECKS:
            raise ValueError(f"batch_checks must be one of {BATCH_CHECKS}, got {batch_checks!r}")
        if transformed and pipeline is not None:
            raise ValueError(f"pipeline={pipeline!r} trains on the loader's batches: use None")
        deferred = judged_next_step(batch_checks, device, specs or {}, model)
        self.model, self.device = model, device
        self.pipeline, self.start_batch, self.asked = pipeline, start_batch, asked
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
        self.training: SparseDistPipeline | None = None
        self.evaluation: SparseDistPipeline | None = None
        self._host_batch: Any = None
        #: Whether training steps vote ahead (see the ``vote_ahead`` argument).
        self.vote_ahead = vote_ahead and not transformed and (pipeline is not None or not deferred)
        self.transformed = transformed
        self._peek: Peek | None = None
        self._covered: int | None = None  # the batch whose checks a decided vote covered
        self._stepped = False  # whether a training step ran since the last epoch's iterator

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
        """Prepares a dataloader: checks in its workers, and reads ahead for the pipeline.

        Its workers, when forked, start after gloo's threads gave the GIL back
        (:func:`~lightning_torchrec.compat.worker_fork.fork_safely`).

        Args:
            loader: a training or evaluation dataloader.
            training: whether it is the training dataloader.

        Returns:
            The loader to iterate (wrapped when the stage runs a pipeline).
        """
        fork_safely(loader)
        if self.guard.validate_batches is not False and self.guard.token is not None:
            guard = self.guard
            check_in_workers(loader, guard.specs, guard.dense_width, str(guard.token))
        if training and self.vote_ahead and self.pipeline is None:
            return PipelineFeed(loader, self._new_epoch, lambda: self.vote_ahead, Peek)
        if self.pipeline is None:
            return loader
        if not training and self.evaluation is None:
            self.evaluation = SparseDistPipeline(self.model, self.device, self.asked)
        pipeline = self.stage(training)
        return loader if pipeline is None else pipeline.feed(loader)

    def _new_epoch(self, peek: Peek) -> None:
        if self._peek is not None and not self._stepped:
            # A second training loader in the same epoch (Lightning combines them): the batch
            # the step gets is made of both, so the vote stays before each forward.
            self.vote_ahead = False
        self._peek, self._covered, self._stepped = peek, None, False

    def stage(self, training: bool) -> SparseDistPipeline | None:
        """The running stage's pipeline, if any.

        Args:
            training: whether this is a training step.

        Returns:
            The pipeline, or None.
        """
        return self.training if training else self.evaluation

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
        return self.stage(training) is not None

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
        """One training step: the agreed checks, then the forward (pipelined or not).

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
        host = self._checked(batch)
        pipeline = self.training
        guard = self.guard
        self._stepped = True
        covered, self._covered = self._covered == batch_idx, None
        stopping = self.collective(guard.decide_ahead) or []  # normally decided already
        if not covered:  # no vote ahead decided this batch: vote now
            ahead = pipeline.ahead(batch_idx) if pipeline is not None else None
            at, end = epoch_ending(pipeline, batch_idx, last)
            stopping = self.collective(
                guard.before_training_step, host, step, at, end, ahead, batch, stop
            )
        if stopping:
            raise StopRequested(stopping)
        if pipeline is None:
            output = self.collective(run, batch)
        else:
            output, usable = self.collective(pipeline.run, run, lambda: run(move(host)))
            if not usable:  # unpipelined from now on, with no batch read ahead to vote on
                self.training, self.vote_ahead = None, False
        late = self.vote_ahead and self.device.type == "cuda"  # see the vote_ahead argument
        if not late:
            guard.record_loss(output, step)
        if self.vote_ahead and self.training is not None:
            self._vote_next_sent(self.training, step, batch_idx, last, stop)
        elif self.vote_ahead and self._peek is not None:
            self._vote_next(step, batch_idx, last, stop)
        if late:
            guard.record_loss(output, step)
        return output

    def _vote_next_sent(
        self, pipeline: SparseDistPipeline, step: int, batch_idx: int, last: bool, stop: bool
    ) -> None:
        # The batches the next step's progress() sends early, read and checked now.
        ahead = [] if last else pipeline.ahead(batch_idx + 1)
        error = self.guard.verdict_of(None, step + 1, ahead) if ahead else None
        at, ending = epoch_ending(pipeline, batch_idx, last, 1)
        self.collective(self.guard.vote_ahead, error, at, ending, stop)
        self._covered = None if last else batch_idx + 1

    def _vote_next(self, step: int, batch_idx: int, last: bool, stop: bool) -> None:
        assert self._peek is not None
        found, upcoming = self._peek.after(batch_idx)
        error = self.guard.verdict_of(upcoming, step + 1) if found and not last else None
        self.collective(self.guard.vote_ahead, error, batch_idx, last or not found, stop)
        self._covered = None if last or not found else batch_idx + 1

    def after_step(self) -> None:
        """Decides the vote a training step started (with ``vote_ahead``). Collective.

        Call on every rank at the same point after every training step (after its update;
        other collectives may run before it, e.g. a checkpoint of this step).

        Raises:
            StopRequested: on every rank when some rank asked to stop.
        """
        stopping = self.collective(self.guard.decide_ahead)
        if stopping:
            self._covered = None
            raise StopRequested(stopping)

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

    @property
    def updates_after_backward(self) -> bool:
        """Whether :meth:`after_backward` has work to do (semi-sync's table update)."""
        return isinstance(self.training, SemiSyncPipeline)

    def after_backward(self) -> None:
        """After the backward of a training step: semi-sync's table update of that batch."""
        if isinstance(self.training, SemiSyncPipeline):  # sparse-dist has nothing to do here
            self.collective(self.training.after_backward)

    # ------------------------------------------------------------------ stages
    def start_fit(self) -> None:
        """A new training pipeline for a new fit (none without a pipeline)."""
        self._peek, self._covered, self._stepped = None, None, False
        if self.pipeline == "semi_sync":
            check_semi_sync_plan(getattr(self.model, "plan", None))
            self.training = SemiSyncPipeline(
                self.model, self.device, self.start_batch, self.global_step, self.asked
            )
        elif self.pipeline is not None:
            self.training = SparseDistPipeline(self.model, self.device, self.asked)

    def end_fit(self) -> None:
        """Judges the last step's loss (collective) and releases the training pipeline."""
        self.collective(self.guard.flush)
        if self.training is not None:  # a later fit, validate or predict: the own forwards
            self.training.release()

    def start_evaluation(self) -> None:
        """Before evaluation: the sharded modules run their own forwards again."""
        if self.training is not None:  # it re-attaches at its next step
            self.training.detach()

    def end_evaluation(self) -> None:
        """After evaluation: releases the evaluation pipeline's batches and iterator."""
        if self.evaluation is not None:
            self.evaluation.release()

    def close(self) -> None:
        """Releases both pipelines' batches and iterators (at teardown)."""
        for pipeline in (self.training, self.evaluation):
            if pipeline is not None:
                pipeline.release()
        if self._peek is not None:  # its workers exit now (see ``Split.close``)
            self._peek.close()
        self._host_batch = self._peek = None
