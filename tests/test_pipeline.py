"""TorchRec's train pipelines under Lightning (tests/scripts/pipeline_ranks.py).

Two real gloo ranks train the same model with ``pipeline=None``, ``"sparse_dist"`` and
``"semi_sync"``. The sparse-dist run, and a semi-sync run before its ``start_batch``, must be the
same computation as the unpipelined one, bit for bit; after ``start_batch`` the semi-sync run
looks the tables up one update late and must track the synchronous loss. Each pipelined Trainer
run must also equal TorchRec's own ``progress()`` loop on the same model, data and optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_torchrec import TorchRecStrategy, combine_optimizers, dense_parameters
from lightning_torchrec.data.batch import TensorFields
from tests.helpers import assert_same, load_ranks, run_script
from tests.scripts.factory import QUIET, tiny_data


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    run_script("pipeline_ranks.py", str(out), timeout=300)
    return out


@pytest.mark.parametrize("tag", ["sparse_dist", "semi_sync_late"])
def test_synchronous_pipelines_are_bit_equal_to_the_unpipelined_path(run: Path, tag: str) -> None:
    plain, piped = load_ranks(run, "None"), load_ranks(run, tag)
    for rank in range(2):
        assert plain[rank]["steps"] == piped[rank]["steps"] == 60
        assert len(plain[rank]["train"]) == len(piped[rank]["train"]) == 60
        for step, (a, b) in enumerate(zip(plain[rank]["train"], piped[rank]["train"], strict=True)):
            assert torch.equal(a, b), f"rank {rank} step {step + 1}: {a} != {b}"
        # Validation in between (every 20 steps, across epochs) sees the same model.
        assert len(plain[rank]["val"]) == 3 and plain[rank]["val"] == piped[rank]["val"]
        # Tables, dense weights: identical at the end; so are predictions (eval pipeline).
        assert_same(plain[rank]["state"], piped[rank]["state"], f"rank{rank}")
        assert len(plain[rank]["preds"]) == 2
        assert_same(plain[rank]["preds"], piped[rank]["preds"], f"rank{rank}/preds")


@pytest.mark.parametrize("pipeline", ["sparse_dist", "semi_sync"])
def test_pipelines_are_bit_equal_to_torchrecs_own_pipelined_loops(run: Path, pipeline: str) -> None:
    for r in load_ranks(run, f"torchrec_{pipeline}"):
        assert len(r["lightning"]) == len(r["torchrec"]) == 30
        for step, (a, b) in enumerate(zip(r["lightning"], r["torchrec"], strict=True)):
            assert torch.equal(a, b), f"step {step + 1}: Trainer {a} != TorchRec loop {b}"


@pytest.mark.parametrize("tag", ["sparse_dist", "semi_sync"])
def test_the_pipeline_really_pipelines_the_sharded_tables(run: Path, tag: str) -> None:
    for r in load_ranks(run, tag):
        assert r["pipelined"] == 1  # the DLRM's sharded EmbeddingBagCollection
        assert r["unpipelined"] == []
        assert r["eval_pipelined"] == 1  # validation and predict ran through a pipeline too


def test_semi_sync_tracks_the_synchronous_loss(run: Path) -> None:
    plain, semi = load_ranks(run, "None"), load_ranks(run, "semi_sync")
    for rank in range(2):
        a, b = torch.stack(plain[rank]["train"]), torch.stack(semi[rank]["train"])
        assert a.shape == b.shape == (60,)
        # Synchronous up to start_batch (10): the same steps, bit for bit.
        assert torch.equal(a[:10], b[:10])
        # From there the tables are read one update late: really different steps...
        assert not torch.equal(a[10:], b[10:])
        # ...that track the synchronous curve (measured: max |gap| 3e-3 on losses ~0.65).
        gap = (a - b).abs()
        assert gap.max() < 0.02, f"rank {rank}: semi-sync drifted by {gap.max():.4f}"
        assert abs(a[-20:].mean() - b[-20:].mean()) < 0.005
        for va, vb in zip(plain[rank]["val"], semi[rank]["val"], strict=True):
            assert abs(va - vb) / va < 0.01, (plain[rank]["val"], semi[rank]["val"])


def test_pipeline_refuses_gradient_accumulation_and_unknown_names() -> None:
    with pytest.raises(ValueError, match="pipeline must be one of"):
        TorchRecStrategy(pipeline="async")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pipeline_options\['start_bach'\] is not an option"):
        TorchRecStrategy(pipeline="semi_sync", pipeline_options={"start_bach": 3})
    with pytest.raises(ValueError, match="dense part is always synchronous"):
        TorchRecStrategy(pipeline="semi_sync", pipeline_options={"stash_gradients": True})
    with pytest.raises(ValueError, match="takes none"):
        TorchRecStrategy(pipeline="sparse_dist", pipeline_options={"start_batch": 3})
    with pytest.raises(ValueError, match="must be an int >= 0, got -1"):
        TorchRecStrategy(pipeline="semi_sync", pipeline_options={"start_batch": -1})
    from tests.scripts.factory import table_wise, tiny_dlrm

    trainer = L.Trainer(
        strategy=TorchRecStrategy(
            constraints=table_wise(2),
            pipeline="sparse_dist",
            allow_fused_gradient_accumulation=True,
        ),
        devices=1,
        max_steps=2,
        accumulate_grad_batches=2,
        **QUIET,
    )
    with pytest.raises(ValueError, match="cannot combine with a train pipeline"):
        trainer.fit(tiny_dlrm(), datamodule=tiny_data())


def test_a_model_the_pipeline_cannot_trace_trains_unpipelined() -> None:
    from tests.scripts.factory import table_wise
    from tests.test_strategy import PlainEBCModule

    model = PlainEBCModule()  # no forward(): TorchRec's tracer cannot find the tables' inputs
    strategy = TorchRecStrategy(
        constraints=table_wise(["item_table", "user_table"]), pipeline="sparse_dist"
    )
    trainer = L.Trainer(strategy=strategy, devices=1, max_steps=3, **QUIET)
    with (
        pytest.warns(UserWarning, match="cannot pipeline this model"),
        pytest.warns(UserWarning, match="drives the dense optimizer only"),  # its StepLR
    ):
        trainer.fit(model, datamodule=tiny_data())
    assert trainer.global_step == 3
    assert strategy._runner.step.pipeline is None


def test_semi_sync_refuses_tables_the_dense_optimizer_updates_naming_them() -> None:
    from tests.scripts.factory import sharding_constraints, tiny_dlrm

    # The planner's choice for small tables on CPU; semi-sync looks the next batch up before
    # this one's update, which fails in autograd for tables updated in place after it.
    constraints = sharding_constraints({"t_cat_0": "table_wise", "t_cat_1": "data_parallel"})
    strategy = TorchRecStrategy(constraints=constraints, pipeline="semi_sync")
    trainer = L.Trainer(strategy=strategy, devices=1, max_steps=2, **QUIET)
    with pytest.raises(ValueError) as err:
        trainer.fit(tiny_dlrm(), datamodule=tiny_data())
    assert "the dense optimizer: ['t_cat_1 (data_parallel, kernel dense)']" in str(err.value)
    assert trainer.global_step == 0
    # evaluation never runs semi-sync: the same strategy settings validate that plan
    strategy = TorchRecStrategy(constraints=constraints, pipeline="semi_sync")
    validating = L.Trainer(strategy=strategy, devices=1, **QUIET)
    (metrics,) = validating.validate(tiny_dlrm(), datamodule=tiny_data())
    assert "val/loss" in metrics


@dataclass
class TwoTowerBatch(TensorFields):
    user: KeyedJaggedTensor
    item: KeyedJaggedTensor
    labels: torch.Tensor


def _two_tower_batches(n: int, size: int = 8) -> list[TwoTowerBatch]:
    g = torch.Generator().manual_seed(0)

    def kjt() -> KeyedJaggedTensor:
        lengths = torch.randint(1, 3, (size,), generator=g)
        values = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
        return KeyedJaggedTensor(keys=["id"], values=values, lengths=lengths.int())

    labels = [torch.randint(0, 2, (size,), generator=g).float() for _ in range(n)]
    return [TwoTowerBatch(kjt(), kjt(), y) for y in labels]


class SharedIdTable(L.LightningModule):
    """Users and items share one id table: the collection is called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        table = EmbeddingBagConfig(name="ids", embedding_dim=4, num_embeddings=30)
        table.feature_names = ["id"]
        self.ebc = EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
        self.user, self.item = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: TwoTowerBatch) -> torch.Tensor:
        users = self.user(self.ebc(batch.user).values())
        return (users * self.item(self.ebc(batch.item).values())).sum(1)

    def training_step(self, batch: TwoTowerBatch, batch_idx: int) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(self(batch), batch.labels)

    def validation_step(self, batch: TwoTowerBatch, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self) -> Any:
        return combine_optimizers(torch.optim.SGD(dense_parameters(self), lr=0.1), self)


def test_a_model_calling_a_sharded_module_twice_trains_unpipelined() -> None:
    # TorchRec's pipelined forward refused the second call ("Invalid PipelinedForward usage")
    # and the fit failed; the default pipeline ("auto") takes this path on 2 CPU ranks.
    weights = []
    for pipeline in ("sparse_dist", None):
        L.seed_everything(0)
        model = SharedIdTable()
        strategy = TorchRecStrategy(pipeline=pipeline, log_plan=False)
        trainer = L.Trainer(strategy=strategy, devices=1, max_steps=3, **QUIET)
        loader = DataLoader(_two_tower_batches(4), batch_size=None)
        if pipeline is None:
            trainer.fit(model, train_dataloaders=loader)
        else:
            with pytest.warns(UserWarning, match="called twice per forward"):
                trainer.fit(model, train_dataloaders=loader)
            assert strategy._runner.step.pipeline is None  # dropped after the first step
            with pytest.warns(UserWarning, match="called twice per forward"):  # evaluation's
                (validated,) = trainer.validate(model, DataLoader(_two_tower_batches(2), None))
            assert validated["val_loss"] > 0
        assert trainer.global_step == 3
        weights.append({k: v.detach().clone() for k, v in model.user.state_dict().items()})
    assert_same(weights[0], weights[1])  # the first step ran once, unpipelined
