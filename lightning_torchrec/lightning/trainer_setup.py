"""What the strategy checks and reports when a Trainer sets it up.

Trainer settings that fused tables or train pipelines cannot honour are refused (or warned
about) by name, before the first step; the sharding plan is printed and written to the loggers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_torchrec.sharding.plan_summary import PlanSummary
from lightning_torchrec.training.pipelines import PipelineConfig, resolve_pipeline


def check_precision(precision_plugin: Any) -> None:
    """Refuses precisions that convert the whole model.

    Args:
        precision_plugin: the Trainer's precision plugin.

    Raises:
        ValueError: for ``*-true`` precisions, with the fix.
    """
    if isinstance(precision_plugin, (HalfPrecision, DoublePrecision)):
        raise ValueError(
            f"precision={precision_plugin.precision!r} converts the whole model, but TorchRec's "
            "embedding kernels keep fp32 tables and return fp32 embeddings. Use "
            "precision='bf16-mixed' (or '32-true'); set the table dtype with "
            "EmbeddingBagConfig(data_type=...)."
        )


def check_fused_precision(precision_plugin: Any) -> None:
    """Refuses a gradient scaler when tables are fused.

    Args:
        precision_plugin: the Trainer's precision plugin.

    Raises:
        ValueError: for fp16 mixed precision with a grad scaler.
    """
    if isinstance(precision_plugin, MixedPrecision) and precision_plugin.scaler is not None:
        raise ValueError(
            "precision='16-mixed' uses a gradient scaler, but fused embedding tables update "
            "inside the backward pass with the *scaled* gradients, so they would diverge. Use "
            "precision='bf16-mixed', or shard tables with a non-fused compute kernel."
        )


def check_fused_training(trainer: Any, allow_fused_gradient_accumulation: bool) -> None:
    """Refuses or warns about fit settings that fused tables cannot honour.

    Args:
        trainer: the Trainer about to fit.
        allow_fused_gradient_accumulation: the user accepts that only dense gradients accumulate.

    Raises:
        ValueError: for a grad scaler, or gradient accumulation without the opt-in.
    """
    check_fused_precision(trainer.precision_plugin)
    if trainer.accumulate_grad_batches > 1 and not allow_fused_gradient_accumulation:
        raise ValueError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} does not apply to fused "
            "embedding tables: they update at every backward pass. Use a larger batch, or pass "
            "TorchRecStrategy(allow_fused_gradient_accumulation=True) to accumulate only the "
            "dense gradients."
        )
    if trainer.gradient_clip_val:
        rank_zero_warn(
            "Gradient clipping reaches the dense parameters only: fused embedding tables update "
            "inside the backward pass before clipping could see their gradients."
        )


def check_pipeline_training(trainer: Any) -> None:
    """Refuses fit settings TorchRec's train pipeline cannot combine with.

    Args:
        trainer: the Trainer about to fit with ``TorchRecStrategy(pipeline=...)``.

    Raises:
        ValueError: for gradient accumulation (the pipeline runs one update per batch).
    """
    if trainer.accumulate_grad_batches > 1:
        raise ValueError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} cannot combine with a "
            "train pipeline: the pipeline runs the next batch's input all-to-all against every "
            "update. Use pipeline=None to accumulate, or a larger batch."
        )


def pipeline_for(
    config: PipelineConfig, device: torch.device, trainer: Any, fitting: bool, ahead: bool = False
) -> str | None:
    """The pipeline a run trains with: ``"auto"`` resolved for the device and the Trainer.

    Args:
        config: the strategy's pipeline configuration.
        device: the rank's device.
        trainer: the Trainer (its gradient accumulation rules a pipeline out under ``"auto"``).
        fitting: whether the run is a ``fit``.
        ahead: whether the fit's steps vote ahead (see :func:`resolve_pipeline`).

    Returns:
        ``"sparse_dist"``, ``"semi_sync"`` or None.

    Raises:
        ValueError: when an asked-for pipeline cannot train with the Trainer's settings.
    """
    if config.kind == "auto":
        accumulating = fitting and trainer.accumulate_grad_batches > 1
        why = "gradient accumulation needs the unpipelined step" if accumulating else None
        return resolve_pipeline(config, device, why, ahead)
    if fitting and config.kind is not None:
        check_pipeline_training(trainer)
    return config.kind


def check_sync_batchnorm(device: torch.device) -> None:
    """Refuses ``Trainer(sync_batchnorm=True)`` where torch's ``SyncBatchNorm`` cannot run.

    Args:
        device: the rank's device.

    Raises:
        ValueError: on CPU: ``SyncBatchNorm`` needs CUDA (or another accelerator).
    """
    if device.type == "cpu":
        raise ValueError(
            "Trainer(sync_batchnorm=True) converts BatchNorm layers to torch's SyncBatchNorm, "
            "which runs on GPUs only. On CPU, train with sync_batchnorm=False (each rank then "
            "normalises with its own batch statistics)."
        )


def log_plan(summary: PlanSummary, loggers: Sequence[Any]) -> None:
    """Prints the plan and writes it to the loggers (TensorBoard text, ``sharding_plan.md``).

    Call on rank 0.

    Args:
        summary: the plan summary.
        loggers: Lightning loggers (``trainer.loggers``).
    """
    text = summary.to_markdown()
    rank_zero_info(f"TorchRec sharding plan ({summary.world_size} ranks):\n{text}")
    for logger in loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("torchrec/sharding_plan", text, global_step=0)
        log_dir = getattr(logger, "log_dir", None)
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "sharding_plan.md").write_text(text + "\n")
