"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory:

- DCP files (``.metadata`` and ``__{rank}_{i}.distcp``): the module state (every rank writes the
  shards it owns; replicated tensors are written once) and the optimizer *state* (the fused
  optimizer's per-row state is sharded like its table);
- ``param_groups.rank{r}.pt``: rank ``r``'s optimizer hyper-parameters and fused-kernel step
  counters. Fused param groups name rank-local tables and DCP keeps one rank's copy of non-tensor
  values, so they are kept per rank;
- ``meta.pt``: Lightning's own checkpoint entries (loops, callbacks, schedulers, ...), written by
  rank 0 last;
- ``checksums.json`` (format version 2): the CRC-32 and size of every other file.

Saving is atomic: every rank writes into a hidden sibling directory (``.{name}.partial``, which
matches no checkpoint pattern); each rank checksums the files it wrote, rank 0 gathers the
checksums into the manifest and moves the directory to its final name. An existing checkpoint of
that name is swapped out in one ``renameat2(RENAME_EXCHANGE)`` on Linux (elsewhere: two renames,
undone on the next read if a crash fell between them), so the name never goes missing. A failed
save leaves the previous checkpoint untouched. Only a checkpoint written by this package, a
Lightning single-file checkpoint or an empty directory is ever replaced.

Loading verifies the checksums (each rank reads a share of the files), reads every file without
running code from it (DCP metadata through a restricted unpickler, the rest with
``torch.load(weights_only=True)``) and checks the checkpoint's keys and global shapes against the
target before reading any tensor. It reshards: a checkpoint written under one plan or world size
loads under another (DCP copies by global offsets).

Everything is collective: every rank must call :func:`save_sharded` / :func:`load_sharded`. Every
error found on one rank (a damaged file, a full disk, a mismatch) is raised on every rank as the
same named error (:func:`lightning_torchrec.distributed.agree`); a peer that died raises
:class:`~lightning_torchrec.errors.PeerFailureError`.

:func:`load_unsharded` (and ``TorchRecModule.load_from_checkpoint``) builds a ready unsharded
model from a checkpoint directory in one process.
"""

from __future__ import annotations

import errno
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torchrec.optim.keyed import KeyedOptimizer

from lightning_torchrec.checkpoint_files import (
    DCP_METADATA,
    MANIFEST_FILE,
    WRITER,
    SafeFileSystemReader,
    SafeLoadPlanner,
    file_checksum,
    fsync_dir,
    fsync_file,
    load_torch_file,
    looks_complete,
    pickled_strings,
    read_dcp_metadata,
    read_manifest,
    recover_replaced,
    remove_path,
    replace_path,
    single_file_checkpoint_kind,
    verify_files,
    write_manifest,
)
from lightning_torchrec.compat import ShardedTensor
from lightning_torchrec.distributed import agree, is_distributed, rank_and_world_size
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointWriteError,
    NonFiniteCheckpointError,
    PeerFailureError,
    RankFailureError,
    UnsafeCheckpointError,
)
from lightning_torchrec.faults import nonfinite_tensors, peer_failure
from lightning_torchrec.layout import global_shape
from lightning_torchrec.optim import init_optimizer_state, optimizer_steps, set_optimizer_steps
from lightning_torchrec.tables import table_of_key

META_FILE = "meta.pt"
#: 1: no checksum manifest; 2: ``checksums.json``.
FORMAT_VERSION = 2
MODEL_KEY = "state_dict"
#: The ``meta.pt`` entry that marks a checkpoint written by this package.
PACKAGE_KEY = "lightning_torchrec"
_PARTIAL_SUFFIX = ".partial"
_UNVERIFIED = (
    "{path} has no checksum manifest (written before lightning_torchrec checkpoint format 2): "
    "its files cannot be verified, so damage would go unnoticed. Save it again to add one."
)

#: For peer-failure messages: the checkpoint code does not know the strategy's timeout value.
_TIMEOUT = "TorchRecStrategy(timeout=...)"


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


# ------------------------------------------------------------------ agreement


def _collective(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs a collective; a peer that died turns into :class:`PeerFailureError`."""
    try:
        return fn(*args, **kwargs)
    except (PeerFailureError, RankFailureError):
        raise
    except RuntimeError as err:
        failure = peer_failure(err, _TIMEOUT)
        if failure is None:
            raise
        raise failure from err


def _agree(error: BaseException | None) -> None:
    """:func:`agree` for checkpoint verdicts. Every rank raises the same named error."""
    _agree_first(error)


def _agree_first(*errors: BaseException | None) -> None:
    """:func:`_agree` of several verdicts in one collective; the first failed slot is raised."""
    try:
        _collective(agree, *errors)
    except CheckpointWriteError as err:
        found = re.search(r"\[Errno (\d+)\]", str(err))
        if err.errno is None and found:  # rebuilt from another rank's message: keep its errno
            raise CheckpointWriteError(int(found.group(1)), str(err)) from err
        raise


def _write_error(err: BaseException, file: Path) -> BaseException:
    """A named error for a failed write of ``file`` on this rank."""
    if isinstance(err, CheckpointWriteError | PeerFailureError | FileExistsError):
        return err
    where = f"writing {file} failed on rank {_rank()}"
    keep = "The previous checkpoint of that name is intact."
    if isinstance(err, OSError) and err.errno is not None:
        full = " (disk full)" if err.errno == errno.ENOSPC else ""
        return CheckpointWriteError(
            err.errno, f"{where}{full}: {err.strerror or err}. {keep} Free space or save elsewhere."
        )
    return CheckpointWriteError(f"{where}: {type(err).__name__}: {err}. {keep}")


def _dcp_error(err: BaseException, checkpoint: Path, writing: bool) -> BaseException:
    """A named error for an exception raised by ``dcp.save``/``dcp.load``.

    DCP gathers every rank's exception into a ``CheckpointException`` (raised on every rank);
    it names the ranks, and for reads the damaged file (:class:`SafeFileSystemReader`).
    """
    failures: list[tuple[int, BaseException]] = [(_rank(), err)]
    if isinstance(err, CheckpointException):
        failures = [(rank, exc) for rank, (exc, _) in sorted(err.failures.items())]
    for _, exc in failures:
        if isinstance(exc, RuntimeError) and not isinstance(exc, RankFailureError):
            peer = peer_failure(exc, _TIMEOUT)
            if peer is not None:
                return peer
    for _, exc in failures:
        if isinstance(exc, PeerFailureError | UnsafeCheckpointError | CheckpointCorruptError):
            return exc
        if writing and isinstance(exc, CheckpointWriteError):
            return exc
    text = "; ".join(
        f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        for rank, exc in failures
    )
    if not writing:
        return CheckpointCorruptError(
            f"reading the tensors of {checkpoint} failed ({text}). A file is truncated or "
            "damaged; use another checkpoint."
        )
    codes = [e.errno for _, e in failures if isinstance(e, OSError) and e.errno is not None]
    full = " (disk full)" if errno.ENOSPC in codes else ""
    message = (
        f"writing the tensors of {checkpoint} failed{full} ({text}). The previous checkpoint "
        "of that name is intact."
    )
    return CheckpointWriteError(codes[0], message) if codes else CheckpointWriteError(message)


def _agree_dcp_failure(err: BaseException, checkpoint: Path, writing: bool) -> None:
    """Raises the named error for a failed ``dcp.save``/``dcp.load`` on every rank.

    DCP raises the same ``CheckpointException`` (every failing rank's exception) on every rank;
    its lowest failing rank reports it, so the message names each failure once. A peer that
    died is raised at once (no collective can reach it).
    """
    error = _dcp_error(err, checkpoint, writing)
    if isinstance(error, PeerFailureError):
        raise error from err
    reporter = min(err.failures, default=_rank()) if isinstance(err, CheckpointException) else None
    _agree(error if reporter in (None, _rank()) else None)
    raise error from err  # (agree raised already unless the failure was this rank's alone)


# ------------------------------------------------------------------ what a path is


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory.

    A checkpoint that a crash left at ``.{name}.old`` while it was being replaced (possible only
    where the atomic exchange is unavailable) is moved back to ``path`` first.

    Args:
        path: a checkpoint path.

    Returns:
        True when it is a directory holding DCP metadata and Lightning's metadata (written last,
        so a directory whose save was interrupted is not a checkpoint).
    """
    try:
        recover_replaced(path)
    except OSError:
        pass
    return looks_complete(path)


def written_by_this_package(path: str | Path) -> bool:
    """Whether a directory is a checkpoint this package wrote (complete or not).

    Recognised by its manifest or by the ``lightning_torchrec`` entry of its ``meta.pt`` (read
    without unpickling).

    Args:
        path: a directory.

    Returns:
        True for a checkpoint directory of this package.
    """
    p = Path(path)
    try:
        manifest = read_manifest(p)
    except CheckpointCorruptError:
        manifest = None
    if manifest is not None and manifest.get("writer") == WRITER:
        return True
    strings = pickled_strings(p / META_FILE) if (p / META_FILE).is_file() else None
    return strings is not None and PACKAGE_KEY in strings


def _check_replaceable(path: Path) -> None:
    """Refuses to replace anything but a checkpoint (or an empty directory) at ``path``."""
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir():
        if written_by_this_package(path) or not any(path.iterdir()):
            return
        what = "a directory that is not a checkpoint written by lightning_torchrec"
    elif path.is_file() and single_file_checkpoint_kind(path) == "lightning":
        return  # a Lightning single-file checkpoint (e.g. from DDP) of the same name
    else:
        what = "a file that is not a checkpoint"
    raise FileExistsError(
        f"refusing to save a checkpoint to {path}: it is {what}, and saving would delete it. "
        "Move it away or save the checkpoint under another name."
    )


def _check_is_checkpoint(path: Path) -> None:
    if is_sharded_checkpoint(path):
        return
    if path.is_file():
        kind = single_file_checkpoint_kind(path)
        if kind == "lightning":
            raise CheckpointMismatchError(
                f"{path} is a single-file Lightning checkpoint (written with torch.save by "
                "another strategy, e.g. DDP), not a sharded checkpoint directory of "
                "TorchRecStrategy. Resume it with the strategy that wrote it, or load its "
                "weights into the (sharded) model: `load_plain_weights(model, torch.load(path, "
                "weights_only=True)['state_dict'])` (from lightning_torchrec.consolidate)."
            )
        if kind == "torch":
            raise CheckpointMismatchError(
                f"{path} is a single torch.save file, not a sharded checkpoint directory. If it "
                "holds a plain state dict, load it with "
                "`lightning_torchrec.consolidate.load_plain_weights(model, path)`."
            )
        raise FileNotFoundError(f"{path} is a file, not a sharded checkpoint directory")
    if path.is_dir() and (path / DCP_METADATA).is_file():
        raise FileNotFoundError(
            f"{path} is not a complete sharded checkpoint: '{META_FILE}' is missing (it is "
            "written last, so the save was interrupted). Use an earlier checkpoint."
        )
    raise FileNotFoundError(
        f"{path} is not a complete sharded checkpoint (a directory with DCP '{DCP_METADATA}' "
        f"and '{META_FILE}'); it may be missing or its save was interrupted."
    )


# ------------------------------------------------------------------ save


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
    _agree(error)


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
        path: the checkpoint directory. An existing checkpoint of this package (or a Lightning
            single-file checkpoint, or an empty directory) there is replaced once the new one is
            complete; anything else there is refused.
        module: the (sharded) module; ``module.state_dict()`` holds ShardedTensors for tables.
        optimizers: keyed optimizers (state keyed by parameter name).
        metadata: the rest of Lightning's checkpoint dict; rank 0 writes it.
        model_state: ``module.state_dict()`` when the caller has built it already.
        check_finite_values: refuse NaN/inf weights and optimizer state (:func:`check_finite`).

    Raises:
        NonFiniteCheckpointError: see :func:`check_finite`; nothing is written.
        FileExistsError: if ``path`` holds something that is not a checkpoint; nothing is
            written.
        CheckpointWriteError: if writing failed on some rank (e.g. disk full: errno ``ENOSPC``),
            naming the file; the previous checkpoint of that name is intact.
        PeerFailureError: if another rank died during the save.
    """
    path = Path(path)
    rank, world = rank_and_world_size()
    model_state = module.state_dict() if model_state is None else model_state
    state: dict[str, Any] = {MODEL_KEY: model_state}
    for i, opt in enumerate(optimizers):
        state[_opt_key(i)] = opt.state_dict()["state"]
    if check_finite_values:
        check_finite(state, metadata.get("global_step"))
    tmp = _partial_dir(path)
    error: BaseException | None = None
    if rank == 0:
        try:
            recover_replaced(path)
            _check_replaceable(path)
            remove_path(tmp)
            tmp.mkdir(parents=True)
        except Exception as err:  # noqa: BLE001 - agreed below
            error = _write_error(err, tmp)
    _agree(error)  # nothing is written before every rank knows the target is fine
    try:
        _write(path, tmp, state, optimizers, metadata, rank, world)
    except (CheckpointWriteError, FileExistsError, UnsafeCheckpointError, RankFailureError):
        if rank == 0:
            remove_path(tmp)  # agreed: no rank writes any more; frees the space
        raise


def _write(
    path: Path,
    tmp: Path,
    state: dict[str, Any],
    optimizers: list[KeyedOptimizer],
    metadata: dict[str, Any],
    rank: int,
    world: int,
) -> None:
    try:
        dcp.save(state, storage_writer=FileSystemWriter(str(tmp)))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - agreed below
        _agree_dcp_failure(err, tmp, writing=True)
    _agree(None)
    error: BaseException | None = None

    own = _param_groups_file(tmp, rank)
    sums: dict[str, dict[str, Any]] = {}
    try:
        torch.save(
            {
                "world_size": world,
                "param_groups": [_hyper_params(o) for o in optimizers],
                "optimizer_steps": [optimizer_steps(o) for o in optimizers],
            },
            own,
        )
        fsync_file(own)
        for file in [*sorted(tmp.glob(f"__{rank}_*.distcp")), own]:
            sums[file.name] = file_checksum(file)
    except Exception as err:  # noqa: BLE001 - agreed below
        error = _write_error(err, own)
    _agree(error)
    if is_distributed():
        gathered: list[Any] = [None] * world
        _collective(torch.distributed.all_gather_object, gathered, sums)
    else:
        gathered = [sums]

    if rank == 0:
        current = tmp / META_FILE
        try:
            meta = dict(metadata)
            meta[PACKAGE_KEY] = {"format_version": FORMAT_VERSION, "world_size": world}
            torch.save(meta, current)
            fsync_file(current)
            files = {name: s for rank_sums in gathered for name, s in rank_sums.items()}
            for file in sorted(tmp.iterdir()):  # .metadata, meta.pt, anything DCP added
                if file.is_file() and file.name not in files:
                    files[file.name] = file_checksum(file)
            current = tmp / MANIFEST_FILE
            write_manifest(tmp, files, FORMAT_VERSION, world)
            fsync_dir(tmp)
            current = path
            replace_path(tmp, path)
        except Exception as err:  # noqa: BLE001 - agreed below
            error = _write_error(err, current)
    _agree(error)


# ------------------------------------------------------------------ load


def load_meta(path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """Reads Lightning's metadata of a checkpoint, refusing code unless told otherwise.

    Args:
        path: the checkpoint directory.
        weights_only: ``torch.load(weights_only=...)``; keep True for checkpoints you did not
            write yourself.

    Returns:
        Lightning's checkpoint dict without model and optimizer states.

    Raises:
        UnsafeCheckpointError: if the metadata holds objects other than tensors and plain
            containers (e.g. a pickled function), naming the file (also a
            ``pickle.UnpicklingError``).
        CheckpointCorruptError: if the file is missing, truncated or damaged, naming it.
    """
    meta = load_torch_file(Path(path) / META_FILE, weights_only=weights_only)
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(f"{Path(path) / META_FILE} does not hold a dict")
    return meta


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
    lines = [f"{path} does not match the {what} it is loaded into (rank {_rank()}):"]
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
    return int(load_torch_file(_param_groups_file(path, 0)).get("world_size", 1))


def _read_param_groups(path: Path, rank: int, saved_world: int) -> dict[str, Any]:
    """This rank's saved hyper-parameters; rank 0's only for a rank the saving run lacked."""
    own = _param_groups_file(path, rank)
    if rank >= saved_world:
        own = _param_groups_file(path, 0)  # more ranks than saved: hyper-parameters are alike
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
        _check_is_checkpoint(path)
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
    _agree_first(unsafe, damaged, error)
    if manifest is None and rank == 0:
        warnings.warn(_UNVERIFIED.format(path=path), UserWarning, stacklevel=2)

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
                    path, {_opt_key(i): target}, f"optimizer {i}", True, metadata=metadata
                )
            except CheckpointMismatchError as err:
                raise CheckpointMismatchError(
                    f"{err}\nThe optimizer state cannot be carried over (another model, or a "
                    "plan that reshapes the fused optimizer state). To continue from the "
                    "weights with fresh optimizer state, pass "
                    "`TorchRecStrategy(load_optimizer_states=False)` (or "
                    "`load_sharded(..., load_optimizer_states=False)`)."
                ) from None
            state[_opt_key(i)] = target
    except Exception as err:  # noqa: BLE001 - agreed below
        error = err
    _agree(error)

    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(path, metadata),
            planner=SafeLoadPlanner(flatten_sharded_tensors=False),
        )
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - agreed below
        _agree_dcp_failure(err, path, writing=False)
    _agree(None)

    module.load_state_dict(model_sd)
    for i, opt in enumerate(optimizers):
        if _opt_key(i) in state:
            opt.load_state_dict({"state": state[_opt_key(i)]})
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


def remove_checkpoint(path: str | Path) -> None:
    """Deletes a checkpoint directory (or file) whole.

    Args:
        path: the checkpoint.
    """
    remove_path(path)


# ------------------------------------------------------------------ one process, unsharded


def plain_tensor_index(
    checkpoint: str | Path, verify: bool = True
) -> dict[str, TensorStorageMetadata]:
    """The model tensors of a sharded checkpoint: state-dict key to DCP's shape and dtype.

    One process, no process group.

    Args:
        checkpoint: a sharded checkpoint directory.
        verify: check every file against the checksum manifest first (a checkpoint without one
            warns that it cannot be verified).

    Returns:
        ``{state-dict key: TensorStorageMetadata}`` in key order.

    Raises:
        FileNotFoundError: if ``checkpoint`` is not a complete sharded checkpoint.
        CheckpointCorruptError: if a file is damaged, truncated or missing, naming it.
        UnsafeCheckpointError: if the DCP metadata would run code, naming the global.
        CheckpointMismatchError: if ``checkpoint`` is a single-file checkpoint.
    """
    checkpoint = Path(checkpoint)
    _check_is_checkpoint(checkpoint)
    damaged = None
    try:  # a file that would run code is named first, then checksum failures
        stored = read_dcp_metadata(checkpoint).state_dict_metadata
    except CheckpointCorruptError as err:
        damaged = err
    if verify:
        manifest = read_manifest(checkpoint)
        if manifest is None:
            warnings.warn(_UNVERIFIED.format(path=checkpoint), UserWarning, stacklevel=2)
        else:
            verify_files(checkpoint, manifest, sorted(manifest["files"]))
    if damaged is not None:
        raise damaged
    prefix = MODEL_KEY + "."
    return {
        k[len(prefix) :]: v
        for k, v in sorted(stored.items())
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }


def iter_plain_tensors(
    checkpoint: str | Path, verify: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the unsharded model's tensors one at a time from a sharded checkpoint.

    Runs in one process without a process group; only the tensor being yielded is in memory.
    Files are checked against their checksums first and nothing is unpickled unsafely.

    Args:
        checkpoint: a sharded checkpoint directory.
        verify: check the checksums first (see :func:`plain_tensor_index`).

    Yields:
        ``(state-dict key, plain tensor)`` pairs in key order.

    Raises:
        FileNotFoundError: if ``checkpoint`` is not a complete sharded checkpoint.
        CheckpointCorruptError: if a file is damaged, truncated or missing, naming it.
        UnsafeCheckpointError: if the DCP metadata would run code, naming the global.
    """
    checkpoint = Path(checkpoint)
    entries = plain_tensor_index(checkpoint, verify=verify)
    reader = SafeFileSystemReader(checkpoint, read_dcp_metadata(checkpoint))
    for key, meta in entries.items():
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        try:
            with warnings.catch_warnings():
                # DCP warns on every single-process load, even when asked for one (no_dist=True).
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(
                    {MODEL_KEY: {key: tensor}},
                    storage_reader=reader,
                    planner=SafeLoadPlanner(),
                    no_dist=True,
                )
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - named below
            raise _dcp_error(err, checkpoint, writing=False) from err
        yield key, tensor


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
def fill_plain(
    module: nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    strict: bool = True,
) -> list[str]:
    """Loads whole tensors into an unsharded module, one at a time; meta tensors materialise.

    Args:
        module: the unsharded module (tables may be on the meta device).
        shapes: the shape of every tensor ``tensors`` will yield, checked before any is read.
        tensors: ``(state-dict key, tensor)`` pairs.
        strict: raise when the source lacks a tensor of the module or has one it lacks.

    Returns:
        The keys loaded.

    Raises:
        CheckpointMismatchError: on missing/unexpected keys (``strict``), a shape mismatch, or
            tensors left on the meta device, naming them (before anything is loaded, except
            for the tensors left on meta).
    """
    target = module.state_dict()
    keys = [k for k, v in target.items() if isinstance(v, torch.Tensor)]
    missing = [k for k in keys if k not in shapes]
    extra = [k for k in shapes if k not in target]
    wrong = [
        f"{k}: source {list(shapes[k])}, model {list(target[k].shape)}"
        for k in keys
        if k in shapes and tuple(target[k].shape) != tuple(shapes[k])
    ]
    if wrong or (strict and (missing or extra)):
        raise CheckpointMismatchError(
            f"the weights do not fit the model: missing {missing}, unexpected {extra}, "
            f"shapes differ: {wrong}"
        )
    loaded = []
    for key, tensor in tensors:
        if key not in target:
            continue
        if _is_plain_meta(target[key]):  # a table built on the meta device: take the tensor
            module.load_state_dict({key: tensor}, strict=False, assign=True)
        else:
            target[key].copy_(tensor)
        loaded.append(key)
    left = meta_tensors(module)
    if left:
        raise CheckpointMismatchError(
            f"these tensors of the model are still on the meta device (no values; the source "
            f"does not hold them): {left}"
        )
    return loaded


def load_unsharded(
    checkpoint: str | Path,
    module: nn.Module | type[nn.Module],
    *,
    strict: bool = True,
    weights_only: bool = True,
    **init_args: Any,
) -> Any:
    """A ready, unsharded model from a sharded checkpoint directory, in one process.

    No process group is needed. Tables created on the meta device are materialised on the CPU.
    Every tensor is read one at a time (:func:`iter_plain_tensors`: files verified against their
    checksums, nothing unpickled unsafely), so memory stays near the model's size.
    ``TorchRecModule.load_from_checkpoint(directory)`` calls this.

    Args:
        checkpoint: a sharded checkpoint directory.
        module: a module to fill in place, or a module class (e.g. a LightningModule) to build
            from the checkpoint's saved ``hyper_parameters`` (updated with ``init_args``).
        strict: raise when the checkpoint lacks a tensor of the model or has one it lacks.
        weights_only: read ``meta.pt`` (the hyper-parameters) with ``weights_only``.
        **init_args: constructor arguments overriding the saved hyper-parameters (class only).

    Returns:
        The module, on the CPU, in the mode it was built in (call ``.eval()`` to predict).

    Raises:
        TypeError: if ``init_args`` are given with a module instance.
        CheckpointMismatchError: if the model does not fit the checkpoint, naming the keys.
        CheckpointCorruptError: if a file is damaged, truncated or missing, naming it.
        UnsafeCheckpointError: if a file would run code when loaded, naming it.
        FileNotFoundError: if ``checkpoint`` is not a complete sharded checkpoint.
    """
    checkpoint = Path(checkpoint)
    entries = plain_tensor_index(checkpoint)
    if isinstance(module, type):
        meta = load_meta(checkpoint, weights_only=weights_only)
        hparams = dict(meta.get("hyper_parameters") or {})
        module = module(**{**hparams, **init_args})
    elif init_args:
        raise TypeError(f"constructor arguments {sorted(init_args)} need a class, not a module")
    shapes = {k: tuple(v.size) for k, v in entries.items()}
    fill_plain(module, shapes, iter_plain_tensors(checkpoint, verify=False), strict)
    return module
