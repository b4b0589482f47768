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
- ``checksums.json`` (format version 2): the CRC-32 and size of every other file and the save's
  token (with a key: SHA-256 entries and an HMAC-SHA256 signature).

Saving is atomic: every rank writes into a hidden sibling directory (``.{name}.partial-{token}``,
which matches no checkpoint pattern); each rank checksums the files it wrote, rank 0 gathers the
checksums into the manifest and moves the directory to its final name. An existing checkpoint of
that name is swapped out in one ``renameat2(RENAME_EXCHANGE)`` on Linux (elsewhere: two renames,
undone on the next read if a crash fell between them), so the name never goes missing. A failed
save leaves the previous checkpoint untouched. Only a checkpoint written by this package and
holding nothing else (proven by a per-save token in its manifest and ``meta.pt``), a Lightning
single-file checkpoint or an empty directory is ever replaced.

Loading verifies the checksums (each rank reads a share of the files; each file it parses is
verified from the bytes it parses), opens only listed regular files inside the folder, reads
every file without running code from it (DCP metadata through this package's own pickle
interpreter, the rest with ``torch.load(weights_only=True)`` behind bounds) and checks the
checkpoint's keys and global shapes against the target before reading any tensor. It
reshards: a checkpoint written under one plan or world size loads under another (DCP copies by
global offsets).

Everything is collective: every rank must call :func:`save_sharded` / :func:`load_sharded`. Every
error found on one rank (a damaged file, a full disk, a mismatch) is raised on every rank as the
same named error (:func:`lightning_torchrec.distributed.agree`); a peer that died raises
:class:`~lightning_torchrec.errors.PeerFailureError`.

:func:`load_unsharded` (and ``TorchRecModule.load_from_checkpoint``) builds a ready unsharded
model from a checkpoint directory in one process.

This module is the public face of the checkpoint modules: ``common`` (recognising a checkpoint,
agreeing errors), ``save``, ``load``, ``unsharded``, ``consolidate``, with ``files`` (writing,
crash-safe replacement), ``ownership`` (what a save may delete) and ``safe_load`` (DCP's reader,
made safe) below them. ``delta`` writes, reads and applies delta checkpoints (only the rows
training touched since the last publish, and the dense state) and ``delta_writer`` keeps one
run's chain of them. Reading a stranger's checkpoint safely is ``folder`` (every file a load
opens: ``paths``, ``manifest``, ``signing``, ``limits``), ``unpickle`` with ``dcp_allow`` and
``dcp_metadata`` (DCP's metadata), and ``torch_files`` (``torch.save`` files); ``confine`` keeps
restored ``ModelCheckpoint`` paths inside its directory. See ``docs/checkpoints.md`` for the
threat model.
"""

from __future__ import annotations

from lightning_torchrec.checkpoint.common import (
    FORMAT_VERSION,
    META_FILE,
    MODEL_KEY,
    PACKAGE_KEY,
    is_sharded_checkpoint,
    load_meta,
    remove_checkpoint,
    written_by_this_package,
)
from lightning_torchrec.checkpoint.confine import confine_checkpoint_paths
from lightning_torchrec.checkpoint.delta import (
    Delta,
    chain_of,
    checkpoint_id,
    read_delta,
    restore_chain,
    write_delta,
)
from lightning_torchrec.checkpoint.delta_writer import DeltaWriter
from lightning_torchrec.checkpoint.load import check_compatible, load_sharded
from lightning_torchrec.checkpoint.save import check_finite, save_sharded
from lightning_torchrec.checkpoint.signing import KEY_FILE_ENV, read_key_file
from lightning_torchrec.checkpoint.unsharded import (
    fill_plain,
    iter_plain_tensors,
    load_unsharded,
    meta_tensors,
    plain_tensor_index,
)

__all__ = [
    "Delta",
    "DeltaWriter",
    "FORMAT_VERSION",
    "KEY_FILE_ENV",
    "META_FILE",
    "MODEL_KEY",
    "PACKAGE_KEY",
    "check_compatible",
    "chain_of",
    "check_finite",
    "checkpoint_id",
    "confine_checkpoint_paths",
    "fill_plain",
    "is_sharded_checkpoint",
    "iter_plain_tensors",
    "load_meta",
    "load_sharded",
    "load_unsharded",
    "meta_tensors",
    "plain_tensor_index",
    "read_delta",
    "read_key_file",
    "remove_checkpoint",
    "restore_chain",
    "save_sharded",
    "write_delta",
    "written_by_this_package",
]
