"""``TorchRecModule``: the LightningModule for click models built on ``ModelAndLoss``."""

from __future__ import annotations

import os
from typing import IO, Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics.classification import BinaryAUROC

from lightning_torchrec.checkpoint import load_unsharded
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.compat.lightning import progress_bar_refreshes, show_in_progress_bar
from lightning_torchrec.models.model_and_loss import ModelAndLoss
from lightning_torchrec.training.metrics import RecMetrics
from lightning_torchrec.training.optim import combine_optimizers, dense_parameters


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """The dense optimizer of ``TorchRecModule`` unless one is given: Adam, lr 1e-3.

    Args:
        params: the dense parameters.

    Returns:
        The optimizer.
    """
    return torch.optim.Adam(params, lr=1e-3)


def monitored(trainer: L.Trainer, key: str) -> bool:
    """Whether a callback or an LR scheduler of the Trainer monitors ``key``.

    Args:
        trainer: the Trainer.
        key: a logged name.

    Returns:
        True when a callback (``ModelCheckpoint``, ``EarlyStopping``, anything with a
        ``monitor`` attribute) or an LR scheduler's config (``ReduceLROnPlateau``) monitors it.
    """
    if any(getattr(callback, "monitor", None) == key for callback in trainer.callbacks):
        return True
    return any(config.monitor == key for config in trainer.lr_scheduler_configs)


class TorchRecModule(L.LightningModule):
    """A LightningModule for click models built on ``ModelAndLoss``.

    Trains, validates and tests; logs ``train/loss`` (in the progress bar on the CPU only: on
    CUDA, reading it at every refresh would wait for the GPU), ``val/loss``, ``val/auroc``,
    ``test/loss`` and ``test/auroc`` (AUROC from torchmetrics, synchronised across ranks), and
    the recommendation metrics (NE, calibration, AUROC, AUPRC, kept on the device; see
    :mod:`lightning_torchrec.training.metrics`), synchronised across ranks:

    * ``val/ne``, ``val/calibration``, ``val/auprc`` (and ``test/...``) over the whole
      evaluation;
    * ``train/{ne,calibration}_{window,lifetime}`` and ``train/{auroc,auprc}_window`` every
      ``train_metrics_every_n_steps`` steps: the window holds the last
      ``metrics_window_size`` training samples (over all ranks), lifetime is the whole run
      since this process started.

    With several tasks (logits ``[B, T]``) every recommendation metric is logged per task, e.g.
    ``val/ne/{task}``. The dense optimizer and LR schedule are arguments, so no subclass is
    needed; under ``TorchRecStrategy`` the scheduler drives the fused embedding learning rate
    too.

    Args:
        model_and_loss: the wrapped model and loss.
        optimizer: builds the dense optimizer from the dense parameters (fused tables are
            excluded automatically). Defaults to Adam with lr 1e-3.
        lr_scheduler: builds an LR scheduler from the combined optimizer, or None. One with a
            ``monitor`` (Lightning CLI's ``ReduceLROnPlateau``) is stepped with that metric.
        lr_scheduler_interval: ``"step"`` or ``"epoch"`` (e.g. for a plateau on ``val/loss``).
        task_names: one name per output column of the model (None: one task, ``click``).
        metrics_window_size: samples (over all ranks) of the training window metrics.
        train_metrics_every_n_steps: steps between training metric computations (a collective
            over the ranks); None uses the trainer's ``log_every_n_steps``, 0 turns them off.
        train_loss_every_n_steps: steps between ``train/loss`` logs (Lightning's result
            collection costs every ``self.log``). None: at every step when something reads it
            then: a callback whose ``monitor`` is ``train/loss``, such as ``ModelCheckpoint``
            or ``EarlyStopping``, or an LR scheduler monitoring it; else at the loggers' steps
            (``log_every_n_steps``) and the last step of the fit or epoch; 1: every step (for a
            callback reading ``trainer.callback_metrics["train/loss"]`` at every step). The
            progress bar gets ``train/loss`` apart from these logs, without ``self.log``, at
            the steps it refreshes after (its ``refresh_rate``; on the CPU only, and on the rank
            that shows it).
    """

    #: FLOPs of one training batch for Lightning's ``ThroughputMonitor``; None: not measured.
    flops_per_batch: int | None = None

    def __init__(
        self,
        model_and_loss: ModelAndLoss,
        optimizer: OptimizerCallable = default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scheduler_interval: str = "step",
        task_names: list[str] | None = None,
        metrics_window_size: int = 100_000,
        train_metrics_every_n_steps: int | None = None,
        train_loss_every_n_steps: int | None = None,
    ) -> None:
        super().__init__()
        if train_loss_every_n_steps is not None and train_loss_every_n_steps < 1:
            raise ValueError(
                f"train_loss_every_n_steps must be >= 1 or None, got {train_loss_every_n_steps}"
            )
        self.model_and_loss = model_and_loss
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.lr_scheduler_interval = lr_scheduler_interval
        self.val_auroc = BinaryAUROC()
        self.test_auroc = BinaryAUROC()
        self.task_names = list(task_names) if task_names else ["click"]
        self.metrics_window_size = metrics_window_size
        self.train_metrics_every_n_steps = train_metrics_every_n_steps
        self.train_loss_every_n_steps = train_loss_every_n_steps
        # Plain attribute, not submodules: metric states stay out of state_dict and checkpoints.
        self.rec_metrics: dict[str, RecMetrics] = {}

    def _metrics(self, stage: str) -> RecMetrics:
        if stage not in self.rec_metrics:
            train = stage == "train"
            self.rec_metrics[stage] = RecMetrics(
                self.task_names,
                # AUROC of an evaluation comes from torchmetrics (``{stage}/auroc``).
                metrics=("ne", "calibration", "auroc", "auprc")
                if train
                else ("ne", "calibration", "auprc"),
                # An evaluation's window holds all of its samples.
                window_size=self.metrics_window_size if train else 2**40,
            )
        return self.rec_metrics[stage]

    def _update_metrics(self, stage: str, outputs: dict[str, Any], labels: torch.Tensor) -> None:
        logits = outputs["logits"].detach().float()
        shape = labels.shape if len(self.task_names) == 1 else (-1, len(self.task_names))
        weights = outputs.get("weights")
        self._metrics(stage).update(
            torch.sigmoid(logits.reshape(shape)),
            labels.reshape(shape),
            None if weights is None else weights.detach(),
        )

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | os.PathLike[str] | IO[bytes],
        map_location: Any = None,
        hparams_file: str | os.PathLike[str] | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """The model of a checkpoint: a sharded checkpoint directory or a single file.

        A sharded checkpoint directory (written by ``TorchRecStrategy``) is loaded in this one
        process by :func:`lightning_torchrec.checkpoint.load_unsharded`: the module is built
        from the saved hyper-parameters (``kwargs`` override them), tables on the meta device
        are materialised on the CPU, its ``on_load_checkpoint`` gets the checkpoint's metadata
        (the checkpoint dict without the tensors, as under the strategy) and every tensor is
        read one at a time, verified. Anything else goes to Lightning's
        ``LightningModule.load_from_checkpoint``.

        Args:
            checkpoint_path: a sharded checkpoint directory (a ``file://`` URL is its local
                path), or what Lightning accepts.
            map_location: for a directory: a device to move the model to (default CPU).
            hparams_file: Lightning's argument; not supported for a directory.
            strict: raise when the checkpoint and the model do not hold the same tensors (a
                shape mismatch always raises); None: the module's ``strict_loading``.
            weights_only: read the hyper-parameters with ``torch.load(weights_only=...)``.
            **kwargs: constructor arguments overriding the saved hyper-parameters.

        Returns:
            The model (unsharded).

        Raises:
            ValueError: if ``hparams_file`` is given with a checkpoint directory.
        """
        if isinstance(checkpoint_path, str | os.PathLike) and _is_local_dir(checkpoint_path):
            if hparams_file is not None:
                raise ValueError(
                    "hparams_file is not supported for a sharded checkpoint directory; pass the "
                    "constructor arguments as keyword arguments instead"
                )
            model = load_unsharded(
                checkpoint_path,
                cls,
                strict=strict,
                weights_only=weights_only is not False,
                on_build=lambda module, meta: module.on_load_checkpoint(meta),
                **kwargs,
            )
            if isinstance(map_location, str | torch.device):
                model = model.to(map_location)
            return model
        return super().load_from_checkpoint(
            checkpoint_path, map_location, hparams_file, strict, weights_only, **kwargs
        )

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """Runs ``ModelAndLoss`` on a batch.

        Args:
            batch: the batch.

        Returns:
            ``(loss, outputs)``.
        """
        return self.model_and_loss(batch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """One training step; logs ``train/loss``.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        loss, outputs = self(batch)
        n = len(batch.labels)
        self._log_train_loss(loss, n, batch_idx)
        every = self.train_metrics_every_n_steps
        if every is None:
            every = self.trainer.log_every_n_steps if self._trainer is not None else 0
        if every > 0:
            self._update_metrics("train", outputs, batch.labels)
            if (self.global_step + 1) % every == 0:
                values = self._metrics("train").named("train")
                self.log_dict(values, batch_size=n, on_step=True, on_epoch=False)
        return loss

    def _log_train_loss(self, loss: torch.Tensor, batch_size: int, batch_idx: int) -> None:
        # The progress bar shows the loss only on the CPU (a refresh turns its values into
        # Python numbers, which on CUDA waits for the GPU), only on the rank that shows it, and
        # only when it refreshes after this batch; it gets the number without self.log, whose
        # result collection costs 0.75 ms a call. The loggers and monitors get it logged.
        trainer = self._trainer
        if trainer is None:
            self.log("train/loss", loss, batch_size=batch_size)
            return
        shown = loss.device.type == "cpu" and loss.numel() == 1
        if shown and progress_bar_refreshes(trainer, batch_idx):  # False without a shown bar
            show_in_progress_bar(trainer, "train/loss", float(loss.detach()))
        if self._train_loss_due(trainer, batch_idx):
            self.log("train/loss", loss, batch_size=batch_size)

    def _train_loss_due(self, trainer: L.Trainer, batch_idx: int) -> bool:
        every = self.train_loss_every_n_steps
        if every is None:
            if monitored(trainer, "train/loss"):
                return True
            every = trainer.log_every_n_steps
        step = self.global_step + 1  # the optimizer step this batch makes
        last = (0 < trainer.max_steps <= step) or batch_idx + 1 >= trainer.num_training_batches
        return (every > 0 and step % every == 0) or last

    def _eval_step(self, batch: Any, stage: str, auroc: BinaryAUROC) -> torch.Tensor:
        loss, outputs = self(batch)
        probs = torch.sigmoid(outputs["logits"].detach().reshape(batch.labels.shape).float())
        auroc.update(probs, batch.labels.long())
        self._update_metrics(stage, outputs, batch.labels)
        n = len(batch.labels)
        self.log(f"{stage}/loss", loss, sync_dist=True, batch_size=n)
        self.log(f"{stage}/auroc", auroc, prog_bar=stage == "val", batch_size=n)
        return loss

    def _log_eval_metrics(self, stage: str) -> None:
        metrics = self.rec_metrics.pop(stage, None)
        if metrics is not None:
            # Already global (TorchRec's metrics reduce over the ranks); sync_dist averages
            # equal values and tells Lightning so.
            values = metrics.named(stage, scope="lifetime")
            self.log_dict(values, on_step=False, on_epoch=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        """Logs ``val/ne``, ``val/calibration`` and ``val/auprc`` of the whole validation."""
        self._log_eval_metrics("val")

    def on_test_epoch_end(self) -> None:
        """Logs ``test/ne``, ``test/calibration`` and ``test/auprc`` of the whole test."""
        self._log_eval_metrics("test")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Logs ``val/loss`` and ``val/auroc``.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        return self._eval_step(batch, "val", self.val_auroc)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Logs ``test/loss`` and ``test/auroc``.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            The loss.
        """
        return self._eval_step(batch, "test", self.test_auroc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Click probabilities for a batch.

        Args:
            batch: the batch.
            batch_idx: its index.

        Returns:
            ``[B]`` probabilities.
        """
        _, outputs = self(batch)
        return torch.sigmoid(outputs["logits"].reshape(-1))

    def configure_optimizers(self) -> Any:
        """Dense optimizer on the dense parameters, combined with the fused embedding optimizer.

        Returns:
            The optimizer, and the LR scheduler config when one was given.
        """
        dense = self.optimizer_factory(dense_parameters(self))
        optimizer = combine_optimizers(dense, self)
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        config = {"scheduler": scheduler, "interval": self.lr_scheduler_interval}
        monitor = getattr(scheduler, "monitor", None)
        if isinstance(monitor, str):  # Lightning CLI's ReduceLROnPlateau: what it watches
            config["monitor"] = monitor
        return {"optimizer": optimizer, "lr_scheduler": config}


def _is_local_dir(path: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint path names a directory of the local file system.

    Args:
        path: a path, or a URL (``file://...`` is its local path).

    Returns:
        True for a local directory; False otherwise, also for a URL of another file system
        (``s3://...``), which Lightning's loader reads as one file.
    """
    try:
        return local_path(path).is_dir()
    except ValueError:
        return False
