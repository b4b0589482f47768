"""TorchRec's own test models under ``strategy="torchrec"`` on 2 CPU ranks: what TorchRec runs,
the strategy runs.

One launch (``tests/scripts/conformance_ranks.py``) trains TorchRec's ``TestSparseNN``
(unweighted and weighted tables) on every sharding type CPU runs, and
``TestMixedEmbeddingSparseArch`` (an EBC and an EC), each beside an unsharded copy trained on
the global batches, as ``torchrec.distributed.test_utils.test_sharding``'s
``sharding_single_rank_test`` compares them (``torch.testing.assert_close`` with its default
float32 tolerances); and resumes ``torchrec.models``' ``DLRM_DCN`` (row-wise tables) and
``DeepFM`` from a checkpoint, bit for bit.

The row-wise types (``row_wise``, ``table_row_wise``, ``grid_shard``) need a gloo with both
reduce-scatter forms TorchRec calls: ``reduce_scatter_tensor`` (torch 2.2, pytorch#112144) and
``reduce_scatter`` (torch 2.8, pytorch#149869). On an older stack they are left out by name.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_same, load_ranks, run_script

#: Whether this stack's gloo has both reduce-scatter forms (see the module docstring).
GLOO_REDUCE_SCATTER = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 8)
ALWAYS = ["table_wise", "column_wise", "table_column_wise", "data_parallel"]
REDUCE_SCATTER = ["row_wise", "table_row_wise", "grid_shard"]
TYPES = ALWAYS + (REDUCE_SCATTER if GLOO_REDUCE_SCATTER else [])
#: TorchRec's tower models wrap their interaction in DDP(device_ids=[device]): CUDA only, in
#: scripts/gpu_run.sh's list instead.
#: Steps per epoch of the resume runs (conformance_ranks.HALF).
HALF = 2
CUDA_ONLY_MODELS = ("TestTowerSparseNN", "TestTowerCollectionSparseNN")


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("conformance")
    run_script("conformance_ranks.py", str(out), ",".join(TYPES), timeout=600)
    return out


def compare(out: Path, tag: str, types: list[str]) -> dict[str, float]:
    """Each type's plan and predictions against the unsharded copy; the largest differences."""
    ranks = load_ranks(out, tag)
    assert sorted(ranks[0]) == sorted(types)
    largest: dict[str, float] = {}
    for sharding_type in types:
        plan = ranks[0][sharding_type]["plan"]
        assert set(plan.values()) == {sharding_type}, plan
        local = torch.cat([r[sharding_type]["local"] for r in ranks])
        unsharded = ranks[0][sharding_type]["global"]
        assert torch.equal(unsharded, ranks[1][sharding_type]["global"])
        moved = float((unsharded - ranks[0][sharding_type]["before"]).abs().max())
        assert moved > 1e-3, f"{sharding_type}: training did not change the predictions"
        torch.testing.assert_close(local, unsharded)  # TorchRec's tolerance: the defaults
        largest[sharding_type] = float((local - unsharded).abs().max())
    print(f"{tag}: largest |sharded - unsharded| per type: {largest}")
    return largest


def test_test_sparse_nn_trains_as_unsharded_on_every_cpu_sharding_type(out: Path) -> None:
    compare(out, "sparse_nn", TYPES)


@pytest.mark.skipif(not GLOO_REDUCE_SCATTER, reason="this stack's gloo has no reduce_scatter")
def test_row_wise_types_run_on_cpu_where_gloo_can_reduce_scatter(out: Path) -> None:
    assert set(REDUCE_SCATTER) <= set(load_ranks(out, "sparse_nn")[0])


def test_mixed_ebc_and_ec_model_trains_as_unsharded(out: Path) -> None:
    types = [t for t in ("table_wise", "column_wise", "row_wise") if t in TYPES]
    compare(out, "mixed", types)


ROW_WISE = "row_wise" if GLOO_REDUCE_SCATTER else "table_wise"


@pytest.mark.parametrize(
    ("model", "sharding_type"),
    [
        ("dlrm_dcn", ROW_WISE),
        ("deepfm", "table_wise"),
        pytest.param(
            "mc_ebc",
            "row_wise",
            marks=pytest.mark.skipif(not GLOO_REDUCE_SCATTER, reason="gloo: no reduce_scatter"),
        ),
    ],
)
def test_torchrec_models_resume_bit_for_bit(out: Path, model: str, sharding_type: str) -> None:
    """DLRM_DCN row-wise, DeepFM table-wise, and a ManagedCollisionEmbeddingBagCollection
    (TorchRec shards it row-wise only; the planner is offered that on CPU where gloo can)."""
    for rank in load_ranks(out, f"resume_{model}"):
        assert set(rank["plan"].values()) == {sharding_type}, rank["plan"]
        assert rank["straight"], "nothing recorded"
        assert_same(rank["straight"], rank["resumed"])


@pytest.mark.skipif(not GLOO_REDUCE_SCATTER, reason="this stack's gloo has no reduce_scatter")
def test_a_row_wise_checkpoint_reshards_table_wise_and_exports(out: Path, tmp_path: Path) -> None:
    """DLRM_DCN's row-wise checkpoint of step 2, resumed table-wise to step 4, ends where the
    row-wise run ends; the row-wise checkpoint exports, and the fp32 artifact predicts as the
    float model loaded from its consolidated weights."""
    from lightning_torchrec import consolidate, load_plain_weights
    from lightning_torchrec.export import export

    with warnings.catch_warnings():  # torchrec's test_utils use torch.jit.script at import
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", FutureWarning)
        from tests.scripts.conformance_ranks import HALF as SCRIPT_HALF
        from tests.scripts.conformance_ranks import DLRMWrapped
    assert SCRIPT_HALF == HALF

    ranks = load_ranks(out, "resume_dlrm_dcn")
    assert set(ranks[0]["resharded_plan"].values()) == {"table_wise"}
    row_wise = out / "ckpt_dlrm_dcn_straight" / f"epoch=1-step={2 * HALF}.ckpt"
    table_wise = out / "ckpt_dlrm_dcn_resharded" / f"epoch=1-step={2 * HALF}.ckpt"
    plain = torch.load(consolidate(row_wise, tmp_path / "row_wise.pt"))
    assert_same(plain, torch.load(consolidate(table_wise, tmp_path / "table_wise.pt")))

    result = export(row_wise, DLRMWrapped("dlrm_dcn"), dtype="fp32")
    float_model = DLRMWrapped("dlrm_dcn")
    load_plain_weights(float_model, plain)
    inputs = float_model.example_inputs()
    with torch.no_grad():
        torch.testing.assert_close(result.model(*inputs), float_model.eval()(*inputs))
