"""How ``TorchRecStrategy`` saves and loads: sharded DCP directories instead of one file.

Lightning's default writes rank 0's ``state_dict()`` with ``torch.save``, which holds only rank
0's shards of every table. The strategy's ``save_checkpoint`` and ``load_checkpoint`` call
:func:`save_trainer_checkpoint` and :func:`load_trainer_checkpoint`: every rank saves and loads
its own shards through :mod:`lightning_torchrec.checkpoint` (collective calls on every rank), and
Lightning's own entries (loops, callbacks, schedulers) go in the directory's ``meta.pt``.

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

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from lightning_torchrec.checkpoint import (
    confine_checkpoint_paths,
    load_sharded,
    save_sharded,
)
from lightning_torchrec.checkpoint.hyper_params import scheduler_state
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
    take_position,
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


def save_trainer_checkpoint(strategy: Any, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Saves Lightning's checkpoint dict as a sharded directory, on every rank (collective).

    Refused, with nothing written, between a training backward and its optimizer step (the
    fused tables then hold an update the dense weights lack), and on every rank when a batch
    judged a step late or a non-finite value would reach it.

    Args:
        strategy: the ``TorchRecStrategy`` (its module, optimizers, run and settings).
        checkpoint: Lightning's checkpoint dict (``state_dict`` and ``optimizer_states`` are
            replaced by the shards of every rank).
        filepath: rank 0's path, used by every rank.

    Raises:
        MidStepCheckpointError: for a save between a backward and its optimizer step.
        PeerFailureError: when a save asked for while handling an exception misses a rank.
    """
    trainer = attached_trainer(strategy.lightning_module)
    interrupted = bool(getattr(trainer, "interrupted", False))
    # Between micro-batches of an accumulation the dense gradients are dropped, as under DDP; a
    # save there is Lightning's (a validation's) own.
    accumulating = getattr(trainer, "accumulate_grad_batches", 1) > 1
    ahead = strategy.tables_ahead and (interrupted or not accumulating)
    ahead = ahead and has_fused_tables(strategy.sharding_plan)
    step = getattr(trainer, "global_step", "?")
    if interrupted and strategy.world_size > 1:
        handling = sys.exception()  # the peers are told first, in case no rank comes
        if handling is not None:
            strategy.report_failure(handling)
        meet_to_save(strategy, step, ahead)  # every rank, at the same point of a step
    if ahead:
        raise MidStepCheckpointError(_mid_step(strategy.global_rank, step, [strategy.global_rank]))
    runner = strategy.run.runner
    if runner is not None:  # a batch judged a step late never reaches a checkpoint
        runner.settle()
    # Rank 0's path and position within the epoch, for every rank (one broadcast).
    target, position = strategy.run.collective(
        strategy.broadcast, (str(filepath), epoch_position(trainer))
    )
    path = local_path(target)  # a URL of another file system: refused on every rank
    checkpoint = dict(checkpoint)
    if position is not None:  # what the training step consumed: a resume skips it
        checkpoint[POSITION_KEY] = position
    model_state = checkpoint.pop("state_dict", None)
    has_optim = bool(checkpoint.pop("optimizer_states", None))
    optimizers = [keyed_optimizer(o) for o in strategy.optimizers] if has_optim else []
    try:
        save_sharded(
            path,
            strategy.lightning_module,
            optimizers,
            checkpoint,
            model_state=model_state,
            check_finite_values=strategy.check_finite_checkpoints,
            key=strategy.checkpoint_key,
        )
    except NonFiniteCheckpointError:  # refused on every rank: a NaN loss may be why
        if runner is not None:
            runner.explain()  # its vote is decided after this step's checkpoint
        raise


def meet_to_save(strategy: Any, step: Any, ahead: bool) -> None:
    """Waits, bounded, for every rank to reach a save asked for while handling an exception.

    ``OnExceptionCheckpoint`` saves from the failing rank's exception handler. A rank that did
    not fail is still in a step, waiting for this one, and never joins the save's collectives;
    and ranks that all failed (Ctrl-C reaches every rank) may have stopped at different points of
    a step, one having started a collective the others never will, so the save's first
    collective would pair with it and hang. The ranks meet through the store
    (:func:`~lightning_torchrec.failure_reports.meet`), each waiting at most ``peer_timeout`` (at
    most a minute), and compare how many collectives each started.

    Args:
        strategy: the ``TorchRecStrategy``.
        step: the global step, for the messages.
        ahead: whether this rank's fused tables hold an update its dense weights lack.

    Raises:
        PeerFailureError: if some rank did not come: nothing is written.
        MidStepCheckpointError: on every rank, if some rank's tables are ahead of its dense
            weights or the ranks stopped at different points of a step: nothing is written.
    """
    rank = strategy.global_rank
    wait = min(strategy.peer_timeout or SAVE_MEETING, SAVE_MEETING)
    counts = [collective_count(), collective_count(strategy.run.host_group)]
    mine = {"counts": counts, "ahead": ahead, "step": step}
    posts = meet(mine, strategy.world_size, wait, rank)
    missing = [r for r, post in enumerate(posts) if post is None]
    if missing:
        raise PeerFailureError(
            f"rank {rank}: the checkpoint asked for while handling an exception was not "
            f"written: rank(s) {missing} did not reach it within {wait} (a rank that did not "
            "fail is still in a step, waiting for the failed one, or has stopped). The last "
            "checkpoint written stays the last good one."
        )
    ranks = [r for r, post in enumerate(posts) if post and post.get("ahead")]
    steps = [post.get("step") if post else None for post in posts]
    if any(s != steps[0] for s in steps):  # a rank that finished its step, one that did not
        step = f"{steps} (by rank)"
    if ranks:
        raise MidStepCheckpointError(_mid_step(rank, step, ranks))
    started = [post.get("counts") if post else None for post in posts]
    if any(c != started[0] for c in started):
        raise MidStepCheckpointError(
            f"rank {rank}: refusing to save the checkpoint asked for while handling an "
            f"exception at global step {step}: the ranks stopped at different points of a step "
            f"(collectives started on the default and host groups, by rank: {started}), so the "
            "save's own collectives could not be matched. Nothing is written; the last "
            "checkpoint written stays the last good one."
        )


def load_trainer_checkpoint(
    strategy: Any, checkpoint_path: Any, weights_only: bool | None
) -> tuple[dict[str, Any], dict[str, int] | None]:
    """Loads a sharded directory into the module (and, fitting, the optimizers), in place.

    Args:
        strategy: the ``TorchRecStrategy`` (after setup).
        checkpoint_path: rank 0's path, used by every rank.
        weights_only: Lightning's ``weights_only`` (None: what the Trainer's call asked for).

    Returns:
        The checkpoint's metadata (Lightning's entries, its ``ModelCheckpoint`` paths confined
        to their ``dirpath``), and where in its epoch a fit resumes (None: at an epoch's start,
        or not fitting), in the checkpoint's layout (rescaled with the training loader's).
    """
    path = local_path(strategy.run.collective(strategy.broadcast, str(checkpoint_path)))
    module = strategy.lightning_module
    trainer = attached_trainer(module)
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    # Evaluation restores the weights only (as Lightning does), also on a Trainer whose fit left
    # its optimizers behind: their state is neither needed nor overwritten.
    optimizers = [keyed_optimizer(o) for o in strategy.optimizers] if fitting else []
    if weights_only is None:  # Lightning drops it for a strategy restoring after setup
        weights_only = requested_weights_only(trainer)
    meta = load_sharded(
        path,
        module,
        optimizers,
        weights_only=True if weights_only is None else weights_only,
        load_optimizer_states=strategy.load_optimizer_states,
        key=strategy.checkpoint_key,
        limits=strategy.checkpoint_limits,
        strict=module.strict_loading,
    )
    # The training loader skips the batches trained on (see `TorchRecStrategy.process_dataloader`).
    position = reopen(meta, take_position(meta)) if fitting else None
    if fitting:
        match_scheduler_states(meta, trainer)
    dropped = confine_restored_callbacks(meta, trainer)
    if dropped and strategy.is_global_zero:
        warnings.warn(
            f"{path}: restored ModelCheckpoint paths outside the callback's dirpath were "
            f"dropped (a resumed run never deletes outside it): {dropped[:5]}",
            UserWarning,
            stacklevel=3,
        )
    return meta, position
