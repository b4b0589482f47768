"""Uneven data across ranks: every rank must get as many batches, or the others wait forever.

Sharded tables run collectives in every step. Known batch counts are compared before a stage
starts (:func:`check_counts`); unknown ones batch by batch, with the "last batch" flag that rides
in the training step's vote (:func:`check_even`), and in a loop of the user's own with the flag
of a rank still evaluating (:func:`check_in_step`). Each raises the same named error on every rank.
"""

from __future__ import annotations

from lightning_torchrec.distributed import all_gather, rank_and_world_size
from lightning_torchrec.errors import UnevenDataError


def check_even(last_ranks: list[int], stage: str, batch_idx: int) -> None:
    """Raises when only some ranks are at their last batch (call with an agreed rank list).

    Args:
        last_ranks: the ranks at their last batch of the epoch (from :func:`agree`'s flags).
        stage: ``"training"``, ``"validation"``, ...
        batch_idx: the index of the batch all ranks are at.

    Raises:
        UnevenDataError: naming the ranks and their batch counts, the same on every rank.
    """
    if not last_ranks:  # the common case, decided without asking torch.distributed
        return
    _, world = rank_and_world_size()
    if len(last_ranks) == world:
        return
    others = [r for r in range(world) if r not in last_ranks]
    raise UnevenDataError(
        f"the ranks have different numbers of {stage} batches in this epoch: rank(s) "
        f"{last_ranks} have {batch_idx + 1}, rank(s) {others} have more. Every rank must get "
        "the same number of batches (sharded tables run collectives in every step): use "
        "Lightning's distributed sampler (use_distributed_sampler=True pads the last batches), "
        "split iterable datasets evenly per rank, or drop the remainder."
    )


def check_in_step(evaluating: list[int]) -> None:
    """Raises when only some ranks voted from an evaluation forward (call with an agreed list).

    In a loop of the user's own, an evaluation forward's vote has the training votes' layout
    (:meth:`~lightning_torchrec.training.step_guard.StepGuard.before_loop_eval`): a rank with
    more evaluation batches than the others meets their next training vote or their end of
    training there.

    Args:
        evaluating: the ranks that voted from an evaluation forward.

    Raises:
        UnevenDataError: naming the ranks, the same on every rank.
    """
    if not evaluating:
        return
    _, world = rank_and_world_size()
    if len(evaluating) == world:
        return
    others = [r for r in range(world) if r not in evaluating]
    raise UnevenDataError(
        f"rank(s) {evaluating} ran an evaluation forward while rank(s) {others} had ended their "
        "evaluation (at a training step, or at the end of training): the ranks have different "
        "numbers of evaluation batches. Give every rank as many evaluation batches (a "
        "distributed sampler pads them; drop the remainder of an iterable dataset)."
    )


def check_counts(count: float, stage: str) -> None:
    """Raises on every rank when the ranks' known batch counts differ. Collective.

    Sized dataloaders are compared this way before the first step; unknown counts (``inf``) are
    compared batch by batch in the step's collective.

    Args:
        count: this rank's number of batches (``inf`` when unknown).
        stage: ``"training"``, ``"validation"``, ``"test"`` or ``"predict"``.

    Raises:
        UnevenDataError: naming every rank's count, the same on every rank.
    """
    counts = all_gather(float(count))
    known = [c for c in counts if c != float("inf")]
    if len(set(known)) <= 1:
        return
    listed = ", ".join(f"rank {r}: {c:g}" for r, c in enumerate(counts))
    fix = (
        "make the number of predict batches a multiple of the number of ranks (pad the "
        "dataset), or predict on one device"
        if stage == "predict"
        else "use Lightning's distributed sampler (use_distributed_sampler=True pads the last "
        "batches), or give every rank as many batches"
    )
    raise UnevenDataError(
        f"the ranks have different numbers of {stage} batches ({listed}). Sharded tables run "
        f"collectives in every step, so the shorter ranks would leave the others waiting: {fix}."
    )
