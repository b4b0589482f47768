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
    agree_checkpoint_error,
    agree_dcp_failure,
    agree_first_error,
    check_is_checkpoint,
    optimizer_key,
    this_rank,
)
from lightning_torchrec.checkpoint.folder import UNVERIFIED, CheckpointFolder, read_dcp_metadata
from lightning_torchrec.checkpoint.hyper_params import apply_hyper_params, read_run_record
from lightning_torchrec.checkpoint.lenient import (
    model_differences,
    report,
    state_of,
    without_keys,
)
from lightning_torchrec.checkpoint.limits import CheckpointLimits
from lightning_torchrec.checkpoint.mc_layout import check_managed_collision_layout
from lightning_torchrec.checkpoint.names import (
    DCP_METADATA,
    META_FILE,
    PACKAGE_KEY,
    param_groups_file,
)
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from lightning_torchrec.distributed import rank_and_world_size
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)
from lightning_torchrec.sharding.layout import global_shape
from lightning_torchrec.sharding.tables import table_of_key
from lightning_torchrec.training.optim import (
    DENSE_KEY,
    FUSED_KEY,
    DenseAndFusedOptimizer,
    forget_dense_state,
    init_optimizer_state,
)


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
            tables = {table_of_key(k.split(".", 1)[1]) for k in keys}
            lines.append(f"- {label} ({len(keys)} entries; tables {_few(tables)}): {_few(keys)}")
    if wrong:
        tables = {table_of_key(w.split(":")[0].split(".", 1)[1]) for w in wrong}
        lines.append(f"- shapes differ (tables {_few(tables)}): " + "; ".join(_few(wrong)))
    raise CheckpointMismatchError("\n".join(lines))


def _few(names: Any, most: int = 20, width: int = 200) -> list[str]:
    """The first ``most`` names (sorted, each cut at ``width``): a stranger's may be many."""
    ordered = sorted(names)
    shown = [n if len(n) <= width else n[:width] + "..." for n in ordered[:most]]
    return shown + ([f"... {len(ordered) - most} more"] if len(ordered) > most else [])


def _saved_world_size(folder: CheckpointFolder, meta: dict[str, Any]) -> int:
    info = meta.get(PACKAGE_KEY)
    if isinstance(info, dict) and type(info.get("world_size")) is int:
        return info["world_size"]
    manifest = folder.manifest
    if manifest is not None and isinstance(manifest.get("world_size"), int):
        return manifest["world_size"]
    groups = folder.torch_file(param_groups_file(folder.path, 0).name)
    world = groups.get("world_size", 1) if isinstance(groups, dict) else 1
    return world if type(world) is int else 1


def _read_param_groups(folder: CheckpointFolder, rank: int, saved_world: int) -> dict[str, Any]:
    """This rank's saved hyper-parameters; rank 0's only for a rank the saving run lacked."""
    own = param_groups_file(folder.path, rank)
    if rank >= saved_world:
        own = param_groups_file(folder.path, 0)  # more ranks than saved: hyper-parameters alike
    elif not (own.is_file() or own.is_symlink()):
        raise CheckpointCorruptError(
            f"{own} is missing: the checkpoint was written by {saved_world} ranks and rank "
            f"{rank} wrote its optimizer hyper-parameters and step counters there. The "
            "checkpoint is incomplete (copied in part?); restore the file or use another "
            "checkpoint."
        )
    saved = folder.torch_file(own.name)
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise CheckpointCorruptError(f"{own} does not hold optimizer param groups")
    steps = saved.get("optimizer_steps", [])
    if not isinstance(steps, list) or not all(
        isinstance(s, list) and all(type(v) is int and v >= 0 for v in s) for s in steps
    ):
        raise CheckpointCorruptError(f"{own}: its optimizer step counters are not counts")
    for groups in saved["param_groups"]:
        if not isinstance(groups, list) or not all(
            isinstance(g, dict) and all(isinstance(k, str) for k in g) for g in groups
        ):
            raise CheckpointCorruptError(f"{own}: its param groups are not lists of dicts")
    return saved


def _same_kind(saved: Any, current: Any) -> bool:
    numbers = (int, float)
    if isinstance(current, numbers) or isinstance(saved, numbers):
        return isinstance(current, numbers) and isinstance(saved, numbers)
    if isinstance(current, tuple | list) and isinstance(saved, tuple | list):
        return len(saved) == len(current) and all(map(_same_kind, saved, current))
    return type(saved) is type(current)


def _unstepped_dense(target: dict[str, Any], stored: Mapping[str, Any], prefix: str) -> list[str]:
    """Dense parameters of ``target`` the checkpoint holds no optimizer state for at all.

    A dense parameter that never had a gradient before the save (an unused head, a frozen
    layer) has no optimizer state, as in any torch optimizer; it resumes without state too.
    A parameter the checkpoint holds any state for, under other names (another dense
    optimizer: ``exp_avg`` where SGD wants ``momentum_buffer``) or in the fused part (a table
    saved on a fused kernel and planned data-parallel now), was stepped: it is not one of
    these, and the load reports its missing entries instead of dropping its state.

    Args:
        target: the optimizer's state as the load target (``{"dense.<name>": {...}}``).
        stored: the checkpoint's DCP metadata entries.
        prefix: the optimizer's key in the checkpoint (``"optimizer_0"``).

    Returns:
        The target keys (``"dense.<name>"``) of the parameters without any saved state.
    """
    holders: set[str] = set()  # every dotted prefix of a saved entry of this optimizer
    for entry in stored:
        if entry.startswith(f"{prefix}."):
            parts = entry[len(prefix) + 1 :].split(".")
            holders.update(".".join(parts[:n]) for n in range(2, len(parts)))
    unstepped = []
    for key, value in target.items():
        if not key.startswith(f"{DENSE_KEY}.") or not isinstance(value, Mapping):
            continue
        name = key[len(DENSE_KEY) + 1 :]
        if not any(f"{part}.{name}" in holders for part in (DENSE_KEY, FUSED_KEY)):
            unstepped.append(key)
    return unstepped


def _check_hyper_params(
    saved: dict[str, Any],
    run: list[dict[str, Any]],
    optimizers: list[KeyedOptimizer],
    where: Path,
) -> None:
    """Refuses saved hyper-parameters whose kinds differ from the optimizers' (before loading)."""
    for index, opt in enumerate(optimizers[: len(saved["param_groups"])]):
        fused = run[index]["fused_group"] if index < len(run) else None
        for values in [*saved["param_groups"][index], *([fused] if fused else [])]:
            for group in opt.param_groups:
                wrong = [k for k, v in values.items() if k in group and not _same_kind(v, group[k])]
                if wrong:
                    raise CheckpointCorruptError(
                        f"{where}: the saved hyper-parameters {sorted(wrong)} of optimizer "
                        f"{index} are not of the kind the optimizer holds (e.g. a string for a "
                        "learning rate)"
                    )


def _verify_share(folder: CheckpointFolder, rank: int, world: int) -> None:
    # .metadata and meta.pt were verified by every rank as they were read.
    names = [n for n in folder.names() if n not in (DCP_METADATA, META_FILE)]
    folder.verify(names[rank::world])


def load_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: list[KeyedOptimizer],
    *,
    weights_only: bool = True,
    load_optimizer_states: bool = True,
    key: bytes | str | None = None,
    limits: CheckpointLimits | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Loads a checkpoint written by :func:`save_sharded` in place, resharding. Collective.

    Before any tensor is read, every rank checks a share of the files against the checksums
    written with them, reads the metadata safely (each rank verifies the bytes it parses) and
    checks the model and optimizer targets; every verdict is agreed, so every rank raises the
    same error. No file outside the checkpoint folder, unlisted in its manifest, or not a
    regular file is opened (:class:`~lightning_torchrec.checkpoint.folder.CheckpointFolder`).

    Args:
        path: the checkpoint directory (a ``file://`` URL is its local path).
        module: the (sharded) module to load into.
        optimizers: keyed optimizers to load into (may be empty: weights only).
        weights_only: load Lightning's metadata with ``torch.load(weights_only=...)`` (the DCP
            metadata and tensors are always read without running code).
        load_optimizer_states: False loads the weights, the hyper-parameters and step counters
            but leaves the optimizer *state* as it is (e.g. after a plan change that reshapes the
            fused optimizer's state).
        key: refuse checkpoints not signed with this HMAC key (default: see
            :func:`~lightning_torchrec.checkpoint.signing.resolve_key`).
        limits: the reading limits (:class:`~lightning_torchrec.checkpoint.limits.
            CheckpointLimits`).
        strict: False loads what the model and checkpoint share (see
            :mod:`~lightning_torchrec.checkpoint.lenient`): a model tensor the checkpoint lacks
            keeps its value (and its parameter fresh optimizer state), a checkpoint tensor the
            model lacks is ignored, both with a warning; a shape mismatch is still refused.

    Returns:
        Lightning's metadata (the checkpoint dict without model and optimizer states).

    Raises:
        FileNotFoundError: if ``path`` is not a complete sharded checkpoint.
        ValueError: if ``path`` is a URL of another file system (``s3://...``), on every rank.
        CheckpointMismatchError: if the model or the optimizer state does not fit the checkpoint
            (on any rank; without ``strict``, a tensor in both with another shape only), or
            ``path`` is a single-file checkpoint of another strategy.
        ManagedCollisionLayoutError: if a managed-collision table was saved sharded over other
            rows per rank (another world size), naming the tables; nothing is loaded.
        CheckpointCorruptError: if a file is damaged, truncated or missing, naming it.
        UnsafeCheckpointError: if a file would run code when loaded, naming it (for ``meta.pt``
            only when ``weights_only`` is True), or reaches outside its folder.
        CheckpointSignatureError: with a key, if the checkpoint is not signed with it.
        CheckpointLimitError: if a file is larger, or expands further, than the limits.
        PeerFailureError: if another rank died during the load.
    """
    path = local_path(path)
    rank, world = rank_and_world_size()
    error: BaseException | None = None
    folder = None
    try:  # the metadata files, verified as they are read, read without running code
        check_is_checkpoint(path)
        folder = CheckpointFolder(path, key=key, limits=limits)
        meta = folder.meta(weights_only)
        metadata = folder.metadata()
    except Exception as err:  # noqa: BLE001 - agreed below
        error = err
    damaged = None
    try:  # this rank's share of the checksums
        if folder is not None and (error is None or isinstance(error, CheckpointCorruptError)):
            _verify_share(folder, rank, world)
    except Exception as err:  # noqa: BLE001 - agreed below
        damaged = err
    # One collective; a file that would run code (or cost without bound) is named first, then
    # checksum failures.
    unsafe = error if isinstance(error, UnsafeCheckpointError | CheckpointLimitError) else None
    agree_first_error(unsafe, damaged, error)
    assert folder is not None
    if folder.manifest is None and rank == 0:
        warnings.warn(UNVERIFIED.format(path=path), UserWarning, stacklevel=2)

    model_sd = module.state_dict()
    missing, unexpected = ([], []) if strict else model_differences(metadata, model_sd)
    state: dict[str, Any] = {MODEL_KEY: without_keys(model_sd, missing)}
    try:
        groups = None
        run: list[dict[str, Any]] = []
        unstepped: dict[int, list[str]] = {}
        kept: dict[int, dict[str, Any]] = {}
        if optimizers:
            groups = _read_param_groups(folder, rank, _saved_world_size(folder, meta))
            run = read_run_record(meta, PACKAGE_KEY, str(path / META_FILE))
            _check_hyper_params(groups, run, optimizers, path)
        check_compatible(path, state, "model", not strict, metadata=metadata)
        check_managed_collision_layout(path, _flatten(state), metadata)
        for i, opt in enumerate(optimizers if load_optimizer_states else []):
            init_optimizer_state(opt)
            target = opt.state_dict()["state"]
            stored = metadata.state_dict_metadata
            if _flatten(target) and not any(k.startswith(f"{optimizer_key(i)}.") for k in stored):
                raise CheckpointMismatchError(
                    f"{path} holds no state of optimizer {i} (saved with weights only, e.g. "
                    "ModelCheckpoint(save_weights_only=True)), so a fit cannot resume from it. "
                    "To train on from its weights, load them first with the same Trainer "
                    "(`trainer.validate(model, ckpt_path=...)`), then `trainer.fit(model)`."
                )
            # Only the package's combined optimizer tells its dense groups from the tables'.
            combined = isinstance(opt, DenseAndFusedOptimizer)
            unstepped[i] = _unstepped_dense(target, stored, optimizer_key(i)) if combined else []
            for key in unstepped[i]:
                del target[key]
            kept[i] = state_of(target, missing)  # not in the checkpoint: left as they are
            target = {k: v for k, v in target.items() if k not in kept[i]}
            try:
                check_compatible(
                    path, {optimizer_key(i): target}, f"optimizer {i}", True, metadata=metadata
                )
            except CheckpointMismatchError as err:
                raise CheckpointMismatchError(
                    f"{err}\nThe optimizer state cannot be carried over (another model, another "
                    "dense optimizer, or a plan that reshapes the fused optimizer state or "
                    "moves a table between a fused kernel and data-parallel). To continue from the "
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
            storage_reader=SafeFileSystemReader(path, metadata, folder),
            planner=SafeLoadPlanner(flatten_sharded_tensors=False),
        )
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - agreed below
        agree_dcp_failure(err, path, writing=False)
    agree_checkpoint_error(None)

    report(path, missing, unexpected, rank)
    module.load_state_dict(model_sd)
    for i, opt in enumerate(optimizers):
        if optimizer_key(i) in state:
            forget_dense_state(opt, unstepped.get(i, []))  # as they were when saved: no state
            opt.load_state_dict({"state": {**kept.get(i, {}), **state[optimizer_key(i)]}})
        if groups is not None:
            apply_hyper_params(groups, run, i, opt)
    return meta
