"""Signals that end a run with one complete checkpoint, taken between steps on every rank.

- ``PreemptionCheckpoint``: SIGTERM on any rank saves a checkpoint at a path of your choice.
- ``SLURMRequeue``: SLURM's requeue signal (Lightning's ``SLURMEnvironment(auto_requeue=True)``)
  saves Lightning's ``hpc_ckpt_{n}.ckpt`` and requeues the job; ``TorchRecStrategy`` adds it
  by itself under such an environment.

Both only set a flag in the signal handler. Every ``check_every_n_steps`` training batches the
ranks ``all_reduce`` their flags; when any rank was signalled, all of them save (a collective)
and raise :class:`~lightning_torchrec.errors.Preempted`. A save inside the handler, as Lightning's
own SLURM handler does, runs wherever each rank happens to be: fused tables update inside the
backward, so a checkpoint taken between the backward and the dense optimizer step holds tables
one step ahead of the rest, and a rank that starts the save's collectives while its peer waits in
a training collective pairs the wrong ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.compat.lightning import hpc_save_path
from lightning_torchrec.distributed import ranks_where
from lightning_torchrec.errors import Preempted


class _SaveOnSignal(Callback):
    """Flag on ``signals``; every ``check_every_n_steps`` batches, agree and :meth:`_act`."""

    def __init__(self, check_every_n_steps: int, exit_code: int, signals: tuple[int, ...]) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self.exit_code = exit_code
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signum

    def _install(self) -> None:
        # Lightning installs its own handlers (which save inside the handler, on the signalled
        # rank alone) right before the sanity check: replace them from its start.
        if not self._previous:
            self.received = None
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handler)

    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()  # a signal during the sanity check is acted on at the first step

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
        if ranks:
            self._act(trainer, ranks)

    def _act(self, trainer: L.Trainer, ranks: list[int]) -> None:
        raise NotImplementedError


class PreemptionCheckpoint(_SaveOnSignal):
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
        ValueError: if ``check_every_n_steps < 1``, or ``path`` is a URL of another file system
            than the local one (``s3://...``: the checkpoint would land in a local ``s3:``
            directory).
    """

    def __init__(
        self,
        path: str | Path,
        check_every_n_steps: int = 1,
        exit_code: int = 0,
        signals: tuple[int, ...] = (signal.SIGTERM,),
    ) -> None:
        super().__init__(check_every_n_steps, exit_code, signals)
        self.path = local_path(path)

    def _act(self, trainer: L.Trainer, ranks: list[int]) -> None:
        trainer.save_checkpoint(self.path)
        if trainer.is_global_zero:
            print(
                f"Preempted (signal on rank(s) {ranks}): saved {self.path} at global step "
                f"{trainer.global_step}; exiting.",
                flush=True,
            )
        raise Preempted(self.exit_code)


def slurm_job_id() -> str | None:
    """The job ``scontrol requeue`` takes: ``{array job}_{task}`` in an array, else the job id.

    Returns:
        The id from SLURM's environment variables, or None outside a SLURM job.
    """
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


class SLURMRequeue(_SaveOnSignal):
    """SLURM's requeue signal on any rank: save ``hpc_ckpt_{n}.ckpt`` on all ranks, requeue, exit.

    Lightning's ``SLURMEnvironment(auto_requeue=True)`` saves the HPC checkpoint inside the
    signal handler (see the module docstring for why that breaks sharded training); this callback
    replaces that handler during fit and saves between steps instead, at the path Lightning's
    handler would use, so the requeued job's ``fit`` resumes from it as Lightning documents.
    After the save, rank 0 runs ``scontrol requeue JOB`` and every rank raises
    :class:`Preempted`. SLURM then sends SIGTERM to the job's tasks; it is ignored from the save
    on (the process is already on its way out; Lightning restores the handler at teardown).

    ``TorchRecStrategy`` adds one by itself when the cluster environment is a
    ``SLURMEnvironment`` with ``auto_requeue`` (with its ``requeue_signal``); add your own to
    change ``check_every_n_steps``.

    Args:
        check_every_n_steps: how often the ranks compare flags (send the signal at least this
            many step times before SLURM's deadline, e.g. ``#SBATCH --signal=SIGUSR1@120``).
        exit_code: the exit status after a successful requeue (1 on rank 0 if it failed).
        signals: the requeue signals (Lightning's default: SIGUSR1).
        requeue_command: the command, followed by the job id, that requeues the job.

    Raises:
        ValueError: if ``check_every_n_steps < 1``.
    """

    def __init__(
        self,
        check_every_n_steps: int = 1,
        exit_code: int = 0,
        signals: tuple[int, ...] = (signal.SIGUSR1,),
        requeue_command: tuple[str, ...] = ("scontrol", "requeue"),
    ) -> None:
        super().__init__(check_every_n_steps, exit_code, signals)
        self.requeue_command = tuple(requeue_command)
        self.saved: Path | None = None

    def _requeue(self) -> bool:
        job = slurm_job_id()
        if job is None:
            print("SLURMRequeue: no SLURM_JOB_ID; the job was not requeued.", file=sys.stderr)
            return False
        command = [*self.requeue_command, job]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            print(f"SLURMRequeue: {' '.join(command)} failed: {err}", file=sys.stderr)
            return False
        if proc.returncode != 0:
            print(
                f"SLURMRequeue: {' '.join(command)} exited with {proc.returncode}: "
                f"{(proc.stderr or proc.stdout).strip()}",
                file=sys.stderr,
            )
            return False
        return True

    def _act(self, trainer: L.Trainer, ranks: list[int]) -> None:
        # SLURM answers the requeue with SIGTERM; Lightning's SIGTERM handler would run a
        # collective inside the handler while the ranks are saving or tearing down.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        path = hpc_save_path(trainer)
        trainer.save_checkpoint(path)
        self.saved = Path(path)
        exit_code = self.exit_code
        if trainer.is_global_zero:
            requeued = self._requeue()
            print(
                f"Requeue signal on rank(s) {ranks}: saved {path} at global step "
                f"{trainer.global_step}; "
                + (f"requeued job {slurm_job_id()}; exiting." if requeued else "NOT requeued."),
                flush=True,
            )
            exit_code = exit_code if requeued else 1
        raise Preempted(exit_code)


def add_slurm_requeue(trainer: L.Trainer, environment: Any) -> SLURMRequeue | None:
    """Adds a :class:`SLURMRequeue` to ``trainer`` under SLURM's auto-requeue, unless one is there.

    Args:
        trainer: the Trainer.
        environment: the strategy's cluster environment.

    Returns:
        The trainer's ``SLURMRequeue`` (added or already there); None when ``environment`` is
        not a ``SLURMEnvironment`` with ``auto_requeue``.
    """
    if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
        return None
    for callback in trainer.callbacks:
        if isinstance(callback, SLURMRequeue):
            return callback
    sig = environment.requeue_signal or signal.SIGUSR1
    callback = SLURMRequeue(signals=(sig,))
    trainer.callbacks.append(callback)
    return callback
