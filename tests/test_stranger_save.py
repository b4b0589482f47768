"""Resuming from and saving next to a stranger's files; the command lines; signed manifests.

Issue 20 classes 4 (a resumed ``ModelCheckpoint`` never deletes outside its ``dirpath``), 7
(saving deletes only what it made) and 9 (the command lines' rules), and the optional HMAC
signature of manifests. Class 8 (the OS's errno on every rank) is ``test_stranger_ranks.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.checkpoint import (
    KEY_FILE_ENV,
    files,
    is_sharded_checkpoint,
    load_meta,
    load_sharded,
    remove_checkpoint,
)
from lightning_torchrec.checkpoint import consolidate as consolidate_module
from lightning_torchrec.checkpoint.consolidate import main as consolidate_main
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE, file_checksum
from lightning_torchrec.errors import CheckpointCorruptError, CheckpointSignatureError
from lightning_torchrec.export.artifact import export
from lightning_torchrec.export.artifact import main as export_main
from lightning_torchrec.lightning.checkpoint_hooks import confine_restored_callbacks
from tests.helpers import ROOT, clean_env
from tests.scripts.factory import cpu_trainer, table_wise, tiny_data, tiny_dlrm
from tests.scripts.hostile import make_checkpoint, restamp, small_model, torch_bytes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KEY = b"0123456789abcdef0123456789abcdef"


def fingerprint(path: Path) -> dict[str, Any]:
    return {p.name: file_checksum(p) for p in sorted(path.iterdir()) if p.is_file()}


# ------------------------------------------------------------------ 4: confined resume


def fit(root: Path, steps: int, ckpt_path: Path | None = None, key: bytes | None = None) -> Any:
    callback = ModelCheckpoint(
        dirpath=root / "ck",
        monitor="train/loss",
        save_top_k=1,
        every_n_train_steps=1,
        save_last=True,
    )
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False, checkpoint_key=key)
    trainer = cpu_trainer(
        strategy,
        max_steps=steps,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=[callback],
        enable_checkpointing=True,
    )
    data = tiny_data(40, 2, batch_size=8, train_batches=8)
    trainer.fit(tiny_dlrm(40), datamodule=data, ckpt_path=ckpt_path)
    return callback


def test_resume_never_deletes_outside_the_checkpoint_directory(tmp_path: Path) -> None:
    first = fit(tmp_path, 2, key=KEY)
    ck = tmp_path / "ck"
    assert "signature" in json.loads((ck / "last.ckpt" / MANIFEST_FILE).read_text())
    victim = tmp_path / "victim.ckpt"  # this package's own checkpoint: deletable if reached
    make_checkpoint(victim)
    elsewhere = tmp_path / "elsewhere"
    make_checkpoint(elsewhere / "x.ckpt")
    (ck / "link").symlink_to(elsewhere)  # a path inside ck that resolves outside it

    resume = tmp_path / "resume.ckpt"
    shutil.copytree(first.best_model_path, resume)
    meta = load_meta(resume)
    (state,) = meta["callbacks"].values()
    sneaky = str(ck / ".." / "victim.ckpt")  # Lightning's own check is lexical: it passes
    state.update(
        best_model_path=sneaky,
        kth_best_model_path=sneaky,
        best_k_models={sneaky: torch.tensor(1e9)},  # the worst score: retired first
        last_model_path=str(ck / "link" / "x.ckpt"),
    )
    (resume / "meta.pt").write_bytes(torch_bytes(meta))
    restamp(resume, "meta.pt")  # the attacker's consistent checksums, but no signature

    with pytest.raises(CheckpointSignatureError, match="signature does not match"):
        fit(tmp_path, 4, ckpt_path=resume, key=KEY)
    with pytest.warns(UserWarning, match="outside the callback's dirpath were dropped"):
        second = fit(tmp_path, 4, ckpt_path=resume)
    assert is_sharded_checkpoint(victim) and is_sharded_checkpoint(elsewhere / "x.ckpt")
    assert second.best_k_models and all(Path(p).parent == ck for p in second.best_k_models)


def test_restored_paths_inside_the_directory_are_kept(tmp_path: Path) -> None:
    callback = ModelCheckpoint(dirpath=tmp_path / "ck")
    inside, outside = str(tmp_path / "ck" / "a.ckpt"), str(tmp_path / "b.ckpt")
    state = {
        "best_model_path": inside,
        "last_model_path": outside,
        "kth_best_model_path": str(tmp_path / "ck"),  # the directory itself: never deleted
        "best_k_models": {inside: 1.0, outside: 2.0},
    }
    meta = {"callbacks": {callback.state_key: state}}
    dropped = confine_restored_callbacks(meta, SimpleNamespace(callbacks=[callback]))
    assert len(dropped) == 3
    assert state["best_model_path"] == inside and state["best_k_models"] == {inside: 1.0}
    assert state["last_model_path"] == state["kth_best_model_path"] == ""


@pytest.mark.parametrize("odd", ["a\x00b.ckpt", "\ud800.ckpt"])
def test_restored_paths_no_file_system_can_hold_are_dropped(tmp_path: Path, odd: str) -> None:
    # A NUL or a lone surrogate made resolving the path raise a bare ValueError on resume.
    callback = ModelCheckpoint(dirpath=tmp_path / "ck")
    bad = str(tmp_path / "ck" / odd)
    state = {"best_model_path": bad, "best_k_models": {bad: 1.0}}
    meta = {"callbacks": {callback.state_key: state}}
    dropped = confine_restored_callbacks(meta, SimpleNamespace(callbacks=[callback]))
    assert len(dropped) == 2 and state["best_model_path"] == "" and state["best_k_models"] == {}


# ------------------------------------------------------------------ 7: deletes only its own


def user_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    return path


def test_save_leaves_directories_named_like_its_own_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.ckpt"
    partial, old = (
        user_dir(tmp_path / ".model.ckpt.partial"),
        user_dir(tmp_path / ".model.ckpt.old"),
    )
    make_checkpoint(path, seed=1)
    make_checkpoint(path, seed=2)  # replaces model.ckpt
    assert load_meta(path)["global_step"] == 1 and (partial / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".model.ckpt.old", ".model.ckpt.partial", "model.ckpt"]
    )
    monkeypatch.setattr(files, "USE_RENAME_EXCHANGE", False)  # the fallback parks the old at .old
    before = fingerprint(path)
    with pytest.raises(FileExistsError, match=r"\.model\.ckpt\.old"):
        make_checkpoint(path, seed=3)
    assert fingerprint(path) == before and (old / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".model.ckpt.old", ".model.ckpt.partial", "model.ckpt"]
    )


def test_a_checkpoint_holding_foreign_files_is_never_deleted(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    make_checkpoint(path)
    (path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        make_checkpoint(path, seed=1)
    with pytest.warns(UserWarning, match="not deleted"):
        remove_checkpoint(path)  # what a ModelCheckpoint retiring it calls
    assert (path / "notes.txt").read_text() == "mine" and is_sharded_checkpoint(path)
    (path / "notes.txt").unlink()
    remove_checkpoint(path)
    assert not path.exists()


@pytest.mark.parametrize("forged", ["copied", "listing_the_users_files"])
def test_a_manifest_claiming_our_writer_proves_nothing(tmp_path: Path, forged: str) -> None:
    real = tmp_path / "real.ckpt"
    make_checkpoint(real)
    user = user_dir(tmp_path / "user.ckpt")
    (user / "data.csv").write_text("1,2")
    manifest = json.loads((real / MANIFEST_FILE).read_text())
    if forged != "copied":
        manifest["files"] = {n: file_checksum(user / n) for n in ("notes.txt", "data.csv")}
    (user / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(FileExistsError, match="did not write"):
        make_checkpoint(user)
    with pytest.warns(UserWarning, match="not deleted"):
        remove_checkpoint(user)
    assert (user / "notes.txt").read_text() == "mine" and (user / "data.csv").exists()


def test_an_interrupted_save_elsewhere_is_named_not_deleted(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    stale = user_dir(tmp_path / ".model.ckpt.partial-0123")  # another process's, or a user's
    with pytest.warns(UserWarning, match="interrupted save"):
        make_checkpoint(path)
    assert (stale / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------ 9: the command lines


def run_main(main: Any, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return int(exit_info.value.code or 0), err


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "in" / "model.ckpt"
    make_checkpoint(path)
    return path


def test_cli_never_writes_into_its_input(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = fingerprint(ckpt)
    for out in (ckpt, ckpt / "meta.pt", ckpt / "plain.safetensors", ckpt / "sub" / "x.pt"):
        code, err = run_main(consolidate_main, capsys, str(ckpt), str(out))
        assert code == 2 and "inside the checkpoint" in err, err
        code, err = run_main(
            export_main, capsys, str(ckpt), str(out), "--module", "torch.nn.Linear"
        )
        assert code == 2 and "inside the checkpoint" in err, err
    assert fingerprint(ckpt) == before and not (ckpt / "sub").exists()


def test_cli_overwrites_only_when_asked(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plain.safetensors"
    out.write_text("precious")
    code, err = run_main(consolidate_main, capsys, str(ckpt), str(out))
    assert code == 2 and "--overwrite" in err and out.read_text() == "precious"
    consolidate_main([str(ckpt), str(out), "--overwrite"])
    assert out.stat().st_size > 100


def test_cli_leaves_nothing_behind_when_it_fails(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = consolidate_module.iter_plain_tensors

    def dies_midway(*args: Any, **kwargs: Any) -> Any:
        for i, item in enumerate(real(*args, **kwargs)):
            if i == 2:
                raise CheckpointCorruptError("a chunk file changed while it was read")
            yield item

    monkeypatch.setattr(consolidate_module, "iter_plain_tensors", dies_midway)
    for name in ("plain.safetensors", "plain.pt"):
        code, err = run_main(consolidate_main, capsys, str(ckpt), str(out_dir / name))
        assert code == 2 and "changed while it was read" in err
    monkeypatch.undo()
    raw = bytearray((ckpt / "__0_0.distcp").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (ckpt / "__0_0.distcp").write_bytes(bytes(raw))
    code, err = run_main(consolidate_main, capsys, str(ckpt), str(out_dir / "plain.safetensors"))
    assert code == 2 and "CheckpointCorruptError" in err and "__0_0.distcp" in err
    assert list(out_dir.iterdir()) == []


def test_export_module_must_be_a_module_class(ckpt: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    meta = load_meta(ckpt)
    meta["hyper_parameters"] = {"args": ["touch", str(marker)]}  # Popen(**hparams) would run it
    (ckpt / "meta.pt").write_bytes(torch_bytes(meta))
    restamp(ckpt, "meta.pt")
    for module in ("subprocess.Popen", "collections.OrderedDict"):
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_torchrec.export", str(ckpt), str(tmp_path / "o.pt2")]
            + ["--module", module],
            cwd=ROOT,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert "not a LightningModule (or torch.nn.Module) subclass" in proc.stderr
        assert not marker.exists() and not list(tmp_path.glob("o.pt2*"))
        if module == "subprocess.Popen":
            break  # one interpreter start is enough to show the exit; the rest in process
    with pytest.raises(TypeError, match="not a LightningModule"):
        export(ckpt, "collections.OrderedDict")
    assert not marker.exists()


# ------------------------------------------------------------------ signed manifests


def test_signed_manifests_refuse_unsigned_and_foreign_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    signed, unsigned = tmp_path / "signed.ckpt", tmp_path / "unsigned.ckpt"
    make_checkpoint(signed, key=KEY)
    make_checkpoint(unsigned)
    manifest = json.loads((signed / MANIFEST_FILE).read_text())
    assert manifest["signature"]["alg"] == "hmac-sha256"
    assert all("sha256" in entry for entry in manifest["files"].values())
    model, opt = small_model(seed=4)
    assert load_sharded(signed, model, [opt], key=KEY)["global_step"] == 1
    assert load_sharded(signed, model, [opt])["global_step"] == 1  # no key: CRC-32 only
    with pytest.raises(CheckpointSignatureError, match="signature does not match"):
        load_sharded(signed, model, [opt], key=b"another key, 16 bytes or more")
    with pytest.raises(CheckpointSignatureError, match="not signed"):
        load_sharded(unsigned, model, [opt], key=KEY)
    raw = bytearray((signed / "__0_0.distcp").read_bytes())
    raw[-100] ^= 0xFF  # changed, and restamped by someone without the key
    (signed / "__0_0.distcp").write_bytes(bytes(raw))
    restamp(signed, "__0_0.distcp")
    with pytest.raises(CheckpointSignatureError):
        load_sharded(signed, model, [opt], key=KEY)
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))  # a team's policy for every load
    with pytest.raises(CheckpointSignatureError, match="not signed"):
        load_sharded(unsigned, model, [opt])
    monkeypatch.delenv(KEY_FILE_ENV)
    out = tmp_path / "plain.safetensors"
    code, err = run_main(
        consolidate_main, capsys, str(unsigned), str(out), "--key-file", str(key_file)
    )
    assert code == 2 and "CheckpointSignatureError" in err and not out.exists()
    with pytest.raises(ValueError, match="at least 16"):
        load_sharded(signed, model, [opt], key=b"short")


@pytest.mark.parametrize("mac", ["\u00e9" * 64, "\ud800" * 64, 7])
def test_a_forged_signature_of_any_text_is_refused_by_name(tmp_path: Path, mac: object) -> None:
    signed = tmp_path / "signed.ckpt"
    make_checkpoint(signed, key=KEY)
    manifest = json.loads((signed / MANIFEST_FILE).read_text())
    manifest["signature"]["mac"] = mac  # hmac.compare_digest refuses non-ASCII text itself
    (signed / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointSignatureError, match="signature does not match"):
        load_sharded(signed, small_model()[0], [], key=KEY)
