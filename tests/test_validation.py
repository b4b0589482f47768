"""Batch validation on hand-made batches, and what TorchRec/fbgemm do without it (one process)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import Batch, DLRMClickModule, TorchRecStrategy, dense_parameters
from lightning_torchrec.data.batch import TensorFields
from lightning_torchrec.errors import BatchValidationError
from lightning_torchrec.sharding.features import FeatureSpec, feature_specs
from lightning_torchrec.sharding.tables import dense_width
from lightning_torchrec.training.batch_checks import validate_batch
from tests.scripts.factory import cpu_trainer, table_wise, tiny_dlrm

ROWS = [10, 20]


def model() -> DLRMClickModule:
    return tiny_dlrm(ROWS, num_dense_features=3)


SPECS = feature_specs(model())


def batch(values: Any = None, lengths: Any = None, keys: Any = None, **kw: Any) -> Batch:
    kjt = KeyedJaggedTensor(
        keys=keys or ["cat_0", "cat_1"],
        values=torch.tensor([1, 2, 3, 19]) if values is None else values,
        lengths=torch.tensor([1, 1, 1, 1]) if lengths is None else lengths,
    )
    fields = {"dense_features": torch.zeros(2, 3), "labels": torch.ones(2)} | kw
    return Batch(sparse_features=kjt, **fields)


def check(b: Any) -> str:
    with pytest.raises(BatchValidationError) as err:
        validate_batch(b, SPECS, num_dense_features=3)
    return str(err.value)


def test_specs_from_the_unsharded_model() -> None:
    assert SPECS["cat_1"].table == "t_cat_1" and SPECS["cat_1"].num_embeddings == 20
    assert dense_width(model()) == 3
    validate_batch(batch(), SPECS, num_dense_features=3)  # a good batch passes


def test_id_past_the_end_names_feature_table_value_and_sample() -> None:
    msg = check(batch(values=torch.tensor([1, 2, 3, 20])))
    assert "'cat_1'" in msg and "'t_cat_1'" in msg and "id 20" in msg and "sample 1" in msg
    msg = check(batch(values=torch.tensor([1, 10, 3, 4])))  # 10 is fine for cat_1, not cat_0
    assert "'cat_0'" in msg and "id 10" in msg and "sample 1" in msg


def test_negative_float_and_mismatched_ids() -> None:
    assert "id -3 (negative)" in check(batch(values=torch.tensor([1, 2, -3, 4])))
    assert "dtype torch.float32" in check(batch(values=torch.tensor([1.0, 2.0, 3.0, 4.0])))
    assert "sum to 5 but there are 4 ids" in check(batch(lengths=torch.tensor([1, 2, 1, 1])))
    assert "negative length" in check(batch(lengths=torch.tensor([2, -1, 2, 1])))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_every_id_is_judged_against_its_own_table_in_both_id_dtypes(dtype: torch.dtype) -> None:
    # One pass per run of same-size tables reads ids as unsigned: a negative id must still fail,
    # in either run, in either dtype, and the extremes of each range must pass.
    validate_batch(batch(values=torch.tensor([0, 9, 0, 19], dtype=dtype)), SPECS, 3)
    for values, culprit in (([-1, 2, 3, 4], "id -1"), ([1, 2, 3, -(2**31)], f"id {-(2**31)}")):
        assert culprit in check(batch(values=torch.tensor(values, dtype=dtype)))
    assert "id 10" in check(batch(values=torch.tensor([1, 10, 3, 4], dtype=dtype)))
    # ids that are a strided view (every other element) are read as they are
    strided = torch.tensor([1, 99, 2, 99, 3, 99, -4, 99], dtype=dtype)[::2]
    assert "id -4" in check(batch(values=strided))
    # an int32 id read as unsigned is >= 2**31 exactly when negative: a table larger than that
    # still refuses it, and takes every non-negative int32 id
    huge = {k: FeatureSpec(k, s.table, 2**32, False) for k, s in SPECS.items()}
    big = torch.tensor([0, 2**31 - 1, 5, 6], dtype=dtype)
    validate_batch(batch(values=big), huge, 3)
    with pytest.raises(BatchValidationError, match="id -7"):
        validate_batch(batch(values=torch.tensor([0, 1, -7, 6], dtype=dtype)), huge, 3)


def test_lengths_per_feature_keys_dtypes_and_weights_each_give_a_named_error() -> None:
    from lightning_torchrec.training.batch_checks import check_batch

    # one sample's length left out: the lengths still sum to the number of ids
    msg = check(batch(values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1])))
    assert "['cat_0', 'cat_1'] have 3 lengths for 2 features" in msg
    assert "appear twice" in check(batch(keys=["cat_0", "cat_0"]))
    assert "dtype torch.uint8" in check(batch(values=torch.tensor([1, 2, 3, 4]).byte()))
    weighted = {
        k: FeatureSpec(k, spec.table, spec.num_embeddings, True) for k, spec in SPECS.items()
    }
    good = batch()
    kjt = good.sparse_features
    for weights, found in (
        (torch.ones(3), "carry 3 weights for 4 ids"),
        (torch.tensor([1.0, float("nan"), 1.0, 1.0]), "non-finite weight nan of id 1"),
    ):
        bad = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights, kjt.lengths())
        with pytest.raises(BatchValidationError, match=found):
            validate_batch(Batch(good.dense_features, bad, good.labels), weighted, 3)
    ok = KeyedJaggedTensor(kjt.keys(), kjt.values(), torch.ones(4), kjt.lengths())
    validate_batch(Batch(good.dense_features, ok, good.labels), weighted, 3)

    # a batch whose own methods fail is a verdict too (agreed across ranks), not a crash
    def broken() -> None:
        raise RuntimeError("shape '[2, 7]' is invalid for input of size 15")

    odd = batch(values=torch.tensor([1, 2, 3, 30]))  # out of range: the per-key counts are read
    odd.sparse_features.length_per_key = broken  # type: ignore[method-assign]
    verdict = check_batch(odd, SPECS, 3, "rank 1, step 2")
    assert verdict is not None
    assert str(verdict) == (
        "rank 1, step 2: the batch could not be read: RuntimeError: shape '[2, 7]' is invalid "
        "for input of size 15"
    )


def unread_batch(cat_0: list[int], cat_1: list[int], order: list[str]) -> Batch:
    """cat_0 and cat_1 (one id per sample) and cat_9, which no table reads, holding ids out of
    range or negative for any table (2 for sample 0, none for sample 1), keys in ``order``."""
    ids = {"cat_0": cat_0, "cat_1": cat_1, "cat_9": [-5, 10**12]}
    lengths = {"cat_0": [1, 1], "cat_1": [1, 1], "cat_9": [2, 0]}
    return batch(
        torch.tensor([i for k in order for i in ids[k]]),
        torch.tensor([n for k in order for n in lengths[k]]),
        order,
    )


def test_features_no_table_reads_are_ignored_named_once_and_read_ones_still_checked() -> None:
    specs = feature_specs(model())  # remembers the features it named
    good = unread_batch([1, 2], [3, 19], ["cat_0", "cat_1", "cat_9"])
    with pytest.warns(UserWarning, match=r"\['cat_9'\] of the batch are read by no table") as w:
        for _ in range(3):  # named once, not at every step
            validate_batch(good, specs, num_dense_features=3)
    assert len([x for x in w if "read by no table" in str(x.message)]) == 1
    # every bad id of a feature a table reads is still refused, wherever the unread one sits
    for order in (["cat_0", "cat_9", "cat_1"], ["cat_9", "cat_0", "cat_1"]):
        validate_batch(unread_batch([1, 2], [3, 19], order), specs, num_dense_features=3)
        for cat_0, cat_1, culprit in (([1, 10], [3, 4], "'cat_0'"), ([1, 2], [-1, 4], "'cat_1'")):
            with pytest.raises(BatchValidationError, match=culprit):
                validate_batch(unread_batch(cat_0, cat_1, order), specs, num_dense_features=3)
    # a feature a table reads that is missing stays an error, unread features or not
    kjt = KeyedJaggedTensor(
        ["cat_0", "cat_9"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0])
    )
    with pytest.raises(BatchValidationError, match=r"\['cat_1'\].*missing"):
        validate_batch(Batch(torch.zeros(2, 3), kjt, torch.ones(2)), specs, num_dense_features=3)


def test_missing_keys() -> None:
    kjt = KeyedJaggedTensor(
        keys=["cat_0"], values=torch.tensor([1, 2]), lengths=torch.ones(2).int()
    )
    msg = check(Batch(torch.zeros(2, 3), kjt, torch.ones(2)))
    assert "['cat_1']" in msg and "'t_cat_1'" in msg and "missing" in msg


def test_dense_labels_and_empty_batches() -> None:
    assert "width 5" in check(batch(dense_features=torch.zeros(2, 5)))
    dense = torch.zeros(2, 3)
    dense[1, 2] = float("nan")
    assert "dense_features[1, 2] is nan" in check(batch(dense_features=dense))
    assert "labels has shape (2, 2)" in check(batch(labels=torch.ones(2, 2)))
    assert "labels has 3 entries" in check(batch(labels=torch.ones(3)))
    empty = KeyedJaggedTensor(
        keys=["cat_0", "cat_1"],
        values=torch.tensor([], dtype=torch.int64),
        lengths=torch.tensor([], dtype=torch.int32),
    )
    assert "empty" in check(Batch(torch.zeros(0, 3), empty, torch.ones(0)))


def test_features_sharing_a_row_count_are_checked_together_and_each_id_against_its_table() -> None:
    rows = {"a": 10, "b": 10, "c": 5, "d": 10, "e": 10}
    specs = {k: FeatureSpec(k, f"t_{k}", n) for k, n in rows.items()}

    def kjt(values: list[int], lengths: list[int]) -> Batch:
        sparse = KeyedJaggedTensor(list(rows), torch.tensor(values), lengths=torch.tensor(lengths))
        return Batch(torch.zeros(2, 3), sparse, torch.ones(2))

    # Two samples; c holds no id, so a, b, d and e form one run: each of its ids must be < 10.
    good = kjt([9, 0, 9, 1, 9, 2, 0, 9], [1, 1, 1, 1, 0, 0, 1, 1, 1, 1])
    validate_batch(good, specs, num_dense_features=3)
    for at, feature in [(0, "a"), (3, "b"), (4, "d"), (7, "e")]:
        values = [9, 0, 9, 1, 9, 2, 0, 9]
        values[at] = 10
        with pytest.raises(BatchValidationError, match=f"feature '{feature}'.*id 10"):
            validate_batch(kjt(values, [1, 1, 1, 1, 0, 0, 1, 1, 1, 1]), specs, 3)
    # With ids, c is its own run: 5 is fine for its neighbours, not for c.
    validate_batch(kjt([9, 0, 9, 1, 4, 4, 9, 2, 0, 9], [1] * 10), specs, 3)
    with pytest.raises(BatchValidationError, match="feature 'c'.*id 5 .*sample 1"):
        validate_batch(kjt([9, 0, 9, 1, 4, 5, 9, 2, 0, 9], [1] * 10), specs, 3)


def test_finite_values_whose_sum_overflows_pass_and_each_non_finite_one_is_named() -> None:
    huge = torch.full((2, 3), 3e38)  # finite; their float32 sum is inf
    validate_batch(batch(dense_features=huge, labels=torch.full((2,), 3e38)), SPECS, 3)
    dense = huge.clone()
    dense[0, 1] = float("-inf")
    assert "dense_features[0, 1] is -inf" in check(batch(dense_features=dense))
    assert "labels[1] is inf" in check(batch(labels=torch.tensor([1.0, float("inf")])))
    assert "weights[0] is nan" in check(batch(weights=torch.tensor([float("nan"), 1.0])))


class _Batches(Dataset):
    def __init__(self, bad_at: int) -> None:
        self.bad_at = bad_at

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Batch:
        return batch(values=torch.tensor([1, 2, 1000 if i == self.bad_at else 3, 4]))


def _fit(validate: Any, bad_at: int) -> L.Trainer:
    strategy = TorchRecStrategy(
        constraints=table_wise(2), log_plan=False, validate_batches=validate
    )
    t = cpu_trainer(strategy, max_steps=6, use_distributed_sampler=False)
    t.fit(model(), DataLoader(_Batches(bad_at), batch_size=None))
    return t


def test_strategy_refuses_the_bad_batch_before_training_on_it() -> None:
    with pytest.raises(BatchValidationError, match=r"rank 0, step 2: feature 'cat_1'.*id 1000"):
        _fit(True, bad_at=2)


def test_fbgemm_alone_trains_through_out_of_range_ids() -> None:
    # Without our check the fused CPU kernel (bounds_check_mode=WARNING) logs the id, replaces it
    # by row 0 and trains on: the run "succeeds". This is what validation exists for.
    assert _fit(False, bad_at=2).global_step == 6
    # validate_batches=N checks only the first N steps.
    assert _fit(2, bad_at=3).global_step == 6
    with pytest.raises(BatchValidationError):
        _fit(2, bad_at=1)


class TwoTowers(nn.Module):
    """Users and items each read a feature named ``"id"``, from tables of different sizes."""

    def __init__(self, user_features: tuple[str, ...], item_features: tuple[str, ...]) -> None:
        super().__init__()

        def tower(prefix: str, rows: dict[str, int]) -> EmbeddingBagCollection:
            tables = [
                EmbeddingBagConfig(
                    name=f"t_{prefix}_{f}", embedding_dim=4, num_embeddings=n, feature_names=[f]
                )
                for f, n in rows.items()
            ]
            return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))

        sizes = {"id": 0, "age": 10, "cat": 5}
        self.users = tower("user", {f: 1000 if f == "id" else sizes[f] for f in user_features})
        self.items = tower("item", {f: 50 if f == "id" else sizes[f] for f in item_features})

    def forward(self, batch: TwoTowerBatch) -> torch.Tensor:
        users = torch.cat(list(self.users(batch.user).to_dict().values()), dim=1)
        items = torch.cat(list(self.items(batch.item).to_dict().values()), dim=1)
        return (users[:, :4] * items[:, :4]).sum(1)


@dataclass
class TwoTowerBatch(TensorFields):
    user: KeyedJaggedTensor
    item: KeyedJaggedTensor
    labels: torch.Tensor


def two_tower_batch(user_ids: list[int], item_ids: list[int], more: bool = True) -> TwoTowerBatch:
    """Two samples, one id each; ``more`` adds ``age`` (users) and ``cat`` (items)."""
    extra = [1, 2] if more else []

    def kjt(ids: list[int], key: str) -> KeyedJaggedTensor:
        keys = ["id", key] if more else ["id"]
        values = torch.tensor(ids + extra)
        return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.ones(len(values)).int())

    return TwoTowerBatch(kjt(user_ids, "age"), kjt(item_ids, "cat"), torch.ones(2))


def test_a_feature_name_two_collections_read_is_checked_against_its_own_collection() -> None:
    """Both towers read "id": every id was checked against the smaller item table (50 rows)."""
    specs = feature_specs(TwoTowers(("id", "age"), ("id", "cat")))
    assert specs["id"].num_embeddings == 50 and specs.shared == {"id"}
    validate_batch(two_tower_batch([700, 3], [49, 0]), specs)  # 700 is a user id: was refused
    with pytest.raises(BatchValidationError, match=r"'id' \(table 't_user_id'\) has id 1000"):
        validate_batch(two_tower_batch([1000, 3], [1, 2]), specs)
    with pytest.raises(BatchValidationError, match=r"'id' \(table 't_item_id'\) has id 60"):
        validate_batch(two_tower_batch([1, 2], [60, 2]), specs)
    copied = pickle.loads(pickle.dumps(specs))  # as DataLoader workers receive it
    assert copied == specs and copied.collections == specs.collections
    validate_batch(two_tower_batch([700, 3], [49, 0]), copied)


def test_a_kjt_whose_keys_match_several_collections_names_every_table_of_its_feature() -> None:
    specs = feature_specs(TwoTowers(("id",), ("id",)))
    with pytest.raises(BatchValidationError) as err:
        validate_batch(two_tower_batch([700, 3], [1, 2], more=False), specs)
    message = str(err.value)
    assert "'id' (table 't_item_id') has id 700 (>= num_embeddings=50)" in message
    assert (
        "'t_user_id' (1000 rows, in users)" in message and "match collections ['users'" in message
    )
    assert "names of their own" in message


def test_a_two_tower_fit_trains_user_ids_beyond_the_item_table() -> None:
    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TwoTowers(("id", "age"), ("id", "cat"))

        def training_step(self, batch: TwoTowerBatch, batch_idx: int) -> torch.Tensor:
            return nn.functional.binary_cross_entropy_with_logits(self.model(batch), batch.labels)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(dense_parameters(self), lr=0.1)

    batches = [two_tower_batch([700 + i, 999], [49, i]) for i in range(3)]
    trainer = cpu_trainer(TorchRecStrategy(log_plan=False), max_steps=3, limit_val_batches=0)
    trainer.fit(Module(), train_dataloaders=DataLoader(batches, batch_size=None))
    assert trainer.global_step == 3
