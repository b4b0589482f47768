"""Crafting hostile (or unlucky) checkpoint files from a real checkpoint, as an attacker would.

An attacker who hands over a checkpoint directory controls every byte in it, the manifest
included: :func:`restamp` rewrites manifest entries so that changed files pass the CRC-32 check
and the parsers behind it are reached. Pickle payloads are spliced into a real ``.metadata`` at
the place of one string (:func:`splice`), so the rest of the file stays what DCP wrote.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec.optim.keyed import KeyedOptimizerWrapper

from lightning_torchrec.checkpoint import save_sharded
from lightning_torchrec.checkpoint.folder import read_dcp_metadata
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE, file_checksum

MARKER = "MARKER-0123456789abcdef"


def small_model(seed: int = 0) -> tuple[nn.Module, KeyedOptimizerWrapper]:
    """A model of a few tensors with Adam state (after one step)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = KeyedOptimizerWrapper(
        dict(model.named_parameters()), lambda params: torch.optim.Adam(params, lr=0.1)
    )
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def make_checkpoint(path: Path, seed: int = 0, key: bytes | None = None, **meta: Any) -> Any:
    """Saves :func:`small_model` to ``path``; returns ``(model, optimizer)``."""
    model, opt = small_model(seed)
    save_sharded(path, model, [opt], {"global_step": 1, **meta}, key=key)
    return model, opt


def restamp(path: Path, *names: str) -> None:
    """Rewrites the manifest entries of ``names`` to match the files (CRC-32 and size)."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    for name in names:
        manifest["files"][name] = file_checksum(path / name)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def write_metadata(path: Path, data: bytes) -> None:
    """Replaces ``.metadata`` with ``data`` and restamps it."""
    (path / ".metadata").write_bytes(data)
    restamp(path, ".metadata")


def metadata(path: Path) -> Any:
    """The checkpoint's DCP metadata (read safely), to mutate and :func:`dump`."""
    return read_dcp_metadata(path)


def dump(path: Path, md: Any) -> None:
    """Pickles mutated metadata into ``.metadata`` (plain pickle, as DCP does) and restamps it."""
    write_metadata(path, pickle.dumps(md))


def splice(md: Any, payload: bytes) -> bytes:
    """The pickle of ``md`` (protocol 2) with ``payload`` standing for one string in it.

    ``payload`` must push exactly one object and not use the memo.
    """
    md.storage_meta.checkpoint_id = MARKER
    data = pickle.dumps(md, protocol=2)
    raw = MARKER.encode()
    needle = b"X" + struct.pack("<I", len(raw)) + raw
    assert data.count(needle) == 1
    return data.replace(needle, payload)


def string(value: str) -> bytes:
    """Pickle bytes pushing a string."""
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def global_(module: str, name: str) -> bytes:
    """Pickle bytes pushing a global."""
    return f"c{module}\n{name}\n".encode()


def build_on_class(module: str, name: str, attribute: str, value: str) -> bytes:
    """Pickle bytes that BUILD a "slot state" onto a class: ``setattr(cls, attribute, value)``."""
    state = b"N}" + string(attribute) + string(value) + b"s\x86"  # (None, {attribute: value})
    return global_(module, name) + state + b"b"


def call(module: str, name: str, *args: int | str) -> bytes:
    """Pickle bytes calling a global with integer or string arguments."""
    encoded = b"".join(
        b"\x8a\x08" + struct.pack("<q", a) if isinstance(a, int) else string(a) for a in args
    )
    return global_(module, name) + b"(" + encoded + b"tR"


def shared_chunks_bomb(md: Any, copies: int, tensors: int) -> bytes:
    """Metadata whose tensors share one chunk list of ``copies`` references (tiny on disk)."""
    fqn, entry = next(
        (k, v) for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and v.chunks
    )
    entry.chunks = [entry.chunks[0]] * copies
    for i in range(tensors):
        md.state_dict_metadata[f"{fqn}.copy{i}"] = entry
    return pickle.dumps(md, protocol=4)


def deflated(data: bytes, pad_bytes: int = 0) -> bytes:
    """A ``torch.save`` zip with every entry DEFLATE-compressed, plus ``pad_bytes`` of zeros."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        prefix = src.namelist()[0].split("/")[0]
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
        if pad_bytes:
            pad = zipfile.ZipInfo(f"{prefix}/data/pad")
            pad.compress_type = zipfile.ZIP_DEFLATED
            with dst.open(pad, "w", force_zip64=True) as f:
                chunk = bytes(1 << 20)
                for _ in range(pad_bytes >> 20):
                    f.write(chunk)
    return out.getvalue()


def torch_bytes(obj: Any) -> bytes:
    """``torch.save`` of ``obj`` into bytes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def legacy_prefixed(obj: Any, zipped: bytes) -> bytes:
    """``torch.save`` of ``obj`` in the legacy (pickle) format, then the archive ``zipped``.

    ``zipfile`` finds the archive at the end; ``torch.load`` reads the legacy pickle first.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue() + zipped


def _stored(data: bytes) -> tuple[bytes, bytearray, int]:
    """A zip rewritten with every entry stored: (entries, central directory, entry count)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    raw = out.getvalue()
    end = raw.rindex(b"PK\x05\x06")
    count, size, offset = struct.unpack("<HII", raw[end + 10 : end + 20])
    return raw[:offset], bytearray(raw[offset : offset + size]), count


def _directory_entries(directory: bytearray) -> list[int]:
    starts, pos = [], 0
    while pos < len(directory):
        starts.append(pos)
        name, extra, comment = struct.unpack("<HHH", directory[pos + 28 : pos + 34])
        pos += 46 + name + extra + comment
    return starts


def two_faced(torch_sees: bytes, zipfile_sees: bytes) -> bytes:
    """One file holding two zip archives: torch's reader (miniz) reads the central directory
    at the offset the end record states, Python's ``zipfile`` the one just before the end
    record (taking what precedes its archive as a prefix).
    """
    first, first_dir, count = _stored(torch_sees)
    second, second_dir, _ = _stored(zipfile_sees)
    size = max(len(first_dir), len(second_dir))
    for directory in (first_dir, second_dir):  # equal sizes: pad the last entry's comment
        last = _directory_entries(directory)[-1]
        (comment,) = struct.unpack("<H", directory[last + 32 : last + 34])
        struct.pack_into("<H", directory, last + 32, comment + size - len(directory))
        directory += b" " * (size - len(directory))
    first += bytes(max(0, len(second) - len(first)))
    shift = len(first) - len(second)  # zipfile adds the prefix length (len(second) + size)
    for pos in _directory_entries(second_dir):
        (offset,) = struct.unpack("<I", second_dir[pos + 42 : pos + 46])
        struct.pack_into("<I", second_dir, pos + 42, offset + shift)
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, count, count, size, len(first), 0)
    return first + bytes(first_dir) + second + bytes(second_dir) + end


def replace_in_pickle(data: bytes, old: bytes, new: bytes) -> bytes:
    """A ``torch.save`` zip whose ``data.pkl`` has ``old`` (found once) replaced by ``new``."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            entry = src.read(info)
            if info.filename.endswith("/data.pkl"):
                assert entry.count(old) == 1
                entry = entry.replace(old, new)
            dst.writestr(info.filename, entry)
    return out.getvalue()
