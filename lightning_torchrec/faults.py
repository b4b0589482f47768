"""Training faults: non-finite losses, non-finite checkpoints, dead peers and preemption.

Every decision here is collective: a rank that finds a problem tells the others through one
small ``all_reduce`` before anyone enters a collective the failing rank would skip, so all
ranks raise (or skip, or save) together instead of waiting for the collective timeout.

* :class:`StepGuard` (used by ``TorchRecStrategy``): one ``all_reduce`` per training step carries
  this step's batch-validation verdict and the previous step's loss verdict; a NaN/inf loss on
  any rank raises :class:`NonFiniteLossError` on every rank at the next step, naming the step
  and the ranks. (Skipping the step instead is not offered: Lightning refuses a ``None`` loss in
  distributed training, and a zero loss would still move momentum-based optimizers.)
* :class:`FiniteCheckpointGuard` (added by ``TorchRecStrategy(check_finite_checkpoints=True)``):
  refuses to save a checkpoint holding a non-finite weight, naming the tensor; the previous
  checkpoint stays intact.
* :func:`peer_failure` turns a collective that failed because a peer died (gloo: "Connection
  closed by peer") or timed out into a :class:`PeerFailureError` saying so.
* :class:`PreemptionCheckpoint`: SIGTERM on any rank saves a complete sharded checkpoint at the
  next batch end on every rank, then exits; resume with ``trainer.fit(..., ckpt_path=path)``.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class NonFiniteLossError(FloatingPointError):
    """The training loss was NaN or infinite on some rank."""


class NonFiniteCheckpointError(ValueError):
    """A checkpoint would have stored a NaN or infinite weight."""


class PeerFailureError(RuntimeError):
    """A collective failed because another rank died or stopped answering."""


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint was written."""


def failing_ranks(failed: bool, device: torch.device | None = None) -> list[int]:
    """Which ranks report ``failed=True`` (one ``all_reduce`` of ``world_size`` integers).

    Args:
        failed: this rank's verdict.
        device: where the flag vector lives (CPU for gloo, CUDA for nccl).

    Returns:
        The failing ranks, the same list on every rank; ``[0]``/``[]`` without a process group.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [0] if failed else []
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[dist.get_rank()] = int(failed)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


class StepGuard:
    """The per-step checks of a training step, decided in ONE collective.

    Before the forward of step ``t`` every rank contributes, in one ``all_reduce``, whether its
    batch of step ``t`` failed validation and whether its loss of step ``t - 1`` was non-finite.
    The batch check must precede the forward (a bad id can fail on one rank mid-collective while
    the others wait); the loss verdict rides along one step late, so it costs no collective and
    no device sync of its own. A non-finite loss therefore stops the run at the next step (or at
    the end of training, :meth:`flush`): that step's update has been applied, so in-memory
    weights may be non-finite, but :class:`FiniteCheckpointGuard` keeps them out of checkpoints.

    Args:
        on_nonfinite_loss: ``"raise"`` or ``"ignore"``.
        device: the collective's device (CPU for gloo, CUDA for nccl).
    """

    def __init__(self, on_nonfinite_loss: str, device: torch.device | None = None) -> None:
        self.on_nonfinite_loss = on_nonfinite_loss
        self.device = device
        self._pending: tuple[int, torch.Tensor] | None = None

    def record_loss(self, output: Any, step: int) -> None:
        """Remembers this step's loss, to be judged at the next check (no sync here).

        Args:
            output: what ``training_step`` returned (a loss or a mapping with ``"loss"``).
            step: the global step of that loss.
        """
        if self.on_nonfinite_loss != "raise":
            return
        loss = _loss_of(output)
        value = loss.detach().reshape(-1)[:1] if loss is not None else torch.zeros(1)
        self._pending = (step, value)

    def check(self, batch_error: Exception | None, batch_checked: bool) -> None:
        """Raises on every rank if any rank's batch or previous loss was bad. Collective.

        Args:
            batch_error: this rank's validation error for the coming step, or None.
            batch_checked: whether batches are validated at this step (the same on every rank).

        Raises:
            BatchValidationError: on every rank when any rank's batch is bad (the failing rank
                raises its own error; the others name it).
            NonFiniteLossError: on every rank when any rank's previous loss was NaN/inf.
        """
        import torch.distributed as dist

        from lightning_torchrec.validation import BatchValidationError

        pending, self._pending = self._pending, None
        if not batch_checked and pending is None:
            return
        loss_bad = pending is not None and not bool(torch.isfinite(pending[1]).all())
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not distributed:
            if batch_error is not None:
                raise batch_error
            if loss_bad:
                raise _nonfinite_loss_error(pending, [0])
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        flags = torch.zeros(2 * world, dtype=torch.int32, device=self.device)
        flags[rank] = int(batch_error is not None)
        flags[world + rank] = int(loss_bad)
        dist.all_reduce(flags)
        values = flags.tolist()
        if any(values[:world]):
            messages: list[Any] = [None] * world
            mine = None if batch_error is None else f"{type(batch_error).__name__}: {batch_error}"
            dist.all_gather_object(messages, mine)
            if batch_error is not None:
                raise batch_error
            text = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
            raise BatchValidationError(f"stopped because another rank failed: {text}")
        loss_ranks = [r for r in range(world) if values[world + r]]
        if loss_ranks:
            raise _nonfinite_loss_error(pending, loss_ranks)

    def flush(self) -> None:
        """Judges the last recorded loss (call at the end of training, on every rank)."""
        self.check(None, batch_checked=False)


def _nonfinite_loss_error(
    pending: tuple[int, torch.Tensor] | None, ranks: list[int]
) -> NonFiniteLossError:
    step, value = pending if pending is not None else (-1, torch.zeros(1))
    local = float(value[0]) if value.numel() else 0.0
    here = f" (this rank: {local})" if not torch.isfinite(value).all() else ""
    return NonFiniteLossError(
        f"non-finite training loss at global step {step} on rank(s) {ranks}{here}. That step's "
        "update was applied, so the in-memory weights may be non-finite; checkpoints refuse "
        "non-finite weights and the last one is intact. Check the batch (NaN features, extreme "
        "labels/weights) and lower the learning rate."
    )


def nonfinite_tensors(state: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Names of the tensors in a (sharded) state dict holding a NaN or inf, local shards only.

    Args:
        state: a state dict; ShardedTensor and DTensor values are checked by their local shards.
        prefix: prepended to the names.

    Returns:
        The dotted names of the offending tensors.
    """
    bad: list[str] = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            bad += nonfinite_tensors(value, f"{name}.")
            continue
        if hasattr(value, "local_shards"):
            parts = [s.tensor for s in value.local_shards()]
        elif hasattr(value, "to_local"):
            parts = [value.to_local()]
        elif isinstance(value, torch.Tensor):
            parts = [value]
        else:
            continue
        for t in parts:
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                bad.append(name)
                break
    return bad


class FiniteCheckpointGuard(Callback):
    """Refuses to save a checkpoint whose weights hold NaN or inf (checks local shards).

    The check reads every local weight once per save (cheap next to writing it) and agrees
    across ranks with one ``all_reduce`` so no rank enters the collective save alone.
    """

    @override
    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("state_dict")
        if state is None:
            state = pl_module.state_dict()
        bad = nonfinite_tensors(state)
        ranks = failing_ranks(bool(bad), trainer.strategy.root_device)
        if ranks:
            names = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise NonFiniteCheckpointError(
                f"refusing to save a checkpoint at global step {trainer.global_step}: non-finite "
                f"values on rank(s) {ranks}{': ' + names if names else ''}. The previous "
                "checkpoint is kept; find where the NaN came from (loss, learning rate, data)."
            )


_PEER_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket closed",
    "connection refused",
)


def peer_failure(exc: BaseException, timeout: Any = None) -> PeerFailureError | None:
    """A :class:`PeerFailureError` explaining ``exc`` if it is a failed collective, else None.

    Args:
        exc: the exception raised inside a step.
        timeout: the collective timeout, for the message.

    Returns:
        The explaining error, or None for unrelated exceptions.
    """
    text = str(exc).lower()
    is_dist = type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistError")
    if not (is_dist or (isinstance(exc, RuntimeError) and any(s in text for s in _PEER_SIGNS))):
        return None
    return PeerFailureError(
        "a collective failed: another rank probably died (killed, out of memory) or stopped "
        f"answering within the collective timeout ({timeout}). Check the other ranks' logs; "
        f"resume from the last checkpoint. Original error: {str(exc).splitlines()[0][:300]}"
    )


class PreemptionCheckpoint(Callback):
    """On SIGTERM (preemption) on any rank: save a complete checkpoint on all ranks, then exit.

    The signal handler only sets a flag. Every ``check_every_n_steps`` training batches, the
    ranks ``all_reduce`` their flags (one integer per rank); when any rank was signalled, all
    call the collective ``trainer.save_checkpoint(path)`` and raise :class:`Preempted`
    (``SystemExit(exit_code)``). Lightning's own SIGTERM handler (which would stop without a
    checkpoint and deadlocks when only a non-zero rank is signalled) is replaced during fit.

    Args:
        path: where to write the checkpoint (resume with ``trainer.fit(..., ckpt_path=path)``).
        check_every_n_steps: how often the ranks compare flags; larger is cheaper but reacts
            later (keep ``n * step time`` well inside the grace period before SIGKILL).
        exit_code: the process exit status after saving.
        signals: the signals treated as preemption.

    Raises:
        ValueError: if ``check_every_n_steps < 1``.
    """

    def __init__(
        self,
        path: str | Path,
        check_every_n_steps: int = 1,
        exit_code: int = 0,
        signals: tuple[int, ...] = (signal.SIGTERM,),
    ) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.path = Path(path)
        self.check_every_n_steps = check_every_n_steps
        self.exit_code = exit_code
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signum

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received = None
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if trainer.global_step % self.check_every_n_steps:
            return
        ranks = failing_ranks(self.received is not None, trainer.strategy.root_device)
        if not ranks:
            return
        trainer.save_checkpoint(self.path)
        if trainer.is_global_zero:
            print(
                f"Preempted (signal on rank(s) {ranks}): saved {self.path} at global step "
                f"{trainer.global_step}; exiting.",
                flush=True,
            )
        raise Preempted(self.exit_code)
