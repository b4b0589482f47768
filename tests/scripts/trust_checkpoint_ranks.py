"""Checkpoint trust scenarios on 2 gloo ranks, all in one launch (Lightning relaunches it).

``python trust_checkpoint_ranks.py OUT``. One 2-rank table-wise model (rank 0 owns ``t_cat_0``,
rank 1 ``t_cat_1``) trains 4 steps and saves ``OUT/good.ckpt``; then, each phase on both ranks:

* failing saves over ``good.ckpt``: NaN in rank 1's fused optimizer state; disk full (``ENOSPC``
  from ``torch.save``) on one rank for its param-groups file, ``meta.pt``, or inside ``dcp.save``;
* saves over things that are not checkpoints (a user's directory, a file) and an empty directory;
* loads of damaged copies prepared by rank 0: ``.metadata`` pickles that would run code, 16
  flipped bytes in a ``.distcp`` file, a missing/truncated param-groups file, truncated
  ``.distcp``/``meta.pt``, garbage ``.metadata``, a checkpoint without manifest (format 1), a
  single-file Lightning checkpoint;
* an optimizer-state mismatch on rank 0 only (a second model: ``t_cat_0`` column-wise on rank 0);
* a reload of ``good.ckpt`` and predictions on held-out batches (each rank half of them);
* last: rank 1 dies (``os._exit``) while writing a checkpoint; rank 0 records what it raised.

Each rank writes ``OUT/results_rank{r}.pt``: ``{phase: {"error", "message", "errno", ...}}``.
The damaged copies stay in ``OUT`` for the single-process checks of the test.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from factory import WIDE, cpu_trainer, table_wise, tiny_data, tiny_dlrm  # sibling module
from rank_state import local_view  # sibling module (script directory)
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
)
from torchrec.distributed.sharding_plan import (
    table_wise as table_wise_on,
)
from torchrec.distributed.types import ShardingPlan

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.checkpoint import META_FILE, is_sharded_checkpoint, load_sharded
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE, file_checksum

OUT = Path(sys.argv[1])
ROWS, TABLES = 40, 2
EBC = "model_and_loss.model.sparse_arch.embedding_bag_collection"
GOOD = OUT / "good.ckpt"
#: Pickles that would run code: ``os.system`` (pickled as ``posix.system``), ``os.system``
#: spelled ``os``, and ``builtins.open`` creating a marker file.
PAYLOADS = {
    "posix_system": b"cposix\nsystem\n(Vtouch {marker}\ntR.",
    "os_system": b"cos\nsystem\n(Vtouch {marker}\ntR.",
    "builtins_open": b"cbuiltins\nopen\n(V{marker}\nVw\ntR.",
}
results: dict[str, dict[str, Any]] = {}


def data() -> Any:
    return tiny_data(ROWS, TABLES, batch_size=16, train_batches=8, test_batches=4, seed=2)


def make(max_steps: int, **strategy: Any) -> tuple[Any, Any]:
    torch.manual_seed(3)
    model = tiny_dlrm(ROWS, TABLES, **WIDE)
    strategy.setdefault("constraints", table_wise(TABLES))
    trainer = cpu_trainer(
        TorchRecStrategy(log_plan=False, timeout=timedelta(seconds=30), **strategy),
        devices=2,
        max_steps=max_steps,
        limit_val_batches=0,
        default_root_dir=OUT,
    )
    trainer.fit(model, datamodule=data())
    return model, trainer


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
            result: dict[str, Any] = {"error": None, "message": "", "errno": None}
        except Exception as e:  # recorded for the test's assertions
            result = {"error": type(e).__name__, "message": str(e)}
            result["errno"] = getattr(e, "errno", None)
    result["warnings"] = [str(w.message) for w in caught]
    return result


def fingerprint(path: Path) -> dict[str, Any]:
    return {f.name: file_checksum(f) for f in sorted(path.iterdir()) if f.is_file()}


def target(f: Any) -> str:
    """What ``torch.save`` writes to: a path, or the name of the file (or buffer) it is for."""
    return str(getattr(f, "name", f))


class FailingSave:
    """Makes ``torch.save`` raise ``ENOSPC`` (or exit the process) on one rank for one target."""

    def __init__(self, rank: int, match: Callable[[Any], bool], exit_process: bool = False):
        self.rank, self.match, self.exit_process = rank, match, exit_process
        self.real = torch.save

    def __call__(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if self.match(f):
            if self.exit_process:
                os._exit(0)  # a peer that dies (exit code 0: Lightning's observer stays calm)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real(obj, f, *args, **kwargs)

    def __enter__(self) -> FailingSave:
        if torch.distributed.get_rank() == self.rank:
            torch.save = self
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.save = self.real


def copy_good(name: str, damage: Callable[[Path], None], old_format: bool = False) -> Path:
    """Rank 0: a copy of good.ckpt, damaged; every rank gets its path after a barrier."""
    path = OUT / name
    if torch.distributed.get_rank() == 0:
        shutil.copytree(GOOD, path)
        if old_format:  # as written before format 2: no manifest, format_version 1
            (path / MANIFEST_FILE).unlink()
            meta = torch.load(path / META_FILE, weights_only=True)
            meta["lightning_torchrec"]["format_version"] = 1
            torch.save(meta, path / META_FILE)
        damage(path)
    torch.distributed.barrier()
    return path


def restamp(path: Path, name: str) -> None:
    """What an attacker does after changing a file: writes a manifest entry that matches it."""
    written = json.loads((path / MANIFEST_FILE).read_text())
    written["files"][name] = file_checksum(path / name)
    (path / MANIFEST_FILE).write_text(json.dumps(written))


def flip16(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 16] = bytes(b ^ 0xFF for b in raw[mid : mid + 16])
    file.write_bytes(bytes(raw))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def save_results(rank: int) -> None:
    torch.save(results, OUT / f"results_rank{rank}.pt")


def rank0_plan(model: Any) -> ShardingPlan:
    """``t_cat_0`` column-wise in two shards both on rank 0, ``t_cat_1`` on rank 1."""
    ebc = model.get_submodule(EBC)
    per_table = {
        "t_cat_0": column_wise(ranks=[0, 0], compute_kernel="fused"),
        "t_cat_1": table_wise_on(rank=1, compute_kernel="fused"),
    }
    return ShardingPlan(
        {EBC: construct_module_sharding_plan(ebc, per_table, world_size=2, device_type="cpu")}
    )


def main() -> None:
    model, trainer = make(4)
    rank = trainer.global_rank
    opt = trainer.optimizers[0]
    trainer.save_checkpoint(GOOD)
    saved_model = local_view(model.state_dict())
    saved_optim = local_view(opt.state_dict()["state"])
    good_before = fingerprint(GOOD)
    results["setup"] = {"rank": rank, "manifest": (GOOD / MANIFEST_FILE).is_file()}

    def save(path: Path) -> Callable[[], None]:
        return lambda: trainer.save_checkpoint(path)

    def load(path: Path, target: Any = None, optimizers: Any = None) -> Callable[[], None]:
        target = model if target is None else target
        optimizers = [opt] if optimizers is None else optimizers
        return lambda: load_sharded(path, target, optimizers)

    # --- Item 4: NaN in rank 1's fused optimizer state (the Adagrad momentum of t_cat_1).
    key = f"embedding.{EBC}.embedding_bags.t_cat_1.weight"
    state = opt.state_dict()["state"]
    momentum = None
    if key in state:
        (shard,) = state[key]["t_cat_1.momentum1"].local_shards()
        momentum = shard.tensor
        kept = momentum.clone()
        momentum.fill_(float("nan"))
    results["nan_optimizer"] = outcome(save(GOOD))
    results["nan_optimizer"]["owner"] = key in state
    if momentum is not None:
        momentum.copy_(kept)

    # --- Item 6: never replace what is not a checkpoint.
    user_dir, user_file, empty = OUT / "user_dir", OUT / "user_file.ckpt", OUT / "empty.ckpt"
    if rank == 0:
        user_dir.mkdir()
        (user_dir / "notes.txt").write_text("mine")
        user_file.write_text("not a checkpoint")
        empty.mkdir()
    torch.distributed.barrier()
    results["foreign_dir"] = outcome(save(user_dir))
    results["foreign_file"] = outcome(save(user_file))
    results["empty_dir"] = outcome(save(empty))
    results["empty_dir"]["complete"] = is_sharded_checkpoint(empty)

    # --- Item 13: disk full on one rank; the previous checkpoint is kept.
    with FailingSave(1, lambda f: target(f).endswith("param_groups.rank1.pt")):
        results["enospc_param_groups"] = outcome(save(GOOD))
    with FailingSave(0, lambda f: target(f).endswith(META_FILE)):
        results["enospc_meta"] = outcome(save(GOOD))
    with FailingSave(1, lambda f: not target(f).endswith(".pt")):  # DCP's streams
        results["enospc_dcp"] = outcome(save(GOOD))
    torch.distributed.barrier()  # rank 0 removes the partial directory after raising
    results["good_after_failed_saves"] = {
        "same": fingerprint(GOOD) == good_before,
        "partial_left": bool(list(OUT.glob(".good.ckpt.partial*"))),
    }
    save_results(rank)

    # --- Items 2, 3, 5, 13, 17: damaged or unsafe checkpoints, agreed errors.
    for name, payload in PAYLOADS.items():
        marker = OUT / f"marker_{name}"

        def unsafe(p: Path, payload: bytes = payload, marker: Path = marker) -> None:
            (p / ".metadata").write_bytes(payload.replace(b"{marker}", str(marker).encode()))
            restamp(p, ".metadata")  # consistent checksums: the unpickler itself must refuse

        path = copy_good(f"unsafe_{name}.ckpt", unsafe)
        results[f"unsafe_{name}"] = outcome(load(path))
        results[f"unsafe_{name}"]["marker"] = marker.exists()
    flipped = copy_good("flipped.ckpt", lambda p: flip16(p / "__1_0.distcp"))
    results["flipped"] = outcome(load(flipped))
    old = copy_good("old_format.ckpt", lambda p: None, old_format=True)
    results["old_format"] = outcome(load(old))
    missing = copy_good(
        "missing_pg_old.ckpt", lambda p: (p / "param_groups.rank1.pt").unlink(), old_format=True
    )
    results["missing_pg_old"] = outcome(load(missing))
    missing = copy_good("missing_pg.ckpt", lambda p: (p / "param_groups.rank1.pt").unlink())
    results["missing_pg"] = outcome(load(missing))
    bad = copy_good(
        "truncated_pg_old.ckpt", lambda p: truncate(p / "param_groups.rank1.pt"), old_format=True
    )
    results["truncated_pg_old"] = outcome(load(bad))
    bad = copy_good(
        "truncated_distcp_old.ckpt", lambda p: truncate(p / "__1_0.distcp"), old_format=True
    )
    results["truncated_distcp_old"] = outcome(load(bad))
    bad = copy_good("truncated_meta.ckpt", lambda p: truncate(p / META_FILE))
    results["truncated_meta"] = outcome(load(bad))
    bad = copy_good(
        "garbage_metadata.ckpt", lambda p: (p / ".metadata").write_bytes(os.urandom(300))
    )
    results["garbage_metadata"] = outcome(load(bad))
    single = OUT / "ddp.ckpt"
    if rank == 0:
        torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {}, "epoch": 0}, single)
    torch.distributed.barrier()
    results["single_file"] = outcome(load(single))
    save_results(rank)

    # --- Item 13: the optimizer state mismatches on rank 0 only.
    plan_model = tiny_dlrm(ROWS, TABLES, **WIDE)
    model2, trainer2 = make(1, plan=rank0_plan(plan_model), constraints=None)
    results["opt_mismatch_rank0"] = outcome(load(GOOD, model2, [trainer2.optimizers[0]]))

    # --- Everything failed cleanly: the good checkpoint still loads, bit for bit.
    results["reload_good"] = outcome(load(GOOD))
    results["reload_good"]["same_model"] = str(local_view(model.state_dict())) == str(saved_model)
    results["reload_good"]["same_optim"] = str(local_view(opt.state_dict()["state"])) == str(
        saved_optim
    )

    # --- Item 15: predictions of the trained sharded model on held-out batches.
    model.eval()
    held = data().dataset("test")
    preds = {}
    with torch.no_grad():
        for i in range(rank, len(held), 2):
            preds[i] = model.predict_step(held[i], i).clone()
    results["predictions"] = preds
    save_results(rank)

    # --- Item 17: rank 1 dies while writing a checkpoint; rank 0 must name it.
    with FailingSave(1, lambda f: target(f).endswith("param_groups.rank1.pt"), exit_process=True):
        results["dead_peer"] = outcome(save(OUT / "dying.ckpt"))
    save_results(rank)
    sys.stdout.flush()
    os._exit(0)  # the process group is broken: skip the teardown's collectives


if __name__ == "__main__":
    main()
