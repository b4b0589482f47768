"""The step hooks of ``TorchRecStrategy``: every step goes through its ``StepRunner``.

Lightning calls these once per batch. They translate Lightning's calls (its batch, index, global
step and "last batch" state) into the runner's, which owns the checks, the vote and the
pipelines; the fused learning rate is pushed into the kernels before each training forward.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_torchrec.compat.fused import kernel_tables
from lightning_torchrec.compat.lightning import take_over_sigterm_broadcast
from lightning_torchrec.compat.lightning_batches import move_batch
from lightning_torchrec.compat.lightning_ddp import (
    DMPForwardRedirection,
    flush_first_static_backward,
    prepare_manual_backward,
)
from lightning_torchrec.compat.lightning_step import batch_position, is_dataloader_iter
from lightning_torchrec.compat.lightning_toggle import toggle_leaving
from lightning_torchrec.distributed import peer_failure, run_collective
from lightning_torchrec.errors import PeerFailureError, StopRequested
from lightning_torchrec.failure_reports import begin_run, post, post_stop
from lightning_torchrec.lightning.checkpoint_hooks import attached_trainer
from lightning_torchrec.sharding.sharders import has_fused_tables
from lightning_torchrec.training.optim import DenseAndFusedOptimizer
from lightning_torchrec.training.step_runner import StepRunner
from lightning_torchrec.training.steps import check_accumulation


class StepVote(Callback):
    """Decides, after each training step, the vote on the next step that ran during it.

    ``TorchRecStrategy`` puts it last among the Trainer's callbacks for a fit whose steps vote
    ahead (:class:`~lightning_torchrec.training.steps.StepMode`'s ``ahead``), and
    takes it out at teardown: every rank decides the vote at the same point, after the step's
    update and after the other callbacks (a checkpoint of this step is written even when the
    next batch is bad), and stops there together when it says so.

    Args:
        runner: the strategy's step runner.
    """

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        try:
            self.runner.after_step()
        except StopRequested:
            # Every rank stops after the same step, as after Lightning's own SIGTERM broadcast.
            raise SIGTERMException() from None


def take_over_step_votes(trainer: Any, runner: StepRunner) -> Any:
    """The step's vote carries Lightning's SIGTERM flag, and is decided by a :class:`StepVote`.

    Lightning's per-step SIGTERM broadcast (a GPU sync per step) is switched off meanwhile.

    Args:
        trainer: the Trainer about to fit (more than one rank).
        runner: the strategy's step runner.

    Returns:
        What undoes both (call at teardown).
    """
    runner.guard.carries_stop = True
    undo_broadcast = take_over_sigterm_broadcast(trainer)
    vote = StepVote(runner) if runner.vote_ahead else None
    if vote is not None:
        trainer.callbacks.append(vote)

    def undo() -> None:
        undo_broadcast()
        if vote is not None and vote in trainer.callbacks:
            trainer.callbacks.remove(vote)

    return undo


def guard_toggles(module: Any) -> Any:
    """Makes ``module.toggle_optimizer`` work with fused tables; returns what undoes it.

    Lightning's ``toggle_optimizer`` freezes every other optimizer's parameters: the fused
    tables' (combined into the first optimizer) refuse it with an unnamed torch error, and
    could not be frozen anyway, since their kernels update them in the backward of any loss
    that reaches them. Toggling the optimizer that holds them is Lightning's toggle with the
    tables left trainable; toggling another is refused, naming them. A module with its own
    ``toggle_optimizer`` keeps it.

    Args:
        module: the LightningModule about to train (manual optimization).

    Returns:
        A function that gives the module Lightning's ``toggle_optimizer`` back.
    """
    if type(module).toggle_optimizer is not L.LightningModule.toggle_optimizer:
        return lambda: None

    def toggle(optimizer: Any) -> None:
        holder = next(
            (o for o in module.trainer.optimizers if getattr(o, "fused", None) is not None), None
        )
        if holder is None:
            return L.LightningModule.toggle_optimizer(module, optimizer)
        inner = getattr(optimizer, "optimizer", optimizer)
        if inner is not holder:
            tables = [t for _, kernel in holder.fused_groups() for t in kernel_tables(kernel)]
            optimizers = list(module.trainer.optimizers)
            where = optimizers.index(inner) if inner in optimizers else "?"
            name = type(getattr(inner, "dense_optimizer", inner)).__name__
            raise ValueError(
                f"toggle_optimizer of optimizer {where} ({name}) cannot freeze the fused "
                f"embedding tables {sorted(set(tables))} of optimizer 0: their kernels update "
                "them inside the backward of any loss that reaches them. Detach the embeddings "
                "from this optimizer's loss instead, or toggle only optimizer 0."
            )
        fused = {id(p) for group in holder.fused.param_groups for p in group["params"]}
        toggle_leaving(module, optimizer, fused)

    vars(module)["toggle_optimizer"] = toggle
    return lambda: vars(module).pop("toggle_optimizer", None)


class StepHooks:
    """Mixin for ``TorchRecStrategy`` (which provides the annotated attributes)."""

    lightning_module: Any
    optimizers: list[Any]
    collective_timeout: Any
    root_device: torch.device
    allow_fused_gradient_accumulation: bool
    _plan: Any
    _runner: StepRunner | None
    #: The Trainer's ``accumulate_grad_batches`` at the last training step (checked on change).
    _accumulating: int = 1
    #: Between a training backward and the optimizer step: fused tables hold the step's
    #: update, the dense weights not yet (a checkpoint now would not resume exactly).
    tables_ahead: bool = False
    model: Any
    #: The dense DDP whose first (static-graph) manual backward was all-reduced.
    _flushed: Any = None
    #: Undoes :func:`guard_toggles` (set during a manual-optimization fit).
    _undo_toggles: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Lightning's DDP handling of `manual_backward` (here and in `pre_backward` and
        # `post_backward`), for the dense DDP inside the DMP: Lightning's own looks for a DDP at
        # `model`, finds the DMP, and leaves the dense gradients of manual optimization
        # unreduced: every rank would train its own dense weights.
        self._forward_redirection = DMPForwardRedirection()

    def _push_fused_lr(self) -> None:
        for opt in self.optimizers:
            if isinstance(opt, DenseAndFusedOptimizer):
                opt.push_fused_lr()

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return run_collective(fn, *args, timeout=self.collective_timeout, **kwargs)

    # Lightning's own collectives (its set-up barriers, checkpoint broadcasts, logged values'
    # `sync_dist`, EarlyStopping's decision) also name a dead or failed peer.
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._collective(super().barrier, *args, **kwargs)  # type: ignore[misc]

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._collective(super().broadcast, obj, src)  # type: ignore[misc]

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._collective(super().reduce, tensor, *args, **kwargs)  # type: ignore[misc]

    @override
    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._collective(super().all_gather, tensor, *args, **kwargs)  # type: ignore[misc]

    def _move(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        if self._runner is not None and not self._runner.transformed:  # no batch hook to run
            return move_batch(batch, torch.device(device or self.root_device))
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        # The step checks the host copy (no GPU-to-host sync); a pipeline copies its batches to
        # the device itself (on its own stream).
        training = self.lightning_module.trainer.training
        if self._runner is not None and self._runner.hold(batch, training):
            return batch
        return self._move(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # The fused kernels read the LR during backward; a scheduler's change made after the
        # last step must reach them before this forward (and the first step after a resume).
        self._push_fused_lr()
        assert self._runner is not None
        trainer = self.lightning_module.trainer
        self._check_accumulation(trainer)
        # Lightning's own index: a `training_step(self, batch)` gets none in `args`.
        step, (batch_idx, last) = trainer.global_step, batch_position(trainer)
        last = last or batch_idx + 1 >= trainer.num_training_batches
        last = last or 0 < trainer.max_steps <= step + 1
        batch = args[0] if args else kwargs.pop("batch")
        self._refuse_dataloader_iter(batch, "training_step", self._runner.step.pipeline)
        parent = super()

        def run(device_batch: Any) -> Any:
            return parent.training_step(device_batch, *args[1:], **kwargs)

        stop = bool(getattr(trainer, "received_sigterm", False))
        try:
            return self._runner.train_step(batch, batch_idx, step, last, run, self._move, stop)
        except StopRequested:
            # Every rank stops at the same step, as after Lightning's own SIGTERM broadcast.
            raise SIGTERMException() from None

    def _refuse_dataloader_iter(self, batch: Any, hook: str, pipeline: Any) -> None:
        # A step that fetches its own batches (Lightning's `dataloader_iter`) escapes the checks
        # and the vote, and a pipeline would hand it a batch: run unchecked and unpipelined only.
        assert self._runner is not None
        if not is_dataloader_iter(batch):
            return
        if self._runner.guard.validate_batches is not False or pipeline is not None:
            raise ValueError(
                f"{hook}(self, dataloader_iter) fetches its batches itself, so TorchRecStrategy "
                "can neither check them against the tables before the step nor feed them through "
                "a train pipeline. Take the batch as an argument (`(self, batch, batch_idx)`), "
                "or pass TorchRecStrategy(validate_batches=False, pipeline=None) to run it "
                "unchecked."
            )

    def _check_accumulation(self, trainer: Any) -> None:
        # Set at setup, refused there; a callback may change it mid-fit (at an epoch's start).
        factor = trainer.accumulate_grad_batches
        if factor != self._accumulating:
            assert self._runner is not None
            fused, allowed = has_fused_tables(self._plan), self.allow_fused_gradient_accumulation
            source = f"accumulate_grad_batches={factor} (set at epoch {trainer.current_epoch})"
            check_accumulation(factor, source, fused, allowed, self._runner.pipeline is not None)
            self._accumulating = factor

    def _eval_step(self, step_fn: Any, stage: str, args: Any, kwargs: Any) -> Any:
        assert self._runner is not None
        trainer = self.lightning_module.trainer
        # A step that takes no `batch_idx` gets `(batch,)`: count as Lightning does.
        index, last = batch_position(trainer)
        batch_idx = int(args[1]) if len(args) > 1 else kwargs.get("batch_idx", index)
        batch = args[0] if args else kwargs.pop("batch")
        self._refuse_dataloader_iter(batch, step_fn.__name__, self._runner.evaluation)

        def run(device_batch: Any) -> Any:
            return step_fn(device_batch, *args[1:], **kwargs)

        return self._runner.eval_step(batch, stage, batch_idx, last, run, self._move)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().predict_step, "predict", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().validation_step, "validation", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().test_step, "test", args, kwargs)

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> Any:
        # From here on fused tables may hold this step's update (set before the backward: a
        # user's on_after_backward runs inside it); cleared by the optimizer step.
        self.tables_ahead = True
        # The backward runs collectives too (sparse all-to-all, the DDP all-reduce).
        return self._collective(super().backward, closure_loss, optimizer, *args, **kwargs)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if not self.lightning_module.automatic_optimization:  # see `__init__`
            prepare_manual_backward(self.model, closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if not self.lightning_module.automatic_optimization:  # see `__init__`
            self._flushed = flush_first_static_backward(self.model, self._flushed)
        super().post_backward(closure_loss)
        if self._runner is not None and self.lightning_module.trainer.training:
            self._runner.after_backward()  # semi-sync: the tables' update of this batch

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        done = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        self.tables_ahead = False
        return done

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        # No report of an earlier run in these processes explains a failure of this one.
        begin_run(getattr(self, "global_rank", 0))

    @override
    def on_train_start(self) -> None:
        self.tables_ahead = False  # a failed fit before this one may have left it set
        if not self.lightning_module.automatic_optimization:
            self._undo_toggles = guard_toggles(self.lightning_module)
        super().on_train_start()  # type: ignore[misc]

    def _give_toggles_back(self) -> None:
        if self._undo_toggles is not None:
            self._undo_toggles()
        self._undo_toggles = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        rank = getattr(self, "global_rank", 0)
        # A dead peer's launcher (Lightning's, torchrun) kills the survivors within seconds,
        # often before the traceback is printed after teardown: say why on this rank now. A
        # collective of someone else's (a metric's sync) failed bare: say which peer failed.
        failure = exception
        if not isinstance(exception, PeerFailureError):
            failure = peer_failure(exception, self.collective_timeout) or exception
        if isinstance(failure, PeerFailureError):
            name = type(failure).__name__
            print(f"[rank {rank}] {name}: {failure}", file=sys.stderr, flush=True)
        self.report_failure(failure)  # not a dead peer's bare error: that is not this rank's
        self._give_toggles_back()
        super().on_exception(exception)  # type: ignore[misc]

    def report_failure(self, exception: BaseException) -> None:
        """Tells the peers what this rank fails with, before it exits (see ``failure_reports``).

        Args:
            exception: the error this rank is failing with.
        """
        trainer = attached_trainer(self.lightning_module)
        step = "set-up" if trainer is None else f"global step {trainer.global_step}"
        stage = getattr(trainer.state.stage, "value", "") if trainer is not None else ""
        post(exception, f"{step} ({stage})" if stage else step, getattr(self, "global_rank", 0))

    @override
    def on_train_end(self) -> None:
        self._give_toggles_back()
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None and trainer.should_stop and getattr(self, "world_size", 1) > 1:
            post_stop(f"global step {trainer.global_step}", getattr(self, "global_rank", 0))
        if self._runner is not None:  # the last step's loss has no next step to be judged at
            self._runner.end_fit()
