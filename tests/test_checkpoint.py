"""Single-process (world size 1) tests of sharded checkpoints: safety, atomicity, consolidation."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_torchrec import (
    DLRMClickModule,
    SyntheticClickData,
    TorchRecStrategy,
    combine_optimizers,
    dense_parameters,
)
from lightning_torchrec.checkpoint import META_FILE, is_sharded_checkpoint, load_unsharded
from lightning_torchrec.checkpoint.consolidate import (
    consolidate,
    load_plain_weights,
    main,
    read_plain,
)
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE, file_checksum
from lightning_torchrec.checkpoint.outputs import OwnedTemp
from lightning_torchrec.errors import CheckpointMismatchError, UnsafeCheckpointError
from lightning_torchrec.export.artifact import export
from lightning_torchrec.lightning.preemption import PreemptionCheckpoint
from lightning_torchrec.training.optim import optimizer_steps, set_optimizer_steps
from tests.scripts.factory import (
    adam,
    cpu_trainer,
    sharding_constraints,
    table_wise,
    tiny_data,
    tiny_dlrm,
)
from tests.scripts.hostile import restamp

ROWS = 60


def data(tables: int = 2) -> SyntheticClickData:
    return tiny_data(ROWS, tables, batch_size=16, train_batches=6)


def dlrm(rows: list[int] | None = None, dim: int = 4) -> DLRMClickModule:
    return tiny_dlrm(rows or ROWS, embedding_dim=dim, **adam(1e-2))


def trainer(root: Path, tables: int = 2, **kwargs: Any) -> L.Trainer:
    strategy = TorchRecStrategy(constraints=table_wise(tables), log_plan=False)
    defaults: dict[str, Any] = dict(max_steps=3, limit_val_batches=0, default_root_dir=root)
    return cpu_trainer(strategy, **(defaults | kwargs))


def plain_state(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """World size 1: every table has one local shard holding all of it."""
    out = {}
    for k, v in module.state_dict().items():
        if hasattr(v, "local_shards"):
            (shard,) = v.local_shards()
            v = shard.tensor
        out[k] = v.detach().clone()
    return out


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("fit")
    model = dlrm()
    t = trainer(root)
    t.fit(model, datamodule=data())
    set_optimizer_steps(t.optimizers[0], 17)
    t.save_checkpoint(root / "done.ckpt")
    return root / "done.ckpt", plain_state(model)


def test_checkpoint_restores_fused_step_counter(fitted, tmp_path: Path) -> None:
    ckpt, _ = fitted
    model = dlrm()
    t = trainer(tmp_path, max_steps=3)
    t.fit(model, datamodule=data(), ckpt_path=ckpt)  # already at max_steps: restores only
    steps = optimizer_steps(t.optimizers[0])
    assert steps and set(steps) == {17}


def test_consolidate_streams_plain_state_dict_and_command(fitted, tmp_path: Path) -> None:
    ckpt, expected = fitted
    out = consolidate(ckpt, tmp_path / "model.safetensors")
    got = read_plain(out)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    # The file is real safetensors: the reference library reads the same tensors.
    from safetensors.torch import load_file

    reference = load_file(str(out))
    assert set(reference) == set(got) and all(torch.equal(reference[k], got[k]) for k in got)
    main([str(ckpt), str(tmp_path / "model.pt")])
    as_pt = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(as_pt) == set(expected) and all(torch.equal(as_pt[k], v) for k, v in got.items())
    table = (
        "model_and_loss.model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_1.weight"
    )
    assert list(read_plain(out, [table])) == [table]
    # The plain file serves an unsharded model in one process.
    plain = dlrm()
    plain.model_and_loss.model.sparse_arch.embedding_bag_collection.to_empty(device="cpu")
    plain.load_state_dict(as_pt)
    assert torch.equal(plain.state_dict()[table], expected[table])


def test_plain_weights_initialise_a_sharded_model(fitted, tmp_path: Path) -> None:
    ckpt, expected = fitted
    out = consolidate(ckpt, tmp_path / "model.safetensors")
    model = dlrm()
    t = trainer(tmp_path)
    t.validate(model, datamodule=data(), verbose=False)  # shards the model
    assert not torch.equal(plain_state(model)[next(iter(expected))], expected[next(iter(expected))])
    loaded = load_plain_weights(model, out)
    assert set(loaded) == set(expected)
    for k, v in plain_state(model).items():
        assert torch.equal(v, expected[k]), k
    with pytest.raises(ValueError, match="t_cat_2"):
        load_plain_weights(model, {**expected, "x.embedding_bags.t_cat_2.weight": torch.ones(1)})


def test_checkpoint_of_another_model_fails_naming_tables(fitted, tmp_path: Path) -> None:
    ckpt, _ = fitted
    model = dlrm([ROWS + 1, ROWS, ROWS])
    with pytest.raises(CheckpointMismatchError) as err:
        trainer(tmp_path, tables=3).validate(model, datamodule=data(3), ckpt_path=ckpt)
    msg = str(err.value)
    assert "missing from the checkpoint" in msg and "t_cat_2" in msg
    (shapes,) = [line for line in msg.splitlines() if line.startswith("- shapes differ")]
    assert "'t_cat_0'" in shapes and "checkpoint [60, 4], target [61, 4]" in shapes
    assert "'t_cat_1'" not in shapes


def test_metadata_carrying_code_is_refused(fitted, tmp_path: Path) -> None:
    import shutil

    ckpt, _ = fitted
    bad = tmp_path / "bad.ckpt"
    shutil.copytree(ckpt, bad)
    meta = torch.load(bad / META_FILE, weights_only=True)
    meta["payload"] = print  # a pickled callable: loading it could run code
    torch.save(meta, bad / META_FILE)
    written = json.loads((bad / MANIFEST_FILE).read_text())  # checksums that match, as an
    written["files"][META_FILE] = file_checksum(bad / META_FILE)  # attacker would write them
    (bad / MANIFEST_FILE).write_text(json.dumps(written))
    with pytest.raises(pickle.UnpicklingError, match="Refusing to load .*meta.pt"):
        trainer(tmp_path).validate(dlrm(), datamodule=data(), ckpt_path=bad)


def test_interrupted_save_keeps_the_previous_last_checkpoint(tmp_path: Path, monkeypatch) -> None:
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, every_n_train_steps=2)
    t = trainer(tmp_path, max_steps=2, callbacks=[ckpt_cb], enable_checkpointing=True)
    model = dlrm()
    t.fit(model, datamodule=data())
    last = tmp_path / "ck" / "last.ckpt"
    assert is_sharded_checkpoint(last)
    before = torch.load(last / META_FILE, weights_only=True)["global_step"]

    real_save = torch.save

    def dying_save(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        if str(getattr(f, "name", f)).endswith(META_FILE):
            raise KeyboardInterrupt("killed while writing")
        real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        t.save_checkpoint(last)
    monkeypatch.undo()
    (partial,) = (tmp_path / "ck").glob(".last.ckpt.partial-*")  # a fresh name per save
    assert partial.is_dir() and (partial / ".metadata").is_file()
    assert not is_sharded_checkpoint(partial)
    assert is_sharded_checkpoint(last)
    assert torch.load(last / META_FILE, weights_only=True)["global_step"] == before == 2
    # "last" resolves to the complete checkpoint, never to the partial one.
    t2 = trainer(
        tmp_path,
        max_steps=3,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck")],
        enable_checkpointing=True,
    )
    t2.fit(dlrm(), datamodule=data(), ckpt_path="last")
    assert t2.ckpt_path is not None and Path(t2.ckpt_path).name == "last.ckpt"
    assert t2.global_step == 3


def test_top_k_keeps_and_deletes_whole_directories(tmp_path: Path) -> None:
    ckpt_cb = ModelCheckpoint(
        dirpath=tmp_path / "ck",
        monitor="train/loss",
        save_top_k=2,
        every_n_train_steps=1,
        save_last=True,
    )
    t = trainer(tmp_path, max_steps=6, callbacks=[ckpt_cb], enable_checkpointing=True)
    t.fit(dlrm(), datamodule=data())
    entries = sorted(p.name for p in (tmp_path / "ck").iterdir())
    kept = sorted(Path(p).name for p in ckpt_cb.best_k_models)
    assert len(kept) == 2
    assert entries == sorted([*kept, "last.ckpt"]), entries  # nothing partial or half-deleted
    for name in entries:
        assert is_sharded_checkpoint(tmp_path / "ck" / name)


def test_a_url_is_a_local_path_or_refused_never_a_local_directory_named_like_it(
    fitted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning takes fsspec URLs for checkpoint paths; read as plain paths, ``memory://ck``
    (``s3://bucket/ck``) was the directory ``memory:/ck`` of the current directory."""
    ckpt, expected = fitted
    monkeypatch.chdir(tmp_path)
    remote = ModelCheckpoint(dirpath="memory://ck", every_n_train_steps=1)
    t = trainer(tmp_path, callbacks=[remote], enable_checkpointing=True)
    with pytest.raises(ValueError, match=r"^memory://ck is a memory:// URL; .*local file system"):
        t.fit(dlrm(), datamodule=data())
    assert t.global_step == 0  # refused before training
    with pytest.raises(ValueError, match="s3://bucket/p.ckpt is a s3:// URL"):
        PreemptionCheckpoint("s3://bucket/p.ckpt")
    t = trainer(tmp_path, max_steps=1)
    model = dlrm()
    t.validate(model, datamodule=data(), ckpt_path=f"file://{ckpt}", verbose=False)
    assert all(torch.equal(plain_state(model)[k], v) for k, v in expected.items())
    with pytest.raises(ValueError, match="memory://a.ckpt is a memory:// URL"):
        t.save_checkpoint("memory://a.ckpt")
    t.save_checkpoint(f"file://{tmp_path}/a.ckpt")
    assert is_sharded_checkpoint(tmp_path / "a.ckpt") and is_sharded_checkpoint(
        f"file://{tmp_path}/a.ckpt"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]  # no "memory:" or "file:"


def test_a_weights_only_checkpoint_says_so_when_a_fit_resumes_from_it(tmp_path: Path) -> None:
    only = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_weights_only=True)
    trained = dlrm()
    trainer(tmp_path, callbacks=[only], enable_checkpointing=True).fit(trained, datamodule=data())
    (ckpt,) = (tmp_path / "ck").iterdir()
    with pytest.raises(CheckpointMismatchError) as err:
        trainer(tmp_path, max_steps=5).fit(dlrm(), datamodule=data(), ckpt_path=ckpt)
    assert str(err.value) == (
        f"{ckpt} holds no state of optimizer 0 (saved with weights only, e.g. "
        "ModelCheckpoint(save_weights_only=True)), so a fit cannot resume from it. To train on "
        "from its weights, load them first with the same Trainer (`trainer.validate(model, "
        "ckpt_path=...)`), then `trainer.fit(model)`."
    )
    # what the message says works: the weights loaded, then trained on
    model, again = dlrm(), trainer(tmp_path, max_steps=2)
    again.validate(model, datamodule=data(), ckpt_path=ckpt)
    loaded = plain_state(model)
    for name, value in plain_state(trained).items():
        assert torch.equal(loaded[name], value), name
    again.fit(model, datamodule=data())
    assert again.global_step == 2


def test_evaluating_a_checkpoint_after_fit_restores_weights_only(tmp_path: Path) -> None:
    # On the Trainer that just ran fit: a weights-only checkpoint evaluates, and a full one
    # leaves the live optimizers' state (dense and fused) as the fit left it.
    only = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_weights_only=True)
    model = dlrm()
    t = trainer(tmp_path, callbacks=[only], enable_checkpointing=True)
    t.fit(model, datamodule=data())
    (ckpt,) = (tmp_path / "ck").iterdir()
    full = tmp_path / "full.ckpt"
    t.save_checkpoint(full)
    opt = t.optimizers[0]
    opt.step()  # the live state now differs from both checkpoints'
    before = {k: v.clone() for k, v in plain_state_of(opt).items()}
    t.validate(model, datamodule=data(), ckpt_path=ckpt, verbose=False)
    assert t.test(model, datamodule=data(), ckpt_path=full, verbose=False)[0]["test/loss"] > 0
    after = plain_state_of(opt)
    assert before.keys() == after.keys() and before
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def plain_state_of(optimizer: Any) -> dict[str, torch.Tensor]:
    """An optimizer's state as plain tensors (world size 1: one local shard each)."""
    flat = {}
    for param, states in optimizer.state_dict()["state"].items():
        for name, value in states.items():
            if hasattr(value, "local_shards"):
                (shard,) = value.local_shards()
                value = shard.tensor
            if isinstance(value, torch.Tensor):
                flat[f"{param}.{name}"] = value
    return flat


class WithUnusedHead(DLRMClickModule):
    """A dense layer outside the loss (a head not trained yet): it never gets a gradient."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unused = torch.nn.Linear(3, 1)


def test_a_dense_parameter_without_gradients_resumes_without_optimizer_state(
    tmp_path: Path,
) -> None:
    def fit(steps: int, ckpt: Path | None = None) -> tuple[L.Trainer, DLRMClickModule]:
        L.seed_everything(5)
        model = tiny_dlrm(ROWS, embedding_dim=4, cls=WithUnusedHead, **adam(1e-2))
        t = trainer(tmp_path, max_steps=steps)
        t.fit(model, datamodule=data(), ckpt_path=ckpt)
        return t, model

    part, _ = fit(2)
    part.save_checkpoint(tmp_path / "part.ckpt")
    resumed, model = fit(5, tmp_path / "part.ckpt")
    whole, reference = fit(5)
    assert resumed.global_step == 5
    expected = plain_state(reference)
    for name, value in plain_state(model).items():
        assert torch.equal(value, expected[name]), name
    for t in (part, resumed, whole):  # never stepped: no state, as in any torch optimizer
        assert not any(k.startswith("dense.unused.") for k in plain_state_of(t.optimizers[0]))
    assert (
        plain_state_of(resumed.optimizers[0]).keys() == plain_state_of(whole.optimizers[0]).keys()
    )


def test_optimizer_state_saved_under_other_names_is_refused_not_dropped(
    fitted, tmp_path: Path
) -> None:
    # Saved with a dense Adam and fused tables. A dense SGD with momentum finds no
    # momentum_buffer, and a table planned data-parallel now finds its state in the fused part:
    # both were stepped, so their state is missing, not absent (unlike a never-stepped head).
    ckpt, _ = fitted
    sgd = tiny_dlrm(
        ROWS, embedding_dim=4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)
    )
    with pytest.raises(CheckpointMismatchError, match="momentum_buffer") as err:
        trainer(tmp_path, max_steps=4).fit(sgd, datamodule=data(), ckpt_path=ckpt)
    assert "load_optimizer_states=False" in str(err.value)
    replicated = TorchRecStrategy(
        constraints=sharding_constraints({"t_cat_0": "data_parallel", "t_cat_1": "table_wise"}),
        log_plan=False,
    )
    t = cpu_trainer(replicated, max_steps=4, limit_val_batches=0, default_root_dir=tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"missing .*tables \['t_cat_0'\]"):
        t.fit(dlrm(), datamodule=data(), ckpt_path=ckpt)


class BuildRecorder(DLRMClickModule):
    """Records the device each construction's new tensors go to (meta: no memory)."""

    built: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        BuildRecorder.built.append(torch.empty(0).device.type)
        super().__init__(*args, **kwargs)


def test_hyper_parameters_of_a_stranger_are_checked_before_memory_is_taken(
    fitted, tmp_path: Path
) -> None:
    ckpt, _ = fitted
    bad = tmp_path / "wide.ckpt"
    shutil.copytree(ckpt, bad)
    meta = torch.load(bad / META_FILE, weights_only=True)
    width = 1 << 20  # a 2**40-element dense layer, were it built
    meta["hyper_parameters"] |= {"num_dense_features": width, "dense_arch_layer_sizes": [width, 4]}
    torch.save(meta, bad / META_FILE)
    restamp(bad, META_FILE)
    BuildRecorder.built = []
    with pytest.raises(CheckpointMismatchError, match="shapes differ: .*dense_arch"):
        BuildRecorder.load_from_checkpoint(bad)
    assert BuildRecorder.built == ["meta"]  # refused before the real build
    BuildRecorder.built = []
    loaded = BuildRecorder.load_from_checkpoint(ckpt)  # the checkpoint's own: built for real
    assert BuildRecorder.built == ["meta", "cpu"] and isinstance(loaded, BuildRecorder)


def test_a_checkpoint_lightning_cli_wrote_loads_by_class(fitted, tmp_path: Path) -> None:
    """LightningCLI (the demo) saves how it built the module with its arguments; the
    documented ``DLRMClickModule.load_from_checkpoint(dir)`` passed that on as an argument."""
    ckpt, expected = fitted
    cli = tmp_path / "cli.ckpt"
    shutil.copytree(ckpt, cli)
    meta = torch.load(cli / META_FILE, weights_only=True)
    meta["hyper_parameters"]["_instantiator"] = "lightning.pytorch.cli.instantiate_module"
    torch.save(meta, cli / META_FILE)
    restamp(cli, META_FILE)
    loaded = DLRMClickModule.load_from_checkpoint(cli)
    assert "_instantiator" not in loaded.hparams
    got = loaded.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], v) for k, v in expected.items())


def test_a_file_url_dirpath_lightning_made_a_relative_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's ``ModelCheckpoint`` runs a ``file://`` dirpath through ``os.path.realpath``:
    ``file:///abs/ck`` became ``./file:/abs/ck``, where every checkpoint of the fit went."""
    monkeypatch.chdir(tmp_path)
    callback = ModelCheckpoint(dirpath=f"file://{tmp_path}/ck", every_n_train_steps=1)
    assert callback.dirpath == f"{tmp_path}/file:{tmp_path}/ck"  # Lightning's own doing
    t = trainer(tmp_path, callbacks=[callback], enable_checkpointing=True)
    with pytest.raises(ValueError, match=r"holds a directory named 'file:': a file:// URL"):
        t.fit(dlrm(), datamodule=data())
    assert t.global_step == 0 and list(tmp_path.iterdir()) == []


def test_one_process_tools_read_a_file_url_as_its_path_and_refuse_other_urls(
    fitted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_unsharded``, ``consolidate``, ``export`` and ``load_from_checkpoint`` took a URL as
    a plain path: ``file:///dir`` raised ``FileNotFoundError`` (``IsADirectoryError`` from
    ``load_from_checkpoint``), and an ``s3://`` output was written to a local directory ``s3:``."""
    ckpt, expected = fitted
    monkeypatch.chdir(tmp_path)
    url = f"file://{ckpt}"
    for model in (load_unsharded(url, dlrm()), DLRMClickModule.load_from_checkpoint(url)):
        got = model.state_dict()
        assert set(got) == set(expected) and all(
            torch.equal(got[k], v) for k, v in expected.items()
        )
    assert consolidate(url, f"file://{tmp_path}/plain.pt") == tmp_path / "plain.pt"
    export(url, dlrm(), f"file://{tmp_path}/m.ts", dtype="fp32", format="torchscript")
    refused = (
        lambda: load_unsharded("s3://bucket/ck", dlrm()),
        lambda: consolidate(ckpt, "s3://bucket/plain.pt"),
        lambda: export(ckpt, dlrm(), "s3://bucket/m.ts", dtype="fp32", format="torchscript"),
    )
    for call in refused:
        with pytest.raises(ValueError, match=r"^s3://bucket/\S+ is a s3:// URL"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ts", "m.ts.json", "plain.pt"]


def test_weights_only_false_given_to_the_trainer_reaches_the_load(fitted, tmp_path: Path) -> None:
    """The documented way to load one's own checkpoint whose ``meta.pt`` holds objects (here a
    table config among the hyper-parameters): Lightning 2.6 does not pass ``weights_only`` on to
    a strategy that restores after setup, so it was refused either way."""
    ckpt, expected = fitted
    own = tmp_path / "own.ckpt"
    shutil.copytree(ckpt, own)
    meta = torch.load(own / META_FILE, weights_only=True)
    table = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=ROWS, feature_names=["f"])
    meta["hyper_parameters"]["table"] = table
    torch.save(meta, own / META_FILE)
    restamp(own, META_FILE)
    with pytest.raises(UnsafeCheckpointError, match="EmbeddingBagConfig"):
        trainer(tmp_path).fit(dlrm(), datamodule=data(), ckpt_path=own)
    resumed = trainer(tmp_path, max_steps=4)
    resumed.fit(dlrm(), datamodule=data(), ckpt_path=own, weights_only=False)
    assert resumed.global_step == 4
    model = dlrm()
    trainer(tmp_path).validate(model, datamodule=data(), ckpt_path=own, weights_only=False)
    assert all(torch.equal(plain_state(model)[k], v) for k, v in expected.items())


class TwoOptimizers(DLRMClickModule):
    """Manual optimization: the model's optimizer, and plain SGD with momentum on a side head."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self.side = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        main, side = self.optimizers()
        loss, _ = self(batch)
        loss = loss + (self.side(batch.dense_features[:, :2]) ** 2).mean()
        main.zero_grad()
        side.zero_grad()
        self.manual_backward(loss)
        main.step()
        side.step()
        return loss

    def configure_optimizers(self) -> Any:
        side = {id(p) for p in self.side.parameters()}
        dense = [p for p in dense_parameters(self) if id(p) not in side]
        main = combine_optimizers(torch.optim.Adam(dense, lr=1e-2), self)
        return [main, torch.optim.SGD(self.side.parameters(), lr=0.1, momentum=0.9)]


def test_a_second_optimizer_of_manual_optimization_is_checkpointed_and_resumed(
    tmp_path: Path,
) -> None:
    def fit(steps: int, ckpt: Path | None = None) -> tuple[L.Trainer, TwoOptimizers]:
        L.seed_everything(5)
        model = tiny_dlrm(ROWS, embedding_dim=4, cls=TwoOptimizers)
        t = trainer(tmp_path, max_steps=steps)
        t.fit(model, datamodule=data(), ckpt_path=ckpt)
        return t, model

    part, _ = fit(4)  # manual optimization: each optimizer's step counts
    part.save_checkpoint(tmp_path / "part.ckpt")
    resumed, model = fit(8, tmp_path / "part.ckpt")
    whole, reference = fit(8)
    assert resumed.global_step == whole.global_step == 8
    assert torch.equal(model.side.weight, reference.side.weight)
    momentum = [plain_state_of(t.optimizers[1]) for t in (resumed, whole)]
    assert momentum[0].keys() == momentum[1].keys() and momentum[0]
    for key, value in momentum[1].items():
        assert torch.equal(momentum[0][key], value), key


def test_command_outputs_get_the_mode_of_any_new_file(tmp_path: Path) -> None:
    # A consolidated file or an exported artifact is read by a server run by another account.
    umask = os.umask(0o027)
    try:
        with OwnedTemp(tmp_path / "model.pt2") as temp:
            assert temp.path.stat().st_mode & 0o777 == 0o600  # private while it is written
            temp.path.write_bytes(b"artifact")
        with pytest.raises(RuntimeError), OwnedTemp(tmp_path / "failed.pt2") as temp:
            raise RuntimeError("export failed")
    finally:
        os.umask(umask)
    assert (tmp_path / "model.pt2").stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"]


class BuiltInConfigureModel(L.LightningModule):
    """A user's model that builds its tables and layers in ``configure_model``, as Lightning
    recommends for large models (nothing but hyper-parameters in ``__init__``)."""

    def __init__(self, rows: int = ROWS) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.built = 0

    def configure_model(self) -> None:
        if hasattr(self, "ebc"):  # Lightning asks the hook to be idempotent
            return
        self.built += 1
        tables = [
            EmbeddingBagConfig(
                name=f"t_cat_{i}",
                embedding_dim=4,
                num_embeddings=self.hparams["rows"],
                feature_names=[f"cat_{i}"],
            )
            for i in range(2)
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.head = torch.nn.Linear(8 + 3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pooled = self.ebc(batch.sparse_features).values()
        logit = self.head(torch.cat([pooled, batch.dense_features], 1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logit, batch.labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def test_a_model_built_in_configure_model_loads_by_class_and_resumes(tmp_path: Path) -> None:
    # load_unsharded built the class without running configure_model: an empty model, and the
    # load failed with every tensor of the checkpoint "unexpected".
    model = BuiltInConfigureModel()
    fit = trainer(tmp_path)
    fit.fit(
        model, datamodule=tiny_data(ROWS, 2, batch_size=16, train_batches=6, num_dense_features=3)
    )
    fit.save_checkpoint(tmp_path / "late.ckpt")
    trained = plain_state(model)
    loaded = load_unsharded(tmp_path / "late.ckpt", BuiltInConfigureModel)
    assert loaded.built == 1 and sorted(loaded.state_dict()) == sorted(trained)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    again = BuiltInConfigureModel()  # an instance is configured before it is filled too
    assert load_unsharded(tmp_path / "late.ckpt", again) is again and again.built == 1
    assert torch.equal(again.head.weight, trained["head.weight"])
    # a fit resumes from it
    resumed = BuiltInConfigureModel()
    more = trainer(tmp_path, max_steps=4)
    more.fit(
        resumed,
        datamodule=tiny_data(ROWS, 2, batch_size=16, train_batches=6, num_dense_features=3),
        ckpt_path=tmp_path / "late.ckpt",
    )
    assert more.global_step == 4 and resumed.built == 1
