"""A stream of time partitions: order, waiting, the end, bad partitions, exact resumes, and the
progressive metrics per partition.

One process each (a Trainer under ``TorchRecStrategy`` on one CPU rank), but for one 2-rank
launch (``scripts/stream_ranks.py``) that trains part of a partition on 2 ranks and resumes it on
one. Row ``i`` of partition ``p`` holds ``d0 = (1000 p + i) / 1000`` (its identity, read back from
each batch), ids ``cat_0 = i % 7``, ``cat_1 = i % 5`` and ``label = i % 3 == 0``.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.data import PartitionStreamData, PartitionStreamLoader
from lightning_torchrec.errors import PartitionError
from lightning_torchrec.lightning import ProgressiveEvaluation
from tests.helpers import load_ranks, run_script
from tests.scripts.factory import Capture, cpu_trainer, table_wise, tiny_dlrm

ROWS = 7  # table rows of the tiny model


def write_partition(
    root: Path, name: str, index: int, rows: int, group: int = 16, marker: bool = True, **extra
) -> Path:
    """Partition ``index`` as the directory ``root/name`` (with ``_SUCCESS`` when ``marker``)."""
    i = np.arange(rows)
    columns = {
        "d0": (1000 * index + i) / 1000.0,
        "cat_0": i % 7,
        "cat_1": i % 5,
        "label": (i % 3 == 0).astype(np.int64),
        **extra,
    }
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), folder / "part-0.parquet", row_group_size=group)
    if marker:
        (folder / "_SUCCESS").touch()
    return folder


def stream(root: Path | list, **kwargs: Any) -> PartitionStreamData:
    kwargs.setdefault("batch_size", 8)
    kwargs.setdefault("poll_seconds", 0.05)
    return PartitionStreamData(root, ["d0"], ["cat_0", "cat_1"], "label", **kwargs)


def row_ids(batch: Any) -> list[int]:
    return [round(float(x) * 1000) for x in batch.dense_features[:, 0]]


def hours(root: Path, sizes: list[int]) -> list[Path]:
    return [write_partition(root, f"hour=T{p:02d}", p, n) for p, n in enumerate(sizes)]


# ---------------------------------------------------------------------- without a Trainer
def test_partitions_are_trained_in_order_once_and_the_stream_ends(tmp_path: Path) -> None:
    """Each iteration of the training loader is the next partition, whole batches of it in row
    order; after the last one (no wait) the loader yields nothing and ``ended`` says why."""
    hours(tmp_path, [40, 24, 19])
    (tmp_path / "_temporary").mkdir()  # a writer's scratch: ignored
    data = stream(tmp_path)
    loader = data.train_dataloader()
    seen = []
    while data.ended is None:
        seen.append([row_ids(b) for b in loader])
    assert seen[0] == [list(range(k, k + 8)) for k in range(0, 40, 8)]
    assert seen[1] == [list(range(1000 + k, 1008 + k)) for k in (0, 8, 16)]
    assert seen[2] == [list(range(2000 + k, 2008 + k)) for k in (0, 8)]  # 3 tail rows dropped
    assert len(seen) == 3  # the end is known at the last partition's end
    assert list(loader) == []
    assert [p.name for p in data.partitions] == ["hour=T00", "hour=T01", "hour=T02"]
    assert "no partition after 'hour=T02'" in data.ended


def test_a_directory_counts_once_it_holds_the_marker(tmp_path: Path) -> None:
    """A partition directory without ``_SUCCESS`` is still being written: not taken (the
    stream ends before it); ``ready_marker=None`` takes it."""
    write_partition(tmp_path, "hour=T00", 0, 16)
    write_partition(tmp_path, "hour=T01", 1, 16, marker=False)
    data = stream(tmp_path)
    loader = data.train_dataloader()
    assert len(list(loader)) == 2
    assert data.ended is not None and list(loader) == []
    assert [p.name for p in data.partitions] == ["hour=T00"]
    anything = stream(tmp_path, ready_marker=None)
    loader = anything.train_dataloader()
    assert [len(list(loader)) for _ in range(3)] == [2, 2, 0]


def test_a_partition_written_while_waiting_is_picked_up(tmp_path: Path) -> None:
    """At a partition's end the loader waits (polling) for the next one; one that appears
    within the timeout is trained next; the marker written last makes it count."""
    write_partition(tmp_path, "hour=T00", 0, 16)
    data = stream(tmp_path, timeout_seconds=30)
    loader = data.train_dataloader()

    def write_later() -> None:
        time.sleep(0.5)
        write_partition(tmp_path, "hour=T01", 1, 24, marker=False)
        time.sleep(0.3)
        (tmp_path / "hour=T01" / "_SUCCESS").touch()

    writer = threading.Thread(target=write_later)
    start = time.monotonic()
    writer.start()
    assert len(list(loader)) == 2  # then waits for hour=T01
    writer.join()
    assert 0.8 < time.monotonic() - start < 20
    data.timeout_seconds = 0.2  # no third partition
    assert [row_ids(b) for b in loader] == [list(range(1000 + k, 1008 + k)) for k in (0, 8, 16)]
    assert "no partition after 'hour=T01'" in str(data.ended)


def test_the_wait_is_rounds_of_one_agreed_look_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 looks once a round and the ranks sleep between rounds together: no collective
    lasts a whole wait (an hour's wait would outlast the process group's timeout), and an
    error of rank 0's listing is raised through the agreed broadcast, not left on rank 0."""
    import lightning_torchrec.data.stream as stream_module

    hours(tmp_path, [16])
    data = stream(tmp_path, timeout_seconds=0.35)
    data.poll_seconds = 0.1
    decisions: list[dict[str, Any]] = []

    def one_round(fn: Any) -> Any:
        decisions.append(fn())
        return decisions[-1]

    monkeypatch.setattr(stream_module, "broadcast_from_rank0", one_round)
    assert data.partition(0) is not None and data.partition(1) is None
    waits = [d["wait"] for d in decisions if "wait" in d]
    assert len(waits) >= 3 and all(0 < w <= 0.1 for w in waits), decisions
    assert "end" in decisions[-1]

    def listing_fails(*args: Any) -> Any:
        raise OSError("the source's file system is gone")

    fresh = stream(tmp_path, timeout_seconds=0)
    monkeypatch.setattr(stream_module, "list_partitions", listing_fails)
    with pytest.raises(OSError, match="file system is gone"):
        fresh.partition(0)


def test_a_partition_sorting_before_one_taken_is_skipped_with_a_warning(tmp_path: Path) -> None:
    hours(tmp_path, [16])
    write_partition(tmp_path, "hour=T05", 5, 16)
    data = stream(tmp_path)
    loader = data.train_dataloader()
    list(loader)  # hour=T00, then hour=T05 is taken
    write_partition(tmp_path, "hour=T03", 3, 16)  # late
    write_partition(tmp_path, "hour=T06", 6, 16)
    with pytest.warns(UserWarning, match=r"partition 'hour=T03' .* appeared after partition "):
        assert [row_ids(b)[0] for b in loader] == [5000, 5008]  # then the next is looked for
    assert row_ids(next(iter(loader)))[0] == 6000
    assert [p.name for p in data.partitions] == ["hour=T00", "hour=T05", "hour=T06"]


def test_an_ordered_list_is_the_stream_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    """A list's order is the stream's (not the names'); it ends after the last; a listed
    partition absent at the end of the wait is a PartitionError naming it."""
    a, b = hours(tmp_path, [16, 16])
    file = tmp_path / "extra.parquet"
    pq.write_table(pq.read_table(a / "part-0.parquet"), file)
    data = stream([b, file, a])
    loader = data.train_dataloader()
    firsts = [row_ids(next(iter(loader)))[0] for _ in range(3)]
    assert firsts == [1000, 0, 0] and [p.name for p in data.partitions] == [
        "hour=T01",
        "extra",
        "hour=T00",
    ]
    assert list(loader) == [] and "last listed partition 'hour=T00'" in data.ended
    missing = stream([a, tmp_path / "hour=T09"], timeout_seconds=0.2)
    loader = missing.train_dataloader()
    list(loader)
    with pytest.raises(PartitionError, match=r"partition 'hour=T09' \(.*\) is missing"):
        list(loader)


def test_bad_partitions_are_refused_naming_them(tmp_path: Path) -> None:
    """A file that is not Parquet, a partition with other columns than the first, one missing a
    role's column: PartitionError naming the partition (and the file)."""
    write_partition(tmp_path, "hour=T00", 0, 16)
    write_partition(tmp_path, "hour=T01", 1, 16, new=np.zeros(16))
    data = stream(tmp_path)
    loader = data.train_dataloader()
    list(loader)
    with pytest.raises(
        PartitionError, match=r"partition 'hour=T01' .*other columns.*added: \['new'\]"
    ):
        list(loader)
    corrupt = tmp_path / "corrupt"
    write_partition(corrupt, "hour=T00", 0, 16)
    (corrupt / "hour=T01").mkdir()
    (corrupt / "hour=T01" / "part-0.parquet").write_bytes(b"PAR1 not really")
    (corrupt / "hour=T01" / "_SUCCESS").touch()
    data = stream(corrupt)
    loader = data.train_dataloader()
    list(loader)
    with pytest.raises(
        PartitionError, match=r"partition 'hour=T01' .*part-0.parquet: not a readable"
    ):
        list(loader)


# ---------------------------------------------------------------------- under a Trainer
class Rows(Callback):
    """Records the rows of every training batch and the loss of every step."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self.losses: list[torch.Tensor] = []
        self.evaluated: list[tuple[int, int]] = []

    def on_validation_batch_end(
        self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.evaluated.append((trainer.current_epoch, row_ids(batch)[0]))

    def on_train_batch_end(
        self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.rows.append(row_ids(batch))
        self.losses.append(outputs["loss"].detach().clone())


def fit(
    data: PartitionStreamData,
    root: Path,
    callbacks: list[Callback],
    ckpt_path: Path | None = None,
    pipeline: str | None = None,
    **kwargs: Any,
) -> L.Trainer:
    L.seed_everything(3)
    model = tiny_dlrm(ROWS, 2, num_dense_features=1)
    kwargs.setdefault("max_epochs", -1)
    trainer = cpu_trainer(
        TorchRecStrategy(constraints=table_wise(2), log_plan=False, pipeline=pipeline),  # type: ignore[arg-type]
        callbacks=callbacks,
        default_root_dir=root,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        **kwargs,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_the_fit_ends_cleanly_when_no_partition_comes_in_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``max_epochs=-1``: one epoch per partition, then the wait for the next times out, the fit
    stops (no error) with one log line naming the last partition and the wait."""
    hours(tmp_path / "data", [24, 16])
    rows = Rows()
    with caplog.at_level(logging.INFO, logger="lightning_torchrec.data.stream"):
        trainer = fit(
            stream(tmp_path / "data", timeout_seconds=0.3), tmp_path, [rows], limit_val_batches=0
        )
    assert trainer.current_epoch == 2 and trainer.global_step == 5
    assert [r[0] for r in rows.rows] == [0, 8, 16, 1000, 1008]
    ended = [r.getMessage() for r in caplog.records if "stream ended" in r.getMessage()]
    assert ended == [
        f"partition stream ended: no partition after 'hour=T01' appeared in {tmp_path / 'data'} "
        "within 0.3 s; the fit stops"
    ]


def test_progressive_metrics_are_logged_per_partition(tmp_path: Path) -> None:
    """Validation at epoch e's end evaluates partition e + 1 (never trained yet), the sanity
    check partition 0: NE, calibration and AUROC of each reach every logger as ``online/*`` at
    step = the partition's index, and the history names the partitions."""
    hours(tmp_path / "data", [24, 16, 16])
    capture, progressive, rows = Capture(), ProgressiveEvaluation(), Rows()
    trainer = fit(
        stream(tmp_path / "data"),
        tmp_path,
        [progressive, rows],
        logger=[capture, TensorBoardLogger(tmp_path, name="tb")],
        num_sanity_val_steps=-1,
    )
    assert trainer.current_epoch == 3
    # (trained epoch, first row) of each validation batch: before any training partition 0,
    # after epoch e partition e + 1; after the last none
    assert rows.evaluated == [(0, 0), (0, 8), (0, 16), (0, 1000), (0, 1008), (1, 2000), (1, 2008)]
    assert [(r["index"], r["partition"]) for r in progressive.history] == [
        (0, "hour=T00"),
        (1, "hour=T01"),
        (2, "hour=T02"),
    ]
    for record in progressive.history:
        assert {"ne", "calibration", "auroc", "loss"} <= record.keys()
        logged = capture.metrics[record["index"]]
        for name in ("ne", "calibration", "auroc"):
            assert logged[f"online/{name}"] == pytest.approx(record[name])
    events = EventAccumulator(str(next((tmp_path / "tb").rglob("events.out.*")).parent))
    events.Reload()
    assert [e.step for e in events.Scalars("online/ne")] == [0, 1, 2]  # one curve
    names = [
        t.tensor_proto.string_val[0].decode()
        for t in events.Tensors("online/partition/text_summary")
    ]
    assert names == ["hour=T00", "hour=T01", "hour=T02"]
    # trainer.validate after the fit: the first partition not trained (none here: nothing)
    rows.evaluated.clear()
    hours(tmp_path / "data", [24, 16, 16, 8])  # a fourth partition appeared
    trainer.validate(trainer.lightning_module, datamodule=trainer.datamodule, verbose=False)
    assert rows.evaluated == [(3, 3000)]
    # partition 1 was evaluated after training on partition 0 only: its NE differs from the
    # untrained model's on partition 0
    assert progressive.history[0]["ne"] != progressive.history[1]["ne"]


def test_a_mid_partition_checkpoint_resumes_bit_equal_on_the_same_partitions(
    tmp_path: Path,
) -> None:
    """Checkpoints after every step (one at a partition's last batch, others within
    partitions): a fresh run resumed from each trains the same rows with bit-equal losses, and
    each epoch keeps its partition although a partition sorting before a taken one appeared
    since (skipped with a warning)."""
    data_dir = tmp_path / "data"
    hours(data_dir, [24, 40, 24])  # 3 + 5 + 3 steps of 8 rows
    every = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1)
    full = Rows()
    fit(stream(data_dir), tmp_path, [full, every], limit_val_batches=0)
    ends, with_val = ModelCheckpoint(dirpath=tmp_path / "ends", save_top_k=-1), Rows()
    fit(stream(data_dir), tmp_path, [with_val, ends])  # validation, a checkpoint each epoch's end
    assert with_val.rows == full.rows and with_val.evaluated[0] == (0, 1000)
    resumed = Rows()
    fit(stream(data_dir), tmp_path, [resumed], ckpt_path=tmp_path / "ends/epoch=0-step=3.ckpt")
    assert resumed.rows == full.rows[3:] and resumed.evaluated[0] == (1, 2000)
    assert all(torch.equal(a, b) for a, b in zip(resumed.losses, full.losses[3:], strict=True))
    assert [r[0] for r in full.rows] == [0, 8, 16] + [1000 + 8 * k for k in range(5)] + [
        2000,
        2008,
        2016,
    ]
    piped = Rows()  # a train pipeline reads ahead of the step: the position is the step's
    (path,) = (tmp_path / "ckpts").glob("*step=4.ckpt")
    fit(stream(data_dir), tmp_path, [piped], path, "sparse_dist", limit_val_batches=0)
    assert piped.rows == full.rows[4:] and len(piped.losses) == len(full.losses) - 4
    for got, want in zip(piped.losses, full.losses[4:], strict=True):
        assert torch.equal(got, want)
    for step in (3, 4, 9):
        if step == 9:  # hour=T02 was taken before this checkpoint; hour=T01a sorts before it
            write_partition(data_dir, "hour=T01a", 9, 16)
        (path,) = (tmp_path / "ckpts").glob(f"*step={step}.ckpt")
        resumed = Rows()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(stream(data_dir), tmp_path, [resumed], ckpt_path=path, limit_val_batches=0)
        assert resumed.rows == full.rows[step:], step
        for got, want in zip(resumed.losses, full.losses[step:], strict=True):
            assert torch.equal(got, want), step
        skipped = [w for w in caught if "'hour=T01a'" in str(w.message)]
        assert len(skipped) == (step == 9), step


def test_a_resume_under_another_batch_size_trains_exactly_the_rows_left(tmp_path: Path) -> None:
    """Batches of 8, checkpoint 1 batch into partition 1 (its rows 0-7 trained): resumed with
    batches of 6 it trains rows 8-37 (the 2-row tail is dropped), nothing twice, nothing left
    out; a checkpoint of that run, off its own batch boundary (rows 8 + 2 * 6 = 20), resumes
    with batches of 8 at row 20 exactly."""
    data_dir = tmp_path / "data"
    hours(data_dir, [24, 40])
    every = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1)
    fit(stream(data_dir), tmp_path, [every], limit_val_batches=0)
    (path,) = (tmp_path / "ckpts").glob("*step=4.ckpt")
    sixes = Rows()
    again = ModelCheckpoint(dirpath=tmp_path / "again", every_n_train_steps=1, save_top_k=-1)
    fit(
        stream(data_dir, batch_size=6),
        tmp_path,
        [sixes, again],
        ckpt_path=path,
        limit_val_batches=0,
    )
    assert sixes.rows == [list(range(1000 + k, 1006 + k)) for k in range(8, 38, 6)]
    (path,) = (tmp_path / "again").glob("*step=6.ckpt")  # 2 batches of 6 after the resume
    eights = Rows()
    fit(stream(data_dir), tmp_path, [eights], ckpt_path=path, limit_val_batches=0)
    assert eights.rows == [list(range(1000 + k, 1008 + k)) for k in (20, 28)]


def test_two_ranks_resumed_on_one_train_exactly_the_rows_left(tmp_path: Path) -> None:
    """2 ranks split each global batch of 8 rows (rank 0 its first 4, rank 1 the next 4);
    a checkpoint 2 steps into partition 1 (its rows 0-15 trained) resumes on 1 rank with
    batches of 6 at row 16: rows 16-39, then partition 2, nothing twice, nothing left out."""
    data_dir = tmp_path / "data"
    hours(data_dir, [24, 40, 16])
    run_script("stream_ranks.py", str(tmp_path), str(data_dir), timeout=240)
    full = load_ranks(tmp_path, "full")
    per_step = [a + b for a, b in zip(full[0]["rows"], full[1]["rows"], strict=True)]
    assert per_step == [list(range(k, k + 8)) for k in (0, 8, 16)] + [
        list(range(1000 + k, 1008 + k)) for k in range(0, 40, 8)
    ] + [list(range(2000 + k, 2008 + k)) for k in (0, 8)]
    (path,) = (tmp_path / "ckpts").glob("*step=5.ckpt")
    one = Rows()
    fit(stream(data_dir, batch_size=6), tmp_path, [one], ckpt_path=path, limit_val_batches=0)
    assert one.rows == [list(range(1000 + k, 1006 + k)) for k in range(16, 40, 6)] + [
        list(range(2000 + k, 2006 + k)) for k in (0, 6)
    ]


def test_a_loop_of_ones_own_resumes_at_the_saved_partition_and_row(tmp_path: Path) -> None:
    """Without a Trainer: save ``state_dict()`` and ``rows_done``; a new data module restored
    from them continues partition 1 at the row it stopped, then goes on with partition 2."""
    hours(tmp_path, [16, 40, 16])
    data = stream(tmp_path)
    loader = data.train_dataloader()
    list(loader)
    batches = iter(loader)
    next(batches), next(batches)  # 2 batches of partition 1
    state, rows = data.state_dict(), loader.rows_done(2)
    assert rows == 16 and [p["name"] for p in state["partitions"]] == ["hour=T00", "hour=T01"]
    again = stream(tmp_path)
    again.load_state_dict(state)
    loader = again.train_dataloader()
    loader.set_epoch(1)
    loader.resume_rows(rows)
    assert [row_ids(b)[0] for b in loader] == [1016, 1024, 1032]
    assert [row_ids(b)[0] for b in loader] == [2000, 2008]


def test_workers_read_every_nth_global_batch_in_the_same_order(tmp_path: Path) -> None:
    """With 2 DataLoader workers on rank 1 of 2 the batches are those of the main process: the
    rank's 4 rows of each global batch of 8, in order."""
    hours(tmp_path, [40])
    data = stream(tmp_path, batch_size=4)
    dataset = data.dataset()
    dataset.rank, dataset.world_size = 1, 2
    plain, workers = (PartitionStreamLoader(data, dataset, "val", num_workers=n) for n in (0, 2))
    want = [list(range(k + 4, k + 8)) for k in range(0, 40, 8)]
    assert [row_ids(b) for b in plain] == want
    assert [row_ids(b) for b in workers] == want


def test_a_row_group_that_cannot_be_read_names_the_partition(tmp_path: Path) -> None:
    """A damaged page (the footer intact) fails when its row group is read: PartitionError
    naming the partition, the file and the row group."""
    folder = write_partition(tmp_path, "hour=T00", 0, 64)
    file = folder / "part-0.parquet"
    table = pq.read_table(file)
    pq.write_table(table, file, row_group_size=32, compression="snappy")
    raw = bytearray(file.read_bytes())
    meta = pq.read_metadata(file)
    column = meta.row_group(1).column(0)
    start = column.data_page_offset
    raw[start + 8 : start + 40] = b"\xff" * 32
    file.write_bytes(bytes(raw))
    loader = stream(tmp_path).train_dataloader()
    with pytest.raises(
        PartitionError, match=r"partition 'hour=T00': .*part-0.parquet \(row group 1\)"
    ):
        list(loader)


def write_day(root: Path, day: int, rows: int) -> None:
    """TorchRec's npy day ``day_{day}``: dense[:, 0] = (1000 day + i) / 1000, ids 100 i + f."""
    i = np.arange(rows)
    dense = np.zeros((rows, 13), np.float32)
    dense[:, 0] = (1000 * day + i) / 1000.0
    np.save(root / f"day_{day}_dense.npy", dense)
    np.save(root / f"day_{day}_sparse.npy", (100 * i[:, None] + np.arange(26)).astype(np.int32))
    np.save(root / f"day_{day}_labels.npy", (i % 2).astype(np.int32)[:, None])


def test_criteo_days_are_partitions_by_day_number(tmp_path: Path) -> None:
    """TorchRec's npy days stream by day number (day_2 before day_10); a day counts once its
    three files exist; ids are taken modulo the table sizes, one per feature ``cat_f``."""
    for day in (10, 2):
        write_day(tmp_path, day, 20)
    np.save(tmp_path / "day_11_dense.npy", np.zeros((4, 13), np.float32))  # still being written
    data = PartitionStreamData.criteo_days(tmp_path, num_embeddings_per_feature=7, batch_size=8)
    assert data.num_dense_features == 13
    loader = data.train_dataloader()
    days = [[row_ids(b) for b in loader] for _ in range(2)]
    assert days == [
        [list(range(2000 + k, 2008 + k)) for k in (0, 8)],
        [list(range(10000 + k, 10008 + k)) for k in (0, 8)],
    ]
    assert [p.name for p in data.partitions] == ["day_2", "day_10"] and data.ended
    batch = next(
        iter(PartitionStreamData.criteo_days([tmp_path / "day_2"], 7, 8).train_dataloader())
    )
    sparse = batch.sparse_features.to_dict()
    assert list(sparse) == [f"cat_{f}" for f in range(26)]
    assert sparse["cat_3"].values().tolist() == [(100 * i + 3) % 7 for i in range(8)]
    assert batch.labels.tolist() == [float(i % 2) for i in range(8)]
