"""From a sharded checkpoint to a served model: quantized inference export.

:func:`export` reads a sharded checkpoint (saved on any number of ranks, under any plan) in one
process without a process group, rebuilds the model for inference with its embedding tables
quantized by TorchRec's own quantized ``EmbeddingBagCollection`` / ``EmbeddingCollection``
(fbgemm's row-wise int8/int4 with a per-row fp16 scale and bias, or fp16/fp32 rows) and its
dense part in fp32, and writes an
artifact a serving process loads with ``import torch, torchrec`` only:

- ``pt2`` (default): ``torch.export``; load with ``torch.export.load(path).module()``;
- ``torchscript``: ``torchrec.fx.symbolic_trace`` then ``torch.jit.script`` (TorchRec's own
  inference path); load with ``torch.jit.load(path)``.

Tables are streamed from the checkpoint one at a time and quantized straight into the buffers of
the quantized module, so at most one table is ever held in float: a model larger than memory in
float can be exported when it fits quantized. See ``docs/export.md``.

What is exported: ``module.inference_model()`` if the LightningModule defines it, else
``module.model_and_loss.model`` (``TorchRecModule``, ``DLRMClickModule``: DLRM's
``forward(dense_features, sparse_features) -> logits``), else the module itself.

Command line::

    python -m lightning_torchrec.export CKPT_DIR OUT.pt2 --module pkg.mod.Class --dtype int8
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import Dim, ShapesCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.checkpoint.outputs import USER_ERRORS, OwnedTemp, check_output, user_error
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.checkpoint.signing import read_key_file
from lightning_torchrec.compat.upstream import drop_unused_range_constraints
from lightning_torchrec.errors import CheckpointCorruptError
from lightning_torchrec.export.archive import load_pt2, load_torchscript
from lightning_torchrec.export.fresh import (
    MANIFEST_FILE,
    REMAP_TENSORS,
    checkpoint_id,
    tensor_sha256,
)
from lightning_torchrec.export.modules import QUANTIZED_MODULES, describe_call, strip_table_buffers
from lightning_torchrec.export.quantize import DTYPES, quantize_from_checkpoint
from lightning_torchrec.export.scripting import script
from lightning_torchrec.export.validate import ServedModel, input_contract

#: The artifact formats.
FORMATS = ("pt2", "torchscript")


@dataclass
class ExportResult:
    """What :func:`export` produced.

    Attributes:
        model: the quantized eager model (what was traced); call it like the float model. Its
            quantized EBCs/ECs no longer expose the tables in ``state_dict()`` (see
            :func:`trace`); each has the id check in front (``IdOutOfRangeError``, see
            ``export.validate``).
        artifact: the ``torch.export.ExportedProgram`` or ``torch.jit.ScriptModule``.
        format: ``"pt2"`` or ``"torchscript"``.
        dtype: the table dtype name (``"int8"``, ...).
        path: the written artifact, or None when no output was given.
        tables: ``{table: (rows, dim)}`` of the quantized tables; a name that tables of two
            collections share (a user and an item tower) as ``"<collection path>/<name>"``.
        float_table_bytes: bytes of the tables in the checkpoint (float).
        quantized_table_bytes: bytes of the quantized tables (with scale/bias and padding).
        seconds: wall time of the export.
        info: the JSON side file's content (features, their tables and row counts, the input
            contract, dense width, dtypes, how to load; ``checkpoint_id`` and ``served_state``:
            the source checkpoint's id and where the artifact holds each table's rows and each
            dense tensor, which ``export.fresh`` applies deltas by).
    """

    model: nn.Module
    artifact: Any
    format: str
    dtype: str
    path: Path | None
    tables: dict[str, tuple[int, int]]
    float_table_bytes: int
    quantized_table_bytes: int
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


def example_inputs(
    features: list[str], dense: int, batch_size: int = 4, weighted: bool = False
) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    """A ``(dense_features, sparse_features)`` sample in the layout of the package's batches.

    Ids are int64, lengths int32 (as ``SyntheticClickData`` and ``Batch``); ``pt2`` artifacts
    accept exactly these dtypes.

    Args:
        features: the KJT keys.
        dense: the dense width.
        batch_size: samples.
        weighted: add per-id weights.

    Returns:
        The sample.
    """
    lengths = (torch.arange(batch_size * len(features), dtype=torch.int32) % 3) + 1
    values = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    weights = torch.ones(values.shape[0]) if weighted else None
    kjt = KeyedJaggedTensor(keys=features, values=values, lengths=lengths, weights=weights)
    return torch.randn(batch_size, dense), kjt


def _dynamic_shapes(args: tuple[Any, ...]) -> ShapesCollection:
    """Batch and id counts dynamic: dim 0 of dense tensors is the batch, KJT lengths F*batch."""
    shapes = ShapesCollection()
    batch = Dim("batch", min=1)
    for arg in args:
        if isinstance(arg, KeyedJaggedTensor):
            shapes[arg.values()] = {0: Dim.AUTO}
            shapes[arg.lengths()] = {0: len(arg.keys()) * batch}
            if arg.weights_or_none() is not None:
                shapes[arg.weights()] = {0: Dim.AUTO}
        elif isinstance(arg, torch.Tensor) and arg.dim() > 0:
            shapes[arg] = {0: batch}
    return shapes


def _plain_kjt(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        lengths=kjt.lengths(),
        weights=kjt.weights_or_none(),
    )


def trace(model: nn.Module, fmt: str, args: tuple[Any, ...] | None) -> Any:
    """Turns the quantized eager model into an artifact.

    Args:
        model: the quantized model (its table buffers are stripped, see above).
        fmt: ``"pt2"`` or ``"torchscript"``.
        args: example positional inputs (``pt2`` only).

    Returns:
        The ``ExportedProgram`` or ``ScriptModule``.

    Raises:
        ValueError: for an unknown format, or ``pt2`` without example inputs.
        TypeError: ``torchscript`` of a ``forward`` without real type annotations (see
            :func:`~lightning_torchrec.export.scripting.script`).
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    strip_table_buffers(model)
    if fmt == "torchscript":
        return script(model)
    if args is None:
        raise ValueError(
            "pt2 export needs example inputs: pass example_inputs=(...), define "
            "example_inputs() on the module, or use format='torchscript'"
        )
    # A KJT built by from_lengths_sync caches its stride and per-key lengths as Python ints,
    # which tracing would bake in (the artifact would then refuse a batch of one): trace a
    # plain one.
    args = tuple(_plain_kjt(a) if isinstance(a, KeyedJaggedTensor) else a for a in args)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "is_fx_tracing will return true", UserWarning)
        program = torch.export.export(model, args, dynamic_shapes=_dynamic_shapes(args))
    # The example inputs would be pickled into the file (a KJT: not weights-only loadable).
    program.example_inputs = None
    # Ranges of the ints TorchRec's KJT computes and the graph drops: torch.export.load would
    # log a warning for each (one per feature, and one more).
    drop_unused_range_constraints(program)
    return program


def save_artifact(artifact: Any, fmt: str, output: str | Path) -> Path:
    """Writes an artifact atomically (a fresh temporary file, then rename; removed on failure).

    Args:
        artifact: from :func:`trace`.
        fmt: its format.
        output: the file.

    Returns:
        The path.
    """
    output = Path(output)
    with OwnedTemp(output) as tmp, open(tmp.path, "wb") as f:
        # A file object: torch.export wants a .pt2 name otherwise.
        if fmt == "pt2":
            torch.export.save(artifact, f)
        else:
            with warnings.catch_warnings():  # TorchScript: deprecated in torch 2.13, as in trace()
                warnings.filterwarnings("ignore", "`torch.jit.save`", DeprecationWarning)
                warnings.filterwarnings("ignore", "`torch.jit.save`", FutureWarning)  # 2.14
                torch.jit.save(artifact, f)
    return output


def export(
    checkpoint_dir: str | Path,
    module: str | type | nn.Module,
    output: str | Path | None = None,
    *,
    dtype: str = "int8",
    format: str = "pt2",  # noqa: A002 - the CLI's name
    example_inputs: tuple[Any, ...] | None = None,
    verify: bool = True,
    key: bytes | str | None = None,
) -> ExportResult:
    """Exports a sharded checkpoint as a quantized inference artifact, in one process.

    Args:
        checkpoint_dir: a sharded checkpoint directory (any world size and plan; a ``file://``
            URL is its local path).
        module: the LightningModule: a dotted class path ``pkg.mod.Class`` (built from the
            checkpoint's saved ``hyper_parameters``), a class, or an instance (modified in
            place: its EBCs and ECs are replaced by quantized ones).
        output: where to write the artifact (and ``OUT.json`` beside it, describing the inputs);
            None writes nothing (the artifact is in the result). An existing file is replaced
            (the command line asks for ``--overwrite``); a path inside the checkpoint is refused.
        dtype: table dtype: ``"int8"``, ``"int4"`` (row-wise, per-row fp16 scale and bias),
            ``"fp16"`` or ``"fp32"``. Dense layers stay fp32.
        format: ``"pt2"`` (``torch.export``) or ``"torchscript"``.
        example_inputs: positional inputs to trace with (``pt2``); default: the module's
            ``example_inputs()`` if defined, else ``(dense_features, KJT)`` built from the
            tables' features and the ``num_dense_features`` hyper-parameter.
        verify: check the checkpoint's files against its checksum manifest first.
        key: the key the checkpoint must be signed with (see
            ``lightning_torchrec.checkpoint.signing``).

    Returns:
        The :class:`ExportResult`.

    Raises:
        ValueError: for an unknown dtype or format, table widths the dtype cannot pack, an
            output inside (or equal to) the checkpoint (before anything is read or written), or
            a URL of another file system than the local one (``s3://...``) as either path.
        FileExistsError: if ``output`` (or ``OUT.json``) is a directory.
        CheckpointMismatchError: if the checkpoint holds another model, naming the tables.
        FileNotFoundError: if ``checkpoint_dir`` is not a sharded checkpoint directory.
        ImportError: for an unknown module path, naming it.
        TypeError: for a module without EBC/EC tables, with a managed-collision table the
            artifact cannot hold (see ``export.managed``), that cannot be built from the
            checkpoint, or (``torchscript``) whose ``forward`` lacks real type annotations.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    checkpoint_dir = local_path(checkpoint_dir)
    if output is not None:  # an artifact inside the checkpoint would make it foreign to saves
        output = local_path(output)
        for out in (output, f"{output}.json"):
            check_output(checkpoint_dir, out, overwrite=True)
    start = time.perf_counter()
    model, facts = quantize_from_checkpoint(checkpoint_dir, module, dtype, verify=verify, key=key)
    args = example_inputs
    if args is None and callable(facts["example_inputs"]):
        args = tuple(facts["example_inputs"]())
    if args is None and format == "pt2" and facts["dense_width"] is not None:
        args = _default_inputs(facts)
    dense = dense_tensors(model)  # before trace() drops the quantized modules' table views
    artifact = trace(model, format, args)
    if format == "torchscript" and args is not None:  # pt2: tracing ran it on them
        with torch.inference_mode():  # an artifact that fails its example is not written
            artifact(*args)
    info = {
        "format": format,
        "dtype": dtype,
        "dense_dtype": "float32",
        "features": facts["features"],
        "dense_width": facts["dense_width"],
        "weighted": facts["weighted"],
        "sequence_features": facts["sequence_features"],
        "tables": {k: list(v) for k, v in facts["tables"].items()},
        "feature_tables": facts["feature_tables"],
        "input_contract": input_contract(facts["feature_tables"]),
        "inputs": describe_call(model, args),
        "load": "torch.export.load(path).module()" if format == "pt2" else "torch.jit.load(path)",
        "checkpoint": str(checkpoint_dir),
        "checkpoint_id": _checkpoint_id(checkpoint_dir),
        "served_state": served_state(
            artifact,
            format,
            dtype,
            facts["tables"],
            facts["table_rows"],
            dense,
            facts.get("managed"),
        ),
    }
    path = None
    if output is not None:
        with OwnedTemp(f"{output}.json") as side:
            side.path.write_text(json.dumps(info, indent=2) + "\n")
            path = save_artifact(artifact, format, output)
    return ExportResult(
        model=model,
        artifact=artifact,
        format=format,
        dtype=dtype,
        path=path,
        tables=facts["tables"],
        float_table_bytes=facts["float_table_bytes"],
        quantized_table_bytes=facts["quantized_table_bytes"],
        seconds=time.perf_counter() - start,
        info=info,
    )


def _checkpoint_id(checkpoint_dir: Path) -> str | None:
    """The checkpoint's id (what deltas name as their base), None without a manifest."""
    if not (checkpoint_dir / MANIFEST_FILE).is_file():
        return None
    return checkpoint_id(checkpoint_dir)


def dense_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    """The model's tensors that are not embedding tables: ``{name: (tensor, persistent)}``.

    Args:
        model: the quantized model, before :func:`trace`.

    Returns:
        Its parameters and buffers outside the quantized embedding modules, named as in the
        model (the inference model a delta's ``dense.pt`` names them by); ``persistent``: in
        its ``state_dict()`` (a checkpoint holds it).
    """
    inside = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, QUANTIZED_MODULES))
    persistent = set(model.state_dict())
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {n: (t, n in persistent) for n, t in tensors if not n.startswith(inside)}


def _artifact_tensors(artifact: Any, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "pt2":
        return {**artifact.constants, **artifact.state_dict}
    return {**dict(artifact.named_buffers()), **dict(artifact.named_parameters())}


def served_state(
    artifact: Any,
    fmt: str,
    dtype: str,
    tables: dict[str, tuple[int, int]],
    table_rows: dict[str, torch.Tensor],
    dense: dict[str, tuple[torch.Tensor, bool]],
    managed: dict[str, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Where a served artifact holds each table's rows and each dense tensor (for deltas).

    Found by identity: the traced artifact holds the quantized model's own tensors (fbgemm's
    table buffer as a constant, the dense parameters and buffers), under the names the loaded
    artifact has them by (``.module()`` of a ``.pt2``, a TorchScript module's attributes).

    Args:
        artifact: from :func:`trace` (not yet saved).
        fmt: its format.
        dtype: the table dtype name.
        tables: ``{table: (rows, dim)}``.
        table_rows: ``{table: uint8 [rows, bytes]}`` views of the quantized tables.
        dense: from :func:`dense_tensors`.
        managed: ``{remap path: tables}`` of the managed-collision remaps
            (``export.managed.managed_sources``), or None.

    Returns:
        ``{"tables": {table: {"state", "offset", "rows", "dim", "dtype", "row_bytes"}},
        "dense": {name: {"state", "shape", "dtype", "persistent"}}, "fixed": {name: {"shape",
        "dtype", "sha256"}}}``: ``offset`` is the byte offset of the table's row 0 in the
        ``uint8`` tensor ``state``; ``fixed`` are dense tensors the artifact holds only as
        constants derived from them (a TorchScript graph's slices of a buffer): a delta may
        carry them unchanged only. With managed-collision tables also ``"managed": {remap
        path: {"sorted_ids", "rows", "fallback", "tables"}}``: the artifact's names of each
        remap's three tensors (not in ``dense``: a delta's MCH buffers rebuild them) and its
        tables as ``managed`` gives them.

    Raises:
        RuntimeError: if a table's rows are not found in the artifact.
    """
    held = _artifact_tensors(artifact, fmt)
    out_tables = {}
    for table, rows in table_rows.items():
        storage = rows.untyped_storage().data_ptr()
        found = [
            (name, t)
            for name, t in held.items()
            if t.dtype == torch.uint8
            and t.dim() == 1
            and t.numel() > 0
            and t.untyped_storage().data_ptr() == storage
        ]
        if len(found) != 1:
            raise RuntimeError(f"table {table}'s rows are in {len(found)} tensors of the artifact")
        name, buffer = found[0]
        out_tables[table] = {
            "state": name,
            "offset": rows.data_ptr() - buffer.data_ptr(),
            "rows": tables[table][0],
            "dim": tables[table][1],
            "dtype": dtype,
            "row_bytes": rows.shape[1],
        }
    aliases = {
        (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype): name for name, t in held.items()
    }
    out_dense, fixed = {}, {}
    for name, (tensor, persistent) in dense.items():
        shape, kind = list(tensor.shape), str(tensor.dtype)
        alias = aliases.get((tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype))
        if alias is not None:
            out_dense[name] = {
                "state": alias,
                "shape": shape,
                "dtype": kind,
                "persistent": persistent,
            }
        else:
            digest = tensor_sha256(tensor)
            fixed[name] = {"shape": shape, "dtype": kind, "sha256": digest}
    out_managed = {}
    for path, remap_tables in (managed or {}).items():
        names = [f"{path}.{attr}" for attr in REMAP_TENSORS]
        if all(n in out_dense for n in names):  # else not recorded: its deltas are refused
            pairs = zip(REMAP_TENSORS, names, strict=True)
            held_as = {attr: out_dense.pop(name)["state"] for attr, name in pairs}
            out_managed[path] = {**held_as, "tables": remap_tables}
    state = {"tables": out_tables, "dense": out_dense, "fixed": fixed}
    return state | ({"managed": out_managed} if out_managed else {})


def _default_inputs(facts: dict[str, Any]) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    return example_inputs(
        facts["features"], facts["dense_width"], batch_size=4, weighted=facts["weighted"]
    )


def load_artifact(path: str | Path) -> Any:
    """Loads an exported artifact (what a serving process does, shown in ``docs/export.md``).

    Serving needs only ``import torch, torchrec`` (TorchRec registers fbgemm's operators and
    the ``KeyedJaggedTensor`` pytree); this helper is for convenience.

    Args:
        path: a ``.pt2`` (``torch.export``) or TorchScript file.

    Returns:
        A callable module: ``model(dense_features, sparse_features) -> logits``; it raises
        ``IdOutOfRangeError`` (naming the feature, table, id, sample and row count) for an id
        outside its table, where a bare server gets the artifact's ``RuntimeError``.

    Raises:
        UnsafeCheckpointError: a ``.pt2`` holding what ``torch.export.load`` would unpickle
            without ``weights_only``, ``eval`` or ``exec`` (checked before it is loaded; see
            ``export.archive``), naming the file and the entry.
        CheckpointCorruptError: a file that cannot be read as an artifact, naming it.
    """
    path = Path(path)
    if path.suffix != ".pt2":
        return ServedModel(load_torchscript(path))
    program = load_pt2(path)
    try:  # binds the archive's example inputs, if any, to the program's signature
        module = program.module()
    except (TypeError, ValueError, RuntimeError, AssertionError) as err:
        raise CheckpointCorruptError(
            f"{path}: its exported program cannot be made a module: {err!s:.500}"
        ) from err
    return ServedModel(module)


def main(argv: list[str] | None = None) -> ExportResult:
    """Command line: ``python -m lightning_torchrec.export CKPT OUT --module pkg.Class``.

    Refuses an output inside the checkpoint and an existing output (or ``OUT.json``) unless
    ``--overwrite``; leaves nothing behind when it fails; a user's mistake (a damaged, unsafe or
    unsigned checkpoint, a ``--module`` that is not a ``LightningModule``/``nn.Module``
    subclass, a wrong path) exits with status 2 and one line, no traceback.

    Args:
        argv: arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The export result.
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_torchrec.export",
        description="Export a sharded checkpoint as a quantized inference artifact.",
    )
    parser.add_argument("checkpoint", help="sharded checkpoint directory")
    parser.add_argument("output", help="artifact file (.pt2 or .ts)")
    parser.add_argument(
        "--module",
        required=True,
        help="the LightningModule class, e.g. lightning_torchrec.DLRMClickModule",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="int8")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="pt2 (torch.export) or torchscript; default: from the output suffix (.pt2: pt2)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument(
        "--key-file", type=Path, help="refuse checkpoints not signed with the key in this file"
    )
    args = parser.parse_args(argv)
    fmt = args.format or ("pt2" if Path(args.output).suffix == ".pt2" else "torchscript")
    try:
        checkpoint, output = local_path(args.checkpoint), local_path(args.output)
        for out in (output, Path(f"{output}.json")):
            check_output(checkpoint, out, args.overwrite)
        key = read_key_file(args.key_file) if args.key_file else None
        result = export(checkpoint, args.module, output, dtype=args.dtype, format=fmt, key=key)
    except USER_ERRORS as err:
        # CheckpointMismatchError is a ValueError; the message names what is wrong.
        user_error(parser, err)
    ratio = result.quantized_table_bytes / max(result.float_table_bytes, 1)
    print(
        f"wrote {result.path} ({fmt}, tables {args.dtype}: {result.quantized_table_bytes} bytes, "
        f"{ratio:.2f} of float; file {result.path.stat().st_size} bytes) "
        f"in {result.seconds:.1f} s"
    )
    return result
