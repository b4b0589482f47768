"""Progressive evaluation of a stream of partitions: ``ProgressiveEvaluation``, the online curve.

With :class:`~lightning_torchrec.data.stream.PartitionStreamData` the validation at the end of
epoch e evaluates partition e + 1, which the model has not trained on yet. This callback takes
that validation's metrics (``val/ne``, ``val/calibration``, ``val/auroc``, ... of
``DLRMClickModule`` or ``TorchRecModule``: every ``val/*`` value) and logs them to every logger
of the Trainer as ``online/<metric>`` at step = the partition's index, so that TensorBoard draws
one curve per metric over the partitions (the online learning curve). Loggers that take text
(TensorBoard's ``add_text``) also get the partition's name under ``online/partition`` at that
step; :attr:`ProgressiveEvaluation.history` keeps ``{"partition": name, "index": i, "ne": ...}``
per partition (saved in checkpoints, so a resumed run continues it).

The sanity check before training evaluates partition 0 on ``num_sanity_val_steps`` batches: it is
recorded only when that is all of it (``Trainer(num_sanity_val_steps=-1)``).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback

from lightning_torchrec.data.stream import Partition

__all__ = ["ProgressiveEvaluation"]


class ProgressiveEvaluation(Callback):
    """Logs each partition's validation metrics, evaluated before training on it.

    Args:
        prefix: the logged names' prefix (``online/ne``).
        stage: the prefix of the module's validation metrics to take (``val/ne`` -> ``ne``).
    """

    def __init__(self, prefix: str = "online", stage: str = "val") -> None:
        self.prefix = prefix
        self.stage = stage
        #: ``{"partition": name, "index": i, <metric>: value, ...}`` per partition evaluated.
        self.history: list[dict[str, Any]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Records and logs the metrics of the partition just evaluated.

        Args:
            trainer: the Trainer.
            pl_module: the module.
        """
        partition = getattr(trainer.datamodule, "evaluating", None)
        if not isinstance(partition, Partition):
            return  # not a stream, or the stream ended: nothing was evaluated
        if trainer.sanity_checking and trainer.num_sanity_val_steps != math.inf:
            return  # a few batches of partition 0, not its metrics
        start = f"{self.stage}/"
        values = {
            key[len(start) :]: float(value)
            for key, value in trainer.callback_metrics.items()
            if key.startswith(start)
        }
        if not values:
            return
        record = {"partition": partition.name, "index": partition.index, **values}
        self.history = [r for r in self.history if r["index"] != partition.index] + [record]
        logged = {f"{self.prefix}/{k}": v for k, v in values.items()}
        for logger in trainer.loggers:
            logger.log_metrics(logged, step=partition.index)
            add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
            if trainer.is_global_zero and callable(add_text):
                add_text(f"{self.prefix}/partition", partition.name, global_step=partition.index)

    def state_dict(self) -> dict[str, Any]:
        """The history (Lightning keeps it in checkpoints).

        Returns:
            ``{"history": [...]}``.
        """
        return {"history": [dict(r) for r in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues the history of a checkpoint.

        Args:
            state_dict: from :meth:`state_dict`.
        """
        self.history = [dict(r) for r in state_dict.get("history", [])]
