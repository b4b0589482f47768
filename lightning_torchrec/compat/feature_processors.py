"""TorchRec's feature-processed embedding bag collections, read (torchrec 1.6.1 through 1.9).

A ``FeatureProcessedEmbeddingBagCollection`` wraps a weighted ``EmbeddingBagCollection`` and the
feature processors that make the per-id weights it reads: they replace whatever weights the
batch carries (unsharded, the processors' outputs alone reach the collection; row-wise sharded,
``modify_input_for_feature_processor`` overwrites the batch's weights in place). A
``PositionWeightedModule(max_feature_length=N)`` (or a ``PositionWeightedModuleCollection``)
looks each id's weight up by its position in its sample (``torch.gather``), so a sample holding
more than ``N`` ids of its feature fails deep inside the forward (``index N is out of bounds``;
on CUDA, a device-side assert).

The collection has no public accessor for its inner collection or for its processors by feature
(``split()`` builds a new wrapper around them); the attribute names read below are the same in
every supported version (checked in the installed sources).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torchrec.modules.feature_processor_ import (
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

__all__ = ["ProcessedCollection", "processed_collections"]


@dataclass(frozen=True)
class ProcessedCollection:
    """One ``FeatureProcessedEmbeddingBagCollection`` of a model.

    Attributes:
        embeddings: its inner (weighted) embedding bag collection, whose weights the feature
            processors make: the batch needs none for its features.
        max_ids: ``{feature: (limit, what sets it)}`` for each feature whose processor looks
            its weights up by position: a sample may hold at most ``limit`` ids of it.
    """

    embeddings: nn.Module
    max_ids: dict[str, tuple[int, str]]


def _limits(processors: nn.Module) -> dict[str, tuple[int, str]]:
    """``{feature: (limit, what sets it)}`` of the position-weighted processors.

    Another ``FeatureProcessorsCollection``, or another processor, sets no limit known here.
    """
    limits: dict[str, tuple[int, str]] = {}
    if isinstance(processors, PositionWeightedModuleCollection):
        for feature, weight in processors.position_weights.items():
            n = int(weight.shape[0])
            by = f"PositionWeightedModuleCollection(max_feature_lengths={{{feature!r}: {n}}})"
            limits[feature] = (n, by)
    elif isinstance(processors, nn.ModuleDict):  # one processor per feature
        for feature, processor in processors.items():
            if isinstance(processor, PositionWeightedModule):
                n = int(processor.position_weight.shape[0])
                limits[feature] = (n, f"PositionWeightedModule(max_feature_length={n})")
    return limits


def processed_collections(model: nn.Module) -> list[ProcessedCollection]:
    """Every unsharded ``FeatureProcessedEmbeddingBagCollection`` of ``model``, in model order.

    Args:
        model: an unsharded model (parameters may be on the meta device).

    Returns:
        One entry per collection: its inner collection and the per-sample id limits its
        position-weighted processors set.
    """
    return [
        ProcessedCollection(
            module._embedding_bag_collection,
            _limits(module._feature_processors),
        )
        for module in model.modules()
        if isinstance(module, FeatureProcessedEmbeddingBagCollection)
    ]
