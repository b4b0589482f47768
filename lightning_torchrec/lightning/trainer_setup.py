"""What the strategy checks and reports when a Trainer sets it up.

Trainer settings that fused tables or train pipelines cannot honour are refused (or warned
about) by name, before the first step; the sharding plan is printed and written to the loggers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    GradientAccumulationScheduler,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.compat.lightning_callbacks import pruning_targets, summarize_with
from lightning_torchrec.lightning.summary import WholeTableSummary
from lightning_torchrec.sharding.plan_summary import PlanSummary
from lightning_torchrec.sharding.sharders import has_fused_tables
from lightning_torchrec.sharding.tables import configs_of
from lightning_torchrec.training.run import check_precision
from lightning_torchrec.training.steps import check_accumulation

#: The LightningModule and DataModule hooks by which Lightning changes each batch between the
#: loader and the step (around ``Strategy.batch_to_device``).
BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def batch_hooks(trainer: Any) -> list[str]:
    """The batch hooks (:data:`BATCH_HOOKS`) the Trainer's LightningModule or DataModule overrides.

    Where any is overridden, the batch a step trains on is not the loader's own: it is checked
    as the hooks left it, votes stay before each forward, and no train pipeline runs (a
    pipeline reads the loader's batches itself).

    Args:
        trainer: the Trainer.

    Returns:
        ``"Class.hook"`` names (empty when none is overridden).
    """
    owners = (getattr(trainer, "lightning_module", None), getattr(trainer, "datamodule", None))
    return [
        f"{type(owner).__name__}.{hook}"
        for owner in owners
        if owner is not None
        for hook in BATCH_HOOKS
        if is_overridden(hook, owner)
    ]


def accumulation(trainer: Any) -> tuple[int, str]:
    """The gradient accumulation a fit may run, and what sets it.

    ``Trainer(accumulate_grad_batches=N)``, or a ``GradientAccumulationScheduler`` callback: it
    changes the Trainer's value at the start of its epochs, after setup (Lightning refuses the
    two together), so its schedule is read here.

    Args:
        trainer: the Trainer about to fit.

    Returns:
        ``(factor, source)``: a factor above 1 it accumulates (else 1), and its description.
    """
    for callback in getattr(trainer, "callbacks", ()):
        if isinstance(callback, GradientAccumulationScheduler):
            schedule = dict(sorted(callback.scheduling.items()))
            for epoch, factor in schedule.items():
                if factor > 1:
                    return factor, (
                        f"GradientAccumulationScheduler({schedule}) "
                        f"(accumulate_grad_batches={factor} from epoch {epoch})"
                    )
    factor = trainer.accumulate_grad_batches
    return factor, f"accumulate_grad_batches={factor}"


def check_setup(trainer: Any, precision_plugin: Any) -> None:
    """The checks made before sharding: the precision and, for a fit, what is pruned.

    See :func:`check_precision` and :func:`check_pruning`.

    Args:
        trainer: the Trainer being set up.
        precision_plugin: its precision plugin.

    Raises:
        ValueError: see those functions.
    """
    check_precision(precision_plugin, fused_tables=False)
    if trainer.state.fn == TrainerFn.FITTING:
        check_pruning(trainer)


def check_pruning(trainer: Any) -> None:
    """Refuses a ``ModelPruning`` callback that would prune embedding tables.

    Sharding replaces the tables' modules with TorchRec kernels that keep their own storage:
    the callback would hold the unsharded modules (on the meta device) and fail after the first
    epoch. Pruning dense modules is left to it.

    Args:
        trainer: the Trainer, after its callbacks' ``setup`` and before sharding.

    Raises:
        ValueError: naming the table parameters it targets.
    """
    module = trainer.lightning_module
    paths = {id(m): p for p, m in module.named_modules()}
    tables = [p for p, m in module.named_modules() if configs_of(m) is not None]
    found = []
    for target, name in pruning_targets(trainer):
        path = paths.get(id(target))
        if path is not None and any(not t or path == t or path.startswith(f"{t}.") for t in tables):
            found.append(f"{path}.{name}" if path else name)
    if found:
        raise ValueError(
            f"ModelPruning would prune embedding-table parameters {found}: sharding replaces "
            "those modules with TorchRec's kernels, which keep their own storage, so pruning "
            "cannot reach them. Pass ModelPruning(parameters_to_prune=[(module, 'weight'), ...]) "
            "naming dense modules only."
        )


def adapt_trainer_defaults(trainer: Any) -> Callable[[], None]:
    """Lightning's model summary made right for a sharded model; returns the undo.

    The Trainer's ``ModelSummary``/``RichModelSummary`` callbacks count each sharded table whole
    (:class:`~lightning_torchrec.lightning.summary.WholeTableSummary`) instead of the rank's
    own pieces of it. Nothing else of the Trainer's defaults is changed.

    Args:
        trainer: the Trainer being set up.

    Returns:
        A function that gives the callbacks Lightning's own summary back (call it in teardown).
    """
    return summarize_with(trainer, lambda m, depth: WholeTableSummary(m, max_depth=depth))


def _callback(trainer: Any, kind: type) -> Any:
    return next((c for c in getattr(trainer, "callbacks", ()) if isinstance(c, kind)), None)


def check_fit(trainer: Any, plan: Any, allow_fused_gradient_accumulation: bool) -> None:
    """Refuses fit settings a sharded model cannot honour (see :func:`check_fused_training`).

    Args:
        trainer: the Trainer about to fit.
        plan: the sharding plan.
        allow_fused_gradient_accumulation: the user accepts that only dense gradients accumulate.

    Raises:
        ValueError: for ``StochasticWeightAveraging``, a ``ModelCheckpoint`` whose ``dirpath``
            is a URL (``s3://...``) of another file system, and see :func:`check_fused_training`.
    """
    for callback in getattr(trainer, "callbacks", ()):
        if isinstance(callback, ModelCheckpoint) and isinstance(callback.dirpath, str):
            local_path(callback.dirpath)  # refused before training, not at the first save
    swa = _callback(trainer, StochasticWeightAveraging)
    if swa is not None:
        raise ValueError(
            f"{type(swa).__name__} keeps an averaged deep copy of the whole LightningModule "
            "on one device; sharded embedding tables exist only as shards (on the meta device "
            "before sharding), so it cannot copy them. Lightning refuses it for its sharded "
            "strategies (FSDP, DeepSpeed) too: remove the callback."
        )
    if has_fused_tables(plan):
        check_fused_training(trainer, allow_fused_gradient_accumulation)


def check_fused_training(trainer: Any, allow_fused_gradient_accumulation: bool) -> None:
    """Refuses or warns about fit settings that fused tables cannot honour.

    Args:
        trainer: the Trainer about to fit.
        allow_fused_gradient_accumulation: the user accepts that only dense gradients accumulate.

    Raises:
        ValueError: for a grad scaler, a ``BaseFinetuning`` callback, or gradient accumulation
            (``accumulate_grad_batches``, or a ``GradientAccumulationScheduler`` that ever
            accumulates) without the opt-in.
    """
    check_precision(trainer.precision_plugin, fused_tables=True)
    finetuning = _callback(trainer, BaseFinetuning)
    if finetuning is not None:
        raise ValueError(
            f"{type(finetuning).__name__} (a BaseFinetuning) records the optimizer's param "
            "groups by the module's parameter names, but the fused embedding tables' groups hold "
            "kernel weights that are no named parameters, and the fused optimizer takes no new "
            "groups. To freeze dense layers for a while, set their requires_grad in a callback "
            "of your own and build the dense optimizer on all of dense_parameters(self): torch "
            "optimizers skip parameters without gradients."
        )
    check_accumulation(*accumulation(trainer), True, allow_fused_gradient_accumulation, False)
    if trainer.gradient_clip_val:
        rank_zero_warn(
            "Gradient clipping reaches the dense parameters only: fused embedding tables update "
            "inside the backward pass before clipping could see their gradients."
        )


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


def write_plan(summary: PlanSummary, loggers: Sequence[Any]) -> None:
    """Writes the plan to the loggers (TensorBoard text, ``sharding_plan.md``).

    Call on rank 0 (the run prints it: :meth:`~lightning_torchrec.training.run.ShardedRun.shard`).

    Args:
        summary: the plan summary.
        loggers: Lightning loggers (``trainer.loggers``).
    """
    text = summary.to_markdown()
    for logger in loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("torchrec/sharding_plan", text, global_step=0)
        log_dir = getattr(logger, "log_dir", None)
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "sharding_plan.md").write_text(text + "\n")
