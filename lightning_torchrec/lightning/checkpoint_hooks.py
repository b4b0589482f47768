"""The checkpoint hooks of ``TorchRecStrategy``: sharded DCP directories instead of one file.

Lightning's default writes rank 0's ``state_dict()`` with ``torch.save``, which holds only rank
0's shards of every table. These hooks make every rank save and load its own shards through
:mod:`lightning_torchrec.checkpoint` (collective calls on every rank) and keep Lightning's own
entries (loops, callbacks, schedulers) in the directory's ``meta.pt``.

Resuming confines what a checkpoint can make the run do later: the paths restored into each
``ModelCheckpoint`` (best, last, k-best) are kept only inside its ``dirpath`` (the others are
dropped with a warning), so a resumed run never deletes anything outside it; and retiring a
checkpoint deletes only this package's own (see :mod:`lightning_torchrec.checkpoint.ownership`).
"""

from __future__ import annotations

import sys
import warnings
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_torchrec.checkpoint import (
    confine_checkpoint_paths,
    load_sharded,
    remove_checkpoint,
    save_sharded,
)
from lightning_torchrec.checkpoint.hyper_params import scheduler_state
from lightning_torchrec.checkpoint.limits import CheckpointLimits
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.compat.c10d import collective_count
from lightning_torchrec.compat.lightning import requested_weights_only
from lightning_torchrec.errors import (
    MidStepCheckpointError,
    NonFiniteCheckpointError,
    PeerFailureError,
)
from lightning_torchrec.failure_reports import meet
from lightning_torchrec.lightning.mid_epoch import (
    POSITION_KEY,
    epoch_position,
    reopen,
    rescale,
    saved_position,
)
from lightning_torchrec.sharding.sharders import has_fused_tables
from lightning_torchrec.training.optim import keyed_optimizer

#: The longest a rank waits for the others at a save asked for while handling an exception.
SAVE_MEETING = timedelta(minutes=1)


def _mid_step(rank: int, step: Any, ranks: list[int]) -> str:
    return (
        f"rank {rank}: refusing to save a checkpoint at global step {step}: the fused embedding "
        f"tables of rank(s) {ranks} already hold this step's update (they update inside the "
        "backward pass) but the dense optimizer has not stepped, so it would not resume "
        "exactly. Save between steps (ModelCheckpoint, PreemptionCheckpoint); the last "
        "checkpoint written stays the last good one."
    )


def attached_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None.

    Args:
        module: the LightningModule (or None).

    Returns:
        The Trainer, or None.
    """
    try:
        return module.trainer if module is not None else None
    except RuntimeError:  # not attached to a Trainer
        return None


def match_scheduler_states(meta: dict[str, Any], trainer: Any) -> None:
    """Matches the saved LR schedulers' per-group lists to this rank's param groups, in place.

    Lightning restores every rank's schedulers from rank 0's state; under another plan or world
    size, or on a rank driving another number of fused kernels than rank 0, their per-group
    lists (``base_lrs``, ...) would not line up with the groups and some groups would never be
    scheduled (see :mod:`lightning_torchrec.checkpoint.hyper_params`).

    Args:
        meta: the checkpoint's metadata (its ``lr_schedulers`` are replaced).
        trainer: the Trainer.
    """
    states = meta.get("lr_schedulers")
    configs = list(getattr(trainer, "lr_scheduler_configs", None) or [])
    if not isinstance(states, list) or len(states) != len(configs):
        return  # Lightning names the mismatch itself
    matched = []
    for state, config in zip(states, configs, strict=True):
        scheduler = config.scheduler
        optimizer = getattr(scheduler, "optimizer", None)
        if isinstance(state, dict) and optimizer is not None:  # the combined one, or another
            state = scheduler_state(state, optimizer, scheduler.state_dict())
        matched.append(state)
    meta["lr_schedulers"] = matched


def confine_restored_callbacks(meta: dict[str, Any], trainer: Any) -> list[str]:
    """Drops restored ``ModelCheckpoint`` paths outside each callback's ``dirpath``, in place.

    Args:
        meta: the loaded checkpoint dict (its ``"callbacks"`` entry is changed).
        trainer: the Trainer whose callbacks will restore it.

    Returns:
        ``"callback: path"`` for every dropped path.
    """
    states = meta.get("callbacks")
    if not isinstance(states, dict) or trainer is None:
        return []
    dropped = []
    for callback in getattr(trainer, "callbacks", []):
        if not isinstance(callback, ModelCheckpoint):
            continue
        for key in {callback.state_key, type(callback).__qualname__}:
            state = states.get(key)
            if isinstance(state, dict):
                paths = confine_checkpoint_paths(state, callback.dirpath)
                dropped += [f"{key}: {p}" for p in paths]
    return dropped


class ShardedCheckpointing:
    """Mixin for a Lightning strategy over a sharded LightningModule (``TorchRecStrategy``).

    The strategy provides ``lightning_module``, ``optimizers``, ``broadcast``,
    ``is_global_zero``, ``check_finite_checkpoints``, ``load_optimizer_states``,
    ``checkpoint_key`` (HMAC key: sign on save, require on load; None: the
    ``LIGHTNING_TORCHREC_CHECKPOINT_KEY_FILE`` environment variable decides), ``_push_fused_lr``
    and ``_collective`` (runs a collective, turning a dead peer's error into
    ``PeerFailureError``). ``checkpoint_limits`` bounds what loading may cost; set it on the
    strategy (``strategy.checkpoint_limits = CheckpointLimits(...)``) to load a trusted
    checkpoint beyond the defaults.
    """

    checkpoint_key: bytes | str | None = None
    checkpoint_limits: CheckpointLimits | None = None

    lightning_module: Any
    optimizers: list[Any]
    is_global_zero: bool
    check_finite_checkpoints: bool
    load_optimizer_states: bool
    broadcast: Any
    _push_fused_lr: Any
    _collective: Any
    _runner: Any
    _resume_position: dict[str, int] | None = None
    tables_ahead: bool
    _plan: Any
    global_rank: int
    world_size: int
    peer_timeout: timedelta | None
    _host_group: Any
    report_failure: Any

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
        trainer = attached_trainer(self.lightning_module)
        interrupted = bool(getattr(trainer, "interrupted", False))
        # Between micro-batches of an accumulation the dense gradients are dropped, as under
        # DDP; a save there is Lightning's (a validation's) own.
        accumulating = getattr(trainer, "accumulate_grad_batches", 1) > 1
        ahead = self.tables_ahead and (interrupted or not accumulating)
        ahead = ahead and has_fused_tables(self._plan)
        step = getattr(trainer, "global_step", "?")
        if interrupted and self.world_size > 1:
            handling = sys.exception()  # the peers are told first, in case no rank comes
            if handling is not None:
                self.report_failure(handling)
            self._meet_to_save(step, ahead)  # every rank, at the same point of a step
        if ahead:
            raise MidStepCheckpointError(_mid_step(self.global_rank, step, [self.global_rank]))
        if self._runner is not None:  # a batch judged a step late never reaches a checkpoint
            self._runner.settle()
        # Rank 0's path and position within the epoch, for every rank (one broadcast).
        target, position = self._collective(
            self.broadcast, (str(filepath), epoch_position(trainer))
        )
        path = local_path(target)  # a URL of another file system: refused on every rank
        checkpoint = dict(checkpoint)
        if position is not None:  # what the training step consumed: a resume skips it
            checkpoint[POSITION_KEY] = position
        model_state = checkpoint.pop("state_dict", None)
        has_optim = bool(checkpoint.pop("optimizer_states", None))
        optimizers = [keyed_optimizer(o) for o in self.optimizers] if has_optim else []
        assert self.lightning_module is not None
        try:
            save_sharded(
                path,
                self.lightning_module,
                optimizers,
                checkpoint,
                model_state=model_state,
                check_finite_values=self.check_finite_checkpoints,
                key=self.checkpoint_key,
            )
        except NonFiniteCheckpointError:  # refused on every rank: a NaN loss may be why
            if self._runner is not None:
                self._runner.explain()  # its vote is decided after this step's checkpoint
            raise

    def _meet_to_save(self, step: Any, ahead: bool) -> None:
        """Waits, bounded, for every rank to reach a save asked for while handling an exception.

        ``OnExceptionCheckpoint`` saves from the failing rank's exception handler. A rank that
        did not fail is still in a step, waiting for this one, and never joins the save's
        collectives; and ranks that all failed (Ctrl-C reaches every rank) may have stopped at
        different points of a step, one having started a collective the others never will, so
        the save's first collective would pair with it and hang. The ranks meet through the
        store (:func:`~lightning_torchrec.failure_reports.meet`), each waiting at most
        ``peer_timeout`` (at most a minute), and compare how many collectives each started.

        Args:
            step: the global step, for the messages.
            ahead: whether this rank's fused tables hold an update its dense weights lack.

        Raises:
            PeerFailureError: if some rank did not come: nothing is written.
            MidStepCheckpointError: on every rank, if some rank's tables are ahead of its dense
                weights or the ranks stopped at different points of a step: nothing is written.
        """
        wait = min(self.peer_timeout or SAVE_MEETING, SAVE_MEETING)
        counts = [collective_count(), collective_count(self._host_group)]
        mine = {"counts": counts, "ahead": ahead, "step": step}
        posts = meet(mine, self.world_size, wait, self.global_rank)
        missing = [r for r, post in enumerate(posts) if post is None]
        if missing:
            raise PeerFailureError(
                f"rank {self.global_rank}: the checkpoint asked for while handling an exception "
                f"was not written: rank(s) {missing} did not reach it within {wait} (a rank that "
                "did not fail is still in a step, waiting for the failed one, or has stopped). "
                "The last checkpoint written stays the last good one."
            )
        ranks = [r for r, post in enumerate(posts) if post and post.get("ahead")]
        steps = [post.get("step") if post else None for post in posts]
        if any(s != steps[0] for s in steps):  # a rank that finished its step, one that did not
            step = f"{steps} (by rank)"
        if ranks:
            raise MidStepCheckpointError(_mid_step(self.global_rank, step, ranks))
        started = [post.get("counts") if post else None for post in posts]
        if any(c != started[0] for c in started):
            raise MidStepCheckpointError(
                f"rank {self.global_rank}: refusing to save the checkpoint asked for while "
                f"handling an exception at global step {step}: the ranks stopped at different "
                "points of a step (collectives started on the default and host groups, by "
                f"rank: {started}), so the save's own collectives could not be matched. Nothing "
                "is written; the last checkpoint written stays the last good one."
            )

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = local_path(self._collective(self.broadcast, str(checkpoint_path)))
        assert self.lightning_module is not None
        trainer = attached_trainer(self.lightning_module)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # Evaluation restores the weights only (as Lightning does), also on a Trainer whose fit
        # left its optimizers behind: their state is neither needed nor overwritten.
        optimizers = [keyed_optimizer(o) for o in self.optimizers] if fitting else []
        if weights_only is None:  # Lightning drops it for a strategy restoring after setup
            weights_only = requested_weights_only(trainer)
        meta = load_sharded(
            path,
            self.lightning_module,
            optimizers,
            weights_only=True if weights_only is None else weights_only,
            load_optimizer_states=self.load_optimizer_states,
            key=self.checkpoint_key,
            limits=self.checkpoint_limits,
            strict=self.lightning_module.strict_loading,
        )
        self._push_fused_lr()
        # The training loader skips the batches trained on (see `DataHooks.process_dataloader`).
        position = reopen(meta, saved_position(meta)) if fitting else None
        self._resume_position = rescale(position, self.world_size)
        if fitting:
            match_scheduler_states(meta, trainer)
        dropped = confine_restored_callbacks(meta, trainer)
        if dropped and self.is_global_zero:
            warnings.warn(
                f"{path}: restored ModelCheckpoint paths outside the callback's dirpath were "
                f"dropped (a resumed run never deletes outside it): {dropped[:5]}",
                UserWarning,
                stacklevel=2,
            )
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
