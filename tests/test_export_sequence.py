"""Export of a model whose tables are in an ``EmbeddingCollection`` (one vector per id).

A small click model looks its features up in an ``EmbeddingCollection``, sums each sample's
vectors and feeds a tiny dense head; it trains under ``TorchRecStrategy`` on one rank in this
process and is saved as a sharded checkpoint. Every dtype is exported to ``.pt2`` and served
from a fresh process that cannot import ``lightning_torchrec``: predictions match the float
model within the dtype's quantization error, and ids outside a table (negative, ``>= rows``)
are refused naming the feature, its table and row count. About 15 s on 2 idle cores.

No ``from __future__ import annotations`` here: TorchScript (``torchrec.fx.symbolic_trace`` then
``torch.jit.script``) cannot resolve the string annotations of the model's ``forward``.
"""

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchrec.inference.modules import quantize_embeddings
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import TorchRecModule, TorchRecStrategy
from lightning_torchrec.checkpoint import load_unsharded
from lightning_torchrec.errors import IdOutOfRangeError
from lightning_torchrec.export.artifact import (
    DTYPES,
    export,
    load_artifact,
    quantize_from_checkpoint,
)
from lightning_torchrec.models.model_and_loss import ModelAndLoss
from tests.helpers import bad_id_requests, serve_bare
from tests.scripts.factory import cpu_trainer, table_wise, tiny_data

ROWS, TABLES, DIM, DENSE = 100, 2, 8, 13
#: Per dtype: bound on max |delta p| against the float model.
BOUNDS = {"fp32": 1e-6, "fp16": 2e-4, "int8": 2e-3, "int4": 3e-2}


class SequenceClickModel(nn.Module):
    """Click logits from the summed per-id vectors of an ``EmbeddingCollection``."""

    def __init__(self, rows: int, tables: int, dim: int, dense: int) -> None:
        super().__init__()
        self.features = [f"cat_{i}" for i in range(tables)]
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=f"t_{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f]
                )
                for f in self.features
            ],
            device=torch.device("meta"),
        )
        self.dense = nn.Linear(dense, dim)
        self.over = nn.Sequential(nn.Linear(dim * (tables + 1), 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        looked_up = self.ec(sparse)
        pooled = [
            torch.segment_reduce(
                looked_up[f].values(), "sum", lengths=looked_up[f].lengths(), unsafe=True
            )
            for f in self.features
        ]
        return self.over(torch.cat([self.dense(dense), *pooled], dim=1))


class SequenceClickModule(TorchRecModule):
    """The model above as a LightningModule rebuilt from its saved hyper-parameters."""

    def __init__(self, rows: int = ROWS, tables: int = TABLES, dim: int = DIM) -> None:
        super().__init__(
            ModelAndLoss(SequenceClickModel(rows, tables, dim, DENSE)),
            optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
            train_metrics_every_n_steps=0,
        )
        self.num_dense_features = DENSE
        self.save_hyperparameters()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export_ec")
    torch.manual_seed(0)
    data = tiny_data(ROWS, TABLES, ids_per_feature=3, batch_size=64, train_batches=20, seed=0)
    strategy = TorchRecStrategy(
        fused_params={"learning_rate": 0.1}, constraints=table_wise(TABLES), log_plan=False
    )
    trainer = cpu_trainer(strategy, max_steps=20, limit_val_batches=0, default_root_dir=out)
    trainer.fit(SequenceClickModule(), datamodule=data)
    trainer.save_checkpoint(out / "ckpt")
    if torch.distributed.is_initialized():  # the export needs no process group
        torch.distributed.destroy_process_group()
    return out / "ckpt"


@pytest.fixture(scope="module")
def batch() -> Any:
    return tiny_data(ROWS, TABLES, ids_per_feature=3, batch_size=256, seed=1).dataset("test")[0]


def _bad_requests(batch: Any) -> list[tuple[dict[str, torch.Tensor], tuple[str, int, int]]]:
    """Requests with one id outside its table, with (feature, id, sample)."""
    return bad_id_requests(batch, [("cat_1", ROWS, 5), ("cat_0", -1, 0), ("cat_1", 2**40, 200)])


def _serve(tmp: Path, artifacts: list[Path], batch: Any, bad: list[dict]) -> dict[str, Any]:
    kjt = batch.sparse_features
    inputs = {
        "bad": bad,
        "keys": kjt.keys(),
        "batches": [
            {"dense": batch.dense_features, "values": kjt.values(), "lengths": kjt.lengths()}
        ],
    }
    return serve_bare(tmp, inputs, artifacts)


def test_every_dtype_served_and_refuses_ids_outside_the_tables(
    checkpoint: Path, batch: Any, tmp_path: Path
) -> None:
    float_model = load_unsharded(checkpoint, SequenceClickModule).eval().model_and_loss.model
    with torch.inference_mode():
        reference = torch.sigmoid(float_model(batch.dense_features, batch.sparse_features))
    artifacts = {}
    for dtype in DTYPES:
        result = export(checkpoint, SequenceClickModule, tmp_path / f"ec_{dtype}.pt2", dtype=dtype)
        artifacts[dtype] = result.path
        info = json.loads(Path(f"{result.path}.json").read_text())
        assert info["feature_tables"] == [
            {"feature": f"cat_{i}", "table": f"t_cat_{i}", "rows": ROWS, "dim": DIM}
            for i in range(TABLES)
        ]
        assert info["sequence_features"] == ["cat_0", "cat_1"]
        assert info["input_contract"]["keys"] == ["cat_0", "cat_1"]
    bad = _bad_requests(batch)
    served = _serve(tmp_path, list(artifacts.values()), batch, [r for r, _ in bad])
    rows = []
    for dtype, path in artifacts.items():
        delta = (served[str(path)] - reference.reshape(-1)).abs().max()
        rows.append(f"{dtype}: max|dp| {delta:.2e}")
        assert float(delta) < BOUNDS[dtype], rows[-1]
        named = load_artifact(path)
        for message, (request, (feature, value, sample)) in zip(
            served["refused"][str(path)], bad, strict=True
        ):
            table = f"feature '{feature}' (table 't_{feature}', {ROWS} rows) got "
            assert f"RuntimeError: id out of range: {table}an id outside the table" in message
            kjt = KeyedJaggedTensor(
                keys=["cat_0", "cat_1"], values=request["values"], lengths=request["lengths"]
            )
            exact = re.escape(f"{table}id {value} (sample {sample})")
            with pytest.raises(IdOutOfRangeError, match=exact):
                named(request["dense"], kjt)
    print("\n" + "\n".join(rows))
    # The learnt model is not a constant: the comparison means something.
    assert float(reference.std()) > 0.05


def test_torchscript_and_eager_refuse_too(checkpoint: Path, batch: Any) -> None:
    result = export(checkpoint, SequenceClickModule, dtype="int8", format="torchscript")
    request, (feature, value, sample) = _bad_requests(batch)[0]
    kjt = KeyedJaggedTensor(
        keys=["cat_0", "cat_1"], values=request["values"], lengths=request["lengths"]
    )
    exact = f"'{feature}' (table 't_{feature}', {ROWS} rows) got id {value} (sample {sample})"
    with pytest.raises(torch.jit.Error, match=re.escape(exact)):
        result.artifact(request["dense"], kjt)
    with pytest.raises(IdOutOfRangeError, match=re.escape(exact)):
        result.model(request["dense"], kjt)
    with torch.inference_mode():
        torch.testing.assert_close(
            result.artifact(batch.dense_features, batch.sparse_features),
            result.model(batch.dense_features, batch.sparse_features),
        )


def test_matches_torchrecs_own_quantization(checkpoint: Path, batch: Any) -> None:
    """The streamed quantized EC predicts bit for bit what TorchRec's ``from_float`` gives."""
    float_model = load_unsharded(checkpoint, SequenceClickModule).eval().model_and_loss.model
    args = (batch.dense_features, batch.sparse_features)
    for dtype, torch_dtype in {
        "int8": torch.int8,
        "int4": torch.quint4x2,
        "fp16": torch.half,
    }.items():
        ours, _ = quantize_from_checkpoint(checkpoint, SequenceClickModule, dtype)
        theirs = quantize_embeddings(
            float_model,
            dtype=torch_dtype,
            inplace=False,
            additional_qconfig_spec_keys=[EmbeddingCollection],
            additional_mapping={EmbeddingCollection: QuantEmbeddingCollection},
        )
        assert isinstance(theirs.ec, QuantEmbeddingCollection)  # through its from_float
        with torch.inference_mode():
            assert torch.equal(ours(*args), theirs(*args)), dtype
