"""Saving a sharded checkpoint (collective): finite values, DCP files, manifest, atomic move.

See :mod:`lightning_torchrec.checkpoint` for the format and the guarantees.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torchrec.optim.keyed import KeyedOptimizer

from lightning_torchrec.checkpoint.common import (
    FORMAT_VERSION,
    MODEL_KEY,
    agree_checkpoint_error,
    agree_dcp_failure,
    check_replaceable,
    checkpoint_collective,
    hyper_params,
    optimizer_key,
    this_rank,
    write_error,
)
from lightning_torchrec.checkpoint.files import (
    fsync_dir,
    recover_replaced,
    replace_path,
    write_torch_file,
)
from lightning_torchrec.checkpoint.hyper_params import RUN_KEY, merge_run_records, run_record
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE, file_checksum, write_manifest
from lightning_torchrec.checkpoint.names import META_FILE, PACKAGE_KEY, param_groups_file
from lightning_torchrec.checkpoint.ownership import forget_partial, make_partial, remove_partial
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.checkpoint.signing import resolve_key
from lightning_torchrec.distributed import broadcast_from_rank0, is_distributed, rank_and_world_size
from lightning_torchrec.errors import (
    CheckpointWriteError,
    NonFiniteCheckpointError,
    RankFailureError,
    UnsafeCheckpointError,
)
from lightning_torchrec.training.finite import nonfinite_tensors
from lightning_torchrec.training.optim import optimizer_steps


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
            f"refusing to save a checkpoint{at}: non-finite values on rank(s) [{this_rank()}]: "
            f"{names}. The previous checkpoint is kept; find where the NaN came from (loss, "
            "learning rate, data)."
        )
    agree_checkpoint_error(error)


def save_sharded(
    path: str | Path,
    module: nn.Module,
    optimizers: list[KeyedOptimizer],
    metadata: dict[str, Any],
    *,
    model_state: dict[str, Any] | None = None,
    check_finite_values: bool = True,
    key: bytes | str | None = None,
) -> None:
    """Saves a module's (sharded) state, optimizer states and Lightning metadata. Collective.

    Args:
        path: the checkpoint directory (a ``file://`` URL is its local path). An existing
            checkpoint of this package holding nothing else (or a Lightning single-file
            checkpoint, or an empty directory) there is replaced once the new one is complete;
            anything else there is refused.
        module: the (sharded) module; ``module.state_dict()`` holds ShardedTensors for tables.
        optimizers: keyed optimizers (state keyed by parameter name).
        metadata: the rest of Lightning's checkpoint dict; rank 0 writes it.
        model_state: ``module.state_dict()`` when the caller has built it already.
        check_finite_values: refuse NaN/inf weights and optimizer state (:func:`check_finite`).
        key: sign the manifest with this HMAC key, with SHA-256 entries (default: see
            :func:`~lightning_torchrec.checkpoint.signing.resolve_key`).

    Raises:
        NonFiniteCheckpointError: see :func:`check_finite`; nothing is written.
        FileExistsError: if ``path`` holds something that is not a checkpoint; nothing is
            written.
        ValueError: if ``path`` is a URL of another file system (``s3://...``), on every rank;
            nothing is written.
        CheckpointWriteError: if writing failed on some rank, with the OS's errno on every rank
            (``ENOSPC`` disk full, ``EFBIG`` past a file-size limit), naming the file and the
            rank; the previous checkpoint of that name is intact.
        PeerFailureError: if another rank died during the save.
    """
    path = local_path(path)
    rank, world = rank_and_world_size()
    model_state = module.state_dict() if model_state is None else model_state
    state: dict[str, Any] = {MODEL_KEY: model_state}
    for i, opt in enumerate(optimizers):
        state[optimizer_key(i)] = opt.state_dict()["state"]
    if check_finite_values:
        check_finite(state, metadata.get("global_step"))
    signing = resolve_key(key)
    error: BaseException | None = None
    made: tuple[Path, str] | None = None
    if rank == 0:
        try:
            recover_replaced(path)
            check_replaceable(path)
            made = make_partial(path)
        except Exception as err:  # noqa: BLE001 - agreed below
            error = write_error(err, path)
    agree_checkpoint_error(error)  # nothing is written before every rank knows the target is fine
    tmp_name, token = checkpoint_collective(broadcast_from_rank0, lambda: (str(made[0]), made[1]))
    tmp = Path(tmp_name)
    try:
        _write(path, tmp, state, optimizers, metadata, rank, world, token, signing)
    except (CheckpointWriteError, FileExistsError, UnsafeCheckpointError, RankFailureError):
        if rank == 0:
            remove_partial(tmp)  # agreed: no rank writes any more; frees the space
        raise
    if rank == 0:
        forget_partial(tmp)


def _write(
    path: Path,
    tmp: Path,
    state: dict[str, Any],
    optimizers: list[KeyedOptimizer],
    metadata: dict[str, Any],
    rank: int,
    world: int,
    token: str,
    key: bytes | None,
) -> None:
    try:
        dcp.save(state, storage_writer=FileSystemWriter(str(tmp)))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - agreed below
        agree_dcp_failure(err, tmp, writing=True)
    agree_checkpoint_error(None)
    error: BaseException | None = None

    own = param_groups_file(tmp, rank)
    sums: dict[str, dict[str, Any]] = {}
    try:
        write_torch_file(
            {
                "world_size": world,
                "param_groups": [hyper_params(o) for o in optimizers],
                "optimizer_steps": [optimizer_steps(o) for o in optimizers],
            },
            own,
        )
        for file in [*sorted(tmp.glob(f"__{rank}_*.distcp")), own]:
            sums[file.name] = file_checksum(file, strong=key is not None)
    except Exception as err:  # noqa: BLE001 - agreed below
        error = write_error(err, own)
    agree_checkpoint_error(error)
    share = (sums, run_record(optimizers))
    if is_distributed():
        gathered: list[Any] = [None] * world
        checkpoint_collective(torch.distributed.all_gather_object, gathered, share)
    else:
        gathered = [share]

    if rank == 0:
        current = tmp / META_FILE
        try:
            meta = dict(metadata)
            meta[PACKAGE_KEY] = {
                "format_version": FORMAT_VERSION,
                "world_size": world,
                "save_token": token,
                RUN_KEY: merge_run_records([record for _, record in gathered]),
            }
            write_torch_file(meta, current)
            files = {name: s for rank_sums, _ in gathered for name, s in rank_sums.items()}
            for file in sorted(tmp.iterdir()):  # .metadata, meta.pt, anything DCP added
                if file.is_file() and file.name not in files:
                    files[file.name] = file_checksum(file, strong=key is not None)
            unsigned = sorted(n for n, s in files.items() if key is not None and "sha256" not in s)
            if unsigned:
                raise CheckpointWriteError(
                    f"cannot sign {path}: ranks without the checkpoint key wrote {unsigned[:5]}; "
                    "give every rank the same key"
                )
            current = tmp / MANIFEST_FILE
            write_manifest(tmp, files, FORMAT_VERSION, world, token=token, key=key)
            fsync_dir(tmp)
            current = path
            replace_path(tmp, path)
        except Exception as err:  # noqa: BLE001 - agreed below
            error = write_error(err, current)
    agree_checkpoint_error(error)
