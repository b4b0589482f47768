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

from lightning_torchrec.checkpoint_files import (
    DCP_METADATA,
    WRITER,
    looks_complete,
    read_manifest,
    recover_replaced,
    remove_path,
)
from lightning_torchrec.distributed import agree, rank_and_world_size
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointWriteError,
    PeerFailureError,
    RankFailureError,
    UnsafeCheckpointError,
)
from lightning_torchrec.faults import peer_failure, run_collective
from lightning_torchrec.safe_load import (
    load_torch_file,
    pickled_strings,
    single_file_checkpoint_kind,
)

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


def _collective(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs a collective; a peer that died turns into :class:`PeerFailureError`."""
    return run_collective(fn, *args, timeout=_TIMEOUT, **kwargs)


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


def _hyper_params(optimizer: KeyedOptimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


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


def remove_checkpoint(path: str | Path) -> None:
    """Deletes a checkpoint directory (or file) whole.

    Args:
        path: the checkpoint.
    """
    remove_path(path)
