"""``PreemptionCheckpoint``: SIGTERM on any rank saves one complete checkpoint on every rank."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_torchrec.distributed import ranks_where
from lightning_torchrec.errors import Preempted


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
        ranks = ranks_where(self.received is not None)
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
