"""Quantizing a sharded checkpoint's tables into TorchRec's quantized modules, one table at a time.

The model is rebuilt for inference from the checkpoint's hyper-parameters
(:func:`build_module`, :func:`inference_model`); its ``EmbeddingBagCollection`` s and
``EmbeddingCollection`` s are replaced by TorchRec's quantized twins (fbgemm's row-wise int8/int4
with a per-row fp16 scale and bias, or fp16/fp32 rows; see
:mod:`lightning_torchrec.export.modules`), whose buffers are allocated once and filled as each
table is streamed from the checkpoint (:func:`quantize_from_checkpoint`): at most one table is
held in float. Each sits behind the id check of :mod:`lightning_torchrec.export.validate`;
:mod:`lightning_torchrec.export.artifact` traces and saves the result.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel as DMP
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_configs import DATA_TYPE_NUM_BITS, BaseEmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from lightning_torchrec.checkpoint import (
    iter_plain_tensors,
    load_meta,
    meta_tensors,
    plain_tensor_index,
)
from lightning_torchrec.checkpoint.unsharded import constructor_args
from lightning_torchrec.errors import CheckpointMismatchError
from lightning_torchrec.export.fresh import SCALE_BIAS_BYTES, encode_rows
from lightning_torchrec.export.managed import (
    MANAGED_MODULES,
    managed_sources,
    managed_tables,
    raw_id_bounds,
    served_managed,
)
from lightning_torchrec.export.modules import (
    CPU_ROW_ALIGNMENT,
    DTYPES,
    EMBEDDING_MODULES,
    empty_quantized,
    id_check,
    rows_attribute,
    table_configs,
    table_rows,
    takes_weights,
)
from lightning_torchrec.export.validate import CheckedEmbeddings
from lightning_torchrec.sharding.tables import dense_width, table_bytes, table_of_key

#: fbgemm's row-wise quantizer (``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``) needs the
#: packed row to be a whole number of 2-byte words: int8 rows need an even width, int4 rows a
#: width divisible by 4.
DIM_MULTIPLE: dict[str, int] = {"int8": 2, "int4": 4, "fp16": 1, "fp32": 1}


#: Rows quantized per fbgemm call (bounds the temporary copies to a few MiB per table).
CHUNK_ROWS = 65536


def resolve_class(path: str) -> type:
    """Imports a class from a dotted path ``pkg.mod.Class``.

    Args:
        path: the dotted path.

    Returns:
        The class.

    Raises:
        ImportError: if the module cannot be imported or lacks the attribute, naming both.
        TypeError: if the path names something that is not a class.
    """
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"--module {path!r}: expected a dotted path 'pkg.mod.Class'")
    try:
        owner = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"--module {path!r}: cannot import module {module_name!r} ({err})"
        ) from err
    if not hasattr(owner, attr):
        raise ImportError(f"--module {path!r}: module {module_name!r} has no attribute {attr!r}")
    cls = getattr(owner, attr)
    if not isinstance(cls, type):
        raise TypeError(f"--module {path!r} is a {type(cls).__name__}, not a class")
    return cls


def build_module(
    checkpoint: str | Path, module: str | type | nn.Module, key: bytes | str | None = None
) -> nn.Module:
    """The (LightningModule) instance to export, built from the checkpoint's hyper-parameters.

    A class must be an ``nn.Module`` (e.g. ``LightningModule``) subclass: the checkpoint's
    hyper-parameters are passed to its constructor, which for any other class (say, one that
    runs a command) would let the checkpoint choose what runs.

    Args:
        checkpoint: the sharded checkpoint directory (its ``meta.pt`` holds Lightning's
            ``hyper_parameters``, read with ``weights_only=True``).
        module: a dotted class path, a class, or an instance (used as is).
        key: the key the checkpoint must be signed with.

    Returns:
        The module (tables typically still on the meta device).

    Raises:
        ImportError: for an unknown dotted path (see :func:`resolve_class`).
        TypeError: if the class is not an ``nn.Module`` subclass (nothing is built), cannot
            be built from the saved hyper-parameters, or the instance is sharded.
    """
    if isinstance(module, nn.Module):
        sharded = [(p, m) for p, m in module.named_modules() if isinstance(m, ShardedModule | DMP)]
        if sharded:
            raise TypeError(
                f"{type(module).__name__} is sharded ({sharded[0][0] or 'it'} is a "
                f"{type(sharded[0][1]).__name__}): pass its class or an unsharded instance"
            )
        return module
    cls = resolve_class(module) if isinstance(module, str) else module
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(
            f"--module {getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)} is "
            "not a LightningModule (or torch.nn.Module) subclass; it is not built from the "
            "checkpoint's hyper-parameters"
        )
    saved = load_meta(checkpoint, key=key).get("hyper_parameters") or {}
    if not isinstance(saved, dict) or not all(isinstance(k, str) for k in saved):
        raise TypeError(f"{checkpoint}: its hyper_parameters are not a dict of arguments")
    hparams = constructor_args(saved)
    try:
        return cls(**hparams)
    except TypeError as err:
        raise TypeError(
            f"cannot build {cls.__module__}.{cls.__qualname__} from the checkpoint's saved "
            f"hyper_parameters {sorted(hparams)}: {err}. Pass an instance instead."
        ) from err


def inference_model(module: nn.Module) -> nn.Module:
    """The part of a (Lightning) module that is exported.

    Args:
        module: the LightningModule (or any module).

    Returns:
        ``module.inference_model()`` when defined; else ``module.model_and_loss.model``
        (``TorchRecModule`` and ``DLRMClickModule``); else ``module``.
    """
    chooser = getattr(module, "inference_model", None)
    if callable(chooser):
        return chooser()
    wrapped = getattr(module, "model_and_loss", None)
    inner = getattr(wrapped, "model", None)
    return inner if isinstance(inner, nn.Module) else module


def _check_dims(dtype: str, configs: list[BaseEmbeddingConfig]) -> None:
    multiple = DIM_MULTIPLE[dtype]
    bad = [f"{c.name} (dim {c.embedding_dim})" for c in configs if c.embedding_dim % multiple]
    if bad:
        raise ValueError(
            f"dtype {dtype} needs table widths divisible by {multiple} (fbgemm packs each "
            f"quantized row in 2-byte words); these tables cannot use it: {bad}. "
            f"Use {'int8 or ' if dtype == 'int4' else ''}fp16."
        )


def quantized_row_bytes(dtype: str, dim: int) -> int:
    """Bytes of one quantized table row on the CPU (data, scale/bias, padding).

    Args:
        dtype: a :data:`DTYPES` name.
        dim: the table width.

    Returns:
        The row size.
    """
    data = dim * DATA_TYPE_NUM_BITS[DTYPES[dtype]] // 8
    extra = SCALE_BIAS_BYTES if dtype in ("int8", "int4") else 0
    size = data + extra
    return -(-size // CPU_ROW_ALIGNMENT) * CPU_ROW_ALIGNMENT


@torch.no_grad()
def _write_quantized(rows: torch.Tensor, table: torch.Tensor, dtype: str) -> None:
    """Quantizes a float table into its TBE rows (``rows``: uint8 ``[N, row bytes]``).

    TorchRec's ``quantize_state_dict`` does the same for a whole module: fbgemm's quantizer
    puts scale and bias after the data, the TBE stores them first (:func:`encode_rows`, which a
    served model kept fresh by deltas uses for the rows it writes).
    """
    for start in range(0, table.shape[0], CHUNK_ROWS):
        encoded = encode_rows(table[start : start + CHUNK_ROWS], dtype)
        rows[start : start + CHUNK_ROWS, : encoded.shape[1]].copy_(encoded)


def _module_paths(root: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in root.named_modules(remove_duplicate=False)}


def _set_submodule(root: nn.Module, path: str, value: nn.Module, target: nn.Module) -> None:
    # Also any reference the exported model holds to it: an inference_model() wrapper may hold
    # the module directly rather than through the LightningModule's attribute.
    old = root.get_submodule(path)
    for owner in (root, target):
        for _, parent in owner.named_modules(remove_duplicate=False):
            for attr, child in list(parent.named_children()):
                if child is old:
                    setattr(parent, attr, value)


def _check_checkpoint(
    checkpoint: Path, expected: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]]
) -> None:
    missing = sorted(k for k in expected if k not in stored)
    extra = sorted(k for k in stored if k not in expected)
    wrong = [
        f"{k}: checkpoint {list(stored[k])}, model {list(expected[k])}"
        for k in sorted(expected)
        if k in stored and tuple(stored[k]) != tuple(expected[k])
    ]
    if not (missing or extra or wrong):
        return
    lines = [f"{checkpoint} is not a checkpoint of this model:"]
    for label, keys in (("missing from the checkpoint", missing), ("not in the model", extra)):
        if keys:
            tables = sorted({table_of_key(k) for k in keys if table_of_key(k) != k})
            lines.append(f"- {label}: tables {tables}; entries {keys[:20]}")
    if wrong:
        tables = sorted({table_of_key(w.split(":")[0]) for w in wrong})
        lines.append(f"- shapes differ (tables {tables}): " + "; ".join(wrong[:20]))
    raise CheckpointMismatchError("\n".join(lines))


def quantize_from_checkpoint(
    checkpoint: str | Path,
    module: str | type | nn.Module,
    dtype: str = "int8",
    verify: bool = True,
    key: bytes | str | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """The inference model of a checkpoint, tables quantized, in one process, no process group.

    Everything is checked before any tensor is read (keys, shapes, dtype and table widths).
    Tables stream from the checkpoint one at a time and are quantized into the quantized
    module's buffers; dense tensors are loaded in fp32. A managed-collision module's remapping
    state is read into it, then it is replaced by its served form (``export.managed``).

    Args:
        checkpoint: a sharded checkpoint directory.
        module: a dotted class path (built from the checkpoint's hyper-parameters), a class, or
            an instance.
        dtype: ``"int8"``, ``"int4"``, ``"fp16"`` or ``"fp32"`` (tables only).
        verify: check the checkpoint's files against its checksum manifest first.
        key: the key the checkpoint must be signed with (see
            ``lightning_torchrec.checkpoint.signing``).

    Returns:
        ``(model in eval mode, facts)`` where facts holds ``tables`` (``{name: (rows, dim)}``;
        a name that tables of two collections share as ``"<collection path>/<name>"``),
        ``float_table_bytes``, ``quantized_table_bytes``, ``features`` (KJT keys in table
        order), ``feature_tables``, ``sequence_features`` (those of ``EmbeddingCollection`` s:
        one vector per id), ``weighted`` (the input carries per-id weights: a feature processor's
        weights are made inside), ``dense_width``, ``table_rows`` (``{name: uint8 [rows,
        bytes]}``: each a view of its quantized module's fbgemm buffer), ``managed``
        (``{remap path: managed_sources(...)}``: each served remap's tables and the buffers of
        the inference model a delta carries their state in).

    Raises:
        ValueError: for an unknown dtype, table widths the dtype cannot pack, or
            managed-collision state not in row-wise shards whose number divides the buckets.
        CheckpointMismatchError: if the checkpoint holds another model, naming the tables.
        FileNotFoundError: if ``checkpoint`` is not a sharded checkpoint directory.
        ImportError: for an unknown module path.
        TypeError: if the module holds no TorchRec ``EmbeddingBagCollection`` or
            ``EmbeddingCollection``, or a managed-collision table the artifact cannot hold (not
            an ``MCHManagedCollisionModule``, or one with an ``input_hash_func``), naming it.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    checkpoint = Path(checkpoint)
    entries = plain_tensor_index(checkpoint, verify=verify, key=key)  # refuses a non-checkpoint
    root = build_module(checkpoint, module, key)
    target = inference_model(root)
    paths = _module_paths(root)
    collections: dict[str, nn.Module] = {}
    managed: dict[str, nn.Module] = {}  # managed-collision modules around some collections
    for _, sub in target.named_modules():
        if isinstance(sub, EMBEDDING_MODULES + MANAGED_MODULES):
            if id(sub) not in paths:
                raise TypeError(
                    f"the exported model's {type(sub).__name__} is not a submodule of the "
                    "module the checkpoint was saved from, so its checkpoint keys are unknown"
                )
        if isinstance(sub, MANAGED_MODULES):
            managed_tables(sub)  # refuses what cannot be served, before anything is read
            managed[paths[id(sub)]] = sub
        elif isinstance(sub, EMBEDDING_MODULES):
            collections[paths[id(sub)]] = sub
    if not collections:
        raise TypeError(
            f"{type(target).__name__} holds no TorchRec EmbeddingBagCollection or "
            "EmbeddingCollection"
        )
    named = [(path, c) for path, module in collections.items() for c in table_configs(module)]
    configs = [c for _, c in named]
    _check_dims(dtype, configs)

    expected = {k: tuple(v.shape) for k, v in root.state_dict().items()}
    _check_checkpoint(checkpoint, expected, {k: tuple(v.size) for k, v in entries.items()})

    # Quantized modules first (one quantized buffer each), then stream the checkpoint.
    rows_of: dict[str, torch.Tensor] = {}
    quantized_at: dict[str, nn.Module] = {}
    views: dict[tuple[str, str], torch.Tensor] = {}  # (collection path, table): its rows
    for path, module in collections.items():
        quantized = quantized_at[path] = empty_quantized(module, dtype)
        prefix = f"{path}.{rows_attribute(module)}." if path else f"{rows_attribute(module)}."
        for name, rows in table_rows(quantized).items():
            rows_of[f"{prefix}{name}.weight"] = rows
            views[(path, name)] = rows
        # The float module (meta or not) is dropped here; the served model checks its ids first
        # (a managed-collision one: its raw ids, in front of the remap; see below).
        inside = any(path.startswith(f"{m}.") for m in managed)
        served = quantized if inside else CheckedEmbeddings(id_check(module), quantized)
        _set_submodule(root, path, served, target)
    table_prefixes = tuple(f"{p}." if p else "" for p in collections)
    tensors = iter_plain_tensors(checkpoint, verify=False, key=key)
    with torch.no_grad():
        for key, tensor in tensors:  # (the signing key was bound above)
            if key in rows_of:
                _write_quantized(rows_of.pop(key), tensor, dtype)
            elif key.startswith(table_prefixes) and table_of_key(key) != key:
                continue  # other state of an embedding module: not used for inference
            else:
                owner_path, _, name = key.rpartition(".")
                owner = root.get_submodule(owner_path) if owner_path else root
                current = getattr(owner, name)
                if isinstance(current, torch.Tensor) and current.is_meta:
                    value = tensor.to(current.dtype)
                    if isinstance(current, nn.Parameter):
                        value = nn.Parameter(value, requires_grad=current.requires_grad)
                    setattr(owner, name, value)
                else:
                    current.copy_(tensor)
            del tensor
    # The MCH modules now hold the checkpoint's remapping state (every shard's, by global row).
    raw_ids: dict[str, int] = {}
    within = {id(m): n for n, m in target.named_modules()}  # paths in the inference model
    remaps: dict[str, list[dict[str, Any]]] = {}  # served remap: where deltas carry its state
    for path, module in managed.items():
        raw_ids.update(raw_id_bounds(module))
        at = within[id(module)]
        remaps[f"{at}.remap" if at else "remap"] = managed_sources(module, at)
        inner = next(p for p in quantized_at if p.startswith(f"{path}."))
        _set_submodule(root, path, served_managed(module, quantized_at[inner]), target)
    left = meta_tensors(target)
    if left:
        raise CheckpointMismatchError(f"tensors of the model without values: {left}")
    target.eval()
    features = [f for c in configs for f in c.feature_names]
    names = [c.name for c in configs]  # a name two collections share is qualified by the path
    by_name = {c.name if names.count(c.name) == 1 else f"{p}/{c.name}": c for p, c in named}
    facts = {
        "tables": {name: (c.num_embeddings, c.embedding_dim) for name, c in by_name.items()},
        "float_table_bytes": sum(table_bytes(c) for c in configs),
        "quantized_table_bytes": sum(
            c.num_embeddings * quantized_row_bytes(dtype, c.embedding_dim) for c in configs
        ),
        "features": features,
        "feature_tables": [
            {"feature": f, "table": c.name, "rows": c.num_embeddings, "dim": c.embedding_dim}
            | ({"raw_ids": raw_ids[f], "remapped": True} if f in raw_ids else {})
            for c in configs
            for f in c.feature_names
        ],
        "weighted": takes_weights(root, collections),
        "sequence_features": [
            f
            for m in collections.values()
            if not isinstance(m, EmbeddingBagCollection)
            for c in table_configs(m)
            for f in c.feature_names
        ],
        "dense_width": dense_width(root),
        "example_inputs": getattr(root, "example_inputs", None),
        "managed": remaps,
        "table_rows": {
            c.name if names.count(c.name) == 1 else f"{p}/{c.name}": views[(p, c.name)]
            for p, c in named
        },
    }
    return target, facts
