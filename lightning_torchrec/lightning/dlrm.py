"""``DLRMClickModule``: TorchRec's DLRM as a ready-made LightningModule for click data."""

from __future__ import annotations

from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_torchrec.lightning.module import TorchRecModule, default_optimizer
from lightning_torchrec.models.dlrm import dlrm_click_model


class DLRMClickModule(TorchRecModule):
    """TorchRec's DLRM trained on click data, tables created on the meta device.

    Tables exist only as shards once ``TorchRecStrategy`` has sharded the model; no rank ever
    holds a whole table it was not assigned.

    Args:
        num_embeddings_per_feature: rows of the table of each sparse feature ``cat_i``.
        num_dense_features: width of the dense input.
        embedding_dim: width of every table (the last dense layer has this width).
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal ``embedding_dim``.
        over_arch_layer_sizes: top MLP sizes; the last must be 1.
        pooling: how a bag of ids is pooled, ``"sum"`` or ``"mean"``.
        embedding_init_scale: rows start uniform in ``[-s, s]`` (None: TorchRec's default).
        optimizer: builds the dense optimizer.
        lr_scheduler: builds the LR scheduler (drives the fused embedding LR too), or None.
        lr_scheduler_interval: ``"step"`` or ``"epoch"``: when the scheduler steps.
        metrics_window_size: samples (over all ranks) of the training window metrics.
        train_metrics_every_n_steps: steps between training metric computations; None follows
            ``log_every_n_steps``, 0 turns training metrics off (see ``TorchRecModule``).
        train_loss_every_n_steps: steps between ``train/loss`` logs; None logs it when read
            (see ``TorchRecModule``).

    Raises:
        ValueError: if the layer sizes do not fit DLRM's shape rules.
    """

    def __init__(
        self,
        num_embeddings_per_feature: list[int],
        num_dense_features: int = 13,
        embedding_dim: int = 16,
        dense_arch_layer_sizes: list[int] | None = None,
        over_arch_layer_sizes: list[int] | None = None,
        pooling: str = "mean",
        embedding_init_scale: float | None = 0.1,
        optimizer: OptimizerCallable = default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scheduler_interval: str = "step",
        metrics_window_size: int = 100_000,
        train_metrics_every_n_steps: int | None = None,
        train_loss_every_n_steps: int | None = None,
    ) -> None:
        model = dlrm_click_model(
            num_embeddings_per_feature,
            num_dense_features,
            embedding_dim,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            pooling,
            embedding_init_scale,
        )
        super().__init__(
            model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            lr_scheduler_interval=lr_scheduler_interval,
            metrics_window_size=metrics_window_size,
            train_metrics_every_n_steps=train_metrics_every_n_steps,
            train_loss_every_n_steps=train_loss_every_n_steps,
        )
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
