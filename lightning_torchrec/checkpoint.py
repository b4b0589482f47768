"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory:

- DCP files (``.metadata`` and ``__{rank}_{i}.distcp``): the module state (every rank writes the
  shards it owns; replicated tensors are written once) and the optimizer *state* (the fused
  optimizer's per-row state is sharded like its table);
- ``param_groups.rank{r}.pt``: rank ``r``'s optimizer hyper-parameters and fused-kernel step
  counters. Fused param groups name rank-local tables and DCP keeps one rank's copy of non-tensor
  values, so they are kept per rank;
- ``meta.pt``: Lightning's own checkpoint entries (loops, callbacks, schedulers, ...), written by
  rank 0 last.

Saving is atomic: every rank writes into a hidden sibling directory (``.{name}.partial``, which
matches no checkpoint pattern), and rank 0 moves it to its final name only once ``meta.pt`` is
written. An interrupted save leaves the previous checkpoint of that name untouched.

Loading reshards: a checkpoint written under one plan or world size loads under another (DCP
copies by global offsets). Before reading anything, the checkpoint's keys and global shapes are
checked against the target, so a checkpoint of another model fails naming the tables.

Everything is collective: every rank must call :func:`save_sharded` / :func:`load_sharded`.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

META_FILE = "meta.pt"
FORMAT_VERSION = 1
MODEL_KEY = "state_dict"
_PARTIAL_SUFFIX = ".partial"


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors do not fit the model or optimizer it is loaded into."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _opt_key(i: int) -> str:
    return f"optimizer_{i}"


def _param_groups_file(path: Path, rank: int) -> Path:
    return path / f"param_groups.rank{rank}.pt"


def _partial_dir(path: Path) -> Path:
    return path.parent / f".{path.name}{_PARTIAL_SUFFIX}"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory.

    Args:
        path: a checkpoint path.

    Returns:
        True when it is a directory holding DCP metadata and Lightning's metadata (written last,
        so a directory whose save was interrupted is not a checkpoint).
    """
    p = Path(path)
    return p.is_dir() and (p / ".metadata").is_file() and (p / META_FILE).is_file()


def _hyper_params(optimizer: KeyedOptimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _fused_kernels(optimizer: Any) -> list[Any]:
    """The fused embedding kernels (TBEs) a keyed optimizer drives, in a stable order."""
    if isinstance(optimizer, CombinedOptimizer):
        return [k for _, o in optimizer.optimizers for k in _fused_kernels(o)]
    emb = getattr(optimizer, "_emb_module", None)
    return [emb] if emb is not None and hasattr(emb, "iter") else []


def optimizer_steps(optimizer: KeyedOptimizer) -> list[int]:
    """The step counters of the fused kernels (used by Adam-family fused optimizers).

    Args:
        optimizer: a keyed optimizer, typically ``DenseAndFusedOptimizer``.

    Returns:
        One counter per fused kernel; they live outside every state dict.
    """
    return [int(k.iter.item()) for k in _fused_kernels(optimizer)]


def set_optimizer_steps(optimizer: KeyedOptimizer, step: int) -> None:
    """Sets every fused kernel's step counter (the device counter and its host copy).

    Args:
        optimizer: a keyed optimizer, typically ``DenseAndFusedOptimizer``.
        step: the counter value; every kernel of one run advances in lock step.
    """
    for kernel in _fused_kernels(optimizer):
        kernel.iter.fill_(step)
        if hasattr(kernel, "iter_cpu"):
            kernel.iter_cpu.fill_(step)


def save_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: list[KeyedOptimizer],
    metadata: dict[str, Any],
) -> None:
    """Saves a module's (sharded) state, optimizer states and Lightning metadata. Collective.

    Args:
        path: the checkpoint directory (an existing checkpoint or file there is replaced once
            the new one is complete).
        module: the (sharded) module; ``module.state_dict()`` holds ShardedTensors for tables.
        optimizers: keyed optimizers (state keyed by parameter name).
        metadata: the rest of Lightning's checkpoint dict; rank 0 writes it.
    """
    path = Path(path)
    tmp = _partial_dir(path)
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    state: dict[str, Any] = {MODEL_KEY: module.state_dict()}
    for i, opt in enumerate(optimizers):
        state[_opt_key(i)] = opt.state_dict()["state"]
    dcp.save(state, checkpoint_id=tmp)
    torch.save(
        {
            "world_size": _world(),
            "param_groups": [_hyper_params(o) for o in optimizers],
            "optimizer_steps": [optimizer_steps(o) for o in optimizers],
        },
        _param_groups_file(tmp, _rank()),
    )
    _barrier()
    if _rank() == 0:
        meta = dict(metadata)
        meta["lightning_torchrec"] = {"format_version": FORMAT_VERSION, "world_size": _world()}
        torch.save(meta, tmp / META_FILE)
        _replace(tmp, path)
    _barrier()


def _replace(src: Path, dst: Path) -> None:
    """Moves the complete directory ``src`` to ``dst``, removing what was there."""
    if dst.is_dir():
        old = dst.parent / f".{dst.name}.old"
        if old.exists():
            shutil.rmtree(old)
        dst.rename(old)
        src.rename(dst)
        shutil.rmtree(old)
    else:
        if dst.exists():
            dst.unlink()
        src.rename(dst)


def init_optimizer_state(optimizer: KeyedOptimizer) -> None:
    """Materialises lazily created optimizer state so a checkpoint can be loaded into it.

    Torch optimizers create state at their first step; a load target without state would
    restore nothing, silently. Runs the dense optimizer once on zero gradients (the loaded
    weights and state overwrite whatever that step did) and clears the gradients again.

    Args:
        optimizer: a keyed optimizer, typically ``DenseAndFusedOptimizer``.
    """
    from lightning_torchrec.optim import DenseAndFusedOptimizer

    dense = optimizer.dense if isinstance(optimizer, DenseAndFusedOptimizer) else optimizer
    params = [p for p in dense.params.values() if p.requires_grad]
    if params and len(dense.state) < len(params):
        dense.init_state()
        for p in params:
            p.grad = None


def load_meta(path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """Reads Lightning's metadata of a checkpoint, refusing code unless told otherwise.

    Args:
        path: the checkpoint directory.
        weights_only: ``torch.load(weights_only=...)``; keep True for checkpoints you did not
            write yourself.

    Returns:
        Lightning's checkpoint dict without model and optimizer states.

    Raises:
        pickle.UnpicklingError: if the metadata holds objects other than tensors and plain
            containers (e.g. a pickled function), naming the file.
    """
    file = Path(path) / META_FILE
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(
            f"Refusing to load {file}: it holds objects that are not tensors or plain data "
            "(loading them could run code). If you wrote this checkpoint yourself and trust it, "
            f"load it with `weights_only=False` (e.g. `trainer.fit(..., weights_only=False)`).\n"
            f"torch.load said: {err}"
        ) from err


def _global_shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Tensor) or hasattr(value, "metadata"):
        return tuple(value.size())
    return None


def _table_of(key: str) -> str:
    """The table a state key belongs to (``...embedding_bags.t_cat_0.weight`` -> ``t_cat_0``)."""
    parts = key.split(".")
    for marker in ("embedding_bags", "embeddings"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1]
    return key


def check_compatible(
    path: str | Path, state: dict[str, Any], what: str, allow_extra: bool = False
) -> None:
    """Checks that a checkpoint holds every tensor of ``state`` with the same global shape.

    Args:
        path: the checkpoint directory.
        state: the nested load target, e.g. ``{"state_dict": module.state_dict()}``.
        what: what is checked, for the message (``"model"`` or ``"optimizer 0"``).
        allow_extra: accept checkpoint entries the target lacks (fused optimizer state is keyed
            by the tables a rank owns, so each rank's target names only some of them).

    Raises:
        CheckpointMismatchError: naming missing, unexpected and mis-shaped entries (by table).
    """
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(state)
    prefixes = {k.split(".", 1)[0] + "." for k in flat} or {f"{k}." for k in state}
    missing, wrong = [], []
    for key, value in flat.items():
        shape = _global_shape(value)
        if key not in stored:
            missing.append(key)
        elif shape is not None and isinstance(stored[key], TensorStorageMetadata):
            if tuple(stored[key].size) != shape:
                wrong.append(f"{key}: checkpoint {list(stored[key].size)}, target {list(shape)}")
    extra = [
        k
        for k in stored
        if not allow_extra and any(k.startswith(p) for p in prefixes) and k not in flat
    ]
    if not (missing or wrong or extra):
        return
    lines = [f"{path} does not match the {what} it is loaded into:"]
    for label, keys in (("missing from the checkpoint", missing), ("not in the target", extra)):
        if keys:
            tables = sorted({_table_of(k.split(".", 1)[1]) for k in keys})
            lines.append(f"- {label} ({len(keys)} entries; tables {tables}): {sorted(keys)[:20]}")
    if wrong:
        tables = sorted({_table_of(w.split(":")[0].split(".", 1)[1]) for w in wrong})
        lines.append(f"- shapes differ (tables {tables}): " + "; ".join(wrong[:20]))
    raise CheckpointMismatchError("\n".join(lines))


def load_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: list[KeyedOptimizer],
    *,
    weights_only: bool = True,
    load_optimizer_states: bool = True,
) -> dict[str, Any]:
    """Loads a checkpoint written by :func:`save_sharded` in place, resharding. Collective.

    Args:
        path: the checkpoint directory.
        module: the (sharded) module to load into.
        optimizers: keyed optimizers to load into (may be empty: weights only).
        weights_only: load Lightning's metadata with ``torch.load(weights_only=...)``.
        load_optimizer_states: False loads the weights, the hyper-parameters and step counters
            but leaves the optimizer *state* as it is (e.g. after a plan change that reshapes the
            fused optimizer's state).

    Returns:
        Lightning's metadata (the checkpoint dict without model and optimizer states).

    Raises:
        FileNotFoundError: if ``path`` is not a complete sharded checkpoint.
        CheckpointMismatchError: if the model or the optimizer state does not fit the checkpoint.
        pickle.UnpicklingError: if the metadata holds code and ``weights_only`` is True.
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a complete sharded checkpoint (a directory with DCP '.metadata' and "
            f"'{META_FILE}'); it may be missing or its save was interrupted."
        )
    meta = load_meta(path, weights_only=weights_only)
    model_sd = module.state_dict()
    state: dict[str, Any] = {MODEL_KEY: model_sd}
    check_compatible(path, state, "model")
    for i, opt in enumerate(optimizers if load_optimizer_states else []):
        init_optimizer_state(opt)
        target = opt.state_dict()["state"]
        try:
            check_compatible(path, {_opt_key(i): target}, f"optimizer {i}", allow_extra=True)
        except CheckpointMismatchError as err:
            raise CheckpointMismatchError(
                f"{err}\nThe optimizer state cannot be carried over (another model, or a plan "
                "that reshapes the fused optimizer state). To continue from the weights with "
                "fresh optimizer state, pass `TorchRecStrategy(load_optimizer_states=False)` "
                "(or `load_sharded(..., load_optimizer_states=False)`)."
            ) from None
        state[_opt_key(i)] = target
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
    module.load_state_dict(model_sd)
    for i, opt in enumerate(optimizers):
        if _opt_key(i) in state:
            opt.load_state_dict({"state": state[_opt_key(i)]})
        _load_hyper_params(path, i, opt)
    return meta


def _load_hyper_params(path: Path, index: int, optimizer: KeyedOptimizer) -> None:
    own = _param_groups_file(path, _rank())
    source = own if own.is_file() else _param_groups_file(path, 0)
    saved = torch.load(source, map_location="cpu", weights_only=True)
    if index >= len(saved["param_groups"]):
        return
    steps = saved.get("optimizer_steps", [])
    if index < len(steps) and steps[index]:
        set_optimizer_steps(optimizer, max(steps[index]))
    groups = saved["param_groups"][index]
    current = list(optimizer.param_groups)
    if len(groups) != len(current):
        # Another plan or world size: groups do not line up one to one. Hyper-parameters are
        # the same for every group of one optimizer type, so apply the first saved group.
        groups = [groups[0]] * len(current) if groups else []
    for group, values in zip(current, groups, strict=True):
        for k, v in values.items():
            if k in group:
                group[k] = v


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """Sets ``epoch`` on every sampler of ``dataloader`` that has ``set_epoch``.

    Args:
        dataloader: a DataLoader (or anything with ``sampler``/``batch_sampler``).
        epoch: the epoch about to be iterated.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), batch_sampler):
        for s in (sampler, getattr(sampler, "sampler", None)):
            if callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)


def keyed_optimizer(optimizer: Any) -> KeyedOptimizer:
    """The keyed optimizer behind a (Lightning-wrapped) optimizer.

    Args:
        optimizer: an optimizer, possibly a ``LightningOptimizer``.

    Returns:
        The ``KeyedOptimizer`` (state keyed by parameter name, as checkpoints need).

    Raises:
        TypeError: for a plain torch optimizer, saying how to fix ``configure_optimizers``.
    """
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if not isinstance(opt, KeyedOptimizer):
        raise TypeError(
            f"TorchRecStrategy checkpoints keyed optimizers; got {type(opt).__name__}. Return "
            "the optimizer from `combine_optimizers(...)` in configure_optimizers."
        )
    return opt


def remove_checkpoint(path: str | Path) -> None:
    """Deletes a checkpoint directory (or file) whole.

    Args:
        path: the checkpoint.
    """
    import shutil

    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
