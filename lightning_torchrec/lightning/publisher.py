"""``DeltaPublisher``: publishes delta checkpoints from a Trainer's fit, for a served model.

A Lightning callback over :class:`~lightning_torchrec.checkpoint.delta_writer.DeltaWriter`. At
the fit's start it saves the chain's base (``dirpath/base``, ``trainer.save_checkpoint``: the
strategy's sharded format) unless the fit resumed a chain; then every ``every_n_steps`` steps,
every ``every_minutes`` minutes and at each partition's end (``on_train_epoch_end``: a partition
is an epoch), it writes the next delta. Its state (sequence, last id, base id, the ids touched
since the last delta) goes into every full checkpoint, so a fit resumed from one continues the
chain exactly.

The time trigger is decided by rank 0's clock and broadcast: one small broadcast every
``time_check_every_n_steps`` steps (16 by default), not every step, so a delta may come up to
that many steps after its time.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_torchrec.checkpoint.delta_writer import DeltaWriter
from lightning_torchrec.training.optim import keyed_optimizer


class DeltaPublisher(Callback):
    """Publishes delta checkpoints of a ``TorchRecStrategy`` fit into ``dirpath``.

    Args:
        dirpath: the chain's folder (``base``, ``delta-000001``, ...).
        every_n_steps: publish after every this many training steps (None: not by steps).
        every_minutes: publish once this many minutes passed since the last (None: not by time).
        at_partition_end: publish at each epoch's (partition's) end.
        with_optimizer: write the touched rows' optimizer state too.
        key: sign deltas with this HMAC key (None: the strategy's ``checkpoint_key``, else the
            ``LIGHTNING_TORCHREC_CHECKPOINT_KEY_FILE`` environment variable).
        time_check_every_n_steps: how often the ranks agree on the time trigger (a broadcast).

    Raises:
        ValueError: for a trigger that is not positive.
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_steps: int | None = None,
        every_minutes: float | None = None,
        at_partition_end: bool = True,
        with_optimizer: bool = False,
        key: bytes | str | None = None,
        time_check_every_n_steps: int = 16,
    ) -> None:
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("every_minutes", every_minutes),
            ("time_check_every_n_steps", time_check_every_n_steps),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"DeltaPublisher({name}={value!r}): give a positive number")
        self.writer = DeltaWriter(dirpath, with_optimizer=with_optimizer, key=key)
        self.every_n_steps = every_n_steps
        self.every_minutes = every_minutes
        self.at_partition_end = at_partition_end
        self.time_check_every_n_steps = time_check_every_n_steps
        self._last_time = time.monotonic()
        self._last_step = -1
        self._trainer: Any = None
        #: The delta folders this fit published, in order.
        self.published: list[Path] = []
        #: The wall time each of them took to publish (gather, write, rename), in seconds.
        self.publish_seconds: list[float] = []

    @property
    @override
    def state_key(self) -> str:
        return f"DeltaPublisher{{dirpath={str(self.writer.dirpath)!r}}}"

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        strategy = trainer.strategy
        kind = getattr(getattr(strategy, "pipeline_config", None), "kind", None)
        if stage == "fit" and kind == "semi_sync":
            raise ValueError(
                "DeltaPublisher cannot follow pipeline='semi_sync': it looks up the next batch's "
                "rows before this batch's update, so a delta could miss rows updated after it "
                "was written. Use pipeline='sparse_dist' or None."
            )
        if self.writer.key is None:
            self.writer.key = getattr(strategy, "checkpoint_key", None)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dmp = getattr(getattr(trainer.strategy, "run", None), "dmp", None)
        if dmp is None:
            raise TypeError(
                "DeltaPublisher needs a TorchRecStrategy (a model sharded with "
                "DistributedModelParallel)"
            )
        self.writer.start(
            dmp, pl_module, lambda path: trainer.save_checkpoint(path, weights_only=False)
        )
        self._last_time = time.monotonic()
        self._last_step = trainer.global_step

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # After the fit (or its failure): the model, which the strategy keeps, stops marking.
        if stage == "fit":
            self.writer.stop()
        self._trainer = None

    def _publish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self._last_step:
            return  # published at this step already (e.g. a step trigger at an epoch's end)
        optimizer = keyed_optimizer(trainer.optimizers[0]) if trainer.optimizers else None
        # A stream's data module names its partitions; otherwise the epoch is the partition.
        partition = getattr(getattr(trainer, "datamodule", None), "current_partition", None)
        partition = str(trainer.current_epoch) if partition is None else str(partition)
        began = time.monotonic()
        path = self.writer.publish(
            pl_module, trainer.global_step, partition=partition, optimizer=optimizer
        )
        self.published.append(path)
        self.publish_seconds.append(time.monotonic() - began)
        self._last_time = time.monotonic()
        self._last_step = trainer.global_step

    def _time_is_up(self, trainer: L.Trainer) -> bool:
        if self.every_minutes is None:
            return False
        if trainer.global_step % self.time_check_every_n_steps:
            return False
        due = time.monotonic() - self._last_time >= self.every_minutes * 60
        return bool(trainer.strategy.broadcast(due, src=0))  # rank 0's clock decides

    @override
    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        by_steps = self.every_n_steps is not None and step % self.every_n_steps == 0
        if self._time_is_up(trainer) or by_steps:
            self._publish(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_partition_end:
            self._publish(trainer, pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        # A save while handling an exception (OnExceptionCheckpoint) may find the ranks at
        # different points: no collective then; a run resumed from it publishes whole tables.
        interrupted = bool(getattr(self._trainer, "interrupted", False))
        return self.writer.state_dict(collective=not interrupted)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.writer.load_state_dict(state_dict)
