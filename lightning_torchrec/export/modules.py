"""The embedding modules the export quantizes, bags and sequences alike.

TorchRec's ``EmbeddingBagCollection`` pools bags of ids; its ``EmbeddingCollection`` returns one
vector per id (sequence models).

Each float module is replaced by its TorchRec quantized twin
(``torchrec.quant.embedding_modules.EmbeddingBagCollection`` / ``EmbeddingCollection``: fbgemm's
``IntNBitTableBatchedEmbeddingBagsCodegen``, pooled or with ``PoolingMode.NONE``), built empty
(one buffer allocated, filled later as the checkpoint streams) with the tables' data type set to
the export dtype. What differs between the two kinds is gathered here: the configs, the
quantized module, where its table rows live (``embedding_bags`` / ``embeddings``) and the id
check of its features.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.quant.embedding_modules import (
    EmbeddingBagCollection as QuantEmbeddingBagCollection,
)
from torchrec.quant.embedding_modules import (
    EmbeddingCollection as QuantEmbeddingCollection,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.export.validate import IdRangeCheck

#: ``--dtype`` name to TorchRec's table data type.
DTYPES: dict[str, DataType] = {
    "int8": DataType.INT8,
    "int4": DataType.INT4,
    "fp16": DataType.FP16,
    "fp32": DataType.FP32,
}

#: fbgemm pads every row to this many bytes on the CPU (its own CPU default; TorchRec's
#: quantized modules default to 16, a GPU cache-line choice that would waste up to 15 bytes a
#: row).
CPU_ROW_ALIGNMENT = 1

#: The float embedding modules the export replaces.
EMBEDDING_MODULES = (EmbeddingBagCollection, EmbeddingCollection)

#: The quantized modules that replace them (their tables are dropped before tracing).
QUANTIZED_MODULES = (QuantEmbeddingBagCollection, QuantEmbeddingCollection)


def table_configs(module: nn.Module) -> list[BaseEmbeddingConfig]:
    """The table configs of a float ``EmbeddingBagCollection`` or ``EmbeddingCollection``.

    Args:
        module: the embedding module.

    Returns:
        Its configs, in table order.
    """
    if isinstance(module, EmbeddingBagCollection):
        return list(module.embedding_bag_configs())
    return list(module.embedding_configs())


def rows_attribute(module: nn.Module) -> str:
    """Where a (float or quantized) embedding module keeps its tables in ``state_dict()``.

    Args:
        module: the embedding module.

    Returns:
        ``"embedding_bags"`` for bags, ``"embeddings"`` for an ``EmbeddingCollection``.
    """
    bags = (EmbeddingBagCollection, QuantEmbeddingBagCollection)
    return "embedding_bags" if isinstance(module, bags) else "embeddings"


def empty_quantized(module: nn.Module, dtype: str) -> nn.Module:
    """The quantized twin of a float embedding module, its table buffer not yet written.

    Args:
        module: the float ``EmbeddingBagCollection`` or ``EmbeddingCollection`` (any device,
            meta included: nothing is read from its tables).
        dtype: a :data:`DTYPES` name.

    Returns:
        TorchRec's quantized module on the CPU, fp32 outputs, rows aligned to
        :data:`CPU_ROW_ALIGNMENT`.
    """
    configs = copy.deepcopy(table_configs(module))
    for config in configs:
        config.data_type = DTYPES[dtype]
    # No weights given: fbgemm allocates the (quantized) buffer once, uninitialised; every table
    # is written into it as it streams from the checkpoint.
    if isinstance(module, EmbeddingBagCollection):
        return QuantEmbeddingBagCollection(
            tables=configs,
            is_weighted=module.is_weighted(),
            device=torch.device("cpu"),
            output_dtype=torch.float,
            row_alignment=CPU_ROW_ALIGNMENT,
        )
    return QuantEmbeddingCollection(
        tables=configs,
        device=torch.device("cpu"),
        need_indices=module.need_indices(),
        output_dtype=torch.float,
        row_alignment=CPU_ROW_ALIGNMENT,
    )


def table_rows(quantized: nn.Module) -> dict[str, torch.Tensor]:
    """Each table's rows in a quantized module's buffer, as writable ``uint8 [rows, bytes]``.

    Args:
        quantized: from :func:`empty_quantized`.

    Returns:
        ``{table: rows}`` (int4 tables are wrapped in ``UInt4Tensor``, whose ``.view(uint8)``
        is the raw bytes).
    """
    tables = getattr(quantized, rows_attribute(quantized))
    return {name: holder.weight.view(torch.uint8) for name, holder in tables.items()}


def id_check(module: nn.Module) -> IdRangeCheck:
    """The id check of an embedding module's features: each against its table's rows.

    Args:
        module: the float embedding module.

    Returns:
        The check.
    """
    return IdRangeCheck(
        {f: (c.name, c.num_embeddings) for c in table_configs(module) for f in c.feature_names}
    )


def takes_weights(root: nn.Module, collections: dict[str, nn.Module]) -> bool:
    """Whether the served model reads per-id weights from its input ``KeyedJaggedTensor``.

    A weighted ``EmbeddingBagCollection`` inside a ``FeatureProcessedEmbeddingBagCollection``
    gets its weights from the feature processors (position weights, say), not from the input.

    Args:
        root: the module the paths are relative to.
        collections: ``{path: float embedding module}``.

    Returns:
        True when a weighted bag collection is fed the input's weights.
    """
    for path, module in collections.items():
        if not (isinstance(module, EmbeddingBagCollection) and module.is_weighted()):
            continue
        owner_path = path.rpartition(".")[0]
        owner = root.get_submodule(owner_path) if owner_path else None
        if not isinstance(owner, FeatureProcessedEmbeddingBagCollection):
            return True
    return False


def strip_table_buffers(model: nn.Module) -> None:
    """Drops the quantized modules' per-table buffers before tracing.

    They are views of fbgemm's weight buffer kept for ``state_dict()``; the forward reads the
    buffer itself, which tracing captures as a constant. Serialising both would store every
    table twice.

    Args:
        model: the quantized model (changed in place).
    """
    for sub in model.modules():
        if isinstance(sub, QUANTIZED_MODULES):
            attr = rows_attribute(sub)
            names = list(getattr(sub, attr))
            setattr(sub, attr, nn.ModuleDict({name: nn.Module() for name in names}))


def _describe(value: Any) -> str:
    if isinstance(value, KeyedJaggedTensor):
        weights = ", weights=float32" if value.weights_or_none() is not None else ""
        return (
            f"KeyedJaggedTensor(keys={list(value.keys())}, values={value.values().dtype}, "
            f"lengths={value.lengths().dtype}{weights})".replace("torch.", "")
        )
    if isinstance(value, torch.Tensor):  # the first dimension is the batch
        dims = ", ".join(["B", *map(str, value.shape[1:])])
        return f"{str(value.dtype).replace('torch.', '')} [{dims}]"
    if isinstance(value, tuple | list):
        return f"({', '.join(_describe(v) for v in value)})"
    return type(value).__name__


def describe_call(model: nn.Module, args: tuple[Any, ...] | None) -> str:
    """What the exported model takes and returns, for the side file: from the traced inputs.

    Args:
        model: the quantized model (before tracing).
        args: the positional inputs it was traced or checked with, or None (TorchScript
            without example inputs: the signature of its ``forward`` is shown).

    Returns:
        ``"forward(float32 [B, 13], KeyedJaggedTensor(keys=[...], ...)) -> float32 [B, 1]"``.
    """
    if args is None:
        return f"forward{inspect.signature(model.forward)}"
    with torch.inference_mode():
        output = model(*args)
    return f"forward({', '.join(_describe(a) for a in args)}) -> {_describe(output)}"
