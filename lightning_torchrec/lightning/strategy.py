"""``TorchRecStrategy``: Lightning training with TorchRec's ``DistributedModelParallel``."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from typing_extensions import override

from lightning_torchrec.compat.lightning import ResultsOnlyLauncher, is_last_batch, layer_sync
from lightning_torchrec.distributed import run_collective, use_host_group
from lightning_torchrec.lightning.checkpoint_hooks import ShardedCheckpointing
from lightning_torchrec.lightning.data_hooks import DataHooks
from lightning_torchrec.lightning.trainer_setup import (
    check_fused_precision,
    check_fused_training,
    check_pipeline_training,
    check_precision,
    check_sync_batchnorm,
    log_plan,
)
from lightning_torchrec.sharding.plan_summary import PlanSummary
from lightning_torchrec.sharding.planning import ShardingConfig, shard_model
from lightning_torchrec.sharding.sharders import has_fused_tables
from lightning_torchrec.training.optim import (
    DenseAndFusedOptimizer,
    combine_with_schedulers,
)
from lightning_torchrec.training.pipelines import (
    SparseDistPipeline,
    StagePipelines,
    check_pipeline_options,
)
from lightning_torchrec.training.step_guard import StepGuard

log = logging.getLogger(__name__)


class TorchRecStrategy(DataHooks, ShardedCheckpointing, DDPStrategy):
    """Trains any LightningModule holding TorchRec embedding modules with sharded tables.

    One process per device (gloo on CPU, nccl on CUDA; Lightning's launcher, ``torchrun`` and
    SLURM all work). At setup it plans with TorchRec's ``EmbeddingShardingPlanner`` on rank 0
    (one plan for all ranks), wraps the LightningModule in ``DistributedModelParallel`` (tables
    built on the meta device are materialised only as shards; DMP data-parallelises the dense
    part), and combines the fused embedding optimizer with the dense optimizer from
    ``configure_optimizers``. Checkpoints are sharded ``torch.distributed.checkpoint``
    directories: every rank writes its own shards. Sharding goes through
    :func:`lightning_torchrec.sharding.planning.shard_model`, the same path as
    ``maybe_shard_model``.

    Args:
        sharders: TorchRec sharders; defaults to TorchRec's with ``fused_params``.
        plan: an explicit ``ShardingPlan`` (skips the planner).
        constraints: per-table ``ParameterConstraints`` for the planner.
        fused_params: fused embedding optimizer settings (``optimizer``, ``learning_rate``, ...);
            defaults to row-wise Adagrad, lr 0.01. Give either this or ``sharders``.
        planner: a planner to use instead of the default one.
        data_parallel_wrapper: how DMP wraps the dense part (e.g. to find unused parameters).
        allow_fused_gradient_accumulation: fused tables update at every backward, so
            ``accumulate_grad_batches > 1`` does not accumulate them; set True to accept that.
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
        start_method: ``"popen"`` (scripts), ``"spawn"`` or ``"fork"`` (notebooks).
        validate_batches: check each batch against the tables before the forward (ids in
            range, known keys, lengths, dtypes, finite dense features; see
            ``lightning_torchrec.training.batch_checks``); an int ``N`` checks the first ``N``
            training steps (and evaluation batches) only, False never. Costs one vectorised pass
            over the ids and one tiny ``all_reduce`` per checked step.
        on_nonfinite_loss: ``"raise"``: a NaN/inf loss on any rank raises a
            ``NonFiniteLossError`` naming the step and ranks on every rank, at the next step's
            check (see ``lightning_torchrec.training.step_guard.StepGuard``; checkpoints refuse
            non-finite values); ``"ignore"``. The verdict shares the batch check's one small
            collective.
        check_finite_checkpoints: refuse to save a checkpoint holding NaN/inf weights or
            optimizer state.
        pipeline: ``"sparse_dist"`` trains through TorchRec's ``TrainPipelineSparseDist``
            (the next batch's copy and sparse input all-to-all overlap this batch's forward and
            backward; same results as ``None``) with ``training_step`` unchanged, and runs
            validation, test and predict through the same pipeline in eval mode (forward only);
            see ``lightning_torchrec.training.pipelines``. ``"semi_sync"``: TorchRec's
            ``TrainPipelineSemiSync``: from global step ``start_batch`` on, the embeddings of
            batch ``i + 1`` are looked up before batch ``i``'s table update (one batch of
            staleness for the tables; dense weights stay synchronous), so their all-to-all
            overlaps the backward; synchronous (the same results as ``None``) before it.
            ``None``: no pipeline.
        pipeline_options: options of the chosen pipeline: ``{"start_batch": N}`` for
            ``"semi_sync"`` (default 900, TorchRec's).

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
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        validate_batches: bool | int = True,
        on_nonfinite_loss: Literal["raise", "ignore"] = "raise",
        check_finite_checkpoints: bool = True,
        pipeline: Literal["sparse_dist", "semi_sync"] | None = None,
        pipeline_options: dict[str, Any] | None = None,
    ) -> None:
        self.pipeline_options = check_pipeline_options(pipeline, pipeline_options)
        self.sharding = ShardingConfig(sharders, plan, constraints, fused_params, planner)
        self._guard = StepGuard(on_nonfinite_loss, validate_batches=validate_batches)
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
        self.start_method = start_method
        self.check_finite_checkpoints = check_finite_checkpoints
        self.pipeline = pipeline
        self._pipelines: StagePipelines | None = None
        self._host_batch: Any = None
        self._dmp: DistributedModelParallel | None = None
        self._plan: ShardingPlan | None = None
        self._sharded_module: L.LightningModule | None = None
        self._results_launcher: ResultsOnlyLauncher | None = None
        self.plan_summary: PlanSummary | None = None

    # ------------------------------------------------------------------ properties
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
        return self._guard.on_nonfinite_loss

    @on_nonfinite_loss.setter
    def on_nonfinite_loss(self, mode: str) -> None:
        self._guard.on_nonfinite_loss = mode

    @property
    def validate_batches(self) -> bool | int:
        """Which batches are checked before the forward (settable; see the class docstring)."""
        return self._guard.validate_batches

    @validate_batches.setter
    def validate_batches(self, value: bool | int) -> None:
        self._guard.validate_batches = value

    @property
    @override
    def launcher(self) -> Any:
        # Fork/spawn: Lightning's launcher would load rank 0's shards into the parent's
        # unsharded module; this one brings results back without weights.
        if self.start_method == "popen":
            return super().launcher
        if self._results_launcher is None:
            self._results_launcher = ResultsOnlyLauncher(self, start_method=self.start_method)
        return self._results_launcher

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if torch.distributed.get_backend() != "gloo":
            # The per-step votes are host integers: a gloo group decides them without a GPU sync.
            use_host_group(torch.distributed.new_group(backend="gloo"))

    @override
    def setup(self, trainer: L.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._guard.device = self.root_device
        check_precision(self.precision_plugin)
        if self._dmp is None or self._sharded_module is not self.lightning_module:
            self._shard(trainer)
        assert self._dmp is not None and self._plan is not None
        self.model = self._dmp
        if trainer.state.fn == TrainerFn.FITTING:
            if has_fused_tables(self._plan):
                check_fused_precision(self.precision_plugin)
                check_fused_training(trainer, self.allow_fused_gradient_accumulation)
            if self.pipeline is not None:
                check_pipeline_training(trainer)
                self._stage_pipelines().start_fit()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        # DistributedModelParallel places shards and dense modules itself; moving the unsharded
        # module would fail on meta tables or copy every table to one device.
        pass

    def _shard(self, trainer: L.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        sync = layer_sync(self)
        if sync is not None:
            check_sync_batchnorm(self.root_device)
            module = sync.apply(module)
        sharded = shard_model(
            module,
            self.root_device,
            local_world_size=self.num_processes,
            data_parallel_wrapper=self.data_parallel_wrapper,
            **vars(self.sharding),
        )
        self._dmp, self._plan, self.plan_summary = sharded.dmp, sharded.plan, sharded.summary
        self._guard.specs, self._guard.dense_width = sharded.feature_specs, sharded.dense_width
        self._sharded_module = module
        if self.log_plan and self.is_global_zero:
            log_plan(self.plan_summary, trainer.loggers)

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        super().setup_optimizers(trainer)
        module = self.lightning_module
        assert module is not None
        if not self.optimizers:
            return
        schedulers = [cfg.scheduler for cfg in self.lr_scheduler_configs]
        combined = combine_with_schedulers(self.optimizers[0], module, schedulers)
        self.optimizers = [combined, *self.optimizers[1:]]

    # ------------------------------------------------------------------ steps
    def _push_fused_lr(self) -> None:
        for opt in self.optimizers:
            if isinstance(opt, DenseAndFusedOptimizer):
                opt.push_fused_lr()

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return run_collective(fn, *args, timeout=self.collective_timeout, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # The fused kernels read the LR during backward; a scheduler's change made after the
        # last step must reach them before this forward (and the first step after a resume).
        self._push_fused_lr()
        trainer = self.lightning_module.trainer
        step, batch_idx = trainer.global_step, int(args[1] if len(args) > 1 else 0)
        last = is_last_batch(trainer) or batch_idx + 1 >= trainer.num_training_batches
        last = last or 0 < trainer.max_steps <= step + 1
        # One collective: this step's batch verdict, the previous step's loss verdict, and
        # whether every rank is (or no rank is) at its last batch.
        batch = args[0] if args else kwargs.get("batch")
        checked = self._checked_batch(batch)
        pipelines = self._pipelines if self._stage_pipeline() is not None else None
        # A pipeline sends batches before their step: the vote covers those it sends next.
        ahead = pipelines.ahead(True, batch_idx) if pipelines is not None else None
        self._collective(self._guard.before_training_step, checked, step, batch_idx, last, ahead)
        parent = super()
        if pipelines is not None:
            output = self._collective(
                pipelines.run,
                True,
                lambda device_batch: parent.training_step(device_batch, batch_idx),
                lambda: parent.training_step(parent.batch_to_device(checked), batch_idx),
            )
        else:
            output = self._collective(parent.training_step, *args, **kwargs)
        self._guard.record_loss(output, step)
        return output

    def _stage_pipelines(self) -> StagePipelines:
        if self._pipelines is None:
            assert self._dmp is not None
            self._pipelines = StagePipelines(
                self._dmp,
                self.root_device,
                self.pipeline or "sparse_dist",
                self.pipeline_options,
                lambda: self.lightning_module.trainer.global_step,
            )
        return self._pipelines

    def _stage_pipeline(self) -> SparseDistPipeline | None:
        if self._pipelines is None:
            return None
        return self._pipelines.for_stage(self.lightning_module.trainer.training)

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        # The step checks the host copy (no GPU-to-host sync); a pipeline copies its batches to
        # the device itself (on its own stream).
        self._host_batch = batch
        if self._stage_pipeline() is not None:
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    def _checked_batch(self, batch: Any) -> Any:
        host, self._host_batch = self._host_batch, None
        return batch if host is None else host

    def _eval_step(self, step_fn: Any, stage: str, args: Any, kwargs: Any) -> Any:
        batch_idx = int(args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        last = is_last_batch(self.lightning_module.trainer)
        batch = self._checked_batch(args[0] if args else kwargs.get("batch"))
        pipelines = self._pipelines if self._stage_pipeline() is not None else None
        ahead = pipelines.ahead(False, batch_idx) if pipelines is not None else None
        self._collective(self._guard.before_eval_step, batch, stage, batch_idx, last, ahead)
        if pipelines is None:
            return self._collective(step_fn, *args, **kwargs)
        return self._collective(
            pipelines.run,
            False,
            lambda device_batch: step_fn(device_batch, *args[1:], **kwargs),
            lambda: step_fn(super(TorchRecStrategy, self).batch_to_device(batch), *args[1:]),
        )

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
        # The backward runs collectives too (sparse all-to-all, the DDP all-reduce).
        return self._collective(self._backward, closure_loss, optimizer, *args, **kwargs)

    def _backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kw: Any) -> Any:
        out = super().backward(closure_loss, optimizer, *args, **kw)
        if self._pipelines is not None and self.lightning_module.trainer.training:
            self._pipelines.after_backward()  # semi-sync: the tables' update of this batch
        return out

    @override
    def on_train_end(self) -> None:
        # The last step's loss has no next step to be judged at.
        self._collective(self._guard.flush)
        if self._pipelines is not None:  # a later fit, validate or predict: the own forwards
            self._pipelines.release(training=True)

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        # Keep the sharded model: a later trainer.validate/test/predict reuses it. Lightning's
        # default would move every table to CPU (and fails on meta tables after an early error).
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

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
