"""TorchRec's sparse-dist train pipeline under Lightning (tests/scripts/pipeline_ranks.py).

Two real gloo ranks train the same model twice, with ``pipeline=None`` and with
``pipeline="sparse_dist"``; the pipelined run must be the same computation, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_torchrec import TorchRecStrategy
from tests.helpers import assert_same, load_ranks, run_script
from tests.scripts.factory import QUIET, tiny_data


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    run_script("pipeline_ranks.py", str(out), timeout=300)
    return out


def test_sparse_dist_pipeline_is_bit_equal_to_the_unpipelined_path(run: Path) -> None:
    plain, piped = load_ranks(run, "None"), load_ranks(run, "sparse_dist")
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


def test_sparse_dist_pipeline_is_bit_equal_to_torchrecs_own_pipelined_loop(run: Path) -> None:
    for r in load_ranks(run, "torchrec"):
        assert len(r["lightning"]) == len(r["torchrec"]) == 30
        for step, (a, b) in enumerate(zip(r["lightning"], r["torchrec"], strict=True)):
            assert torch.equal(a, b), f"step {step + 1}: Trainer {a} != TorchRec loop {b}"


def test_the_pipeline_really_pipelines_the_sharded_tables(run: Path) -> None:
    for r in load_ranks(run, "sparse_dist"):
        assert r["pipelined"] == 1  # the DLRM's sharded EmbeddingBagCollection
        assert r["unpipelined"] == []
        assert r["eval_pipelined"] == 1  # validation and predict ran through a pipeline too


def test_pipeline_refuses_gradient_accumulation_and_unknown_names() -> None:
    with pytest.raises(ValueError, match="pipeline must be one of"):
        TorchRecStrategy(pipeline="async")  # type: ignore[arg-type]
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
    with pytest.warns(UserWarning, match="cannot pipeline this model"):
        trainer.fit(model, datamodule=tiny_data())
    assert trainer.global_step == 3
    assert strategy._pipelines.training is None
