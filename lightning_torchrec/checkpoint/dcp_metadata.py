"""DCP's ``.metadata``: unpickled without running code, then checked to describe a sane checkpoint.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load``: a crafted file runs code.
:func:`parse_dcp_metadata` reads it with :func:`~lightning_torchrec.checkpoint.unpickle.
restricted_load`, admitting only what DCP writes there (``compat.upstream.dcp_metadata_classes``:
its metadata dataclasses and enums; ``torch.Size``, dtypes and layouts; paths, read as strings),
then :func:`check_metadata` refuses what DCP would trip over or what would reach too far:

- every field has the type DCP writes (no strings for sizes, no foreign objects anywhere);
- dtypes are ones a checkpoint holds (:data:`DTYPES`), layouts strided, sizes non-negative;
- every tensor is covered **exactly once** by its chunks (no element left to uninitialised
  memory, none written twice), each chunk within the tensor;
- every chunk has one file slice, in a file named by a plain name inside the folder, no longer
  than the chunk can be (so a tensor never outgrows the bytes on disk), with no stream
  transforms (compression) that could inflate, and no two slices sharing bytes of a file (so
  all tensors together never outgrow the files either);
- the whole walk is bounded by the file's object budget (:class:`CheckpointLimits`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_torchrec.checkpoint.dcp_allow import build_dcp_object, resolve_dcp_global
from lightning_torchrec.checkpoint.limits import DEFAULT_LIMITS, CheckpointLimits
from lightning_torchrec.checkpoint.paths import check_plain_name
from lightning_torchrec.checkpoint.unpickle import PairList, restricted_load
from lightning_torchrec.compat.upstream import DCP_METADATA_VERSIONS, DCP_STORAGE_INFO
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    UnsafeCheckpointError,
)

_STORAGE_INFO = DCP_STORAGE_INFO


#: The dtypes a checkpoint's tensors may have.
DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float64 float32 float16 bfloat16 float8_e4m3fn float8_e5m2 complex64 complex128 "
        "int64 int32 int16 int8 uint64 uint32 uint16 uint8 bool"
    ).split()
    if isinstance(getattr(torch, name, None), torch.dtype)
)

#: Largest tensor dimension accepted (2**62): sums of offsets stay exact in any arithmetic.
_MAX_DIM = 1 << 62


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


class _Checker:
    """Walks unpickled DCP metadata with a budget, raising named errors about ``file``."""

    def __init__(self, file: Path, budget: int) -> None:
        self.file, self.budget = file, budget

    def corrupt(self, why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.file} is not valid DCP metadata: {why}")

    def take(self, n: int = 1) -> None:
        self.budget -= n
        if self.budget < 0:
            raise CheckpointLimitError(
                f"{self.file} expands to more objects than its size allows (shared references "
                "reached repeatedly); refused. If you trust it, raise "
                "CheckpointLimits.objects_per_byte."
            )

    def field(self, obj: Any, cls: type, name: str) -> Any:
        self.take()
        if type(obj) is not cls:
            raise self.corrupt(f"expected {cls.__name__}, found {type(obj).__name__}")
        if name in vars(obj):
            return vars(obj)[name]
        default = _defaults(cls).get(name)
        if default is dataclasses.MISSING:
            raise self.corrupt(f"{cls.__name__} lacks '{name}'")
        return default

    def pairs(self, value: Any, what: str) -> list[tuple[Any, Any]]:
        if type(value) is not PairList:
            raise self.corrupt(f"{what} is a {type(value).__name__}, not a dict")
        self.take(len(value))
        return list(value)

    def str_dict(self, value: Any, what: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, item in self.pairs(value, what):
            if type(key) is not str or key in out:
                raise self.corrupt(f"{what} has the key {key!r:.80} (not a string, or twice)")
            out[key] = item
        return out

    def dims(self, value: Any, what: str, ndim: int | None = None) -> tuple[int, ...]:
        if type(value) is not torch.Size or (ndim is not None and len(value) != ndim):
            raise self.corrupt(f"{what} is not a torch.Size of {ndim} dimensions: {value!r:.80}")
        self.take(len(value))
        if not all(0 <= v < _MAX_DIM for v in value):
            raise self.corrupt(f"{what} has a negative or huge dimension: {list(value)}")
        return tuple(value)


def parse_dcp_metadata(
    data: bytes, file: str | Path, limits: CheckpointLimits = DEFAULT_LIMITS
) -> Metadata:
    """DCP metadata from the bytes of a ``.metadata`` file, unpickled safely and checked.

    Args:
        data: the file's bytes.
        file: the file, for messages.
        limits: the object budget.

    Returns:
        The metadata (its ``storage_meta`` replaced by an empty one: nothing of it is needed).

    Raises:
        UnsafeCheckpointError: for a global, call or opcode DCP metadata never holds, or a file
            name that leaves the folder, naming the file.
        CheckpointCorruptError: for malformed metadata, naming the file and the key.
        CheckpointLimitError: when the file expands beyond its object budget.
    """
    file = Path(file)
    metadata = restricted_load(data, file, resolve_dcp_global, build_dcp_object)
    return check_metadata(metadata, file, limits.object_budget(len(data)))


def check_metadata(metadata: Any, file: Path, budget: int) -> Metadata:
    """Checks unpickled DCP metadata (see the module docstring) and makes its dicts real dicts.

    Args:
        metadata: what :func:`restricted_load` returned.
        file: its file, for messages.
        budget: the objects the walk may visit.

    Returns:
        The metadata.

    Raises:
        CheckpointCorruptError: naming the file and what is wrong (the key, for a tensor).
        UnsafeCheckpointError: for a chunk file name that leaves the folder or stream transforms.
        CheckpointLimitError: when the walk exceeds the budget.
    """
    c = _Checker(file, budget)
    try:
        return _check_all(c, metadata)
    except RecursionError as err:  # repr() of a value nested thousands deep, for a message
        raise c.corrupt("a value is nested too deeply to be anything DCP writes") from err


def _check_all(c: _Checker, metadata: Any) -> Metadata:
    version = c.field(metadata, Metadata, "version")
    if version not in DCP_METADATA_VERSIONS:
        raise c.corrupt(f"written by an unknown DCP version {version!r:.40}")
    entries = c.str_dict(c.field(metadata, Metadata, "state_dict_metadata"), "state_dict_metadata")
    chunks: dict[str, dict[tuple[int, ...], int]] = {}
    for key, entry in entries.items():
        if type(entry) is BytesStorageMetadata:
            continue
        chunks[key] = _check_tensor(c, key, entry)
    storage = _check_storage(c, metadata, entries, chunks)
    planner = c.field(metadata, Metadata, "planner_data")
    if planner is not None:
        planner = c.str_dict(planner, "planner_data")
        for key, route in planner.items():
            c.take(len(route) if type(route) in (tuple, list) else 1)
            if type(route) not in (tuple, list) or not all(type(p) in (str, int) for p in route):
                raise c.corrupt(f"planner_data[{key!r}] is not a tuple of names")
            planner[key] = tuple(route)
    for name, value in (
        ("state_dict_metadata", entries),
        ("planner_data", planner),
        ("storage_data", storage),
        ("storage_meta", StorageMeta()),
    ):
        object.__setattr__(metadata, name, value)
    return metadata


def _check_tensor(c: _Checker, key: str, entry: Any) -> dict[tuple[int, ...], int]:
    """Checks one tensor entry; returns its chunks as ``{offsets: bytes it holds}``."""
    properties = c.field(entry, TensorStorageMetadata, "properties")
    dtype = c.field(properties, TensorProperties, "dtype")
    if dtype not in DTYPES or c.field(properties, TensorProperties, "layout") != torch.strided:
        raise c.corrupt(f"tensor {key!r} has dtype {dtype} / a layout no checkpoint holds")
    size = c.dims(c.field(entry, TensorStorageMetadata, "size"), f"the size of {key!r}")
    listed = c.field(entry, TensorStorageMetadata, "chunks")
    if type(listed) is not list:
        raise c.corrupt(f"the chunks of {key!r} are not a list")
    c.take(len(listed))
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in listed:
        offsets = c.dims(c.field(chunk, ChunkStorageMetadata, "offsets"), key, len(size))
        lengths = c.dims(c.field(chunk, ChunkStorageMetadata, "sizes"), key, len(size))
        if any(o + n > s for o, n, s in zip(offsets, lengths, size, strict=True)):
            raise c.corrupt(f"a chunk of {key!r} at {list(offsets)} reaches outside its size")
        boxes.append((offsets, lengths))
    problem = _coverage_problem(c, size, boxes)
    if problem is not None:
        raise CheckpointCorruptError(
            f"{c.file}: tensor {key!r} of size {list(size)} is not covered exactly once by its "
            f"chunks ({problem}); loading it would leave memory uninitialised or mix values. "
            "Use another checkpoint."
        )
    element = torch.empty((), dtype=dtype).element_size()
    out: dict[tuple[int, ...], int] = {}
    for offsets, lengths in boxes:
        if offsets in out:
            raise c.corrupt(f"two chunks of {key!r} start at {list(offsets)}")
        out[offsets] = math.prod(lengths) * element
    return out


def _coverage_problem(
    c: _Checker, size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> str | None:
    """Why the boxes (all inside ``size``) do not tile it exactly once, or None."""
    numel = math.prod(size)
    full = [b for b in boxes if math.prod(b[1]) > 0]
    held = sum(math.prod(b[1]) for b in full)
    if held != numel:
        return f"its chunks hold {held} elements, it has {numel}"
    if len(full) < 2:
        return None
    # Equal volume and no two boxes overlapping means an exact tiling. Sweep along the dimension
    # with the most distinct starts: only boxes still open at a start can overlap the next one.
    dim = max(range(len(size)), key=lambda d: len({b[0][d] for b in full}))
    full.sort(key=lambda b: b[0][dim])
    open_boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in full:
        start = box[0][dim]
        open_boxes = [b for b in open_boxes if b[0][dim] + b[1][dim] > start]
        c.take(len(open_boxes) + 1)
        for other in open_boxes:
            if all(
                max(a, b) < min(a + n, b + m)
                for a, n, b, m in zip(box[0], box[1], other[0], other[1], strict=True)
            ):
                return f"the chunks at {list(other[0])} and {list(box[0])} overlap"
        open_boxes.append(box)
    return None


def _check_storage(
    c: _Checker,
    metadata: Any,
    entries: dict[str, Any],
    chunks: dict[str, dict[tuple[int, ...], int]],
) -> dict[MetadataIndex, Any]:
    """Checks ``storage_data``: one slice per chunk (or bytes entry), plain file names."""
    found: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    pairs = c.pairs(c.field(metadata, Metadata, "storage_data"), "storage_data")
    for index, info in pairs:
        fqn = c.field(index, MetadataIndex, "fqn")
        offset = c.field(index, MetadataIndex, "offset")
        hint = c.field(index, MetadataIndex, "index")
        if type(fqn) is not str or fqn not in entries or not (hint is None or type(hint) is int):
            raise c.corrupt(f"storage_data names {fqn!r:.80}, which is not an entry")
        at = None if offset is None else c.dims(offset, f"an offset of {fqn!r}")
        if (fqn in chunks) != (at is not None) or (at is not None and at not in chunks[fqn]):
            raise c.corrupt(f"storage_data holds a slice of {fqn!r} at {at}, which no chunk has")
        if (fqn, at) in found:
            raise c.corrupt(f"storage_data holds two slices of {fqn!r} at {at}")
        name = check_plain_name(
            c.field(info, _STORAGE_INFO, "relative_path"), f"{c.file} (entry {fqn!r})"
        )
        start = c.field(info, _STORAGE_INFO, "offset")
        length = c.field(info, _STORAGE_INFO, "length")
        if not all(type(v) is int and 0 <= v < _MAX_DIM for v in (start, length)):
            raise c.corrupt(f"the slice of {fqn!r} has offset {start!r:.40}, length {length!r:.40}")
        if at is not None and length < chunks[fqn][at]:
            raise c.corrupt(
                f"the slice of {fqn!r} at {list(at)} has {length} bytes, less than the "
                f"{chunks[fqn][at]} its chunk holds"
            )
        if c.field(info, _STORAGE_INFO, "transform_descriptors"):
            raise UnsafeCheckpointError(
                f"Refusing to load {c.file}: the slice of {fqn!r} declares stream transforms "
                "(e.g. compression), which this package never writes and which could inflate "
                "without bound."
            )
        found[(fqn, at)] = (index, info, name)
    missing = [
        f"{fqn} at {list(at)}"
        for fqn, starts in chunks.items()
        for at in starts
        if (fqn, at) not in found
    ]
    missing += [f for f in entries if f not in chunks and (f, None) not in found]
    if missing:
        raise c.corrupt(f"chunks without a file slice: {missing[:5]}")
    _check_disjoint(c, found)
    return {index: info for index, info, _ in found.values()}


def _check_disjoint(c: _Checker, found: dict[tuple[str, Any], Any]) -> None:
    """Refuses two slices sharing bytes of a file (DCP writes each item once, in its own bytes).

    Without this, every tensor of a checkpoint could be read from the same bytes: a tensor
    never outgrows the bytes on disk, but thousands of them could, and a model built from the
    checkpoint's hyper-parameters (or a consolidated file) would cost that many times its files.
    """
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for (fqn, _), (_, info, name) in found.items():
        spans.setdefault(name, []).append((info.offset, info.offset + info.length, fqn))
    for name, listed in spans.items():
        listed.sort()
        for (_, end, first), (start, _, second) in zip(listed, listed[1:], strict=False):
            if start < end:
                raise c.corrupt(
                    f"the slices of {first!r} and {second!r} share bytes of {name!r} (each "
                    "entry is written once, in bytes of its own)"
                )


def storage_files(metadata: Metadata) -> dict[str, int]:
    """The files the chunks of checked metadata are in, and the bytes each must have at least.

    Args:
        metadata: metadata from :func:`parse_dcp_metadata`.

    Returns:
        ``{file name: end of its last slice}``.
    """
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    return ends
