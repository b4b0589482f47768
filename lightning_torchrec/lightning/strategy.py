"""``TorchRecStrategy``: Lightning training with TorchRec's ``DistributedModelParallel``.

One class, one file: what the Trainer's loop asks of a strategy (set-up, the steps, the data, the
checkpoints, the end) in the order a fit meets it. What the Fabric front end does too lives in
the core it delegates to (:class:`~lightning_torchrec.training.run.ShardedRun`: process groups,
sharding, the steps, collectives, failures); the step itself is one object of the run's mode
(:mod:`~lightning_torchrec.training.steps`); saving and loading are
:mod:`~lightning_torchrec.lightning.checkpoint_hooks`. ``docs/life_of_a_step.md`` follows one
training step through these files.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from typing_extensions import override

from lightning_torchrec.checkpoint import remove_checkpoint
from lightning_torchrec.checkpoint.limits import CheckpointLimits
from lightning_torchrec.compat.lightning import (
    layer_sync,
    model_kept_in_place,
    process_group_backend,
    processed_epochs,
    results_only_launcher,
)
from lightning_torchrec.compat.lightning_batches import move_batch
from lightning_torchrec.compat.lightning_ddp import (
    DMPForwardRedirection,
    flush_first_static_backward,
    prepare_manual_backward,
)
from lightning_torchrec.compat.lightning_step import batch_position, is_dataloader_iter
from lightning_torchrec.compat.lightning_toggle import guard_toggles
from lightning_torchrec.errors import StopRequested
from lightning_torchrec.failure_reports import post_stop
from lightning_torchrec.lightning.checkpoint_hooks import (
    attached_trainer,
    load_trainer_checkpoint,
    save_trainer_checkpoint,
)
from lightning_torchrec.lightning.mid_epoch import resume_in_epoch, set_sampler_epoch
from lightning_torchrec.lightning.preemption import add_slurm_requeue
from lightning_torchrec.lightning.step_vote import take_over_step_votes
from lightning_torchrec.lightning.trainer_setup import (
    accumulation,
    adapt_trainer_defaults,
    batch_hooks,
    check_fit,
    check_setup,
    check_sync_batchnorm,
    write_plan,
)
from lightning_torchrec.sharding.plan_summary import PlanSummary
from lightning_torchrec.sharding.planning import ShardingConfig
from lightning_torchrec.sharding.sharders import has_fused_tables
from lightning_torchrec.training.device_checks import judged_next_step
from lightning_torchrec.training.optim import combine_with_schedulers, keyed_further, push_fused_lr
from lightning_torchrec.training.pipelines import PipelineConfig
from lightning_torchrec.training.run import ShardedRun, register_names
from lightning_torchrec.training.step_guard import StepGuard
from lightning_torchrec.training.steps import (
    StepRunner,
    check_accumulation,
    choose_mode,
)

#: ``TorchRecStrategy``'s default ``peer_timeout``.
PEER_TIMEOUT = timedelta(minutes=5)


class TorchRecStrategy(DDPStrategy):
    """Trains any LightningModule holding TorchRec embedding modules with sharded tables.

    One process per device (gloo on CPU, nccl on CUDA; Lightning's launcher, ``torchrun`` and
    SLURM all work). At setup it plans on rank 0 (one plan for all ranks), wraps the
    LightningModule in ``DistributedModelParallel`` (meta tables materialise only as shards) via
    :func:`lightning_torchrec.sharding.planning.shard_model` (as ``maybe_shard_model`` does), and
    combines the fused embedding optimizer with the dense one from ``configure_optimizers``.
    Checkpoints are sharded ``torch.distributed.checkpoint`` directories; a fit resumed from a
    mid-epoch checkpoint continues the training loader (a map-style DataLoader, or one with the
    ``resume_at`` hook: the package's) at the first batch not trained on
    (``lightning_torchrec.lightning.mid_epoch``). Under ``SLURMEnvironment(auto_requeue=True)``
    a :class:`~lightning_torchrec.lightning.preemption.SLURMRequeue` saves between steps.

    It extends Lightning's ``DDPStrategy``, not ``ParallelStrategy``: a DMP needs exactly DDP's
    process group, launchers and collectives, and DMP wraps the dense part in DDP itself, so
    ``Strategy.setup``'s template runs with ``_setup_model`` sharding instead of DDP's wrap
    (``DDPStrategy.setup`` is skipped), and the model is never moved (DMP places its shards).

    Args:
        sharders: TorchRec sharders; defaults to TorchRec's with ``fused_params``.
        plan: an explicit ``ShardingPlan`` (skips the planner).
        constraints: per-table ``ParameterConstraints`` for the planner.
        fused_params: fused embedding optimizer settings (``optimizer``, ``learning_rate``, ...);
            defaults to row-wise Adagrad, lr 0.01. Give either this or ``sharders``.
        planner: a planner to use instead of the default one.
        data_parallel_wrapper: how DMP wraps the dense part (e.g. to find unused parameters).
        allow_fused_gradient_accumulation: fused tables update at every backward, so gradient
            accumulation (or a ``GradientAccumulationScheduler``) skips them; True accepts that.
        log_plan: print the plan at start and write it to the loggers.
        load_optimizer_states: False resumes from a checkpoint's weights, hyper-parameters and
            training progress with fresh optimizer state (needed when a plan change reshapes the
            fused optimizer state; loading it raises a ``CheckpointMismatchError`` naming it).
        accelerator: see ``DDPStrategy``.
        parallel_devices: see ``DDPStrategy``.
        cluster_environment: see ``DDPStrategy``.
        checkpoint_io: see ``DDPStrategy`` (unused for sharded checkpoints).
        precision_plugin: see ``DDPStrategy``.
        process_group_backend: ``"gloo"``/``"nccl"``; defaults to the device's.
        timeout: collective timeout.
        peer_timeout: how long a rank waits for the others at a step's vote (the one small
            collective of every step, on a gloo group of its own, but for the votes ahead of
            CPU ranks) before it raises ``PeerFailureError``: a rank that died or hangs stops
            the others within this time instead of ``timeout``, so torchrun restarts the job
            promptly (see ``vote_ahead``). Longer than any rank's work between two steps.
            None: the votes run on the default group, under ``timeout``.
        start_method: ``"popen"`` (scripts), ``"spawn"`` or ``"fork"`` (notebooks).
        validate_batches: check each batch against the tables before the forward (ids in
            range, known keys, lengths, dtypes, finite dense features; see
            ``lightning_torchrec.training.batch_checks``); an int ``N`` checks the first ``N``
            training steps (and evaluation batches) only, False never. A DataLoader with
            workers checks each batch in the worker that makes it (off the training process's
            critical path); otherwise the step runs one vectorised pass over the ids. Either
            way the verdict rides in the step's one tiny ``all_reduce``.
        on_nonfinite_loss: ``"raise"``: a NaN/inf loss on any rank raises a
            ``NonFiniteLossError`` naming the step and ranks on every rank, before the next
            step (``lightning_torchrec.training.step_guard``; checkpoints refuse non-finite
            values), in the batch check's collective; ``"ignore"``.
        check_finite_checkpoints: refuse to save a checkpoint holding NaN/inf weights or
            optimizer state.
        pipeline: ``"auto"`` (the default): ``"sparse_dist"`` where it is faster (CUDA; CPU
            ranks whose steps vote ahead), else none (``docs/benchmarks.md``); a model TorchRec
            cannot pipeline, batch hooks (``on_after_batch_transfer``, ...: refused by a named
            pipeline) or accumulation: none (an INFO line says why). ``"sparse_dist"``: TorchRec's
            ``TrainPipelineSparseDist`` (the next batch's copy and sparse input all-to-all
            overlap this batch's forward and backward; the same results as ``None``) with
            ``training_step`` unchanged; validation, test and predict run through the same
            pipeline in eval mode (forward only); see ``lightning_torchrec.training.pipelines``.
            ``"semi_sync"``: TorchRec's ``TrainPipelineSemiSync``: from global step
            ``start_batch`` on, the embeddings of batch ``i + 1`` are looked up before batch
            ``i``'s table update (one batch of staleness for the tables; dense weights stay
            synchronous), so their all-to-all overlaps the backward; synchronous (the same
            results as ``None``) before it. ``None``: no pipeline.
        batch_checks: when an unpipelined training batch that no DataLoader worker checked
            is checked. ``"auto"``: ``"next_step"`` on CUDA where every table's kernel clamps bad
            ids and no feature has a per-sample limit, else ``"before_forward"``: its ids are
            read on the host before the forward (on CUDA the host then waits for the GPU's copy
            of the batch). ``"next_step"``: checked on the device with a few reductions, the
            verdict read at the next step's vote (no wait); a bad batch stops every rank one
            step later, with the same named error, its ids clamped to row 0 by fbgemm in
            between, and before any checkpoint is written (``training.device_checks``).
        pipeline_options: ``{"start_batch": N}`` for ``"semi_sync"`` (default 900, TorchRec's).
        vote_ahead: training on more than one rank, pipelined or with batches checked on the
            host: each step's vote on the next step starts after the forward and is decided
            after the step (the batches it covers read one step early), during the backward.
            False votes before each forward: only then does a peer that hangs between two steps
            stop the others within ``peer_timeout`` (with the vote ahead they wait in the next
            forward's all-to-all, for ``timeout``).
        checkpoint_key: an HMAC-SHA256 key: checkpoints are saved with signed manifests and only
            those signed with it load (``lightning_torchrec.checkpoint.signing``; None: the
            ``LIGHTNING_TORCHREC_CHECKPOINT_KEY_FILE`` environment variable decides).

    Raises:
        ValueError: if both ``sharders`` and ``fused_params`` are given, ``plan`` with
            ``constraints`` or ``planner``, for an unknown ``on_nonfinite_loss``, pipeline or
            pipeline option.
    """

    strategy_name = "torchrec"

    def __init__(
        self,
        sharders: list[ModuleSharder[torch.nn.Module]] | None = None,
        plan: ShardingPlan | None = None,
        constraints: dict[str, ParameterConstraints] | None = None,
        fused_params: dict[str, Any] | None = None,
        planner: EmbeddingShardingPlanner | None = None,
        data_parallel_wrapper: DataParallelWrapper | None = None,
        allow_fused_gradient_accumulation: bool = False,
        log_plan: bool = True,
        load_optimizer_states: bool = True,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        peer_timeout: timedelta | None = PEER_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        validate_batches: bool | int = True,
        on_nonfinite_loss: Literal["raise", "ignore"] = "raise",
        check_finite_checkpoints: bool = True,
        pipeline: Literal["auto", "sparse_dist", "semi_sync"] | None = "auto",
        pipeline_options: dict[str, Any] | None = None,
        batch_checks: Literal["auto", "before_forward", "next_step"] = "auto",
        checkpoint_key: bytes | str | None = None,
        vote_ahead: bool = True,
    ) -> None:
        self.batch_checks = batch_checks
        self.pipeline_config = PipelineConfig.parse(pipeline, pipeline_options)
        self.run = ShardedRun(  # refuses a bad setting now, not at setup
            ShardingConfig(sharders, plan, constraints, fused_params, planner),
            timeout=timeout,
            data_parallel_wrapper=data_parallel_wrapper,
            batch_checks=batch_checks,
            on_nonfinite_loss=on_nonfinite_loss,
        )
        self.sharding = self.run.sharding
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.data_parallel_wrapper = data_parallel_wrapper
        self.allow_fused_gradient_accumulation = allow_fused_gradient_accumulation
        self.log_plan = log_plan
        self.load_optimizer_states = load_optimizer_states
        self.collective_timeout = timeout
        self.peer_timeout = peer_timeout
        self.check_finite_checkpoints = check_finite_checkpoints
        self.checkpoint_key = checkpoint_key
        #: Bounds what loading may cost; set it to load a trusted checkpoint beyond the defaults.
        self.checkpoint_limits: CheckpointLimits | None = None
        self.vote_ahead = vote_ahead
        self._validate_batches = validate_batches
        self._on_nonfinite_loss = on_nonfinite_loss
        #: Between a training backward and the optimizer step: fused tables hold the step's
        #: update, the dense weights not yet (a checkpoint now would not resume exactly).
        self.tables_ahead = False
        # Lightning's DDP handling of `manual_backward` (here and in `pre_backward` and
        # `post_backward`), for the dense DDP inside the DMP: Lightning's own looks for a DDP at
        # `model`, finds the DMP, and leaves the dense gradients of manual optimization
        # unreduced: every rank would train its own dense weights.
        self._forward_redirection = DMPForwardRedirection()
        self._flushed: Any = None  # the dense DDP whose first static-graph backward was reduced
        self._accumulating = 1  # the Trainer's accumulate_grad_batches at the last step
        self._resume_position: dict[str, Any] | None = None  # until the training loader exists
        self._undo: list[Any] = []  # what gives Lightning's objects back at teardown
        self._undo_toggles: Any = None

    # ------------------------------------------------------------------ properties
    @property
    def pipeline(self) -> str | None:
        """The pipeline asked for (``"auto"``, ``"sparse_dist"``, ``"semi_sync"`` or None)."""
        return self.pipeline_config.kind

    @property
    def pipeline_in_use(self) -> str | None:
        """The pipeline the current (or last) run trains with, after ``"auto"`` was resolved."""
        return self._runner.step.pipeline if self._runner is not None else None

    @property
    def sharding_plan(self) -> ShardingPlan | None:
        """The plan in use after setup (before it: the plan given, if any)."""
        return self.run.plan

    @property
    def dmp(self) -> DistributedModelParallel | None:
        """The ``DistributedModelParallel`` wrapping the LightningModule, after setup."""
        return self.run.dmp

    @property
    def plan_summary(self) -> PlanSummary | None:
        """The plan in use, readably (after setup)."""
        return self.run.summary

    @property
    def _runner(self) -> StepRunner | None:
        return self.run.runner

    @property
    def on_nonfinite_loss(self) -> str:
        """``"raise"`` or ``"ignore"``: what a NaN/inf training loss does (settable)."""
        return self._on_nonfinite_loss

    @on_nonfinite_loss.setter
    def on_nonfinite_loss(self, mode: str) -> None:
        StepGuard(mode)  # refuses an unknown mode
        self._on_nonfinite_loss = mode
        if self._runner is not None:
            self._runner.guard.on_nonfinite_loss = mode

    @property
    def validate_batches(self) -> bool | int:
        """Which batches are checked before the forward (settable; see the class docstring)."""
        return self._validate_batches

    @validate_batches.setter
    def validate_batches(self, value: bool | int) -> None:
        self._validate_batches = value
        if self._runner is not None:
            self._runner.guard.validate_batches = value

    # ------------------------------------------------------------------ launch and set-up
    @override
    def _configure_launcher(self) -> None:
        # Fork and spawn bring back the results without rank 0's weights (a sharded model's
        # shards cannot load into the parent's unsharded module; see ResultsOnlyLauncher).
        results_only_launcher(self, super())

    @override
    def setup_distributed(self) -> None:
        # In a store of this torchrun attempt's own; Lightning's set-up then finds the group.
        self.set_world_ranks()
        backend = process_group_backend(self)
        self.run.start_group(backend, self.global_rank, self.world_size, self.root_device)
        super().setup_distributed()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Host votes without a GPU sync, within `peer_timeout`; destroyed in teardown.
        needed = self.peer_timeout is not None or dist.get_backend() != "gloo"
        self.run.open_host_group(self.global_rank, self.peer_timeout, needed)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        check_setup(trainer, self.precision_plugin)
        self._resume_position = None  # set again when this run loads a checkpoint
        # Strategy.setup's template (not DDP's): `_setup_model` shards, optimizers follow.
        super(DDPStrategy, self).setup(trainer)
        # Lightning's SLURM requeue saves inside its signal handler; save between steps instead.
        add_slurm_requeue(trainer, self.cluster_environment)
        self._undo.append(adapt_trainer_defaults(trainer))  # the model summary's whole tables

    @override
    def model_to_device(self) -> None:
        # DMP places shards and dense modules itself (moving would fail on meta tables).
        pass

    def _setup_model(self, model: nn.Module) -> nn.Module:
        # Strategy.setup's hook (lightning 2.0+): shard once, reuse for later trainer functions.
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        sync = layer_sync(self)
        if sync is not None and (fitting or self.run.sharded is None):
            check_sync_batchnorm(self.root_device)
            module = sync.apply(module)
        sharded, first = self.run.shard(module, self.root_device, self.num_processes, self.log_plan)
        if first and self.log_plan and self.is_global_zero:
            write_plan(sharded.summary, trainer.loggers)
        hooks = batch_hooks(trainer)
        mode = choose_mode(  # the one decision of how training steps run: pipeline, vote ahead
            self.pipeline_config,
            self.root_device,
            world_size=self.world_size,
            vote_ahead=self.vote_ahead,
            fitting=fitting,
            hooks=hooks,
            accumulation=accumulation(trainer),
            deferred=judged_next_step(
                self.batch_checks, self.root_device, sharded.feature_specs, sharded.dmp
            ),
        )
        runner = self.run.new_steps(
            self.root_device,
            validate_batches=self._validate_batches,
            on_nonfinite_loss=self._on_nonfinite_loss,
            batch_checks=self.batch_checks,
            mode=mode,
            global_step=lambda: self.lightning_module.trainer.global_step,
            transformed=bool(hooks),
        )
        if fitting:
            check_fit(trainer, sharded.plan, self.allow_fused_gradient_accumulation)
            runner.start_fit()
            if self.world_size > 1:
                self._undo.append(take_over_step_votes(trainer, runner))
        return sharded.dmp

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        super().setup_optimizers(trainer)
        module = self.lightning_module
        assert module is not None
        if not self.optimizers:
            return
        schedulers = [cfg.scheduler for cfg in self.lr_scheduler_configs]
        first = combine_with_schedulers(self.optimizers[0], module, schedulers)
        self.optimizers = [first, *keyed_further(self.optimizers[1:], module)]

    # ------------------------------------------------------------------ collectives
    # Lightning's own collectives (its set-up barriers, checkpoint broadcasts, logged values'
    # `sync_dist`, EarlyStopping's decision) also name a dead or failed peer.
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.run.collective(super().barrier, *args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.run.collective(super().broadcast, obj, src)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self.run.collective(super().reduce, tensor, *args, **kwargs)

    @override
    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self.run.collective(super().all_gather, tensor, *args, **kwargs)

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # Lightning creates the first epoch's iterator before it sets the sampler's epoch and does
        # not re-create it after a resume: a run resumed at epoch e would replay epoch 0's
        # shuffle. Setting the restored epoch here (after the checkpoint is loaded, before the
        # iterator exists) makes resumed runs see the same order as uninterrupted ones.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            set_sampler_epoch(dataloader, processed_epochs(trainer))
            if trainer.training and self._resume_position is not None:
                # Before the step wraps it: its sampler skips what was trained on.
                resume_in_epoch(dataloader, self._resume_position, trainer, self.is_global_zero)
        if trainer is not None and self._runner is not None:
            # Checks in the loader's workers; the step (or evaluation pipeline) reads ahead.
            return self._runner.feed(dataloader, trainer.training)
        return dataloader

    def _check_batch_counts(self, stage: str, count: float) -> None:
        if self._runner is not None:
            self._runner.check_counts(stage, count)

    def _move(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        if self._runner is not None and not self._runner.transformed:  # no batch hook to run
            return move_batch(batch, torch.device(device or self.root_device))
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        # The step checks the host copy (no GPU-to-host sync); a pipeline copies its batches to
        # the device itself (on its own stream).
        training = self.lightning_module.trainer.training
        if self._runner is not None and self._runner.hold(batch, training):
            return batch
        return self._move(batch, device, dataloader_idx)

    # ------------------------------------------------------------------ the steps
    @override
    def on_train_start(self) -> None:
        self.tables_ahead = False  # a failed fit before this one may have left it set
        if not self.lightning_module.automatic_optimization:
            self._undo_toggles = guard_toggles(self.lightning_module)
        self._resume_position = None  # the training loaders are made: a reload starts whole
        self._check_batch_counts("training", self.lightning_module.trainer.num_training_batches)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # The fused kernels read the LR during backward; a scheduler's change made after the
        # last step must reach them before this forward (and the first step after a resume).
        push_fused_lr(self.optimizers)
        runner = self._runner
        assert runner is not None
        trainer = self.lightning_module.trainer
        self._check_accumulation(trainer)
        # Lightning's own index: a `training_step(self, batch)` gets none in `args`.
        step, (batch_idx, last) = trainer.global_step, batch_position(trainer)
        last = last or batch_idx + 1 >= trainer.num_training_batches
        last = last or 0 < trainer.max_steps <= step + 1
        batch = args[0] if args else kwargs.pop("batch")
        self._refuse_dataloader_iter(batch, "training_step", runner.step.pipeline)
        parent = super()

        def run(device_batch: Any) -> Any:
            return parent.training_step(device_batch, *args[1:], **kwargs)

        stop = bool(getattr(trainer, "received_sigterm", False))
        try:
            return runner.train_step(batch, batch_idx, step, last, run, self._move, stop)
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
            fused = has_fused_tables(self.sharding_plan)
            allowed = self.allow_fused_gradient_accumulation
            source = f"accumulate_grad_batches={factor} (set at epoch {trainer.current_epoch})"
            check_accumulation(factor, source, fused, allowed, self._runner.pipeline is not None)
            self._accumulating = factor

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> Any:
        # From here on fused tables may hold this step's update (set before the backward: a
        # user's on_after_backward runs inside it); cleared by the optimizer step.
        self.tables_ahead = True
        # The backward runs collectives too (sparse all-to-all, the DDP all-reduce).
        return self.run.collective(super().backward, closure_loss, optimizer, *args, **kwargs)

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
        done = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.tables_ahead = False
        return done

    @override
    def on_train_end(self) -> None:
        self._give_toggles_back()
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None and trainer.should_stop and self.world_size > 1:
            post_stop(f"global step {trainer.global_step}", self.global_rank)
        if self._runner is not None:  # the last step's loss has no next step to be judged at
            self._runner.end_fit()

    def _give_toggles_back(self) -> None:
        if self._undo_toggles is not None:
            self._undo_toggles()
        self._undo_toggles = None

    # ------------------------------------------------------------------ evaluation
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
    def on_validation_start(self) -> None:
        if self._runner is not None:  # evaluation runs the sharded modules' own forwards
            self._runner.start_evaluation()
        self._check_batch_counts("validation", sum(self.lightning_module.trainer.num_val_batches))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().validation_step, "validation", args, kwargs)

    @override
    def on_validation_end(self) -> None:
        self._end_evaluation()

    @override
    def on_test_start(self) -> None:
        self._check_batch_counts("test", sum(self.lightning_module.trainer.num_test_batches))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().test_step, "test", args, kwargs)

    @override
    def on_test_end(self) -> None:
        self._end_evaluation()

    @override
    def on_predict_start(self) -> None:
        self._check_batch_counts("predict", sum(self.lightning_module.trainer.num_predict_batches))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().predict_step, "predict", args, kwargs)

    @override
    def on_predict_end(self) -> None:
        self._end_evaluation()

    def _end_evaluation(self) -> None:
        if self._runner is not None:
            self._runner.end_evaluation()

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The keyed optimizer itself is saved by `save_checkpoint`; Lightning only needs a
        # placeholder in its list.
        return {}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("TorchRecStrategy.save_checkpoint does not take storage_options")
        save_trainer_checkpoint(self, checkpoint, filepath)

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        meta, self._resume_position = load_trainer_checkpoint(self, checkpoint_path, weights_only)
        push_fused_lr(self.optimizers)
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        # Loaded in place by `load_checkpoint` (with the module's `strict_loading`).
        pass

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # Loaded in place by `load_checkpoint`.
        pass

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint(filepath)

    # ------------------------------------------------------------------ failures and the end
    @override
    def on_exception(self, exception: BaseException) -> None:
        # A dead peer's launcher (Lightning's, torchrun) kills the survivors within seconds,
        # often before the traceback is printed after teardown: say why on this rank now. A
        # collective of someone else's (a metric's sync) failed bare: say which peer failed.
        self.report_failure(self.run.explain(exception, self.global_rank))
        self._give_toggles_back()
        super().on_exception(exception)

    def report_failure(self, exception: BaseException) -> None:
        """Tells the peers what this rank fails with, before it exits (see ``failure_reports``).

        Args:
            exception: the error this rank is failing with.
        """
        trainer = attached_trainer(self.lightning_module)
        step = "set-up" if trainer is None else f"global step {trainer.global_step}"
        stage = getattr(trainer.state.stage, "value", "") if trainer is not None else ""
        self.run.report(exception, f"{step} ({stage})" if stage else step, self.global_rank)

    @override
    def teardown(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.run.close()
        # The sharded model stays in place: a later validate/test/predict reuses it.
        with model_kept_in_place(self):
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)
