"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory:

- DCP files (``.metadata`` and ``__{rank}_{i}.distcp``): the module state (every rank writes the
  shards it owns; replicated tensors are written once) and the optimizer *state* (the fused
  optimizer's per-row state is sharded like its table);
- ``param_groups.rank{r}.pt``: rank ``r``'s optimizer hyper-parameters. Fused param groups name
  rank-local tables and DCP keeps one rank's copy of non-tensor values, so they are kept per rank;
- ``meta.pt``: Lightning's own checkpoint entries (loops, callbacks, schedulers, ...), written by
  rank 0 last, so a directory without it is an incomplete checkpoint.

Everything is collective: every rank must call :func:`save_sharded` / :func:`load_sharded`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torchrec.optim.keyed import KeyedOptimizer

META_FILE = "meta.pt"
FORMAT_VERSION = 1
_MODEL_KEY = "state_dict"


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


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory.

    Args:
        path: a checkpoint path.

    Returns:
        True when it is a directory holding DCP metadata and Lightning's metadata.
    """
    p = Path(path)
    return p.is_dir() and (p / ".metadata").is_file() and (p / META_FILE).is_file()


def _hyper_params(optimizer: KeyedOptimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def save_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: list[KeyedOptimizer],
    metadata: dict[str, Any],
) -> None:
    """Saves a module's (sharded) state, optimizer states and Lightning metadata. Collective.

    Args:
        path: the checkpoint directory (created; an existing file there is replaced).
        module: the (sharded) module; ``module.state_dict()`` holds ShardedTensors for tables.
        optimizers: keyed optimizers (state keyed by parameter name).
        metadata: the rest of Lightning's checkpoint dict; rank 0 writes it.
    """
    path = Path(path)
    if _rank() == 0:
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        (path / META_FILE).unlink(missing_ok=True)
    _barrier()
    state: dict[str, Any] = {_MODEL_KEY: module.state_dict()}
    for i, opt in enumerate(optimizers):
        state[_opt_key(i)] = opt.state_dict()["state"]
    dcp.save(state, checkpoint_id=path)
    torch.save(
        {"world_size": _world(), "param_groups": [_hyper_params(o) for o in optimizers]},
        _param_groups_file(path, _rank()),
    )
    _barrier()
    if _rank() == 0:
        meta = dict(metadata)
        meta["lightning_torchrec"] = {"format_version": FORMAT_VERSION, "world_size": _world()}
        torch.save(meta, path / META_FILE)


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


def load_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: list[KeyedOptimizer],
    *,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Loads a checkpoint written by :func:`save_sharded` in place. Collective.

    Args:
        path: the checkpoint directory.
        module: the (sharded) module to load into.
        optimizers: keyed optimizers to load into (may be empty: weights only).
        weights_only: load Lightning's metadata with ``torch.load(weights_only=...)``.

    Returns:
        Lightning's metadata (the checkpoint dict without model and optimizer states).

    Raises:
        FileNotFoundError: if ``path`` is not a complete sharded checkpoint.
        KeyError: if the checkpoint lacks the optimizer states to load.
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a complete sharded checkpoint (a directory with DCP '.metadata' and "
            f"'{META_FILE}'); it may be missing or its save was interrupted."
        )
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model_sd = module.state_dict()
    state: dict[str, Any] = {_MODEL_KEY: model_sd}
    for i, opt in enumerate(optimizers):
        init_optimizer_state(opt)
        target = opt.state_dict()["state"]
        if target and not any(k.startswith(_opt_key(i)) for k in stored):
            raise KeyError(
                f"{path} holds no state for optimizer {i} (saved with weights only?); "
                "load it with `trainer.validate/test(ckpt_path=...)` or start a new fit."
            )
        state[_opt_key(i)] = target
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
    module.load_state_dict(model_sd)
    for i, opt in enumerate(optimizers):
        opt.load_state_dict({"state": state[_opt_key(i)]})
        _load_hyper_params(path, i, opt)
    return meta


def _load_hyper_params(path: Path, index: int, optimizer: KeyedOptimizer) -> None:
    own = _param_groups_file(path, _rank())
    source = own if own.is_file() else _param_groups_file(path, 0)
    saved = torch.load(source, map_location="cpu", weights_only=True)
    if index >= len(saved["param_groups"]):
        return
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
