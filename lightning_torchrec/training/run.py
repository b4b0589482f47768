"""One sharded model's run, as both front ends drive it: its groups, plan, steps and failures.

The Trainer's ``TorchRecStrategy`` and Fabric's ``TorchRecFabricStrategy`` are two thin front
ends over one :class:`ShardedRun`. It does what both do, in one place:

* the process groups: the default group of a torchrun attempt in keys of its own
  (:func:`~lightning_torchrec.distributed.init_elastic_group`), destroyed at exit, and the gloo
  group that keeps each step's vote on the host (:meth:`ShardedRun.open_host_group`);
* the sharding: :func:`~lightning_torchrec.sharding.planning.shard_model` under the collective
  wrapper (a dead peer is named), the plan printed once;
* the steps: a :class:`~lightning_torchrec.training.steps.StepRunner` per sharded run;
* the collectives of the front end (barriers, broadcasts, reductions), each of which names a
  peer that died (:meth:`ShardedRun.collective`);
* the fused embedding optimizer's learning rate, pushed into the kernels before each forward
  (:func:`~lightning_torchrec.training.optim.push_fused_lr`);
* the precisions a sharded model cannot train with (:func:`check_precision`);
* a failure of this rank told to the others before it exits (:meth:`ShardedRun.report`);
* the end: the steps' batches and iterators released, the host group destroyed, the run's
  garbage finalised (:meth:`ShardedRun.close`).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_torchrec.distributed import (
    init_elastic_group,
    peer_failure,
    run_collective,
    shutdown_at_exit,
)
from lightning_torchrec.errors import PeerFailureError
from lightning_torchrec.failure_reports import begin_run, post
from lightning_torchrec.sharding.planning import ShardedModel, ShardingConfig, shard_model
from lightning_torchrec.training.step_guard import StepGuard
from lightning_torchrec.training.steps import BATCH_CHECKS, StepMode, StepRunner


def check_precision(precision: Any, fused_tables: bool) -> None:
    """Refuses precisions that the sharded model cannot train with (Trainer or Fabric plugin).

    Args:
        precision: the precision plugin (its ``precision`` name and, mixed, its ``scaler``).
        fused_tables: whether the plan holds tables updated by a fused optimizer.

    Raises:
        ValueError: for ``*-true`` half or double precision (they convert the whole model,
            tables included), and for ``16-mixed`` with fused tables (its gradient scaler
            never sees the fused update).
    """
    name = str(getattr(precision, "precision", ""))
    if name in ("16-true", "bf16-true", "64-true", "16", "64"):
        raise ValueError(
            f"precision={name!r} converts the whole model, but TorchRec's embedding kernels "
            "keep the dtype the tables were built with and return fp32 embeddings. Use "
            "precision='bf16-mixed' (or '32-true'); set the table dtype with "
            "EmbeddingBagConfig(data_type=...)."
        )
    if fused_tables and getattr(precision, "scaler", None) is not None:
        raise ValueError(
            "precision='16-mixed' uses a gradient scaler, but fused embedding tables update "
            "inside the backward pass with the *scaled* gradients, so they would diverge. Use "
            "precision='bf16-mixed' or '32-true', or shard tables with a non-fused compute "
            "kernel."
        )


def register_names(strategy_registry: Any, cls: type) -> None:
    """Registers a front end's strategy as ``"torchrec"``, ``"torchrec_spawn"``, ``"_fork"``...

    Args:
        strategy_registry: the Trainer's or Fabric's strategy registry.
        cls: the strategy class (its start method is set per name).
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


class ShardedRun:
    """What both front ends do around one sharded model (see the module docstring).

    Built in the front end's constructor: a bad setting is refused there, not at set-up.

    Args:
        sharding: how to shard (sharders, plan, constraints, fused params, planner).
        timeout: the collective timeout (None: torch's default).
        data_parallel_wrapper: how DMP wraps the dense part.
        batch_checks: when an unpipelined training batch is checked (see ``StepRunner``).
        on_nonfinite_loss: ``"raise"`` or ``"ignore"``.

    Raises:
        ValueError: for an unknown ``batch_checks`` or ``on_nonfinite_loss``.
    """

    def __init__(
        self,
        sharding: ShardingConfig,
        *,
        timeout: timedelta | None = None,
        data_parallel_wrapper: Any = None,
        batch_checks: str = "auto",
        on_nonfinite_loss: str = "raise",
    ) -> None:
        if batch_checks not in BATCH_CHECKS:
            raise ValueError(f"batch_checks must be one of {BATCH_CHECKS}, got {batch_checks!r}")
        StepGuard(on_nonfinite_loss)  # refuses an unknown mode
        self.sharding = sharding
        self.timeout = timeout
        self.data_parallel_wrapper = data_parallel_wrapper
        #: What the last :meth:`shard` built (None before).
        self.sharded: ShardedModel | None = None
        #: The steps of the sharded model (None before :meth:`new_steps`).
        self.runner: StepRunner | None = None
        #: The gloo group of the votes (None: they run on the default group).
        self.host_group: Any = None
        self.vote_timeout: timedelta | None = None

    @property
    def dmp(self) -> Any:
        """The ``DistributedModelParallel`` of the sharded model (None before :meth:`shard`)."""
        return self.sharded.dmp if self.sharded is not None else None

    @property
    def plan(self) -> Any:
        """The plan in use after :meth:`shard` (before it: the plan given, if any)."""
        return self.sharded.plan if self.sharded is not None else self.sharding.plan

    @property
    def summary(self) -> Any:
        """The plan in use, readably (None before :meth:`shard`)."""
        return self.sharded.summary if self.sharded is not None else None

    # ------------------------------------------------------------------ process groups
    def start_group(self, backend: str, rank: int, world_size: int, device: torch.device) -> None:
        """Starts the default group of a torchrun attempt in a store of its own (no-op else).

        Under torchrun a restarted attempt never reads the dead attempt's keys
        (:func:`~lightning_torchrec.distributed.attempt_store`); elsewhere, and when a group is
        up already, the front end's own set-up starts the group.

        Args:
            backend: ``"gloo"`` or ``"nccl"``.
            rank: this process's global rank.
            world_size: the number of processes.
            device: the rank's device.
        """
        cuda = device if device.type == "cuda" else None
        init_elastic_group(backend, rank, world_size, self.timeout or default_pg_timeout, cuda)

    def open_host_group(self, rank: int, vote_timeout: timedelta | None, needed: bool) -> None:
        """After the default group is up: its shutdown at exit, and the votes' host group.

        Args:
            rank: this process's global rank (no report of an earlier run in this process
                explains a failure of this one).
            vote_timeout: how long a vote waits for the peers (the host group's timeout).
            needed: whether the votes get a gloo group of their own (else the default group).
        """
        shutdown_at_exit()
        begin_run(rank)
        if needed and self.host_group is None:
            self.host_group = dist.new_group(backend="gloo", timeout=vote_timeout)
            self.vote_timeout = vote_timeout

    # ------------------------------------------------------------------ collectives
    def collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs a front end's own collective (barrier, broadcast, backward); names a dead peer.

        Args:
            fn: the call; ``args`` and ``kwargs`` are its arguments.
            *args: passed on.
            **kwargs: passed on.

        Returns:
            What ``fn`` returned.
        """
        return run_collective(fn, *args, timeout=self.timeout, **kwargs)

    def timeouts(self) -> str:
        """The timeouts a failed collective may have run into (for ``PeerFailureError``).

        Returns:
            The collective timeout, and the votes' own where they have one.
        """
        if self.host_group is None or self.vote_timeout is None:
            return str(self.timeout)
        return f"{self.vote_timeout} at a step's vote, {self.timeout} elsewhere"

    # ------------------------------------------------------------------ the model
    def shard(
        self, module: nn.Module, device: torch.device, local_world_size: int, log_plan: bool
    ) -> tuple[ShardedModel, bool]:
        """Plans and shards ``module`` on every rank (collective); a sharded one is reused.

        Args:
            module: the unsharded model (tables usually on the meta device).
            device: the rank's device.
            local_world_size: processes per node.
            log_plan: print the plan (rank 0) when the model is new.

        Returns:
            What was built, and whether it is a new model (not the last one's sharding again).
        """
        sharded = self.collective(  # planning and DMP's collectives: a dead peer is named
            shard_model,
            module,
            device,
            local_world_size=local_world_size,
            data_parallel_wrapper=self.data_parallel_wrapper,
            **vars(self.sharding),
        )
        first = self.sharded is None or self.sharded.dmp is not sharded.dmp
        self.sharded = sharded
        if first and log_plan:
            text = sharded.summary.to_markdown()
            rank_zero_info(f"TorchRec sharding plan ({sharded.summary.world_size} ranks):\n{text}")
        return sharded, first

    def new_steps(
        self,
        device: torch.device,
        *,
        validate_batches: bool | int,
        on_nonfinite_loss: str,
        batch_checks: str,
        mode: StepMode | None = None,
        global_step: Callable[[], int] = lambda: 0,
        transformed: bool = False,
    ) -> StepRunner:
        """The steps of the sharded model (the last run's are released first).

        Args:
            device: the rank's device.
            validate_batches: which batches are checked (see ``StepRunner``).
            on_nonfinite_loss: ``"raise"`` or ``"ignore"``.
            batch_checks: when an unpipelined batch is checked (see ``StepRunner``).
            mode: how training steps run (:func:`~lightning_torchrec.training.steps.
                choose_mode`); None: unpipelined, voting before each forward.
            global_step: returns the number of finished training steps.
            transformed: the front end changes batches after the loader.

        Returns:
            The new :class:`~lightning_torchrec.training.steps.StepRunner`.
        """
        assert self.sharded is not None, "shard() first"
        if self.runner is not None:
            self.runner.close()
        self.runner = StepRunner(
            self.sharded.dmp,
            device,
            specs=self.sharded.feature_specs,
            dense_width=self.sharded.dense_width,
            validate_batches=validate_batches,
            on_nonfinite_loss=on_nonfinite_loss,
            mode=mode,
            global_step=global_step,
            timeout=self.timeouts(),
            group=self.host_group,
            batch_checks=batch_checks,
            transformed=transformed,
        )
        return self.runner

    # ------------------------------------------------------------------ failures
    def explain(self, exception: BaseException, rank: int) -> BaseException:
        """The error to report for ``exception``: a dead peer's bare error names the peer.

        A peer's collective that failed bare (a metric's sync, a loop's own all-reduce) only
        says that the connection closed; it becomes a ``PeerFailureError`` naming the failed
        rank (with its own report, when it wrote one), printed at once on this rank: a dead
        peer's launcher kills the survivors within seconds, often before a traceback appears.

        Args:
            exception: what this rank is failing with.
            rank: this rank.

        Returns:
            The ``PeerFailureError`` it explains, or ``exception`` itself.
        """
        failure = exception
        if not isinstance(exception, PeerFailureError):
            failure = peer_failure(exception, self.timeout) or exception
        if isinstance(failure, PeerFailureError):
            name = type(failure).__name__
            print(f"[rank {rank}] {name}: {failure}", file=sys.stderr, flush=True)
        return failure

    def report(self, exception: BaseException, where: str, rank: int) -> None:
        """Tells the peers what this rank fails with, before it exits (``failure_reports``).

        A peer's failure is not this rank's own: it is not reported again.

        Args:
            exception: the error this rank is failing with (after :meth:`explain`).
            where: where the run is (``"global step 12 (train)"``), for the peers' message.
            rank: this rank.
        """
        post(exception, where, rank)

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Releases the steps' batches and iterators and destroys the host group.

        The run's garbage (process-group handles) is finalised here: finalised in a forked
        DataLoader worker of a later run, a ``ProcessGroupGloo`` waits forever for its threads.
        The sharded model stays: a later run of the same front end reuses it.
        """
        if self.runner is not None:
            self.runner.close()
        if self.host_group is not None:
            dist.destroy_process_group(self.host_group)
            self.host_group = None
        gc.collect()
