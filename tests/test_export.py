"""Quantized inference export: from sharded checkpoints (1, 2, 3 ranks) to a served artifact.

One module-scoped fixture trains a demo-like DLRM on 2 ranks and saves the same weights again
from a 3-rank and a 1-rank load (DCP reshards; the 1-rank one in this process). The artifacts are
served in a fresh process that cannot import ``lightning_torchrec``. Multi-process time: two
launches and one serving process, about 40 s on 2 idle cores.
"""

from __future__ import annotations

import json
import re
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.inference.modules import quantize_embeddings
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import lightning_torchrec.export.quantize as quantize_module
from lightning_torchrec.checkpoint import load_unsharded
from lightning_torchrec.errors import CheckpointMismatchError, IdOutOfRangeError, ServedInputError
from lightning_torchrec.export.artifact import (
    DTYPES,
    export,
    load_artifact,
    main,
    quantize_from_checkpoint,
)
from lightning_torchrec.lightning.dlrm import DLRMClickModule
from tests.helpers import bad_id_requests, run_script, serve_bare
from tests.scripts.export_ranks import save as save_checkpoint
from tests.scripts.factory import tiny_data, tiny_dlrm

MODULE = "lightning_torchrec.DLRMClickModule"
ROWS, TABLES, DIM = 200, 4, 16  # as in tests/scripts/export_ranks.py
#: Held-out batches: 8 x 512 samples of the test split (the model trained on the train split).
HELD_OUT = 8
#: Per dtype: bounds on max |delta p| and |delta AUROC| against the float model.
BOUNDS = {
    "fp32": (1e-5, 1e-6),
    "fp16": (2e-3, 2e-4),
    "int8": (2e-2, 1e-3),
    "int4": (1.5e-1, 1e-2),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("export")
    run_script("export_ranks.py", str(out), "2")
    run_script("export_ranks.py", str(out), "3", str(out / "ckpt_w2"))
    save_checkpoint(out, 1, out / "ckpt_w2")  # one rank: in this process
    if torch.distributed.is_initialized():  # the export itself needs none: prove it below
        torch.distributed.destroy_process_group()
    return {w: out / f"ckpt_w{w}" for w in (1, 2, 3)}


@pytest.fixture(scope="module")
def held_out() -> list[Any]:
    data = tiny_data(ROWS, TABLES, ids_per_feature=2, batch_size=512, test_batches=HELD_OUT)
    return list(data.dataset("test"))


def _float_probs(checkpoint: Path, batches: list[Any]) -> torch.Tensor:
    model = load_unsharded(checkpoint, DLRMClickModule).eval().model_and_loss.model
    with torch.inference_mode():
        return torch.cat(
            [torch.sigmoid(model(b.dense_features, b.sparse_features)).reshape(-1) for b in batches]
        )


def _serve(
    tmp: Path, artifacts: list[Path], batches: list[Any], bad: list[dict] | None = None
) -> dict[str, Any]:
    """Predictions of each artifact from a fresh process that cannot import the package, and
    what each raised for the ``bad`` requests (under ``"refused"``)."""
    inputs = {
        "bad": bad or [],
        "keys": batches[0].sparse_features.keys(),
        "batches": [
            {
                "dense": b.dense_features,
                "values": b.sparse_features.values(),
                "lengths": b.sparse_features.lengths(),
            }
            for b in batches
        ],
    }
    return serve_bare(tmp, inputs, artifacts)


def test_every_dtype_served_without_the_training_code(
    checkpoints: dict[int, Path], held_out: list[Any], tmp_path: Path
) -> None:
    labels = torch.cat([b.labels for b in held_out]).long()
    reference = _float_probs(checkpoints[2], held_out)
    float_auroc = float(binary_auroc(reference, labels))
    artifacts = {}
    for dtype in DTYPES:
        result = export(checkpoints[2], MODULE, tmp_path / f"dlrm_{dtype}.pt2", dtype=dtype)
        artifacts[dtype] = result.path
        info = json.loads(Path(f"{result.path}.json").read_text())
        assert info["features"] == [f"cat_{i}" for i in range(TABLES)]
        assert info["dense_width"] == 13 and info["dtype"] == dtype
        assert info["feature_tables"] == [
            {"feature": f"cat_{i}", "table": f"t_cat_{i}", "rows": ROWS, "dim": DIM}
            for i in range(TABLES)
        ]
        assert info["input_contract"]["keys"] == info["features"]
    ts = export(
        checkpoints[2], MODULE, tmp_path / "dlrm_int8.ts", dtype="int8", format="torchscript"
    )
    bad = _bad_requests(held_out[0])
    served = _serve(tmp_path, [*artifacts.values(), ts.path], held_out, [r for r, _ in bad])
    _check_refusals(served["refused"], artifacts, ts.path, bad)
    rows = []
    for dtype, path in artifacts.items():
        probs = served[str(path)]
        delta = (probs - reference).abs()
        d_auroc = float(binary_auroc(probs, labels)) - float_auroc
        rows.append(
            f"{dtype}: max|dp| {delta.max():.2e} mean|dp| {delta.mean():.2e} dAUROC {d_auroc:+.2e}"
        )
        max_bound, auroc_bound = BOUNDS[dtype]
        assert float(delta.max()) < max_bound, rows[-1]
        assert abs(d_auroc) < auroc_bound, rows[-1]
    print(f"\nfloat AUROC {float_auroc:.4f}\n" + "\n".join(rows))
    assert float_auroc > 0.72  # the model learnt something: the comparison means something
    # TorchScript gives the same predictions as pt2.
    torch.testing.assert_close(
        served[str(ts.path)], served[str(artifacts["int8"])], rtol=0, atol=1e-6
    )


def _bad_requests(batch: Any) -> list[tuple[dict[str, torch.Tensor], tuple]]:
    """Requests with one id outside its table (or bad lengths), with (feature, id, sample)."""
    cases = [("cat_2", ROWS, 7), ("cat_0", -1, 0), ("cat_3", 2**40, 300)]
    requests = bad_id_requests(batch, cases)
    kjt = batch.sparse_features
    lengths = kjt.lengths().clone()
    lengths[3] += 1  # one id more than the values hold
    plain = {"dense": batch.dense_features, "values": kjt.values(), "lengths": lengths}
    return [*requests, (plain, ("lengths", 0, 0))]


def _check_refusals(
    refused: dict[str, list[str]], pt2: dict[str, Path], ts: Path, bad: list[tuple]
) -> None:
    """Bare servers: pt2 names the feature, table and rows; TorchScript also the id and sample.
    Loaded with ``load_artifact``: the named errors, with the id and sample, for every dtype."""
    for path in [*pt2.values(), ts]:
        named = load_artifact(path)
        for message, (request, (feature, value, sample)) in zip(
            refused[str(path)], bad, strict=True
        ):
            kjt = KeyedJaggedTensor(
                keys=[f"cat_{i}" for i in range(TABLES)],
                values=request["values"],
                lengths=request["lengths"],
            )
            if feature == "lengths":
                assert message.startswith(("RuntimeError: bad lengths", "Error: builtins.Runtime"))
                with pytest.raises(ServedInputError, match="bad lengths"):
                    named(request["dense"], kjt)
                continue
            table = f"feature '{feature}' (table 't_{feature}', {ROWS} rows) got "
            exact = f"id {value} (sample {sample})"
            expected = exact if path == ts else "an id outside the table"
            assert f"RuntimeError: id out of range: {table}{expected}" in message, message
            with pytest.raises(IdOutOfRangeError, match=re.escape(f"{table}{exact}")):
                named(request["dense"], kjt)


def test_same_predictions_from_1_2_3_rank_checkpoints(
    checkpoints: dict[int, Path], held_out: list[Any]
) -> None:
    batch = held_out[0]
    preds = {}
    for world, path in checkpoints.items():
        model, _ = quantize_from_checkpoint(path, MODULE, "int8")
        with torch.inference_mode():
            preds[world] = model(batch.dense_features, batch.sparse_features)
    assert torch.equal(preds[1], preds[2]) and torch.equal(preds[3], preds[2])


def test_matches_torchrecs_own_quantization(
    checkpoints: dict[int, Path], held_out: list[Any]
) -> None:
    batch = held_out[0]
    float_model = load_unsharded(checkpoints[2], DLRMClickModule).eval().model_and_loss.model
    torch_dtypes = {"int8": torch.int8, "int4": torch.quint4x2, "fp16": torch.half}
    for dtype, torch_dtype in torch_dtypes.items():
        ours, _ = quantize_from_checkpoint(checkpoints[2], MODULE, dtype)
        theirs = quantize_embeddings(float_model, dtype=torch_dtype, inplace=False)
        with torch.inference_mode():
            a = ours(batch.dense_features, batch.sparse_features)
            b = theirs(batch.dense_features, batch.sparse_features)
        assert torch.equal(a, b), dtype
        values = batch.sparse_features.values().clone()
        values[-1] = ROWS  # the last id of cat_3
        kjt = KeyedJaggedTensor(
            keys=batch.sparse_features.keys(),
            values=values,
            lengths=batch.sparse_features.lengths(),
        )
        with pytest.raises(IdOutOfRangeError, match=rf"'cat_3' .* got id {ROWS} \(sample 511\)"):
            ours(batch.dense_features, kjt)


def test_at_most_one_float_table_held(
    checkpoints: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export releases each streamed tensor before it asks for the next one."""
    real = quantize_module.iter_plain_tensors
    alive: list[weakref.ref] = []
    seen = []

    def tracked(*args: Any, **kwargs: Any):
        for key, tensor in real(*args, **kwargs):
            held = [r for r in alive if r() is not None]
            seen.append((key, len(held)))
            copy = tensor.clone()  # the reader keeps its own reference; watch ours only
            del tensor
            alive.append(weakref.ref(copy))
            yield key, copy
            del copy

    monkeypatch.setattr(quantize_module, "iter_plain_tensors", tracked)
    model, facts = quantize_from_checkpoint(checkpoints[1], MODULE, "int8")
    tables = [k for k, _ in seen if ".embedding_bags." in k]
    assert len(tables) == TABLES
    assert all(n == 0 for k, n in seen if ".embedding_bags." in k), seen
    assert facts["quantized_table_bytes"] == TABLES * ROWS * (DIM + 4)
    assert facts["float_table_bytes"] == TABLES * ROWS * DIM * 4


def _batch(size: int) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    b = tiny_data(ROWS, TABLES, ids_per_feature=2, batch_size=max(size, 2)).dataset("test")[0]
    if size > 1:
        return b.dense_features, b.sparse_features
    first = [jt.to_dense()[0] for jt in b.sparse_features.to_dict().values()]
    kjt = KeyedJaggedTensor(
        keys=b.sparse_features.keys(),
        values=torch.cat(first),
        lengths=torch.tensor([len(ids) for ids in first], dtype=torch.int32),
    )
    return b.dense_features[:1], kjt


@pytest.mark.parametrize("size", [1, 2, 3, 1000])
@pytest.mark.parametrize("fmt", ["pt2", "torchscript"])
def test_any_batch_size(checkpoints: dict[int, Path], fmt: str, size: int) -> None:
    result = export(checkpoints[2], MODULE, dtype="int8", format=fmt)
    served = result.artifact.module() if fmt == "pt2" else result.artifact
    dense, kjt = _batch(size)
    with torch.inference_mode():
        expected = result.model(dense, kjt)
        assert torch.equal(served(dense, kjt), expected)


# ------------------------------------------------------------------ errors


def test_unknown_module_path_is_named(checkpoints: dict[int, Path]) -> None:
    with pytest.raises(ImportError, match="no_such_pkg"):
        export(checkpoints[1], "no_such_pkg.models.Model")
    with pytest.raises(ImportError, match="has no attribute 'NoSuchModule'"):
        export(checkpoints[1], "lightning_torchrec.NoSuchModule")


def test_module_built_from_the_hyper_parameters_a_cli_saved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LightningCLI (the demo) saves ``_instantiator`` with the module's arguments."""
    hparams = {"num_embeddings_per_feature": [ROWS] * 2, "embedding_dim": 8}
    meta = {"hyper_parameters": {**hparams, "_instantiator": "lightning.pytorch.cli.x"}}
    monkeypatch.setattr(quantize_module, "load_meta", lambda path, **kwargs: meta)
    module = quantize_module.build_module("ckpt", MODULE)
    assert isinstance(module, DLRMClickModule)
    assert module.hparams["embedding_dim"] == 8


def test_checkpoint_of_another_model_names_the_tables(checkpoints: dict[int, Path]) -> None:
    other = tiny_dlrm(
        [ROWS, ROWS, 300], 3, embedding_dim=DIM, dense_sizes=[64, DIM], over_sizes=[64, 1]
    )
    with pytest.raises(CheckpointMismatchError) as err:
        export(checkpoints[1], other)
    message = str(err.value)
    assert "t_cat_2" in message and "shapes differ" in message  # 300 rows, not 200
    assert "t_cat_3" in message and "not in the model" in message


def test_dtype_the_table_widths_cannot_use(checkpoints: dict[int, Path]) -> None:
    narrow = tiny_dlrm(ROWS, 2, embedding_dim=6, dense_sizes=[6], over_sizes=[4, 1])
    with pytest.raises(ValueError, match=r"divisible by 4.*t_cat_0 \(dim 6\).*t_cat_1"):
        export(checkpoints[1], narrow, dtype="int4")
    with pytest.raises(ValueError, match="dtype must be one of"):
        export(checkpoints[1], MODULE, dtype="int2")


def test_not_a_sharded_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileNotFoundError):
        export(tmp_path, MODULE)
    with pytest.raises(FileNotFoundError):
        export(tmp_path / "missing", MODULE)


def test_command_line(
    checkpoints: dict[int, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.pt2"
    result = main([str(checkpoints[3]), str(out), "--module", MODULE, "--dtype", "int4"])
    assert result.format == "pt2" and out.is_file() and "tables int4" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([str(checkpoints[3]), str(out), "--module", "my_pkg.MyModule", "--overwrite"])
    assert exit_info.value.code == 2
    assert "cannot import module 'my_pkg'" in capsys.readouterr().err
