"""Feature-processed tables (``FeatureProcessedEmbeddingBagCollection``) under the batch checks.

The collection's feature processors make the weights its (weighted) tables read, so the batch
needs none; a ``PositionWeightedModule(max_feature_length=N)`` looks each id's weight up by its
position in its sample, so a sample may hold at most ``N`` ids of the feature. One process.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.feature_processor_ import (
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import Batch, ModelAndLoss, TorchRecModule, TorchRecStrategy
from lightning_torchrec.errors import BatchValidationError
from lightning_torchrec.sharding.features import feature_specs
from lightning_torchrec.training.batch_checks import check_batch, validate_batch, worker_verdict
from lightning_torchrec.training.device_checks import FLAGS, DeferredVerdict, device_flags
from lightning_torchrec.training.worker_checks import CheckingCollate
from tests.scripts.factory import cpu_trainer, table_wise

ROWS = 20
LIMIT = 3
DENSE = 3
BY = f"PositionWeightedModule(max_feature_length={LIMIT})"


def tables(names: list[str], weighted: bool = True, rows: int = ROWS) -> EmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=f"t_{name}", embedding_dim=4, num_embeddings=rows, feature_names=[name]
        )
        for name in names
    ]
    return EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device("meta"))


def fpebc(names: list[str], limit: int = LIMIT) -> FeatureProcessedEmbeddingBagCollection:
    processors = {name: PositionWeightedModule(max_feature_length=limit) for name in names}
    return FeatureProcessedEmbeddingBagCollection(tables(names), processors)


class FPModel(nn.Module):
    """Dense features and the pooled embeddings of an FPEBC (``cat_0``, ``cat_1``), one logit."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = fpebc(["cat_0", "cat_1"])
        self.head = nn.Linear(DENSE + 8, 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(torch.cat([dense, self.ebc(kjt).values()], 1))


def module() -> TorchRecModule:
    torch.manual_seed(0)
    return TorchRecModule(ModelAndLoss(FPModel()), optimizer=lambda p: torch.optim.Adam(p, 1e-2))


SPECS = feature_specs(module())


def batch(lengths: list[int], weights: list[float] | None = None, seed: int = 0) -> Batch:
    """Two features of ``len(lengths) // 2`` samples each, without weights unless given."""
    g = torch.Generator().manual_seed(seed)
    n, samples = sum(lengths), len(lengths) // 2
    kjt = KeyedJaggedTensor(
        keys=["cat_0", "cat_1"],
        values=torch.randint(0, ROWS, (n,), generator=g),
        lengths=torch.tensor(lengths),
        weights=None if weights is None else torch.tensor(weights),
    )
    dense = torch.randn(samples, DENSE, generator=g)
    labels = torch.randint(0, 2, (samples,), generator=g).float()
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


GOOD = [1, 3, 2, 3, 1, 2]  # cat_0: samples of 1, 3, 2 ids; cat_1: 3, 1, 2
TOO_LONG = [1, 3, 2, 3, 4, 2]  # cat_1's sample 1 holds 4 ids


def test_processed_features_need_no_weights_and_are_limited_by_their_position_weights() -> None:
    for feature in ("cat_0", "cat_1"):
        spec = SPECS[feature]
        assert spec.table == f"t_{feature}" and not spec.weighted
        assert spec.max_ids == LIMIT and spec.max_ids_from == BY

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.plain = tables(["cat_0"], rows=50)  # reads the batch's weights of cat_0
            self.fp = fpebc(["cat_0", "cat_1"], limit=5)
            self.collection = FeatureProcessedEmbeddingBagCollection(
                tables(["cat_2", "cat_3"]), PositionWeightedModuleCollection({"cat_2": 2})
            )
            self.max_ids_per_sample = {"cat_1": 4}  # declared: smaller than the processor's

    specs = feature_specs(Mixed())
    assert specs["cat_0"].weighted and specs["cat_0"].table == "t_cat_0"
    assert specs["cat_0"].max_ids == 5
    assert not specs["cat_1"].weighted  # the plain table's weighted flag stays its own
    assert (specs["cat_1"].max_ids, specs["cat_1"].max_ids_from) == (4, "max_ids_per_sample")
    assert not specs["cat_2"].weighted and specs["cat_2"].max_ids == 2
    assert specs["cat_2"].max_ids_from == (
        "PositionWeightedModuleCollection(max_feature_lengths={'cat_2': 2})"
    )
    assert not specs["cat_3"].weighted and specs["cat_3"].max_ids is None


def test_a_batch_passes_without_weights_and_with_weights_torchrec_does_not_read() -> None:
    validate_batch(batch(GOOD), SPECS, DENSE)  # was: "... carries no weights"
    # TorchRec replaces the batch's weights by the processors' (even non-finite ones): valid.
    nan = [1.0] * 11 + [math.nan] * 1
    validate_batch(batch(GOOD, weights=nan), SPECS, DENSE)
    fp = fpebc(["cat_0", "cat_1"]).to_empty(device="cpu")
    for parameter in fp.parameters():
        nn.init.uniform_(parameter)
    without = fp(batch(GOOD).sparse_features).values()
    assert torch.equal(fp(batch(GOOD, weights=nan).sparse_features).values(), without)
    # Weights that do not match the ids cannot be split by feature: still refused.
    with pytest.raises(BatchValidationError, match="carry 3 weights for 12 ids"):
        validate_batch(batch(GOOD, weights=[1.0] * 3), SPECS, DENSE)


def test_weights_a_weighted_table_reads_must_be_finite_beside_processed_ones() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.plain = tables(["cat_0"])
            self.fp = fpebc(["cat_1"])

    specs = feature_specs(Mixed())
    assert specs["cat_0"].weighted and not specs["cat_1"].weighted
    unread = [1.0] * 6 + [math.nan] * 6  # cat_1's weights: made by its processor
    validate_batch(batch(GOOD, weights=unread), specs, DENSE)
    read = [1.0, math.inf] + [1.0] * 10  # cat_0's: read by its weighted table
    with pytest.raises(BatchValidationError, match="non-finite weight inf of id 1"):
        validate_batch(batch(GOOD, weights=read), specs, DENSE)
    with pytest.raises(BatchValidationError, match=r"\['cat_0'\] are read by weighted table"):
        validate_batch(batch(GOOD), specs, DENSE)


def test_a_sample_over_the_position_limit_is_refused_by_name_on_host_device_and_workers() -> None:
    bad = batch(TOO_LONG)
    # Unchecked, TorchRec's processor fails deep inside with a bare index error.
    fp = fpebc(["cat_0", "cat_1"]).to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="out of bounds"):
        fp(bad.sparse_features)
    expected = (
        f"rank 0, step 4: feature 'cat_1' (table 't_cat_1') has 4 ids in sample 1, more than "
        f"the {LIMIT} the model reads per sample ({BY}); 1 sample(s) of this batch are over it."
    )
    found = check_batch(bad, SPECS, DENSE, "rank 0, step 4")
    assert isinstance(found, BatchValidationError) and str(found).startswith(expected)
    assert check_batch(batch(GOOD), SPECS, DENSE, "rank 0, step 4") is None
    # On the device (batch_checks="next_step"): counted, then named by the host check.
    flags = dict(zip(FLAGS, device_flags(bad, SPECS)[: len(FLAGS)].tolist(), strict=True))
    assert flags["too_long"] == 1 and sum(flags.values()) == 1
    deferred = DeferredVerdict(SPECS, DENSE)
    deferred.submit(bad, "rank 0, step 4")
    assert str(deferred.verdict()).startswith(expected)
    deferred.submit(batch(GOOD), "rank 0, step 5")
    assert deferred.verdict() is None
    # In a DataLoader worker: the same verdict.
    collate = CheckingCollate(lambda b: b, SPECS, DENSE, token="fp")
    assert worker_verdict(collate(batch(GOOD)), "fp") is None
    assert f"rank 0, step 4: {worker_verdict(collate(bad), 'fp')}".startswith(expected)


def _fit(batches: list[Batch], steps: int) -> TorchRecModule:
    L.seed_everything(0)
    model = module()
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False)  # default checks
    trainer = cpu_trainer(strategy, max_steps=steps, use_distributed_sampler=False)
    trainer.fit(model, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    assert trainer.global_step == steps
    return model


def test_an_fpebc_model_trains_with_the_default_checks() -> None:
    batches = [batch(GOOD, seed=i) for i in range(4)]
    model = _fit(batches, steps=4)
    positions = {
        name: p.detach() for name, p in model.named_parameters() if name.endswith("position_weight")
    }
    assert len(positions) == 2  # the processors' weights trained (they start at 1)
    assert all(
        torch.isfinite(p).all() and not torch.equal(p, torch.ones(LIMIT))
        for p in positions.values()
    )


def test_a_too_long_sample_stops_training_naming_feature_table_and_limit() -> None:
    batches = [batch(GOOD, seed=0), batch(GOOD, seed=1), batch(TOO_LONG, seed=2)]
    pattern = (
        r"rank 0, step 2: feature 'cat_1' \(table 't_cat_1'\) has 4 ids in sample 1, more than "
        rf"the {LIMIT} the model reads per sample \(PositionWeightedModule"
    )
    with pytest.raises(BatchValidationError, match=pattern):
        _fit(batches, steps=3)
