"""A training step's checks, decided in one collective on every rank.

Bad batches, non-finite losses, uneven data and stop requests raise the same named error on
every rank (:func:`lightning_torchrec.distributed.agree`).

* :class:`StepGuard` (used by ``TorchRecStrategy``): one ``all_reduce`` per training step carries
  the batch verdict and the previous step's loss verdict; a NaN/inf loss on any rank raises
  :class:`~lightning_torchrec.errors.NonFiniteLossError` on every rank at the next vote, naming
  the step and the ranks. (Skipping the step instead is not offered: Lightning refuses a
  ``None`` loss in distributed training, and a zero loss would still move momentum-based
  optimizers.) The vote may run ahead (:meth:`StepGuard.vote_ahead`): started during a step and
  decided after it, it covers the next step's batch while the backward runs.

The vote also carries each rank's "no batch after this one": ranks whose batch counts differ
would otherwise wait forever in the next step's collectives. Known counts are compared before a
stage starts (:func:`check_counts`); unknown ones batch by batch (:func:`check_even`), and in a
loop of the user's own with the flag of a rank still evaluating (:func:`check_in_step`). A loss of
any shape is judged by one number picked on its device (:func:`loss_to_judge`), read a step later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_torchrec.distributed import (
    all_gather,
    collective_device,
    launch_agree,
    rank_and_world_size,
)
from lightning_torchrec.errors import BatchValidationError, NonFiniteLossError, UnevenDataError
from lightning_torchrec.sharding.features import FeatureSpec
from lightning_torchrec.training.batch_checks import (
    UNCHECKED,
    VERDICT_ATTRIBUTE,
    check_batch,
    worker_verdict,
)
from lightning_torchrec.training.device_checks import DeferredVerdict, HostCopy


def loss_to_judge(loss: torch.Tensor) -> torch.Tensor:
    """The one number that judges a loss of any shape, picked on its device (no host read).

    The first non-finite element, else the first element (0 for an empty loss): the loss is
    finite exactly when that number is.

    Args:
        loss: the step's loss (a scalar, or any shape under manual optimization).

    Returns:
        A float32 tensor of one element on the loss's device.
    """
    flat = loss.reshape(-1).float()
    if flat.numel() < 2:  # a scalar (the usual loss) is its own number; nothing to pick
        return flat if flat.numel() else flat.new_zeros(1)
    first_bad = torch.argmin(torch.isfinite(flat).to(torch.int8)).reshape(1)
    return flat.index_select(0, first_bad)


def nonfinite_loss_error(pending: tuple[int, torch.Tensor] | None) -> NonFiniteLossError | None:
    """The error for a recorded loss that is not finite.

    Args:
        pending: ``(global step, loss)`` as recorded: the loss's one judged number
            (:func:`loss_to_judge`), on the host; or None.

    Returns:
        The error naming the step, this rank and the value; None for a finite loss or none.
    """
    if pending is None:
        return None
    step, value = pending
    found = value.item()  # one host read of the copy, made a step ago
    if math.isfinite(found):
        return None
    rank, _ = rank_and_world_size()
    return NonFiniteLossError(
        f"non-finite training loss at global step {step} on rank(s) [{rank}] (this rank: "
        f"{found}). That step's update was applied, so the in-memory "
        "weights may be non-finite; checkpoints refuse non-finite values and the last one is "
        "intact. Check the batch (NaN features, extreme labels/weights) and lower the "
        "learning rate."
    )


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


class StepGuard:
    """The per-step checks of a training step, decided in ONE collective.

    Before the forward of step ``t`` every rank votes once
    (:func:`~lightning_torchrec.distributed.agree`) on its batch of step ``t`` and its loss of
    step ``t - 1``. The batch check must precede the forward (a bad id can fail on one rank
    mid-collective while the others wait); the loss verdict rides along one step late, at no
    collective of its own, so a NaN/inf loss stops the run at the next step (or at
    :meth:`flush`) with its update applied: in-memory weights may be non-finite, but
    checkpoints refuse them.

    Args:
        on_nonfinite_loss: ``"raise"`` or ``"ignore"``.
        device: the collective's device (CPU for gloo, CUDA for nccl).
        validate_batches: True checks every batch, an int ``N`` the first ``N`` steps, False none.
        specs: what each sparse feature may hold (from the unsharded model).
        dense_width: the expected dense width, or None.
        group: the process group the votes run on (a gloo group keeps them on the host).
        token: the token of verdicts that DataLoader workers attached to batches
            (:mod:`~lightning_torchrec.training.worker_checks`); None: always check here.
        deferred: check a training batch that no worker checked on its device and judge it at
            the next step (:mod:`~lightning_torchrec.training.device_checks`), instead of
            reading its ids on the host before the forward.
    """

    def __init__(
        self,
        on_nonfinite_loss: str,
        device: torch.device | None = None,
        validate_batches: bool | int = True,
        specs: Mapping[str, FeatureSpec] | None = None,
        dense_width: int | None = None,
        group: Any = None,
        token: str | None = None,
        deferred: bool = False,
    ) -> None:
        #: Whether each training step's vote carries a stop request (set by a front end).
        self.carries_stop = False
        self.on_nonfinite_loss = on_nonfinite_loss
        self.device = device
        self.validate_batches = validate_batches
        self.specs: Mapping[str, FeatureSpec] = specs or {}
        self.dense_width = dense_width
        self.group = group
        # Where the default group is a gloo one, the votes ahead run on it (see StepRunner).
        on_default = group is not None and collective_device().type == "cpu"
        self._ahead_on = (None, torch.device("cpu")) if on_default else (group, device)
        self.token = token
        self.deferred = DeferredVerdict(self.specs, dense_width) if deferred else None
        self._pending: tuple[int, torch.Tensor] | None = None
        self._loss_copy = HostCopy(1, torch.float32)
        self._ahead: tuple[Callable[[], list[list[int]]], int] | None = None
        self._decided: Any = None

    def checks(self, index: int) -> bool:
        """Whether ``validate_batches`` checks the batch of step (or evaluation batch) ``index``.

        Args:
            index: the global step, or the batch's index in an evaluation.

        Returns:
            True for every index with ``True``, the first ``N`` with ``N``, none with ``False``.
        """
        return self.validate_batches is True or index < self.validate_batches

    def _check(self, batch: Any, where: str) -> Exception | None:
        problem = UNCHECKED if self.token is None else worker_verdict(batch, self.token)
        if problem is UNCHECKED:
            return check_batch(batch, self.specs, self.dense_width, where)
        return None if problem is None else BatchValidationError(f"{where}: {problem}")

    def verdict_of(
        self, batch: Any, step: int, ahead: list[tuple[int, Any]] | None = None
    ) -> Exception | None:
        """This rank's verdict on the batch of global step ``step`` (None: fine or unchecked).

        Args:
            batch: the host batch.
            step: its global step.
            ahead: with a train pipeline, the batches its ``progress()`` at that step sends.

        Returns:
            The validation error, or None.
        """
        return self._verdict(batch, f"step {step}", ahead) if self.checks(step) else None

    def _verdict(
        self, batch: Any, where: str, ahead: list[tuple[int, Any]] | None = None
    ) -> Exception | None:
        if ahead is None:
            return self._check(batch, f"rank {rank_and_world_size()[0]}, {where}")
        rank, _ = rank_and_world_size()
        for index, early in ahead:
            found = self._check(
                early,
                f"rank {rank}, batch {index} of the epoch (checked at {where}, before the "
                "pipeline sends it ahead)",
            )
            if found is not None:
                return found
        return None

    def before_training_step(
        self,
        batch: Any,
        step: int,
        batch_idx: int,
        last: bool,
        ahead: list[tuple[int, Any]] | None = None,
        device_batch: Any = None,
        stop: bool = False,
    ) -> list[int]:
        """The training step's checks, in one collective (see :meth:`check`).

        Args:
            batch: this rank's batch (the host copy).
            step: the global step.
            batch_idx: the batch's index in the epoch.
            last: whether this rank has no batch after this one in the epoch.
            ahead: with a train pipeline, the batches to check instead of ``batch``: those its
                next ``progress()`` sends before their own step (``(index, batch)`` pairs).
            device_batch: the batch on the device, for a ``deferred`` guard.
            stop: whether this rank asks every rank to stop before this step (e.g. it received
                SIGTERM); decided in the same collective when :attr:`carries_stop` is set.

        Returns:
            The ranks that asked to stop (the same on every rank; empty when none did).
        """
        checked = self.checks(step)
        had, earlier = self._take_deferred()
        verdict = None
        if checked:
            rank, deferred = rank_and_world_size()[0], self.deferred
            if deferred is None or ahead is not None or device_batch is None:
                verdict = self._verdict(batch, f"step {step}", ahead)
            elif self._worker_problem(batch) is UNCHECKED:
                deferred.submit(device_batch, f"rank {rank}, step {step}")
            else:  # a worker checked it: judged now; the same pending state on every rank
                verdict = self._verdict(batch, f"step {step}")
                deferred.submit_known()
        voting = checked or had or self.carries_stop
        return self.check(earlier or verdict, voting, last, batch_idx, stop and self.carries_stop)

    def _worker_problem(self, batch: Any) -> Any:
        attributes = getattr(batch, "__dict__", None) if self.token is not None else None
        entry = attributes.get(VERDICT_ATTRIBUTE) if isinstance(attributes, dict) else None
        return UNCHECKED if entry is None or entry[0] != self.token else entry[1]

    def _take_deferred(self) -> tuple[bool, Exception | None]:
        """Whether a deferred verdict was pending (the same on every rank), and the verdict."""
        if self.deferred is None or not self.deferred.pending:
            return False, None
        return True, self.deferred.verdict()

    def settle(self, loss: bool = False, ended: int | None = None) -> None:
        """Judges a pending deferred batch verdict (and with ``loss``, the last loss). Collective.

        Call on every rank before a checkpoint is written: a bad batch of the last step then
        stops the run before its effect reaches the checkpoint (a non-finite loss's effect is
        refused by the checkpoint itself, and judged at the next step as before).

        Args:
            loss: judge the last step's loss too (at the end of training).
            ended: this rank's loop ended after that many steps: it votes "no batch left", so a
                rank still training meets the vote and every rank raises ``UnevenDataError``.
        """
        had, earlier = self._take_deferred()
        pending, self._pending = self._pending, None
        if loss:
            self._pending = pending
        try:
            last = ended is not None
            self.check(earlier, had or last, last, (ended or 1) - 1)
        finally:
            if not loss:
                self._pending = pending

    def before_eval_step(
        self,
        batch: Any,
        stage: str,
        batch_idx: int,
        last: bool,
        ahead: list[tuple[int, Any]] | None = None,
    ) -> None:
        """An evaluation or predict step's batch check and batch-count vote. Collective.

        Args:
            batch: this rank's batch.
            stage: ``"validation"``, ``"test"`` or ``"predict"``.
            batch_idx: the batch's index.
            last: whether this rank has no batch after this one.
            ahead: with a pipeline, the batches to check instead of ``batch`` (see
                :meth:`before_training_step`).

        Raises:
            BatchValidationError: on every rank when any rank's batch is bad.
            UnevenDataError: on every rank when only some ranks are at their last batch.
        """
        self.decide_ahead()  # a stop request it carries is made again at the next step
        if (checked := self.checks(batch_idx)) or self._mode == "raise":  # any check: a vote
            verdict = self._verdict(batch, f"{stage} batch {batch_idx}", ahead) if checked else None
            (ranks,) = self._agree(verdict, flags=[last])
            check_even(ranks, stage, batch_idx)

    @property
    def on_nonfinite_loss(self) -> str:
        """``"raise"`` or ``"ignore"`` (settable; anything else raises ``ValueError``)."""
        return self._mode

    @on_nonfinite_loss.setter
    def on_nonfinite_loss(self, mode: str) -> None:
        if mode not in ("raise", "ignore"):
            raise ValueError(f"on_nonfinite_loss must be 'raise' or 'ignore', got {mode!r}")
        self._mode = mode

    def record_loss(self, output: Any, step: int) -> None:
        """Remembers this step's loss, to be judged at the next check (no GPU-to-host sync).

        Args:
            output: what ``training_step`` returned (a loss or a mapping with ``"loss"``).
            step: the global step of that loss.
        """
        if self._mode != "raise":
            return
        loss = output.get("loss") if isinstance(output, Mapping) else output
        value = loss.detach() if isinstance(loss, torch.Tensor) else torch.zeros(1)
        # The one number judged, copied to the host without waiting; read a step later, no stall.
        self._pending = (step, self._loss_copy.start(loss_to_judge(value)))

    def check(
        self,
        batch_error: Exception | None,
        batch_checked: bool,
        last_batch: bool = False,
        batch_idx: int = 0,
        stop: bool = False,
    ) -> list[int]:
        """Raises on every rank if any rank's batch or previous loss was bad. Collective.

        Whether this is the rank's last batch of the epoch rides along in the same collective:
        ranks that disagree have different numbers of batches, and would otherwise hang in the
        next step's collectives. So does a request to stop.

        Args:
            batch_error: this rank's validation error for the coming step, or None.
            batch_checked: whether batches are validated at this step (the same on every rank).
            last_batch: whether this rank has no batch after this one in the epoch.
            batch_idx: the batch's index in the epoch, for the message.
            stop: whether this rank asks every rank to stop.

        Returns:
            The ranks that asked to stop (empty when no vote ran).

        Raises:
            BatchValidationError: on every rank when any rank's batch is bad (the failing rank
                raises its own error; the others name it).
            NonFiniteLossError: on every rank when any rank's previous loss was NaN/inf.
            UnevenDataError: on every rank when only some ranks are at their last batch.
        """
        if not batch_checked and self._pending is None:
            return []
        error = self._loss_error()
        last, stopping, evaluating = self._agree(
            batch_error, error, flags=[last_batch, stop, False]
        )
        check_in_step(evaluating)
        check_even(last, "training", batch_idx)
        return stopping

    def before_loop_eval(self, batch: Any, where: str, index: int, last: bool = False) -> None:
        """An evaluation forward's checks in a loop of the user's own (Fabric). Collective.

        The vote has the training votes' layout and says that this rank is evaluating, so a rank
        with an evaluation batch more than the others meets their next training vote (or
        :meth:`flush`) and every rank raises ``UnevenDataError`` instead of hanging. It judges
        the last training step's loss and a deferred batch verdict too (before any metric of
        this evaluation is read).

        Args:
            batch: this rank's batch (checked unless ``validate_batches`` leaves out ``index``).
            where: where the batch is, for the message (``"evaluation forward 2 after step 6"``).
            index: the forward's index in this evaluation (``validate_batches=N``: the first N).
            last: whether this rank has no evaluation batch after this one (ranks that disagree
                raise ``UnevenDataError``).

        Raises:
            BatchValidationError: on every rank when any rank's batch is bad.
            NonFiniteLossError: on every rank when any rank's last training loss was NaN/inf.
            UnevenDataError: on every rank when only some ranks are evaluating, or at their
                last batch.
        """
        _, earlier = self._take_deferred()
        verdict = self._verdict(batch, where) if self.checks(index) else None
        error = self._loss_error()
        last_ranks, _, evaluating = self._agree(
            earlier or verdict, error, flags=[last, False, True]
        )
        check_in_step(evaluating)
        check_even(last_ranks, "evaluation", index)

    def _agree(self, *errors: Exception | None, flags: list[bool]) -> list[list[int]]:
        self._decided = launch_agree(  # agree(), its votes held as in decide_ahead
            *errors, flags=flags, device=self.device, group=self.group, later=False
        )
        return self._decided()

    def vote_ahead(
        self, next_error: Exception | None, batch_idx: int, last: bool, stop: bool = False
    ) -> None:
        """Starts the next step's vote now, to be decided after this step (:meth:`decide_ahead`).

        It carries what :meth:`check` would decide before the next forward (the next batch's
        verdict, the loss recorded last, "no batch after this one", a stop request) and runs while
        this step's backward and update do. Other votes may run meanwhile (gloo keeps their
        order); a checkpoint of this step can be written before it is decided.

        Args:
            next_error: this rank's verdict on its next batch (None: fine, unchecked or none).
            batch_idx: this step's batch index in the epoch.
            last: whether this rank has no batch after this one in the epoch.
            stop: whether this rank asks every rank to stop (when :attr:`carries_stop`).
        """
        self.decide_ahead()
        flags = [last, stop and self.carries_stop, False]  # the layout of check()'s vote
        error = self._loss_error()
        group, device = self._ahead_on
        decide = launch_agree(next_error, error, flags=flags, device=device, group=group)
        self._ahead = (decide, batch_idx)

    def _loss_error(self) -> NonFiniteLossError | None:
        """Takes the recorded loss and judges it (its copy finished long ago: no stall)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._loss_copy.wait()
        return nonfinite_loss_error(pending)

    def decide_ahead(self) -> list[int] | None:
        """Decides the vote :meth:`vote_ahead` started, if one is running. Collective.

        Returns:
            The ranks that asked to stop; None when no vote was running.

        Raises:
            BatchValidationError: or another error of :meth:`check`, on every rank.
        """
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        # Held until the next vote (so are _agree's): gloo's thread never frees them: cpython#112275
        decide, batch_idx = self._decided = ahead
        last, stopping, evaluating = decide()
        check_in_step(evaluating)
        check_even(last, "training", batch_idx)
        return stopping

    def release(self) -> None:
        """Lets go of the votes' process group and the last vote's handles (at the run's end).

        A destroyed group's gloo threads stop only when nothing references the group any more;
        a guard kept by a live Trainer (its strategy's last run) would keep them running.
        """
        self.group, self._ahead, self._decided = None, None, None
        self._ahead_on = (None, self._ahead_on[1])

    def flush(self, ended: int | None = None) -> None:
        """The last step's loss and batch judged at training's end, on every rank (see settle)."""
        self.settle(loss=True, ended=ended)
