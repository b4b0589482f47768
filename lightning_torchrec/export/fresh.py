"""A served model kept fresh by deltas: verified, applied out of place, swapped in one step.

Standalone: this module imports only the standard library, ``torch`` and ``torchrec``, so a
serving process that cannot import ``lightning_torchrec`` loads it by file path::

    import importlib.util
    spec = importlib.util.spec_from_file_location("fresh", "/path/to/export/fresh.py")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    model = fresh.FreshModel("dlrm_int8.pt2")        # reads dlrm_int8.pt2.json beside it
    model.apply("deltas/delta-000001")               # DeltaRefusedError if it does not fit
    logits = model(dense_features, sparse_features)  # the current state, whole

A delta (version 1, written by ``lightning_torchrec.checkpoint.delta``) is a folder holding
``delta.json``, ``rank-NNNNN.pt`` files (the changed rows of each table, by global id),
``dense.pt`` (every dense tensor) and ``checksums.json`` (the package's manifest: CRC-32 and size
of each file, SHA-256 and an HMAC-SHA256 signature when a key is set). :func:`read_delta` checks
all of it before anything is used; :meth:`FreshModel.apply` checks that the delta continues the
served chain and fits the served tables, then writes the rows (re-quantized row-wise for
int8/int4 exactly as the export quantizes them: :func:`encode_rows`) into a *copy* of the served
module and swaps the copy in by replacing one reference. A request reads that reference once, so
it runs wholly on the old or wholly on the new state; a refused or failed delta leaves the served
model as it was. A managed-collision model's remap of raw ids is rebuilt from the MCH buffers in
``dense.pt`` (:func:`served_remap`, with which the export builds it) and swapped in with the rows.

After each delta the served model equals a full export of the same training step: bit for bit at
fp32 (rows and dense tensors are copied), and at int8/int4/fp16 equal to the export's own
quantization of those rows (the same fbgemm operator, the same row layout).
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import io
import json
import os
import re
import stat
import threading
import warnings
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torchrec  # noqa: F401  (registers fbgemm's operators: the row-wise quantizer)

try:
    from lightning_torchrec.errors import DeltaRefusedError
except ImportError:  # a serving process without the package

    class DeltaRefusedError(ValueError):  # type: ignore[no-redef]
        """A delta that cannot be applied; names the delta and the reason.

        Nothing of it was applied: the model keeps its last good state.
        """


#: ``delta.json``'s ``format``.
DELTA_FORMAT = "lightning_torchrec.delta"

#: The delta format version this module reads.
DELTA_VERSION = 1

#: The files of a delta folder.
DELTA_FILE, MANIFEST_FILE, DENSE_FILE = "delta.json", "checksums.json", "dense.pt"

#: A rank file's name.
RANK_FILE = re.compile(r"rank-\d{5}\.pt")

#: A delta folder's name (``delta-<sequence:06d>``).
DELTA_NAME = re.compile(r"delta-(\d{6,})")

#: The environment variable naming a key file (as ``lightning_torchrec.checkpoint.signing``).
KEY_FILE_ENV = "LIGHTNING_TORCHREC_CHECKPOINT_KEY_FILE"

#: The shortest key accepted (bytes), as the package's signing.
MIN_KEY_BYTES = 16

#: Bytes of the per-row fp16 scale and bias of int8/int4 rows (stored first in each TBE row).
SCALE_BIAS_BYTES = 4

#: Bits per value of each table dtype.
DTYPE_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}

#: The largest ``checksums.json`` or ``delta.json`` read (bytes).
MAX_JSON_BYTES = 16 << 20

_HEX = {"crc32": re.compile(r"[0-9a-f]{8}"), "sha256": re.compile(r"[0-9a-f]{64}")}


# ---------------------------------------------------------------------------------------------
# Rows: the export's quantization, shared with export/quantize.py


@torch.no_grad()
def encode_rows(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """Float rows in the byte layout of fbgemm's inference tables (TorchRec's TBE).

    fp32/fp16: the values' bytes; int8/int4: fbgemm's row-wise quantization
    (``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``), its fp16 scale and bias moved from
    after the data (where the quantizer puts them) to the front (where the TBE reads them).

    Args:
        rows: ``[n, dim]`` float rows.
        dtype: ``"fp32"``, ``"fp16"``, ``"int8"`` or ``"int4"``.

    Returns:
        ``uint8 [n, bytes]``: ``dim * bits / 8`` bytes, plus 4 for int8/int4 (no padding).
    """
    if dtype == "fp32":
        return rows.float().contiguous().view(torch.uint8)
    if dtype == "fp16":
        return rows.half().contiguous().view(torch.uint8)
    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(
        rows.float().contiguous(), DTYPE_BITS[dtype]
    )
    return torch.cat([fused[:, -SCALE_BIAS_BYTES:], fused[:, :-SCALE_BIAS_BYTES]], dim=1)


# ---------------------------------------------------------------------------------------------
# Managed-collision remapping: the served form of an MCH module's state, shared with
# export/managed.py (the export builds its RawIdRemap with it, a delta's rebuild is the same)

#: An empty slot of an MCH module, and of the served remap (no raw id reaches it).
EMPTY = torch.iinfo(torch.int64).max

#: The served remap's tensors (``export.managed.RawIdRemap``'s buffers): every table's
#: admitted raw ids, their rows, the fallback row of each shard.
REMAP_TENSORS = ("sorted_ids", "rows", "fallback")


def bucket_width(input_size: int, buckets: int, shards: int) -> int:
    """How many consecutive raw ids each row-wise shard gets: shard ``id // width``.

    TorchRec's row-wise input dist (``RwSparseFeaturesDist``) cuts ``[0, input_size)`` into
    ``buckets`` blocks of ``ceil(input_size / buckets)`` ids, ``buckets / shards`` consecutive
    blocks per shard (fbgemm's ``block_bucketize_sparse_features``).

    Args:
        input_size: the raw-id range.
        buckets: the MCH module's buckets (a multiple of ``shards``).
        shards: the row-wise shards (ranks).

    Returns:
        The width, at most ``input_size`` (with one shard the product may pass ``int64`` max).
    """
    return min(-(-input_size // buckets) * (buckets // shards), input_size)


def served_remap(
    table: str,
    sorted_raw_ids: torch.Tensor,
    remapped_ids: torch.Tensor,
    segments: list[int],
    input_size: int,
    buckets: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One table's MCH state in the served form: what ``RawIdRemap`` holds for it.

    Each shard's slice of the state is sorted as TorchRec's load sorts it; its last slot is
    never matched, and only the ids of the shard's own bucket are kept. The kept ids of all
    shards (so sorted) come first, then :data:`EMPTY` up to ``rows - shards + 1`` entries: a
    size fixed by the table, not by how many ids are admitted, so a graph that slices the
    remap by table (a ``.pt2`` bakes the bounds in) stays valid as deltas admit and evict.

    Args:
        table: the table (for messages).
        sorted_raw_ids: the module's ``_mch_sorted_raw_ids`` (unsharded: every shard's slice).
        remapped_ids: its ``_mch_remapped_ids_mapping`` (the global row of each slot).
        segments: the shard boundaries ``[0, ..., rows]``.
        input_size: the raw-id range.
        buckets: the module's buckets.

    Returns:
        ``(ids, their rows, fallback row per shard, ids per shard)``: ``int64 [rows - shards +
        1]`` twice, ``int64 [shards]`` and the bucket width.

    Raises:
        ValueError: for a state not in non-empty row-wise shards covering it whose number
            divides ``buckets``, or that maps an id to a row outside it, naming the table.
    """
    shards = len(segments) - 1
    total = sorted_raw_ids.shape[0]
    bad = (
        shards < 1
        or segments[0] != 0
        or segments[-1] != total
        or any(b <= a for a, b in zip(segments, segments[1:], strict=False))
        or tuple(remapped_ids.shape) != (total,)
    )
    if bad or buckets % shards:
        raise ValueError(
            f"table {table!r}: its managed-collision state was sharded as rows {segments} "
            f"with {buckets} buckets; the export needs non-empty row-wise shards covering "
            f"[0, {total}) and a bucket count divisible by their number"
        )
    width = bucket_width(input_size, buckets, shards)
    ids, rows, fallback = [], [], []
    for p in range(shards):
        start, end = segments[p], segments[p + 1]
        order = torch.argsort(sorted_raw_ids[start:end], stable=True)  # as TorchRec's load
        held = sorted_raw_ids[start:end][order][:-1]  # its last slot is never matched
        held_rows = remapped_ids[start:end][order][:-1]
        mine = (held >= p * width) & (held < min((p + 1) * width, input_size))
        ids.append(held[mine])
        rows.append(held_rows[mine])
        fallback.append(end - 1)
    kept = torch.cat(rows)
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= total):
        raise ValueError(
            f"table {table!r}: its managed-collision state maps an id outside its rows"
        )
    pad = total - shards + 1 - kept.numel()  # at least 1: the end, never passed by searchsorted
    ids.append(torch.full((pad,), EMPTY, dtype=torch.int64))
    rows.append(torch.zeros(pad, dtype=torch.int64))
    return torch.cat(ids), torch.cat(rows), torch.tensor(fallback, dtype=torch.int64), width


# ---------------------------------------------------------------------------------------------
# Reading a delta


def checkpoint_id(folder: str | Path) -> str:
    """The id of a checkpoint or delta folder: the SHA-256 hex of its ``checksums.json`` bytes.

    Args:
        folder: the folder.

    Returns:
        The hex digest.

    Raises:
        FileNotFoundError: if the folder has no ``checksums.json``.
    """
    return hashlib.sha256((Path(folder) / MANIFEST_FILE).read_bytes()).hexdigest()


def resolve_key(key: bytes | str | None) -> bytes | None:
    """The key in force, as the package's signing.

    ``key``, else the file named by :data:`KEY_FILE_ENV`, else None (deltas need not be
    signed).

    Args:
        key: an explicit key (a ``str`` is encoded as UTF-8), or None.

    Returns:
        The key, or None.

    Raises:
        ValueError: for a key shorter than :data:`MIN_KEY_BYTES`.
    """
    where = "the argument"
    if key is None:
        env = os.environ.get(KEY_FILE_ENV)
        if not env:
            return None
        key, where = Path(env).read_bytes().strip(), env
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(f"the key from {where} has {len(raw)} bytes; use at least {MIN_KEY_BYTES}")
    return raw


class Delta(NamedTuple):
    """A verified delta, read whole (see :func:`read_delta`).

    Attributes:
        path: its folder.
        name: ``delta-<sequence:06d>``.
        id: its id (``delta.json``'s ``id``).
        sequence: its place in the chain (1 for the first after the base checkpoint).
        parent: the id of the state it applies on (the previous delta's, or for sequence 1 the
            base checkpoint's).
        base: the base checkpoint's id.
        step: the global step trained when it was written.
        partition: the partition trained last, or None.
        tables: ``{table: (rows, dim)}`` as the writer's model has them.
        ids: ``{table: int64 [n]}`` the changed rows' ids, sorted, unique.
        rows: ``{table: float32 [n, dim]}`` their values.
        dense: ``{name: tensor}`` every dense tensor of the model, or None (unchanged).
        info: ``delta.json``'s content.
    """

    path: Path
    name: str
    id: str
    sequence: int
    parent: str
    base: str
    step: int
    partition: str | None
    tables: dict[str, tuple[int, int]]
    ids: dict[str, torch.Tensor]
    rows: dict[str, torch.Tensor]
    dense: dict[str, torch.Tensor] | None
    info: dict[str, Any]

    def label(self) -> str:
        """``"delta delta-000003 (/path/delta-000003)"``, how messages name it."""
        return f"delta {self.name} ({self.path})"


def _refuse(label: str, reason: str) -> DeltaRefusedError:
    return DeltaRefusedError(f"{label} refused: {reason}. Nothing of it was applied.")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_plain_name(name: Any) -> bool:
    if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name:
        return False
    return "/" not in name and "\\" not in name


def _read_file(folder: Path, name: str, cap: int | None, label: str) -> bytes:
    """A regular file directly inside ``folder`` (no link), read whole."""
    try:
        fd = os.open(folder / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        raise _refuse(label, f"{name} is missing or cannot be opened ({err.strerror})") from err
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(label, f"{name} is not a regular file")
        if cap is not None and info.st_size > cap:
            raise _refuse(label, f"{name} has {info.st_size} bytes, more than {cap}")
        return f.read()


def _read_manifest(folder: Path, label: str, key: bytes | None) -> dict[str, Any]:
    data = _read_file(folder, MANIFEST_FILE, MAX_JSON_BYTES, label)
    try:
        manifest = json.loads(data)
    except ValueError as err:
        raise _refuse(label, f"{MANIFEST_FILE} cannot be read (damaged): {err}") from err
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise _refuse(label, f"{MANIFEST_FILE} has no 'files' entry (damaged or not a delta)")
    for name, entry in files.items():
        if not _is_plain_name(name) or name == MANIFEST_FILE:
            raise _refuse(label, f"{MANIFEST_FILE} lists {name!r}, not a plain file name")
        if not isinstance(entry, dict) or not _is_count(entry.get("size")):
            raise _refuse(label, f"{MANIFEST_FILE}: the entry of {name!r} has no valid size")
        for kind, pattern in _HEX.items():
            value = entry.get(kind)
            if (kind == "crc32" or value is not None) and not (
                isinstance(value, str) and pattern.fullmatch(value)
            ):
                raise _refuse(label, f"{MANIFEST_FILE}: the entry of {name!r} has no valid {kind}")
    if key is not None:
        _check_signature(manifest, key, label)
    return manifest


def _check_signature(manifest: dict[str, Any], key: bytes, label: str) -> None:
    """As ``lightning_torchrec.checkpoint.signing.check_signature``."""
    sig = manifest.get("signature")
    if not isinstance(sig, dict) or sig.get("alg") != "hmac-sha256":
        raise _refuse(label, "it is not signed, and a key is set: only signed deltas are applied")
    unsigned = {k: v for k, v in manifest.items() if k != "signature"}
    payload = json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()
    expected = hmac.new(key, payload, hashlib.sha256).hexdigest()
    mac = sig.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(
        mac.encode("utf-8", "surrogatepass"), expected.encode()
    ):
        raise _refuse(
            label, "its manifest's signature does not match the key (another key, or changed)"
        )
    missing = sorted(n for n, e in manifest["files"].items() if "sha256" not in e)
    if missing:
        raise _refuse(label, f"files without a SHA-256 in its signed manifest: {missing[:5]}")


def _verified(folder: Path, name: str, manifest: dict[str, Any], label: str) -> bytes:
    entry = manifest["files"].get(name)
    if entry is None:
        raise _refuse(label, f"{name} is not listed in {MANIFEST_FILE}")
    data = _read_file(folder, name, entry["size"], label)  # a planted huge file: never read
    if len(data) != entry["size"]:
        raise _refuse(
            label, f"{name} has {len(data)} bytes, {entry['size']} were written (truncated?)"
        )
    crc = f"{zlib.crc32(data):08x}"
    if crc != entry["crc32"]:
        raise _refuse(label, f"{name} is damaged (crc32 {crc}, written {entry['crc32']})")
    if "sha256" in entry:
        sha = hashlib.sha256(data).hexdigest()
        if sha != entry["sha256"]:
            raise _refuse(label, f"{name} is damaged (sha256 {sha[:16]}, written ...)")
    return data


def _load_tensors(data: bytes, name: str, label: str) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - anything unreadable is a damaged file
        raise _refuse(label, f"{name} cannot be read as tensors: {err!s:.300}") from err
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise _refuse(label, f"{name} is not a flat dict of named tensors")
    return loaded


def _check_info(info: Any, label: str) -> dict[str, Any]:
    """``delta.json``'s fields, each of its type; returns the tables as ``{t: (rows, dim, n)}``."""
    if not isinstance(info, dict):
        raise _refuse(label, f"{DELTA_FILE} is not a JSON object")
    if info.get("format") != DELTA_FORMAT:
        raise _refuse(label, f"{DELTA_FILE}'s format is {info.get('format')!r}, not a delta")
    if info.get("version") != DELTA_VERSION:
        raise _refuse(
            label, f"format version {info.get('version')!r}; this reader reads {DELTA_VERSION}"
        )
    for field in ("id", "parent", "base", "name"):
        if not isinstance(info.get(field), str) or not info[field]:
            raise _refuse(label, f"{DELTA_FILE}'s {field!r} is not a non-empty string")
    for field in ("sequence", "step"):
        if not _is_count(info.get(field)):
            raise _refuse(label, f"{DELTA_FILE}'s {field!r} is not a non-negative integer")
    if info["sequence"] < 1 or info["name"] != f"delta-{info['sequence']:06d}":
        raise _refuse(
            label, f"its name {info['name']!r} and sequence {info['sequence']} do not agree"
        )
    if info.get("partition") is not None and not isinstance(info["partition"], str):
        raise _refuse(label, f"{DELTA_FILE}'s 'partition' is neither a string nor null")
    if info.get("dense") not in (DENSE_FILE, None):
        raise _refuse(label, f"{DELTA_FILE}'s 'dense' is {info.get('dense')!r}")
    if not isinstance(info.get("optimizer"), bool):
        raise _refuse(label, f"{DELTA_FILE}'s 'optimizer' is not a boolean")
    files = info.get("files")
    if not isinstance(files, list) or not all(
        isinstance(f, str) and RANK_FILE.fullmatch(f) for f in files
    ):
        raise _refuse(label, f"{DELTA_FILE}'s 'files' is not a list of rank-NNNNN.pt names")
    if len(set(files)) != len(files):
        raise _refuse(label, f"{DELTA_FILE}'s 'files' names a file twice")
    tables = info.get("tables")
    if not isinstance(tables, dict):
        raise _refuse(label, f"{DELTA_FILE}'s 'tables' is not an object")
    out = {}
    for table, spec in tables.items():
        counts = [spec.get(k) if isinstance(spec, dict) else None for k in ("rows", "dim", "ids")]
        if not all(_is_count(c) for c in counts) or counts[1] == 0:
            raise _refuse(label, f"{DELTA_FILE}: table {table!r} has no valid rows/dim/ids")
        out[table] = tuple(counts)
    return out


def _table_of(key: str) -> tuple[str, str]:
    """The table of a rank file's key and its kind: ``"ids"``, ``"rows"``, ``"state"``.

    ``"t/state/<name>"`` is ``("t", "state")``; anything else ``("", "")``.
    """
    at = key.rfind("/state/")
    if at > 0:
        return key[:at], "state"
    table, _, kind = key.rpartition("/")
    return (table, kind) if table and kind in ("ids", "rows") else ("", "")


def read_delta(path: str | Path, key: bytes | str | None = None) -> Delta:
    """Reads and verifies a delta folder (version 1) before any of it is used.

    Checked, in order: ``checksums.json`` (its entries; with a key, its HMAC-SHA256 signature
    and every file's SHA-256); every file of the folder is listed and every listed file is there
    with its size and CRC-32 (and SHA-256 when listed); ``delta.json``'s fields; the rank files
    and ``dense.pt`` load with ``torch.load(weights_only=True)`` as flat dicts of tensors; each
    table's ids are int64, sorted, unique (across files too), in ``[0, rows)``, as many as
    ``delta.json`` says, and its rows ``float32 [n, dim]``.

    Args:
        path: the delta folder.
        key: the key it must be signed with (``bytes`` or ``str``); None: the file named by
            ``LIGHTNING_TORCHREC_CHECKPOINT_KEY_FILE`` if set, else no signature is required.

    Returns:
        The :class:`Delta`.

    Raises:
        DeltaRefusedError: naming the delta (folder and name) and what is wrong.
    """
    folder = Path(path)
    label = f"delta {folder.name} ({folder})"
    if not folder.is_dir():
        raise _refuse(label, "it is not a folder")
    manifest = _read_manifest(folder, label, resolve_key(key))
    try:
        info = json.loads(_verified(folder, DELTA_FILE, manifest, label))
    except ValueError as err:
        if isinstance(err, DeltaRefusedError):
            raise
        raise _refuse(label, f"{DELTA_FILE} is not JSON: {err}") from err
    if isinstance(info, dict) and isinstance(info.get("name"), str):
        label = f"delta {info['name']} ({folder})"
    tables = _check_info(info, label)
    expected = {DELTA_FILE, *info["files"], *([DENSE_FILE] if info["dense"] else [])}
    listed = set(manifest["files"])
    present = {p.name for p in folder.iterdir()} - {MANIFEST_FILE}
    for what, names in (
        (f"listed in {DELTA_FILE} but not in {MANIFEST_FILE}", expected - listed),
        (f"listed in {MANIFEST_FILE} but not in {DELTA_FILE}", listed - expected),
        (f"in the folder but not listed in {MANIFEST_FILE}", present - listed),
    ):
        if names:
            raise _refuse(label, f"files {what}: {sorted(names)}")
    ids: dict[str, list[torch.Tensor]] = {t: [] for t in tables}
    rows: dict[str, list[torch.Tensor]] = {t: [] for t in tables}
    for name in info["files"]:
        tensors = _load_tensors(_verified(folder, name, manifest, label), name, label)
        for tkey in tensors:
            table, kind = _table_of(tkey)
            if table not in tables:
                raise _refuse(label, f"{name} holds {tkey!r}, not of a table in {DELTA_FILE}")
        for table, (count, dim, _) in tables.items():
            got = _check_rows(tensors, table, count, dim, f"{name}", label)
            if got is not None:
                ids[table].append(got[0])
                rows[table].append(got[1])
    merged_ids, merged_rows = {}, {}
    for table, (_, _, n) in tables.items():
        if not ids[table]:
            if n:
                raise _refuse(label, f"table {table!r}: {n} ids in {DELTA_FILE}, none in files")
            continue
        all_ids, all_rows = torch.cat(ids[table]), torch.cat(rows[table])
        if len(ids[table]) > 1:  # each file's are sorted: merge (numpy's sort: torch's is
            # two hundred times slower on a busy CPU)
            order = torch.from_numpy(all_ids.numpy().argsort(kind="stable"))
            all_ids, all_rows = all_ids[order], all_rows[order]
        if all_ids.numel() != n:
            raise _refuse(
                label, f"table {table!r}: {all_ids.numel()} ids in its files, {n} in {DELTA_FILE}"
            )
        if all_ids.numel() > 1 and not bool((all_ids[1:] > all_ids[:-1]).all()):
            raise _refuse(label, f"table {table!r}: an id is in two rank files")
        merged_ids[table], merged_rows[table] = all_ids, all_rows
    dense = None
    if info["dense"]:
        dense = _load_tensors(_verified(folder, DENSE_FILE, manifest, label), DENSE_FILE, label)
    return Delta(
        path=folder,
        name=info["name"],
        id=info["id"],
        sequence=info["sequence"],
        parent=info["parent"],
        base=info["base"],
        step=info["step"],
        partition=info.get("partition"),
        tables={t: (r, d) for t, (r, d, _) in tables.items()},
        ids=merged_ids,
        rows=merged_rows,
        dense=dense,
        info=info,
    )


def _check_rows(
    tensors: dict[str, torch.Tensor], table: str, count: int, dim: int, name: str, label: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A rank file's ids and rows of one table, checked; None when the file has none."""
    ids, rows = tensors.get(f"{table}/ids"), tensors.get(f"{table}/rows")
    if ids is None and rows is None:
        return None
    where = f"{name}, table {table!r}"
    if ids is None or rows is None:
        raise _refuse(label, f"{where}: ids and rows must come together")
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise _refuse(label, f"{where}: ids are {ids.dtype} {list(ids.shape)}, not int64 [n]")
    if rows.dtype != torch.float32 or tuple(rows.shape) != (ids.numel(), dim):
        raise _refuse(
            label,
            f"{where}: rows are {rows.dtype} {list(rows.shape)}, not float32 "
            f"[{ids.numel()}, {dim}]",
        )
    if ids.numel():
        if int(ids.min()) < 0:
            raise _refuse(label, f"{where}: id {int(ids.min())} is negative")
        if int(ids.max()) >= count:
            raise _refuse(
                label,
                f"{where}: id {int(ids.max())} >= the table's rows ({count}); ids must "
                f"be in [0, {count})",
            )
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise _refuse(label, f"{where}: ids are not sorted and unique")
    finite = torch.isfinite(rows).all(1)
    if not bool(finite.all()):
        first = int(ids[~finite][0])
        raise _refuse(label, f"{where}: the row of id {first} holds NaN or inf")
    for key, value in tensors.items():
        if key.startswith(f"{table}/state/") and (
            value.dim() == 0 or value.shape[0] != ids.numel()
        ):
            raise _refuse(
                label, f"{where}: {key} has {list(value.shape)}, not [{ids.numel()}, ...]"
            )
    return ids, rows


# ---------------------------------------------------------------------------------------------
# The served model


class _Served(NamedTuple):
    """One served state, swapped whole: the module and where it stands in the chain."""

    module: Any
    id: str
    sequence: int
    delta: str | None
    step: int | None


def _resolve(module: Any, name: str) -> torch.Tensor:
    # Attribute by attribute: a TorchScript module has no get_submodule().
    value = module
    for attr in name.split("."):
        value = getattr(value, attr)
    if not isinstance(value, torch.Tensor):
        raise AttributeError(f"{name} is a {type(value).__name__}, not a tensor")
    return value


def _copy_module(module: Any) -> Any:
    with warnings.catch_warnings():  # torch's pytree deprecation, raised by copying a spec
        warnings.filterwarnings("ignore", "`isinstance\\(treespec, LeafSpec\\)`", FutureWarning)
        return copy.deepcopy(module)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The SHA-256 hex of a tensor's bytes (C order).

    Args:
        tensor: any CPU tensor.

    Returns:
        The digest.
    """
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


class FreshModel:
    """An exported artifact served while deltas keep it fresh (see the module's docstring).

    ``model(*inputs)`` runs the current state; :meth:`apply` verifies a delta and swaps in the
    state after it. Requests and :meth:`apply` may run in different threads: a request reads
    the current module once, so it sees the state before or after a delta, never a mix; two
    :meth:`apply` calls run one after the other.

    Memory and time: a delta is applied to a copy of the served module (``copy.deepcopy``:
    its tables dominate, and the tables of one embedding collection share one fbgemm buffer, so
    a copy of a changed table's buffer is nearly the whole model anyway), so applying needs the
    model's size once more, for as long as requests still run on the old state. Measured on a
    busy 2-core CPU, int8 tables of 65 MiB (4 x 250,000 rows of 64): the copy 70 ms; a delta of
    1,000 rows a table plus dense applied in 0.16-0.27 s, of 50,000 rows a table (51 MB of
    float rows to read, verify and quantize) in 0.6-0.8 s. The alternative when
    twice the memory is too much per delta: a double buffer (two resident copies, the standby
    one brought up to date with the last two deltas and swapped; no allocation per delta but
    twice the memory all the time), or writes in place under a reader-writer lock (no copy, but
    requests wait while rows are written).

    Args:
        artifact: the exported ``.pt2`` or TorchScript file (with its side file
            ``<artifact>.json`` from ``lightning_torchrec.export``, holding ``checkpoint_id``
            and ``served_state``).
        module: the artifact already loaded (``torch.export.load(p).module()`` or
            ``torch.jit.load(p)``), e.g. by a loader that checks it first; default: loaded here.
        sidecar: the side file, if not beside the artifact.
        key: the key every delta must be signed with; None: the file named by
            ``LIGHTNING_TORCHREC_CHECKPOINT_KEY_FILE`` if set, else unsigned deltas are applied.

    Raises:
        ValueError: for a side file without ``checkpoint_id``/``served_state`` (an export
            from before deltas: export again), or that does not match the artifact.
    """

    def __init__(
        self,
        artifact: str | Path,
        *,
        module: Any = None,
        sidecar: str | Path | None = None,
        key: bytes | str | None = None,
    ) -> None:
        self.artifact = Path(artifact)
        side = Path(sidecar) if sidecar is not None else Path(f"{self.artifact}.json")
        self.info: dict[str, Any] = json.loads(side.read_text())
        state = self.info.get("served_state")
        base = self.info.get("checkpoint_id")
        if not isinstance(base, str) or not isinstance(state, dict):
            raise ValueError(
                f"{side} has no 'checkpoint_id' or 'served_state': the artifact was exported "
                "before deltas could be applied (or from a checkpoint without checksums.json); "
                "export it again"
            )
        self.tables: dict[str, dict[str, Any]] = state["tables"]
        self.dense: dict[str, dict[str, Any]] = state["dense"]
        self.fixed: dict[str, dict[str, Any]] = state.get("fixed", {})
        self.managed: dict[str, dict[str, Any]] = state.get("managed", {})
        self.key = resolve_key(key)
        if module is None:
            if self.info.get("format") == "pt2":
                module = torch.export.load(self.artifact).module()
            else:
                with warnings.catch_warnings():  # TorchScript: deprecated since torch 2.13
                    warnings.filterwarnings("ignore", "`torch.jit.load`", DeprecationWarning)
                    warnings.filterwarnings("ignore", "`torch.jit.load`", FutureWarning)
                    module = torch.jit.load(str(self.artifact))
        self._check_artifact(module, side)
        self.checkpoint_id = base
        self._served = _Served(module, base, 0, None, None)
        self._apply_lock = threading.Lock()

    def _check_artifact(self, module: Any, side: Path) -> None:
        for table, spec in self.tables.items():
            try:
                buffer = _resolve(module, spec["state"])
            except AttributeError as err:
                raise ValueError(f"{self.artifact} has no {spec['state']} ({side}): {err}") from err
            end = spec["offset"] + spec["rows"] * spec["row_bytes"]
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < end:
                raise ValueError(
                    f"{self.artifact}: table {table!r}'s rows are not in {spec['state']} "
                    f"(uint8 {list(buffer.shape)}; {side} says bytes [{spec['offset']}, {end}))"
                )
        expected = [(spec["state"], spec["shape"]) for spec in self.dense.values()]
        for remap in self.managed.values():
            slots = sum(t["rows"] - t["shards"] + 1 for t in remap["tables"])
            shards = sum(t["shards"] for t in remap["tables"])
            for attr, size in zip(REMAP_TENSORS, (slots, slots, shards), strict=True):
                expected.append((remap[attr], [size]))
        for state, shape in expected:
            try:
                tensor = _resolve(module, state)
            except AttributeError as err:
                raise ValueError(f"{self.artifact} has no {state} ({side}): {err}") from err
            if list(tensor.shape) != shape:
                raise ValueError(
                    f"{self.artifact}: {state} is {list(tensor.shape)}, {side} says {shape}"
                )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the current state's module (read once: one whole state per request)."""
        return self._served.module(*args, **kwargs)

    @property
    def module(self) -> Any:
        """The module of the current state (do not write into it)."""
        return self._served.module

    @property
    def current_id(self) -> str:
        """The id of the served state: the last applied delta's, or the base checkpoint's."""
        return self._served.id

    @property
    def sequence(self) -> int:
        """The sequence number of the last applied delta (0: none, the export as is)."""
        return self._served.sequence

    @property
    def applied(self) -> str | None:
        """The name of the last applied delta, or None."""
        return self._served.delta

    @property
    def step(self) -> int | None:
        """The global step of the last applied delta, or None."""
        return self._served.step

    def apply(self, delta: str | Path) -> Delta:
        """Verifies a delta, then serves the state after it (swapped in one step).

        Refused (nothing applied, the current state kept): a damaged, incomplete, unlisted or
        (with a key) unsigned file; a delta already applied or older than the current one (out
        of order); one past the next (a gap: the message names the missing delta); the next one
        of another chain or base checkpoint; a table the served model lacks, or with other rows
        or width; an id outside its table; dense tensors the served model does not hold or with
        other shapes; a managed-collision state that is not the export's (other rows, shards or
        buckets).

        Args:
            delta: the delta folder.

        Returns:
            The applied :class:`Delta`.

        Raises:
            DeltaRefusedError: naming the delta and why.
        """
        with self._apply_lock:
            served = self._served
            loaded = read_delta(delta, self.key)
            self._check_chain(loaded, served)
            remaps = self._check_fits(loaded)
            module = self._build(loaded, served.module, remaps)
            self._served = _Served(module, loaded.id, loaded.sequence, loaded.name, loaded.step)
        return loaded

    def apply_pending(self, root: str | Path) -> list[Delta]:
        """Applies, in order, the deltas under ``root`` newer than the current state.

        Folders named ``delta-<sequence:06d>`` with a sequence above :attr:`sequence` are
        applied in sequence order; the first refusal stops (and raises).

        Args:
            root: the folder the trainer publishes deltas into.

        Returns:
            The deltas applied.

        Raises:
            DeltaRefusedError: for the first delta refused (those before it stay applied).
        """
        found = []
        for entry in Path(root).iterdir():
            match = DELTA_NAME.fullmatch(entry.name)
            if match and entry.is_dir() and int(match.group(1)) > self.sequence:
                found.append((int(match.group(1)), entry))
        return [self.apply(path) for _, path in sorted(found)]

    def _check_chain(self, delta: Delta, served: _Served) -> None:
        label, current = delta.label(), served.sequence
        # Another base first: whatever its sequence, it is not of this chain.
        if delta.base != self.checkpoint_id:
            raise _refuse(
                label,
                f"another model or chain: its base checkpoint is {delta.base}, the served "
                f"export's is {self.checkpoint_id}",
            )
        if delta.sequence <= current:
            again = delta.id == served.id
            raise _refuse(
                label,
                f"out of order: sequence {delta.sequence} "
                + ("is the delta the model serves already" if again else "was already applied")
                + f" (the model serves sequence {current}, "
                + f"{served.delta or 'the export itself'}, id {served.id}; this delta's id is "
                + f"{delta.id})",
            )
        if delta.sequence > current + 1:
            missing = f"delta-{current + 1:06d}"
            raise _refuse(
                label,
                f"a gap in its chain: {missing} (sequence {current + 1}) is missing; the model "
                f"serves sequence {current}",
            )
        if delta.parent != served.id:
            raise _refuse(
                label,
                f"another chain: it applies on state {delta.parent}, the model serves "
                f"{served.id} ({served.delta or 'the export itself'})",
            )

    def _check_fits(self, delta: Delta) -> dict[str, torch.Tensor]:
        """Refuses what does not fit; returns the rebuilt remap tensors by artifact name."""
        label = delta.label()
        for table, (rows, dim) in delta.tables.items():
            spec = self.tables.get(table)
            if spec is None:
                raise _refuse(
                    label,
                    f"another model: table {table!r} is not in the served model "
                    f"(its tables: {sorted(self.tables)})",
                )
            if (rows, dim) != (spec["rows"], spec["dim"]):
                raise _refuse(
                    label,
                    f"another model: table {table!r} has {rows} rows of width {dim}, the "
                    f"served one {spec['rows']} of width {spec['dim']}",
                )
        if delta.dense is None:
            return {}
        managed = [t for remap in self.managed.values() for t in remap["tables"]]
        sources = {t[k] for t in managed for k in ("sorted_raw_ids", "remapped_ids", "segments")}
        carried = sources | {n for t in managed for n in t["other"]}
        unknown = sorted(set(delta.dense) - set(self.dense) - set(self.fixed) - carried)
        if unknown:
            older = not self.managed and any(
                n.rpartition(".")[2] == "sorted_ids" and ".remap." in f".{n}" for n in self.dense
            )
            raise _refuse(
                label,
                f"another model: dense tensors the served model does not hold: {unknown}"
                + (
                    " (the export records no managed-collision remapping to rebuild from them: "
                    "it was exported before deltas of such models could be applied; export it "
                    "again)"
                    if older
                    else ""
                ),
            )
        required = {n for n, s in self.dense.items() if s.get("persistent", True)} | sources
        missing = sorted(required - set(delta.dense))
        if missing:
            raise _refuse(label, f"{DENSE_FILE} lacks dense tensors of the model: {missing}")
        for name, tensor in delta.dense.items():
            if name in carried:
                continue  # managed-collision state: checked as the remap is rebuilt, below
            spec = self.dense.get(name) or self.fixed[name]
            if list(tensor.shape) != spec["shape"] or str(tensor.dtype) != spec["dtype"]:
                raise _refuse(
                    label,
                    f"another model: {name} is {tensor.dtype} {list(tensor.shape)}, the served "
                    f"one {spec['dtype']} {spec['shape']}",
                )
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise _refuse(label, f"{name} holds NaN or inf")
            if name in self.fixed and tensor_sha256(tensor) != spec["sha256"]:
                raise _refuse(
                    label,
                    f"{name} changed, and the artifact holds it as a constant of its graph: "
                    "export the model again",
                )
        return self._rebuilt_remaps(delta, label)

    def _rebuilt_remaps(self, delta: Delta, label: str) -> dict[str, torch.Tensor]:
        """Each served remap's tensors rebuilt from the delta's MCH buffers (as the export)."""
        dense = delta.dense or {}
        out = {}
        for remap in self.managed.values():
            parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            for spec in remap["tables"]:
                table, rows = spec["table"], spec["rows"]
                state = [dense[spec[k]] for k in ("sorted_raw_ids", "remapped_ids", "segments")]
                if len(state[0]) != rows or any(
                    t.dtype != torch.int64 or t.dim() != 1 for t in state
                ):
                    raise _refuse(
                        label,
                        f"another model: table {table!r}'s managed-collision state is "
                        f"{[f'{t.dtype} {list(t.shape)}' for t in state]}, not int64 [{rows}] "
                        "(ids, rows) and int64 [n] (shards)",
                    )
                segments = [int(s) for s in state[2].tolist() if s >= 0]  # -1: no boundary
                if len(segments) - 1 != spec["shards"]:
                    raise _refuse(
                        label,
                        f"table {table!r}: its managed-collision state is in "
                        f"{len(segments) - 1} row-wise shards {segments}, the export's in "
                        f"{spec['shards']} (trained on another number of ranks): export again",
                    )
                try:
                    ids, held_rows, fallback, _ = served_remap(
                        table, state[0], state[1], segments, spec["input_size"], spec["buckets"]
                    )
                except ValueError as err:
                    raise _refuse(label, str(err)) from err
                parts.append((ids, held_rows, fallback))
            for i, attr in enumerate(REMAP_TENSORS):
                out[remap[attr]] = torch.cat([p[i] for p in parts])
        return out

    @torch.no_grad()
    def _build(self, delta: Delta, module: Any, remaps: dict[str, torch.Tensor]) -> Any:
        """The state after ``delta``: a copy of ``module`` with its rows, dense and remaps."""
        new = _copy_module(module)
        for table, ids in delta.ids.items():
            spec = self.tables[table]
            buffer = _resolve(new, spec["state"])
            start, width = spec["offset"], spec["row_bytes"]
            rows = buffer[start : start + spec["rows"] * width].view(spec["rows"], width)
            encoded = encode_rows(delta.rows[table], spec["dtype"])
            rows[ids, : encoded.shape[1]] = encoded
        for name, tensor in (delta.dense or {}).items():
            if name in self.dense:
                _resolve(new, self.dense[name]["state"]).copy_(tensor)
        for state, tensor in remaps.items():  # sizes fixed per table (``served_remap``)
            _resolve(new, state).copy_(tensor)
        return new
