"""From a sharded checkpoint directory to plain tensors and a ready unsharded model, in one process.

:func:`iter_plain_tensors` reads the unsharded model's tensors one at a time (verified, safely
unpickled, no process group); :func:`load_unsharded` (and ``TorchRecModule.load_from_checkpoint``)
builds a ready model from them, tables on the meta device materialised on the CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_torchrec.checkpoint.common import MODEL_KEY, check_is_checkpoint, dcp_error
from lightning_torchrec.checkpoint.folder import UNVERIFIED, CheckpointFolder
from lightning_torchrec.checkpoint.lenient import report
from lightning_torchrec.checkpoint.limits import CheckpointLimits
from lightning_torchrec.checkpoint.mc_layout import check_managed_collision_layout
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from lightning_torchrec.compat.upstream import ShardedTensor
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)
from lightning_torchrec.sharding.layout import copy_into_shards, global_shape


def _open(
    checkpoint: Path, verify: bool, key: bytes | str | None, limits: CheckpointLimits | None
) -> tuple[CheckpointFolder, dict[str, TensorStorageMetadata], Any]:
    """The folder, its model tensors and metadata; every file verified first when ``verify``."""
    check_is_checkpoint(checkpoint)
    folder = CheckpointFolder(checkpoint, key=key, limits=limits)
    damaged = None
    metadata = None
    try:  # a file that would run code is named first, then checksum failures
        metadata = folder.metadata()
    except (UnsafeCheckpointError, CheckpointLimitError):
        raise
    except CheckpointCorruptError as err:
        damaged = err
    if verify:
        if folder.unverified():
            warnings.warn(UNVERIFIED.format(path=checkpoint), UserWarning, stacklevel=3)
        folder.verify()
    if damaged is not None:
        raise damaged
    prefix = MODEL_KEY + "."
    entries = {
        k[len(prefix) :]: v
        for k, v in sorted(metadata.state_dict_metadata.items())
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }
    return folder, entries, metadata


def plain_tensor_index(
    checkpoint: str | Path,
    verify: bool = True,
    *,
    key: bytes | str | None = None,
    limits: CheckpointLimits | None = None,
) -> dict[str, TensorStorageMetadata]:
    """The model tensors of a sharded checkpoint: state-dict key to DCP's shape and dtype.

    One process, no process group.

    Args:
        checkpoint: a sharded checkpoint directory (a ``file://`` URL is its local path).
        verify: check every file against the checksum manifest first (a checkpoint without one
            warns that it cannot be verified; format 2 without one is refused). ``.metadata`` is
            verified in any case before it is parsed.
        key: the key the checkpoint must be signed with (see
            :func:`~lightning_torchrec.checkpoint.signing.resolve_key`).
        limits: the reading limits.

    Returns:
        ``{state-dict key: TensorStorageMetadata}`` in key order.

    Raises:
        FileNotFoundError: if ``checkpoint`` is not a complete sharded checkpoint.
        ValueError: if ``checkpoint`` is a URL of another file system (``s3://...``).
        CheckpointCorruptError: if a file is damaged, truncated or missing, naming it.
        UnsafeCheckpointError: if the DCP metadata would run code, naming the global.
        CheckpointMismatchError: if ``checkpoint`` is a single-file checkpoint.
        CheckpointLimitError: if a file is larger, or expands further, than the limits.
    """
    return _open(local_path(checkpoint), verify, key, limits)[1]


def iter_plain_tensors(
    checkpoint: str | Path,
    verify: bool = True,
    *,
    key: bytes | str | None = None,
    limits: CheckpointLimits | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the unsharded model's tensors one at a time from a sharded checkpoint.

    Runs in one process without a process group; only the tensor being yielded is in memory.
    Files are checked against their checksums first and nothing is unpickled unsafely; every
    tensor is covered exactly once by its chunks, so no element is left uninitialised.

    Args:
        checkpoint: a sharded checkpoint directory (a ``file://`` URL is its local path).
        verify: check the checksums first (see :func:`plain_tensor_index`).
        key: the key the checkpoint must be signed with.
        limits: the reading limits.

    Yields:
        ``(state-dict key, plain tensor)`` pairs in key order.

    Raises:
        FileNotFoundError: if ``checkpoint`` is not a complete sharded checkpoint.
        ValueError: if ``checkpoint`` is a URL of another file system (``s3://...``).
        CheckpointCorruptError: if a file is damaged, truncated or missing, naming it.
        UnsafeCheckpointError: if the DCP metadata would run code, naming the global.
    """
    checkpoint = local_path(checkpoint)
    folder, entries, metadata = _open(checkpoint, verify, key, limits)
    reader = SafeFileSystemReader(checkpoint, metadata, folder)
    for name, meta in entries.items():
        tensor = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
        try:
            with warnings.catch_warnings():
                # DCP warns on every single-process load, even when asked for one (no_dist=True).
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(
                    {MODEL_KEY: {name: tensor}},
                    storage_reader=reader,
                    planner=SafeLoadPlanner(),
                    no_dist=True,
                )
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - named below
            raise dcp_error(err, checkpoint, writing=False) from err
        yield name, tensor


def _is_plain_meta(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, ShardedTensor | DTensor)
        and value.is_meta
    )


def meta_tensors(module: nn.Module) -> list[str]:
    """Parameters and buffers of a module still on the meta device (no values).

    Args:
        module: a module.

    Returns:
        Their names.
    """
    named = chain(module.named_parameters(), module.named_buffers())
    return [name for name, t in named if _is_plain_meta(t)]


@torch.no_grad()
def check_fits(
    target: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], strict: bool = True
) -> tuple[list[str], list[str]]:
    """Checks that tensors of ``shapes`` fit a state dict (the keys, with ``strict``, and shapes).

    Args:
        target: the module's state dict (its tensors may be on the meta device, or sharded).
        shapes: the global shape of every source tensor.
        strict: also require the same keys.

    Returns:
        ``(missing, unexpected)``: the target's tensors the source lacks, and the source's
        tensors the target lacks (both empty with ``strict``).

    Raises:
        CheckpointMismatchError: naming the missing, unexpected and misshapen keys.
    """
    keys = [k for k, v in target.items() if isinstance(v, torch.Tensor)]
    missing = [k for k in keys if k not in shapes]
    extra = [k for k in shapes if k not in target]
    wrong = [
        f"{k}: source {list(shapes[k])}, model {list(global_shape(target[k]))}"
        for k in keys
        if k in shapes and tuple(global_shape(target[k])) != tuple(shapes[k])
    ]
    if wrong or (strict and (missing or extra)):
        raise CheckpointMismatchError(
            f"the weights do not fit the model: missing {missing}, unexpected {extra}, "
            f"shapes differ: {wrong}"
        )
    return missing, extra


def fill_plain(
    module: nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    strict: bool = True,
) -> list[str]:
    """Loads whole tensors into a module, one at a time; each rank copies only its shards.

    Works on an unsharded module (tensors on the meta device take the loaded tensor, on the
    CPU) and on a sharded one (ShardedTensor/DTensor tables: this rank's shards are filled).

    Args:
        module: the module (tables may be on the meta device, or sharded).
        shapes: the global shape of every tensor ``tensors`` will yield, checked before any is
            read.
        tensors: ``(state-dict key, whole tensor)`` pairs.
        strict: raise when the source lacks a tensor of the module or has one it lacks.

    Returns:
        The keys loaded.

    Raises:
        CheckpointMismatchError: on missing/unexpected keys (``strict``), a shape mismatch, or
            tensors left on the meta device, naming them (before anything is loaded, except
            for the tensors left on meta).
    """
    target = module.state_dict()
    check_fits(target, shapes, strict)
    on_meta = set(meta_tensors(module))
    loaded = []
    for key, tensor in tensors:
        if key not in target:
            continue
        if key in on_meta:  # a table built on the meta device: take the tensor
            module.load_state_dict({key: tensor}, strict=False, assign=True)
        else:
            copy_into_shards({key: tensor}, {key: target[key]})
        loaded.append(key)
    left = meta_tensors(module)
    if left:
        raise CheckpointMismatchError(
            f"these tensors of the model are still on the meta device (no values; the source "
            f"does not hold them): {left}"
        )
    return loaded


def constructor_args(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """A module's constructor arguments from the ``hyper_parameters`` saved with it.

    LightningCLI (the demo) saves how it built the module next to its arguments, under keys
    with a leading underscore (``_instantiator``, ``_class_path``), which no argument has. They
    are left out: the class is the caller's, and nothing is imported on the checkpoint's behalf.

    Args:
        hparams: the saved hyper-parameters.

    Returns:
        The arguments.
    """
    return {k: v for k, v in hparams.items() if not k.startswith("_")}


def load_unsharded(
    checkpoint: str | Path,
    module: nn.Module | type[nn.Module],
    *,
    strict: bool | None = True,
    weights_only: bool = True,
    key: bytes | str | None = None,
    limits: CheckpointLimits | None = None,
    on_build: Callable[[Any, dict[str, Any]], None] | None = None,
    **init_args: Any,
) -> Any:
    """A ready, unsharded model from a sharded checkpoint directory, in one process.

    No process group is needed. Tables created on the meta device are materialised on the CPU.
    Every tensor is read one at a time (:func:`iter_plain_tensors`: files verified against their
    checksums, nothing unpickled unsafely), so memory stays near the model's size.
    ``TorchRecModule.load_from_checkpoint(directory)`` calls this.

    Args:
        checkpoint: a sharded checkpoint directory (a ``file://`` URL is its local path).
        module: a module to fill in place, or a module class (e.g. a LightningModule) to build
            from the checkpoint's saved ``hyper_parameters`` (updated with ``init_args``). Its
            ``configure_model`` hook, where it has one, runs first, as under Lightning.
        strict: raise when the checkpoint lacks a tensor of the model or has one it lacks (False:
            both are left alone and listed in a warning; a shape mismatch is always refused).
            None: the module's ``strict_loading`` (a LightningModule's) decides, else True.
        weights_only: read ``meta.pt`` (the hyper-parameters) with ``weights_only``.
        key: the key the checkpoint must be signed with.
        limits: the reading limits.
        on_build: called with the module and the checkpoint's metadata (``meta.pt``: the
            checkpoint dict without the tensors) before any tensor is loaded, e.g. Lightning's
            ``on_load_checkpoint``.
        **init_args: constructor arguments overriding the saved hyper-parameters (class only).

    Returns:
        The module, on the CPU, in the mode it was built in (call ``.eval()`` to predict).

    Raises:
        TypeError: if ``init_args`` are given with a module instance.
        CheckpointMismatchError: if the model does not fit the checkpoint, naming the keys.
        ManagedCollisionLayoutError: if a managed-collision table was saved sharded over more
            than one rank (its state is per shard), naming the tables; nothing is loaded.
        CheckpointCorruptError: if a file is damaged, truncated or missing, naming it.
        UnsafeCheckpointError: if a file would run code when loaded, naming it.
        FileNotFoundError: if ``checkpoint`` is not a complete sharded checkpoint.
        ValueError: if ``checkpoint`` is a URL of another file system (``s3://...``).
    """
    checkpoint = local_path(checkpoint)
    folder, entries, metadata = _open(checkpoint, True, key, limits)
    shapes = {k: tuple(v.size) for k, v in entries.items()}
    meta = folder.meta(weights_only) if isinstance(module, type) or on_build else {}
    if isinstance(module, type):
        hparams = meta.get("hyper_parameters") or {}
        if not isinstance(hparams, dict) or not all(isinstance(k, str) for k in hparams):
            raise CheckpointCorruptError(f"{checkpoint}: its hyper_parameters are not a dict")
        args = {**constructor_args(hparams), **init_args}
        # The hyper-parameters come from the file: the model they describe is built on the meta
        # device first (no memory) and checked against the checkpoint's shapes, so a crafted
        # width cannot make the real build allocate without bound.
        try:
            with torch.device("meta"):
                probe = _configured(module(**args))
        except Exception:  # noqa: BLE001 - a constructor that cannot run on meta: build it
            probe = None
        if probe is not None:
            check_fits(probe.state_dict(), shapes, _strict(strict, probe))
            del probe
        module = _configured(module(**args))
    elif init_args:
        raise TypeError(f"constructor arguments {sorted(init_args)} need a class, not a module")
    else:
        module = _configured(module)
    strict = _strict(strict, module)
    if on_build is not None:
        on_build(module, meta)
    target = {f"{MODEL_KEY}.{k}": v for k, v in module.state_dict().items()}
    check_managed_collision_layout(checkpoint, target, metadata)
    missing, unexpected = check_fits(module.state_dict(), shapes, strict)
    tensors = iter_plain_tensors(checkpoint, verify=False, key=key, limits=limits)
    fill_plain(module, shapes, tensors, strict)
    report(checkpoint, missing, unexpected, 0)
    return module


def _configured(module: Any) -> Any:
    """``module`` after its ``configure_model`` hook, as Lightning runs it before a fit or a load.

    A LightningModule may build its layers (its tables) there rather than in ``__init__``;
    Lightning asks the hook to do nothing when they exist already.
    """
    hook = getattr(module, "configure_model", None)
    if callable(hook):
        hook()
    return module


def _strict(strict: bool | None, module: nn.Module) -> bool:
    return bool(getattr(module, "strict_loading", True)) if strict is None else strict
