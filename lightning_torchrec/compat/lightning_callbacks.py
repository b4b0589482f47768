"""Lightning's private names of two built-in callbacks (lightning 2.6), for the Trainer glue.

Like :mod:`lightning_torchrec.compat.lightning`, only the glue (``lightning_torchrec.lightning``)
imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import ModelPruning, ModelSummary

_LIGHTNINGS_SUMMARY = ModelSummary._summary


def summarize_with(trainer: Any, summary: Callable[[Any, int], Any]) -> Callable[[], None]:
    """Makes the Trainer's model-summary callbacks build their summary with ``summary``.

    ``ModelSummary.on_fit_start`` (``RichModelSummary`` too; lightning 2.0+) prints what its
    ``_summary(trainer, module)`` returns, ``summarize(module, max_depth=self._max_depth)``;
    there is no public way to give it another summary. Subclasses that override ``_summary``
    themselves are left as they are.

    Args:
        trainer: the Trainer about to run.
        summary: ``(LightningModule, max_depth) -> summary`` (a Lightning ``ModelSummary``).

    Returns:
        A function that restores the callbacks' own summary (call it in teardown).
    """
    changed = [
        c
        for c in trainer.callbacks
        if isinstance(c, ModelSummary) and type(c)._summary is _LIGHTNINGS_SUMMARY
    ]
    for callback in changed:
        depth = callback._max_depth
        vars(callback)["_summary"] = lambda _, module, depth=depth: summary(module, depth)

    def undo() -> None:
        for callback in changed:
            vars(callback).pop("_summary", None)

    return undo


def pruning_targets(trainer: Any) -> list[tuple[Any, str]]:
    """The ``(module, parameter name)`` pairs the Trainer's ``ModelPruning`` callbacks prune.

    ``ModelPruning.setup`` (lightning 1.4+) resolves its ``parameters_to_prune`` (every module
    with a ``weight`` or ``bias`` when none were given) into ``_parameters_to_prune`` before
    the strategy's setup; there is no public getter.

    Args:
        trainer: the Trainer, after its callbacks' ``setup``.

    Returns:
        The pairs, empty without such a callback.
    """
    return [
        pair
        for callback in trainer.callbacks
        if isinstance(callback, ModelPruning)
        for pair in getattr(callback, "_parameters_to_prune", None) or ()
    ]
