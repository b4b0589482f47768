"""Mid-epoch resume of any training DataLoader: one position, saved, rescaled and skipped.

This is the package's one mid-epoch resume mechanism. ``TorchRecStrategy`` saves in every
checkpoint how far into its epoch the *training step* got (the fit loop's count of processed
batches, not what the loader or a pipeline read ahead), under :data:`POSITION_KEY`, rank 0's value
for every rank, with the layout the epoch's order depends on (world size, the loader's batch size
and readers per rank) and the epoch's length. On resume, before the resumed epoch's iterator
exists, :func:`resume_in_epoch` decides what to skip (:func:`rescale`: one rule for another world
or batch size, one warning) and hands it to the training loader:

- a loader whose batches split one global order of rows (``k`` batches of ``B`` rows on ``W``
  ranks are exactly the order's first ``k * W * B`` rows: the stream's
  :class:`~lightning_torchrec.data.stream.PartitionStreamLoader`) has the hooks
  ``rows_done(batches) -> int`` and ``resume_rows(rows) -> int``: the position saves the rows
  trained, and the resume starts at that row under any world or batch size, exactly;
- a loader with the resume hook ``resume_at(batches: int) -> None`` (the package's
  :class:`~lightning_torchrec.data.resumable.ResumableDataLoader`, or one's own) is called with it;
- a map-style ``DataLoader``'s index sampler leaves out those batches without loading them
  (:func:`~lightning_torchrec.data.mid_epoch.skip_batches`);
- a loader with ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``) is left
  to Lightning, which restores its own state;
- for the rest (an ``IterableDataset`` without either) one warning says that the epoch replays.

Lightning's loop counters must resume in the epoch the position belongs to; where Lightning would
resume them wrongly the checkpoint's loop state is rewritten first (:func:`reopen`, with
:mod:`lightning_torchrec.compat.lightning_loops`), and where the rescaled count differs from the
checkpoint's the restored counters are set to it (:func:`restart_epoch_at`). Checkpoints of older
versions are read by :func:`take_position`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning_torchrec.compat.lightning import epoch_running, processed_epochs
from lightning_torchrec.compat.lightning_loops import (
    pop_loader_states,
    reopen_cut_epoch,
    saved_epoch,
    start_next_epoch,
)
from lightning_torchrec.compat.upstream import drop_persistent_iterator
from lightning_torchrec.data.mid_epoch import skip_batches

log = logging.getLogger(__name__)

#: The checkpoint entry: ``{"epoch": e, "batches": k, "world_size": W}``, ``k`` batches of epoch
#: ``e`` trained on each of ``W`` ranks (0 when the epoch was complete), and when the training
#: loader tells them ``"layout"`` (``{"batch_size": B, ...}``, see :func:`loader_layout`),
#: ``"epoch_batches"`` (its length) and ``"rows"`` (the rows of the epoch's one global order
#: trained on: a loader with ``rows_done``).
POSITION_KEY = "lightning_torchrec_epoch_position"

#: What the resumable loaders of older versions saved through Lightning's ``state_dict`` protocol.
_LEGACY_LOADER_KEYS = frozenset({"start_batch", "epoch_batches", "layout"})


def trainer_position(trainer: Any) -> int:
    """Batches of the current epoch the trainer's training step has processed.

    Args:
        trainer: the Lightning Trainer.

    Returns:
        The count (what a checkpoint written now has trained on in this epoch).
    """
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def restart_epoch_at(trainer: Any, batches: int) -> None:
    """Makes a fit loop restored within an epoch count ``batches`` of it as trained.

    A run resumed from a checkpoint written under another layout skips another count of batches
    than the checkpoint's ranks trained (:func:`rescale`). Lightning restores its count of the
    epoch's batches (``k``) and ends the epoch when that count reaches ``num_training_batches``;
    left at ``k`` when the loader skipped fewer, it would stop before the loader's last
    batches, which no rank would ever train. Call it after the checkpoint's loop state is
    restored and before the epoch's loop starts.

    Args:
        trainer: the Lightning Trainer, its loops restored from the checkpoint.
        batches: the batches of the epoch this run's loader skips.
    """
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    # Saved at a batch's end, the last batch is processed but not completed: Lightning completes
    # it when the epoch's loop restarts. The same lag keeps that step right.
    behind = current.processed - current.completed
    current.ready = current.started = current.processed = batches
    current.completed = batches - behind


def loader_layout(loader: Any) -> dict[str, int]:
    """What the order of a training loader's epoch depends on besides the data and world size.

    Args:
        loader: the training loader (or a wrapper that forwards its attributes).

    Returns:
        Its ``resume_layout()`` when it has one (the package's loaders: ``readers_per_rank`` and
        ``batch_size``); else ``{"batch_size": B}`` for a loader batching ``B`` samples; else
        empty.
    """
    hook = getattr(loader, "resume_layout", None)
    if callable(hook):
        return {str(k): int(v) for k, v in hook().items()}
    size = getattr(loader, "batch_size", None)
    if size is None:  # a batch_sampler= of one's own, maybe wrapped by SkipBatches
        batches = getattr(loader, "batch_sampler", None)
        size = getattr(getattr(batches, "batches", batches), "batch_size", None)
    return {"batch_size": size} if type(size) is int and size > 0 else {}


def _epoch_batches(loader: Any) -> int | None:
    try:
        return int(len(loader))
    except (TypeError, NotImplementedError):
        return None


def epoch_position(trainer: Any) -> dict[str, Any] | None:
    """Where in its epoch the fit loop's training step is.

    Args:
        trainer: the Trainer, or None.

    Returns:
        ``{"epoch": e, "batches": k, "world_size": W}``: ``k`` batches of epoch ``e`` were
        trained on, 0 when none or all were, and the single training loader's ``layout``
        (:func:`loader_layout`) and ``epoch_batches``; None without a trainer. A fit stopped
        within epoch ``e`` (``max_steps``, ``should_stop``) has processed that epoch's end, but
        its ``k`` batches still belong to ``e``.
    """
    if trainer is None:
        return None
    batches = trainer_position(trainer)
    cut = 0 < batches < trainer.num_training_batches
    epoch = processed_epochs(trainer)
    if cut and not epoch_running(trainer):
        epoch -= 1  # the epoch was cut short, and Lightning ended it
    position: dict[str, Any] = {
        "epoch": epoch,
        "batches": batches if cut else 0,
        "world_size": trainer.world_size,
    }
    loader = trainer.train_dataloader
    if loader is None or isinstance(loader, (list, tuple, dict)):
        return position  # several loaders: the world size only
    layout, length = loader_layout(loader), _epoch_batches(loader)
    rows_done = getattr(loader, "rows_done", None)
    return (
        position
        | ({"layout": layout} if layout else {})
        | ({"epoch_batches": length} if length is not None else {})
        | ({"rows": int(rows_done(batches))} if cut and callable(rows_done) else {})
    )


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


def saved_position(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The position a loaded checkpoint holds, if it holds a well-formed one.

    Args:
        checkpoint: Lightning's checkpoint dict (as loaded).

    Returns:
        ``{"epoch": e, "batches": k}`` with its well-formed ``world_size``, ``layout`` and
        ``epoch_batches``, or None.
    """
    position = checkpoint.get(POSITION_KEY)
    if not isinstance(position, dict):
        return None
    epoch, batches = position.get("epoch"), position.get("batches")
    if not isinstance(epoch, int) or not isinstance(batches, int) or epoch < 0 or batches < 0:
        return None
    out: dict[str, Any] = {"epoch": epoch, "batches": batches}
    world, length = position.get("world_size"), position.get("epoch_batches")
    if type(world) is int and world > 0:
        out["world_size"] = world
    if type(length) is int and length >= 0:
        out["epoch_batches"] = length
    rows = position.get("rows")
    if type(rows) is int and rows >= 0:
        out["rows"] = rows
    layout = _well_formed_layout(position.get("layout"))
    return out | ({"layout": layout} if layout else {})


def _well_formed_layout(layout: Any) -> dict[str, int]:
    if not isinstance(layout, dict):
        return {}
    return {k: v for k, v in layout.items() if isinstance(k, str) and type(v) is int and v > 0}


def _legacy_loader_state(state: Any) -> bool:
    return (
        isinstance(state, dict)
        and type(state.get("start_batch")) is int
        and state.keys() <= _LEGACY_LOADER_KEYS
    )


def take_position(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's position, also from a checkpoint of an older version (rewritten in place).

    Older versions' :class:`~lightning_torchrec.data.resumable.ResumableDataLoader` kept its own
    count through Lightning's ``state_dict`` protocol (``{"start_batch": k, "epoch_batches": n,
    "layout": {...}}`` in the fit loop's loader states). Such a state is removed from the
    checkpoint (today's loader has no ``state_dict()``; Lightning would refuse a state without
    its loader) and read into the position: its layout and length complete a saved position, and
    without one (a checkpoint older than the position) its count becomes the position in the
    epoch the fit loop was in. Either way the resume is the same exact one as before.

    Args:
        checkpoint: Lightning's checkpoint dict (as loaded), rewritten in place.

    Returns:
        The position (see :func:`saved_position`), or None.
    """
    position = saved_position(checkpoint)
    legacy = pop_loader_states(checkpoint, _legacy_loader_state)
    if not legacy:
        return position
    state = legacy[0]
    layout = _well_formed_layout(state.get("layout"))
    world = layout.pop("world_size", None)
    length = state.get("epoch_batches")
    if position is None:
        epoch = saved_epoch(checkpoint)
        if epoch is None:
            return None
        count = state["start_batch"]
        within = 0 < count and (type(length) is not int or count < length)
        position = {"epoch": epoch, "batches": count if within else 0}
        if world is not None:
            position["world_size"] = world
    extra: dict[str, Any] = {"layout": layout} if layout else {}
    if type(length) is int and length >= 0:
        extra["epoch_batches"] = length
    return extra | position


def rescale(
    position: dict[str, Any] | None, world_size: int, layout: dict[str, int] | None = None
) -> dict[str, Any] | None:
    """The position of a checkpoint written under another layout, in this run's batches.

    The one rule for another world size, batch size or readers per rank: ``k`` batches of ``B``
    samples on each of ``W`` ranks are the first ``k * W * B`` samples of the epoch's global
    order when the ranks split one order as Lightning's ``DistributedSampler`` does (``rank::W``;
    more than one rank in both runs): ``k * W * B / (W' * B')`` batches on each of ``W'`` ranks,
    rounded down (the rest trained again); without a batch size on both sides, ``k * W / W'``.
    Any other split (the package's file readers, whose order depends on the layout) is not
    carried over exactly, so :func:`resume_in_epoch` warns when the layout changed
    (``saved_batches`` and ``changed`` are kept for it).

    Args:
        position: from :func:`take_position` (after :func:`reopen`).
        world_size: this run's number of ranks.
        layout: this run's training loader's :func:`loader_layout`.

    Returns:
        The position in this run's batches per rank (``position`` itself when nothing that both
        sides know changed).
    """
    if position is None:
        return None
    saved = {"world_size": position.get("world_size", world_size)} | position.get("layout", {})
    now = {"world_size": world_size} | (layout or {})
    changed = {
        k: (saved[k], now[k]) for k in sorted(saved.keys() & now.keys()) if saved[k] != now[k]
    }
    if not changed:
        return position
    sized = "batch_size" in saved and "batch_size" in now
    per_step = [x["world_size"] * (x["batch_size"] if sized else 1) for x in (saved, now)]
    count = position["batches"]
    return position | {
        "batches": count * per_step[0] // per_step[1],
        "world_size": world_size,
        "layout": dict(layout or {}),
        "saved_batches": count,
        "changed": changed,
        "per_step": per_step,
        "unit": "samples" if sized else "batches",
    }


def _rescaled_warning(position: dict[str, Any], loader: Any) -> str:
    count, batches = position["saved_batches"], position["batches"]
    (saved_step, step), unit = position["per_step"], position["unit"]
    changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in position["changed"].items())
    return (
        f"The checkpoint was written {count} batches into epoch {position['epoch']} under "
        f"another layout than this run's ({changes}). The training loader "
        f"{type(loader).__name__} resumes after {batches} batches per rank ({batches * step} of "
        f"the {count * saved_step} {unit} trained; {count * saved_step - batches * step} trained "
        "again). That skips the same samples only where both runs split one order across more "
        "than one rank, as Lightning's DistributedSampler does; the package's file readers read "
        "in another order under another layout, so some of the epoch may be trained twice, some "
        "not at all. Resume with the checkpoint's ranks, DataLoader workers and batch size, or "
        "from a checkpoint written at an epoch's end, for an exact resume."
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


def rows_trained(position: dict[str, Any]) -> int | None:
    """The rows of the epoch's one global order a position trained on.

    For a loader whose batches split one global order of rows (``resume_rows``): ``k`` batches
    of ``B`` rows on ``W`` ranks are its first ``k * W * B`` rows. The saved ``rows`` when the
    loader told them (a run resumed off a batch boundary of its own layout), else that product.

    Args:
        position: from :func:`take_position` (after :func:`reopen`).

    Returns:
        The rows, or None without a batch size or world size in the position.
    """
    if "rows" in position:
        return int(position["rows"])
    size, world = position.get("layout", {}).get("batch_size"), position.get("world_size")
    if size is None or world is None:
        return None
    return int(position["batches"]) * int(world) * int(size)


def resume_in_epoch(loader: Any, position: dict[str, Any], trainer: Any, warn: bool) -> bool:
    """Makes a training loader skip what the resumed checkpoint already trained on.

    The one place that decides what a resumed epoch skips (see the module's docstring).

    Args:
        loader: the training loader, before its epoch's iterator is made.
        position: from :func:`take_position` (after :func:`reopen`), in the checkpoint's layout.
        trainer: the Trainer, its loops restored from the checkpoint.
        warn: whether to warn (once, on one rank) about a rescaled position, an epoch of
            another length, or a loader that will replay the epoch.

    Returns:
        True when the loader now skips the batches trained on.
    """
    if position["batches"] == 0 or position["epoch"] != processed_epochs(trainer):
        return False  # saved at an epoch's end: the next epoch starts whole
    if has_state_protocol(loader):
        return False  # Lightning restores its own position
    rows = rows_trained(position)
    resume_rows = getattr(loader, "resume_rows", None)
    if callable(resume_rows) and rows is not None:  # one global order: exact under any layout
        count = int(resume_rows(rows))
        log.info("resuming epoch %d after its first %d rows", position["epoch"], rows)
        if count != position["batches"]:
            restart_epoch_at(trainer, count)  # the loop counts what the loader skips
        return True
    here = rescale(position, trainer.world_size, loader_layout(loader))
    assert here is not None
    count = here["batches"]
    hook = getattr(loader, "resume_at", None)
    if callable(hook):
        hook(count)
    elif skip_batches(loader, count):
        drop_persistent_iterator(loader)  # a loader fitted before keeps its old sampler there
    else:
        if warn:
            warnings.warn(
                f"The checkpoint was written {count} batches into epoch {position['epoch']}, but "
                f"the training loader {type(loader).__name__} (dataset "
                f"{type(getattr(loader, 'dataset', None)).__name__}) is neither a map-style "
                "DataLoader whose sampler can skip them nor has a resume hook (resume_at) or "
                "state_dict()/load_state_dict(): the epoch replays from its start. Use "
                "lightning_torchrec.data.ResumableDataLoader or give the loader "
                "resume_at(batches).",
                UserWarning,
                stacklevel=2,
            )
        return False
    log.info("resuming epoch %d after its first %d batches", position["epoch"], count)
    if "saved_batches" in here:
        restart_epoch_at(trainer, count)  # the loop counts what the loader skips
        if warn:
            warnings.warn(_rescaled_warning(here, loader), UserWarning, stacklevel=2)
    elif (
        warn
        and (length := _epoch_batches(loader)) is not None
        and position.get("epoch_batches", length) != length
    ):
        warnings.warn(
            f"The checkpoint was written {count} batches into epoch {position['epoch']} of "
            f"{position['epoch_batches']} batches, but the training loader "
            f"{type(loader).__name__} now gives {length} batches per epoch (data added, "
            "removed or rewritten since the checkpoint): the batches it skips are not those "
            "trained on (some of the epoch may be trained twice, some not at all). Resume with "
            "the same data, or from a checkpoint written at an epoch's end, for an exact resume.",
            UserWarning,
            stacklevel=2,
        )
    return True
