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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec.optim.keyed import KeyedOptimizer

from lightning_torchrec.distributed import agree, barrier, rank_and_world_size
from lightning_torchrec.errors import CheckpointMismatchError, NonFiniteCheckpointError
from lightning_torchrec.faults import nonfinite_tensors
from lightning_torchrec.layout import global_shape
from lightning_torchrec.optim import init_optimizer_state, optimizer_steps, set_optimizer_steps
from lightning_torchrec.tables import table_of_key

META_FILE = "meta.pt"
FORMAT_VERSION = 1
MODEL_KEY = "state_dict"
_PARTIAL_SUFFIX = ".partial"


def _rank() -> int:
    return rank_and_world_size()[0]


def _world() -> int:
    return rank_and_world_size()[1]


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


def check_finite(state: Mapping[str, Any], step: int | None = None) -> None:
    """Refuses, on every rank, a checkpoint whose local weights or optimizer state hold NaN/inf.

    Collective: one small ``all_reduce`` (the names are gathered only on failure).

    Args:
        state: what would be saved (model and optimizer states, nested).
        step: the global step, for the message.

    Raises:
        NonFiniteCheckpointError: on every rank when any rank holds a non-finite value, naming
            the ranks and tensors.
    """
    bad = nonfinite_tensors(state)
    error = None
    if bad:
        names = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
        at = f" at global step {step}" if step is not None else ""
        error = NonFiniteCheckpointError(
            f"refusing to save a checkpoint{at}: non-finite values on rank(s) [{_rank()}]: "
            f"{names}. The previous checkpoint is kept; find where the NaN came from (loss, "
            "learning rate, data)."
        )
    agree(error)


def save_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: list[KeyedOptimizer],
    metadata: dict[str, Any],
    *,
    model_state: dict[str, Any] | None = None,
    check_finite_values: bool = True,
) -> None:
    """Saves a module's (sharded) state, optimizer states and Lightning metadata. Collective.

    Args:
        path: the checkpoint directory (an existing checkpoint or file there is replaced once
            the new one is complete).
        module: the (sharded) module; ``module.state_dict()`` holds ShardedTensors for tables.
        optimizers: keyed optimizers (state keyed by parameter name).
        metadata: the rest of Lightning's checkpoint dict; rank 0 writes it.
        model_state: ``module.state_dict()`` when the caller has built it already.
        check_finite_values: refuse NaN/inf weights and optimizer state (:func:`check_finite`).

    Raises:
        NonFiniteCheckpointError: see :func:`check_finite`; nothing is written.
    """
    path = Path(path)
    model_state = module.state_dict() if model_state is None else model_state
    state: dict[str, Any] = {MODEL_KEY: model_state}
    for i, opt in enumerate(optimizers):
        state[_opt_key(i)] = opt.state_dict()["state"]
    if check_finite_values:
        check_finite(state, metadata.get("global_step"))
    tmp = _partial_dir(path)
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(state, checkpoint_id=tmp)
    torch.save(
        {
            "world_size": _world(),
            "param_groups": [_hyper_params(o) for o in optimizers],
            "optimizer_steps": [optimizer_steps(o) for o in optimizers],
        },
        _param_groups_file(tmp, _rank()),
    )
    barrier()
    if _rank() == 0:
        meta = dict(metadata)
        meta["lightning_torchrec"] = {"format_version": FORMAT_VERSION, "world_size": _world()}
        torch.save(meta, tmp / META_FILE)
        _replace(tmp, path)
    barrier()


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
    if isinstance(value, torch.Tensor):  # ShardedTensor and DTensor too
        return tuple(global_shape(value))
    return None


def _flatten(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings to DCP's dotted keys (``{"a": {"b": t}}`` -> ``{"a.b": t}``)."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


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
    flat = _flatten(state)
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
            tables = sorted({table_of_key(k.split(".", 1)[1]) for k in keys})
            lines.append(f"- {label} ({len(keys)} entries; tables {tables}): {sorted(keys)[:20]}")
    if wrong:
        tables = sorted({table_of_key(w.split(":")[0].split(".", 1)[1]) for w in wrong})
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


def remove_checkpoint(path: str | Path) -> None:
    """Deletes a checkpoint directory (or file) whole.

    Args:
        path: the checkpoint.
    """
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
