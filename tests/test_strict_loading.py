"""``LightningModule.strict_loading = False`` with sharded checkpoints (one process).

As under Lightning's own strategies (``load_state_dict(strict=False)``): a layer added since the
save keeps its values, one removed since is ignored, and a tensor in both with another shape is
still refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_torchrec import DLRMClickModule, SyntheticClickData, TorchRecStrategy
from lightning_torchrec.errors import CheckpointMismatchError
from tests.scripts.factory import adam, cpu_trainer, table_wise, tiny_data, tiny_dlrm

ROWS = 60
EBC = "model_and_loss.model.sparse_arch.embedding_bag_collection.embedding_bags"
NEW = ["extra.weight", "extra.bias"]
SIDE = "side.embedding_bags.t_side.weight"


class Wider(DLRMClickModule):
    """A dense layer added since the save (trained: a term of the loss)."""

    def __init__(self, *args: Any, lenient: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra = torch.nn.Linear(2, 2)
        self.strict_loading = not lenient

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 0.0 * self.extra.weight.sum()


class Lenient(DLRMClickModule):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.strict_loading = False


class WithSideTable(Lenient):
    """A table added since the save, in a collection of its own (not read by this model)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = EmbeddingBagConfig(
            name="t_side", embedding_dim=4, num_embeddings=ROWS, feature_names=["side"]
        )
        self.side = EmbeddingBagCollection(tables=[config], device=torch.device("meta"))


def data() -> SyntheticClickData:
    return tiny_data(ROWS, batch_size=16, train_batches=6)


def trainer(root: Path, side: bool = False, **kwargs: Any) -> L.Trainer:
    # The side table reads no feature of the batches: not checked against them.
    tables = table_wise(["t_cat_0", "t_cat_1", *(["t_side"] if side else [])])
    strategy = TorchRecStrategy(constraints=tables, log_plan=False, validate_batches=not side)
    defaults: dict[str, Any] = dict(max_steps=3, limit_val_batches=0, default_root_dir=root)
    return cpu_trainer(strategy, **(defaults | kwargs))


def plain(module: L.LightningModule) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in module.state_dict().items():
        if hasattr(v, "local_shards"):  # one rank: one shard holds the table
            (shard,) = v.local_shards()
            v = shard.tensor
        out[k] = v.detach().clone()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("fit")
    model = tiny_dlrm(ROWS, **adam())
    t = trainer(root)
    t.fit(model, datamodule=data())
    t.save_checkpoint(root / "done.ckpt")
    return root / "done.ckpt", plain(model)


def test_an_added_layer_keeps_its_values_and_the_rest_loads(saved, tmp_path: Path) -> None:
    ckpt, expected = saved
    model = tiny_dlrm(ROWS, cls=Wider, **adam())
    extra = model.extra.weight.detach().clone()
    with pytest.warns(UserWarning, match=re.escape(f"not in the checkpoint: {NEW}")):
        trainer(tmp_path, limit_val_batches=1).validate(model, datamodule=data(), ckpt_path=ckpt)
    got = plain(model)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert torch.equal(got["extra.weight"], extra)
    # A fit resumes too: the new layer starts with fresh optimizer state.
    resumed = trainer(tmp_path, max_steps=5)
    with pytest.warns(UserWarning, match="not in the checkpoint"):
        resumed.fit(tiny_dlrm(ROWS, cls=Wider, **adam()), datamodule=data(), ckpt_path=ckpt)
    assert resumed.global_step == 5
    # strict_loading left at its default: refused, as before.
    with pytest.raises(CheckpointMismatchError, match="extra.weight"):
        strict = tiny_dlrm(ROWS, cls=Wider, lenient=False, **adam())
        trainer(tmp_path).validate(strict, datamodule=data(), ckpt_path=ckpt)


def test_an_added_table_keeps_its_rows_and_fused_state(saved, tmp_path: Path) -> None:
    ckpt, expected = saved
    model = tiny_dlrm(ROWS, cls=WithSideTable, **adam())
    t = trainer(tmp_path, side=True, max_steps=4)
    with pytest.warns(UserWarning, match=re.escape(f"checkpoint: ['{SIDE}']")):
        t.fit(model, datamodule=data(), ckpt_path=ckpt)
    assert t.global_step == 4
    fresh = tiny_dlrm(ROWS, cls=WithSideTable, **adam())
    with pytest.warns(UserWarning, match="t_side"):
        trainer(tmp_path, side=True).validate(fresh, datamodule=data(), ckpt_path=ckpt)
    got = plain(fresh)
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_a_table_of_another_shape_is_refused_even_when_not_strict(saved, tmp_path: Path) -> None:
    ckpt, _ = saved
    model = tiny_dlrm([ROWS + 1, ROWS], cls=Lenient, **adam())
    with pytest.raises(CheckpointMismatchError, match=r"t_cat_0.*checkpoint \[60, 4\]"):
        trainer(tmp_path).validate(model, datamodule=data(), ckpt_path=ckpt)


def test_a_removed_layer_is_ignored(tmp_path: Path) -> None:
    wide = tiny_dlrm(ROWS, cls=Wider, **adam())
    t = trainer(tmp_path)
    t.fit(wide, datamodule=data())
    t.save_checkpoint(tmp_path / "wide.ckpt")
    model = tiny_dlrm(ROWS, cls=Lenient, **adam())
    resumed = trainer(tmp_path, max_steps=5)
    with pytest.warns(UserWarning, match=re.escape("but in the checkpoint: ['extra.bias', 'ex")):
        resumed.fit(model, datamodule=data(), ckpt_path=tmp_path / "wide.ckpt")
    assert resumed.global_step == 5


def test_load_from_checkpoint_follows_strict_loading(saved) -> None:
    ckpt, expected = saved
    with pytest.warns(UserWarning, match=re.escape(f"not in the checkpoint: {NEW}")):
        model = Wider.load_from_checkpoint(ckpt)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    with pytest.raises(CheckpointMismatchError, match="extra.weight"):
        Wider.load_from_checkpoint(ckpt, strict=True)
    with pytest.raises(CheckpointMismatchError, match="extra.weight"):
        Wider.load_from_checkpoint(ckpt, lenient=False)  # its strict_loading


class Annotated(DLRMClickModule):
    """Adds a key of its own to every checkpoint and records what it gets back."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["mine"] = {"vocabulary": ["a", "b"], "counts": torch.arange(3)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.got = checkpoint.get("mine")


def test_load_from_checkpoint_calls_on_load_checkpoint(tmp_path: Path) -> None:
    model = tiny_dlrm(ROWS, cls=Annotated, **adam())
    t = trainer(tmp_path)
    t.fit(model, datamodule=data())
    t.save_checkpoint(tmp_path / "mine.ckpt")
    loaded = Annotated.load_from_checkpoint(tmp_path / "mine.ckpt")
    assert loaded.got["vocabulary"] == ["a", "b"]
    assert torch.equal(loaded.got["counts"], torch.arange(3))
