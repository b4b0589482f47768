"""Lightning's loop state in a checkpoint, rewritten where Lightning would resume it wrongly.

Lightning (2.x) saves its fit loop's progress counters (``loops.fit_loop``: the epoch's, the
batches') and decides on resume where to continue from them. Two states it resumes wrongly are
rewritten here into states it resumes right; both read and write its private layout. They are
part of the package's one mid-epoch resume (:mod:`lightning_torchrec.lightning.mid_epoch`): the
position it saves is counted in Lightning's batch counters, which must then resume in the epoch
the position belongs to. The same layout holds the loader states Lightning saved for loaders with
``state_dict()`` (:func:`pop_loader_states`: how checkpoints of older versions, whose own loaders
had one, are read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["pop_loader_states", "reopen_cut_epoch", "saved_epoch", "start_next_epoch"]

_PARTS = ("total", "current")
_COUNTS = ("ready", "started", "processed", "completed")


def reopen_cut_epoch(checkpoint: dict[str, Any]) -> int | None:
    """Turns the loop state of an epoch cut short into Lightning's own mid-epoch state.

    A fit stopped within an epoch (``max_steps``, ``should_stop``) ends that epoch as though it
    were over (lightning 2.x: its end processed, and completed), so a checkpoint saved then
    (``trainer.save_checkpoint`` after ``fit``, or in an epoch-end hook) resumes at the next
    epoch, and the rest of the cut one is never trained. Here the checkpoint's
    ``loops.fit_loop`` is rewritten to what Lightning saves after the same training batch
    *within* the epoch (at ``on_train_batch_end``): the epoch's end not processed, the last
    batch processed but not completed, ``_batches_that_stepped`` one short (Lightning adds it
    back on restart). Lightning does not step epoch-interval schedulers at a cut epoch's end,
    so nothing else changed. The caller makes the loader skip the batches trained on.

    Args:
        checkpoint: Lightning's checkpoint dict, saved after at least one batch of the epoch.

    Returns:
        The epoch reopened, or None when the loop state is not an ended epoch's (a checkpoint
        saved within an epoch, or one of another layout, is left as it is).
    """
    parts = ("total", "current")
    try:
        fit = checkpoint["loops"]["fit_loop"]
        epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
        state = fit["epoch_loop.state_dict"]
        epoch = {
            p: {k: int(epochs[p][k]) for k in ("started", "processed", "completed")} for p in parts
        }
        batch = {p: {k: int(batches[p][k]) for k in ("processed", "completed")} for p in parts}
        stepped, last = int(state["_batches_that_stepped"]), bool(batches["is_last_batch"])
    except (KeyError, TypeError, ValueError):
        return None
    if last or not all(epoch[p]["started"] == epoch[p]["processed"] >= 1 for p in parts):
        return None
    for p in parts:
        epochs[p]["processed"] = epoch[p]["processed"] - 1
        epochs[p]["completed"] = min(epoch[p]["completed"], epoch[p]["processed"] - 1)
        if batch[p]["completed"] == batch[p]["processed"] >= 1:
            batches[p]["completed"] = batch[p]["completed"] - 1
    state["_batches_that_stepped"] = max(0, stepped - 1)
    checkpoint["epoch"] = epochs["current"]["completed"]
    return epoch["current"]["processed"] - 1


def start_next_epoch(checkpoint: dict[str, Any]) -> int | None:
    """Turns the loop state of an epoch saved at its end into the next epoch's start.

    Saved at an epoch's end (all its batches trained: ``on_train_epoch_end``, or after a fit
    that ran to the epoch's end), a checkpoint resumes by "restarting" that epoch whenever the
    fit is bounded by ``max_steps`` (Lightning 2.x restarts every iteration-based fit). Lightning
    then waits for the epoch's validation before it ends it; without validation (no
    ``val_dataloader``, ``limit_val_batches=0``) it trains one more batch, from a new iterator,
    as a batch of the ended epoch: the first batch of the data trained twice, and every later
    step one batch behind the uninterrupted run. Here ``loops.fit_loop`` becomes what Lightning
    saves as the next epoch starts (its ``on_train_epoch_start``: the epoch ready, not started;
    no batch of it yet), which it resumes by starting that epoch.

    Args:
        checkpoint: Lightning's checkpoint dict, rewritten in place.

    Returns:
        The epoch that starts, or None when the loop state is not an ended epoch's (a checkpoint
        saved within an epoch, or one of another layout, is left as it is).
    """
    try:
        fit = checkpoint["loops"]["fit_loop"]
        epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
        epoch = {p: {k: int(epochs[p][k]) for k in _COUNTS} for p in _PARTS}
        current = {k: int(batches["current"][k]) for k in _COUNTS}
        last = bool(batches["is_last_batch"])
    except (KeyError, TypeError, ValueError):
        return None
    ended = all(
        e["ready"] == e["started"] == e["processed"] >= 1
        and e["completed"] in (e["processed"] - 1, e["processed"])
        for e in epoch.values()
    )
    if not (ended and last and len(set(current.values())) == 1 and current["ready"] >= 1):
        return None  # a cut epoch (not its last batch) is reopen_cut_epoch's
    for p in _PARTS:
        done = epoch[p]["processed"]
        epochs[p].update(ready=done + 1, started=done, processed=done, completed=done)
    batches["current"].update(dict.fromkeys(_COUNTS, 0))
    batches["is_last_batch"] = False
    checkpoint["epoch"] = epoch["current"]["processed"]
    return epoch["current"]["processed"]


def pop_loader_states(
    checkpoint: dict[str, Any], taken: Callable[[Any], bool]
) -> list[dict[str, Any]]:
    """Removes the training loaders' saved states that ``taken`` accepts, in place.

    Lightning (2.x) saves the state of every training loader with ``state_dict()`` and
    ``load_state_dict()`` in ``loops.fit_loop.state_dict.combined_loader`` and, on resume, hands
    them in order to the loaders that have the protocol (an error when the counts differ). A
    state removed here is never handed to a loader; the others stay, in their order.

    Args:
        checkpoint: Lightning's checkpoint dict, rewritten in place.
        taken: whether a state is one to remove.

    Returns:
        The removed states, in their order (none for another layout).
    """
    try:
        state = checkpoint["loops"]["fit_loop"]["state_dict"]
        states = state["combined_loader"]
    except (KeyError, TypeError):
        return []
    if not isinstance(states, list):
        return []
    removed = [s for s in states if taken(s)]
    if removed:
        kept = [s for s in states if not taken(s)]
        if kept:
            state["combined_loader"] = kept
        else:
            del state["combined_loader"]
    return removed


def saved_epoch(checkpoint: dict[str, Any]) -> int | None:
    """The epochs the checkpoint's fit loop had processed (the one it was in, within an epoch).

    Args:
        checkpoint: Lightning's checkpoint dict.

    Returns:
        ``loops.fit_loop.epoch_progress.current.processed``, or None for another layout.
    """
    try:
        return int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):
        return None
