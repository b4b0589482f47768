"""TorchRec's DLRM for click data: its tables and the model with its loss, tables on meta."""

from __future__ import annotations

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from lightning_torchrec.models.model_and_loss import ModelAndLoss


def dlrm_tables(
    num_embeddings_per_feature: list[int],
    embedding_dim: int,
    pooling: str = "mean",
    init_scale: float | None = None,
) -> list[EmbeddingBagConfig]:
    """One table ``t_cat_i`` per sparse feature ``cat_i``.

    Args:
        num_embeddings_per_feature: rows per table.
        embedding_dim: width of every table.
        pooling: ``"sum"`` or ``"mean"`` of the ids of a bag.
        init_scale: rows start uniform in ``[-init_scale, init_scale]``; None keeps TorchRec's
            ``sqrt(1 / rows)``, which is tiny for large tables and slows learning interactions.

    Returns:
        The table configs.
    """
    return [
        EmbeddingBagConfig(
            name=f"t_cat_{i}",
            embedding_dim=embedding_dim,
            num_embeddings=rows,
            feature_names=[f"cat_{i}"],
            pooling=PoolingType[pooling.upper()],
            weight_init_min=None if init_scale is None else -init_scale,
            weight_init_max=init_scale,
        )
        for i, rows in enumerate(num_embeddings_per_feature)
    ]


def dlrm_click_model(
    num_embeddings_per_feature: list[int],
    num_dense_features: int = 13,
    embedding_dim: int = 16,
    dense_arch_layer_sizes: list[int] | None = None,
    over_arch_layer_sizes: list[int] | None = None,
    pooling: str = "mean",
    embedding_init_scale: float | None = 0.1,
) -> ModelAndLoss:
    """TorchRec's DLRM with a click loss, its tables on the meta device.

    Tables exist only as shards once the model is sharded; no rank ever holds a whole table it
    was not assigned. The Trainer's ``DLRMClickModule`` and a Fabric loop build the same model.

    Args:
        num_embeddings_per_feature: rows of the table of each sparse feature ``cat_i``.
        num_dense_features: width of the dense input.
        embedding_dim: width of every table (the last dense layer has this width).
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal ``embedding_dim``.
        over_arch_layer_sizes: top MLP sizes; the last must be 1.
        pooling: how a bag of ids is pooled, ``"sum"`` or ``"mean"``.
        embedding_init_scale: rows start uniform in ``[-s, s]`` (None: TorchRec's default).

    Returns:
        ``ModelAndLoss(DLRM(...))``.

    Raises:
        ValueError: if the layer sizes do not fit DLRM's shape rules.
    """
    dense_sizes = dense_arch_layer_sizes or [64, embedding_dim]
    over_sizes = over_arch_layer_sizes or [64, 1]
    if dense_sizes[-1] != embedding_dim:
        raise ValueError(
            f"dense_arch_layer_sizes must end with embedding_dim={embedding_dim}, got {dense_sizes}"
        )
    if over_sizes[-1] != 1:
        raise ValueError(f"over_arch_layer_sizes must end with 1, got {over_sizes}")
    ebc = EmbeddingBagCollection(
        tables=dlrm_tables(
            num_embeddings_per_feature, embedding_dim, pooling, embedding_init_scale
        ),
        device=torch.device("meta"),
    )
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense_features,
        dense_arch_layer_sizes=dense_sizes,
        over_arch_layer_sizes=over_sizes,
    )
    return ModelAndLoss(dlrm)
