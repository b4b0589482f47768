"""Mid-epoch resume of any map-style DataLoader: skipped at the sampler, never loaded.

Single-process tests of :class:`SkipBatches` and the strategy's decision, then two real gloo
ranks (tests/scripts/mid_epoch_ranks.py) training with a plain shuffled DataLoader with workers:
an uninterrupted run against runs resumed from mid-epoch checkpoints.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
)

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.data.mid_epoch import SkipBatches, skip_batches
from lightning_torchrec.data.synthetic import SyntheticClickDataset
from lightning_torchrec.lightning.mid_epoch import (
    POSITION_KEY,
    resume_in_epoch,
    saved_position,
    set_sampler_epoch,
)
from tests.helpers import assert_same, load_ranks, run_script
from tests.scripts.factory import ROWS, cpu_trainer, table_wise, tiny_data, tiny_dlrm


class Counting(Dataset):
    """Sample ``i`` is ``i``; every ``__getitem__`` is recorded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.calls.append(i)
        return i


def epochs(loader: DataLoader, first: int, count: int) -> list[list[Any]]:
    """The batches of ``count`` epochs from ``first``, the sampler's epoch set as Lightning does."""
    out = []
    for epoch in range(first, first + count):
        set_sampler_epoch(loader, epoch)
        out.append([b.tolist() if isinstance(b, torch.Tensor) else b for b in loader])
    return out


def shuffled_loader(data: Counting, **kwargs: Any) -> DataLoader:
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=7)
    return DataLoader(data, sampler=sampler, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 3},
        {"batch_size": 3, "drop_last": True},
        {"batch_size": None},  # every index is a whole batch
        {"batch_size": 3, "num_workers": 1},  # a worker's iterator asks for the sampler twice
    ],
)
def test_skipped_batches_are_never_loaded_and_the_next_epoch_is_whole(kwargs: dict) -> None:
    full = epochs(shuffled_loader(Counting(23), **kwargs), 0, 3)  # uninterrupted
    data = Counting(23)
    loader = shuffled_loader(data, **kwargs)
    length = len(loader)
    set_sampler_epoch(loader, 1)
    assert skip_batches(loader, 2)
    assert len(loader) == length  # the whole epoch's: the skipped batches count as done
    resumed = epochs(loader, 1, 2)
    assert resumed[0] == full[1][2:]
    assert resumed[1] == full[2]  # the next epoch: whole, the same shuffle
    # __getitem__ ran for exactly the samples yielded: none for the skipped batches
    yielded = [i for epoch in resumed for b in epoch for i in (b if isinstance(b, list) else [b])]
    if not kwargs.get("num_workers"):  # (a worker's calls are its own; the 2-rank test counts)
        assert sorted(data.calls) == sorted(yielded)


def test_a_users_batch_sampler_is_skipped_in_and_gets_the_epoch() -> None:
    class Shifting(BatchSampler):
        epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):  # type: ignore[no-untyped-def]
            batches = list(super().__iter__())
            return iter(batches[self.epoch :] + batches[: self.epoch])

    data = Counting(12)
    loader = DataLoader(data, batch_sampler=Shifting(SequentialSampler(data), 2, False))
    assert skip_batches(loader, 4)
    assert isinstance(loader.batch_sampler, SkipBatches)
    set_sampler_epoch(loader, 1)
    assert [b.tolist() for b in loader] == [[10, 11], [0, 1]]
    assert data.calls == [10, 11, 0, 1]
    assert len(list(loader)) == 6


def test_skip_needs_a_count_of_zero_or_more() -> None:
    with pytest.raises(ValueError, match="skip >= 0, got -1"):
        SkipBatches([[0]], -1)


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(4))


def trainer_at(epoch: int, batches: int = 0, world_size: int = 1) -> Any:
    """A trainer of ``world_size`` ranks whose fit loop was restored in ``epoch``, ``batches`` of
    it processed (saved at a batch's end: the last one not completed)."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=epoch))
    counts = dict(ready=batches, started=batches, processed=batches, completed=batches - 1)
    epoch_loop = SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(**counts)))
    loops = SimpleNamespace(epoch_progress=progress, epoch_loop=epoch_loop)
    return SimpleNamespace(fit_loop=loops, world_size=world_size)


def test_the_resume_skips_only_in_the_saved_epoch() -> None:
    data = Counting(8)
    loader = DataLoader(data, batch_size=2)
    position = {"epoch": 1, "batches": 3}
    assert not resume_in_epoch(loader, position, trainer_at(2), warn=True)  # epoch ended
    assert not resume_in_epoch(loader, {"epoch": 1, "batches": 0}, trainer_at(1), warn=True)
    assert resume_in_epoch(loader, position, trainer_at(1), warn=True)
    assert [b.tolist() for b in loader] == [[6, 7]]


def test_a_loader_fitted_before_with_persistent_workers_skips_too() -> None:
    loader = DataLoader(Counting(8), batch_size=2, num_workers=1, persistent_workers=True)
    assert len(list(loader)) == 4  # its workers (and their sampler) outlive this epoch
    assert resume_in_epoch(loader, {"epoch": 0, "batches": 3}, trainer_at(0), warn=True)
    assert [b.tolist() for b in loader] == [[6, 7]]
    assert len(list(loader)) == 4


def test_loaders_with_the_state_protocol_are_left_to_it() -> None:
    data = SyntheticClickDataset([10], num_batches=4, batch_size=2)
    loader = DataLoader(data, batch_size=None)
    loader.state_dict = dict  # type: ignore[attr-defined]
    loader.load_state_dict = print  # type: ignore[attr-defined]
    assert not resume_in_epoch(loader, {"epoch": 0, "batches": 2}, trainer_at(0), warn=True)
    assert not isinstance(loader.sampler, SkipBatches)


def test_an_iterable_dataset_without_the_protocol_warns_once_naming_the_loader() -> None:
    loader = DataLoader(Stream(), batch_size=2)
    with pytest.warns(UserWarning, match=r"4 batches into epoch 0.*DataLoader \(dataset Stream\)"):
        assert not resume_in_epoch(loader, {"epoch": 0, "batches": 4}, trainer_at(0), warn=True)
    # the other ranks stay quiet (pytest makes the package's warnings errors)
    assert not resume_in_epoch(loader, {"epoch": 0, "batches": 4}, trainer_at(0), warn=False)


@pytest.mark.parametrize(
    "meta",
    [
        {},
        {POSITION_KEY: None},
        {POSITION_KEY: {"epoch": 1}},
        {POSITION_KEY: {"epoch": -1, "batches": 2}},
    ],
)
def test_a_checkpoint_without_a_position_resumes_as_lightning_does(meta: dict) -> None:
    assert saved_position(meta) is None


# ------------------------------------------------------------------ two ranks


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("mid_epoch")
    proc = run_script("mid_epoch_ranks.py", str(out), timeout=240)
    return out, proc.stderr


def calls(out: Path, run: str, rank: int) -> Counter:
    found: Counter = Counter()
    for f in (out / "calls").glob(f"{run}_rank{rank}_*.txt"):
        found.update(int(line) for line in f.read_text().split())
    return found


def test_two_ranks_resume_a_shuffled_dataloader_mid_epoch_bit_exact(
    resumed: tuple[Path, str],
) -> None:
    out, stderr = resumed
    full = load_ranks(out, "full")
    # 25 samples per rank, batches of 4, drop_last: 6 batches an epoch, 2 epochs
    assert full[0]["batches_per_epoch"] == full[1]["batches_per_epoch"] == 6
    assert sorted(full[0]["steps"]) == list(range(1, 13))
    assert full[0]["steps"][1]["ids"] != full[1]["steps"][1]["ids"]  # each rank its own
    assert full[0]["steps"][1]["ids"] != full[0]["steps"][7]["ids"]  # epochs shuffled apart
    # resume_cut: the checkpoint of a fit stopped by max_steps=3, saved after Lightning had
    # ended the cut epoch as though it were over, resumes inside that epoch
    for step, run in ((4, "resume4"), (8, "resume8"), (3, "resume_cut")):
        res = load_ranks(out, run)
        for rank in range(2):
            steps = res[rank]["steps"]
            assert sorted(steps) == list(range(step + 1, 13)), (run, rank)
            for s, got in steps.items():
                want = full[rank]["steps"][s]
                assert got["ids"] == want["ids"], (run, rank, s)
                assert got["batch_idx"] == want["batch_idx"], (run, rank, s)
                assert torch.equal(got["loss"], want["loss"]), (run, rank, s)
            # tables and dense weights at the end: bit-equal
            assert_same(full[rank]["state"], res[rank]["state"], f"{run}/rank{rank}")
            # __getitem__ ran (in the workers) for exactly the samples trained on after the
            # resume: none of the skipped batches was loaded
            trained = Counter(i for s in steps.values() for i in s["ids"])
            assert calls(out, run, rank) == trained, (run, rank)
    assert "not resumable" not in stderr and "replays" not in stderr


def _loops(epoch: dict[str, int], batch: dict[str, int], stepped: int) -> dict[str, Any]:
    fit = {
        "epoch_progress": {"total": dict(epoch), "current": dict(epoch)},
        "epoch_loop.batch_progress": {
            "total": dict(batch),
            "current": dict(batch),
            "is_last_batch": False,
        },
        "epoch_loop.state_dict": {"_batches_that_stepped": stepped},
    }
    return {"epoch": epoch["completed"], "loops": {"fit_loop": fit}}


def test_a_cut_epoch_gets_lightnings_mid_epoch_loop_state_and_nothing_else_is_touched() -> None:
    from lightning_torchrec.compat.lightning_loops import reopen_cut_epoch

    ended = {"ready": 1, "started": 1, "processed": 1, "completed": 1}
    batches = {"ready": 6, "started": 6, "processed": 6, "completed": 6}
    checkpoint = _loops(ended, batches, 6)
    assert reopen_cut_epoch(checkpoint) == 0
    # what Lightning itself saves at on_train_batch_end of the epoch's 6th batch
    within = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    assert checkpoint == _loops(within, batches | {"completed": 5}, 5)
    # saved within an epoch already, at a finished epoch's last batch, or of another layout
    for other in (
        _loops(within, batches | {"completed": 5}, 5),
        {"loops": {"fit_loop": {"epoch_progress": "?"}}},
        {"loops": {"fit_loop": _loops(ended, batches, "six")["loops"]["fit_loop"]}},
        {},
    ):
        kept = repr(other)
        assert reopen_cut_epoch(other) is None
        assert repr(other) == kept
    last = _loops(ended, batches, 6)
    last["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] = True
    assert reopen_cut_epoch(last) is None


def test_a_position_from_another_world_size_counts_the_same_global_batches() -> None:
    from lightning_torchrec.lightning.mid_epoch import rescale

    saved = {"epoch": 1, "batches": 3, "world_size": 2}
    assert rescale(saved, 2) is saved  # the same world size: as saved
    assert rescale({"epoch": 1, "batches": 3}, 4) == {"epoch": 1, "batches": 3}  # older entry
    assert rescale(saved, 4)["batches"] == 1  # 6 global batches: 1 on each of 4 ranks, 2 again
    position = rescale(saved, 3)
    assert position is not None and position["batches"] == 2
    loader = DataLoader(Counting(24), batch_size=2)
    restored = trainer_at(1, batches=3, world_size=3)
    with pytest.warns(
        UserWarning,
        match=r"3 batches into epoch 1 under another layout than this run's \(world_size 2 -> 3"
        r"\)\. The training loader DataLoader resumes after 2 batches per rank \(6 of the 6 "
        r"batches trained; 0 trained again\)",
    ):
        assert resume_in_epoch(loader, saved, restored, warn=True)  # rescaled there
    assert next(iter(loader)).tolist() == [4, 5]
    # the fit loop counts the 2 batches skipped, not the checkpoint's 3: it would otherwise end
    # the epoch one batch before the loader's end (on more ranks than the checkpoint's)
    current = restored.fit_loop.epoch_loop.batch_progress.current
    assert (current.ready, current.started, current.processed, current.completed) == (2, 2, 2, 1)
    # a loader that restores its own position is left to it, without a warning
    assert not resume_in_epoch(
        SimpleNamespace(state_dict=dict, load_state_dict=print), saved, trainer_at(1), warn=True
    )
    assert saved_position({POSITION_KEY: saved}) == saved
    assert saved_position({POSITION_KEY: saved | {"world_size": "2"}}) == {"epoch": 1, "batches": 3}


def test_one_rescale_rule_for_world_and_batch_size() -> None:
    """``k`` batches of ``B`` on ``W`` ranks are ``k * W * B`` samples of the epoch: as many
    batches of ``B'`` on ``W'`` ranks; a change the two sides do not both know is not one."""
    from lightning_torchrec.lightning.mid_epoch import rescale

    saved = {"epoch": 0, "batches": 6, "world_size": 2, "layout": {"batch_size": 10}}
    assert rescale(saved, 2, {"batch_size": 10}) is saved
    assert rescale(saved, 2, {}) is saved  # this loader tells no batch size: not a change
    assert rescale(saved, 1, {"batch_size": 20})["batches"] == 6  # 120 samples
    assert rescale(saved, 2, {"batch_size": 20})["batches"] == 3
    assert rescale(saved, 3, {"batch_size": 7})["batches"] == 5  # 120 // 21, 15 again
    readers = rescale(
        saved | {"layout": {"batch_size": 10, "readers_per_rank": 1}},
        2,
        {"batch_size": 10, "readers_per_rank": 2},
    )
    assert readers["batches"] == 6 and readers["changed"] == {"readers_per_rank": (1, 2)}


class Resumable(DataLoader):
    """A loader of one's own with the resume hook: it records the counts it is handed."""

    def __init__(self) -> None:
        super().__init__(Stream(), batch_size=None)
        self.handed: list[int] = []

    def resume_at(self, batches: int) -> None:
        self.handed.append(batches)

    def resume_layout(self) -> dict[str, int]:
        return {"batch_size": 5}


def test_a_loader_with_the_resume_hook_is_handed_the_rescaled_count() -> None:
    loader = Resumable()
    saved = {"epoch": 0, "batches": 4, "world_size": 1, "layout": {"batch_size": 5}}
    assert resume_in_epoch(loader, saved, trainer_at(0, 4), warn=True)
    assert loader.handed == [4]
    with pytest.warns(UserWarning, match=r"\(world_size 1 -> 2\).*Resumable resumes after 2"):
        assert resume_in_epoch(loader, saved, trainer_at(0, 4, world_size=2), warn=True)
    assert loader.handed == [4, 2]
    assert not resume_in_epoch(loader, saved, trainer_at(1, 4), warn=True)  # epoch ended
    assert loader.handed == [4, 2]


def test_a_checkpoint_of_an_older_resumable_loader_resumes_from_its_loader_state() -> None:
    """Older versions' ResumableDataLoader saved its count in Lightning's loader states; the
    state is taken out of the checkpoint (the loader no longer has load_state_dict: Lightning
    would refuse it) and becomes the position, with or without a saved position."""
    from lightning_torchrec.lightning.mid_epoch import take_position

    def checkpoint(position: dict | None, states: list) -> dict:
        epoch = {"ready": 2, "started": 2, "processed": 1, "completed": 1}
        fit = {
            "epoch_progress": {"total": epoch, "current": epoch},
            "state_dict": {"combined_loader": states},
        }
        return {"loops": {"fit_loop": fit}} | ({POSITION_KEY: position} if position else {})

    layout = {"world_size": 2, "readers_per_rank": 1, "batch_size": 20}
    legacy = {"start_batch": 3, "epoch_batches": 10, "layout": layout}
    theirs = {"torchdata": 1}  # another loader's state stays, for its loader
    old = checkpoint(None, [legacy, theirs])
    want = {
        "epoch": 1,
        "batches": 3,
        "world_size": 2,
        "layout": {"readers_per_rank": 1, "batch_size": 20},
        "epoch_batches": 10,
    }
    assert take_position(old) == want
    assert old["loops"]["fit_loop"]["state_dict"] == {"combined_loader": [theirs]}
    both = checkpoint({"epoch": 1, "batches": 3, "world_size": 2}, [legacy])
    assert take_position(both) == want
    assert both["loops"]["fit_loop"]["state_dict"] == {}
    at_end = checkpoint(None, [legacy | {"start_batch": 10}])  # the saved epoch was over
    assert take_position(at_end)["batches"] == 0
    assert take_position(checkpoint(None, [theirs])) is None


class _Steps(Callback):
    """Every training step's epoch, batch index, batch fingerprint, loss and learning rates."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        ids = int(batch.sparse_features.values().sum())
        lrs = tuple(g["lr"] for g in trainer.optimizers[0].param_groups)
        loss = outputs["loss"].detach().clone()
        key = (trainer.current_epoch, batch_idx, ids, float(batch.dense_features.sum()))
        self.steps[trainer.global_step] = (*key, lrs, loss)


def _fit_steps(tmp_path: Path, ckpt: Path | None = None, **trainer_kw: Any) -> tuple[Any, dict]:
    torch.manual_seed(0)
    model = tiny_dlrm(ROWS, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    model.lr_scheduler_interval = "epoch"
    steps = _Steps()
    callbacks = [steps, *trainer_kw.pop("callbacks", [])]
    trainer = cpu_trainer(
        TorchRecStrategy(constraints=table_wise(2), log_plan=False),
        callbacks=callbacks,
        default_root_dir=tmp_path,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        **trainer_kw,
    )
    data = tiny_data(ROWS, 2, batch_size=8, train_batches=6, seed=4)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    return trainer, steps.steps


@pytest.mark.parametrize("saved_by", ["on_train_epoch_end", "save_checkpoint after max_epochs"])
def test_an_epoch_end_checkpoint_under_max_steps_without_validation_resumes_bit_equal(
    tmp_path: Path, saved_by: str
) -> None:
    # Lightning (2.6) restarts the ended epoch of an iteration-based fit and, with no validation
    # to wait for, trained one more batch of it from a new iterator: the epoch's first batch
    # twice, and every later step one batch behind the uninterrupted run.
    _, full = _fit_steps(tmp_path / "full", max_steps=9, limit_val_batches=0)
    if saved_by == "on_train_epoch_end":
        every_epoch = ModelCheckpoint(tmp_path / "ckpts", every_n_epochs=1, save_top_k=-1)
        _fit_steps(tmp_path / "a", max_steps=9, limit_val_batches=0, callbacks=[every_epoch])
        ckpt = tmp_path / "ckpts" / "epoch=0-step=6.ckpt"
    else:
        trainer, _ = _fit_steps(tmp_path / "a", max_epochs=1, limit_val_batches=0)
        ckpt = tmp_path / "after.ckpt"
        trainer.save_checkpoint(ckpt)
    _, resumed = _fit_steps(tmp_path / "b", ckpt, max_steps=9, limit_val_batches=0)
    assert sorted(resumed) == [7, 8, 9]
    for step, got in resumed.items():
        assert got[:5] == full[step][:5], (step, got[:5], full[step][:5])  # batch and LRs
        assert torch.equal(got[5], full[step][5]), step


def test_an_ended_epoch_becomes_the_next_epochs_start_and_nothing_else_is_touched() -> None:
    from lightning_torchrec.compat.lightning_loops import start_next_epoch

    batches = {"ready": 6, "started": 6, "processed": 6, "completed": 6}
    for completed in (0, 1):  # in on_train_epoch_end, or after it
        ended = {"ready": 1, "started": 1, "processed": 1, "completed": completed}
        checkpoint = _loops(ended, batches, 6)
        checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] = True
        assert start_next_epoch(checkpoint) == 1
        fit = checkpoint["loops"]["fit_loop"]
        assert fit["epoch_progress"]["current"] == {
            "ready": 2,
            "started": 1,
            "processed": 1,
            "completed": 1,
        }
        assert fit["epoch_loop.batch_progress"]["total"] == batches  # the global step's count
        assert set(fit["epoch_loop.batch_progress"]["current"].values()) == {0}
        assert fit["epoch_loop.state_dict"]["_batches_that_stepped"] == 6
        assert checkpoint["epoch"] == 1
    within = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    cut = _loops({"ready": 1, "started": 1, "processed": 1, "completed": 1}, batches, 6)
    for other in (cut, _loops(within, batches, 6), {"loops": {"fit_loop": {}}}, {}):
        kept = repr(other)
        assert start_next_epoch(other) is None  # a cut epoch is reopened instead
        assert repr(other) == kept
