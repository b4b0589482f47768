"""A callback that logs the managed-collision tables' open slots, admissions and evictions."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_torchrec.lightning.norm_callbacks import log_due
from lightning_torchrec.training.mc_stats import ManagedCollisionCounts


class ManagedCollisionStatsCallback(Callback):
    """Logs, per managed-collision table, its open slots and the ids admitted and evicted.

    Every ``every_n_steps`` optimizer steps, for each ``MCHManagedCollisionModule`` of the model
    (a ``ManagedCollisionEmbeddingCollection``'s tables, sharded or not), rank 0 writes to every
    attached logger ``{prefix}/{table}/open_slots`` (TorchRec's ``open_slots()``: slots no id
    holds yet), ``{prefix}/{table}/admitted`` and ``{prefix}/{table}/evicted`` (raw ids that
    entered or left the table since the previous log, or since training started or resumed).
    Values are summed over the ranks' shards of the table: counting is one collective, made by
    every rank on the same steps. See :mod:`lightning_torchrec.training.mc_stats` for what the
    counts see.

    Args:
        every_n_steps: cadence in optimizer steps; None follows the Trainer's
            ``log_every_n_steps``.
        prefix: the first part of every metric name.

    Raises:
        ValueError: for a non-positive ``every_n_steps``.
    """

    def __init__(self, every_n_steps: int | None = None, prefix: str = "managed_collision") -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.last_values: dict[str, float] = {}
        self._counts: ManagedCollisionCounts | None = None
        self._last_logged_step = -1

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.loggers:
            raise MisconfigurationException(
                "Cannot use ManagedCollisionStatsCallback with Trainer(logger=False): attach a "
                "logger (e.g. TensorBoardLogger) to see the counts."
            )
        counts = ManagedCollisionCounts(pl_module)
        if not counts.tables:  # the same on every rank: the names are gathered
            raise MisconfigurationException(
                "ManagedCollisionStatsCallback found no MCHManagedCollisionModule in the "
                "LightningModule (a ManagedCollisionEmbeddingCollection's tables have one each)."
            )
        self._counts = counts
        self._last_logged_step = trainer.global_step

    @override
    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._counts is not None and log_due(
            trainer, self.every_n_steps, self._last_logged_step
        ):
            self._log(trainer, self._counts)

    def _log(self, trainer: L.Trainer, counts: ManagedCollisionCounts) -> None:
        step = trainer.global_step
        self.last_values = {
            f"{self.prefix}/{table}/{name}": float(value)
            for table, row in counts().items()
            for name, value in row.items()
        }
        self._last_logged_step = step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last_values, step=step)

    @property
    @override
    def state_key(self) -> str:
        return f"{type(self).__qualname__}{{'prefix': {self.prefix!r}}}"
