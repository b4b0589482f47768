"""``TorchRecFabricStrategy``: Lightning Fabric with TorchRec's ``DistributedModelParallel``.

Fabric's seams, as its FSDP and model-parallel strategies use them: ``setup_environment`` opens
the process group (gloo on CPU, nccl on CUDA), ``setup_module`` shards the model with the same
:func:`~lightning_torchrec.sharding.planning.shard_model` as ``TorchRecStrategy``,
``setup_optimizer`` combines the dense optimizer with the fused embedding optimizer,
``module_to_device`` leaves placement to DMP, ``backward`` records the loss for the agreed
checks, and ``save_checkpoint``/``load_checkpoint`` write and read the package's sharded
checkpoint directories (:mod:`.checkpointing`).
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from typing_extensions import override

from lightning_torchrec.compat.lightning_fabric import ReportingLaunching
from lightning_torchrec.compat.worker_fork import fork_safely
from lightning_torchrec.distributed import init_elastic_group, shutdown_at_exit
from lightning_torchrec.fabric.checkpointing import FabricCheckpointing
from lightning_torchrec.fabric.checks import (
    adopted_optimizers,
    check_fabric_precision,
    combine_fabric_optimizer,
)
from lightning_torchrec.fabric.collectives import FabricCollectives
from lightning_torchrec.fabric.failures import FabricFailures
from lightning_torchrec.fabric.steps import FabricSteps
from lightning_torchrec.sharding.plan_summary import PlanSummary
from lightning_torchrec.sharding.planning import ShardingConfig, shard_model
from lightning_torchrec.sharding.sharders import has_fused_tables
from lightning_torchrec.sharding.tables import unwrap
from lightning_torchrec.training.optim import DenseAndFusedOptimizer
from lightning_torchrec.training.step_guard import StepGuard
from lightning_torchrec.training.step_runner import BATCH_CHECKS, StepRunner

#: Fabric's warning about a model on several devices (meta tables, CPU dense layers).
MIXED_DEVICES_WARNING = r"The model passed to `Fabric.setup\(\)` has \d+ parameters on different"


class TorchRecFabricStrategy(
    ReportingLaunching,
    FabricCheckpointing,
    FabricFailures,
    FabricSteps,
    FabricCollectives,
    DDPStrategy,
):
    """Fabric training of a TorchRec model with sharded tables, in the user's own loop.

    ``L.Fabric(strategy="torchrec", accelerator=..., devices=..., num_nodes=...)`` selects it
    (importing ``lightning_torchrec`` registers the name). ``fabric.setup_module(model)`` plans
    on rank 0 and wraps the model in ``DistributedModelParallel`` (tables built on the meta
    device exist only as shards); ``fabric.setup_optimizers(opt)`` combines an optimizer over
    ``lightning_torchrec.dense_parameters(model)`` with the fused embedding optimizer, so
    ``step()``, ``zero_grad()``, LR schedulers and ``state_dict()`` cover both. Every forward,
    training or evaluation, first runs the agreed checks of :class:`StepGuard` (the batch against
    the tables, the previous step's loss) in one small collective, so a bad batch or a NaN loss
    on one rank raises the same named error on every rank (:mod:`.steps`); the fused LR is pushed
    into the kernels before a training forward. An error that one rank raises and does not catch
    is written to the job's store before that rank exits, and the other ranks raise an error of
    its type that names it (:mod:`.failures`). ``fabric.save``/``fabric.load`` write and read the
    same sharded checkpoints as the Trainer's ``TorchRecStrategy``.

    Args:
        sharders: TorchRec sharders; defaults to TorchRec's with ``fused_params``.
        plan: an explicit ``ShardingPlan`` (skips the planner).
        constraints: per-table ``ParameterConstraints`` for the planner.
        fused_params: fused embedding optimizer settings (``optimizer``, ``learning_rate``, ...);
            defaults to row-wise Adagrad, lr 0.01. Give either this or ``sharders``.
        planner: a planner to use instead of the default one.
        data_parallel_wrapper: how DMP wraps the dense part.
        log_plan: print the plan on rank 0 after sharding.
        load_optimizer_states: False loads weights, hyper-parameters and step counters with fresh
            optimizer state (needed after a plan change that reshapes the fused state).
        validate_batches: check each batch against the tables before its forward (ids in range,
            known keys, lengths, dtypes, finite dense features), in training and in evaluation;
            an int ``N`` checks the first ``N`` steps (and the first ``N`` forwards of each
            evaluation) only, False never.
        on_nonfinite_loss: ``"raise"``: a NaN/inf loss on any rank raises
            ``NonFiniteLossError`` on every rank at the next step's check (or at
            :meth:`finish`); ``"ignore"``.
        check_finite_checkpoints: refuse to save NaN/inf weights or optimizer state.
        batch_checks: ``"auto"``, ``"before_forward"`` or ``"next_step"`` (see
            ``TorchRecStrategy``).
        check_in_forward: run :meth:`check_batch` automatically before every forward of the
            set-up module, training or evaluation (False: the loop calls it).
        accelerator: see Fabric's ``DDPStrategy``.
        parallel_devices: see Fabric's ``DDPStrategy``.
        cluster_environment: see Fabric's ``DDPStrategy``.
        checkpoint_io: see Fabric's ``DDPStrategy`` (unused for sharded checkpoints).
        precision: see Fabric's ``DDPStrategy``.
        process_group_backend: ``"gloo"``/``"nccl"``; defaults to the device's.
        timeout: collective timeout.
        start_method: ``"popen"`` (scripts), ``"spawn"`` or ``"fork"`` (notebooks).

    Raises:
        ValueError: if both ``sharders`` and ``fused_params`` are given, ``plan`` with
            ``constraints`` or ``planner``, or for an unknown ``on_nonfinite_loss`` or
            ``batch_checks``.
    """

    def __init__(
        self,
        sharders: list[ModuleSharder[torch.nn.Module]] | None = None,
        plan: ShardingPlan | None = None,
        constraints: dict[str, ParameterConstraints] | None = None,
        fused_params: dict[str, Any] | None = None,
        planner: EmbeddingShardingPlanner | None = None,
        data_parallel_wrapper: DataParallelWrapper | None = None,
        log_plan: bool = True,
        load_optimizer_states: bool = True,
        validate_batches: bool | int = True,
        on_nonfinite_loss: Literal["raise", "ignore"] = "raise",
        check_finite_checkpoints: bool = True,
        batch_checks: Literal["auto", "before_forward", "next_step"] = "auto",
        check_in_forward: bool = True,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if batch_checks not in BATCH_CHECKS:
            raise ValueError(f"batch_checks must be one of {BATCH_CHECKS}, got {batch_checks!r}")
        self.sharding = ShardingConfig(sharders, plan, constraints, fused_params, planner)
        StepGuard(on_nonfinite_loss)  # refuses an unknown mode now, not at setup
        # Fabric warns that a model with tables on the meta device "will be moved"; this
        # strategy never moves it (DistributedModelParallel places the shards).
        warnings.filterwarnings("ignore", message=MIXED_DEVICES_WARNING)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.data_parallel_wrapper = data_parallel_wrapper
        self.log_plan = log_plan
        self.load_optimizer_states = load_optimizer_states
        self.validate_batches = validate_batches
        self.on_nonfinite_loss = on_nonfinite_loss
        self.check_finite_checkpoints = check_finite_checkpoints
        self.batch_checks = batch_checks
        self.check_in_forward = check_in_forward
        self.collective_timeout = timeout
        self.step = 0
        self._host_group: Any = None
        self._runner: StepRunner | None = None
        self._dmp: DistributedModelParallel | None = None
        self._plan: ShardingPlan | None = None
        self._optimizers: list[DenseAndFusedOptimizer] = []
        self.plan_summary: PlanSummary | None = None

    # ------------------------------------------------------------------ properties
    @property
    def dmp(self) -> DistributedModelParallel | None:
        """The ``DistributedModelParallel`` of the set-up module (None before setup)."""
        return self._dmp

    @property
    def sharding_plan(self) -> ShardingPlan | None:
        """The plan in use after setup (before it: the plan given, if any)."""
        return self._plan or self.sharding.plan

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        # Under torchrun, the default group lives in a store of this attempt's own (a restart
        # never reads the dead attempt's keys; see `attempt_store`); Fabric then finds it up.
        env, device = self.cluster_environment, self.root_device
        backend = self.process_group_backend or ("nccl" if device.type == "cuda" else "gloo")
        if env is not None:
            timeout = self.collective_timeout or default_pg_timeout
            cuda = device if device.type == "cuda" else None
            init_elastic_group(backend, env.global_rank(), env.world_size(), timeout, cuda)
        super().setup_environment()
        shutdown_at_exit()
        if dist.get_backend() != "gloo":
            # The per-step votes are host integers: a gloo group decides them without a GPU
            # sync. Owned by this strategy; destroyed in teardown.
            self._host_group = dist.new_group(backend="gloo")

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # DistributedModelParallel places shards and dense modules itself; moving the unsharded
        # module would fail on meta tables or copy every table to one device.
        pass

    @override
    def setup_module(self, module: nn.Module) -> DistributedModelParallel:
        """Plans and shards ``module`` (collective), as ``TorchRecStrategy`` does at setup.

        Args:
            module: the unsharded model (tables usually on the meta device).

        Returns:
            The ``DistributedModelParallel``.

        Raises:
            ValueError: for a precision the sharded model cannot train with, and every
                configuration error of ``shard_model`` (on every rank).
        """
        check_fabric_precision(self.precision, fused_tables=False)
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
        check_fabric_precision(self.precision, has_fused_tables(sharded.plan))
        if first and self.log_plan:
            text = sharded.summary.to_markdown()
            rank_zero_info(f"TorchRec sharding plan ({sharded.summary.world_size} ranks):\n{text}")
        if first:  # a new model: its own steps, optimizers and checks
            self.step, self._prechecked, self._optimizers = 0, False, []
            self._evaluated = 0
            if self._runner is not None:
                self._runner.close()
            self._runner = StepRunner(
                sharded.dmp,
                self.root_device,
                specs=sharded.feature_specs,
                dense_width=sharded.dense_width,
                validate_batches=self.validate_batches,
                on_nonfinite_loss=self.on_nonfinite_loss,
                global_step=lambda: self.step,
                timeout=self.collective_timeout,
                group=self._host_group,
                batch_checks=self.batch_checks,
            )
            sharded.dmp.register_forward_pre_hook(self._before_forward, with_kwargs=True)
            self._name_dead_peers_in_forward(sharded.dmp)
        return sharded.dmp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Combines a dense optimizer with the fused embedding optimizer of the set-up module.

        Args:
            optimizer: an optimizer over ``lightning_torchrec.dense_parameters(model)``.

        Returns:
            A ``DenseAndFusedOptimizer``: ``step()``, ``zero_grad()``, ``param_groups`` (for LR
            schedulers) and ``state_dict()`` cover both. With several optimizers
            (``setup_optimizers(a, b)``) the first drives the fused tables and the others are
            dense-only (:func:`~lightning_torchrec.fabric.checks.combine_fabric_optimizer`).

        Raises:
            RuntimeError: before ``setup_module``.
            ValueError: if the optimizer holds fused embedding-table parameters.
        """
        if self._dmp is None:
            raise RuntimeError(
                "TorchRecFabricStrategy shards the model first: call `fabric.setup_module(model)` "
                "before `fabric.setup_optimizers(optimizer)` (or use `fabric.setup(model, opt)`)."
            )
        combined = combine_fabric_optimizer(optimizer, unwrap(self._dmp), not self._optimizers)
        if all(combined is not o for o in self._optimizers):
            self._optimizers.append(combined)
        return combined

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, *optimizers)``: shards, then combines each optimizer.

        Args:
            module: the unsharded model.
            optimizers: optimizers over ``lightning_torchrec.dense_parameters(model)`` of the
                unsharded model (its tables are replaced by the sharded model's parameters).
            scheduler: an LR scheduler; built on a dense optimizer it drives the dense LR only
                (build it on the optimizer ``fabric.setup`` returns to schedule both).

        Returns:
            The DMP, the combined optimizers and the scheduler.
        """
        dmp = self.setup_module(module)
        combined = adopted_optimizers(optimizers, dmp, not self._optimizers, scheduler)
        return dmp, [self.setup_optimizer(o) for o in combined], scheduler

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        fork_safely(dataloader)  # forked workers start after gloo's threads gave the GIL back
        return dataloader

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        if self._runner is not None:
            self._runner.close()
        if self._host_group is not None:
            dist.destroy_process_group(self._host_group)
            self._host_group = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``"torchrec"`` (and ``_spawn``, ``_fork``, ``_notebook``) with Fabric.

        Args:
            strategy_registry: Fabric's ``STRATEGY_REGISTRY``.
        """
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
