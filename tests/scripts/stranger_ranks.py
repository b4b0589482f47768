"""Write refusals and hostile checkpoints on 2 gloo ranks: every rank raises the same named error.

``python stranger_ranks.py RANK OUT [TMPFS]``, once per rank (the test starts both). Phases:

* the OS refuses a write on one rank: ``RLIMIT_FSIZE`` (``EFBIG``) while rank 1 writes its
  ``param_groups`` file (a large hyper-parameter) or rank 0 writes ``meta.pt`` (a large entry);
  with ``TMPFS`` (a 1 MiB tmpfs the test mounted), a full disk (``ENOSPC``) for the same files.
  The previous checkpoint must stay as it was and no partial directory may be left;
* loads of checkpoints rank 0 crafted (``hostile``): a chunk path leaving the folder, a FIFO,
  a tensor its chunks do not cover, a BUILD onto a class.

Each rank writes ``OUT/results_rank{r}.json``: ``{phase: {"error", "message", "errno", ...}}``.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from hostile import (  # sibling module (script directory)
    build_on_class,
    dump,
    metadata,
    small_model,
    splice,
    write_metadata,
)

from lightning_torchrec.checkpoint import load_sharded, save_sharded
from lightning_torchrec.checkpoint.manifest import file_checksum
from lightning_torchrec.compat.upstream import dcp_metadata_classes

RANK, OUT = int(sys.argv[1]), Path(sys.argv[2])
TMPFS = Path(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
results: dict[str, dict[str, Any]] = {}


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
        return {"error": None, "message": "", "errno": None}
    except Exception as e:  # recorded for the test's assertions
        return {"error": type(e).__name__, "message": str(e), "errno": getattr(e, "errno", None)}


def fingerprint(path: Path) -> dict[str, Any]:
    return {f.name: file_checksum(f) for f in sorted(path.iterdir()) if f.is_file()}


def save(path: Path, note_on: int | None = None, blob: int = 0, size: int = 200_000) -> Any:
    """A save of the same model on both ranks; rank ``note_on`` has a large hyper-parameter."""
    model, opt = small_model()
    if RANK == note_on:
        opt.param_groups[0]["note"] = "x" * size
    meta = {"global_step": 2, "blob": "x" * blob}
    return lambda: save_sharded(path, model, [opt], meta)


def refused_write(name: str, path: Path, limit_on: int | None, **kwargs: Any) -> None:
    """One save the OS refuses; records the outcome, the survivor and what was left behind."""
    before = fingerprint(path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if RANK == limit_on:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        results[name] = outcome(save(path, **kwargs))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    dist.barrier()  # rank 0 removes the partial directory after raising
    results[name]["same"] = fingerprint(path) == before
    results[name]["left"] = sorted(p.name for p in path.parent.iterdir() if p != path)


def crafted(name: str, damage: Callable[[Path], None]) -> Path:
    """Rank 0: a copy of the good checkpoint, damaged; every rank gets it after a barrier."""
    path = OUT / "crafted" / name
    if RANK == 0:
        shutil.copytree(OUT / "good" / "model.ckpt", path)
        damage(path)
    dist.barrier()
    return path


def leave(path: Path) -> None:
    md = metadata(path)
    for info in md.storage_data.values():
        info.relative_path = "../model.ckpt/__0_0.distcp"
    dump(path, md)


def fifo(path: Path) -> None:
    (path / "__0_0.distcp").unlink()
    os.mkfifo(path / "__0_0.distcp")


def uncovered(path: Path) -> None:
    md = metadata(path)
    md.state_dict_metadata["state_dict.2.weight"].chunks = []
    dump(path, md)


def build_class(path: Path) -> None:
    payload = build_on_class("pathlib", "PosixPath", "absolute", "changed")
    write_metadata(path, splice(metadata(path), payload))


def main() -> None:
    warnings.simplefilter("ignore")
    store = f"file://{OUT / 'store'}"
    dist.init_process_group(
        "gloo", init_method=store, rank=RANK, world_size=2, timeout=timedelta(seconds=60)
    )
    good = OUT / "good" / "model.ckpt"
    save(good)()
    refused_write("efbig_param_groups", good, limit_on=1, note_on=1)
    refused_write("efbig_meta", good, limit_on=0, blob=200_000)
    if TMPFS is not None:
        small = TMPFS / "model.ckpt"
        save(small)()
        refused_write("enospc_param_groups", small, limit_on=None, note_on=1, size=2 << 20)
        refused_write("enospc_meta", small, limit_on=None, blob=2 << 20)
    classes = {c: dict(vars(c)) for c in [Path, type(Path()), *dcp_metadata_classes().values()]}
    for name, damage in (
        ("leave", leave),
        ("fifo", fifo),
        ("uncovered", uncovered),
        ("build_class", build_class),
    ):
        path = crafted(name, damage)
        model, opt = small_model(seed=7)
        results[name] = outcome(lambda p=path, m=model, o=opt: load_sharded(p, m, [o]))
    results["classes_unchanged"] = {"same": all(dict(vars(c)) == d for c, d in classes.items())}
    (OUT / f"results_rank{RANK}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
