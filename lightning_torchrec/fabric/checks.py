"""Setup checks of ``TorchRecFabricStrategy`` that depend on Fabric's precision plugins."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision


def check_fabric_precision(precision: Any, fused_tables: bool) -> None:
    """Refuses precisions that the sharded model cannot train with.

    Args:
        precision: Fabric's precision plugin.
        fused_tables: whether the plan holds tables updated by a fused optimizer.

    Raises:
        ValueError: for ``*-true`` half or double precision (they convert the whole model,
            tables included), and for ``16-mixed`` with fused tables (its gradient scaler
            never sees the fused update).
    """
    if isinstance(precision, (HalfPrecision, DoublePrecision)):
        raise ValueError(
            f"precision={precision.precision!r} converts the whole model, but TorchRec's "
            "sharded tables keep the dtype they were built with. Use precision='32-true' or "
            "'bf16-mixed'; set the table dtype with `EmbeddingBagConfig(data_type=...)`."
        )
    if fused_tables and isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise ValueError(
            "precision='16-mixed' uses a gradient scaler, but fused embedding tables update "
            "inside the backward pass without it. Use precision='bf16-mixed' or '32-true', or "
            "shard tables with a non-fused compute kernel."
        )
