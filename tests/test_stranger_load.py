"""Loading a stranger's checkpoint directory stays safe: one test per class of issue 20.

Every test starts from a real checkpoint and changes it as an attacker (or bad luck) would,
usually rewriting the manifest to match (``hostile.restamp``) so that the parsers behind the
checksums are reached. Classes: 1 unpickling cannot change anything, 2 bounded work, 3 no file
outside the folder, 5 tensors covered exactly once, 6 no hang on odd files, 9 weaker spots.
"""

from __future__ import annotations

import enum
import json
import os
import pathlib
import pickle
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

from lightning_torchrec.checkpoint import (
    iter_plain_tensors,
    load_meta,
    load_sharded,
    load_unsharded,
)
from lightning_torchrec.checkpoint.consolidate import consolidate
from lightning_torchrec.checkpoint.limits import CheckpointLimits
from lightning_torchrec.checkpoint.load import check_compatible
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE
from lightning_torchrec.compat.upstream import dcp_metadata_classes
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
    UnsupportedDtypeError,
)
from tests.helpers import ROOT, clean_env
from tests.scripts import hostile
from tests.scripts.hostile import (
    MARKER,
    build_on_class,
    call,
    dump,
    make_checkpoint,
    metadata,
    restamp,
    small_model,
    splice,
    write_metadata,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WEIGHT = "state_dict.0.weight"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "in" / "model.ckpt"
    make_checkpoint(path)
    return path


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A load that blocks (a FIFO) fails the test instead of hanging the run."""

    def fail(*_: Any) -> None:
        raise TimeoutError("a checkpoint load blocked")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


CLASSES = [
    pathlib.PurePath,
    pathlib.PurePosixPath,
    pathlib.Path,
    pathlib.PosixPath,
    enum.Enum,
    *dcp_metadata_classes().values(),
]


def snapshot() -> dict[type, dict[str, int]]:
    """Every attribute of the classes an unpickler could reach, by identity."""
    return {cls: {k: id(v) for k, v in vars(cls).items()} for cls in CLASSES}


def loaders(path: Path, out: Path) -> dict[str, Callable[[], Any]]:
    """Every way this package reads a checkpoint in one process."""
    model, opt = small_model(seed=5)
    return {
        "load_sharded": lambda: load_sharded(path, model, [opt]),
        "iter_plain_tensors": lambda: list(iter_plain_tensors(path)),
        "consolidate": lambda: consolidate(path, out / "plain.safetensors"),
    }


def refused_everywhere(path: Path, out: Path, error: type, match: str) -> None:
    for name, load in loaders(path, out).items():
        with pytest.raises(error, match=match):
            load()
        assert not (out / "plain.safetensors").exists(), name
        assert not list(out.glob(".plain*")), name


# ------------------------------------------------------------------ 1: nothing changes


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("pathlib", "PosixPath"),
        ("pathlib", "Path"),
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("enum", "Enum"),
    ],
)
def test_unpickling_cannot_change_a_class(
    ckpt: Path, tmp_path: Path, module: str, name: str
) -> None:
    before = snapshot()
    payload = build_on_class(module, name, "absolute", "changed by a checkpoint")
    write_metadata(ckpt, splice(metadata(ckpt), payload))
    refused_everywhere(ckpt, tmp_path, UnsafeCheckpointError, "Refusing to load")
    assert snapshot() == before


@pytest.mark.parametrize(
    ("module", "name", "args"),
    [
        ("collections", "OrderedDict", ()),  # allowed before; DCP never writes it
        ("__builtin__", "set", ()),
        ("builtins", "getattr", ("x", "y")),
        ("torch", "_C", ()),  # a module attribute that is not a dtype
        ("torch.distributed.checkpoint.metadata", "TensorProperties", ()),  # REDUCE, not NEWOBJ
    ],
)
def test_only_what_dcp_writes_resolves(
    ckpt: Path, tmp_path: Path, module: str, name: str, args: tuple[Any, ...]
) -> None:
    write_metadata(ckpt, splice(metadata(ckpt), call(module, name, *args)))
    with pytest.raises(UnsafeCheckpointError, match=rf"{module}\.{name}|calls"):
        load_sharded(ckpt, small_model()[0], [])


# ------------------------------------------------------------------ 2: bounded work


def bytearray_metadata(path: Path) -> None:
    # bytearray(2**31) was an allowed call: 2 GiB from a file of 1 KiB.
    write_metadata(path, splice(metadata(path), call("__builtin__", "bytearray", 2**31)))


def shared_metadata(path: Path) -> None:
    # 400 planner entries sharing one tuple of 50,000 names: 20M objects from ~260 KB.
    md = metadata(path)
    names = tuple("x" for _ in range(50_000))
    md.planner_data.update({f"k{i}": names for i in range(400)})
    write_metadata(path, pickle.dumps(md, protocol=4))
    assert (path / ".metadata").stat().st_size < 400_000


def deflated_meta(path: Path, restamped: bool = True) -> None:
    meta = path / "meta.pt"
    meta.write_bytes(hostile.deflated(meta.read_bytes(), pad_bytes=1 << 30))  # 1 GiB of zeros
    assert meta.stat().st_size < 4 << 20
    if restamped:
        restamp(path, "meta.pt")


def bytearray_meta(path: Path) -> None:
    class Bomb:
        def __reduce__(self) -> Any:
            return (bytearray, (2**31,))  # torch's weights-only unpickler allows bytearray

    meta = load_meta(path)
    meta["hyper_parameters"] = {"x": Bomb()}
    (path / "meta.pt").write_bytes(hostile.torch_bytes(meta))
    restamp(path, "meta.pt")


class _Bytearray:
    def __reduce__(self) -> Any:
        return (bytearray, (2**31,))  # torch's weights-only unpickler allows bytearray


def two_faced_meta(path: Path) -> None:
    # zipfile reads the real meta.pt, torch's reader another archive in the same file.
    meta = path / "meta.pt"
    real = meta.read_bytes()
    meta.write_bytes(hostile.two_faced(hostile.torch_bytes({"x": _Bytearray()}), real))
    restamp(path, "meta.pt")


def legacy_meta(path: Path) -> None:
    # zipfile finds the real meta.pt at the end; torch.load reads the legacy pickle before it.
    meta = path / "meta.pt"
    meta.write_bytes(hostile.legacy_prefixed({"x": _Bytearray()}, meta.read_bytes()))
    restamp(path, "meta.pt")


BOMBS = {
    "bytearray_metadata": (bytearray_metadata, "UnsafeCheckpointError: .*__builtin__.bytearray"),
    "shared_metadata": (shared_metadata, "CheckpointLimitError: .*expands to more objects"),
    "deflated_meta_unstamped": (
        lambda p: deflated_meta(p, restamped=False),
        "CheckpointCorruptError: checkpoint files do not match the checksums",
    ),
    "deflated_meta": (deflated_meta, "CheckpointCorruptError: .*compressed entry"),
    "bytearray_meta": (bytearray_meta, "UnsafeCheckpointError: .*__builtin__.bytearray"),
    "two_faced_meta": (two_faced_meta, "UnsafeCheckpointError: .*__builtin__.bytearray"),
    "legacy_meta": (legacy_meta, "CheckpointCorruptError: .*legacy pickle"),
}

CHILD = """
import json, resource, sys, time, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from lightning_torchrec.checkpoint import load_sharded, iter_plain_tensors
from tests.scripts.hostile import small_model
model, opt = small_model()
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
before, out = rss(), {}
for path in sys.argv[1:]:
    for name, load in (("load_sharded", lambda: load_sharded(path, model, [opt])),
                       ("iter_plain_tensors", lambda: list(iter_plain_tensors(path)))):
        start = time.perf_counter()
        try:
            load()
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        out[f"{Path(path).name}/{name}"] = {"error": error, "seconds": time.perf_counter() - start}
print(json.dumps({"loads": out, "rss_growth_mb": rss() - before}))
"""


def test_bombs_cost_little(tmp_path: Path) -> None:
    signal.alarm(0)  # the child has its own timeout (it imports torch: slow on a busy machine)
    paths = []
    for name, (craft, _) in BOMBS.items():
        path = tmp_path / f"{name}.ckpt"
        make_checkpoint(path)
        craft(path)
        paths.append(str(path))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *paths],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rss_growth_mb"] < 200, result  # any one bomb would take >= 1 GiB
    for name, (_, match) in BOMBS.items():
        for load in ("load_sharded", "iter_plain_tensors"):
            got = result["loads"][f"{name}.ckpt/{load}"]
            assert got["seconds"] < 10, (name, load, got)
            if load == "iter_plain_tensors" and name.endswith("_meta"):
                assert got["error"] is None  # the tensors do not need meta.pt: never parsed
                continue
            assert got["error"] and re.match(match, got["error"]), (name, load, got)


class _Net(LightningModule):
    """:func:`small_model`'s layers in a LightningModule that saves its hyper-parameters."""

    def __init__(self, x: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()  # deep-copies them
        self.add_module("0", torch.nn.Linear(4, 3))
        self.add_module("2", torch.nn.Linear(3, 2))


def test_containers_nested_too_deeply_are_refused(tmp_path: Path) -> None:
    # 2 bytes a level: hyper-parameters nested 2,000 deep made building the module from them
    # (load_unsharded, load_from_checkpoint) fail with a bare RecursionError in deepcopy.
    ckpt = tmp_path / "deep.ckpt"
    make_checkpoint(ckpt, hyper_parameters={"x": MARKER})
    meta, depth = ckpt / "meta.pt", 2000
    nested = b"]" * depth + b"a" * (depth - 1)
    meta.write_bytes(hostile.replace_in_pickle(meta.read_bytes(), hostile.string(MARKER), nested))
    restamp(ckpt, "meta.pt")
    with pytest.raises(CheckpointLimitError, match=r"meta\.pt nests containers more than 100"):
        load_unsharded(ckpt, _Net)
    deep = load_meta(ckpt, limits=CheckpointLimits(max_depth=depth + 2))
    assert len(deep["hyper_parameters"]["x"]) == 1


def test_size_caps_are_documented_and_raisable(ckpt: Path) -> None:
    model, opt = small_model(seed=3)
    small = CheckpointLimits(max_torch_file_bytes=1000)
    with pytest.raises(CheckpointLimitError, match=r"meta\.pt has \d+ bytes.*larger limits"):
        load_sharded(ckpt, model, [opt], limits=small)
    with pytest.raises(CheckpointLimitError, match=r"\.metadata"):
        load_sharded(ckpt, model, [opt], limits=CheckpointLimits(max_metadata_bytes=100))
    assert load_sharded(ckpt, model, [opt], limits=CheckpointLimits())["global_step"] == 1


# ------------------------------------------------------------------ 3: nothing outside


@pytest.mark.parametrize("where", ["../outside.distcp", "ABSOLUTE"])
def test_chunk_paths_cannot_leave_the_folder(ckpt: Path, tmp_path: Path, where: str) -> None:
    other = tmp_path / "other.ckpt"
    make_checkpoint(other, seed=9)  # a torch.save file elsewhere on the machine
    outside = tmp_path / "in" / "outside.distcp"
    shutil.copy(other / "__0_0.distcp", outside)
    name = str(outside) if where == "ABSOLUTE" else where
    md = metadata(ckpt)
    for info in md.storage_data.values():
        info.relative_path = name
    dump(ckpt, md)
    model, opt = small_model(seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    refused_everywhere(ckpt, tmp_path, UnsafeCheckpointError, "not a plain file name")
    with pytest.raises(UnsafeCheckpointError, match=re.escape(name)):
        load_sharded(ckpt, model, [opt])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_manifest_cannot_name_a_file_outside(ckpt: Path, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "in" / "secret")  # reading it would block: the test would time out
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["files"]["../secret"] = {"crc32": "00000000", "size": 0}
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    refused_everywhere(ckpt, tmp_path, CheckpointCorruptError, r"'\.\./secret'")


def test_a_manifest_name_no_file_system_can_hold_is_refused(ckpt: Path, tmp_path: Path) -> None:
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["files"]["\ud800.distcp"] = {"crc32": "00000000", "size": 0}  # a lone surrogate
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))  # JSON carries it as "\\ud800"
    refused_everywhere(ckpt, tmp_path, CheckpointCorruptError, r"'\\ud800\.distcp'.*not a plain")


def test_symlinks_may_not_leave_the_folder(ckpt: Path, tmp_path: Path) -> None:
    inside = ckpt / "__0_0.distcp"
    copy = tmp_path / "copy.distcp"
    shutil.copy(inside, copy)
    inside.unlink()
    inside.symlink_to(copy)  # same bytes: the checksums match, the link leaves the folder
    refused_everywhere(ckpt, tmp_path, UnsafeCheckpointError, "symbolic link")
    inside.unlink()
    shutil.copy(copy, ckpt / "data.bin")
    inside.symlink_to("data.bin")  # a link inside the folder is followed
    model, opt = small_model(seed=5)
    assert load_sharded(ckpt, model, [opt])["global_step"] == 1


# ------------------------------------------------------------------ 5: covered exactly once


def _chunks(md: Any) -> list[Any]:
    return md.state_dict_metadata[WEIGHT].chunks


@pytest.mark.parametrize("damage", ["none", "half", "outside", "overlap"])
def test_tensor_chunks_must_cover_it_exactly_once(ckpt: Path, tmp_path: Path, damage: str) -> None:
    md = metadata(ckpt)
    (chunk,) = _chunks(md)
    rows, cols = chunk.sizes
    if damage == "none":
        md.state_dict_metadata[WEIGHT].chunks = []
    elif damage == "half":
        chunk.sizes = torch.Size([rows - 1, cols])
    elif damage == "outside":
        chunk.offsets = torch.Size([1, 0])
    else:  # the same volume, but rows 0-1 twice and row 2 never
        second = type(chunk)(offsets=torch.Size([1, 0]), sizes=torch.Size([1, cols]))
        chunk.sizes = torch.Size([rows - 1, cols])
        md.state_dict_metadata[WEIGHT].chunks = [chunk, second]
    dump(ckpt, md)
    match = "reaches outside" if damage == "outside" else "not covered exactly once"
    refused_everywhere(ckpt, tmp_path, CheckpointCorruptError, rf"0\.weight.*{match}")
    with pytest.raises(CheckpointCorruptError, match=match):
        consolidate(ckpt, tmp_path / "plain.safetensors")


def test_tensors_may_not_share_bytes_on_disk(ckpt: Path, tmp_path: Path) -> None:
    # 200 tensors read from the weight's bytes: a consolidated file 200 times the checkpoint.
    md = metadata(ckpt)
    ((index, info),) = [(i, v) for i, v in md.storage_data.items() if i.fqn == WEIGHT]
    for n in range(200):
        key = f"state_dict.copy{n}.weight"
        md.state_dict_metadata[key] = md.state_dict_metadata[WEIGHT]
        md.storage_data[type(index)(key, index.offset, index.index)] = info
    dump(ckpt, md)
    refused_everywhere(ckpt, tmp_path, CheckpointCorruptError, "0\\.weight' and .* share bytes")


def test_a_value_nested_too_deeply_to_print_is_a_named_error(ckpt: Path, tmp_path: Path) -> None:
    # A list nested 100,000 deep as a planner_data key: its repr() in the message recursed.
    md = metadata(ckpt)
    md.planner_data = {MARKER: ("a",)}
    data = pickle.dumps(md, protocol=2)
    needle = hostile.string(MARKER)
    assert data.count(needle) == 1
    write_metadata(ckpt, data.replace(needle, b"(" * 100_000 + b"l" * 100_000))
    refused_everywhere(ckpt, tmp_path, CheckpointCorruptError, "nested too deeply")


# ------------------------------------------------------------------ 6: no hang


@pytest.mark.parametrize("which", ["named_chunk_file", "distcp", "manifest"])
def test_a_fifo_is_refused_not_read(ckpt: Path, tmp_path: Path, which: str) -> None:
    if which == "named_chunk_file":
        os.mkfifo(ckpt / "fifo.distcp")
        md = metadata(ckpt)
        for info in md.storage_data.values():
            info.relative_path = "fifo.distcp"
        dump(ckpt, md)
        manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
        manifest["files"]["fifo.distcp"] = manifest["files"]["__0_0.distcp"]
        (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    else:
        name = "__0_0.distcp" if which == "distcp" else MANIFEST_FILE
        (ckpt / name).unlink()
        os.mkfifo(ckpt / name)
    refused_everywhere(ckpt, tmp_path, UnsafeCheckpointError, "FIFO")


def test_a_fifo_meta_is_not_a_checkpoint(ckpt: Path) -> None:
    (ckpt / "meta.pt").unlink()
    os.mkfifo(ckpt / "meta.pt")
    with pytest.raises(FileNotFoundError, match="not a complete sharded checkpoint"):
        load_sharded(ckpt, small_model()[0], [])


# ------------------------------------------------------------------ 9: weaker spots


def test_format_2_without_manifest_is_refused(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / MANIFEST_FILE).unlink()
    refused_everywhere(ckpt, tmp_path, CheckpointCorruptError, "checksums.json is missing")


def test_a_file_missing_from_the_manifest_is_never_read(ckpt: Path, tmp_path: Path) -> None:
    shutil.copy(ckpt / "__0_0.distcp", ckpt / "__1_0.distcp")  # a file added later
    md = metadata(ckpt)
    for info in md.storage_data.values():
        info.relative_path = "__1_0.distcp"
    dump(ckpt, md)
    refused_everywhere(ckpt, tmp_path, CheckpointCorruptError, "not listed in")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("negative", "negative or huge"),
        ("huge", "not covered exactly once|less than"),
        ("dtype", "no checkpoint holds"),
        ("length", "less than"),
        ("transform", "stream transforms"),
    ],
)
def test_odd_metadata_is_a_named_error(ckpt: Path, tmp_path: Path, change: str, match: str) -> None:
    md = metadata(ckpt)
    entry = md.state_dict_metadata[WEIGHT]
    if change == "negative":
        entry.size = torch.Size([-3, 4])
    elif change == "huge":
        entry.size = entry.chunks[0].sizes = torch.Size([1 << 40, 4])
    elif change == "dtype":
        entry.properties.dtype = torch.qint8
    else:
        for index, info in md.storage_data.items():
            if index.fqn == WEIGHT and change == "length":
                info.length = 8
            elif index.fqn == WEIGHT:
                info.transform_descriptors = ["zstd"]
    dump(ckpt, md)
    error = UnsafeCheckpointError if change == "transform" else CheckpointCorruptError
    refused_everywhere(ckpt, tmp_path, error, match)
    if change != "dtype":
        return
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_torchrec.consolidate", str(ckpt), str(tmp_path / "o")],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert error.__name__ in proc.stderr and not list(tmp_path.glob("o*"))


def test_a_mismatch_with_many_long_names_is_reported_briefly(tmp_path: Path) -> None:
    """The message listed every table a stranger's metadata names, at any length (megabytes)."""
    props = TensorProperties(dtype=torch.float32)
    stored = {
        f"state_dict.t{i:03d}_{'x' * 5000}.embedding_bags.t{i}.weight": TensorStorageMetadata(
            props, torch.Size([2, 2]), []
        )
        for i in range(500)
    }
    target = {"state_dict": {"t.embedding_bags.own.weight": torch.zeros(2, 2)}}
    with pytest.raises(CheckpointMismatchError) as caught:
        check_compatible(tmp_path, target, "model", metadata=Metadata(stored))
    message = str(caught.value)
    assert len(message) < 12_000, len(message)
    assert "not in the target (500 entries; tables ['t0'" in message
    assert "... 480 more" in message and "missing from the checkpoint (1 entries" in message


class _ReaderBefore212:
    """torch 2.11's ``PyTorchFileReader``: no ``get_record_size``."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        if name == "get_record_size":
            raise AttributeError(name)
        return getattr(self._reader, name)


def test_entry_sizes_without_torchs_size_reader_are_those_torch_reads() -> None:
    # torch 2.11 (the oldest stack) has no get_record_size: every checkpoint load failed there.
    import io

    from lightning_torchrec.compat.torch_zip import TorchZip

    def opened(data: bytes) -> tuple[TorchZip, TorchZip]:
        new, old = TorchZip(io.BytesIO(data)), TorchZip(io.BytesIO(data))
        old._reader = _ReaderBefore212(old._reader)
        return new, old

    new, old = opened(hostile.torch_bytes({"w": torch.arange(100), "name": "x" * 50}))
    assert old.names() == new.names() and len(new.names()) > 2
    assert [old.size(n) for n in old.names()] == [new.size(n) for n in new.names()]
    with pytest.raises(RuntimeError, match="not in the central directory"):
        old.size("no_such_entry")
    # Two archives in one file: zipfile would read the other one's sizes; refused as unreadable.
    real = hostile.torch_bytes({"x": 1})
    _, old = opened(hostile.two_faced(hostile.torch_bytes({"x": _Bytearray()}), real))
    with pytest.raises(RuntimeError, match="bytes before the zip archive"):
        old.size("data.pkl")


def test_a_dtype_safetensors_cannot_name_is_a_named_error_naming_the_tensor(
    ckpt: Path, tmp_path: Path
) -> None:
    md = metadata(ckpt)
    md.state_dict_metadata[WEIGHT].properties.dtype = torch.complex64
    dump(ckpt, md)
    with pytest.raises(UnsupportedDtypeError, match=r"'0\.weight'.*complex64.*write a \.pt"):
        consolidate(ckpt, tmp_path / "plain.safetensors")
    assert not (tmp_path / "plain.safetensors").exists()
