"""Mid-epoch resume of any training DataLoader: the position saved, and skipped on resume.

Lightning resumes a loader mid-epoch only when it has ``state_dict()``/``load_state_dict()``;
a plain map-style ``DataLoader`` replays its epoch from the start. ``TorchRecStrategy`` saves in
every checkpoint how far into its epoch the *training step* got (the fit loop's count of
processed batches, not what the loader or a pipeline read ahead), under :data:`POSITION_KEY`,
rank 0's value for every rank. On resume the training loader's index sampler leaves out those
batches without loading them (:func:`~lightning_torchrec.data.mid_epoch.skip_batches`); loaders
with the state protocol are left to Lightning; for the rest (an ``IterableDataset`` without the
protocol) one warning says that the epoch replays. A checkpoint without the entry (written
before it existed) resumes as Lightning does.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning_torchrec.compat.lightning import epoch_running, processed_epochs
from lightning_torchrec.compat.lightning_loops import reopen_cut_epoch, start_next_epoch
from lightning_torchrec.compat.upstream import drop_persistent_iterator
from lightning_torchrec.data.mid_epoch import skip_batches
from lightning_torchrec.data.resumable import restart_epoch_at, trainer_position

log = logging.getLogger(__name__)

#: The checkpoint entry: ``{"epoch": e, "batches": k}``, ``k`` batches of epoch ``e`` trained
#: (0 when the epoch was complete).
POSITION_KEY = "lightning_torchrec_epoch_position"


def epoch_position(trainer: Any) -> dict[str, int] | None:
    """Where in its epoch the fit loop's training step is.

    Args:
        trainer: the Trainer, or None.

    Returns:
        ``{"epoch": e, "batches": k}``: ``k`` batches of epoch ``e`` were trained on, 0 when
        none or all were; None without a trainer. A fit stopped within epoch ``e``
        (``max_steps``, ``should_stop``) has processed that epoch's end, but its ``k`` batches
        still belong to ``e``.
    """
    if trainer is None:
        return None
    batches = trainer_position(trainer)
    assert batches is not None
    cut = 0 < batches < trainer.num_training_batches
    epoch = processed_epochs(trainer)
    if cut and not epoch_running(trainer):
        epoch -= 1  # the epoch was cut short, and Lightning ended it
    return {"epoch": epoch, "batches": batches if cut else 0, "world_size": trainer.world_size}


def reopen(checkpoint: dict[str, Any], position: dict[str, int] | None) -> dict[str, int] | None:
    """Resumes a checkpoint saved at an epoch's end, or cut short within it, where it stopped.

    Lightning ends an epoch cut short (``max_steps``, ``should_stop``) as though it were over,
    so a checkpoint saved then would resume at the next epoch and never train the rest of the
    cut one. Its loop state is made Lightning's own mid-epoch state
    (:func:`~lightning_torchrec.compat.lightning_loops.reopen_cut_epoch`), so the resumed run
    finishes the epoch, skipping the batches trained on as after any mid-epoch checkpoint. A
    checkpoint saved at an epoch's end resumes at the next epoch's start
    (:func:`~lightning_torchrec.compat.lightning_loops.start_next_epoch`): under ``max_steps``
    without validation, Lightning trained one more batch of the ended epoch first.

    Args:
        checkpoint: Lightning's checkpoint dict (as loaded), rewritten in place.
        position: from :func:`saved_position`.

    Returns:
        The position to resume from.
    """
    started = start_next_epoch(checkpoint)
    if started is not None:
        log.info("resuming at the start of epoch %d (saved at the end of the one before)", started)
    if started is not None or position is None or position["batches"] == 0:
        return position
    epoch = reopen_cut_epoch(checkpoint)
    if epoch is None:
        return position
    log.info("reopening epoch %d, cut short after %d batches", epoch, position["batches"])
    return position | {"epoch": epoch}


def saved_position(checkpoint: dict[str, Any]) -> dict[str, int] | None:
    """The position a loaded checkpoint holds, if it holds a well-formed one.

    Args:
        checkpoint: Lightning's checkpoint dict (as loaded).

    Returns:
        ``{"epoch": e, "batches": k}``, or None.
    """
    position = checkpoint.get(POSITION_KEY)
    if not isinstance(position, dict):
        return None
    epoch, batches = position.get("epoch"), position.get("batches")
    if not isinstance(epoch, int) or not isinstance(batches, int) or epoch < 0 or batches < 0:
        return None
    world = position.get("world_size")
    return {"epoch": epoch, "batches": batches} | (
        {"world_size": world} if type(world) is int and world > 0 else {}
    )


def rescale(position: dict[str, int] | None, world_size: int) -> dict[str, int] | None:
    """The position of a checkpoint written by another number of ranks, in this run's batches.

    ``k`` batches on each of ``W`` ranks are the first ``k * W`` batches of the epoch's global
    order when the ranks split one permutation as Lightning's ``DistributedSampler`` does
    (``rank::W``; more than one rank in both runs): ``k * W / W'`` batches on each of ``W'``
    ranks, rounded down (the rest trained again). Any other split is not carried over exactly,
    so :func:`resume_in_epoch` warns when it skips by a rescaled count (``saved_world_size``
    and ``saved_batches`` are kept for it).

    Args:
        position: from :func:`saved_position` (after :func:`reopen`).
        world_size: this run's number of ranks.

    Returns:
        The position in this run's batches per rank.
    """
    if position is None or position.get("world_size", world_size) == world_size:
        return position
    saved, count = position["world_size"], position["batches"]
    return {
        "epoch": position["epoch"],
        "batches": count * saved // world_size,
        "world_size": world_size,
        "saved_world_size": saved,
        "saved_batches": count,
    }


def _rescaled_warning(position: dict[str, int]) -> str:
    saved, count = position["saved_world_size"], position["saved_batches"]
    batches, world = position["batches"], position["world_size"]
    return (
        f"The checkpoint was written {count} batches into epoch {position['epoch']} on {saved} "
        f"ranks; this run has {world}. It resumes after {batches} batches per rank "
        f"({batches * world} of the {count * saved} the {saved} ranks trained; "
        f"{count * saved - batches * world} trained again). That skips the same samples only "
        "where both runs split one permutation across more than one rank, as Lightning's "
        "DistributedSampler does."
    )


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """Sets ``epoch`` on every sampler of ``dataloader`` that has ``set_epoch``.

    Args:
        dataloader: a DataLoader (or anything with ``sampler``/``batch_sampler``).
        epoch: the epoch about to be iterated.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), batch_sampler):
        for s in (sampler, getattr(sampler, "sampler", None)):
            if callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)


def has_state_protocol(loader: Any) -> bool:
    """Whether Lightning saves and restores ``loader``'s own position.

    Args:
        loader: a training loader.

    Returns:
        True when it has ``state_dict()`` and ``load_state_dict()``.
    """
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def resume_in_epoch(loader: Any, position: dict[str, int], trainer: Any, warn: bool) -> bool:
    """Makes a training loader skip what the resumed checkpoint already trained on.

    Args:
        loader: the training loader, before its epoch's iterator is made.
        position: from :func:`saved_position`.
        trainer: the Trainer, its loops restored from the checkpoint.
        warn: whether to warn (once, on one rank) when ``loader`` will replay the epoch.

    Returns:
        True when the loader now skips the batches trained on.
    """
    count = position["batches"]
    if count == 0 or position["epoch"] != processed_epochs(trainer):
        return False  # saved at an epoch's end: the next epoch starts whole
    if has_state_protocol(loader):
        return False  # Lightning restores its own position
    if skip_batches(loader, count):
        drop_persistent_iterator(loader)  # a loader fitted before keeps its old sampler there
        log.info("resuming epoch %d after its first %d batches", position["epoch"], count)
        if "saved_world_size" in position:
            restart_epoch_at(trainer, count)  # the loop counts what the sampler skips
            if warn:
                warnings.warn(_rescaled_warning(position), UserWarning, stacklevel=2)
        return True
    if warn:
        warnings.warn(
            f"The checkpoint was written {count} batches into epoch {position['epoch']}, but "
            f"the training loader {type(loader).__name__} (dataset "
            f"{type(getattr(loader, 'dataset', None)).__name__}) is neither a map-style "
            "DataLoader whose sampler can skip them nor has state_dict()/load_state_dict(): "
            "the epoch replays from its start. Use lightning_torchrec.data.ResumableDataLoader "
            "or give the loader the state_dict protocol.",
            UserWarning,
            stacklevel=2,
        )
    return False
