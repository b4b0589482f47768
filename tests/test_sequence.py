"""The sequence recommender: MovieLens files, leave-last-out batches, SASRec, ranking metrics.

One-process tests here; the 2-rank training, resume and resharding are in
``test_sequence_multiprocess.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.data import resumable
from lightning_torchrec.data.movielens import (
    UserSequences,
    best_achievable,
    cycle_structure,
    read_ratings,
    write_cycle_ratings,
)
from lightning_torchrec.data.sequence_batch import SequenceBatch, sequence_batch
from lightning_torchrec.data.sequences import (
    MovieLensSequenceData,
    NextItemEvalDataset,
    NextItemTrainDataset,
    leave_last_out,
)
from lightning_torchrec.demo_seq import split_sharding
from lightning_torchrec.errors import BatchValidationError
from lightning_torchrec.lightning.sequence import EvalLoss, SASRecModule
from lightning_torchrec.models.sequence import NextItemModelAndLoss, SASRec, padded, target_ranks
from lightning_torchrec.sharding.features import feature_specs
from lightning_torchrec.sharding.setup_checks import (
    check_constraints_for_device,
    device_constraints,
)
from lightning_torchrec.training.batch_checks import check_batch
from lightning_torchrec.training.device_checks import FLAGS, device_flags
from lightning_torchrec.training.ranking import RankingMetrics, popularity_ranks, ranking_values
from tests.scripts.factory import cpu_trainer

# user 1: items 10, 30, 20, 40 at times 5, 1, 3, 9 (tie-free); user 2: 30, 10, 50 with a tie
# (times 2, 2, 4: file order decides); user 3 has 2 interactions and is dropped.
DAT = "1::10::5::5\n2::30::3::2\n1::30::4::1\n1::20::1::3\n2::10::2::2\n3::10::1::1\n1::40::3::9\n"
DAT += "2::50::5::4\n3::20::2::2\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_both_layouts_read_to_time_ordered_sequences(tmp_path: Path) -> None:
    dat = read_ratings(write(tmp_path, "ratings.dat", DAT))
    lines = [line.split("::") for line in DAT.splitlines()]
    csv_text = "userId,movieId,rating,timestamp\n" + "\n".join(",".join(x) for x in lines)
    csv = read_ratings(write(tmp_path, "ratings.csv", csv_text + "\n"))
    for seqs in (dat, csv):
        assert seqs.user_ids.tolist() == [1, 2]
        assert seqs.item_ids.tolist() == [10, 20, 30, 40, 50]
        raw = [seqs.item_ids[seqs.sequence(u)].tolist() for u in range(seqs.num_users)]
        assert raw == [[30, 20, 10, 40], [30, 10, 50]]


@pytest.mark.parametrize(
    "header", ["\ufeffuserId,movieId,rating,timestamp", "userId, movieId, rating, timestamp"]
)
def test_a_csv_header_with_a_byte_order_mark_or_spaces_reads_as_checked(
    tmp_path: Path, header: str
) -> None:
    # A byte-order mark (Excel's "CSV UTF-8") was refused as another header; spaces after the
    # commas passed the header check, then failed with a bare KeyError of pyarrow's schema.
    lines = [line.split("::") for line in DAT.splitlines()]
    text = header + "\n" + "\n".join(",".join(x) for x in lines) + "\n"
    seqs = read_ratings(write(tmp_path, "ratings.csv", text))
    assert seqs.user_ids.tolist() == [1, 2] and seqs.item_ids.tolist() == [10, 20, 30, 40, 50]


def test_other_layouts_and_bad_columns_are_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"bad\.csv.*expected a ratings\.csv header"):
        read_ratings(write(tmp_path, "bad.csv", "user,item,rating,time\n1,2,3,4\n"))
    with pytest.raises(ValueError, match=r"float\.dat: the user column holds double"):
        read_ratings(write(tmp_path, "float.dat", "1.5::2::3::4\n"))
    with pytest.raises(ValueError, match=r"short\.csv: CSV parse error: Expected 4 columns"):
        read_ratings(write(tmp_path, "short.csv", "userId,movieId,rating,timestamp\n1,2,3\n"))
    with pytest.raises(ValueError, match=r"few\.dat: no user has 3 interactions"):
        read_ratings(write(tmp_path, "few.dat", "1::2::3::4\n"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty holds neither ratings.dat nor ratings.csv"):
        MovieLensSequenceData(str(tmp_path / "empty"))


def test_generated_files_follow_their_structure(tmp_path: Path) -> None:
    structure = write_cycle_ratings(
        tmp_path / "ratings.csv", num_users=300, num_items=50, noise=0.25, seed=4
    )
    again = cycle_structure(50, 0.25, 1.0, 4)
    assert np.array_equal(structure.successor, again.successor)
    seqs = read_ratings(tmp_path / "ratings.csv")
    assert seqs.num_items == 50 and seqs.num_users == 300
    follows = [
        np.mean(structure.successor[s[:-1]] == s[1:])
        for s in (seqs.sequence(u) for u in range(seqs.num_users))
    ]
    # P(next == successor) = (1 - noise) + noise * popularity(successor).
    assert 0.74 < float(np.mean(follows)) < 0.82


def test_best_achievable_is_exact_at_the_extremes() -> None:
    none = cycle_structure(20, noise=0.0)
    assert best_achievable(none, np.arange(20), k=10) == {"recall": 1.0, "ndcg": 1.0}
    pure = cycle_structure(20, noise=1.0, popularity_skew=1.0)
    top = np.sort(pure.popularity)[::-1]
    best = best_achievable(pure, np.arange(5), k=3)
    assert best["recall"] == pytest.approx(top[:3].sum())
    assert best["ndcg"] == pytest.approx((top[:3] / np.log2([2, 3, 4])).sum())


def test_leave_last_out_splits_and_truncates(tmp_path: Path) -> None:
    seqs = read_ratings(write(tmp_path, "ratings.dat", DAT))
    # user 1 (index 0) = [30, 20, 10, 40] -> indices [2, 1, 0, 3]; user 2 = [2, 0, 4].
    starts, targets = leave_last_out(seqs, "train")
    assert seqs.items[targets].tolist() == [1]  # only user 1 has a training sample
    assert seqs.items[starts[0] : targets[0]].tolist() == [2]
    _, targets = leave_last_out(seqs, "val")
    assert seqs.items[targets].tolist() == [0, 0]
    data = MovieLensSequenceData(str(tmp_path), max_length=2, batch_size=1)
    batch = next(iter(data.dataset("test")))
    kjt = batch.sparse_features
    assert kjt["item_seq"].values().tolist() == [1, 0] and batch.labels.tolist() == [3]
    assert kjt["item_target"].values().tolist() == [3]
    assert kjt["item_candidates"].lengths().tolist() == [5]
    with pytest.raises(ValueError, match="split must be one of"):
        leave_last_out(seqs, "predict")


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> UserSequences:
    path = tmp_path_factory.mktemp("gen") / "ratings.dat"
    write_cycle_ratings(path, num_users=100, num_items=30, min_length=5, max_length=12)
    return read_ratings(path)


def fingerprints(batches: list) -> list[tuple]:
    return [
        (tuple(b.labels.tolist()), tuple(b.sparse_features["item_candidates"].values().tolist()))
        for b in batches
    ]


def test_training_batches_resume_mid_epoch_and_split_the_ranks(generated: UserSequences) -> None:
    def dataset(rank: int = 0, world: int = 1, epoch: int = 0) -> NextItemTrainDataset:
        ds = NextItemTrainDataset(generated, 8, 4, 5, seed=1, rank=rank, world_size=world)
        ds.epoch = epoch
        return ds

    full = list(dataset())
    assert len(full) == len(dataset()) == 100 // 8
    resumed = dataset()
    resumed.start_batch = 5  # what its loader sets on a resume
    assert fingerprints(list(resumed)) == fingerprints(full[5:])
    assert fingerprints(list(dataset(epoch=1))) != fingerprints(full)
    ranks = [list(dataset(r, 2)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 100 // 8 // 2
    dealt = [full[i] for i in (*range(0, 12, 2), *range(1, 12, 2))]
    assert fingerprints(ranks[0] + ranks[1]) == fingerprints(dealt)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("batch_size", 0), ("num_negatives", 0), ("eval_batch_size", -1), ("max_length", 0)],
)
def test_sizes_that_are_not_positive_are_refused_by_name(
    tmp_path: Path, generated: UserSequences, argument: str, value: int
) -> None:
    # batch_size=0 divided by zero, num_negatives=0 trained on a loss of 0, and a negative
    # eval_batch_size evaluated no user at all (one padding sample).
    path = write(tmp_path, "ratings.dat", DAT)
    with pytest.raises(ValueError, match=f"{argument} must be a positive integer, got {value}"):
        MovieLensSequenceData(str(path), **{argument: value})
    with pytest.raises(ValueError, match="num_negatives must be a positive integer"):
        NextItemTrainDataset(generated, batch_size=8, max_length=4, num_negatives=0)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        NextItemEvalDataset(generated, "val", batch_size=-1, max_length=4)


def test_evaluation_covers_every_user_once_with_equal_batches_per_rank(
    generated: UserSequences,
) -> None:
    ranks = [list(NextItemEvalDataset(generated, "test", 16, 6, r, 2)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 4  # ceil(100 / 32)
    weights = torch.cat([b.weights for rank in ranks for b in rank])
    assert float(weights.sum()) == 100 and len(weights) == 101  # one padding sample, weight 0
    for batch in ranks[0] + ranks[1]:
        assert batch.sparse_features["item_candidates"].values().tolist() == list(range(30))
        assert int(batch.sparse_features["item_seq"].lengths().max()) <= 6


def naive_loss(model: SASRec, batch) -> torch.Tensor:
    """The sampled softmax, position by position, in plain loops."""
    out = model(batch.sparse_features)
    seq = batch.sparse_features["item_seq"]
    ids = torch.split(seq.values(), seq.lengths().tolist())
    cand = batch.sparse_features["item_candidates"].values()
    losses = []
    for b, history in enumerate(ids):
        following = [*history[1:].tolist(), int(batch.labels[b])]
        for t, nxt in enumerate(following):
            state = out["states"][b, t]
            pos = (state * model.item_embeddings.embeddings["t_item"].weight[nxt]).sum()
            negs = [
                (state * model.item_embeddings.embeddings["t_item"].weight[c]).sum()
                for c in cand.tolist()
                if c != nxt
            ]
            losses.append(torch.logsumexp(torch.stack([pos, *negs]), 0) - pos)
    return torch.stack(losses).mean()


def test_sampled_softmax_targets_the_next_item_of_every_position() -> None:
    torch.manual_seed(0)
    model = SASRec(12, embedding_dim=8, max_length=4, num_heads=2, device="cpu")
    histories = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6, 7, 8])]
    batch = sequence_batch(histories, np.array([4, 5, 9]), np.array([0, 4, 9, 11, 3]))
    loss, outputs = NextItemModelAndLoss(model)(batch)
    torch.testing.assert_close(loss, naive_loss(model, batch), rtol=1e-5, atol=1e-6)
    assert outputs["labels"].tolist() == [4, 5, 9] and outputs["scores"].shape == (3, 5)
    assert outputs["ranks"][1] == 5  # 5 is not among the candidates: a miss


def test_states_are_causal() -> None:
    torch.manual_seed(0)
    model = SASRec(12, embedding_dim=8, max_length=4, device="cpu")
    a = sequence_batch([np.array([1, 2, 3])], np.array([4]), np.array([0]))
    b = sequence_batch([np.array([1, 2, 7])], np.array([4]), np.array([0]))
    sa, sb = (model(x.sparse_features)["states"] for x in (a, b))
    # Only the state after the changed (last) item may change.
    assert torch.equal(sa[0, :2], sb[0, :2])
    assert not torch.allclose(sa[0, 2], sb[0, 2])


def test_ranks_count_ties_against_the_target() -> None:
    scores = torch.tensor([[1.0, 1.0, 0.5], [0.1, 0.9, 0.2]])
    ranks = target_ranks(scores, torch.tensor([7, 8, 9]), torch.tensor([7, 9]))
    assert ranks.tolist() == [1, 1]


def test_ranking_metrics_match_the_definitions() -> None:
    ranks = torch.tensor([0, 3, 9, 10, 50])
    weights = torch.tensor([1.0, 2.0, 1.0, 1.0, 0.0])
    metric = RankingMetrics([1, 10])
    metric.update(ranks[:2], weights[:2])
    metric.update(ranks[2:], weights[2:])
    got = metric.compute()
    want = ranking_values(ranks, [1, 10], weights)
    assert got["recall@10"] == pytest.approx(4 / 5)
    assert got["ndcg@10"] == pytest.approx((1 + 2 / np.log2(5) + 1 / np.log2(11)) / 5)
    for name, value in want.items():
        assert float(got[name]) == pytest.approx(float(value))
    with pytest.raises(ValueError, match="positive cut-offs"):
        RankingMetrics([0])


def test_popularity_ranks_count_ties_against_the_target() -> None:
    train = np.array([0, 0, 0, 1, 1, 2, 2, 3])
    assert popularity_ranks(train, np.array([0, 1, 2, 3, 4]), 5).tolist() == [0, 2, 2, 3, 4]


def test_row_wise_sequence_tables_are_allowed_on_cpu_only_when_asked() -> None:
    model = NextItemModelAndLoss(SASRec(10))
    row_wise = {"t_item": ParameterConstraints(sharding_types=["row_wise"])}
    check_constraints_for_device(row_wise, "cpu", model)
    assert device_constraints(model, row_wise, "cpu")["t_item"].sharding_types == ["row_wise"]
    assert "row_wise" not in device_constraints(model, None, "cpu")["t_item"].sharding_types
    with pytest.raises(ValueError, match="needs CUDA"):
        check_constraints_for_device(row_wise, "cpu")  # without the model: a bag table


def test_demo_sharding_choice() -> None:
    assert split_sharding(["--sharding", "row_wise", "--x", "1"]) == ("row_wise", ["--x", "1"])
    assert split_sharding(["--sharding=column_wise"]) == ("column_wise", [])
    with pytest.raises(SystemExit, match="must be one of"):
        split_sharding(["--sharding", "grid"])


def row_wise_strategy() -> TorchRecStrategy:
    return TorchRecStrategy(
        constraints={"t_item": ParameterConstraints(sharding_types=["row_wise"])}, log_plan=False
    )


def loader(batches: list) -> DataLoader:
    return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def test_a_history_over_max_length_is_refused_naming_feature_sample_and_length() -> None:
    rng = np.random.default_rng(0)
    histories = [rng.integers(0, 40, 12), rng.integers(0, 40, 3)]
    batch = sequence_batch(histories, np.array([1, 2]), rng.integers(0, 40, 10))
    specs = feature_specs(NextItemModelAndLoss(SASRec(40, max_length=8)))
    assert specs["item_seq"].max_ids == 8 and specs["item_target"].max_ids == 1
    found = check_batch(batch, specs, None, "rank 0, step 3")
    assert isinstance(found, BatchValidationError)
    assert str(found).startswith("rank 0, step 3: feature 'item_seq' (table 't_item') has 12 ")
    assert "in sample 0, more than the 8" in str(found)
    # Under the strategy: refused before the forward, by name (was a bare IndexError).
    L.seed_everything(0)
    model = SASRecModule(40, embedding_dim=8, max_length=8, num_heads=2)
    trainer = cpu_trainer(row_wise_strategy(), max_steps=1, limit_val_batches=0)
    with pytest.raises(BatchValidationError, match=r"rank 0, step 0: feature 'item_seq'.* 12 ids"):
        trainer.fit(model, loader([batch]), loader([batch]))


def _without_target(batch: SequenceBatch, sample: int) -> SequenceBatch:
    """``batch`` with the ``item_target`` id of ``sample`` removed (its length 0)."""
    kjt = batch.sparse_features
    keys, stride = kjt.keys(), kjt.stride()
    lengths = kjt.lengths().clone()
    position = sum(kjt.length_per_key()[: keys.index("item_target")]) + sample
    lengths[keys.index("item_target") * stride + sample] = 0
    values = torch.cat([kjt.values()[:position], kjt.values()[position + 1 :]])
    features = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    return dataclasses.replace(batch, sparse_features=features)


def test_a_sample_without_its_target_is_refused_on_host_and_device() -> None:
    # It used to train: the other sample's target was broadcast over both rows of the loss.
    rng = np.random.default_rng(0)
    good = sequence_batch(
        [rng.integers(0, 40, 5), rng.integers(0, 40, 3)], np.array([1, 2]), rng.integers(0, 40, 10)
    )
    bad = _without_target(good, 1)
    specs = feature_specs(NextItemModelAndLoss(SASRec(40, max_length=8)))
    assert specs["item_target"].min_ids == 1 and specs["item_seq"].min_ids == 0
    assert check_batch(good, specs, None, "rank 0, step 0") is None
    found = check_batch(bad, specs, None, "rank 0, step 2")
    assert isinstance(found, BatchValidationError)
    assert str(found).startswith("rank 0, step 2: feature 'item_target' (table 't_item') has 0 ")
    assert "in sample 1, fewer than the 1" in str(found)
    flags = dict(zip(FLAGS, device_flags(bad, specs)[: len(FLAGS)].tolist(), strict=True))
    assert flags["too_short"] == 1 and flags["too_long"] == 0
    assert device_flags(good, specs)[: len(FLAGS)].tolist() == [0] * len(FLAGS)
    L.seed_everything(0)
    model = SASRecModule(40, embedding_dim=8, max_length=8, num_heads=2)
    trainer = cpu_trainer(row_wise_strategy(), max_steps=2, limit_val_batches=0)
    with pytest.raises(BatchValidationError, match=r"rank 0, step 1: feature 'item_target'"):
        trainer.fit(model, loader([good, bad]), loader([good]))


def test_a_long_history_that_reaches_the_model_is_read_from_its_last_items() -> None:
    # A batch checked on the GPU is judged a step later: its forward must not fail meanwhile.
    values = torch.arange(13, dtype=torch.float32).unsqueeze(1)
    block = padded(values, torch.tensor([3, 10]), 4).squeeze(2)
    assert block.tolist() == [[0, 1, 2, 0], [9, 10, 11, 12]]
    torch.manual_seed(0)
    model = SASRec(20, embedding_dim=8, max_length=4, num_heads=2, device="cpu")
    long = sequence_batch([np.arange(1, 11), np.array([3])], np.array([4, 5]), np.arange(20))
    short = sequence_batch([np.arange(7, 11), np.array([3])], np.array([4, 5]), np.arange(20))
    a, b = (model(x.sparse_features) for x in (long, short))
    assert a["lengths"].tolist() == [4, 1]
    assert torch.equal(a["states"], b["states"])
    loss_long, _ = NextItemModelAndLoss(model)(long)
    assert torch.equal(loss_long, NextItemModelAndLoss(model)(short)[0])


def merged(batches: list[SequenceBatch]) -> SequenceBatch:
    """One batch holding every sample of weight > 0 of ``batches``."""
    histories, labels = [], []
    for b in batches:
        seq = b.sparse_features["item_seq"]
        for history, label, weight in zip(
            torch.split(seq.values(), seq.lengths().tolist()), b.labels, b.weights, strict=True
        ):
            if weight > 0:
                histories.append(history.numpy())
                labels.append(int(label))
    catalogue = batches[0].sparse_features["item_candidates"].values().numpy()
    return sequence_batch(histories, np.array(labels), catalogue, np.ones(len(labels)))


def validate(num_items: int, batches: list) -> dict[str, float]:
    L.seed_everything(0)
    model = SASRecModule(num_items, embedding_dim=8, max_length=6, num_heads=2)
    trainer = cpu_trainer(row_wise_strategy())
    return trainer.validate(model, dataloaders=loader(batches), verbose=False)[0]


def test_val_loss_is_the_loss_over_every_real_position_padding_left_out(
    generated: UserSequences,
) -> None:
    # What rank 1 of 2 reads: uneven batches, the last one a padding sample of weight 0.
    batches = list(NextItemEvalDataset(generated, "val", 6, 6, rank=1, world_size=2))
    assert [float(b.weights.sum()) for b in batches[-2:]] == [6, 0]
    lengths = {int(b.sparse_features["item_seq"].lengths().sum()) for b in batches[:-1]}
    assert len(lengths) > 1  # batches of different position counts
    split = validate(generated.num_items, batches)
    whole = validate(generated.num_items, [merged(batches)])
    # The padding sample pulled val/loss down (x 48/49), and batches were averaged per sample.
    assert split["val/loss"] == pytest.approx(whole["val/loss"], rel=1e-5)
    assert split["val/recall@10"] == pytest.approx(whole["val/recall@10"], abs=1e-6)


def test_eval_loss_weighs_batches_by_their_positions_and_ignores_weight_zero() -> None:
    metric = EvalLoss()
    metric.update(torch.tensor(2.0), torch.tensor(3.0))
    metric.update(torch.tensor(float("nan")), torch.tensor(0.0))  # padding only: nothing
    metric.update(torch.tensor(1.0), torch.tensor(1.0))
    assert float(metric.compute()) == pytest.approx(7 / 4)


def test_without_a_trainer_the_process_group_splits_the_data_and_each_pass_is_an_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a Fabric loop every rank read every batch, and every epoch in the same order."""
    path = tmp_path / "ratings.dat"
    write_cycle_ratings(path, num_users=100, num_items=30, min_length=5, max_length=12)
    loaders = []
    for rank in (0, 1):
        group = SimpleNamespace(
            is_available=lambda: True,
            is_initialized=lambda: True,
            get_rank=lambda rank=rank: rank,
            get_world_size=lambda: 2,
        )
        monkeypatch.setattr(resumable, "dist", group)
        data = MovieLensSequenceData(str(path), batch_size=8, max_length=4)
        assert data.rank_and_world() == (rank, 2)
        loaders.append(data.train_dataloader())
    first = [fingerprints(list(loader)) for loader in loaders]
    assert len(first[0]) == len(first[1]) == 100 // 8 // 2  # each rank its half
    assert not set(first[0]) & set(first[1])
    second = fingerprints(list(loaders[0]))
    assert second != first[0] and sorted(second) != sorted(first[0])  # epoch 1: reshuffled
    monkeypatch.setattr(resumable, "dist", SimpleNamespace(is_available=lambda: False))
    assert MovieLensSequenceData(str(path)).rank_and_world() == (0, 1)
