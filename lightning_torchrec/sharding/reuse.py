"""A model's sharding lives with the model: reused by a later fit, freed with the model.

A module is sharded once (``DistributedModelParallel`` replaces its embedding modules in place);
a second ``Trainer.fit``, a fine-tune stage or a standalone ``validate`` of the same module reuses
that sharding. The record of it is kept on the module itself (not in a process-wide registry), so
dropping the last reference to the model (and to the trainer, which holds it) frees the model,
its shards and its optimizer state together: nothing outlives what owns it.

A later request for a *different* sharding of a live model (another plan, constraints, sharders,
planner or fused optimizer) is refused with
:class:`~lightning_torchrec.errors.ShardingConflictError` naming the difference; only a new fused
learning rate applies in place.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from lightning_torchrec.errors import ShardingConflictError
from lightning_torchrec.sharding.sharders import resolve_fused_params

#: The instance attribute holding a model's :class:`ShardingRecord` (in ``vars(model)``; not a
#: submodule, parameter or buffer, so it is in no ``state_dict``).
RECORD_ATTRIBUTE = "lightning_torchrec_sharding"


class ShardingRecord:
    """What sharding a model built, attached to that model.

    Copies of the model (``copy.deepcopy``, pickling) get an empty record: a copy is not sharded.

    Args:
        model: the model that was sharded.
        sharded: what :func:`~lightning_torchrec.sharding.planning.shard_model` built.
        config: the :class:`~lightning_torchrec.sharding.planning.ShardingConfig` it used.
    """

    def __init__(self, model: nn.Module | None = None, sharded: Any = None, config: Any = None):
        self.owner = weakref.ref(model) if model is not None else None
        self.sharded = sharded
        self.config = config

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return ShardingRecord, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardingRecord:
        return ShardingRecord()


def attach(model: nn.Module, sharded: Any, config: Any) -> None:
    """Records on ``model`` that it was sharded (see the module docstring).

    Args:
        model: the unsharded model that ``sharded.dmp`` wraps.
        sharded: the ``ShardedModel``.
        config: the ``ShardingConfig`` used.
    """
    vars(model)[RECORD_ATTRIBUTE] = ShardingRecord(model, sharded, config)


def recorded(model: nn.Module) -> ShardingRecord | None:
    """The record of ``model``'s sharding, or None if this very object was never sharded.

    Args:
        model: a model.

    Returns:
        The record, or None.
    """
    record = vars(model).get(RECORD_ATTRIBUTE)
    if isinstance(record, ShardingRecord) and record.owner is not None and record.owner() is model:
        return record
    return None


def detach(model: nn.Module) -> None:
    """Forgets ``model``'s sharding record (its ``DistributedModelParallel`` is then unreachable).

    Args:
        model: a sharded model.
    """
    vars(model).pop(RECORD_ATTRIBUTE, None)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable equality count as different
        return False


def _sharders_key(sharders: Any) -> list[tuple[str, Any]]:
    return [(type(s).__name__, getattr(s, "fused_params", None)) for s in sharders]


def _fused_settings(fused_params: dict[str, Any] | None) -> dict[str, Any]:
    """The effective fused optimizer settings (defaults filled in), without the learning rate."""
    try:
        settings = resolve_fused_params(fused_params)
    except ValueError:  # an unknown optimizer name: compared as given (and refused later)
        settings = dict(fused_params or {})
    return {k: v for k, v in settings.items() if k != "learning_rate"}


def config_differences(old: Any, new: Any, plan_in_use: Any) -> list[str]:
    """What a new sharding configuration asks for that the model's sharding does not have.

    Arguments left unset (None) in ``new`` ask for nothing. A new fused ``learning_rate`` is not
    a difference (it applies in place).

    Args:
        old: the ``ShardingConfig`` the model was sharded with.
        new: the ``ShardingConfig`` of the new request.
        plan_in_use: the plan the model is sharded by.

    Returns:
        One line per difference, naming the argument (empty: the sharding can be reused).
    """
    found = []
    if new.plan is not None and not _same(new.plan, plan_in_use):
        found.append("plan: another ShardingPlan than the one the model is sharded by")
    if new.constraints is not None and not _same(new.constraints, old.constraints):
        old_c, new_c = old.constraints or {}, new.constraints
        tables = sorted(t for t in set(old_c) | set(new_c) if not _same(old_c.get(t), new_c.get(t)))
        found.append(f"constraints: different for table(s) {tables}")
    if new.planner is not None and new.planner is not old.planner:
        found.append(f"planner: another planner ({type(new.planner).__name__})")
    if new.sharders is not None and not (
        new.sharders is old.sharders or _sharders_key(new.sharders) == _sharders_key(old.sharders)
    ):
        found.append("sharders: other sharders (or fused_params) than the model was sharded with")
    if new.fused_params is not None:
        old_f = _fused_settings(old.fused_params)
        new_f = _fused_settings(new.fused_params)
        keys = sorted(k for k in set(old_f) | set(new_f) if not _same(old_f.get(k), new_f.get(k)))
        if keys:
            found.append(f"fused_params: different {keys}")
    return found


def check_reusable(record: ShardingRecord, new: Any) -> None:
    """Refuses a sharding request that the model's existing sharding cannot honour.

    Args:
        record: the model's sharding record.
        new: the new ``ShardingConfig``.

    Raises:
        ShardingConflictError: naming each difference and what to do instead.
    """
    differences = config_differences(record.config, new, record.sharded.plan)
    if differences:
        raise ShardingConflictError(
            "this model was already sharded in this process, and a live model cannot be "
            "resharded in place; the new strategy asks for "
            + "; ".join(differences)
            + ". Build a new model for the new sharding and load the checkpoint into it "
            "(checkpoints reshard exactly to any plan and world size), or pass the same "
            "sharding arguments as the first time (or none)."
        )
