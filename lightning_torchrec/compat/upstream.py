"""Every private or version-sensitive name of torch, TorchRec and fbgemm, in one place.

The rest of the package uses public APIs only and calls these small functions where no public
equivalent exists. Each says why it is needed and since which version its name is stable, so a
dependency upgrade is checked here and nowhere else. Supported: torch 2.11-2.14,
torchrec 1.6.1-1.9, fbgemm-gpu(-cpu) 1.6-1.9, lightning 2.6.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# What DCP reads a tensor's requested part with (torch 2.0+; unchanged through 2.14).
from torch.distributed._shard._utils import narrow_tensor_by_index

# ShardedTensor has no public import path; TorchRec's sharded tables still use it in their
# state dicts (torch 2.0+, unchanged through 2.14).
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import metadata as dcp_metadata

# DCP pickles these two private classes into every ``.metadata`` (torch 2.2+ through 2.14).
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

# The local shape and global offset of a regular DTensor's local tensor; no public equivalent
# (torch 2.4+; same signature through 2.14).
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.fx.experimental.symbolic_shapes import free_symbols
from torchrec.optim.keyed import CombinedOptimizer

__all__ = [
    "assert_async",
    "DCP_METADATA_VERSIONS",
    "DCP_STORAGE_INFO",
    "TORCH_LAYOUT_DECODER",
    "dcp_memory_format",
    "dcp_metadata_classes",
    "narrow_tensor",
    "drop_persistent_iterator",
    "drop_unused_range_constraints",
    "fused_kernels",
    "foreach_norm",
    "kernel_learning_rate",
    "kernel_step",
    "local_shape_and_global_offset",
    "mch_held_ids",
    "planner_topology",
    "set_kernel_step",
    "sharded_tensor_group",
    "sharded_table_views",
    "unwrap_compiled",
]


#: The pickle global by which DCP's ``TensorProperties`` stores its layout: torch's private
#: ``torch.serialization._get_layout`` (torch 1.13+ through 2.14). The safe unpickler of
#: ``lightning_torchrec.checkpoint.safe_load`` maps it to a lookup among torch's layouts instead of
#: calling it.
TORCH_LAYOUT_DECODER = ("torch.serialization", "_get_layout")


#: DCP's private per-chunk file slice (``relative_path``, ``offset``, ``length``), under a
#: public name for the checks of ``lightning_torchrec.checkpoint.dcp_metadata``.
DCP_STORAGE_INFO: type = _StorageInfo


#: The ``Metadata.version`` values of the DCP metadata this package reads: None (torch before
#: 2.4 wrote none) and what the installed DCP writes ("1.0.0" from torch 2.4 through 2.14).
DCP_METADATA_VERSIONS = (None, "1.0.0", CURRENT_DCP_VERSION)


def dcp_metadata_classes() -> dict[tuple[str, str], type]:
    """Every class DCP's ``FileSystemWriter`` pickles into ``.metadata``, by (module, name).

    The allow-list of the restricted unpickler (``lightning_torchrec.checkpoint.unpickle``):
    the public dataclasses of ``torch.distributed.checkpoint.metadata``, the private
    ``_StorageInfo`` (one file slice per chunk) and ``_MEM_FORMAT_ENCODING`` (an enum standing
    in for a memory format). The same set from torch 2.4 through 2.14.

    Returns:
        ``{(module, name): class}``.
    """
    classes = [
        dcp_metadata.Metadata,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata.StorageMeta,
        dcp_metadata.MetadataIndex,
        _MEM_FORMAT_ENCODING,
        _StorageInfo,
    ]
    return {(c.__module__, c.__qualname__): c for c in classes}


def dcp_memory_format(encoding: Any) -> torch.memory_format:
    """The memory format a ``TensorProperties`` pickle stands for by its private enum member.

    Args:
        encoding: a member of DCP's ``_MEM_FORMAT_ENCODING``.

    Returns:
        The memory format.

    Raises:
        ValueError: for anything else.
    """
    formats = {
        _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
        _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
        _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
    }
    if not isinstance(encoding, _MEM_FORMAT_ENCODING):
        raise ValueError(f"not a DCP memory format encoding: {type(encoding).__name__}")
    return formats[encoding]


def narrow_tensor(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of a stored chunk a DCP read item asks for (what ``FileSystemReader`` does).

    Args:
        tensor: the stored chunk.
        offsets: the read item's offsets into it.
        lengths: the read item's lengths.

    Returns:
        A view.
    """
    return narrow_tensor_by_index(tensor, offsets, lengths)


def local_shape_and_global_offset(
    shape: torch.Size, mesh: Any, placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape and global offset of this rank's part of a regular DTensor.

    Args:
        shape: the DTensor's global shape.
        mesh: its device mesh.
        placements: its placements.

    Returns:
        ``(local shape, global offset)``.
    """
    return compute_local_shape_and_global_offset(shape, mesh, placements)


def foreach_norm(
    tensors: list[torch.Tensor], ord: float, dtype: torch.dtype | None
) -> list[torch.Tensor]:
    """Norms of many tensors in one batched kernel (what ``clip_grad_norm_`` uses).

    ``torch._foreach_norm`` is underscored but has been stable since torch 1.13; the public
    ``torch.nn.utils.get_total_norm`` only returns the norm of all tensors together.

    Args:
        tensors: the tensors (same dtype class: all float64 or all lower precision).
        ord: the norm order (1, 2 or ``inf``).
        dtype: accumulate in this dtype (None: the tensors' own).

    Returns:
        One 0-dim tensor per input.
    """
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The module inside a ``torch.compile`` wrapper (``OptimizedModule._orig_mod``), else itself.

    Args:
        module: any module.

    Returns:
        The compiled module's original, or ``module``.
    """
    return getattr(module, "_orig_mod", module)


def mch_held_ids(module: nn.Module) -> torch.Tensor:
    """The raw ids an ``MCHManagedCollisionModule`` holds now (one per filled slot), sorted.

    TorchRec keeps them in the private buffer ``_mch_sorted_raw_ids`` (torchrec 1.6.1 through
    1.9), an empty slot holding ``int64`` max; its public API says only how many slots are open.

    Args:
        module: an ``MCHManagedCollisionModule`` (or its shard on this rank).

    Returns:
        A new ``int64`` tensor of the held raw ids.
    """
    ids = module._mch_sorted_raw_ids
    return ids[ids != torch.iinfo(torch.int64).max]


def sharded_table_views(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """The ShardedTensor/DTensor views a sharded EBC/EC keeps of its tables, without a copy.

    TorchRec's ``ShardedEmbeddingBagCollection`` and ``ShardedEmbeddingCollection`` keep these
    for their state-dict hook (``_model_parallel_name_to_sharded_tensor`` and
    ``_model_parallel_name_to_dtensor``, torchrec 0.6+ through 1.9); their shards are views of
    the fused weights. Building ``state_dict()`` instead recreates ShardedTensor metadata on every
    call.

    Args:
        module: a sharded embedding module.

    Returns:
        ``{"embedding_bags.{table}.weight" or "embeddings.{table}.weight": view}``, or None when
        the module keeps no such views.
    """
    sharded = getattr(module, "_model_parallel_name_to_sharded_tensor", None)
    dtensors = getattr(module, "_model_parallel_name_to_dtensor", None)
    if not (isinstance(sharded, dict) and isinstance(dtensors, dict)):
        return None
    container = "embedding_bags" if hasattr(module, "embedding_bags") else "embeddings"
    return {f"{container}.{t}.weight": v for t, v in {**sharded, **dtensors}.items()}


def fused_kernels(optimizer: Any) -> list[Any]:
    """The fused embedding kernels (fbgemm TBEs) a TorchRec fused optimizer drives, in order.

    ``EmbeddingFusedOptimizer._emb_module`` (torchrec 0.3+ through 1.9) is the only handle on
    the kernel; TorchRec's keyed optimizers nest as ``CombinedOptimizer.optimizers``.

    Args:
        optimizer: a keyed optimizer (combined or fused) or anything else.

    Returns:
        The kernels, empty when ``optimizer`` drives none.
    """
    if isinstance(optimizer, CombinedOptimizer):
        return [k for _, o in optimizer.optimizers for k in fused_kernels(o)]
    kernel = getattr(optimizer, "_emb_module", None)
    return [kernel] if kernel is not None and hasattr(kernel, "iter") else []


def kernel_step(kernel: Any) -> int:
    """A TBE's optimizer step counter (Adam-family bias correction; outside every state dict).

    Args:
        kernel: an fbgemm ``SplitTableBatchedEmbeddingBagsCodegen``.

    Returns:
        ``kernel.iter`` (fbgemm 0.4+ through 1.9).
    """
    return int(kernel.iter.item())


def set_kernel_step(kernel: Any, step: int) -> None:
    """Sets a TBE's step counter: the device counter and its host copy (``iter_cpu``, fbgemm 1.0+).

    Args:
        kernel: an fbgemm TBE.
        step: the value.
    """
    kernel.iter.fill_(step)
    if hasattr(kernel, "iter_cpu"):
        kernel.iter_cpu.fill_(step)


def kernel_learning_rate(kernel: Any) -> float:
    """The learning rate a TBE applies in its next backward (public fbgemm method).

    Args:
        kernel: an fbgemm TBE.

    Returns:
        The learning rate.
    """
    return float(kernel.get_learning_rate())


def drop_persistent_iterator(loader: Any) -> None:
    """Makes a DataLoader's next epoch start a new iterator, reading its sampler anew.

    With ``persistent_workers=True`` a DataLoader keeps its iterator (``DataLoader._iterator``,
    torch 1.7+ through 2.14) from an earlier iteration, and that iterator keeps the index
    sampler it was made with: a sampler installed since would be ignored. Dropping it shuts its
    workers down (the iterator's ``__del__``); the next epoch starts fresh ones.

    Args:
        loader: a ``torch.utils.data.DataLoader`` (anything else is left alone).
    """
    if isinstance(loader, torch.utils.data.DataLoader) and loader._iterator is not None:
        loader._iterator = None


def sharded_tensor_group(tensor: ShardedTensor) -> Any:
    """The process group a ShardedTensor is sharded over (``_process_group``, torch 1.11+).

    Args:
        tensor: a ShardedTensor.

    Returns:
        Its process group, or None.
    """
    return getattr(tensor, "_process_group", None)


def planner_topology(planner: Any) -> Any:
    """The ``Topology`` a TorchRec planner plans for (``_topology``, torchrec 0.2+ through 1.9).

    Args:
        planner: an ``EmbeddingShardingPlanner`` or a user's planner.

    Returns:
        The topology, or None when the planner keeps none.
    """
    return getattr(planner, "_topology", None)


def _symbolic_leaves(value: Any) -> list[Any]:
    """The tensors and symbolic scalars in a node's ``meta["val"]`` (nested lists and tuples)."""
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _symbolic_leaves(v)]
    symbolic = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    return [value] if isinstance(value, symbolic) else []


def drop_unused_range_constraints(program: Any) -> list[str]:
    """Removes the value ranges of symbols that an exported program's graphs no longer use.

    ``torch.export`` (seen in torch 2.13) keeps the range of every unbacked symbol it created
    while tracing, also of values the graph then dropped as dead code: the per-key offsets of
    TorchRec's ``KeyedJaggedTensor`` (``offset_per_key()``: Python ints, one symbol per key and
    one more), which the quantized EBC's forward never reads. ``torch.export.load`` discards such
    ranges and logs a warning for each ("Symbol u5 did not appear in the graph that was
    deserialized"); dropped before saving, the artifact is the same program and loads silently,
    also in a server that never imports this package. ``ExportedProgram.range_constraints`` has
    no setter: its dict is edited in place.

    Args:
        program: a ``torch.export.ExportedProgram``.

    Returns:
        The dropped symbols (or expressions), as strings.
    """
    used: set[Any] = set()
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                used |= set(free_symbols(_symbolic_leaves(node.meta.get("val"))))
    constraints = program.range_constraints
    stale = [key for key in constraints if not set(key.free_symbols) <= used]
    for key in stale:
        del constraints[key]
    return [str(key) for key in stale]


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Fails with ``message`` when a one-element boolean tensor is false, inside a traced graph.

    ``torch._assert_async`` (torch 2.0+, unchanged through 2.14): ``torch.export`` keeps it in
    the exported graph as a side effect (``aten._assert_async.msg``) and it raises a
    ``RuntimeError`` with ``message`` when the program runs; a Python ``if`` on a tensor's value
    cannot be exported. The message is fixed at trace time.

    Args:
        condition: a one-element boolean tensor.
        message: the error's text.
    """
    torch._assert_async(condition, message)


#: The attribute under which TorchRec's ``ManagedCollisionCollection`` (and its sharded form)
#: keeps one managed-collision module per table (torchrec 1.6.1 through 1.9).
_MC_MODULES = "_managed_collision_modules"


def managed_collision_table(key: str) -> str | None:
    """The table whose managed-collision module holds a state-dict entry, or None.

    TorchRec names a managed-collision module's buffers
    ``...{_managed_collision_modules}.{table}.{buffer}`` in a ``state_dict`` (sharded or not).

    Args:
        key: a dotted state-dict key.

    Returns:
        The table's name, or None for an entry of no managed-collision module.
    """
    parts = key.split(".")
    for i, part in enumerate(parts[:-2]):
        if part == _MC_MODULES:
            return parts[i + 1]
    return None


#: An LR scheduler's ``state_dict()`` entries of one value per param group (torch 2.x), the one
#: of them holding the last learning rates, and the nested states of ``SequentialLR`` and
#: ``ChainedScheduler``.
SCHEDULER_GROUP_KEYS = ("base_lrs", "_last_lr", "min_lrs", "max_lrs", "lr_lambdas")
SCHEDULER_LAST_LR = "_last_lr"
SCHEDULER_NESTED = "_schedulers"


def embedding_lookups(module: nn.Module) -> list[nn.Module]:
    """The lookup modules of a sharded EBC/EC, one per sharding type (``_lookups``).

    A lookup's input is the batch's KJT after the input distribution: this rank's ids, local to
    its shards. TorchRec's ``ModelDeltaTracker`` records lookups from
    ``compute_and_output_dist``; a managed-collision collection calls ``compute`` and
    ``output_dist`` of the collection inside it instead (torchrec 1.8), where nothing is
    recorded, so its lookups are watched here.

    Args:
        module: a ``ShardedEmbeddingBagCollection`` or ``ShardedEmbeddingCollection``.

    Returns:
        Its lookup modules (empty for another module).
    """
    lookups = getattr(module, "_lookups", None)
    return [m for m in lookups if isinstance(m, nn.Module)] if lookups is not None else []
