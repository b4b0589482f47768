"""What the checkpoint modules share: the files, recognising a checkpoint, agreeing errors.

See :mod:`lightning_torchrec.checkpoint` for the format. Every error found on one rank (a damaged
file, a full disk, a mismatch) is raised on every rank as the same named error
(:func:`lightning_torchrec.distributed.agree`); a peer that died raises
:class:`~lightning_torchrec.errors.PeerFailureError`.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import CheckpointException
from torchrec.optim.keyed import KeyedOptimizer

from lightning_torchrec.checkpoint.files import looks_complete, recover_replaced
from lightning_torchrec.checkpoint.folder import UNVERIFIED, CheckpointFolder
from lightning_torchrec.checkpoint.limits import CheckpointLimits
from lightning_torchrec.checkpoint.names import (
    DCP_METADATA,
    META_FILE,
    PACKAGE_KEY,
    param_groups_file,
)
from lightning_torchrec.checkpoint.ownership import (
    foreign_entries,
    is_replaceable,
    owned_files,
    remove_replaced,
)
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.checkpoint.torch_files import single_file_checkpoint_kind
from lightning_torchrec.distributed import agree, peer_failure, rank_and_world_size, run_collective
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointWriteError,
    PeerFailureError,
    RankFailureError,
    UnsafeCheckpointError,
)

#: 1: no checksum manifest; 2: ``checksums.json`` (and, since this package marks ownership, a
#: per-save token in it and in ``meta.pt``; signed with SHA-256 entries when a key is set).
FORMAT_VERSION = 2


MODEL_KEY = "state_dict"


__all__ = [
    "DCP_METADATA",
    "FORMAT_VERSION",
    "META_FILE",
    "MODEL_KEY",
    "PACKAGE_KEY",
    "UNVERIFIED",
    "param_groups_file",
]


#: For peer-failure messages: the checkpoint code does not know the strategy's timeout value.
_TIMEOUT = "TorchRecStrategy(timeout=...)"


def this_rank() -> int:
    """This process's rank (0 without a process group).

    Returns:
        The rank.
    """
    return rank_and_world_size()[0]


def optimizer_key(i: int) -> str:
    """The key of the ``i``-th optimizer in a checkpoint's DCP state.

    Args:
        i: the optimizer's index among the Trainer's optimizers.

    Returns:
        ``"optimizer_{i}"``.
    """
    return f"optimizer_{i}"


def checkpoint_collective(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs a collective; a peer that died turns into :class:`PeerFailureError`."""
    return run_collective(fn, *args, timeout=_TIMEOUT, **kwargs)


def agree_checkpoint_error(error: BaseException | None) -> None:
    """:func:`agree` for checkpoint verdicts. Every rank raises the same named error."""
    agree_first_error(error)


def agree_first_error(*errors: BaseException | None) -> None:
    """:func:`agree_checkpoint_error` of several verdicts in one collective.

    Args:
        *errors: this rank's verdicts (None: fine), the same number on every rank.

    Raises:
        RankFailureError: the first failed slot's error type, on every rank.
    """
    try:
        checkpoint_collective(agree, *errors)
    except CheckpointWriteError as err:
        found = re.search(r"\[Errno (\d+)\]", str(err))
        if err.errno is None and found:  # rebuilt from another rank's message: keep its errno
            raise CheckpointWriteError(int(found.group(1)), str(err)) from err
        raise


def write_error(err: BaseException, file: Path) -> BaseException:
    """A named error for a failed write of ``file`` on this rank."""
    if isinstance(err, CheckpointWriteError | PeerFailureError | FileExistsError):
        return err
    where = f"writing {file} failed on rank {this_rank()}"
    keep = "The previous checkpoint of that name is intact."
    if isinstance(err, OSError) and err.errno is not None:
        full = {
            errno.ENOSPC: " (disk full)",
            errno.EFBIG: " (file too large: a file-size limit, e.g. ulimit -f)",
            errno.EDQUOT: " (disk quota exceeded)",
        }.get(err.errno, "")
        return CheckpointWriteError(
            err.errno, f"{where}{full}: {err.strerror or err}. {keep} Free space or save elsewhere."
        )
    return CheckpointWriteError(f"{where}: {type(err).__name__}: {err}. {keep}")


def dcp_error(err: BaseException, checkpoint: Path, writing: bool) -> BaseException:
    """A named error for an exception raised by ``dcp.save``/``dcp.load``.

    DCP gathers every rank's exception into a ``CheckpointException`` (raised on every rank);
    it names the ranks, and for reads the damaged file (:class:`SafeFileSystemReader`).
    """
    failures: list[tuple[int, BaseException]] = [(this_rank(), err)]
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


def agree_dcp_failure(err: BaseException, checkpoint: Path, writing: bool) -> None:
    """Raises the named error for a failed ``dcp.save``/``dcp.load`` on every rank.

    DCP raises the same ``CheckpointException`` (every failing rank's exception) on every rank;
    its lowest failing rank reports it, so the message names each failure once. A peer that
    died is raised at once (no collective can reach it).
    """
    error = dcp_error(err, checkpoint, writing)
    if isinstance(error, PeerFailureError):
        raise error from err
    reporter = (
        min(err.failures, default=this_rank()) if isinstance(err, CheckpointException) else None
    )
    agree_checkpoint_error(error if reporter in (None, this_rank()) else None)
    raise error from err  # (agree raised already unless the failure was this rank's alone)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory.

    A checkpoint that a crash left at ``.{name}.old`` while it was being replaced (possible only
    where the atomic exchange is unavailable) is moved back to ``path`` first.

    Args:
        path: a checkpoint path (a ``file://`` URL is its local path).

    Returns:
        True when it is a directory holding DCP metadata and Lightning's metadata (written last,
        so a directory whose save was interrupted is not a checkpoint); False for a URL of
        another file system.
    """
    try:
        path = local_path(path)
    except ValueError:  # a URL of another file system: no checkpoint of this package
        return False
    try:
        recover_replaced(path)
    except OSError:
        pass
    return looks_complete(path)


def written_by_this_package(path: str | Path) -> bool:
    """Whether a directory is a checkpoint this package wrote and holds nothing else.

    Proven, not claimed: see :func:`lightning_torchrec.checkpoint.ownership.owned_files` (a
    manifest naming the package is not enough on its own).

    Args:
        path: a directory.

    Returns:
        True for a non-empty checkpoint directory of this package holding only its files.
    """
    return bool(owned_files(path))


def check_replaceable(path: Path) -> None:
    """Refuses to replace anything but a checkpoint (or an empty directory) at ``path``."""
    if is_replaceable(path):
        return
    if path.is_dir():
        what = (
            "a directory holding files that lightning_torchrec did not write "
            f"({foreign_entries(path)})"
        )
    else:
        what = "a file that is not a checkpoint"
    raise FileExistsError(
        f"refusing to save a checkpoint to {path}: it is {what}, and saving would delete it. "
        "Move it away or save the checkpoint under another name."
    )


def check_is_checkpoint(path: Path) -> None:
    """Refuses, with the fix, a path that is not a sharded checkpoint of this package.

    Args:
        path: what the user passed as a checkpoint.

    Raises:
        CheckpointMismatchError: for a single-file (Lightning or plain torch) checkpoint.
        FileNotFoundError: for another file, a missing path or an interrupted save.
    """
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
                "weights_only=True)['state_dict'])` (from "
                "lightning_torchrec.checkpoint.consolidate)."
            )
        if kind == "torch":
            raise CheckpointMismatchError(
                f"{path} is a single torch.save file, not a sharded checkpoint directory. If it "
                "holds a plain state dict, load it with "
                "`lightning_torchrec.checkpoint.consolidate.load_plain_weights(model, path)`."
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


def hyper_params(optimizer: KeyedOptimizer) -> list[dict[str, Any]]:
    """The hyper-parameters of each param group (everything but ``params``).

    Args:
        optimizer: a keyed optimizer.

    Returns:
        One dict per param group.
    """
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def load_meta(
    path: str | Path,
    weights_only: bool = True,
    *,
    key: bytes | str | None = None,
    limits: CheckpointLimits | None = None,
) -> dict[str, Any]:
    """Reads Lightning's metadata of a checkpoint, verified first, refusing code unless told.

    Args:
        path: the checkpoint directory.
        weights_only: ``torch.load(weights_only=...)``; keep True for checkpoints you did not
            write yourself.
        key: the key the checkpoint must be signed with (see
            :func:`~lightning_torchrec.checkpoint.signing.resolve_key`).
        limits: the reading limits.

    Returns:
        Lightning's checkpoint dict without model and optimizer states.

    Raises:
        UnsafeCheckpointError: if the metadata holds objects other than tensors and plain
            containers (e.g. a pickled function), naming the file (also a
            ``pickle.UnpicklingError``).
        CheckpointCorruptError: if the file is missing, truncated or damaged, naming it.
        CheckpointLimitError: if it is larger, or expands further, than the limits.
    """
    return CheckpointFolder(path, key=key, limits=limits).meta(weights_only)


def remove_checkpoint(path: str | Path) -> None:
    """Deletes a checkpoint of this package (directory or Lightning file), nothing else.

    A directory holding anything this package did not write is kept, with a warning
    (:func:`lightning_torchrec.checkpoint.ownership.remove_replaced`).

    Args:
        path: the checkpoint (a URL of another file system than the local one holds none).
    """
    try:
        path = local_path(path)
    except ValueError:  # never saved there (refused), so nothing to delete; no rank waits
        return
    remove_replaced(path)
