"""Seeded fuzz of a real checkpoint: each load ends in a correct load or a named error, no more.

``python checkpoint_fuzz.py OUT [COUNT] [SEED]``. A small checkpoint is saved once; each case
copies it, mutates one of ``.metadata``, ``meta.pt``, ``checksums.json`` or the chunk file
``__0_0.distcp`` (random bytes, truncation, structural edits through the safe reader, pickle
payloads, compression, FIFOs, symlinks, paths outside the folder), usually rewriting the
manifest to match as an attacker would, and loads it with ``load_sharded`` and
``iter_plain_tensors``. A case is a *problem* when a load:

- raises anything but the package's named errors (or ``FileNotFoundError`` for a folder that is
  no longer a complete checkpoint);
- hangs (``SIGALRM`` after 20 s);
- succeeds with values that are neither the saved ones nor, for a restamped chunk file, fully
  written (the targets are pre-filled with a sentinel);
- changes a class an unpickler could reach (pathlib, enum, DCP's classes: ``__dict__``
  identities compared), runs a command, or opens, writes, renames or deletes a file under the
  fuzz root but outside the case's folder (an audit hook watches; a FIFO and a canary chunk file
  wait outside).

Writes ``OUT/fuzz.json``: the count, outcomes per kind, problems, peak RSS and its growth.
"""

from __future__ import annotations

import collections
import enum
import json
import os
import pathlib
import pickle
import random
import resource
import shutil
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from hostile import (  # sibling module (script directory)
    build_on_class,
    call,
    deflated,
    make_checkpoint,
    metadata,
    restamp,
    small_model,
    splice,
    torch_bytes,
)

from lightning_torchrec.checkpoint import iter_plain_tensors, load_meta, load_sharded
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE, file_checksum
from lightning_torchrec.compat.upstream import dcp_metadata_classes
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)

NAMED = (
    CheckpointCorruptError,
    UnsafeCheckpointError,
    CheckpointLimitError,
    CheckpointMismatchError,
    FileNotFoundError,
)
SENTINEL = 7777.0
TARGETS = (".metadata", "meta.pt", MANIFEST_FILE, "__0_0.distcp")
CLASSES = [
    pathlib.PurePath,
    pathlib.PurePosixPath,
    pathlib.Path,
    pathlib.PosixPath,
    enum.Enum,
    enum.EnumMeta,
    collections.OrderedDict,
    *dcp_metadata_classes().values(),
]
CODE_EVENTS = ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn")
FILE_EVENTS = ("open", "os.remove", "os.rmdir", "os.rename", "shutil.rmtree", "os.truncate")


class Watch:
    """An audit hook: file events under ``root`` outside ``current``, and commands run."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.current: str | None = None
        self.seen: list[str] = []
        sys.addaudithook(self)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self.current is None:
            return
        if event.startswith(CODE_EVENTS):
            self.seen.append(f"{event} {args!r:.100}")
        elif event in FILE_EVENTS:
            for arg in args[:2]:
                if isinstance(arg, str | bytes | os.PathLike):
                    path = os.path.realpath(os.fsdecode(arg))
                    inside = path == self.current or path.startswith(self.current + os.sep)
                    if path.startswith(self.root + os.sep) and not inside:
                        self.seen.append(f"{event} {path}")


def snapshot() -> dict[str, dict[str, int]]:
    return {c.__qualname__: {k: id(v) for k, v in vars(c).items()} for c in CLASSES}


def rewrite_metadata(path: Path, md: Any, protocol: int = 4) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(md, protocol=protocol))


def structural_metadata(rng: random.Random, path: Path, canary: Path) -> str:
    md = metadata(path)
    tensors = [(k, v) for k, v in md.state_dict_metadata.items() if getattr(v, "size", None)]
    key, entry = rng.choice(tensors)
    infos = list(md.storage_data.values())
    choice = rng.randrange(14)
    if choice == 0:
        dims = list(entry.size)
        dims[rng.randrange(len(dims))] = rng.choice([-1, 0, 1 << 40, 1 << 62, rng.randrange(9)])
        entry.size = torch.Size(dims)
    elif choice == 1 and entry.chunks:
        chunk = rng.choice(entry.chunks)
        field = rng.choice(["offsets", "sizes"])
        dims = list(getattr(chunk, field))
        dims[rng.randrange(len(dims))] += rng.choice([-2, -1, 1, 2, 1 << 40])
        setattr(chunk, field, torch.Size(dims))
    elif choice == 2:
        entry.chunks = rng.choice([[], entry.chunks * 2, entry.chunks[:-1]])
    elif choice == 3:
        names = ["../canary/canary.distcp", str(canary / "canary.distcp"), "../canary/fifo"]
        names += ["", ".", "..", "sub/x", "__9_9.distcp", MANIFEST_FILE, "meta.pt", ".metadata"]
        rng.choice(infos).relative_path = rng.choice(names)
    elif choice == 4:
        info = rng.choice(infos)
        setattr(info, rng.choice(["offset", "length"]), rng.choice([-1, 0, 3, 1 << 40]))
    elif choice == 5:
        dtypes = [torch.qint8, torch.float8_e4m3fn, torch.complex64, torch.int8, torch.bool]
        entry.properties.dtype = rng.choice(dtypes)
    elif choice == 6:
        rng.choice(infos).transform_descriptors = ["zstd"]
    elif choice == 7:
        md.version = rng.choice(["9.9", 3, None])
    elif choice == 8:
        payloads = [
            build_on_class("pathlib", "PosixPath", "absolute", "x"),
            build_on_class("torch.distributed.checkpoint.metadata", "Metadata", "x", "y"),
            build_on_class("enum", "Enum", "x", "y"),
            call("posix", "system", "true"),
            call("__builtin__", "bytearray", 1 << 31),
            call("builtins", "eval", "1"),
            call("torch", "Size", 1 << 40),
        ]
        (path / ".metadata").write_bytes(splice(md, rng.choice(payloads)))
        return "metadata/payload"
    elif choice == 9:
        names = tuple("x" for _ in range(20_000))
        md.planner_data.update({f"k{i}": names for i in range(200)})
    elif choice == 10:
        md.state_dict_metadata[f"{key}.copy"] = entry  # shared, without slices
    elif choice == 11:
        rewrite_metadata(path, md, protocol=rng.choice([0, 1, 2, 3, 5]))
        return "metadata/protocol"
    elif choice == 12:
        md.storage_data = dict(list(md.storage_data.items())[1:])
    else:
        md.planner_data = rng.choice([None, {"x": [1, 2]}, {"x": object.__new__(type(entry))}])
    rewrite_metadata(path, md)
    return f"metadata/structure{choice}"


def structural_meta(rng: random.Random, path: Path) -> str:
    meta = load_meta(path)
    choice = rng.randrange(7)
    if choice == 0:
        (path / "meta.pt").write_bytes(deflated((path / "meta.pt").read_bytes(), 64 << 20))
        return "meta/deflated"
    if choice == 1:

        class Bomb:
            def __reduce__(self) -> Any:
                return (bytearray, (1 << 31,))

        meta["hyper_parameters"] = {"x": Bomb()}
    elif choice == 2:
        meta["hyper_parameters"] = {"f": print}
    elif choice == 3:
        meta["x"] = torch.zeros(1).expand(1 << 30)  # a view repeating one element
    elif choice == 4:
        meta = [meta]
    elif choice == 5:
        meta["lightning_torchrec"] = rng.choice([{"format_version": "2"}, [], {"world_size": -1}])
    else:
        nested: list[Any] = ["x"]
        for _ in range(20):
            nested = [nested] * 8  # 8**20 leaves through shared references
        meta["hyper_parameters"] = {"n": nested}
    (path / "meta.pt").write_bytes(torch_bytes(meta))
    return f"meta/structure{choice}"


def structural_manifest(rng: random.Random, path: Path) -> str:
    file = path / MANIFEST_FILE
    manifest = json.loads(file.read_text())
    name = rng.choice(sorted(manifest["files"]))
    choice = rng.randrange(9)
    if choice == 0:
        manifest["files"][rng.choice(["../x", "/etc/passwd", "", "a/b"])] = manifest["files"][name]
    elif choice == 1:
        manifest["files"][name]["size"] = rng.choice([-1, 1 << 60, "7", None, True])
    elif choice == 2:
        manifest["files"][name]["crc32"] = rng.choice(["xyz", 5, "", "0" * 64])
    elif choice == 3:
        del manifest["files"][name]
    elif choice == 4:
        manifest["files"] = rng.choice([[], None, "files"])
    elif choice == 5:
        file.write_text("[" * 100_000 + "]" * 100_000)
        return "manifest/deep"
    elif choice == 6:
        manifest["format_version"] = rng.choice([-1, "2", 1 << 80])
    elif choice == 7:
        manifest["signature"] = rng.choice(["x", {"alg": "hmac-sha256", "mac": 5}])
    else:
        manifest["files"][f"extra{rng.randrange(9)}"] = {"crc32": "00000000", "size": 0}
    file.write_text(json.dumps(manifest))
    return f"manifest/structure{choice}"


def special_file(rng: random.Random, path: Path, canary: Path, target: str) -> str:
    file = path / target
    file.unlink()
    if rng.random() < 0.5:
        os.mkfifo(file)
        return f"{target}/fifo"
    file.symlink_to(rng.choice([canary / "canary.distcp", canary / "fifo", Path("/dev/zero")]))
    return f"{target}/symlink"


def bytes_mutation(rng: random.Random, file: Path) -> str:
    raw = bytearray(file.read_bytes())
    choice = rng.randrange(6)
    at = rng.randrange(max(len(raw), 1))
    if choice == 0:
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif choice == 1:
        del raw[at:]
    elif choice == 2:
        raw[at:at] = os.urandom(rng.randint(1, 64))
    elif choice == 3:
        raw[at:at] = raw[at : at + rng.randint(1, 256)]
    elif choice == 4:
        end = at + rng.randint(1, 64)
        raw[at:end] = bytes(rng.getrandbits(8) for _ in range(len(raw[at:end])))
    else:
        raw += os.urandom(rng.randint(1, 64))
    file.write_bytes(bytes(raw))
    return f"{file.name}/bytes{choice}"


def mutate(rng: random.Random, path: Path, canary: Path) -> tuple[str, bool]:
    """Mutates one file of ``path``; returns the kind and whether the manifest was made to match.

    A restamped case may load other values than were saved (an attacker can write any values
    into their own checkpoint); it must still load every element or fail with a named error.
    """
    target = rng.choice(TARGETS)
    roll = rng.random()
    if roll < 0.05:
        return special_file(rng, path, canary, target), False
    if roll < 0.5 and target == ".metadata":
        kind = structural_metadata(rng, path, canary)
    elif roll < 0.5 and target == "meta.pt":
        kind = structural_meta(rng, path)
    elif roll < 0.6 and target == MANIFEST_FILE:
        kind = structural_manifest(rng, path)
    else:
        kind = bytes_mutation(rng, path / target)
    if target != MANIFEST_FILE and rng.random() < 0.75:  # as an attacker would
        restamp(path, target)
        return kind + "+restamped", True
    return kind, target == MANIFEST_FILE


def load_case(path: Path, expected: dict[str, torch.Tensor], data_changed: bool) -> str:
    model, opt = small_model(seed=99)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    load_sharded(path, model, [opt])
    plain = dict(iter_plain_tensors(path))
    for name, value in model.state_dict().items():
        if (value == SENTINEL).any():
            raise AssertionError(f"{name} was not (fully) loaded")
        if not data_changed and not torch.equal(value, expected[name]):
            raise AssertionError(f"{name} differs from what was saved")
        if not data_changed and not torch.equal(plain[name], expected[name]):
            raise AssertionError(f"plain {name} differs from what was saved")
    return "loaded" if not data_changed else "loaded (restamped)"


def self_check(watch: Watch, canary: Path, classes: dict[str, dict[str, int]]) -> None:
    """The detectors can fail: a file opened outside the case, and a class changed."""
    watch.current = os.path.realpath(canary.parent / "work")
    with open(canary / "canary.distcp", "rb"):
        pass
    watch.current = None
    assert watch.seen, "the audit hook saw nothing"
    watch.seen.clear()
    pathlib.PurePath.fuzz_check = 1  # type: ignore[attr-defined]
    assert snapshot() != classes, "the class snapshot saw nothing"
    del pathlib.PurePath.fuzz_check  # type: ignore[attr-defined]
    assert snapshot() == classes


def main() -> None:
    out = Path(sys.argv[1])
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    warnings.simplefilter("ignore")
    root = out / "root"
    base = root / "base" / "model.ckpt"
    model, _ = make_checkpoint(base)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    canary = root / "canary"
    make_checkpoint(root / "other.ckpt", seed=1)
    canary.mkdir()
    shutil.copy(root / "other.ckpt" / "__0_0.distcp", canary / "canary.distcp")
    os.mkfifo(canary / "fifo")
    canary_before = file_checksum(canary / "canary.distcp")
    watch = Watch(root)
    classes = snapshot()
    self_check(watch, canary, classes)

    def timeout(*_: Any) -> None:
        raise TimeoutError("a load blocked")

    signal.signal(signal.SIGALRM, timeout)
    load_case(base, expected, False)  # warm up, then measure
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    problems: list[str] = []
    start = time.perf_counter()
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        case = root / "work" / str(i) / "model.ckpt"
        shutil.copytree(base, case)
        try:
            kind, data_changed = mutate(rng, case, canary)
        except Exception as err:  # noqa: BLE001 - a mutation the harness could not make
            kind, data_changed = f"unmade: {type(err).__name__}: {err}"[:120], False
        watch.current = os.path.realpath(case)
        signal.alarm(20)
        try:
            result = load_case(case, expected, data_changed)
        except NAMED as err:
            result = type(err).__name__
        except TimeoutError:
            result = "HANG"
            problems.append(f"case {i} ({kind}): hang")
        except Exception as err:  # noqa: BLE001 - what the fuzz looks for
            result = f"RAW {type(err).__name__}"
            tail = traceback.format_exception(err)[-1].strip()
            problems.append(f"case {i} ({kind}): {tail[:300]}")
        finally:
            signal.alarm(0)
            watch.current = None
        outcomes[kind.split("/")[0]][result] += 1
        if watch.seen:
            problems.append(f"case {i} ({kind}): touched {watch.seen[:3]}")
            watch.seen.clear()
        if snapshot() != classes:
            problems.append(f"case {i} ({kind}): a class changed")
            classes = snapshot()
        shutil.rmtree(case.parent)
    if file_checksum(canary / "canary.distcp") != canary_before:
        problems.append("the canary outside the folder changed")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = {
        "count": count,
        "seed": seed,
        "seconds": round(time.perf_counter() - start, 1),
        "peak_rss_mb": rss >> 10,
        "rss_growth_mb": (rss - rss_before) >> 10,
        "outcomes": {k: dict(v) for k, v in sorted(outcomes.items())},
        "problems": problems,
    }
    (out / "fuzz.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
