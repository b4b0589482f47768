"""Delta checkpoints: only what training changed since the last publish, applied in order.

A delta is a folder ``<root>/delta-<sequence:06d>`` (format version 1, ``docs/checkpoints.md``):
``delta.json`` (its id, sequence, parent, base, step, partition, tables), one
``rank-<r:05d>.pt`` per writing rank (each table's touched global row ids that rank owns, their
full rows and, optionally, their optimizer state), ``dense.pt`` (every parameter and buffer of
the inference model that is not an embedding table) and ``checksums.json`` (the package's
manifest, signed with a key as a full checkpoint is). It is written atomically: every rank
writes into a hidden sibling folder, rank 0 writes the manifest last and renames the folder;
an error on any rank is raised on every rank as the same named error and nothing is left under
the final name.

A delta applies only on top of the state whose id is its ``parent`` (for sequence 1, the base
checkpoint's id: :func:`checkpoint_id`); :func:`restore_chain` loads a full checkpoint and
applies its deltas in order on any world size, refusing a chain out of order, with a gap, of
another base or model, or with a damaged or unsigned file (:class:`~lightning_torchrec.errors.
DeltaRefusedError`) before it writes anything.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_torchrec.checkpoint.common import FORMAT_VERSION, agree_checkpoint_error
from lightning_torchrec.checkpoint.files import fsync_dir, write_torch_file
from lightning_torchrec.checkpoint.load import load_sharded
from lightning_torchrec.checkpoint.manifest import (
    MANIFEST_FILE,
    check_bytes,
    file_checksum,
    read_manifest,
    verify_files,
    write_manifest,
)
from lightning_torchrec.checkpoint.paths import local_path, read_capped
from lightning_torchrec.checkpoint.signing import check_signature, resolve_key
from lightning_torchrec.compat.upstream import ShardedTensor
from lightning_torchrec.distributed import all_gather, broadcast_from_rank0, rank_and_world_size
from lightning_torchrec.errors import (
    CheckpointWriteError,
    DeltaRefusedError,
    NonFiniteCheckpointError,
    ShardingConflictError,
)
from lightning_torchrec.sharding.layout import global_shape, shard_info
from lightning_torchrec.sharding.tables import embedding_tables, table_of_key
from lightning_torchrec.training.finite import nonfinite_tensors
from lightning_torchrec.training.optim import keyed_optimizer
from lightning_torchrec.training.touched import united_ids

#: ``delta.json``'s ``format``.
DELTA_FORMAT = "lightning_torchrec.delta"

#: The delta format's version.
DELTA_VERSION = 1

#: A delta's description.
DELTA_FILE = "delta.json"

#: The inference model's dense parameters and buffers.
DENSE_FILE = "dense.pt"


def delta_name(sequence: int) -> str:
    """The folder name of the delta of ``sequence`` (``delta-000003``).

    Args:
        sequence: the delta's sequence number (1 for the first after the base).

    Returns:
        The name.
    """
    return f"delta-{sequence:06d}"


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s rows file in a delta (``rank-00001.pt``).

    Args:
        rank: the writing rank.

    Returns:
        The file name.
    """
    return f"rank-{rank:05d}.pt"


def checkpoint_id(path: str | Path) -> str:
    """A checkpoint's (or delta's manifest's) id: the SHA-256 hex of its ``checksums.json``.

    Args:
        path: the checkpoint folder.

    Returns:
        64 hex digits.

    Raises:
        FileNotFoundError: if the folder has no manifest (written before format version 2).
    """
    file = local_path(path) / MANIFEST_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: {path} has no manifest, so it has no id")
    return hashlib.sha256(file.read_bytes()).hexdigest()


# ---------------------------------------------------------------------- the model's side
def inference_part(module: nn.Module) -> nn.Module:
    """The part of a module the export exports (as ``export.quantize.inference_model``).

    Args:
        module: the LightningModule (or any module).

    Returns:
        ``module.inference_model()`` when defined; else ``module.model_and_loss.model``; else
        ``module``.
    """
    chooser = getattr(module, "inference_model", None)
    if callable(chooser):
        return chooser()
    inner = getattr(getattr(module, "model_and_loss", None), "model", None)
    return inner if isinstance(inner, nn.Module) else module


@dataclass
class _Table:
    name: str
    key: str
    tensor: torch.Tensor
    rows: int
    dim: int


def model_tables(module: nn.Module) -> dict[str, Any]:
    """The embedding tables of a (sharded) module by table name, with their state-dict keys.

    Args:
        module: the (sharded) module.

    Returns:
        ``{table name: table}`` (each with ``key``, ``tensor``, ``rows``, ``dim``).

    Raises:
        ValueError: if two embedding modules hold tables of the same name.
    """
    tables: dict[str, _Table] = {}
    for key, tensor in embedding_tables(module).items():
        name = table_of_key(key)
        if name in tables:
            raise ValueError(
                f"two tables are named {name!r} ({tables[name].key}, {key}): a delta names "
                "tables by name, so every table of the model needs a name of its own"
            )
        rows, dim = (int(s) for s in global_shape(tensor))
        tables[name] = _Table(name, key, tensor, rows, dim)
    return tables


def _is_sharded(tensor: Any) -> bool:
    return isinstance(tensor, ShardedTensor | DTensor)


def _dense_targets(module: nn.Module, tables: Mapping[str, _Table]) -> dict[str, torch.Tensor]:
    """The inference model's state entries that are not tables (live tensors, by its names)."""
    part = inference_part(module)
    table_suffixes = tuple(
        f"{marker}.{name}.weight" for name in tables for marker in ("embedding_bags", "embeddings")
    )
    out = {}
    for name, tensor in part.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor) or name.endswith(table_suffixes):
            continue
        out[name] = tensor
    return out


def _full(tensor: torch.Tensor) -> torch.Tensor | None:
    """A sharded tensor gathered whole on rank 0 (None elsewhere); collective when sharded."""
    if not _is_sharded(tensor):
        return tensor.detach().cpu().clone()
    info = shard_info(tensor)
    pieces = all_gather([(s.row_offset, s.col_offset, s.tensor.cpu()) for s in info.shards])
    if rank_and_world_size()[0] != 0:
        return None
    first = next((p[2] for ps in pieces for p in ps), None)
    dtype = first.dtype if first is not None else torch.float32
    full = torch.zeros(info.global_shape, dtype=dtype)
    for shards in pieces:
        for row, col, piece in shards:
            index = [slice(row, row + piece.shape[0])]
            if piece.dim() > 1:
                index.append(slice(col, col + piece.shape[1]))
            full[tuple(index)] = piece
    return full


def _row_states(optimizer: Any, tables: Mapping[str, _Table]) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-row state of each table: ``{table: {state name: tensor}}``."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    if optimizer is None:
        return found
    by_key = {t.key: t for t in tables.values()}
    for param_key, states in keyed_optimizer(optimizer).state_dict()["state"].items():
        table = next((t for k, t in by_key.items() if param_key.endswith(k)), None)
        if table is None or not isinstance(states, Mapping):
            continue
        for state_name, value in states.items():
            if not isinstance(value, torch.Tensor):
                continue
            shape = global_shape(value)
            if len(shape) == 0 or int(shape[0]) != table.rows:
                continue  # a step counter, not a per-row state
            short = (
                state_name.split(".", 1)[1]
                if state_name.startswith(f"{table.name}.")
                else state_name
            )
            found.setdefault(table.name, {})[short] = value
    return found


def _owned(
    tensor: torch.Tensor, ids: torch.Tensor, rank: int, table: str
) -> list[tuple[Any, torch.Tensor]]:
    """This rank's pieces of ``tensor`` holding rows among ``ids``.

    Returns ``[(piece, selected global ids, local row index)]`` for each local shard; a
    replicated tensor is written by rank 0 only (every rank applies).
    """
    info = shard_info(tensor)
    shape = info.global_shape
    out = []
    for shard in info.shards:
        if len(shape) > 1 and (shard.col_offset != 0 or shard.tensor.shape[1] != shape[1]):
            raise ShardingConflictError(
                f"table {table!r} is sharded by columns (a shard of columns "
                f"{shard.col_offset}..{shard.col_offset + shard.tensor.shape[1]} of "
                f"{shape[1]}): delta checkpoints need whole rows on one rank. Plan it "
                "table-wise, row-wise or data-parallel (ParameterConstraints(sharding_types=...))."
            )
        start, stop = shard.row_offset, shard.row_offset + shard.tensor.shape[0]
        lo, hi = torch.searchsorted(ids, torch.tensor([start, stop])).tolist()
        if hi > lo:
            out.append((shard.tensor, ids[lo:hi], ids[lo:hi] - start))
    if info.replicated and rank != 0:
        return []
    return out


def check_whole_rows(tables: Mapping[str, _Table]) -> None:
    """Raises unless each table's rows are whole on the rank holding them (no column shards).

    Args:
        tables: from :func:`model_tables`.

    Raises:
        ShardingConflictError: naming the first table sharded by columns.
    """
    for table in tables.values():
        _owned(table.tensor, torch.empty(0, dtype=torch.int64), 0, table.name)


# ---------------------------------------------------------------------- writing
def write_delta(
    root: str | Path,
    module: nn.Module,
    touched: Mapping[str, torch.Tensor],
    *,
    sequence: int,
    parent: str,
    base: str,
    step: int,
    partition: str | None = None,
    optimizer: Any = None,
    key: bytes | str | None = None,
) -> Path:
    """Writes the delta ``root/delta-<sequence>`` of the rows in ``touched``. Collective.

    Every rank passes the global row ids its batches touched (they are united across ranks);
    each rank writes the rows it owns among them from its local shards (a data-parallel table:
    all its rows, by rank 0: the dense optimizer's momentum moves untouched rows too); rank 0
    writes the inference model's dense state (gathered whole where it is sharded, a
    managed-collision remapping), ``delta.json`` and the manifest, then renames the folder.

    Args:
        root: the folder of the chain.
        module: the (sharded) module.
        touched: ``{table name: global row ids}`` this rank's steps touched since the last
            publish (any order, duplicates allowed).
        sequence: the delta's sequence number (1 after the base).
        parent: the id of the state it applies on (the previous delta's ``id``; for sequence 1
            the base checkpoint's :func:`checkpoint_id`).
        base: the base checkpoint's id.
        step: the global step trained.
        partition: the partition's name, if any.
        optimizer: a keyed optimizer (or one wrapping it): the rows' optimizer state is written
            too.
        key: sign the manifest with this HMAC key (default: see ``signing.resolve_key``).

    Returns:
        The delta's folder.

    Raises:
        ValueError: on every rank, for a table ``touched`` names that the model lacks or an id
            outside its table; nothing is written.
        ShardingConflictError: on every rank, for a table sharded by columns.
        FileExistsError: if the delta exists already; nothing is written.
        CheckpointWriteError: if writing failed on some rank, on every rank; nothing is left
            under the final name.
        PeerFailureError: if another rank died.
    """
    root = local_path(root)
    rank, world = rank_and_world_size()
    signing = resolve_key(key)
    name = delta_name(sequence)
    final = root / name
    error: BaseException | None = None
    tables = model_tables(module)
    ids = united_ids(touched)
    for table in tables.values():
        if shard_info(table.tensor).replicated:
            # A data-parallel table is trained by the dense optimizer, whose momentum moves
            # rows no batch touched: the whole (small) table goes into every delta.
            ids[table.name] = torch.arange(table.rows)
    ids = dict(sorted(ids.items()))
    pieces: dict[str, torch.Tensor] = {}
    try:
        for table, table_ids in ids.items():
            if table not in tables:
                raise ValueError(f"{name}: table {table!r} is not in the model ({sorted(tables)})")
            if len(table_ids) and (
                int(table_ids[0]) < 0 or int(table_ids[-1]) >= tables[table].rows
            ):
                raise ValueError(
                    f"{name}: table {table!r} has {tables[table].rows} rows; touched ids reach "
                    f"{int(table_ids[0])}..{int(table_ids[-1])}"
                )
        states = _row_states(optimizer, tables)
        for table, table_ids in ids.items():
            found = _owned(tables[table].tensor, table_ids, rank, table)
            if not found:
                continue
            owned, order = torch.cat([g for _, g, _ in found]).sort()
            pieces[f"{table}/ids"] = owned
            rows = torch.cat([p[i.to(p.device)] for p, _, i in found]).float().cpu()
            pieces[f"{table}/rows"] = rows[order]
            for state, value in states.get(table, {}).items():
                held = _owned(value, table_ids, rank, table)
                state_ids, state_order = torch.cat([owned[:0], *(g for _, g, _ in held)]).sort()
                if not torch.equal(state_ids, owned):
                    raise ValueError(
                        f"the optimizer state {state!r} of table {table!r} is not sharded like "
                        "the table on this rank: its rows cannot go into a delta with them"
                    )
                got = torch.cat([p[i.to(p.device)].cpu() for p, _, i in held])
                pieces[f"{table}/state/{state}"] = got[state_order]
    except Exception as err:  # noqa: BLE001 - agreed below
        error = err
    agree_checkpoint_error(error)
    dense = {n: _full(t) for n, t in _dense_targets(module, tables).items()}
    bad = nonfinite_tensors(
        {"rows": pieces, "dense": {n: t for n, t in dense.items() if t is not None}}
    )
    agree_checkpoint_error(
        NonFiniteCheckpointError(
            f"refusing to publish {name} at global step {step}: non-finite values on rank "
            f"[{rank}]: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. The chain keeps "
            "its last delta; find where the NaN came from (loss, learning rate, data)."
        )
        if bad
        else None
    )

    def make_tmp() -> str:
        root.mkdir(parents=True, exist_ok=True)
        if final.exists() or final.is_symlink():
            raise FileExistsError(
                f"{final} exists already: a delta of sequence {sequence} was published; the "
                "chain continues from the last one (resume from the checkpoint written with it)"
            )
        tmp = root / f".{name}.partial-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        return str(tmp), uuid.uuid4().hex

    made, delta_id = broadcast_from_rank0(make_tmp)
    tmp = Path(made)
    try:
        _write(
            tmp,
            final,
            pieces,
            dense,
            ids,
            tables,
            states_present=bool(optimizer is not None),
            info=dict(
                id=delta_id,
                name=name,
                sequence=sequence,
                parent=parent,
                base=base,
                step=step,
                partition=partition,
            ),
            key=signing,
            rank=rank,
            world=world,
        )
    except BaseException:
        # Every rank removes it (agreed: no rank writes any more), so that no rank returns
        # while a partial delta is still there.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write(
    tmp: Path,
    final: Path,
    pieces: dict[str, torch.Tensor],
    dense: dict[str, torch.Tensor | None],
    ids: dict[str, torch.Tensor],
    tables: Mapping[str, _Table],
    *,
    states_present: bool,
    info: dict[str, Any],
    key: bytes | None,
    rank: int,
    world: int,
) -> None:
    error: BaseException | None = None
    own = tmp / rank_file(rank)
    sums: dict[str, dict[str, Any]] = {}
    try:
        write_torch_file(pieces, own)
        sums[own.name] = file_checksum(own, strong=key is not None)
    except Exception as err:  # noqa: BLE001 - agreed below
        error = _write_error(err, own)
    agree_checkpoint_error(error)
    gathered = all_gather(sums)
    current = tmp
    if rank == 0:
        try:
            files = {n: s for share in gathered for n, s in share.items()}
            unsigned = sorted(n for n, s in files.items() if key is not None and "sha256" not in s)
            if unsigned:  # a signed manifest over them would be refused by every reader
                raise CheckpointWriteError(
                    f"cannot sign delta {final}: ranks without the checkpoint key wrote "
                    f"{unsigned[:5]}; give every rank the same key. No delta written."
                )
            current = tmp / DENSE_FILE
            write_torch_file(dense, current)
            files[DENSE_FILE] = file_checksum(current, strong=key is not None)
            description = {
                "format": DELTA_FORMAT,
                "version": DELTA_VERSION,
                **info,
                "tables": {
                    t: {"rows": tables[t].rows, "dim": tables[t].dim, "ids": len(v)}
                    for t, v in ids.items()
                },
                "dense": DENSE_FILE,
                "optimizer": states_present,
                "files": sorted(n for n in files if n != DENSE_FILE),
                "written": time.time(),
            }
            current = tmp / DELTA_FILE
            with open(current, "x") as f:
                json.dump(description, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            files[DELTA_FILE] = file_checksum(current, strong=key is not None)
            current = tmp / MANIFEST_FILE
            write_manifest(tmp, files, FORMAT_VERSION, world, key=key)
            fsync_dir(tmp)
            current = final
            if final.exists() or final.is_symlink():
                raise FileExistsError(f"{final} appeared while the delta was written")
            os.rename(tmp, final)
            fsync_dir(final.parent)
        except Exception as err:  # noqa: BLE001 - agreed below
            error = _write_error(err, current)
    agree_checkpoint_error(error)


def _write_error(err: BaseException, file: Path) -> BaseException:
    if isinstance(err, CheckpointWriteError | FileExistsError):
        return err
    rank = rank_and_world_size()[0]
    where = f"writing {file} failed on rank {rank}"
    if isinstance(err, OSError) and err.errno is not None:
        return CheckpointWriteError(err.errno, f"{where}: {err.strerror or err}. No delta written.")
    return CheckpointWriteError(f"{where}: {type(err).__name__}: {err}. No delta written.")


# ---------------------------------------------------------------------- reading
@dataclass
class Delta:
    """A delta folder read and verified by :func:`read_delta`.

    Attributes:
        path: the folder.
        info: its ``delta.json``.
        manifest: its ``checksums.json``.
    """

    path: Path
    info: dict[str, Any]
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        """``delta.json``'s name (``delta-000003``)."""
        return str(self.info["name"])

    @property
    def sequence(self) -> int:
        """The delta's sequence number."""
        return int(self.info["sequence"])

    @property
    def id(self) -> str:
        """The delta's id (a later delta names it as its parent)."""
        return str(self.info["id"])

    @property
    def parent(self) -> str:
        """The id of the state it applies on."""
        return str(self.info["parent"])

    @property
    def base(self) -> str:
        """The base checkpoint's id."""
        return str(self.info["base"])

    def refuse(self, reason: str) -> DeltaRefusedError:
        """The error refusing this delta (naming its folder and name).

        Args:
            reason: why.

        Returns:
            The error.
        """
        return DeltaRefusedError(f"delta {self.path} ({self.info.get('name')}) refused: {reason}")

    def tensors(self, file: str) -> dict[str, torch.Tensor]:
        """One of its tensor files, verified against the manifest and loaded without code.

        Args:
            file: a file listed in ``delta.json`` (``rank-00000.pt``, ``dense.pt``).

        Returns:
            ``{name: tensor}``.

        Raises:
            DeltaRefusedError: if the file is damaged or does not hold a flat dict of tensors.
        """
        entry = self.manifest["files"].get(file)
        if entry is None:
            raise self.refuse(f"{file} is not in its manifest")
        try:
            data = read_capped(self.path, file, entry["size"])
        except Exception as err:  # noqa: BLE001 - any failure to read is a refusal
            raise self.refuse(f"{file} cannot be read: {err}") from err
        problem = check_bytes(self.path / file, data, entry, "sha256" in entry)
        if problem is not None:
            raise self.refuse(problem)
        try:
            loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as err:  # noqa: BLE001 - any failure to parse is a refusal
            raise self.refuse(f"{file} cannot be loaded: {err}") from err
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
        ):
            raise self.refuse(f"{file} is not a flat dict of tensors")
        return loaded


_FIELDS: dict[str, Any] = {
    "id": str,
    "name": str,
    "sequence": int,
    "parent": str,
    "base": str,
    "step": int,
    "tables": dict,
    "optimizer": bool,
    "files": list,
}


def read_delta(path: str | Path, key: bytes | str | None = None) -> Delta:
    """Reads a delta folder and verifies its manifest, signature and files.

    Args:
        path: the delta folder.
        key: refuse a delta not signed with this HMAC key (default: see
            ``signing.resolve_key``).

    Returns:
        The verified :class:`Delta`.

    Raises:
        DeltaRefusedError: naming the delta and what is wrong: no manifest or a damaged one, a
            missing, damaged or unlisted file, no or another signature when a key is required,
            a ``delta.json`` of another format or version.
    """
    path = local_path(path)
    shown = Delta(path, {"name": path.name}, {})
    try:
        manifest = read_manifest(path)
    except Exception as err:  # noqa: BLE001 - a damaged manifest is a refusal
        raise shown.refuse(str(err)) from err
    if manifest is None:
        raise shown.refuse(f"it has no {MANIFEST_FILE} (not a complete delta)")
    shown.manifest = manifest
    signing = resolve_key(key)
    if signing is not None:
        try:
            check_signature(manifest, signing, path)
        except Exception as err:  # noqa: BLE001 - the signature's verdict is a refusal
            raise shown.refuse(str(err)) from err
    if DELTA_FILE not in manifest["files"]:
        raise shown.refuse(f"its manifest does not list {DELTA_FILE}")
    try:
        data = read_capped(path, DELTA_FILE, manifest["files"][DELTA_FILE]["size"])
    except Exception as err:  # noqa: BLE001 - unreadable: refused
        raise shown.refuse(f"{DELTA_FILE} cannot be read: {err}") from err
    problem = check_bytes(
        path / DELTA_FILE,
        data,
        manifest["files"][DELTA_FILE],
        "sha256" in manifest["files"][DELTA_FILE],
    )
    if problem is not None:
        raise shown.refuse(problem)
    try:
        info = json.loads(data)
    except ValueError as err:
        raise shown.refuse(f"{DELTA_FILE} is not JSON: {err}") from err
    if not isinstance(info, dict) or info.get("format") != DELTA_FORMAT:
        raise shown.refuse(f"{DELTA_FILE} is not a {DELTA_FORMAT} description")
    if info.get("version") != DELTA_VERSION:
        raise shown.refuse(
            f"format version {info.get('version')!r}; this reader reads {DELTA_VERSION}"
        )
    wrong = [
        f
        for f, kind in _FIELDS.items()
        if not isinstance(info.get(f), kind) or (kind is int and isinstance(info.get(f), bool))
    ]
    if wrong:
        raise shown.refuse(f"{DELTA_FILE} lacks or mistypes {wrong}")
    delta = Delta(path, info, manifest)
    listed = [*info["files"], *([info["dense"]] if info.get("dense") else [])]
    unlisted = [f for f in listed if not isinstance(f, str) or f not in manifest["files"]]
    if unlisted:
        raise delta.refuse(f"files {unlisted} are not in its manifest")
    try:
        verify_files(path, manifest, listed, strong=signing is not None)
    except Exception as err:  # noqa: BLE001 - damaged: refused
        raise delta.refuse(str(err)) from err
    return delta


# ---------------------------------------------------------------------- applying
def check_chain(base_id: str, deltas: Sequence[Delta], current: tuple[int, str] = (0, "")) -> None:
    """Refuses deltas that do not follow each other from ``current`` on top of ``base_id``.

    Args:
        base_id: the base checkpoint's id.
        deltas: the deltas, in the order they would be applied.
        current: the sequence and id applied last (``(0, base_id)`` by default: the base).

    Raises:
        DeltaRefusedError: naming the first delta out of order, after a gap (naming the missing
            one), of another base, or of another chain (another parent).
    """
    sequence, parent = current[0], current[1] or base_id
    for delta in deltas:
        if delta.base != base_id:
            raise delta.refuse(
                f"it follows base {delta.base[:16]}..., not this base {base_id[:16]}... "
                "(another chain or model)"
            )
        if delta.sequence <= sequence:
            raise delta.refuse(
                f"out of order: sequence {delta.sequence} is not after {sequence} (applied already)"
            )
        if delta.sequence > sequence + 1:
            raise delta.refuse(
                f"a gap: {delta_name(sequence + 1)} is missing before sequence {delta.sequence}"
            )
        if delta.parent != parent:
            raise delta.refuse(
                f"it follows {delta.parent[:16]}..., not the state applied last "
                f"({parent[:16]}...): another chain"
            )
        sequence, parent = delta.sequence, delta.id


def _check_content(
    delta: Delta,
    tables: Mapping[str, _Table],
    states: Mapping[str, Mapping[str, torch.Tensor]],
    dense: Mapping[str, torch.Tensor],
) -> list[dict[str, torch.Tensor]]:
    """Every rank file of ``delta``, checked against the model."""
    for table, entry in delta.info["tables"].items():
        if table not in tables:
            raise delta.refuse(f"table {table!r} is not in the model (another model)")
        t = tables[table]
        if not isinstance(entry, dict) or entry.get("rows") != t.rows or entry.get("dim") != t.dim:
            raise delta.refuse(
                f"table {table!r} is {entry} there, {t.rows} x {t.dim} here (another model)"
            )
    files = [delta.tensors(f) for f in delta.info["files"]]
    counts: dict[str, int] = {}
    seen: dict[str, list[torch.Tensor]] = {}
    for file_name, content in zip(delta.info["files"], files, strict=True):
        for name, value in content.items():
            table, _, what = name.partition("/")
            if table not in delta.info["tables"]:
                raise delta.refuse(
                    f"{file_name}: {name} names a table its delta.json does not list"
                )
            t = tables[table]
            ids = content.get(f"{table}/ids")
            if ids is None or ids.dtype != torch.int64 or ids.dim() != 1:
                raise delta.refuse(f"{file_name}: {table}/ids missing or not int64 [n]")
            n = len(ids)
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise delta.refuse(f"{file_name}: {name} holds NaN or inf")
            if what == "ids":
                if n and (int(ids.min()) < 0 or int(ids.max()) >= t.rows):
                    raise delta.refuse(
                        f"{file_name}: an id of {table!r} is outside its {t.rows} rows"
                    )
                if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
                    raise delta.refuse(f"{file_name}: {table}/ids are not sorted and unique")
                counts[table] = counts.get(table, 0) + n
                seen.setdefault(table, []).append(ids)
            elif what == "rows":
                if value.dtype != torch.float32 or tuple(value.shape) != (n, t.dim):
                    raise delta.refuse(
                        f"{file_name}: {name} is {value.dtype} {list(value.shape)}, not "
                        f"float32 [{n}, {t.dim}]"
                    )
            elif what.startswith("state/"):
                target = states.get(table, {}).get(what[len("state/") :])
                if target is not None and (
                    tuple(value.shape[1:]) != tuple(global_shape(target)[1:]) or value.shape[0] != n
                ):
                    raise delta.refuse(
                        f"{file_name}: {name} has shape {list(value.shape)}, the "
                        f"optimizer's is {list(global_shape(target))}"
                    )
            else:
                raise delta.refuse(f"{file_name}: unknown entry {name}")
    for table, entry in delta.info["tables"].items():
        parts = seen.get(table, [])
        union = torch.cat(parts).unique() if parts else torch.empty(0, dtype=torch.int64)
        if counts.get(table, 0) != entry.get("ids") or len(union) != counts.get(table, 0):
            raise delta.refuse(
                f"table {table!r}: its files hold {counts.get(table, 0)} ids ({len(union)} "
                f"distinct), delta.json says {entry.get('ids')}"
            )
    if delta.info.get("dense"):
        content = delta.tensors(delta.info["dense"])
        for name, value in content.items():
            target = dense.get(name)
            if target is None or tuple(value.shape) != tuple(global_shape(target)):
                raise delta.refuse(
                    f"dense entry {name!r} ({list(value.shape)}) does not fit the model"
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise delta.refuse(f"dense entry {name!r} holds NaN or inf")
        files.append(content)
    return files


def _put(tensor: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
    """Writes rows ``ids`` (global) of ``tensor`` that this rank holds."""
    info = shard_info(tensor)
    for shard in info.shards:
        start, stop = shard.row_offset, shard.row_offset + shard.tensor.shape[0]
        mask = (ids >= start) & (ids < stop)
        if bool(mask.any()):
            device = shard.tensor.device
            rows = (ids[mask] - start).to(device)
            shard.tensor[rows] = values[mask].to(device=device, dtype=shard.tensor.dtype)


def _apply(
    delta_files: list[dict[str, torch.Tensor]],
    has_dense: bool,
    tables: Mapping[str, _Table],
    states: Mapping[str, Mapping[str, torch.Tensor]],
    dense: Mapping[str, torch.Tensor],
) -> None:
    rank_files = delta_files[:-1] if has_dense else delta_files
    with torch.no_grad():
        for content in rank_files:
            for name, value in content.items():
                table, _, what = name.partition("/")
                ids = content[f"{table}/ids"]
                if what == "rows":
                    _put(tables[table].tensor, ids, value)
                elif what.startswith("state/"):
                    target = states.get(table, {}).get(what[len("state/") :])
                    if target is not None:
                        _put(target, ids, value)
        if has_dense:
            for name, value in delta_files[-1].items():
                target = dense[name]
                if _is_sharded(target):
                    _put(target, torch.arange(value.shape[0]), value)
                else:
                    target.copy_(value)


def restore_chain(
    module: nn.Module,
    base: str | Path,
    deltas: Sequence[str | Path],
    optimizer: Any = None,
    *,
    key: bytes | str | None = None,
) -> Delta | None:
    """Loads the full checkpoint ``base`` and applies ``deltas`` in order. Collective.

    Every delta is read, verified and checked against the chain and the model before anything
    is loaded: a delta out of order, after a gap, of another base, chain or model, with an id
    outside its table, or damaged or unsigned (with a key) is refused on every rank and the
    model keeps its state. The base loads through :func:`~lightning_torchrec.checkpoint.
    load_sharded` (resharding to this plan and world size); each rank then writes the rows it
    owns, and the dense state.

    Args:
        module: the (sharded) module.
        base: the base checkpoint folder.
        deltas: the delta folders, in order (sequence 1 first).
        optimizer: a keyed optimizer (or one wrapping it): loaded from the base, with the rows'
            optimizer state of deltas that hold it.
        key: the HMAC key the base and deltas must be signed with.

    Returns:
        The last delta applied (None without deltas).

    Raises:
        DeltaRefusedError: on every rank, naming the delta refused; nothing is loaded.
    """
    base = local_path(base)
    error: BaseException | None = None
    read: list[Delta] = []
    contents: list[list[dict[str, torch.Tensor]]] = []
    tables = states = dense = None
    try:
        base_id = checkpoint_id(base)
        read = [read_delta(d, key=key) for d in deltas]
        check_chain(base_id, read)
        tables = model_tables(module)
        check_whole_rows(tables)
        states = _row_states(optimizer, tables)
        dense = _dense_targets(module, tables)
        contents = [_check_content(d, tables, states, dense) for d in read]
    except Exception as err:  # noqa: BLE001 - agreed below
        error = err
    agree_checkpoint_error(error)
    load_sharded(
        base, module, [keyed_optimizer(optimizer)] if optimizer is not None else [], key=key
    )
    tables = model_tables(module)
    states = _row_states(optimizer, tables)
    dense = _dense_targets(module, tables)
    try:  # a failure here (out of memory) is every rank's, not one rank's alone
        for delta, files in zip(read, contents, strict=True):
            _apply(files, bool(delta.info.get("dense")), tables, states, dense)
    except Exception as err:  # noqa: BLE001 - agreed below
        error = err
    agree_checkpoint_error(error)
    return read[-1] if read else None


def chain_of(root: str | Path) -> list[Path]:
    """The delta folders under ``root``, by sequence (hidden partial folders are skipped).

    Args:
        root: the chain's folder.

    Returns:
        ``root/delta-000001``, ``root/delta-000002``, ... that exist, in order.
    """
    root = local_path(root)
    found = [p for p in root.glob("delta-*") if p.is_dir() and p.name[6:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[6:]))  # delta-1000000 after delta-999999
