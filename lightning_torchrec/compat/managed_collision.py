"""TorchRec's managed-collision internals the export reads (torchrec 1.6.1 through 1.9).

A ``ManagedCollisionEmbeddingCollection`` (or ``...BagCollection``) has no public accessor for
its managed-collision modules, its inner embedding module or whether it returns the remapped
features; an ``MCHManagedCollisionModule`` keeps its remapping state (sorted raw ids, the row of
each, the row-wise shard boundaries) and its input hash function in private attributes. The
names below are the same in every supported version (checked in the installed sources).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import MCHManagedCollisionModule

__all__ = ["ManagedParts", "MchState", "managed_parts", "mch_state"]


@dataclass(frozen=True)
class ManagedParts:
    """What a managed-collision embedding module is made of.

    Attributes:
        embeddings: the inner ``EmbeddingCollection`` / ``EmbeddingBagCollection``.
        modules: the managed-collision module of each table, by table name.
        return_remapped: whether its ``forward`` returns the remapped features as well.
    """

    embeddings: nn.Module
    modules: dict[str, nn.Module]
    return_remapped: bool


def managed_parts(module: BaseManagedCollisionEmbeddingCollection) -> ManagedParts:
    """The parts of a managed-collision embedding module.

    Args:
        module: a ``ManagedCollisionEmbeddingCollection`` or ``...BagCollection``.

    Returns:
        Its parts.
    """
    collection = module._managed_collision_collection
    return ManagedParts(
        embeddings=module._embedding_module,
        modules=dict(collection._managed_collision_modules.items()),
        return_remapped=bool(module._return_remapped_features),
    )


@dataclass(frozen=True)
class MchState:
    """An ``MCHManagedCollisionModule``'s remapping state, as in its (unsharded) ``state_dict``.

    Attributes:
        sorted_raw_ids: ``[rows]`` int64: each row-wise shard's slice holds the raw ids it
            admitted, sorted, an empty slot holding ``int64`` max.
        rows: ``[rows]`` int64: the global row of each of those ids.
        segments: the shard boundaries ``[0, ..., rows]`` (TorchRec pads them with -1).
        output_segments: the buffer they are read from (``[rows + 1]`` or longer, -1 padded).
        hash_func: the input hash function applied to raw ids before the remap, if any.
    """

    sorted_raw_ids: torch.Tensor
    rows: torch.Tensor
    segments: list[int]
    output_segments: torch.Tensor
    hash_func: Callable[..., torch.Tensor] | None


def mch_state(module: MCHManagedCollisionModule) -> MchState:
    """The remapping state of an MCH module (as loaded from a checkpoint).

    Args:
        module: the module.

    Returns:
        Its state (the tensors themselves, not copies).
    """
    segments = [int(s) for s in module._output_segments_tensor.tolist() if int(s) >= 0]
    return MchState(
        sorted_raw_ids=module._mch_sorted_raw_ids,
        rows=module._mch_remapped_ids_mapping,
        segments=segments,
        output_segments=module._output_segments_tensor,
        hash_func=module._input_hash_func,
    )
