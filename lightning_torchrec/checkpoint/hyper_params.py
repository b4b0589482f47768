"""Optimizer hyper-parameters and fused-kernel step counters under another plan or world size.

A :class:`~lightning_torchrec.training.optim.DenseAndFusedOptimizer` lists the dense optimizer's
param groups first, then one group per fused embedding kernel. How many kernels a rank drives
follows the plan: which tables it holds, and their pooling and data types (TorchRec groups tables
into kernels by both). So under another plan or world size a rank's groups do not line up with
the ones it saved. The dense groups still do (the same dense optimizer). A fused group takes the
values saved for the tables its kernel holds (the save records every rank's fused groups by
table: tables given their own optimizer with ``apply_optimizer_in_backward`` may each have their
own learning rate); for an older checkpoint, the fused groups are matched one to one when there
are as many, and otherwise each takes a saved fused group's values. An LR scheduler's per-group
lists (``base_lrs``, ``_last_lr``, ...), saved by rank 0 only, are matched the same way, except
that a fused group's ``base_lrs`` and ``_last_lr`` entries are its own restored ``initial_lr``
and ``lr``: rank 0's are those of its own tables.

The kernels' step counters advance in lock step; the save records the run's counter (the
largest any rank saved) and a fused group's values in ``meta.pt``, so a rank that held no kernel
when the checkpoint was written, or reads another rank's file, restores them too.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torchrec.optim.keyed import KeyedOptimizer

from lightning_torchrec.compat.fused import fused_groups_by_path, kernel_tables
from lightning_torchrec.compat.upstream import (
    SCHEDULER_GROUP_KEYS,
    SCHEDULER_LAST_LR,
    SCHEDULER_NESTED,
)
from lightning_torchrec.errors import CheckpointCorruptError
from lightning_torchrec.training.optim import (
    GROUP_NAME,
    DenseAndFusedOptimizer,
    optimizer_steps,
    set_optimizer_steps,
)

#: A fused group whose tables were saved with different values (:func:`_table_values`).
MIXED = object()
#: The key of the run's record in ``meta.pt``'s package entry.
RUN_KEY = "optimizers"


def group_split(optimizer: Any) -> tuple[int, int]:
    """How many of an optimizer's param groups are dense, and how many drive fused kernels.

    Args:
        optimizer: a keyed optimizer.

    Returns:
        ``(dense, fused)``; every group counts as dense unless ``optimizer`` is a
        ``DenseAndFusedOptimizer``.
    """
    total = len(optimizer.param_groups)
    if isinstance(optimizer, DenseAndFusedOptimizer):
        dense = len(optimizer.dense.param_groups)
        return dense, total - dense
    return total, 0


def saved_split(saved_groups: int, current: tuple[int, int]) -> tuple[int, int]:
    """The dense/fused split of ``saved_groups`` groups saved by the same dense optimizer.

    Args:
        saved_groups: how many groups were saved.
        current: this optimizer's ``group_split``.

    Returns:
        ``(dense, fused)`` of the saved groups.
    """
    dense = min(current[0], saved_groups)
    return dense, saved_groups - dense


def group_sources(saved: tuple[int, int], current: tuple[int, int]) -> list[int | None]:
    """For each current group, the saved group whose values it takes.

    Args:
        saved: the saved groups' ``(dense, fused)``.
        current: the current groups' ``(dense, fused)``.

    Returns:
        One saved index per current group; None for a fused group when no fused group was saved.
    """
    saved_dense, saved_fused = saved
    dense, fused = current
    if saved_dense == dense:
        sources: list[int | None] = list(range(dense))
    else:  # the dense optimizer was built otherwise: its first group's values for all
        sources = [0 if saved_dense else None] * dense
    if saved_fused == fused:
        return sources + [saved_dense + k for k in range(fused)]
    return sources + [saved_dense if saved_fused else None] * fused


def run_record(optimizers: list[KeyedOptimizer]) -> list[dict[str, Any]]:
    """This rank's share of the run's record: its kernels' step and a fused group's values.

    Args:
        optimizers: the keyed optimizers being saved.

    Returns:
        One ``{"step": int | None, "fused_group": dict | None, "fused_tables": {table:
        dict}}`` per optimizer.
    """
    record = []
    for opt in optimizers:
        steps = optimizer_steps(opt)
        dense, fused = group_split(opt)
        group = opt.param_groups[dense] if fused else None
        tables: dict[str, dict[str, Any]] = {}
        for kernel_group, names in group_tables(opt):
            for name in names:
                tables.setdefault(name, _values(kernel_group))
        record.append(
            {
                "step": max(steps) if steps else None,
                "fused_group": None if group is None else _values(group),
                "fused_tables": tables,
            }
        )
    return record


def _values(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", GROUP_NAME)}


def merge_run_records(records: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The run's record from every rank's share (rank order): the largest step, the fused groups.

    Args:
        records: every rank's :func:`run_record`.

    Returns:
        One ``{"step", "fused_group", "fused_tables"}`` per optimizer.
    """
    merged = []
    for index in range(len(records[0]) if records else 0):
        shares = [r[index] for r in records if index < len(r)]
        steps = [s["step"] for s in shares if s["step"] is not None]
        groups = [s["fused_group"] for s in shares if s["fused_group"] is not None]
        step = max(steps) if steps else None
        tables: dict[str, dict[str, Any]] = {}
        for share in shares:
            for table, values in share.get("fused_tables", {}).items():
                tables.setdefault(table, values)
        merged.append(
            {"step": step, "fused_group": next(iter(groups), None), "fused_tables": tables}
        )
    return merged


def read_run_record(meta: dict[str, Any], package_key: str, where: str) -> list[dict[str, Any]]:
    """The run's record in a checkpoint's metadata, checked (empty for older checkpoints).

    Args:
        meta: the checkpoint's metadata (``meta.pt``).
        package_key: the package's entry in it.
        where: the file, for errors.

    Returns:
        One ``{"step": int | None, "fused_group": dict | None}`` per optimizer, with
        ``"fused_tables"`` (``{table: dict}``) when the checkpoint recorded them.

    Raises:
        CheckpointCorruptError: if the record is not of that form, naming the file.
    """
    info = meta.get(package_key)
    record = info.get(RUN_KEY, []) if isinstance(info, dict) else []

    def group_ok(group: Any) -> bool:
        return isinstance(group, dict) and all(isinstance(k, str) for k in group)

    def entry_ok(e: Any) -> bool:
        if not isinstance(e, dict) or set(e) - {"fused_tables"} != {"step", "fused_group"}:
            return False
        step, group, tables = e["step"], e["fused_group"], e.get("fused_tables", {})
        step_ok = step is None or (type(step) is int and step >= 0)
        tables_ok = isinstance(tables, dict) and all(
            isinstance(t, str) and group_ok(v) for t, v in tables.items()
        )
        return step_ok and tables_ok and (group is None or group_ok(group))

    if not isinstance(record, list) or not all(entry_ok(e) for e in record):
        raise CheckpointCorruptError(
            f"{where}: its record of the optimizers' step counters and fused hyper-parameters "
            "is not a list of {'step': count or None, 'fused_group': dict or None, "
            "'fused_tables': {table: dict}}"
        )
    return record


def apply_hyper_params(
    saved: dict[str, Any], run: list[dict[str, Any]], index: int, optimizer: KeyedOptimizer
) -> None:
    """Sets optimizer ``index``'s hyper-parameters and kernel step counter from a checkpoint.

    Args:
        saved: this rank's saved ``param_groups`` file (checked).
        run: the run's record (:func:`read_run_record`; empty for older checkpoints).
        index: the optimizer's index.
        optimizer: the keyed optimizer.
    """
    if index >= len(saved["param_groups"]):
        return
    record = run[index] if index < len(run) else {"step": None, "fused_group": None}
    steps = saved.get("optimizer_steps", [])
    step = record["step"]
    if step is None and index < len(steps) and steps[index]:
        step = max(steps[index])  # an older checkpoint: this rank's own kernels
    if step is not None:
        set_optimizer_steps(optimizer, step)
    groups = saved["param_groups"][index]
    current = group_split(optimizer)
    sources = group_sources(saved_split(len(groups), current), current)
    by_table = _table_values(optimizer, record.get("fused_tables") or {})
    for position, (group, source) in enumerate(zip(optimizer.param_groups, sources, strict=True)):
        values = by_table.get(id(group))
        if values is MIXED:  # one kernel now, saved at different rates: it keeps its own
            continue
        if values is None and source is not None:
            values = groups[source]
        if values is None and position >= current[0]:
            values = record["fused_group"]
        for k, v in (values or {}).items():
            if k in group and k != GROUP_NAME:  # a label of the saved plan's grouping
                group[k] = v


def _table_values(optimizer: KeyedOptimizer, saved: dict[str, dict[str, Any]]) -> dict[int, Any]:
    """For each fused group (by ``id``) whose tables were all saved: their values, or MIXED."""
    out: dict[int, Any] = {}
    for group, names in group_tables(optimizer):
        found = [_saved_table(saved, name) for name in names]
        if not found or any(v is None for v in found):
            continue
        if all(v == found[0] for v in found):
            out[id(group)] = found[0]
            continue
        out[id(group)] = MIXED
        rates = {name: v.get("lr") for name, v in zip(names, found, strict=True)}
        rank_zero_warn(
            f"The tables {sorted(rates)} share one fused kernel now but were saved with different "
            f"hyper-parameters (learning rates {rates}); the kernel keeps the ones it was built "
            "with. Give them the same optimizer settings, or plan them as they were saved."
        )
    return out


def group_tables(optimizer: Any) -> list[tuple[dict[str, Any], list[str]]]:
    """Each fused param group with its kernel's tables, named ``"<collection path>/<table>"``.

    Two collections may each hold a table of the same name (a user and an item tower); the
    collection's module path tells them apart (a path relative to where the optimizer keys its
    parts: from the combined optimizer's fused part down).

    Args:
        optimizer: a keyed optimizer.

    Returns:
        ``(param group, table names)`` pairs, in ``param_groups`` order.
    """
    if isinstance(optimizer, DenseAndFusedOptimizer):  # paths from its fused part down
        optimizer = optimizer.fused
    return [
        (group, [f"{path}/{table}" if path else table for table in kernel_tables(kernel)])
        for path, group, kernel in fused_groups_by_path(optimizer)
    ]


def _saved_table(saved: dict[str, dict[str, Any]], name: str) -> dict[str, Any] | None:
    # By path and name; else by name where that is unambiguous (a model wrapped otherwise, or a
    # checkpoint that recorded names only).
    if name in saved:
        return saved[name]
    table = name.rsplit("/", 1)[-1]
    alike = [v for k, v in saved.items() if k.rsplit("/", 1)[-1] == table]
    return alike[0] if alike and all(v == alike[0] for v in alike) else None


def scheduler_state(
    state: dict[str, Any], optimizer: KeyedOptimizer, fresh: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An LR scheduler's saved state (rank 0's groups) matched to this rank's param groups.

    Args:
        state: the scheduler's saved ``state_dict()``.
        optimizer: the keyed optimizer it schedules, as it is now.
        fresh: the scheduler's own ``state_dict()`` as built for these groups, for a group no
            saved value fits (else the group's own ``initial_lr``/``lr``).

    Returns:
        A copy of ``state`` with its per-group lists of one entry per current group, the fused
        groups' ``base_lrs`` and ``_last_lr`` taken from the groups themselves (restored from
        this rank's own file).
    """
    current = group_split(optimizer)
    out = dict(state)
    for key in SCHEDULER_GROUP_KEYS:
        old = state.get(key)
        if not isinstance(old, list) or not old:
            continue
        values = list(old)
        if len(old) != sum(current):
            sources = group_sources(saved_split(len(old), current), current)
            made = (fresh or {}).get(key)
            values = []
            for j, source in enumerate(sources):
                if source is not None:
                    values.append(old[source])
                elif isinstance(made, list) and len(made) == len(sources):
                    values.append(made[j])
                else:
                    values.append(_fallback(key, optimizer.param_groups[j]))
        if key in ("base_lrs", SCHEDULER_LAST_LR):  # a fused group's own, not rank 0's
            for j in range(current[0], sum(current)):
                values[j] = _fallback(key, optimizer.param_groups[j])
        out[key] = values
    nested = state.get(SCHEDULER_NESTED)
    made = (fresh or {}).get(SCHEDULER_NESTED)
    made = made if isinstance(made, list) else []
    if isinstance(nested, list):  # SequentialLR, ChainedScheduler
        out[SCHEDULER_NESTED] = [
            scheduler_state(s, optimizer, made[i] if i < len(made) else None)
            if isinstance(s, dict)
            else s
            for i, s in enumerate(nested)
        ]
    return out


def _fallback(key: str, group: dict[str, Any]) -> Any:
    # What a scheduler built on this group starts from (its last rate: the group's own).
    if key == "lr_lambdas":
        return None
    if key == "min_lrs":
        return 0.0
    if key == SCHEDULER_LAST_LR:
        return group["lr"]
    return group.get("initial_lr", group["lr"])
