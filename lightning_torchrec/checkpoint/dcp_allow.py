"""What DCP's ``.metadata`` pickle may name, and how each allowed name is built.

The allow-list of :func:`~lightning_torchrec.checkpoint.unpickle.restricted_load` for DCP
metadata, narrowed to what DCP's ``FileSystemWriter`` writes (torch 2.4 through 2.14; the
classes come from ``compat.upstream.dcp_metadata_classes``):

- DCP's metadata dataclasses: created empty by NEWOBJ, filled by :func:`build_dcp_object` with
  their declared fields only (``TensorProperties`` from its 5-tuple state);
- DCP's enums: a lookup by value; ``torch.Size`` of integers; torch's dtypes (constants);
  torch's layout decoder (a lookup among torch's layouts, instead of calling it);
- pathlib's path classes (DCP stores the checkpoint's path): read as a plain string.

Nothing else resolves, nothing is imported, and no class object ever reaches the pickle's stack.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorProperties

from lightning_torchrec.checkpoint.unpickle import Allowed, PairList
from lightning_torchrec.compat.upstream import (
    TORCH_LAYOUT_DECODER,
    dcp_memory_format,
    dcp_metadata_classes,
)

_CLASSES = dcp_metadata_classes()
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_PATHS = {"Path", "PurePath", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}


def _size(*args: Any) -> torch.Size:
    if len(args) != 1 or type(args[0]) is not tuple or len(args[0]) > 64:
        raise ValueError("torch.Size of something that is not a short tuple")
    if not all(type(v) is int for v in args[0]):
        raise ValueError("torch.Size of something that is not integers")
    return torch.Size(args[0])


def _layout(name: Any) -> torch.layout:
    if name not in _LAYOUTS:
        raise ValueError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


def _path(*parts: Any) -> str:
    if not all(type(p) is str for p in parts):
        raise ValueError("a path of something that is not strings")
    return str(PurePosixPath(*parts))


def _enum(cls: type[enum.Enum]) -> Any:
    def member(value: Any) -> enum.Enum:
        if type(value) not in (int, str):
            raise ValueError(f"{cls.__name__} of a {type(value).__name__}")
        return cls(value)

    return member


def resolve_dcp_global(module: str, name: str) -> Allowed | None:
    """What a global of DCP metadata stands for.

    Args:
        module: the global's module.
        name: its name.

    Returns:
        Its :class:`Allowed` entry, or None for anything DCP does not write.
    """
    full = f"{module}.{name}"
    if module == "torch":
        if name == "Size":
            return Allowed(full, call=_size)
        value = vars(torch).get(name)  # no module __getattr__: nothing is imported
        return Allowed(full, value=value) if isinstance(value, torch.dtype) else None
    if (module, name) == TORCH_LAYOUT_DECODER:
        return Allowed(full, call=_layout)
    if module == "pathlib" and name in _PATHS:
        return Allowed(full, call=_path)
    cls = _CLASSES.get((module, name))
    if cls is None:
        return None
    if issubclass(cls, enum.Enum):
        return Allowed(full, call=_enum(cls))
    return Allowed(full, new=cls)


def build_dcp_object(instance: Any, state: Any) -> None:
    """Applies a BUILD state to a DCP object the load created: its declared fields only.

    Args:
        instance: the object (made by NEWOBJ of an allowed dataclass).
        state: the pickled state.

    Raises:
        ValueError: for a state with other fields or types.
    """
    cls = type(instance)
    if cls is TensorProperties:  # pickled as a tuple by its __getstate__
        if type(state) is not tuple or len(state) != 5:
            raise ValueError("TensorProperties state is not a 5-tuple")
        dtype, layout, requires_grad, encoding, pin_memory = state
        if not isinstance(dtype, torch.dtype) or not isinstance(layout, torch.layout):
            raise ValueError("TensorProperties without a dtype and a layout")
        values = {
            "dtype": dtype,
            "layout": layout,
            "requires_grad": bool(requires_grad),
            "memory_format": dcp_memory_format(encoding),
            "pin_memory": bool(pin_memory),
        }
    else:
        if type(state) is not PairList:
            raise ValueError(f"{cls.__name__} state is a {type(state).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for key, value in state:
            if type(key) is not str or key not in names:
                raise ValueError(f"{cls.__name__} has no field {key!r}")
            values[key] = value
    for key, value in values.items():
        object.__setattr__(instance, key, value)
