"""Exported artifacts: a tampered file is refused before anything in it runs; models whose
embedding modules each see the whole ``KeyedJaggedTensor`` export and serve.

The artifacts come from a small two-table model saved in this process (a few seconds). No
``from __future__ import annotations`` here: ``torch.jit.script`` could not resolve the string
annotations of the model's ``forward`` (docs/export.md).
"""

import dataclasses
import io
import json
import os
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.checkpoint import save_sharded, written_by_this_package
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    IdOutOfRangeError,
    UnsafeCheckpointError,
)
from lightning_torchrec.export import archive
from lightning_torchrec.export.archive import check_pt2
from lightning_torchrec.export.artifact import export, load_artifact
from tests.scripts.hostile import two_faced

ROWS_A, ROWS_B = 100, 150
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # 1-process save


class TwoEBCs(nn.Module):
    """Two EBCs (``t_a`` for ``cat_0``, ``t_b`` for ``cat_1``), each fed the whole KJT."""

    def __init__(self) -> None:
        super().__init__()
        cpu = torch.device("cpu")
        self.ebc_a = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t_a", embedding_dim=8, num_embeddings=ROWS_A,
                                feature_names=["cat_0"])],
            device=cpu,
        )  # fmt: skip
        self.ebc_b = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t_b", embedding_dim=8, num_embeddings=ROWS_B,
                                feature_names=["cat_1"])],
            device=cpu,
        )  # fmt: skip
        self.dense = nn.Linear(13, 8)
        self.over = nn.Linear(24, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        a = self.ebc_a(sparse)["cat_0"]
        b = self.ebc_b(sparse)["cat_1"]
        return self.over(torch.cat([self.dense(dense), a, b], dim=1))


def _request(cat_0: list[int], cat_1: list[int]) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    kjt = KeyedJaggedTensor(
        keys=["cat_0", "cat_1"],
        values=torch.tensor([*cat_0, *cat_1], dtype=torch.int64),
        lengths=torch.ones(len(cat_0) + len(cat_1), dtype=torch.int32),
    )
    return torch.randn(len(cat_0), 13, generator=torch.Generator().manual_seed(1)), kjt


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TwoEBCs]:
    out = tmp_path_factory.mktemp("safety")
    torch.manual_seed(0)
    model = TwoEBCs()
    for ebc in (model.ebc_a, model.ebc_b):
        for param in ebc.parameters():
            nn.init.normal_(param)
    save_sharded(out / "ckpt", model, [], {})
    return out, model.eval()


@pytest.fixture(scope="module")
def artifact(saved: tuple[Path, TwoEBCs]) -> Path:
    out, _ = saved
    path = out / "fp32.pt2"
    export(out / "ckpt", TwoEBCs(), path, dtype="fp32", example_inputs=_request([1, 2], [3, 4]))
    return path


@pytest.mark.parametrize(
    ("fmt", "dtype"), [("pt2", "fp32"), ("pt2", "int8"), ("torchscript", "int8")]
)
def test_embedding_modules_fed_other_modules_features(
    saved: tuple[Path, TwoEBCs], fmt: str, dtype: str
) -> None:
    """Each EBC checks only its own features: cat_1's id 120 is in t_b (150 rows), not t_a."""
    out, model = saved
    path = out / f"two_{dtype}.{'pt2' if fmt == 'pt2' else 'ts'}"
    example = _request([1, 2], [3, 4])
    export(out / "ckpt", TwoEBCs(), path, dtype=dtype, format=fmt, example_inputs=example)
    served = load_artifact(path)
    good = _request([0, 99, 5], [120, 149, 0])
    with torch.inference_mode():
        want, got = model(*good), served(*good)
    bound = 1e-5 if dtype == "fp32" else 0.1
    assert float((got - want).abs().max()) <= bound
    for cat_0, cat_1, feature, table, rows in (
        ([0], [ROWS_B], "cat_1", "t_b", ROWS_B),
        ([ROWS_A], [0], "cat_0", "t_a", ROWS_A),
        ([0], [-1], "cat_1", "t_b", ROWS_B),
    ):
        message = f"feature '{feature}' (table '{table}', {rows} rows) got id"
        with pytest.raises(IdOutOfRangeError, match=re.escape(message)):
            served(*_request(cat_0, cat_1))


def test_a_failed_export_writes_nothing(saved: tuple[Path, TwoEBCs]) -> None:
    out, _ = saved
    target = out / "failed" / "broken.pt2"
    dense, kjt = _request([1, 2], [3, 4])
    with pytest.raises(RuntimeError):  # the dense layer takes 13 features, not 5
        export(out / "ckpt", TwoEBCs(), target, dtype="fp32", example_inputs=(dense[:, :5], kjt))
    assert not target.parent.exists() or list(target.parent.iterdir()) == []


# ----------------------------------------------------------------------------- tampering


class _Payload:
    """Unpickling it creates ``marker`` (what an attacker's command would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _torch_pickle(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save(_Payload(marker), buffer)
    return buffer.getvalue()


def _rewrite(src: Path, dst: Path, edit: Callable[[str, bytes], bytes | None], add=()) -> None:
    """Copies the archive, passing each entry (below its root) through ``edit`` (None: drop)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        root = zin.namelist()[0].split("/", 1)[0]
        for info in zin.infolist():
            data = edit(info.filename.split("/", 1)[1], zin.read(info.filename))
            if data is not None:
                zout.writestr(info, data)
        for name, data in add:
            zout.writestr(name.replace("ROOT", root), data)


def _json_edit(entry: str, change: Callable[[dict], None]) -> Callable[[str, bytes], bytes]:
    def edit(name: str, data: bytes) -> bytes:
        if name != entry:
            return data
        loaded = json.loads(data)
        change(loaded)
        return json.dumps(loaded).encode()

    return edit


def _first(config: dict) -> dict:
    return next(iter(config["config"].values()))


def _pickled_weight(marker: Path):
    def change(config: dict) -> None:
        _first(config)["use_pickle"] = True

    pickled = _json_edit("data/weights/model_weights_config.json", change)

    def edit(name: str, data: bytes) -> bytes:
        return _torch_pickle(marker) if name == "data/weights/weight_0" else pickled(name, data)

    return edit, (), "data/weights/model_weights_config.json"


def _pickled_constant(marker: Path):
    def change(config: dict) -> None:
        _first(config)["use_pickle"] = True

    pickled = _json_edit("data/constants/model_constants_config.json", change)

    def edit(name: str, data: bytes) -> bytes:
        return _torch_pickle(marker) if name == "data/constants/tensor_0" else pickled(name, data)

    return edit, (), "data/constants/model_constants_config.json"


def _opaque_constant(marker: Path):
    def change(config: dict) -> None:
        _first(config)["path_name"] = "opaque_obj_0"

    edit = _json_edit("data/constants/model_constants_config.json", change)
    add = [("ROOT/data/constants/opaque_obj_0", pickle.dumps(_Payload(marker)))]
    return edit, add, "data/constants/opaque_obj_0"


def _sample_inputs(marker: Path):
    def edit(name: str, data: bytes) -> bytes:
        return _torch_pickle(marker) if name == "data/sample_inputs/model.pt" else data

    return edit, (), "data/sample_inputs/model.pt"


def _legacy_weights(marker: Path):
    return (
        (lambda name, data: data),
        [("ROOT/data/weights/model.pt", _torch_pickle(marker))],
        ("data/weights/model.pt"),
    )


def _old_zip_layout(marker: Path):
    add = [("version", b"8.0"), ("serialized_state_dict.pt", _torch_pickle(marker))]
    return (lambda name, data: data), add, "version"


def _sympy_eval(marker: Path):
    def change(program: dict) -> None:
        text = json.dumps(program).replace(
            "Symbol('s", f"__import__('os').system('touch {marker}') or Symbol('s", 1
        )
        program.clear()
        program.update(json.loads(text))

    return _json_edit("models/model.json", change), (), "models/model.json"


def _guard_exec(marker: Path):
    def change(program: dict) -> None:
        program["guards_code"] = [f'L["x"] == "") ; __import__("os").system("touch {marker}"']

    return _json_edit("models/model.json", change), (), "models/model.json"


def _any_callable(marker: Path):
    def change(program: dict) -> None:
        program["graph_module"]["graph"]["nodes"][0]["target"] = "torch.serialization.os.system"

    return _json_edit("models/model.json", change), (), "models/model.json"


def _aoti_library(marker: Path):
    return (
        (lambda name, data: data),
        [("ROOT/data/aotinductor/model/x.so", b"\x7fELF")],
        ("data/aotinductor/model/x.so"),
    )


TAMPERS = {
    "weight unpickled (use_pickle)": _pickled_weight,
    "constant unpickled (use_pickle)": _pickled_constant,
    "opaque constant (pickle.loads)": _opaque_constant,
    "example inputs": _sample_inputs,
    "legacy weights file": _legacy_weights,
    "pre-2.8 zip layout": _old_zip_layout,
    "symbolic size (sympify)": _sympy_eval,
    "input guard (exec)": _guard_exec,
    "graph target (any callable)": _any_callable,
    "AOTInductor library": _aoti_library,
}


def _tampered(artifact: Path, tmp_path: Path, tamper: str) -> tuple[Path, str, Path]:
    """The artifact with ``TAMPERS[tamper]`` applied, the entry it touches, and its marker."""
    marker = tmp_path / "PAYLOAD_RAN"
    edit, add, entry = TAMPERS[tamper](marker)
    bad = tmp_path / "tampered.pt2"
    _rewrite(artifact, bad, edit, add)
    return bad, entry, marker


@pytest.mark.parametrize("tamper", list(TAMPERS), ids=list(TAMPERS))
def test_tampered_pt2_is_refused_before_anything_runs(
    artifact: Path, tmp_path: Path, tamper: str
) -> None:
    bad, entry, marker = _tampered(artifact, tmp_path, tamper)
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_artifact(bad)
    assert str(bad) in str(refused.value)
    assert repr(entry) in str(refused.value)
    assert not marker.exists()


def test_the_reproducers_tamper_runs_code_in_torch_export_load(
    artifact: Path, tmp_path: Path
) -> None:
    """What the check prevents: torch's own loader runs the payload (then fails)."""
    marker = tmp_path / "PAYLOAD_RAN"
    edit, add, _ = _pickled_weight(marker)
    bad = tmp_path / "tampered.pt2"
    _rewrite(artifact, bad, edit, add)
    with pytest.raises(Exception):  # noqa: B017, PT011 - torch's own error, after the payload
        torch.export.load(bad)
    assert marker.exists()


@pytest.mark.parametrize("tamper", ["weight unpickled (use_pickle)", "symbolic size (sympify)"])
def test_an_archive_only_torch_reads_is_checked_too(
    artifact: Path, tmp_path: Path, tamper: str
) -> None:
    """One file, two archives: zipfile reads the clean artifact, torch's reader the tampered."""
    tampered, entry, marker = _tampered(artifact, tmp_path, tamper)
    bad = tmp_path / "two_faced.pt2"
    bad.write_bytes(two_faced(tampered.read_bytes(), artifact.read_bytes()))
    with zipfile.ZipFile(bad) as seen:  # what a zipfile-only check saw: the clean artifact
        assert seen.read(seen.namelist()[0]) == zipfile.ZipFile(artifact).read(seen.namelist()[0])
    with pytest.raises(UnsafeCheckpointError, match=re.escape(repr(entry))):
        load_artifact(bad)
    assert not marker.exists()


class _Bytearray:
    def __reduce__(self) -> tuple[Callable[..., object], tuple[int]]:
        return bytearray, (1 << 28,)  # weights_only allows it: 256 MiB from a 1 KB entry


def test_example_inputs_that_allocate_without_bound_are_refused(
    artifact: Path, tmp_path: Path
) -> None:
    bomb = io.BytesIO()
    torch.save(((_Bytearray(),), {}), bomb)
    bad = tmp_path / "bomb.pt2"
    entry = "data/sample_inputs/model.pt"
    _rewrite(artifact, bad, lambda name, data: bomb.getvalue() if name == entry else data)
    with pytest.raises(UnsafeCheckpointError, match=rf"'{entry}'.*__builtin__\.bytearray"):
        load_artifact(bad)


def test_example_inputs_that_do_not_fit_the_program_are_a_named_error(
    artifact: Path, tmp_path: Path
) -> None:
    inputs = io.BytesIO()
    torch.save(((), {}), inputs)  # loads weights_only; binding it to forward() fails
    bad = tmp_path / "misfit.pt2"
    entry = "data/sample_inputs/model.pt"
    _rewrite(artifact, bad, lambda name, data: inputs.getvalue() if name == entry else data)
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"{bad}: its exported program")):
        load_artifact(bad)


def test_duplicate_entries_are_refused(artifact: Path, tmp_path: Path) -> None:
    bad = tmp_path / "dup.pt2"
    with pytest.warns(UserWarning, match="Duplicate name"):
        _rewrite(artifact, bad, lambda name, data: data, [("ROOT/models/model.json", b"{}")])
    with pytest.raises(UnsafeCheckpointError, match="more than once"):
        check_pt2(bad)


def test_oversized_or_deeply_nested_descriptions_are_refused_by_name(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # JSON entries were read whole, whatever size they declared; a deep nesting escaped as a
    # bare RecursionError.
    nested = tmp_path / "nested.pt2"
    deep = b"[" * 200_000 + b"]" * 200_000
    _rewrite(artifact, nested, lambda name, data: deep if name == "models/model.json" else data)
    with pytest.raises(CheckpointCorruptError, match=r"entry '.*models/model.json' is not JSON"):
        check_pt2(nested)
    small = dataclasses.replace(archive.DEFAULT_LIMITS, max_metadata_bytes=1000)
    monkeypatch.setattr(archive, "DEFAULT_LIMITS", small)
    with pytest.raises(CheckpointLimitError, match=r"\.json' holds \d+ bytes, over the 1000"):
        check_pt2(artifact)


def test_an_output_inside_the_checkpoint_is_refused_before_anything_is_written(
    saved: tuple[Path, TwoEBCs],
) -> None:
    """``export()`` in Python refused it only on the command line: an artifact written into the
    checkpoint directory made it a folder a later save or ``remove_checkpoint`` calls foreign."""
    out, _ = saved
    before = sorted(p.name for p in (out / "ckpt").iterdir())
    for target in (out / "ckpt" / "inside.ts", out / "ckpt"):
        with pytest.raises(ValueError, match="is inside the checkpoint"):
            export(out / "ckpt", TwoEBCs(), target, dtype="fp32", format="torchscript")
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == before
    assert written_by_this_package(out / "ckpt")


def test_untampered_artifact_passes_the_check(artifact: Path) -> None:
    check_pt2(artifact)  # the round trip itself is tested above and in test_export.py


def test_truncated_artifacts_name_the_file(saved: tuple[Path, TwoEBCs], tmp_path: Path) -> None:
    out, _ = saved
    ts = out / "check.ts"
    export(out / "ckpt", TwoEBCs(), ts, dtype="fp32", format="torchscript")
    pt2 = out / "fp32.pt2"
    if not pt2.exists():
        export(out / "ckpt", TwoEBCs(), pt2, dtype="fp32", example_inputs=_request([1], [2]))
    for src in (pt2, ts):
        cut = tmp_path / f"cut{src.suffix}"
        cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
        with pytest.raises(CheckpointCorruptError, match=re.escape(str(cut))):
            load_artifact(cut)


def test_torchscript_refuses_a_pickled_python_call(
    saved: tuple[Path, TwoEBCs], tmp_path: Path
) -> None:
    """TorchScript's unpickler knows no Python globals: the payload never runs."""
    out, _ = saved
    ts = out / "pickle.ts"
    export(out / "ckpt", TwoEBCs(), ts, dtype="fp32", format="torchscript")
    marker = tmp_path / "PAYLOAD_RAN"
    bad = tmp_path / "tampered.ts"

    def edit(name: str, data: bytes) -> bytes:
        return pickle.dumps(_Payload(marker), protocol=2) if name == "data.pkl" else data

    _rewrite(ts, bad, edit)
    with pytest.raises(CheckpointCorruptError, match=re.escape(str(bad))):
        load_artifact(bad)
    assert not marker.exists()
