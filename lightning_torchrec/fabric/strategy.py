"""``TorchRecFabricStrategy``: Lightning Fabric with TorchRec's ``DistributedModelParallel``.

One class, one file, over the same core as the Trainer's ``TorchRecStrategy``
(:class:`~lightning_torchrec.training.run.ShardedRun`: process groups, sharding, the steps'
checks, collectives, failures). Fabric's seams, as its FSDP and model-parallel strategies use
them: ``setup_environment`` opens the process group (gloo on CPU, nccl on CUDA),
``setup_module`` shards the model, ``setup_optimizer`` combines the dense optimizer with the
fused embedding optimizer, ``module_to_device`` leaves placement to DMP, every forward of the
set-up module is checked first (a forward pre-hook), ``backward`` records the loss for the next
check, and ``save_checkpoint``/``load_checkpoint`` write and read the package's sharded
checkpoint directories (:mod:`.checkpointing`).

Fabric adds no loop, so the strategy learns of a step from the module's forwards and from
``fabric.backward``. Before each forward one small vote of
:class:`~lightning_torchrec.training.step_guard.StepGuard` decides, on every rank, whether any
rank's batch is bad: a training forward (the module in ``train()`` mode) also carries the
previous step's loss verdict, as under the Trainer; an evaluation forward (``eval()`` mode) is
checked too (fbgemm reads an out-of-range id as row 0 without an error, and the metrics of such
an evaluation would be silently wrong); its vote says that the rank is evaluating, so a rank
with an evaluation batch more than the others meets their next training vote (or
:meth:`TorchRecFabricStrategy.finish`) and every rank raises ``UnevenDataError``.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from torch import nn
from torch.optim import Optimizer
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from typing_extensions import override

from lightning_torchrec.compat.lightning_fabric import reporting_launcher
from lightning_torchrec.compat.worker_fork import fork_safely
from lightning_torchrec.fabric.checkpointing import load_fabric_checkpoint, save_fabric_checkpoint
from lightning_torchrec.fabric.checks import adopted_optimizers, combine_fabric_optimizer
from lightning_torchrec.fabric.failures import FailureHook, install_failure_hook
from lightning_torchrec.sharding.plan_summary import PlanSummary
from lightning_torchrec.sharding.planning import ShardingConfig
from lightning_torchrec.sharding.sharders import has_fused_tables
from lightning_torchrec.sharding.tables import unwrap
from lightning_torchrec.training.optim import DenseAndFusedOptimizer, push_fused_lr
from lightning_torchrec.training.run import (
    ShardedRun,
    check_precision,
    register_names,
)
from lightning_torchrec.training.steps import StepRunner

#: Fabric's warning about a model on several devices (meta tables, CPU dense layers).
MIXED_DEVICES_WARNING = r"The model passed to `Fabric.setup\(\)` has \d+ parameters on different"


class TorchRecFabricStrategy(DDPStrategy):
    """Fabric training of a TorchRec model with sharded tables, in the user's own loop.

    ``L.Fabric(strategy="torchrec", accelerator=..., devices=..., num_nodes=...)`` selects it
    (importing ``lightning_torchrec`` registers the name). ``fabric.setup_module(model)`` plans
    on rank 0 and wraps the model in ``DistributedModelParallel`` (tables built on the meta
    device exist only as shards); ``fabric.setup_optimizers(opt)`` combines an optimizer over
    ``lightning_torchrec.dense_parameters(model)`` with the fused embedding optimizer, so
    ``step()``, ``zero_grad()``, LR schedulers and ``state_dict()`` cover both. Every forward,
    training or evaluation, first runs the agreed checks of :class:`StepGuard` (the batch against
    the tables, the previous step's loss) in one small collective, so a bad batch or a NaN loss
    on one rank raises the same named error on every rank; the fused LR is pushed into the
    kernels before a training forward. An error that one rank raises and does not catch is
    written to the job's store before that rank exits, and the other ranks raise an error of its
    type that names it (:mod:`.failures`). ``fabric.save``/``fabric.load`` write and read the
    same sharded checkpoints as the Trainer's ``TorchRecStrategy``.

    It extends Fabric's ``DDPStrategy`` for its process group, launchers and collectives; DMP
    wraps the dense part in DDP itself, so the module is never wrapped or moved here.

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
        self.run = ShardedRun(  # refuses a bad setting now, not at setup
            ShardingConfig(sharders, plan, constraints, fused_params, planner),
            timeout=timeout,
            data_parallel_wrapper=data_parallel_wrapper,
            batch_checks=batch_checks,
            on_nonfinite_loss=on_nonfinite_loss,
        )
        self.sharding = self.run.sharding
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
        #: Training steps (backwards of a training loss) of the set-up module.
        self.step = 0
        self._optimizers: list[DenseAndFusedOptimizer] = []
        self._prechecked = False  # `check_batch` was called for the coming forward
        self._evaluated = 0  # evaluation forwards since the last training vote
        self._failure_hook: FailureHook | None = None

    # ------------------------------------------------------------------ properties
    @property
    def dmp(self) -> DistributedModelParallel | None:
        """The ``DistributedModelParallel`` of the set-up module (None before setup)."""
        return self.run.dmp

    @property
    def sharding_plan(self) -> ShardingPlan | None:
        """The plan in use after setup (before it: the plan given, if any)."""
        return self.run.plan

    @property
    def plan_summary(self) -> PlanSummary | None:
        """The plan in use, readably (after setup)."""
        return self.run.summary

    @property
    def _runner(self) -> StepRunner | None:
        return self.run.runner

    # ------------------------------------------------------------------ launch and set-up
    @override
    def _configure_launcher(self) -> None:
        # A function launched with fork/spawn reports its error (torch's process wrapper
        # catches it before sys.excepthook could see it; see `.failures`).
        reporting_launcher(self, super())

    @override
    def setup_environment(self) -> None:
        # Under torchrun, the default group lives in a store of this attempt's own (a restart
        # never reads the dead attempt's keys); Fabric then finds it up.
        env = self.cluster_environment
        if env is not None:
            device = self.root_device
            backend = self.process_group_backend or ("nccl" if device.type == "cuda" else "gloo")
            self.run.start_group(backend, env.global_rank(), env.world_size(), device)
        super().setup_environment()
        # The per-step votes are host integers: a gloo group decides them without a GPU sync.
        self.run.open_host_group(self.global_rank, None, needed=dist.get_backend() != "gloo")
        if self.world_size > 1 and self._failure_hook is None:
            self._failure_hook = install_failure_hook(self)

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
        check_precision(self.precision, fused_tables=False)
        sharded, first = self.run.shard(module, self.root_device, self.num_processes, self.log_plan)
        check_precision(self.precision, has_fused_tables(sharded.plan))
        if first:  # a new model: its own steps, optimizers and checks
            self.step, self._prechecked, self._optimizers, self._evaluated = 0, False, [], 0
            self.run.new_steps(
                self.root_device,
                validate_batches=self.validate_batches,
                on_nonfinite_loss=self.on_nonfinite_loss,
                batch_checks=self.batch_checks,
                global_step=lambda: self.step,
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
        if self.dmp is None:
            raise RuntimeError(
                "TorchRecFabricStrategy shards the model first: call `fabric.setup_module(model)` "
                "before `fabric.setup_optimizers(optimizer)` (or use `fabric.setup(model, opt)`)."
            )
        combined = combine_fabric_optimizer(optimizer, unwrap(self.dmp), not self._optimizers)
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

    # ------------------------------------------------------------------ the steps
    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: Any) -> None:
        if module.training:
            # The fused kernels read the LR during backward; a scheduler's change made after the
            # last step must reach them before this forward.
            push_fused_lr(self._optimizers)
        if self.check_in_forward and not self._prechecked:  # every forward (several a step too)
            inputs = (*args, *kwargs.values())  # model(batch) or model(batch=batch)
            self._check(inputs[0] if len(inputs) == 1 else inputs, explicit=False)
        self._prechecked = False

    def _name_dead_peers_in_forward(self, module: nn.Module) -> None:
        # The set-up module's forward runs under the collective wrapper, as the Trainer's step
        # does: its collectives (the sparse features' all-to-all) wait for every rank, and a rank
        # that failed in its own forward would leave the others with gloo's bare "Connection
        # closed by peer" instead of a PeerFailureError that names it. Replaced on the
        # instance; hooks still run around it.
        forward = module.forward

        def named(*args: Any, **kwargs: Any) -> Any:
            return self.run.collective(forward, *args, **kwargs)

        module.forward = named  # type: ignore[method-assign]

    def check_batch(self, batch: Any, last: bool = False) -> None:
        """The agreed checks of the coming forward; call before it. Collective.

        One small collective decides whether any rank's batch is bad (ids out of range, unknown
        keys, bad lengths or dtypes, non-finite dense features) and whether any rank's previous
        loss was NaN/inf. Runs by itself before every forward unless ``check_in_forward=False``;
        calling it first makes the next forward skip it. With the module in ``eval()`` mode it
        checks an evaluation batch (always, whatever ``validate_batches`` says).

        Args:
            batch: this rank's batch.
            last: whether this rank has no batch after this one (in training, or in this
                evaluation; ranks that disagree raise ``UnevenDataError``).

        Raises:
            BatchValidationError: on every rank, naming the rank and step, when some rank's
                batch is bad.
            NonFiniteLossError: on every rank when some rank's previous loss was NaN/inf.
            UnevenDataError: on every rank when the ranks' batch counts part.
            RuntimeError: before ``setup_module``.
        """
        self._check(batch, last)
        self._prechecked = True

    def _check(self, batch: Any, last: bool = False, explicit: bool = True) -> None:
        runner = self._require_runner()
        step, guard = self.step, runner.guard
        if runner.model.training:
            self._evaluated = 0
            runner.collective(guard.before_training_step, batch, step, step, last, None, batch)
            return
        index, self._evaluated = self._evaluated, self._evaluated + 1
        if explicit or guard.checks(index) or guard.on_nonfinite_loss == "raise":  # as the Trainer
            where = f"evaluation forward {index} after step {step}"
            runner.collective(guard.before_loop_eval, batch, where, index, last)

    def finish(self) -> None:
        """Judges the last step's loss on every rank; call once after the training loop.

        Raises:
            NonFiniteLossError: on every rank when some rank's last loss was NaN/inf.
            UnevenDataError: on every rank when another rank is still training, or still
                evaluating.
        """
        runner = self._require_runner()
        self._evaluated = 0
        runner.collective(runner.guard.flush, self.step)

    def _require_runner(self) -> StepRunner:
        if self._runner is None:
            raise RuntimeError("call `fabric.setup_module(model)` (or `fabric.setup`) first")
        return self._runner

    @override
    def backward(
        self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kw: Any
    ) -> None:
        # The loss is judged at the next step's vote; the backward runs collectives too (the
        # sparse all-to-all, the dense all-reduce) and updates the fused tables.
        if self._runner is not None and (module is None or module.training):
            self._runner.guard.record_loss(tensor, self.step)
            self.step += 1
        self.run.collective(super().backward, tensor, module, *args, **kw)

    # ------------------------------------------------------------------ collectives
    # A Fabric loop's own collectives (fabric.barrier, broadcast, all_reduce, all_gather, and
    # fabric.save's path broadcast) name a dead or failed peer instead of gloo's bare error.
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.run.collective(super().barrier, *args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.run.collective(super().broadcast, obj, src)

    @override
    def all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self.run.collective(super().all_reduce, tensor, *args, **kwargs)

    @override
    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self.run.collective(super().all_gather, tensor, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Writes a sharded checkpoint directory (every rank writes its shards). Collective.

        Args:
            path: the checkpoint directory (rank 0's path is used by every rank).
            state: the model (the set-up one), optimizers and plain values to save; an object
                with ``state_dict()`` and ``load_state_dict()`` (an LR scheduler) is saved as
                its ``state_dict()``, as Fabric's own strategies do.
            storage_options: not supported.
            filter: not supported.

        Raises:
            TypeError: for ``storage_options`` or ``filter``.
        """
        if storage_options is not None or filter is not None:
            raise TypeError("TorchRecFabricStrategy.save_checkpoint takes no options or filter")
        save_fabric_checkpoint(self, path, state)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Loads a sharded checkpoint in place, resharding to this plan and world. Collective.

        Args:
            path: a checkpoint directory written by this strategy or ``TorchRecStrategy``.
            state: the set-up module, or ``{name: module | optimizer | value}`` (see
                :func:`~lightning_torchrec.fabric.checkpointing.load_fabric_checkpoint`).
            strict: raise when a plain value of ``state`` is not in the checkpoint, or the
                model and the checkpoint do not hold the same tensors.
            weights_only: read the metadata with ``torch.load(weights_only=...)`` (default
                True; tensors are always read without running code).

        Returns:
            The checkpoint's plain values that ``state`` did not ask for.
        """
        meta = load_fabric_checkpoint(self, path, state, strict, weights_only)
        push_fused_lr(self._optimizers)
        return meta

    # ------------------------------------------------------------------ failures and the end
    def report_failure(self, exception: BaseException) -> None:
        """Tells the other ranks what this rank fails with, before it exits.

        Called by the strategy for an error that no one caught (see :mod:`.failures`); a loop
        that catches an error and then ends this rank's part can call it itself. A collective's
        error that only says a peer died is not this rank's own: it is explained (with the
        failing rank's report, when there is one) on stderr and not reported.

        Args:
            exception: the error this rank is failing with.
        """
        failure = self.run.explain(exception, self.global_rank)
        dmp = self.dmp
        evaluating = dmp is not None and not dmp.training
        where = f"Fabric step {self.step}" + (" (evaluation)" if evaluating else "")
        self.run.report(failure, where, self.global_rank)

    @override
    def teardown(self) -> None:
        if self._failure_hook is not None:
            self._failure_hook.remove()
            self._failure_hook = None
        self.run.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``"torchrec"`` (and ``_spawn``, ``_fork``, ``_notebook``) with Fabric.

        Args:
            strategy_registry: Fabric's ``STRATEGY_REGISTRY``.
        """
        register_names(strategy_registry, cls)
