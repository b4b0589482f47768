"""``fabric.save``/``fabric.load`` of ``TorchRecFabricStrategy``: sharded DCP directories.

Fabric hands the strategy a dict of modules, optimizers and plain values. The (one) sharded
module and the optimizers go to :func:`lightning_torchrec.checkpoint.save_sharded` exactly as the
Trainer glue passes its LightningModule and optimizers, and the plain values (the
``state_dict()`` of an object that has one, such as an LR scheduler) become the checkpoint's
metadata (``meta.pt``), so the directory is the same format with the same
guarantees (atomic, verified, loaded without running code, resharded to another plan or world
size). A checkpoint written here resumes under the Trainer's ``TorchRecStrategy`` when the
module's parameter names match the LightningModule's, and the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric import __version__ as lightning_version
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torchrec.optim.keyed import KeyedOptimizer

from lightning_torchrec.checkpoint import load_sharded, save_sharded
from lightning_torchrec.checkpoint.hyper_params import scheduler_state
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.sharding.tables import unwrap
from lightning_torchrec.training.optim import keyed_optimizer

#: Entries the Trainer needs to resume a checkpoint (absent ones are written empty).
TRAINER_ENTRIES: dict[str, Any] = {
    "lr_schedulers": [],
    "pytorch-lightning_version": lightning_version,
}


def is_stateful(value: Any) -> bool:
    """Whether Fabric saves ``value`` as its ``state_dict()`` (an LR scheduler, a sampler, ...).

    Fabric's own strategies save any object with ``state_dict()`` and ``load_state_dict()`` by
    its state and load it back in place; this strategy does the same.

    Args:
        value: a plain (non-module, non-optimizer) entry of Fabric's state.

    Returns:
        True for such an object (not a class).
    """
    return (
        not isinstance(value, type)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def load_stateful(obj: Any, saved: Any, optimizers: list[KeyedOptimizer]) -> None:
    """Loads an object's saved state in place; an LR scheduler's matched to this rank's groups.

    ``meta.pt`` holds rank 0's ``state_dict()``. A scheduler of the combined optimizer lists one
    value per param group, and another rank may drive another number of fused kernels: its
    lists are matched to this rank's groups as the Trainer does for ``lr_schedulers``.

    Args:
        obj: the object in Fabric's state (e.g. an LR scheduler).
        saved: its state from the checkpoint.
        optimizers: the keyed optimizers loaded with it.
    """
    scheduled = getattr(obj, "optimizer", None)
    if isinstance(obj, LRScheduler) and isinstance(saved, dict) and scheduled is not None:
        keyed = keyed_optimizer(scheduled) if isinstance(scheduled, Optimizer) else None
        if any(keyed is o for o in optimizers):
            saved = scheduler_state(saved, keyed, obj.state_dict())
    obj.load_state_dict(saved)


def split_state(
    state: Mapping[str, Any], sharded: nn.Module | None
) -> tuple[nn.Module, list[KeyedOptimizer], dict[str, Any]]:
    """Splits Fabric's state dict into the sharded module, the optimizers and plain values.

    Args:
        state: ``{name: module | optimizer | value}`` as Fabric passes it (unwrapped).
        sharded: the strategy's ``DistributedModelParallel``.

    Returns:
        The module inside the DMP, the keyed optimizers (in the order of ``state``), and the
        remaining entries.

    Raises:
        ValueError: when ``state`` holds no module, another module than the set-up one, or
            more than one module.
    """
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    if len(modules) != 1 or sharded is None or unwrap(modules[0]) is not unwrap(sharded):
        raise ValueError(
            "A TorchRec checkpoint holds exactly one module: the one `fabric.setup_module` "
            f"sharded; got {len(modules)} module(s) in the state "
            f"{sorted(k for k, v in state.items() if isinstance(v, nn.Module))}."
        )
    optimizers = [keyed_optimizer(v) for v in state.values() if isinstance(v, Optimizer)]
    plain = {k: v for k, v in state.items() if not isinstance(v, (nn.Module, Optimizer))}
    return unwrap(modules[0]), optimizers, plain


def save_fabric_checkpoint(strategy: Any, path: Any, state: dict[str, Any]) -> None:
    """Writes a sharded checkpoint directory (every rank writes its shards). Collective.

    Args:
        strategy: the ``TorchRecFabricStrategy`` (its run, set-up module and settings).
        path: the checkpoint directory (rank 0's path is used by every rank).
        state: the model (the set-up one), optimizers and plain values to save; an object with
            ``state_dict()`` and ``load_state_dict()`` (an LR scheduler) is saved as its
            ``state_dict()``, as Fabric's own strategies do.

    Raises:
        ValueError: see :func:`split_state`.
        NonFiniteCheckpointError: for NaN/inf weights or optimizer state; nothing is written.
        BatchValidationError: when a batch judged a step late was bad (on every rank).
    """
    runner = strategy.run.runner
    if runner is not None:  # a batch judged a step late never reaches a checkpoint
        runner.settle()
    target = local_path(strategy.run.collective(strategy.broadcast, str(path)))
    module, optimizers, plain = split_state(state, strategy.dmp)
    values = {k: v.state_dict() if is_stateful(v) else v for k, v in plain.items()}
    save_sharded(
        target,
        module,
        optimizers,
        {**TRAINER_ENTRIES, **values},
        check_finite_values=strategy.check_finite_checkpoints,
    )


def load_fabric_checkpoint(
    strategy: Any, path: Any, state: Any, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Loads a sharded checkpoint in place, resharding to this plan and world. Collective.

    Args:
        strategy: the ``TorchRecFabricStrategy`` (after ``setup_module``).
        path: a checkpoint directory written by this strategy or ``TorchRecStrategy``.
        state: the set-up module, or ``{name: module | optimizer | value}``; plain values are
            replaced by the checkpoint's (in place), objects with ``load_state_dict()`` (an LR
            scheduler) load theirs.
        strict: raise when a plain value of ``state`` is not in the checkpoint, or the model
            and the checkpoint do not hold the same tensors (False: see
            :mod:`~lightning_torchrec.checkpoint.lenient`; a shape mismatch is refused).
        weights_only: read the metadata with ``torch.load(weights_only=...)`` (default True;
            tensors are always read without running code).

    Returns:
        The checkpoint's plain values that ``state`` did not ask for.

    Raises:
        ValueError: without a module to load into.
        KeyError: with ``strict``, for a plain value the checkpoint lacks.
    """
    if isinstance(state, nn.Module):
        state = {"model": state}
    if not isinstance(state, dict):
        raise ValueError(
            "fabric.load of a sharded TorchRec checkpoint needs the objects to load into: "
            "`fabric.load(path, {'model': model, 'optimizer': optimizer, ...})`."
        )
    target = local_path(strategy.run.collective(strategy.broadcast, str(path)))
    module, optimizers, plain = split_state(state, strategy.dmp)
    meta = load_sharded(
        target,
        module,
        optimizers,
        weights_only=True if weights_only is None else weights_only,
        load_optimizer_states=strategy.load_optimizer_states,
        strict=strict,
    )
    schedulers = meta.get("lr_schedulers")
    if optimizers and isinstance(schedulers, list):  # rank 0's groups, matched to this rank's
        meta["lr_schedulers"] = [
            scheduler_state(s, optimizers[0]) if isinstance(s, dict) else s for s in schedulers
        ]
    missing = [k for k in plain if k not in meta]
    if strict and missing:
        raise KeyError(f"the checkpoint {target} holds no {missing}")
    for key, value in plain.items():
        if key in meta and is_stateful(value):  # e.g. an LR scheduler, loaded in place
            load_stateful(value, meta.pop(key), optimizers)
        elif key in meta:
            state[key] = meta.pop(key)
    return meta
