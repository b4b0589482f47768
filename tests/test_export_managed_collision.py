"""Export of managed-collision tables: the served model remaps raw ids as the trained one did.

One 2-rank launch (``tests/scripts/mc_export_ranks.py``) trains ``mc_model``'s click model (a
``ManagedCollisionEmbeddingCollection``, two tables of 32 rows sharded row-wise, one
``MCHManagedCollisionModule`` each with 2 buckets over ``[0, 2**40)``), saves a sharded
checkpoint and records what the sharded model answers in eval mode for every raw id of the data,
ids it never saw and both ends of each rank's bucket. Every dtype is exported from that
checkpoint in this process and served from a fresh process that cannot import the package.
A ``ManagedCollisionEmbeddingBagCollection`` (which cannot be sharded on CPU ranks) is exported
from a one-process checkpoint of an unsharded model. About 25 s.

No ``from __future__ import annotations`` here: TorchScript (``torchrec.fx.symbolic_trace`` then
``torch.jit.script``) cannot resolve the string annotations of a traced ``forward``.
"""

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.checkpoint import save_sharded
from lightning_torchrec.compat.upstream import mch_held_ids
from lightning_torchrec.errors import IdOutOfRangeError
from lightning_torchrec.export.artifact import DTYPES, export, load_artifact
from lightning_torchrec.export.managed import bucket_width, served_managed
from lightning_torchrec.models.model_and_loss import ModelAndLoss
from lightning_torchrec.training.mc_stats import mch_modules
from tests.helpers import load_ranks, run_script, serve_bare
from tests.scripts.mc_model import DIM, EDGES, FEATURES, SPAN, ZCH, module, probe_batch

#: Per dtype: bound on max |delta p| against the trained model (as tests/test_export_sequence.py).
BOUNDS = {"fp32": 1e-6, "fp16": 2e-4, "int8": 2e-3, "int4": 3e-2}
#: Per dtype: bound on max |served - trained| embedding over max |trained embedding| (the
#: trained values are about 1e-3, where fp16's scale and bias are coarse).
ROW_ERRORS = {"fp32": 0.0, "fp16": 1e-3, "int8": 0.02, "int4": 0.1}
KEYS = [f"cat_{f}" for f in range(FEATURES)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The 2-rank checkpoint and what the trained model answered (both ranks agree)."""
    out = tmp_path_factory.mktemp("mc_export")
    run_script("mc_export_ranks.py", str(out))
    ranks = load_ranks(out, "trained")
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    record = {
        "logits": ranks[0]["logits"],
        "lookup": ranks[0]["lookup"],
        "held": [r["held"] for r in ranks],  # per rank: {table: raw ids its shard admitted}
    }
    return next((out / "ckpt").glob("*.ckpt")), record


def _request(values: torch.Tensor) -> dict[str, torch.Tensor]:
    dense, kjt = probe_batch()
    return {"dense": dense, "values": values, "lengths": kjt.lengths()}


def _bad_requests() -> list[tuple[dict[str, torch.Tensor], tuple[str, int, int]]]:
    """Probe requests with one raw id outside ``[0, SPAN)``: (request, (feature, id, sample))."""
    _, kjt = probe_batch()
    per_feature = kjt.values().numel() // FEATURES
    requests = []
    for feature, value, sample in (("cat_0", SPAN, 5), ("cat_1", -1, 0), ("cat_1", 2**62, 52)):
        values = kjt.values().clone()
        values[int(feature[-1]) * per_feature + 4 * sample] = value  # 4 ids a sample
        requests.append((_request(values), (feature, value, sample)))
    return requests


def _serve(tmp: Path, artifacts: list[Path], bad: list[dict]) -> dict[str, Any]:
    _, kjt = probe_batch()
    inputs = {"bad": bad, "keys": KEYS, "batches": [_request(kjt.values())]}
    return serve_bare(tmp, inputs, artifacts)


def _served_lookup(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the exported (eager) model's managed-collision module returns for every probe id."""
    _, kjt = probe_batch()
    ids = kjt.values()[: kjt.values().numel() // FEATURES]
    probe = KeyedJaggedTensor(
        keys=KEYS,
        values=ids.repeat(FEATURES),
        lengths=torch.ones(FEATURES * len(ids), dtype=torch.int32),
    )
    with torch.inference_mode():
        out, remapped = model.mc_ec(probe)
    assert remapped is None  # as the float module returned
    return {k: out[k].values() for k in KEYS}


def test_the_probe_ids_tell_the_buckets_apart(trained: tuple[Path, dict[str, Any]]) -> None:
    """Admitted ids and ids each shard did not admit are probed, with distinct fallback rows."""
    _, record = trained
    _, kjt = probe_batch()
    probe = kjt.values()[: kjt.values().numel() // FEATURES]
    for key in KEYS:
        table = f"t_{key}"
        admitted = torch.isin(probe, torch.cat([h[table] for h in record["held"]]))
        assert 0 < int(admitted.sum()) < len(probe) - 8
        low = ~admitted & (probe < SPAN // 2)  # rank 0's bucket
        high = ~admitted & (probe >= SPAN // 2)
        assert int(low.sum()) > 4 and int(high.sum()) > 4
        rows = record["lookup"][key][: len(probe)]  # the lookup's probe ids are probe[:-4]
        assert len(record["lookup"][key]) == len(probe) - len(EDGES)
        low, high = low[: len(rows)], high[: len(rows)]
        assert (rows[low] == rows[low][0]).all() and (rows[high] == rows[high][0]).all()
        assert not torch.equal(rows[low][0], rows[high][0]), f"{key}: one row for both buckets"


def test_every_dtype_remaps_as_trained_and_refuses_ids_outside_the_range(
    trained: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    checkpoint, record = trained
    reference = torch.sigmoid(record["logits"])
    artifacts, report = {}, []
    for dtype in DTYPES:
        result = export(
            checkpoint, module(), tmp_path / f"mc_{dtype}.pt2", dtype=dtype,
            example_inputs=probe_batch(),
        )  # fmt: skip
        artifacts[dtype] = result.path
        info = json.loads(Path(f"{result.path}.json").read_text())
        assert info["feature_tables"] == [
            {"feature": k, "table": f"t_{k}", "rows": ZCH, "dim": DIM, "raw_ids": SPAN}
            | {"remapped": True}
            for k in KEYS
        ]
        assert "raw ids in [0, raw_ids)" in info["input_contract"]["values"]
        served = _served_lookup(result.model)
        for key in KEYS:
            want = record["lookup"][key]
            got = served[key][: len(want)]
            err = float((got - want).abs().max()) / float(want.abs().max())
            report.append(f"{dtype} {key}: max |d embedding| / max |embedding| {err:.1e}")
            assert err <= ROW_ERRORS[dtype], report[-1]
    bad = _bad_requests()
    served = _serve(tmp_path, list(artifacts.values()), [r for r, _ in bad])
    for dtype, path in artifacts.items():
        delta = float((served[str(path)] - reference).abs().max())
        report.append(f"{dtype}: max |dp| {delta:.2e}")
        assert delta <= BOUNDS[dtype], report[-1]
        named = load_artifact(path)
        for message, (request, (feature, value, sample)) in zip(
            served["refused"][str(path)], bad, strict=True
        ):
            table = f"feature '{feature}' (table 't_{feature}', {SPAN} raw ids) got "
            assert f"RuntimeError: id out of range: {table}an id outside the raw-id range" in (
                message
            ), message
            kjt = KeyedJaggedTensor(keys=KEYS, values=request["values"], lengths=request["lengths"])
            exact = re.escape(f"{table}id {value} (sample {sample}); ids must be int64 in [0, ")
            with pytest.raises(IdOutOfRangeError, match=exact):
                named(request["dense"], kjt)
    print("\n" + "\n".join(report))
    assert float(reference.std()) > 1e-3  # the learnt model is not a constant


class PooledClick(nn.Module):
    """The click model's collection and head, pooled with ``segment_reduce`` (fx-traceable)."""

    def __init__(self, mc_ec: nn.Module, over: nn.Module) -> None:
        super().__init__()
        self.mc_ec = mc_ec
        self.over = over

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out, _ = self.mc_ec(kjt)
        pooled = [
            torch.segment_reduce(out[k].values(), "mean", lengths=out[k].lengths(), unsafe=True)
            for k in KEYS
        ]
        return self.over(torch.cat([dense] + pooled, dim=1)).squeeze(1)


def test_torchscript_remaps_and_names_the_raw_id(trained: tuple[Path, dict[str, Any]]) -> None:
    checkpoint, _ = trained
    root = module()
    click = root.model_and_loss.model
    root.inference_model = lambda: PooledClick(click.mc_ec, click.over)  # type: ignore[method-assign]
    result = export(checkpoint, root, dtype="int8", format="torchscript")
    request, (feature, value, sample) = _bad_requests()[0]
    kjt = KeyedJaggedTensor(keys=KEYS, values=request["values"], lengths=request["lengths"])
    exact = f"'{feature}' (table 't_{feature}', {SPAN} raw ids) got id {value} (sample {sample})"
    with pytest.raises(torch.jit.Error, match=re.escape(exact)):
        result.artifact(request["dense"], kjt)
    with pytest.raises(IdOutOfRangeError, match=re.escape(exact)):
        result.model(request["dense"], kjt)
    dense, kjt = probe_batch()
    with torch.inference_mode():
        assert torch.equal(result.artifact(dense, kjt), result.model(dense, kjt))


class BagClick(nn.Module):
    """A click model on a ``ManagedCollisionEmbeddingBagCollection`` (one table, raw ids < 1000)."""

    def __init__(self) -> None:
        super().__init__()
        config = EmbeddingBagConfig(
            name="t", embedding_dim=8, num_embeddings=16, feature_names=["f"]
        )
        mch = MCHManagedCollisionModule(
            zch_size=16,
            device=torch.device("cpu"),
            eviction_policy=LFU_EvictionPolicy(),
            eviction_interval=1,
            input_hash_size=1000,
        )
        self.mc_ebc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection([config], device=torch.device("cpu")),
            ManagedCollisionCollection({"t": mch}, [config]),
        )
        self.over = nn.Linear(8, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled, _ = self.mc_ebc(kjt)
        return self.over(pooled.values()).squeeze(1)


def _bags(seed: int, size: int = 64) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (size,), generator=gen, dtype=torch.int32)
    values = torch.randint(0, 200, (int(lengths.sum()),), generator=gen) * 5  # some repeat
    return KeyedJaggedTensor(keys=["f"], values=values, lengths=lengths)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a one-process save
def test_managed_collision_bags_export(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = BagClick()
    for seed in range(3):  # admits ids (and evicts: 16 slots for up to 200 ids)
        model(_bags(seed))
    model.eval()
    save_sharded(tmp_path / "ckpt", model, [], {})
    probe = _bags(7)
    probe.values()[:3] = torch.tensor([0, 999, 3])  # both ends; 3 is never seen
    with torch.no_grad():
        want = model(probe)
    assert len(mch_held_ids(mch_modules(model)["t"])) > 4  # ids were admitted
    for dtype, bound in (("fp32", 1e-6), ("int8", 2e-2)):
        result = export(tmp_path / "ckpt", BagClick(), dtype=dtype, example_inputs=(probe,))
        with torch.inference_mode():
            got = result.artifact.module()(probe)
        assert float((got - want).abs().max()) <= bound, dtype
        bad = KeyedJaggedTensor(keys=["f"], values=probe.values() + 1000, lengths=probe.lengths())
        with pytest.raises(IdOutOfRangeError, match="'f' \\(table 't', 1000 raw ids\\) got id"):
            result.model(bad)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_what_the_artifact_cannot_hold_is_refused_by_name(tmp_path: Path) -> None:
    config = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=16, feature_names=["f"])
    mch = MCHManagedCollisionModule(
        zch_size=16,
        device=torch.device("cpu"),
        eviction_policy=LFU_EvictionPolicy(),
        eviction_interval=1,
        input_hash_func=lambda ids, size: ids % size,
    )
    mc_ec = ManagedCollisionEmbeddingCollection(
        EmbeddingCollection([config], device=torch.device("cpu")),
        ManagedCollisionCollection({"t": mch}, [config]),
    )
    save_sharded(tmp_path / "ckpt", nn.Linear(2, 2), [], {})
    with pytest.raises(TypeError, match="table 't': .*input_hash_func"):
        export(tmp_path / "ckpt", ModelAndLoss(mc_ec))


@pytest.mark.parametrize(
    ("input_size", "buckets", "shards"),
    [(100, 2, 2), (101, 4, 2), (97, 6, 3), (10, 4, 4), (2**40, 2, 2), (2**63 - 1, 4, 2)],
)
def test_bucket_width_is_how_the_ranks_split_raw_ids(
    input_size: int, buckets: int, shards: int
) -> None:
    """The served shard of an id is the rank TorchRec's row-wise input dist sends it to."""
    ids = torch.tensor(
        sorted({0, 1, input_size - 1, input_size - 2, *(input_size * k // 13 for k in range(13))})
    )
    block = -(-input_size // buckets)
    lengths, *_ = torch.ops.fbgemm.block_bucketize_sparse_features(
        torch.ones(len(ids), dtype=torch.int64),
        ids,
        bucketize_pos=False,
        sequence=True,
        block_sizes=torch.tensor([block]),
        total_num_blocks=torch.tensor([buckets]),
        my_size=shards,
        weights=None,
        keep_orig_idx=True,
    )
    rank = lengths.view(shards, -1).argmax(0)
    width = bucket_width(input_size, buckets, shards)
    assert torch.equal(torch.div(ids, width, rounding_mode="floor"), rank)


def test_a_layout_the_buckets_do_not_split_is_refused() -> None:
    config = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=16, feature_names=["f"])
    mch = MCHManagedCollisionModule(
        zch_size=16,
        device=torch.device("cpu"),
        eviction_policy=LFU_EvictionPolicy(),
        eviction_interval=1,
        output_segments=[0, 5, 10, 16],  # 3 row-wise shards
        buckets=2,
    )
    mc_ec = ManagedCollisionEmbeddingCollection(
        EmbeddingCollection([config], device=torch.device("cpu")),
        ManagedCollisionCollection({"t": mch}, [config]),
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "table 't': its managed-collision state was sharded as rows [0, 5, 10, 16] with 2 "
            "buckets"
        ),
    ):
        served_managed(mc_ec, nn.Identity())
