"""Between sharded checkpoints and plain, single-file state dicts of the unsharded model.

- :func:`consolidate` turns a sharded checkpoint directory into one file holding the plain state
  dict of the unsharded model (for one-process evaluation or serving). It reads one tensor at a
  time from the checkpoint, so memory stays near the largest table. ``.safetensors`` output is
  written incrementally (the header is known from the checkpoint metadata) and can be read one
  tensor at a time (:func:`read_plain`); any other suffix is written with ``torch.save`` and holds
  the whole state dict in memory once.
- :func:`load_plain_weights` initialises a sharded model from such a file (or a dict): each rank
  copies only its own shards. An unsharded model's tables on the meta device are materialised.

Every file of the checkpoint is checked against the checksums written with it, and nothing in it
is unpickled unsafely (see :mod:`lightning_torchrec.checkpoint.files`). To get a ready model rather
than a file, use :func:`lightning_torchrec.checkpoint.load_unsharded`.

Command line::

    python -m lightning_torchrec.consolidate CHECKPOINT_DIR OUTPUT.safetensors \
        [--overwrite] [--key-file KEY]

It refuses an output inside the checkpoint and an existing output (unless ``--overwrite``),
leaves nothing behind when it fails, and reports a user's mistake (a damaged, unsafe or
unsigned checkpoint, a wrong path) on one line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_torchrec.checkpoint.limits import CheckpointLimits
from lightning_torchrec.checkpoint.outputs import (
    USER_ERRORS,
    OwnedTemp,
    check_output,
    user_error,
)
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.checkpoint.signing import read_key_file
from lightning_torchrec.checkpoint.unsharded import (
    fill_plain,
    iter_plain_tensors,
    plain_tensor_index,
)
from lightning_torchrec.errors import CheckpointWriteError, UnsupportedDtypeError

__all__ = [
    "consolidate",
    "iter_plain_tensors",
    "load_plain_weights",
    "main",
    "read_plain",
]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}


def consolidate(
    checkpoint: str | Path,
    output: str | Path,
    *,
    overwrite: bool = True,
    key: bytes | str | None = None,
    limits: CheckpointLimits | None = None,
) -> Path:
    """Writes the plain (unsharded) model state dict of a sharded checkpoint to one file.

    Args:
        checkpoint: a sharded checkpoint directory (a ``file://`` URL is its local path).
        output: the file to write (a ``file://`` URL is its local path); ``.safetensors``
            streams tensor by tensor (memory near the largest table), anything else is written
            with ``torch.save`` (memory: the model). Written to a fresh temporary file first: a
            failure leaves nothing behind.
        overwrite: replace an existing output (the command line asks for ``--overwrite``).
        key: the key the checkpoint must be signed with (see
            :func:`~lightning_torchrec.checkpoint.signing.resolve_key`).
        limits: the reading limits.

    Returns:
        The output path.

    Raises:
        FileNotFoundError: if ``checkpoint`` is not a complete sharded checkpoint.
        CheckpointCorruptError: if a file of the checkpoint is damaged, truncated or missing,
            naming it (nothing is written).
        UnsafeCheckpointError: if the checkpoint's metadata would run code when loaded.
        UnsupportedDtypeError: for a ``.safetensors`` output of a tensor whose dtype
            safetensors has no name for (``complex64``...), naming the tensor.
        ValueError: for an output inside the checkpoint, or a URL of another file system
            (``s3://...``) as either path.
        FileExistsError: for an existing output without ``overwrite``.
        CheckpointWriteError: if writing the output failed (with the OS's errno).
    """
    checkpoint, output = local_path(checkpoint), local_path(output)
    check_output(checkpoint, output, overwrite)
    entries = plain_tensor_index(checkpoint, key=key, limits=limits)  # verifies every file first
    tensors = iter_plain_tensors(checkpoint, verify=False, key=key, limits=limits)
    header: dict[str, Any] = {}
    offset = 0
    for name, meta in entries.items():
        dtype = meta.properties.dtype
        if dtype not in _DTYPES:
            if output.suffix != ".safetensors":
                continue  # torch.save holds every dtype
            raise UnsupportedDtypeError(
                f"tensor {name!r} of checkpoint {checkpoint} has dtype {dtype}, which "
                f"safetensors has no name for (it holds {sorted(_DTYPES.values())}): write a "
                ".pt file instead (an output path not ending in .safetensors)."
            )
        nbytes = torch.Size(meta.size).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(meta.size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    try:
        with OwnedTemp(output) as tmp:
            if output.suffix != ".safetensors":
                with open(tmp.path, "wb") as f:
                    torch.save(dict(tensors), f)
            else:
                _write_safetensors(tmp.path, header, tensors)
    except RuntimeError as err:  # torch.save hides the OS's error behind a RuntimeError
        raise CheckpointWriteError(f"writing {output} failed: {err}") from err
    return output


def _write_safetensors(path: Path, header: dict[str, Any], tensors: Any) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, tensor in tensors:  # the header's key order
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no copy


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_plain(path: str | Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Reads a plain state dict written by :func:`consolidate` (or ``torch.save``).

    Args:
        path: a ``.safetensors`` file or a ``torch.save`` file of tensors.
        keys: read only these entries (safetensors reads nothing else from disk).

    Returns:
        The state dict.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        sd = torch.load(path, map_location="cpu", weights_only=True)
        return {k: v for k, v in sd.items() if keys is None or k in keys}
    header, base = _safetensors_header(path)
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        for key in header if keys is None else keys:
            info = header[key]
            begin, end = info["data_offsets"]
            f.seek(base + begin)
            buf = bytearray(f.read(end - begin))
            flat = (
                torch.frombuffer(buf, dtype=torch.uint8)
                if buf
                else torch.empty(0, dtype=torch.uint8)
            )
            out[key] = flat.view(_FROM_NAME[info["dtype"]]).reshape(info["shape"])
    return out


@torch.no_grad()
def load_plain_weights(
    module: nn.Module, source: str | Path | dict[str, torch.Tensor], strict: bool = True
) -> list[str]:
    """Initialises a (sharded) module from a plain state dict; each rank copies its shards only.

    Works on a ``DistributedModelParallel``-sharded module after the strategy's setup (e.g. in
    ``LightningModule.on_fit_start``) and on an unsharded one, whose tables on the meta device
    take the loaded tensors (materialised on the CPU).

    Args:
        module: the module to load into (ShardedTensor/DTensor tables or plain tensors).
        source: a file from :func:`consolidate` (a ``.safetensors`` file is read one tensor at a
            time) or a state dict.
        strict: raise when the source lacks a tensor of the module or has one it lacks.

    Returns:
        The keys that were loaded.

    Raises:
        CheckpointMismatchError: (a ``ValueError``) on missing/unexpected keys (``strict``) or
            a global shape mismatch, naming them (nothing is loaded), or when tensors of the
            module stay on the meta device because the source lacks them, naming them.
    """
    if isinstance(source, dict):
        shapes = {k: tuple(v.shape) for k, v in source.items()}
    elif Path(source).suffix == ".safetensors":
        shapes = {k: tuple(v["shape"]) for k, v in _safetensors_header(Path(source))[0].items()}
    else:
        source = read_plain(source)
        shapes = {k: tuple(v.shape) for k, v in source.items()}
    tensors = (
        (key, source[key] if isinstance(source, dict) else read_plain(source, [key])[key])
        for key in shapes
    )
    return fill_plain(module, shapes, tensors, strict)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: ``python -m lightning_torchrec.consolidate CKPT OUT``.

    Exits with status 2 and the error on one line (no traceback) when the checkpoint is
    damaged, unsafe, unsigned (with ``--key-file``), incomplete or not a sharded checkpoint, or
    the output is inside the checkpoint or exists (without ``--overwrite``).

    Args:
        argv: arguments (defaults to ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_torchrec.consolidate",
        description="Write a sharded checkpoint's unsharded model state dict to one file.",
    )
    parser.add_argument("checkpoint", help="sharded checkpoint directory")
    parser.add_argument("output", help="output file (.safetensors streams)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument(
        "--key-file",
        type=Path,
        help="refuse checkpoints not signed with the HMAC key in this file",
    )
    args = parser.parse_args(argv)
    try:
        key = read_key_file(args.key_file) if args.key_file else None
        out = consolidate(args.checkpoint, args.output, overwrite=args.overwrite, key=key)
    except USER_ERRORS as err:
        user_error(parser, err)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
