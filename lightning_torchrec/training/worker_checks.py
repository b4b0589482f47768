"""Batch checks where the batch is made: in the DataLoader's worker processes.

With ``num_workers > 0`` a batch is collated in a worker process while the main process trains
on earlier batches. :func:`check_in_workers` wraps the loader's ``collate_fn`` so the worker also
runs :func:`~lightning_torchrec.training.batch_checks.validate_batch` on the batch it made and
attaches the verdict (the problem's message, or None) to the batch; the main process then only
reads it (:func:`worker_verdict`) and agrees on it with the other ranks in the step's one vote,
exactly as if it had checked the batch itself. The guarantee is unchanged: a bad batch stops every
rank with the same named error before its forward.

The verdict travels as an attribute of the batch object (the package's ``Batch``, any dataclass
or object with a ``__dict__``); batches that cannot carry one (dicts, tuples) are checked in the
main process as before. A verdict is tied to the model it was checked against by a token, so a
loader wrapped for another model is never trusted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning_torchrec.sharding.features import FeatureSpec, FeatureSpecs
from lightning_torchrec.training.batch_checks import VERDICT_ATTRIBUTE, batch_problem


class CheckingCollate:
    """A ``collate_fn`` that also checks the batch it made (runs in the worker process).

    Args:
        collate: the loader's own ``collate_fn``.
        specs: what each sparse feature may hold (from the unsharded model).
        dense_width: the expected dense width, or None.
        token: identifies the model the verdict is for.
    """

    def __init__(
        self,
        collate: Callable[[Any], Any],
        specs: Mapping[str, FeatureSpec],
        dense_width: int | None,
        token: str,
    ) -> None:
        self.collate = collate
        # A FeatureSpecs (pickled whole into the workers) names unread features once per worker.
        self.specs = specs if isinstance(specs, FeatureSpecs) else FeatureSpecs(specs)
        self.dense_width = dense_width
        self.token = token

    def __call__(self, samples: Any) -> Any:
        """Collates ``samples`` and attaches the batch's verdict to it.

        Args:
            samples: what the loader's sampler fetched.

        Returns:
            The collated batch.
        """
        batch = self.collate(samples)
        problem = batch_problem(batch, self.specs, self.dense_width)
        attributes = getattr(batch, "__dict__", None)
        if isinstance(attributes, dict):
            attributes[VERDICT_ATTRIBUTE] = (self.token, problem)
        return batch


def check_in_workers(
    loader: Any, specs: Mapping[str, FeatureSpec], dense_width: int | None, token: str
) -> bool:
    """Makes ``loader``'s workers check the batches they collate (see the module docstring).

    Only loaders with worker processes are wrapped (without workers the main process collates
    and checks at the same cost); a loader wrapped before (for this or another model) is
    re-wrapped around its original ``collate_fn``.

    Args:
        loader: a ``torch.utils.data.DataLoader`` (anything else is left alone).
        specs: what each sparse feature may hold.
        dense_width: the expected dense width, or None.
        token: identifies the model the verdicts are for.

    Returns:
        Whether the workers now check the batches.
    """
    collate = getattr(loader, "collate_fn", None)
    if getattr(loader, "num_workers", 0) <= 0 or not callable(collate):
        return False
    if isinstance(collate, CheckingCollate):
        collate = collate.collate
    try:
        loader.collate_fn = CheckingCollate(collate, specs, dense_width, token)
    except (AttributeError, ValueError):  # a loader that refuses new attributes
        return False
    return True
