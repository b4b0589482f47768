"""Lightning's private or version-sensitive names (lightning 2.6), for the Trainer glue alone.

Each small function says why it is needed and since which version its name is stable; nothing
below the glue (``lightning_torchrec.lightning``) imports this module.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from typing_extensions import override


def layer_sync(strategy: Any) -> Any:
    """The ``LayerSync`` plugin Lightning attaches for ``Trainer(sync_batchnorm=True)``.

    The accelerator connector sets ``ParallelStrategy._layer_sync`` (lightning 2.0+); there is
    no public getter.

    Args:
        strategy: a Lightning parallel strategy.

    Returns:
        The plugin, or None.
    """
    return getattr(strategy, "_layer_sync", None)


def take_over_sigterm_broadcast(trainer: Any) -> Callable[[], None]:
    """Stops the fit loop's per-step SIGTERM broadcast; returns what undoes that.

    Before every training step of a multi-rank run, ``_TrainingEpochLoop.advance`` (lightning
    2.2+) calls ``_broadcast_sigterm_tensor``: a ``broadcast`` of rank 0's
    ``trainer.received_sigterm`` on the default group and an ``.item()`` of the result, so on
    CUDA one GPU-to-host synchronisation per step. A strategy whose step already runs one vote
    on every rank (on a host group) carries the flag in that vote instead and calls this.

    Args:
        trainer: the Trainer about to fit.

    Returns:
        A function that restores Lightning's broadcast (call it in teardown).
    """
    loop = trainer.fit_loop.epoch_loop
    loop._broadcast_sigterm_tensor = _no_broadcast

    def undo() -> None:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    return undo


def _no_broadcast() -> None:
    """The SIGTERM broadcast, taken over by the strategy's step vote."""


def progress_bar_refreshes(trainer: Any, batch_idx: int) -> bool:
    """Whether the progress bar refreshes after training batch ``batch_idx``, were it to end now.

    Asks the bar's ``_should_update(current, total)`` (``TQDMProgressBar``, lightning 2.0+: its
    ``refresh_rate`` and the loop's last batch), which records nothing; a bar without one is
    taken to refresh at every batch.

    Args:
        trainer: the Trainer, during a training step.
        batch_idx: the batch's index in the epoch.

    Returns:
        False when there is no bar, or it is disabled (as on every rank but 0).
    """
    bar = trainer.progress_bar_callback
    if bar is None or not getattr(bar, "is_enabled", True):
        return False
    should = getattr(bar, "_should_update", None)
    if should is None:
        return True
    total = convert_inf(trainer.num_training_batches)  # the bar's total_train_batches
    return bool(should(batch_idx + 1, total))


def show_in_progress_bar(trainer: Any, name: str, value: float) -> None:
    """Puts a value among the progress bar's metrics without ``LightningModule.log``.

    A ``self.log`` call costs 0.75 ms in Lightning's result collection (it copies the value's
    metadata at every call), which a bar refreshing after every step of a CPU run would pay at
    every step. ``Trainer.progress_bar_metrics`` (lightning 2.0+) returns the dict the bars read,
    refreshed on each read from the values logged with ``prog_bar=True``: ``name`` must not be
    logged with ``prog_bar=True`` too, or that value replaces this one.

    Args:
        trainer: the Trainer, during a training step.
        name: the metric's name, e.g. ``"train/loss"``.
        value: its value.
    """
    trainer.progress_bar_metrics[name] = value


def processed_epochs(trainer: Any) -> int:
    """Epochs the fit loop has started (restored from a checkpoint on resume).

    ``trainer.current_epoch`` counts *completed* epochs, which is one short right after a
    checkpoint saved at an epoch end; the loop's progress tracker (lightning 2.0+) knows.

    Args:
        trainer: the Trainer.

    Returns:
        ``trainer.fit_loop.epoch_progress.current.processed``.
    """
    return int(trainer.fit_loop.epoch_progress.current.processed)


def epoch_running(trainer: Any) -> bool:
    """Whether the fit loop is inside an epoch (started, its end not yet processed).

    Args:
        trainer: the Trainer.

    Returns:
        False before the first epoch and once an epoch's end has been processed: at the end
        of every epoch, and when a fit stops within one (``max_steps``, ``should_stop``), which
        Lightning ends as though the epoch were over.
    """
    current = trainer.fit_loop.epoch_progress.current
    return int(current.started) > int(current.processed)


def hpc_save_path(trainer: Any) -> str:
    """Where Lightning's SLURM requeue writes its checkpoint: the next ``hpc_ckpt_{n}.ckpt``.

    The requeued job's ``fit`` resumes from the highest ``hpc_ckpt_{n}.ckpt`` in
    ``default_root_dir`` by itself (``_CheckpointConnector._hpc_resume_path``); the save path
    comes from ``_CheckpointConnector.hpc_save_path`` (lightning 1.5+), which has no public
    counterpart.

    Args:
        trainer: the Trainer.

    Returns:
        The path of the next HPC checkpoint.
    """
    return str(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))


def requested_weights_only(trainer: Any) -> bool | None:
    """The ``weights_only`` passed to the running ``trainer.fit/validate/test/predict``.

    Lightning 2.6 hands it to ``Strategy.load_checkpoint`` only for a strategy that restores
    before its ``setup``; for one that restores after (``restore_checkpoint_after_setup``, as
    ``TorchRecStrategy`` must: the tables exist only once sharded), ``Trainer._run`` calls
    ``_restore_modules_and_callbacks(ckpt_path)`` without it, and ``load_checkpoint`` gets
    None. It is read from ``Trainer._run``'s frame on this thread's stack (its local
    ``weights_only``, lightning 2.5+).

    Args:
        trainer: the Trainer restoring a checkpoint.

    Returns:
        The value given (True or False), or None when none was given or no run is found.
    """
    code = getattr(getattr(L.Trainer, "_run", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is trainer:
            value = frame.f_locals.get("weights_only")
            return value if isinstance(value, bool) else None
        frame = frame.f_back
    return None


class ResultsOnlyLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, minus shipping rank 0's weights back to the parent.

    Lightning's launcher (``_MultiProcessingLauncher``, lightning 2.0+) saves rank 0's
    ``state_dict`` with ``torch.save`` and loads it into the parent's module. A sharded model's
    state holds only rank 0's shards, and the parent's module is the unsharded one (tables on the
    meta device), so that load fails; pickling the shards' ``ShardedTensor`` also warns that
    torch deprecates it. The trainer state, ``callback_metrics`` and the return value still come
    back (``_WorkerOutput``, lightning 2.0+); weights are read from checkpoints or loggers.
    """

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, None, trainer.state, results, extra)


def results_only_launcher(strategy: Any, parent: Any) -> None:
    """Lightning's launcher for ``strategy``, with fork/spawn as :class:`ResultsOnlyLauncher`.

    The body of the strategy's ``_configure_launcher`` override (the hook Lightning's accelerator
    connector calls, lightning 2.0+): Lightning's own choice first, then ``popen`` and external
    launchers are kept and fork/spawn bring back results only.

    Args:
        strategy: the strategy being configured.
        parent: ``super()`` in the strategy's override (Lightning's implementation).
    """
    parent._configure_launcher()
    if isinstance(strategy._launcher, _MultiProcessingLauncher):
        strategy._launcher = ResultsOnlyLauncher(strategy, start_method=strategy._start_method)


@contextlib.contextmanager
def model_kept_in_place(strategy: Any) -> Iterator[None]:
    """Within, ``Strategy.teardown`` leaves the module and the optimizer state where they are.

    ``Strategy.teardown`` (lightning 2.0+) moves ``strategy.optimizers``' state and
    ``strategy.lightning_module`` to the CPU. A sharded model must stay where
    ``DistributedModelParallel`` placed it: a later ``validate``/``test``/``predict`` reuses it,
    fused optimizer state must stay the embedding kernels' own buffers (a copy would be saved
    instead of the live state), and ``.cpu()`` raises on tables still on the meta device after an
    early error, hiding that error. The rest of the teardown (plugins, cluster environment,
    layer-sync revert) runs as Lightning wrote it.

    Args:
        strategy: a Lightning strategy about to call its parent's ``teardown``.

    Yields:
        Nothing.
    """
    module = strategy.lightning_module
    optimizers = strategy.optimizers
    strategy.optimizers = []
    if module is not None:
        vars(module)["cpu"] = lambda *args, **kwargs: module
    try:
        yield
    finally:
        strategy.optimizers = optimizers
        if module is not None:
            vars(module).pop("cpu", None)


def process_group_backend(strategy: Any) -> str:
    """The backend a DDP-style strategy will initialise its process group with.

    ``DDPStrategy._get_process_group_backend`` (lightning 2.0+): the one asked for, else the
    root device's default (gloo on the CPU, nccl on CUDA).

    Args:
        strategy: a ``DDPStrategy``.

    Returns:
        The backend's name.
    """
    return str(strategy._get_process_group_backend())
