"""Between sharded checkpoints and plain, single-file state dicts of the unsharded model.

- :func:`consolidate` turns a sharded checkpoint directory into one file holding the plain state
  dict of the unsharded model (for one-process evaluation or serving). It reads one tensor at a
  time from the checkpoint, so memory stays near the largest table. ``.safetensors`` output is
  written incrementally (the header is known from the checkpoint metadata) and can be read one
  tensor at a time (:func:`read_plain`); any other suffix is written with ``torch.save`` and holds
  the whole state dict in memory once.
- :func:`load_plain_weights` initialises a sharded model from such a file (or a dict): each rank
  copies only its own shards.

Command line::

    python -m lightning_torchrec.consolidate CHECKPOINT_DIR OUTPUT.safetensors
"""

from __future__ import annotations

import argparse
import json
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_torchrec.checkpoint import MODEL_KEY, is_sharded_checkpoint
from lightning_torchrec.layout import copy_into_shards, global_shape

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


def _model_entries(checkpoint: Path) -> dict[str, TensorStorageMetadata]:
    if not is_sharded_checkpoint(checkpoint):
        raise FileNotFoundError(f"{checkpoint} is not a complete sharded checkpoint directory")
    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    prefix = MODEL_KEY + "."
    return {
        k[len(prefix) :]: v
        for k, v in sorted(stored.items())
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }


def iter_plain_tensors(checkpoint: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the unsharded model's tensors one at a time from a sharded checkpoint.

    Runs in one process without a process group; only the tensor being yielded is in memory.

    Args:
        checkpoint: a sharded checkpoint directory.

    Yields:
        ``(state-dict key, plain tensor)`` pairs in key order.

    Raises:
        FileNotFoundError: if ``checkpoint`` is not a complete sharded checkpoint.
    """
    checkpoint = Path(checkpoint)
    reader = dcp.FileSystemReader(str(checkpoint))
    for key, meta in _model_entries(checkpoint).items():
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with warnings.catch_warnings():
            # DCP warns on every single-process load, even when asked for one (no_dist=True).
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({MODEL_KEY: {key: tensor}}, storage_reader=reader, no_dist=True)
        yield key, tensor


def consolidate(checkpoint: str | Path, output: str | Path) -> Path:
    """Writes the plain (unsharded) model state dict of a sharded checkpoint to one file.

    Args:
        checkpoint: a sharded checkpoint directory.
        output: the file to write; ``.safetensors`` streams tensor by tensor (memory near the
            largest table), anything else is written with ``torch.save`` (memory: the model).

    Returns:
        The output path.

    Raises:
        FileNotFoundError: if ``checkpoint`` is not a complete sharded checkpoint.
        ValueError: for a dtype the safetensors format cannot hold.
    """
    checkpoint, output = Path(checkpoint), Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".partial")
    if output.suffix != ".safetensors":
        torch.save(dict(iter_plain_tensors(checkpoint)), tmp)
        tmp.replace(output)
        return output
    entries = _model_entries(checkpoint)
    header: dict[str, Any] = {}
    offset = 0
    for key, meta in entries.items():
        dtype = meta.properties.dtype
        if dtype not in _DTYPES:
            raise ValueError(f"{key}: dtype {dtype} has no safetensors name")
        nbytes = torch.Size(meta.size).numel() * torch.empty((), dtype=dtype).element_size()
        header[key] = {
            "dtype": _DTYPES[dtype],
            "shape": list(meta.size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, tensor in iter_plain_tensors(checkpoint):  # same key order as the header
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no copy
    tmp.replace(output)
    return output


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
    ``LightningModule.on_fit_start``) and on an unsharded one.

    Args:
        module: the module to load into (ShardedTensor/DTensor tables or plain tensors).
        source: a file from :func:`consolidate` (a ``.safetensors`` file is read one tensor at a
            time) or a state dict.
        strict: raise when the source lacks a tensor of the module or has one it lacks.

    Returns:
        The keys that were loaded.

    Raises:
        ValueError: on missing/unexpected keys (``strict``) or a global shape mismatch, naming them.
    """
    target = module.state_dict()
    if isinstance(source, dict):
        shapes = {k: tuple(v.shape) for k, v in source.items()}
    elif Path(source).suffix == ".safetensors":
        shapes = {k: tuple(v["shape"]) for k, v in _safetensors_header(Path(source))[0].items()}
    else:
        source = read_plain(source)
        shapes = {k: tuple(v.shape) for k, v in source.items()}
    keys = [k for k, v in target.items() if isinstance(v, torch.Tensor)]
    missing = [k for k in keys if k not in shapes]
    extra = [k for k in shapes if k not in target]
    wrong = [
        f"{k}: file {list(shapes[k])}, model {list(global_shape(target[k]))}"
        for k in keys
        if k in shapes and tuple(global_shape(target[k])) != shapes[k]
    ]
    if wrong or (strict and (missing or extra)):
        raise ValueError(
            f"Plain weights do not fit the model: missing {missing}, unexpected {extra}, "
            f"shapes differ: {wrong}"
        )
    loaded = []
    for key in keys:
        if key not in shapes:
            continue
        plain = source[key] if isinstance(source, dict) else read_plain(source, [key])[key]
        copy_into_shards({key: plain}, {key: target[key]})
        loaded.append(key)
    module.load_state_dict(target, strict=False)
    return loaded


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: ``python -m lightning_torchrec.consolidate CKPT OUT``.

    Args:
        argv: arguments (defaults to ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_torchrec.consolidate",
        description="Write a sharded checkpoint's unsharded model state dict to one file.",
    )
    parser.add_argument("checkpoint", type=Path, help="sharded checkpoint directory")
    parser.add_argument("output", type=Path, help="output file (.safetensors streams)")
    args = parser.parse_args(argv)
    out = consolidate(args.checkpoint, args.output)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
