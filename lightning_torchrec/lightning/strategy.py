"""``TorchRecStrategy``: Lightning training with TorchRec's ``DistributedModelParallel``.

The strategy extends Lightning's templates at their seams: ``Strategy.setup`` (the model is
sharded in ``_setup_model``, never moved by ``model_to_device``), ``post_backward`` (semi-sync's
table update), ``_configure_launcher`` (fork/spawn bring results back without weights) and
``teardown`` (the sharded model stays in place); a ``StepRunner`` runs each step.
"""

from __future__ import annotations

import gc
import logging
from datetime import timedelta
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from typing_extensions import override

from lightning_torchrec.compat.lightning import (
    ResultsOnlyLaunching,
    layer_sync,
    model_kept_in_place,
    process_group_backend,
)
from lightning_torchrec.distributed import init_elastic_group, shutdown_at_exit
from lightning_torchrec.lightning.checkpoint_hooks import ShardedCheckpointing
from lightning_torchrec.lightning.data_hooks import DataHooks
from lightning_torchrec.lightning.preemption import add_slurm_requeue
from lightning_torchrec.lightning.step_hooks import StepHooks, take_over_step_votes
from lightning_torchrec.lightning.trainer_setup import (
    accumulation,
    adapt_trainer_defaults,
    batch_hooks,
    check_fit,
    check_setup,
    check_sync_batchnorm,
    log_plan,
)
from lightning_torchrec.sharding.plan_summary import PlanSummary
from lightning_torchrec.sharding.planning import ShardingConfig, shard_model
from lightning_torchrec.training.device_checks import judged_next_step
from lightning_torchrec.training.optim import combine_with_schedulers, keyed_further
from lightning_torchrec.training.pipelines import PipelineConfig
from lightning_torchrec.training.step_guard import StepGuard
from lightning_torchrec.training.step_runner import BATCH_CHECKS, StepRunner
from lightning_torchrec.training.steps import choose_mode

log = logging.getLogger(__name__)

#: ``TorchRecStrategy``'s default ``peer_timeout``.
PEER_TIMEOUT = timedelta(minutes=5)


class TorchRecStrategy(
    ResultsOnlyLaunching, StepHooks, DataHooks, ShardedCheckpointing, DDPStrategy
):
    """Trains any LightningModule holding TorchRec embedding modules with sharded tables.

    One process per device (gloo on CPU, nccl on CUDA; Lightning's launcher, ``torchrun`` and
    SLURM all work). At setup it plans on rank 0 (one plan for all ranks), wraps the
    LightningModule in ``DistributedModelParallel`` (meta tables materialise only as shards) via
    :func:`lightning_torchrec.sharding.planning.shard_model` (as ``maybe_shard_model`` does), and
    combines the fused embedding optimizer with the dense one from ``configure_optimizers``.
    Checkpoints are sharded ``torch.distributed.checkpoint`` directories; a fit resumed from a
    mid-epoch checkpoint continues any map-style DataLoader at the first batch not trained on
    (``lightning_torchrec.lightning.mid_epoch``). Under ``SLURMEnvironment(auto_requeue=True)``
    a :class:`~lightning_torchrec.lightning.preemption.SLURMRequeue` saves between steps.

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
        if batch_checks not in BATCH_CHECKS:
            raise ValueError(f"batch_checks must be one of {BATCH_CHECKS}, got {batch_checks!r}")
        self.batch_checks = batch_checks
        self.pipeline_config = PipelineConfig.parse(pipeline, pipeline_options)
        self.sharding = ShardingConfig(sharders, plan, constraints, fused_params, planner)
        StepGuard(on_nonfinite_loss)  # refuses an unknown mode now, not at setup
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
        self.vote_ahead = vote_ahead
        self._validate_batches = validate_batches
        self._on_nonfinite_loss = on_nonfinite_loss
        self._runner: StepRunner | None = None
        self._host_group: Any = None
        self._undo_sigterm: Any = None
        self._undo_bar: Any = None
        self._dmp: DistributedModelParallel | None = None
        self._plan: ShardingPlan | None = None
        self.plan_summary: PlanSummary | None = None

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
        return self._plan or self.sharding.plan

    @property
    def dmp(self) -> DistributedModelParallel | None:
        """The ``DistributedModelParallel`` wrapping the LightningModule, after setup."""
        return self._dmp

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

    # ------------------------------------------------------------------ setup
    @override
    def setup_distributed(self) -> None:
        # In a store of this torchrun attempt's own; Lightning's set-up then finds the group.
        self.set_world_ranks()
        device = self.root_device if self.root_device.type != "cpu" else None
        timeout = self.collective_timeout or default_pg_timeout
        backend = process_group_backend(self)
        init_elastic_group(backend, self.global_rank, self.world_size, timeout, device)
        super().setup_distributed()
        shutdown_at_exit()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.peer_timeout is not None or dist.get_backend() != "gloo":
            # Host votes without a GPU sync, within `peer_timeout`; destroyed in teardown.
            self._host_group = dist.new_group(backend="gloo", timeout=self.peer_timeout)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        check_setup(trainer, self.precision_plugin)
        self._resume_position = None  # set again when this run loads a checkpoint
        # Strategy.setup's template (not DDP's): `_setup_model` shards, optimizers follow.
        super(DDPStrategy, self).setup(trainer)
        # Lightning's SLURM requeue saves inside its signal handler; save between steps instead.
        add_slurm_requeue(trainer, self.cluster_environment)
        self._undo_bar = adapt_trainer_defaults(trainer)  # tables counted whole; no bar work

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
        if sync is not None and (fitting or self._dmp is None):
            check_sync_batchnorm(self.root_device)
            module = sync.apply(module)
        sharded = self._collective(  # planning and DMP's collectives: a dead peer is named
            shard_model,
            module,
            self.root_device,
            local_world_size=self.num_processes,
            data_parallel_wrapper=self.data_parallel_wrapper,
            **vars(self.sharding),
        )
        first = self._dmp is not sharded.dmp
        self._dmp, self._plan, self.plan_summary = sharded.dmp, sharded.plan, sharded.summary
        if first and self.log_plan and self.is_global_zero:
            log_plan(sharded.summary, trainer.loggers)
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
        self._runner = StepRunner(
            sharded.dmp,
            self.root_device,
            specs=sharded.feature_specs,
            dense_width=sharded.dense_width,
            validate_batches=self._validate_batches,
            on_nonfinite_loss=self._on_nonfinite_loss,
            mode=mode,
            global_step=lambda: self.lightning_module.trainer.global_step,
            timeout=self._timeouts(),
            group=self._host_group,
            batch_checks=self.batch_checks,
            transformed=bool(hooks),
        )
        if fitting:
            check_fit(trainer, sharded.plan, self.allow_fused_gradient_accumulation)
            self._runner.start_fit()
            if self.world_size > 1 and self._undo_sigterm is None:
                self._undo_sigterm = take_over_step_votes(trainer, self._runner)
        return sharded.dmp

    def _timeouts(self) -> str:
        """The timeouts a failed collective may have run into (for ``PeerFailureError``)."""
        if self._host_group is None or self.peer_timeout is None:
            return str(self.collective_timeout)
        return f"{self.peer_timeout} at a step's vote, {self.collective_timeout} elsewhere"

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

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        if self._runner is not None:
            self._runner.close()
        for undo in (self._undo_sigterm, self._undo_bar):
            if undo is not None:
                undo()
        self._undo_sigterm = self._undo_bar = None
        if self._host_group is not None:
            dist.destroy_process_group(self._host_group)
            self._host_group = None
        # Finalize this run's garbage (process-group handles) here: finalized in a forked
        # DataLoader worker of a later run, a ProcessGroupGloo waits forever for its threads.
        gc.collect()
        # The sharded model stays in place: a later validate/test/predict reuses it.
        with model_kept_in_place(self):
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (
            ("torchrec", "popen"),
            ("torchrec_spawn", "spawn"),
            ("torchrec_fork", "fork"),
            ("torchrec_notebook", "fork"),
        ):
            strategy_registry.register(
                name,
                cls,
                description=f"TorchRec sharded training with start_method '{start_method}'",
                start_method=start_method,
                override=True,
            )
