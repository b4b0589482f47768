"""What a checkpoint can be trusted with: safe loading, checksums, agreed errors, crash safety.

One 2-rank launch (tests/scripts/trust_checkpoint_ranks.py) runs every distributed scenario and
records what each rank raised; the tests here read those records. The single-process checks
(consolidate, ``load_unsharded``, ``load_plain_weights``, crash-safe replacement) run in this
process on the checkpoints that launch left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_torchrec import DLRMClickModule
from lightning_torchrec.checkpoint import (
    META_FILE,
    check_compatible,
    files,
    is_sharded_checkpoint,
    iter_plain_tensors,
    load_meta,
    load_sharded,
    load_unsharded,
    manifest,
    save_sharded,
)
from lightning_torchrec.checkpoint.consolidate import consolidate, load_plain_weights, read_plain
from lightning_torchrec.checkpoint.files import old_path
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE
from lightning_torchrec.checkpoint.safe_load import read_dcp_metadata
from lightning_torchrec.errors import CheckpointCorruptError, UnsafeCheckpointError
from tests.helpers import ROOT, clean_env, load_ranks, run_script
from tests.scripts.factory import WIDE, tiny_data, tiny_dlrm

ROWS, TABLES = 40, 2
TABLE1 = "model_and_loss.model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_1.weight"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trust_checkpoint")
    run_script("trust_checkpoint_ranks.py", str(out), timeout=240)
    return out


def phase(run: Path, name: str) -> list[dict[str, Any]]:
    return [r[name] for r in load_ranks(run, "results")]


def assert_agreed(run: Path, name: str, error: str, *needles: str) -> list[dict[str, Any]]:
    """Both ranks raised ``error`` and each message names every needle."""
    records = phase(run, name)
    for rank, rec in enumerate(records):
        assert rec["error"] == error, f"{name}, rank {rank}: {rec}"
        for needle in needles:
            assert needle in rec["message"], f"{name}, rank {rank}: {needle!r} not in {rec}"
    return records


def consolidate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_torchrec.consolidate", *args],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


# ------------------------------------------------------------------ 2: code in DCP metadata


@pytest.mark.parametrize(
    ("payload", "global_name"),
    [
        ("posix_system", "posix.system"),
        ("os_system", "os.system"),
        ("builtins_open", "builtins.open"),
    ],
)
def test_code_in_dcp_metadata_never_runs_on_any_rank(
    run: Path, payload: str, global_name: str
) -> None:
    name = f"unsafe_{payload}"
    records = assert_agreed(run, name, "UnsafeCheckpointError", ".metadata", global_name)
    assert not any(r["marker"] for r in records)
    assert not (run / f"marker_{payload}").exists()


def test_consolidate_and_readers_refuse_code_in_metadata(run: Path, tmp_path: Path) -> None:
    bad = run / "unsafe_posix_system.ckpt"
    proc = consolidate_cli(str(bad), str(tmp_path / "out.safetensors"))
    assert proc.returncode != 0
    assert "UnsafeCheckpointError" in proc.stderr and "posix.system" in proc.stderr
    assert str(bad / ".metadata") in proc.stderr
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        next(iter_plain_tensors(bad))
    with pytest.raises(UnsafeCheckpointError, match="builtins.open"):
        check_compatible(run / "unsafe_builtins_open.ckpt", {}, "model")
    assert not list(run.glob("marker_*")) and not (tmp_path / "out.safetensors").exists()


def test_real_dcp_metadata_passes_the_restricted_unpickler(run: Path) -> None:
    metadata = read_dcp_metadata(run / "good.ckpt")
    assert f"state_dict.{TABLE1}" in metadata.state_dict_metadata


# ------------------------------------------------------------------ 3: checksums


def test_flipped_bytes_are_found_on_every_rank(run: Path, tmp_path: Path) -> None:
    assert all(r["manifest"] for r in phase(run, "setup"))
    meta = load_meta(run / "good.ckpt")
    assert meta["lightning_torchrec"]["format_version"] == 2
    written = manifest.read_manifest(run / "good.ckpt")
    assert written is not None
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", META_FILE} <= set(written["files"])
    assert {"param_groups.rank0.pt", "param_groups.rank1.pt"} <= set(written["files"])
    assert_agreed(run, "flipped", "CheckpointCorruptError", "__1_0.distcp", "damaged")
    proc = consolidate_cli(str(run / "flipped.ckpt"), str(tmp_path / "out.safetensors"))
    assert proc.returncode != 0
    assert "CheckpointCorruptError" in proc.stderr and "__1_0.distcp" in proc.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_checkpoint_without_manifest_loads_with_a_warning(run: Path) -> None:
    records = phase(run, "old_format")
    assert [r["error"] for r in records] == [None, None]
    assert any("cannot be verified" in w for w in records[0]["warnings"])
    with pytest.warns(UserWarning, match="cannot be verified"):
        entries = dict(iter_plain_tensors(run / "old_format.ckpt"))
    assert TABLE1 in entries


# ------------------------------------------------------------------ 4: NaN optimizer state


def test_nan_in_one_ranks_optimizer_state_is_refused_on_both(run: Path) -> None:
    records = assert_agreed(
        run, "nan_optimizer", "NonFiniteCheckpointError", "rank(s) [1]", "t_cat_1.momentum1"
    )
    assert [r["owner"] for r in records] == [False, True]  # only rank 1 held the NaN
    assert all(r["same"] for r in phase(run, "good_after_failed_saves"))


# ------------------------------------------------------------------ 5: param-groups files


@pytest.mark.parametrize("name", ["missing_pg_old", "missing_pg"])
def test_missing_param_groups_file_is_an_agreed_error(run: Path, name: str) -> None:
    assert_agreed(run, name, "CheckpointCorruptError", "param_groups.rank1.pt", "missing")


# ------------------------------------------------------------------ 6: never delete user files


def test_save_never_replaces_what_is_not_a_checkpoint(run: Path) -> None:
    assert_agreed(run, "foreign_dir", "FileExistsError", str(run / "user_dir"))
    assert_agreed(run, "foreign_file", "FileExistsError", str(run / "user_file.ckpt"))
    assert (run / "user_dir" / "notes.txt").read_text() == "mine"
    assert (run / "user_file.ckpt").read_text() == "not a checkpoint"
    assert not list(run.glob(".user_dir.partial*"))
    assert [(r["error"], r["complete"]) for r in phase(run, "empty_dir")] == [(None, True)] * 2


# ------------------------------------------------------------------ 13: one rank's error


@pytest.mark.parametrize(
    ("name", "file"),
    [
        ("enospc_param_groups", "param_groups.rank1.pt"),
        ("enospc_meta", META_FILE),
        ("enospc_dcp", ".good.ckpt.partial"),
    ],
)
def test_disk_full_on_one_rank_is_raised_on_every_rank(run: Path, name: str, file: str) -> None:
    records = assert_agreed(run, name, "CheckpointWriteError", file, "disk full", "intact")
    assert [r["errno"] for r in records] == [28, 28]  # ENOSPC, kept on both ranks


def test_failed_saves_keep_the_previous_checkpoint(run: Path) -> None:
    for rec in phase(run, "good_after_failed_saves"):
        assert rec == {"same": True, "partial_left": False}
    for rec in phase(run, "reload_good"):
        assert rec["error"] is None and rec["same_model"] and rec["same_optim"]


def test_optimizer_mismatch_on_rank0_only_is_agreed(run: Path) -> None:
    records = assert_agreed(
        run, "opt_mismatch_rank0", "CheckpointMismatchError", "t_cat_0.momentum1"
    )
    assert "another rank failed: rank 0" in records[1]["message"]


@pytest.mark.parametrize(
    ("name", "file"),
    [("truncated_pg_old", "param_groups.rank1.pt"), ("truncated_distcp_old", "__1_0.distcp")],
)
def test_truncated_file_is_named_on_every_rank(run: Path, name: str, file: str) -> None:
    assert_agreed(run, name, "CheckpointCorruptError", file, "truncated or damaged")


# ------------------------------------------------------------------ 17: name what it is


@pytest.mark.parametrize(
    ("name", "file"), [("truncated_meta", META_FILE), ("garbage_metadata", ".metadata")]
)
def test_damaged_metadata_is_named(run: Path, name: str, file: str) -> None:
    assert_agreed(run, name, "CheckpointCorruptError", f"{name}.ckpt/{file}")


def test_single_file_checkpoint_of_another_strategy_is_explained(run: Path) -> None:
    assert_agreed(run, "single_file", "CheckpointMismatchError", "single-file Lightning checkpoint")
    assert "load_plain_weights" in phase(run, "single_file")[0]["message"]


def test_dead_peer_during_a_save_is_a_peer_failure(run: Path) -> None:
    rank0 = load_ranks(run, "results", world=1)[0]["dead_peer"]
    assert rank0["error"] == "PeerFailureError", rank0


# ------------------------------------------------------------------ 15 and 7: one process


def held_out() -> Any:
    data = tiny_data(ROWS, TABLES, batch_size=16, train_batches=8, test_batches=4, seed=2)
    return data.dataset("test")


@torch.no_grad()
def test_load_unsharded_predicts_like_the_sharded_model(run: Path) -> None:
    sharded = {i: p for r in load_ranks(run, "results") for i, p in r["predictions"].items()}
    assert sorted(sharded) == [0, 1, 2, 3]
    from_class = load_unsharded(run / "good.ckpt", DLRMClickModule)
    via_lightning = DLRMClickModule.load_from_checkpoint(run / "good.ckpt")
    instance = load_unsharded(run / "good.ckpt", tiny_dlrm(ROWS, TABLES, **WIDE))
    batches = held_out()
    for model in (from_class, via_lightning, instance):
        model.eval()
        assert not [n for n, p in model.named_parameters() if p.is_meta]
        for i, expected in sharded.items():
            got = model.predict_step(batches[i], i)
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@torch.no_grad()
def test_plain_weights_fill_tables_on_the_meta_device(run: Path, tmp_path: Path) -> None:
    plain = consolidate(run / "good.ckpt", tmp_path / "model.safetensors")
    expected = read_plain(plain)
    model = tiny_dlrm(ROWS, TABLES, **WIDE)
    assert model.state_dict()[TABLE1].is_meta
    loaded = load_plain_weights(model, plain)
    assert set(loaded) == set(expected)
    state = model.state_dict()
    assert not [k for k, v in state.items() if v.is_meta]
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    partial = {k: v for k, v in expected.items() if k != TABLE1}
    with pytest.raises(ValueError, match="t_cat_1.weight"):  # never reported loaded
        load_plain_weights(tiny_dlrm(ROWS, TABLES, **WIDE), partial, strict=False)


# ------------------------------------------------------------------ 14: crash-safe replacement


class _RenameThenDie:
    """Stands in for the ``os`` module of checkpoint_files: the process dies after one rename."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def rename(self, src: Any, dst: Any) -> None:
        os.rename(src, dst)
        os._exit(0)


def _die(*args: Any) -> None:
    os._exit(0)


def _save(path: Path, step: int) -> None:
    torch.manual_seed(step)
    save_sharded(path, nn.Linear(3, 2), [], {"global_step": step})


def _save_and_die(path: Path, step: int, atomic: bool, kill: str) -> None:
    """Saves in a forked child that dies at ``kill``; waits for it (hard timeout)."""
    pid = os.fork()
    if pid == 0:  # child: only file operations, then a hard exit
        try:
            files.USE_RENAME_EXCHANGE = atomic
            if kill == "after_first_rename":
                files.os = _RenameThenDie()  # type: ignore[assignment]
            else:  # right after the exchange / the second rename: before the old is deleted
                files.remove_replaced = _die  # type: ignore[assignment]
            _save(path, step)
        finally:
            os._exit(3)  # not killed where expected
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the saving child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0, "the child was not killed where expected"


def _step(path: Path) -> int:
    return torch.load(path / META_FILE, weights_only=True)["global_step"]


@pytest.mark.parametrize(
    ("atomic", "kill", "survivor"),
    [
        (True, "after_exchange", 2),
        (False, "after_first_rename", 1),
        (False, "after_second_rename", 2),
    ],
)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_killed_replacement_never_loses_last_ckpt(
    tmp_path: Path, atomic: bool, kill: str, survivor: int
) -> None:
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    if atomic and not files.exchange(tmp_path / "a", tmp_path / "b"):  # probes the call
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    (tmp_path / "a").rmdir(), (tmp_path / "b").rmdir()
    last = tmp_path / "last.ckpt"
    _save(last, 1)
    _save_and_die(last, 2, atomic, kill)
    if kill == "after_first_rename":
        assert not last.exists() and files.looks_complete(old_path(last))  # the crash window
    assert is_sharded_checkpoint(last)  # restores the old one where needed
    assert _step(last) == survivor
    target = nn.Linear(3, 2)
    assert load_sharded(last, target, [])["global_step"] == survivor
    _save(last, 3)  # the next save cleans up what the crash left
    assert _step(last) == 3 and manifest.read_manifest(last) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_missing_checkpoint_is_restored_from_its_old_copy_on_load(tmp_path: Path) -> None:
    last = tmp_path / "last.ckpt"
    _save(last, 1)
    last.rename(old_path(last))  # what a crash between the fallback's renames leaves
    target = nn.Linear(3, 2)
    assert load_sharded(last, target, [])["global_step"] == 1
    assert last.is_dir() and not old_path(last).exists()
    assert (last / MANIFEST_FILE).is_file()


def test_garbage_metadata_is_corrupt_not_unsafe(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(b"\x80\x04\x95garbage")
    with pytest.raises(CheckpointCorruptError, match=r"bad/\.metadata"):
        read_dcp_metadata(bad)
