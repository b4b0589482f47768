"""Reading an artifact without running what a tampered file could put in it.

``torch.export.load`` trusts the archive it reads (its docstring: "uses pickle under the hood
... Never load data from an untrusted source"). Read in torch 2.13's
``torch/export/pt2_archive/_package.py``, ``torch/export/__init__.py``,
``torch/_export/serde/serialize.py`` and ``torch/export/_unlift.py``, these parts of a ``.pt2``
can run code when it is loaded or first called:

- a weight or tensor constant whose entry in ``*_weights_config.json`` /
  ``*_constants_config.json`` says ``"use_pickle": true``: ``torch.load(weights_only=False)``;
- constants named ``custom_obj_*`` (TorchScript's unpickler) or ``opaque_obj_*``
  (``pickle.loads``);
- the example inputs (``data/sample_inputs/*.pt``), legacy ``data/weights/<model>.pt`` /
  ``data/constants/<model>.pt`` files, and the pre-2.8 zip layout (``serialized_*.pt``) that
  ``torch.export.load`` falls back to after a ``RuntimeError``: ``torch.load`` with
  ``weights_only=True`` and, when that fails, ``weights_only=False``;
- compiled AOTInductor libraries (``data/aotinductor/``), which are loaded as shared objects;
- the symbolic sizes in ``models/*.json`` (``"expr_str"``), parsed by ``sympy.sympify`` (an
  ``eval``);
- the input guards (``"guards_code"``), Python source compiled by ``exec`` and run on every
  call of ``ExportedProgram.module()``;
- a graph node's target (``"target"``, ``"as_operator"``): any attribute reached from
  ``torch``, ``operator`` or ``math`` by its dotted name, called when the graph runs.

:func:`check_pt2` reads the archive as a zip file first, as Python's ``zipfile`` and as
torch's own reader read it (:mod:`lightning_torchrec.compat.torch_zip`: one file can hold a
different archive for each; nothing in either is unpickled or evaluated) and refuses, with
:class:`~lightning_torchrec.errors.UnsafeCheckpointError` naming the file and the entry,
anything but what ``torch.export.save`` writes for a program of tensors: the entries it
names, tensors stored raw, example inputs that load ``weights_only``, symbolic sizes and
guards of a small grammar, and targets that are registered operators
(``torch.ops.<namespace>.<op>.<overload>``) or plain arithmetic. :func:`load_pt2` checks, then
loads the same open file; :func:`load_torchscript` loads a TorchScript file. A file that is not
a readable archive raises :class:`~lightning_torchrec.errors.CheckpointCorruptError` naming it.

What is left (see ``docs/export.md``): the graph may still call any registered operator, and a
TorchScript file holds TorchScript code; load artifacts you produced or whose checksum you
checked.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
import zipfile
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import torch

from lightning_torchrec.checkpoint.limits import DEFAULT_LIMITS
from lightning_torchrec.checkpoint.torch_files import load_torch_bytes
from lightning_torchrec.compat.torch_zip import TorchZip
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    UnsafeCheckpointError,
)

_NAME = r"[A-Za-z0-9][A-Za-z0-9_]*"
#: The entries ``torch.export.save`` writes for a program of tensors (below the archive's root).
ENTRIES = re.compile(
    rf"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    rf"|models/{_NAME}\.json|data/sample_inputs/{_NAME}\.pt"
    rf"|data/weights/{_NAME}_weights_config\.json|data/weights/weight_\d+"
    rf"|data/constants/{_NAME}_constants_config\.json|data/constants/tensor_\d+"
)
_MODEL = re.compile(rf"models/({_NAME})\.json")
_OPERATORS = {
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos", "abs",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift",
    "rshift", "trunc", "floor", "ceil", "sqrt",
}  # fmt: skip
_OP = r"_?[A-Za-z][A-Za-z0-9_]*"  # no dunder (but the operators' own below)
_TARGET = re.compile(
    rf"torch\.ops\.{_OP}\.(?:{_OP}|__r?i?(?:and|or|xor|lshift|rshift)__)\.{_OP}"
    rf"|torch\.ops\.higher_order\.{_OP}|torch\.sym_[a-z]+|(?:_operator|math)\.([a-z_]+)"
)
_SYMBOL_TEXT = re.compile(r"[A-Za-z0-9_.+\-]+")
_SYMPY_BARE = {"oo", "zoo", "nan", "pi", "E", "true", "false", "True", "False", "None"}
_GUARD_CALLS = {"size", "stride", "dim", "numel", "storage_offset"}
_GUARD_FUNCTIONS = {"max", "min"}  # Python's builtins in the namespace torch execs guards in
_INPUT_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ATTRIBUTE = re.compile(r"_?[A-Za-z][A-Za-z0-9_]*")


def _unsafe(path: Path, entry: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path}: refused before loading: entry {entry!r} {what}; torch.export.load could run "
        "code from it (only tensors stored raw are accepted; export the model again)"
    )


def _sympy_ok(node: ast.AST, string_ok: bool = False) -> bool:
    """A sympy ``srepr`` of integers, symbols and capitalised classes (no lowercase helpers)."""
    if isinstance(node, ast.Expression):
        return _sympy_ok(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            return string_ok and _SYMBOL_TEXT.fullmatch(node.value) is not None
        return isinstance(node.value, int | float | bool) or node.value is None
    if isinstance(node, ast.Name):
        return node.id in _SYMPY_BARE or re.fullmatch(r"[A-Z][A-Za-z0-9_]*", node.id) is not None
    if isinstance(node, ast.Call):
        func = node.func
        if not (isinstance(func, ast.Name) and re.fullmatch(r"[A-Z][A-Za-z0-9_]*", func.id)):
            return False  # sympy's lowercase helpers (sympify, lambdify, preview) are refused
        if func.id == "S":  # S("...") is sympify
            return False
        named = func.id in ("Symbol", "Dummy", "Float", "Integer", "Rational")
        args = [_sympy_ok(a, string_ok=named and i == 0) for i, a in enumerate(node.args)]
        keywords = [
            isinstance(k.value, ast.Constant) and isinstance(k.value.value, bool | int)
            for k in node.keywords
        ]
        return all(args) and all(keywords) and all(k.arg for k in node.keywords)
    if isinstance(node, ast.UnaryOp | ast.BinOp | ast.Compare | ast.BoolOp):
        return all(_sympy_ok(c) for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr))
    return isinstance(node, ast.operator | ast.unaryop | ast.cmpop | ast.boolop)


def _input_ok(node: ast.AST) -> bool:
    """An input or a part of it, as torch writes its path: ``L['kjt']._lengths``, ``L['x'][0]``."""
    if isinstance(node, ast.Name):
        return node.id == "L"
    if isinstance(node, ast.Subscript):
        key = node.slice
        if not isinstance(key, ast.Constant) or isinstance(key.value, bool):
            return False
        named = isinstance(key.value, str) and _INPUT_KEY.fullmatch(key.value) is not None
        return (named or type(key.value) is int) and _input_ok(node.value)
    if isinstance(node, ast.Attribute):
        return _ATTRIBUTE.fullmatch(node.attr) is not None and _input_ok(node.value)
    return False


def _guard_ok(node: ast.AST) -> bool:
    """Comparisons and arithmetic of input sizes: ``L['x']._lengths.size()[0] % 4 == 0``.

    Calls are an input's size methods (``L['x'].size()``, ``.stride()``, ...) and ``max`` /
    ``min`` of two or more such terms (how torch prints sympy's ``Max`` / ``Min``), all with
    positional arguments only; attributes are only those of an input's path.
    """
    if isinstance(node, ast.Expression):
        return _guard_ok(node.body)
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float | bool) or node.value is None
    if _input_ok(node):
        return True
    if isinstance(node, ast.Subscript):  # an element of a size: L['x'].size()[0]
        index = node.slice
        text_key = isinstance(index, ast.Constant) and isinstance(index.value, str)
        return not text_key and _guard_ok(index) and _guard_ok(node.value)
    if isinstance(node, ast.Call):
        func = node.func
        if node.keywords or not all(_guard_ok(a) for a in node.args):  # ast.Starred: refused
            return False
        if isinstance(func, ast.Name):
            return func.id in _GUARD_FUNCTIONS and len(node.args) >= 2
        return (
            isinstance(func, ast.Attribute) and func.attr in _GUARD_CALLS and _input_ok(func.value)
        )
    if isinstance(node, ast.UnaryOp | ast.BinOp | ast.Compare | ast.BoolOp):
        return all(_guard_ok(c) for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr))
    return False


def _guard_text_ok(text: str) -> bool:
    """A guard of the grammar, without a comment (it would hide the rest of torch's line)."""
    return "#" not in text and _parses(text, _guard_ok)


def _parses(text: str, ok: Any) -> bool:
    try:
        return bool(ok(ast.parse(text, mode="eval")))
    except (SyntaxError, ValueError, RecursionError):
        return False


def _target_ok(target: str) -> bool:
    found = _TARGET.fullmatch(target)
    return found is not None and (found.group(1) is None or found.group(1) in _OPERATORS)


def _check_program(path: Path, entry: str, program: Any) -> None:
    """Refuses expressions, guards and targets of ``models/*.json`` outside the grammar."""
    stack: list[Any] = [program]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        for key, value in item.items():
            if key == "expr_str" and not (isinstance(value, str) and _parses(value, _sympy_ok)):
                raise _unsafe(path, entry, f"has a symbolic size sympy would eval: {value!r:.200}")
            if key == "guards_code":
                for guard in value if isinstance(value, list) else [value]:
                    if not (isinstance(guard, str) and _guard_text_ok(guard)):
                        raise _unsafe(
                            path, entry, f"has an input guard it would exec: {guard!r:.200}"
                        )
            elif key in ("target", "as_operator") and isinstance(value, str):
                if not _target_ok(value):
                    raise _unsafe(path, entry, f"calls {value!r:.200}, not a registered operator")
            else:
                stack.append(value)


def _check_payloads(path: Path, entry: str, config: Any, folder: str, names: set[str]) -> None:
    """Every weight/constant must be a raw tensor (``use_pickle`` false, ``tensor_meta`` set)."""
    payloads = config.get("config") if isinstance(config, dict) else None
    if not isinstance(payloads, dict):
        raise _unsafe(path, entry, "is not a payload config")
    prefix = "weight_" if folder == "weights" else "tensor_"
    for fqn, meta in payloads.items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise _unsafe(path, entry, f"asks for {fqn!r} to be unpickled (use_pickle)")
        name = meta.get("path_name")
        if not (isinstance(name, str) and re.fullmatch(rf"{prefix}\d+", name)):
            raise _unsafe(path, entry, f"stores {fqn!r} as {name!r}, not a raw tensor")
        if not isinstance(meta.get("tensor_meta"), dict) or f"data/{folder}/{name}" not in names:
            raise _unsafe(path, entry, f"has no raw tensor for {fqn!r}")


def _read(path: Path, archive: zipfile.ZipFile | _TorchReading, name: str, cap: int) -> bytes:
    """An entry's bytes, refused before reading when it says it is larger than ``cap``."""
    size = archive.getinfo(name).file_size  # zipfile reads no more than this
    if size > cap:
        raise CheckpointLimitError(
            f"{path}: entry {name!r} holds {size} bytes, over the {cap} an artifact's "
            "description may take; this is not what torch.export.save writes for this package"
        )
    return archive.read(name)


def _read_json(path: Path, archive: zipfile.ZipFile | _TorchReading, name: str) -> Any:
    data = _read(path, archive, name, DEFAULT_LIMITS.max_metadata_bytes)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise CheckpointCorruptError(f"{path}: entry {name!r} is not JSON: {err}") from err


def check_pt2(path: str | Path, file: IO[bytes] | None = None) -> None:
    """Refuses a ``.pt2`` that ``torch.export.load`` would run code from (see the module).

    Args:
        path: the file (named in errors; opened when ``file`` is None).
        file: the open file to read (what is then loaded: no second open of the path).

    Raises:
        UnsafeCheckpointError: naming the file and the entry that could run code.
        CheckpointCorruptError: if the file is not a readable zip archive.
        CheckpointLimitError: if a description entry (JSON, example inputs) is larger than
            :data:`~lightning_torchrec.checkpoint.limits.DEFAULT_LIMITS` allows.
    """
    path = Path(path)
    if file is None:
        with open(path, "rb") as opened:
            check_pt2(path, opened)
        return
    try:
        file.seek(0)
        with zipfile.ZipFile(file) as archive:  # what torch.export.load's fallback reads
            _check_archive(path, archive)
        # What torch.export.load reads first: one file can hold another archive for it.
        _check_archive(path, _TorchReading(TorchZip(file)))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, zlib.error) as err:
        raise CheckpointCorruptError(f"{path}: not a readable .pt2 archive: {err}") from err
    except RuntimeError as err:  # torch's reader
        raise CheckpointCorruptError(
            f"{path}: not a readable .pt2 archive for torch's reader: {str(err).splitlines()[0]}"
        ) from err


class _TorchReading:
    """The archive as torch's reader sees it, through the part of ``ZipFile`` the check uses."""

    root = "archive"  # torch's reader requires one root folder and names entries below it

    def __init__(self, archive: TorchZip) -> None:
        self.archive = archive

    def namelist(self) -> list[str]:
        return [f"{self.root}/{name}" for name in self.archive.names()]

    def getinfo(self, name: str) -> Any:
        return SimpleNamespace(file_size=self.archive.size(name.split("/", 1)[1]))

    def read(self, name: str) -> bytes:
        return self.archive.read(name.split("/", 1)[1])


def _check_archive(path: Path, archive: zipfile.ZipFile | _TorchReading) -> None:
    full = archive.namelist()
    if len(set(full)) != len(full):  # zipfile and torch's reader may pick different copies
        raise _unsafe(path, "(several)", "appears more than once")
    if not full:
        raise CheckpointCorruptError(f"{path}: an empty archive")
    root = full[0].split("/", 1)[0]
    for name in full:
        if not name.startswith(f"{root}/"):
            raise _unsafe(path, name, f"is outside the archive's folder {root!r}")
    names = {name.split("/", 1)[1] for name in full}
    for name in sorted(names):
        if ENTRIES.fullmatch(name) is None:
            raise _unsafe(path, name, "is not one torch.export.save writes for tensors")
    models = [m.group(1) for m in map(_MODEL.fullmatch, sorted(names)) if m]
    for model in models:
        for folder, kind in (("weights", "weights"), ("constants", "constants")):
            entry = f"data/{folder}/{model}_{kind}_config.json"
            if entry in names:
                config = _read_json(path, archive, f"{root}/{entry}")
                _check_payloads(path, entry, config, folder, names)
        entry = f"data/sample_inputs/{model}.pt"
        if entry in names:
            data = _read(path, archive, f"{root}/{entry}", DEFAULT_LIMITS.max_torch_file_bytes)
            _check_sample_inputs(path, entry, data)
        entry = f"models/{model}.json"
        _check_program(path, entry, _read_json(path, archive, f"{root}/{entry}"))


def _check_sample_inputs(path: Path, entry: str, data: bytes) -> None:
    if not data:  # what the package's export writes
        return
    # What torch tries first (weights_only) and only if it fails unpickles without. Loaded as a
    # checkpoint's file is: no global beyond a tensor's, nothing allocated beyond the entry's
    # size (weights_only alone allows bytearray(n): gigabytes from a few bytes).
    try:
        load_torch_bytes(data, Path(entry))
    except Exception as err:  # noqa: BLE001 - every failure means torch's fallback would run
        raise _unsafe(path, entry, f"does not load weights_only ({err!s:.200})") from err


def load_pt2(path: str | Path) -> Any:
    """Checks a ``.pt2`` (:func:`check_pt2`), then loads the same open file.

    Args:
        path: the file.

    Returns:
        The ``torch.export.ExportedProgram``.

    Raises:
        UnsafeCheckpointError: naming the file and the entry that could run code.
        CheckpointCorruptError: if the file cannot be read as an exported program.
        CheckpointLimitError: if a description entry is larger than the limits allow.
    """
    path = Path(path)
    with open(path, "rb") as file:
        check_pt2(path, file)
        file.seek(0)
        try:
            return torch.export.load(file)
        except (RuntimeError, ValueError, AssertionError, KeyError, TypeError) as err:
            # torch's SerializeError is a RuntimeError.
            raise CheckpointCorruptError(
                f"{path}: cannot be loaded as an exported program: {err!s:.500}"
            ) from err


def load_torchscript(path: str | Path) -> Any:
    """Loads a TorchScript file; an unreadable one raises a named error.

    TorchScript's own unpickler refuses Python globals (a pickled ``os.system`` is
    ``Unknown type name``); the file's code is TorchScript, compiled and run by torch.

    Args:
        path: the file.

    Returns:
        The ``torch.jit.ScriptModule``.

    Raises:
        CheckpointCorruptError: if the file cannot be read as TorchScript.
    """
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise CheckpointCorruptError(f"{path}: not a readable TorchScript archive")
    with warnings.catch_warnings():  # TorchScript: deprecated in torch 2.13, as in trace()
        warnings.filterwarnings("ignore", "`torch.jit.load`", DeprecationWarning)
        warnings.filterwarnings("ignore", "`torch.jit.load`", FutureWarning)  # torch 2.14
        try:
            return torch.jit.load(str(path))
        except RuntimeError as err:
            raise CheckpointCorruptError(
                f"{path}: cannot be loaded as TorchScript: {err!s:.500}"
            ) from err
