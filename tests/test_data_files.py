"""The file-backed data modules off the tested path: fits without validation files, resumes
after a limited epoch or under another layout, bad sizes, and malformed Criteo lines.

One process each; a Lightning Trainer trains a linear model on the batches' dense features,
which is all a data module's contract with the Trainer needs. The resumes run under
``TorchRecStrategy``, whose saved position is what a resumed epoch skips (``resumed_trainer``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.checkpoint import META_FILE
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE, file_checksum
from lightning_torchrec.data import CriteoDataModule, ParquetClickData, ResumableDataLoader
from lightning_torchrec.data.criteo import CriteoIterableDataset, parse_tsv, preprocess
from lightning_torchrec.data.criteo import main as criteo_main
from lightning_torchrec.data.parquet import ParquetClickDataset
from lightning_torchrec.lightning.mid_epoch import POSITION_KEY, loader_layout, resume_in_epoch

ROWS = 400


def write_parquet(path: Path, rows: int = ROWS, group: int = 40) -> Path:
    """Row ``i``: d0 = i, a = i % 50, label = i % 2."""
    i = np.arange(rows)
    table = pa.table({"d0": i * 1.0, "a": i % 50, "label": i % 2})
    pq.write_table(table, path / "p.parquet", row_group_size=group)
    return path / "p.parquet"


class Linear(L.LightningModule):
    """Trains a linear layer on the dense features; records each batch's first row."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, int(batch.dense_features[0, 0])))
        logits = self.layer(batch.dense_features / ROWS).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", self.layer(batch.dense_features).mean(), batch_size=len(batch.labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(root: Path, callbacks: list[Callback] = (), **kwargs: Any) -> L.Trainer:  # type: ignore[assignment]
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=root,
        **kwargs,
    )


def resumed_trainer(root: Path, callbacks: list[Callback] = (), **kwargs: Any) -> L.Trainer:  # type: ignore[assignment]
    """:func:`trainer` under ``TorchRecStrategy`` (no tables: the batches are not checked)."""
    return trainer(root, callbacks, strategy=TorchRecStrategy(validate_batches=False), **kwargs)


def trainer_at(epoch: int, batches: int, world_size: int) -> Any:
    """A trainer of ``world_size`` ranks restored ``batches`` batches into ``epoch``."""
    counts = dict(ready=batches, started=batches, processed=batches, completed=batches - 1)
    epoch_loop = SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(**counts)))
    progress = SimpleNamespace(current=SimpleNamespace(processed=epoch))
    loops = SimpleNamespace(epoch_progress=progress, epoch_loop=epoch_loop)
    return SimpleNamespace(fit_loop=loops, world_size=world_size)


def parquet_data(file: Path, **kwargs: Any) -> ParquetClickData:
    return ParquetClickData(str(file), ["d0"], ["a"], "label", batch_size=20, **kwargs)


def test_a_fit_without_validation_files_skips_validation(tmp_path: Path) -> None:
    """``val_paths=None`` means no validation: ``fit`` trains instead of failing in
    ``val_dataloader``; with validation files it validates."""
    file = write_parquet(tmp_path)
    model = Linear()
    fit = trainer(tmp_path, max_epochs=1, limit_train_batches=3)
    fit.fit(model, datamodule=parquet_data(file))
    assert [x for _, x in model.seen] == [0, 20, 40]
    assert "val" not in fit.callback_metrics
    fit = trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=2)
    fit.fit(Linear(), datamodule=parquet_data(file, val_paths=str(file)))
    assert "val" in fit.callback_metrics


def test_an_epoch_end_checkpoint_of_a_limited_epoch_resumes_the_next_epoch_whole(
    tmp_path: Path,
) -> None:
    """``limit_train_batches`` ends epochs before the loader's end; with ``max_steps`` Lightning
    restores the loader's state from a checkpoint written at such an epoch's end, which must
    then start the next epoch at its first batch, as the uninterrupted run does."""
    file = write_parquet(tmp_path)
    full = Linear()
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_epochs=1, save_top_k=-1)
    resumed_trainer(tmp_path, [every_epoch], max_steps=15, limit_train_batches=5).fit(
        full, datamodule=parquet_data(file)
    )
    assert [x for _, x in full.seen] == [0, 20, 40, 60, 80] * 3
    resumed = Linear()
    resumed_trainer(tmp_path, max_steps=15, limit_train_batches=5).fit(
        resumed, datamodule=parquet_data(file), ckpt_path=tmp_path / "ckpts/epoch=0-step=5.ckpt"
    )
    assert resumed.seen == full.seen[5:]


def test_a_mid_epoch_position_under_another_layout_skips_as_many_rows_with_a_warning(
    tmp_path: Path,
) -> None:
    """The batch order depends on the ranks, readers per rank and batch size: a position saved
    under one layout skips as many rows under another, with a warning naming the change (it
    skipped the same count of batches without a word); an epoch-end position, or a position
    without a layout (older checkpoints), is used as it is."""
    write_parquet(tmp_path)

    def loader(rank: int = 0, world: int = 1, workers: int = 0, batch: int = 20) -> Any:
        ds = ParquetClickDataset(
            str(tmp_path),
            ["d0"],
            ["a"],
            "label",
            batch_size=batch,
            rank=rank,
            world_size=world,
            num_workers=workers,
        )
        return ResumableDataLoader(ds, num_workers=workers)

    saved = loader(world=2)
    layout = loader_layout(saved)
    assert layout == {"readers_per_rank": 1, "batch_size": 20} and len(saved) == 10
    # what the strategy saves 3 batches into epoch 0 on 2 ranks
    position = {"epoch": 0, "batches": 3, "world_size": 2, "layout": layout, "epoch_batches": 10}
    for other, world, change, skip in (
        (loader(world=1), 1, "world_size 2 -> 1", 6),  # 3 batches of 20 rows on 2 ranks
        (loader(world=2, workers=2), 2, "readers_per_rank 1 -> 2", 3),
        (loader(world=2, batch=10), 2, "batch_size 20 -> 10", 6),
    ):
        with pytest.warns(UserWarning, match=rf"under another layout .*\({change}\)"):
            assert resume_in_epoch(other, position, trainer_at(0, 3, world), warn=True)
        assert other.skip_next == skip
    firsts = [int(b.dense_features[0, 0]) for b in loader(rank=1, world=2)]
    same = loader(rank=1, world=2, workers=1)  # 0 and 1 workers read in the same order
    assert resume_in_epoch(same, position, trainer_at(0, 3, 2), warn=True)
    assert [int(b.dense_features[0, 0]) for b in same] == firsts[3:]
    at_end = loader()  # the saved epoch was over: any layout starts the next one whole
    assert not resume_in_epoch(at_end, position | {"batches": 0}, trainer_at(0, 0, 1), warn=True)
    assert len(list(at_end)) == len(at_end) == 20
    legacy = loader()  # an older position, without a layout: the count as it is
    assert resume_in_epoch(legacy, {"epoch": 0, "batches": 3}, trainer_at(0, 3, 1), warn=True)
    assert int(next(iter(legacy)).dense_features[0, 0]) == 60


def test_table_and_batch_sizes_below_one_are_refused(tmp_path: Path) -> None:
    """A table size of 0 divided by zero (ids all 0, with a NumPy warning), a negative one
    made negative ids; a batch size of 0 failed with ZeroDivisionError."""
    write_parquet(tmp_path)
    for sizes, culprit in (([0], r"\[0\]"), ([-5], r"\[0\].*-5")):
        with pytest.raises(ValueError, match=f"num_embeddings_per_feature{culprit}"):
            ParquetClickDataset(
                str(tmp_path),
                ["d0"],
                ["a"],
                "label",
                batch_size=20,
                num_embeddings_per_feature=sizes,
            )
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        ParquetClickDataset(str(tmp_path), ["d0"], ["a"], "label", batch_size=0)


def criteo_line(cat_0: str = "ab", ints: list[str] | None = None, columns: int = 40) -> str:
    fields = ["1", *(ints or ["1"] * 13), cat_0, *["cd"] * 25]
    return "\t".join(fields[:columns])


def test_malformed_criteo_lines_are_named_by_file_and_line(tmp_path: Path) -> None:
    """A bad line deep in a file is named by the file and its line (a bad hex id was named by
    its row within a 16 MiB block, without the file; a short line by pyarrow's message only);
    a blank line is refused at its line, not after the whole file."""
    day = tmp_path / "day_0"
    good = [criteo_line()] * 60
    cases = [
        (criteo_line("zz"), r"day_0, line 51: column cat_0 holds 'zz': not a hex id"),
        (criteo_line("1" * 17), r"line 51: column cat_0 holds '1{17}': ids longer than 16 hex"),
        (criteo_line(columns=30), "day_0, line 51: expected 40 tab-separated columns, found 30"),
        (criteo_line(ints=["1.5"] * 13), r"day_0, line 51: column int_0 holds '1.5', not an int"),
        ("", r"day_0, line 51: expected 40 .*found 1 \(a blank line\)"),
    ]
    for bad, message in cases:
        day.write_text("\n".join(good[:50] + [bad] + good[50:]) + "\n")
        with pytest.raises(ValueError, match=message):
            for _ in parse_tsv(day, block_size=1000):  # several blocks before line 51
                pass
    day.write_text("\n".join(good) + "\n")
    assert sum(len(labels) for labels, _, _ in parse_tsv(day, block_size=1000)) == 60


def test_criteo_stages_without_a_batch_and_bad_batch_sizes_are_refused(tmp_path: Path) -> None:
    """A stage too small for one batch per reader trained or validated on nothing, silently."""
    (tmp_path / "day_0").write_text("\n".join([criteo_line()] * 10) + "\n")
    days = preprocess([tmp_path / "day_0"], tmp_path / "npy")
    assert len(CriteoIterableDataset("train", days, 4)) == 2
    with pytest.raises(ValueError, match=r"stage 'val' \(5 rows.*2 ranks x 1 workers no batch"):
        CriteoIterableDataset("val", days, 4, rank=0, world_size=2)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        CriteoIterableDataset("train", days, 0)
    with pytest.raises(ValueError, match="26 positive sizes"):
        CriteoIterableDataset("train", days, 4, num_embeddings_per_feature=[0] * 26)


def test_a_failed_preprocess_leaves_no_day_behind_and_the_command_says_why_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A malformed day 1 left day_0 and a header-only day_1 (numpy's "mmap length is greater
    than file size" when read) and the command printed a traceback."""
    (tmp_path / "day_0").write_text("\n".join([criteo_line()] * 10) + "\n")
    bad = [criteo_line()] * 4 + [criteo_line("zz")] + [criteo_line()] * 5
    (tmp_path / "day_1").write_text("\n".join(bad) + "\n")
    out = tmp_path / "npy"
    with pytest.raises(ValueError, match="day_1, line 5: column cat_0 holds 'zz'"):
        preprocess([tmp_path / "day_0", tmp_path / "day_1"], out)
    assert sorted(p.name for p in out.iterdir()) == []
    with pytest.raises(SystemExit) as exited:
        criteo_main(["preprocess", str(tmp_path), str(out)], prog="criteo")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("criteo: error: ValueError: ") and "zz" in err
    assert list(out.iterdir()) == []
    (tmp_path / "day_1").write_text("\n".join([criteo_line()] * 10) + "\n")
    assert len(preprocess([tmp_path / "day_0", tmp_path / "day_1"], out)) == 2


def test_a_resume_under_another_batch_size_trains_the_rest_of_the_epoch(tmp_path: Path) -> None:
    """Saved 6 batches of 10 rows in, resumed with batches of 20: the loader skips 3 (the 60
    rows trained) and the fit loop counts 3, not the checkpoint's 6, so the epoch's last 3
    batches are trained (the loop ended the epoch at its 20th batch without them)."""
    file = write_parquet(tmp_path)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=6, save_top_k=-1)
    small = ParquetClickData(str(file), ["d0"], ["a"], "label", batch_size=10)
    resumed_trainer(tmp_path, [saver], max_steps=6).fit(Linear(), datamodule=small)
    resumed = Linear()
    with pytest.warns(UserWarning, match="batch_size 10 -> 20"):
        resumed_trainer(tmp_path, max_epochs=1).fit(
            resumed, datamodule=parquet_data(file), ckpt_path=tmp_path / "ckpts/epoch=0-step=6.ckpt"
        )
    assert [x for _, x in resumed.seen] == list(range(60, ROWS, 20))


def test_a_new_conversion_leaves_no_days_of_the_old_one_in_the_cache(tmp_path: Path) -> None:
    """Converted again with fewer days (here larger ``rows_per_file``), the cache kept the old
    days 2 to 4: they were read as training days, and old day 4 (rows the new training days
    hold) as the validation day."""
    line = "\t".join(["1"] + ["1"] * 13 + ["ab"] * 26)
    (tmp_path / "train.txt").write_text((line + "\n") * 500)

    def data(rows_per_file: int) -> CriteoDataModule:
        module = CriteoDataModule(
            str(tmp_path), num_embeddings=10, batch_size=10, rows_per_file=rows_per_file
        )
        module.prepare_data()
        return module

    assert len(data(100).train_dataloader()) == 40  # days 0-3 of 100 rows
    module = data(250)
    days = sorted(p.name for p in (tmp_path / "npy").glob("*.npy"))
    assert days == [f"day_{d}_{k}.npy" for d in (0, 1) for k in ("dense", "labels", "sparse")]
    assert len(module.train_dataloader()) == 25 and len(module.val_dataloader()) == 12


def test_a_resume_after_files_were_added_warns(tmp_path: Path) -> None:
    """A file added to the directory between the save and the resume changes the epoch (the
    files are read in name order): the count skipped is no longer the rows trained on."""
    (tmp_path / "data").mkdir()
    write_parquet(tmp_path / "data")
    saved = parquet_data(tmp_path / "data").train_dataloader()
    position = {"epoch": 0, "batches": 2, "world_size": 1, "epoch_batches": len(saved)}
    position["layout"] = loader_layout(saved)
    pq.write_table(pq.read_table(tmp_path / "data/p.parquet"), tmp_path / "data/a.parquet")
    grown = parquet_data(tmp_path / "data").train_dataloader()
    with pytest.warns(UserWarning, match="2 batches into epoch 0 of 20 batches, but the training"):
        assert resume_in_epoch(grown, position, trainer_at(0, 2, 1), warn=True)
    assert grown.skip_next == 2


@pytest.mark.parametrize("with_position", [False, True])
def test_a_checkpoint_of_an_older_version_resumes_from_its_loader_state(
    tmp_path: Path, with_position: bool
) -> None:
    """Older versions' training loader saved its count in Lightning's loader states, before the
    strategy saved a position (``with_position=False``) and beside it (True). Today's loader has
    no ``load_state_dict`` (Lightning would refuse the state): the state becomes the position,
    and the resumed run trains the same batches as the uninterrupted one."""
    file = write_parquet(tmp_path)
    full = Linear()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=6, save_top_k=-1)
    resumed_trainer(tmp_path, [saver], max_steps=10).fit(full, datamodule=parquet_data(file))
    ckpt = tmp_path / "older.ckpt"
    shutil.copytree(tmp_path / "ckpts/epoch=0-step=6.ckpt", ckpt)
    meta = torch.load(ckpt / META_FILE, weights_only=True)
    position = meta[POSITION_KEY] if with_position else meta.pop(POSITION_KEY)
    layout = {"world_size": 1} | position["layout"]
    state = {"start_batch": 6, "epoch_batches": 20, "layout": layout}
    meta["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [state]
    torch.save(meta, ckpt / META_FILE)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["files"][META_FILE] = file_checksum(ckpt / META_FILE)
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    resumed = Linear()
    resumed_trainer(tmp_path, max_steps=10).fit(
        resumed, datamodule=parquet_data(file), ckpt_path=ckpt
    )
    assert resumed.seen == full.seen[6:]
