"""Loading a sharded checkpoint in place (collective), verified and resharded.

See :mod:`lightning_torchrec.checkpoint` for the format and the guarantees.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torchrec.optim.keyed import KeyedOptimizer

from lightning_torchrec.checkpoint.common import (
    MODEL_KEY,
    PACKAGE_KEY,
    UNVERIFIED,
    agree_checkpoint_error,
    agree_dcp_failure,
    agree_first_error,
    check_is_checkpoint,
    load_meta,
    optimizer_key,
    param_groups_file,
    this_rank,
)
from lightning_torchrec.checkpoint.files import read_manifest, verify_files
from lightning_torchrec.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_torch_file,
    read_dcp_metadata,
)
from lightning_torchrec.distributed import rank_and_world_size
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)
from lightning_torchrec.sharding.layout import global_shape
from lightning_torchrec.sharding.tables import table_of_key
from lightning_torchrec.training.optim import init_optimizer_state, set_optimizer_steps


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
    path: str | Path,
    state: dict[str, Any],
    what: str,
    allow_extra: bool = False,
    metadata: Metadata | None = None,
) -> None:
    """Checks that a checkpoint holds every tensor of ``state`` with the same global shape.

    Local (this rank's target only); :func:`load_sharded` agrees the verdicts of all ranks.

    Args:
        path: the checkpoint directory.
        state: the nested load target, e.g. ``{"state_dict": module.state_dict()}``.
        what: what is checked, for the message (``"model"`` or ``"optimizer 0"``).
        allow_extra: accept checkpoint entries the target lacks (fused optimizer state is keyed
            by the tables a rank owns, so each rank's target names only some of them).
        metadata: the checkpoint's DCP metadata when read already (else read safely here).

    Raises:
        CheckpointMismatchError: naming missing, unexpected and mis-shaped entries (by table).
        UnsafeCheckpointError: if the DCP metadata file would run code.
        CheckpointCorruptError: if the DCP metadata file is damaged.
    """
    metadata = read_dcp_metadata(path) if metadata is None else metadata
    stored = metadata.state_dict_metadata
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
    lines = [f"{path} does not match the {what} it is loaded into (rank {this_rank()}):"]
    for label, keys in (("missing from the checkpoint", missing), ("not in the target", extra)):
        if keys:
            tables = sorted({table_of_key(k.split(".", 1)[1]) for k in keys})
            lines.append(f"- {label} ({len(keys)} entries; tables {tables}): {sorted(keys)[:20]}")
    if wrong:
        tables = sorted({table_of_key(w.split(":")[0].split(".", 1)[1]) for w in wrong})
        lines.append(f"- shapes differ (tables {tables}): " + "; ".join(wrong[:20]))
    raise CheckpointMismatchError("\n".join(lines))


def _saved_world_size(path: Path, meta: dict[str, Any], manifest: dict[str, Any] | None) -> int:
    info = meta.get(PACKAGE_KEY)
    if isinstance(info, dict) and isinstance(info.get("world_size"), int):
        return info["world_size"]
    if manifest is not None and isinstance(manifest.get("world_size"), int):
        return manifest["world_size"]
    return int(load_torch_file(param_groups_file(path, 0)).get("world_size", 1))


def _read_param_groups(path: Path, rank: int, saved_world: int) -> dict[str, Any]:
    """This rank's saved hyper-parameters; rank 0's only for a rank the saving run lacked."""
    own = param_groups_file(path, rank)
    if rank >= saved_world:
        own = param_groups_file(path, 0)  # more ranks than saved: hyper-parameters are alike
    elif not own.is_file():
        raise CheckpointCorruptError(
            f"{own} is missing: the checkpoint was written by {saved_world} ranks and rank "
            f"{rank} wrote its optimizer hyper-parameters and step counters there. The "
            "checkpoint is incomplete (copied in part?); restore the file or use another "
            "checkpoint."
        )
    saved = load_torch_file(own)
    if not isinstance(saved, dict) or "param_groups" not in saved:
        raise CheckpointCorruptError(f"{own} does not hold optimizer param groups")
    return saved


def _verify_share(path: Path, manifest: dict[str, Any] | None, rank: int, world: int) -> None:
    if manifest is not None:
        names = sorted(manifest["files"])
        verify_files(path, manifest, names[rank::world])


def load_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: list[KeyedOptimizer],
    *,
    weights_only: bool = True,
    load_optimizer_states: bool = True,
) -> dict[str, Any]:
    """Loads a checkpoint written by :func:`save_sharded` in place, resharding. Collective.

    Before any tensor is read, every rank checks a share of the files against the checksums
    written with them, reads the metadata safely and checks the model and optimizer targets;
    every verdict is agreed, so every rank raises the same error.

    Args:
        path: the checkpoint directory.
        module: the (sharded) module to load into.
        optimizers: keyed optimizers to load into (may be empty: weights only).
        weights_only: load Lightning's metadata with ``torch.load(weights_only=...)`` (the DCP
            metadata and tensors are always read without running code).
        load_optimizer_states: False loads the weights, the hyper-parameters and step counters
            but leaves the optimizer *state* as it is (e.g. after a plan change that reshapes the
            fused optimizer's state).

    Returns:
        Lightning's metadata (the checkpoint dict without model and optimizer states).

    Raises:
        FileNotFoundError: if ``path`` is not a complete sharded checkpoint.
        CheckpointMismatchError: if the model or the optimizer state does not fit the checkpoint
            (on any rank), or ``path`` is a single-file checkpoint of another strategy.
        CheckpointCorruptError: if a file is damaged, truncated or missing, naming it.
        UnsafeCheckpointError: if a file would run code when loaded, naming it (for ``meta.pt``
            only when ``weights_only`` is True).
        PeerFailureError: if another rank died during the load.
    """
    path = Path(path)
    rank, world = rank_and_world_size()
    error: BaseException | None = None
    manifest = None
    try:  # the metadata files, read without running code
        check_is_checkpoint(path)
        manifest = read_manifest(path)
        meta = load_meta(path, weights_only=weights_only)
        metadata = read_dcp_metadata(path)
    except Exception as err:  # noqa: BLE001 - agreed below
        error = err
    damaged = None
    try:  # this rank's share of the checksums
        if error is None or isinstance(error, CheckpointCorruptError):
            _verify_share(path, manifest, rank, world)
    except Exception as err:  # noqa: BLE001 - agreed below
        damaged = err
    # One collective; a file that would run code is named first, then checksum failures.
    unsafe = error if isinstance(error, UnsafeCheckpointError) else None
    agree_first_error(unsafe, damaged, error)
    if manifest is None and rank == 0:
        warnings.warn(UNVERIFIED.format(path=path), UserWarning, stacklevel=2)

    model_sd = module.state_dict()
    state: dict[str, Any] = {MODEL_KEY: model_sd}
    try:
        groups = None
        if optimizers:
            groups = _read_param_groups(path, rank, _saved_world_size(path, meta, manifest))
        check_compatible(path, state, "model", metadata=metadata)
        for i, opt in enumerate(optimizers if load_optimizer_states else []):
            init_optimizer_state(opt)
            target = opt.state_dict()["state"]
            try:
                check_compatible(
                    path, {optimizer_key(i): target}, f"optimizer {i}", True, metadata=metadata
                )
            except CheckpointMismatchError as err:
                raise CheckpointMismatchError(
                    f"{err}\nThe optimizer state cannot be carried over (another model, or a "
                    "plan that reshapes the fused optimizer state). To continue from the "
                    "weights with fresh optimizer state, pass "
                    "`TorchRecStrategy(load_optimizer_states=False)` (or "
                    "`load_sharded(..., load_optimizer_states=False)`)."
                ) from None
            state[optimizer_key(i)] = target
    except Exception as err:  # noqa: BLE001 - agreed below
        error = err
    agree_checkpoint_error(error)

    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(path, metadata),
            planner=SafeLoadPlanner(flatten_sharded_tensors=False),
        )
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - agreed below
        agree_dcp_failure(err, path, writing=False)
    agree_checkpoint_error(None)

    module.load_state_dict(model_sd)
    for i, opt in enumerate(optimizers):
        if optimizer_key(i) in state:
            opt.load_state_dict({"state": state[optimizer_key(i)]})
        if groups is not None:
            _apply_hyper_params(groups, i, opt)
    return meta


def _apply_hyper_params(saved: dict[str, Any], index: int, optimizer: KeyedOptimizer) -> None:
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
