"""Single-process unit tests of the norm maths (norms, ebc_norms) and of layout."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
)
from torchrec.distributed.composable.table_batched_embedding_slice import (
    TableBatchedEmbeddingSlice,
)

from lightning_torchrec.sharding.layout import LocalShard, log_sharded_tensor_content, shard_info
from lightning_torchrec.sharding.tables import embedding_tables
from lightning_torchrec.training.ebc_norms import log_ebc_norms, sample_positions, sampled_row_norms
from lightning_torchrec.training.norms import (
    bad_return_error,
    l1_norm,
    l2_norm,
    max_norm,
    reduce_weights,
    weights_to_log,
)


def _bag(name: str, dim: int, rows: int) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[name]
    )


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        self.ebc = EmbeddingBagCollection(tables=[_bag("t0", 4, 10), _bag("t1", 8, 6)])


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def _row_norm_table(rows: int, dim: int = 4) -> torch.Tensor:
    """Row i has norm exactly i: sample means reveal which rows were read."""
    table = torch.zeros(rows, dim)
    table[:, 0] = torch.arange(rows, dtype=torch.float32)
    return table


# ---------------------------------------------------------------- weights_to_log


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (None, lambda p: p.pow(2).sum().sqrt()),  # default: l2_norm
        (l2_norm, lambda p: p.pow(2).sum().sqrt()),
        (l1_norm, lambda p: p.abs().sum()),
        (max_norm, lambda p: p.abs().max()),
    ],
)
def test_builtin_norms_of_every_parameter_match_direct_computation(fn, expected) -> None:
    model = Net()
    logged = weights_to_log(model, fn)
    name = (fn or l2_norm).__name__
    params = _params(model)
    assert list(logged) == [f"model/{name}/{n}" for n in params]  # the original's key format
    for n, p in params.items():
        value = logged[f"model/{name}/{n}"]
        torch.testing.assert_close(value, expected(p))
        assert value.dtype == torch.float32 and value.dim() == 0
        torch.testing.assert_close((fn or l2_norm)(p), expected(p))


def test_dict_mode_logs_only_named_parameters_with_their_function() -> None:
    model = Net()

    def mean(t: torch.Tensor) -> torch.Tensor:
        return t.mean()

    how = {
        "dense.0.weight": torch.norm,  # torch's norms count as L2 and keep their own name
        "dense.2.bias": mean,
        "ebc.embedding_bags.t0.weight": max_norm,
        "ebc.embedding_bags.t1.weight": torch.linalg.norm,
    }
    logged = weights_to_log(model, how)
    p = _params(model)
    expected = {
        "model/norm/dense.0.weight": p["dense.0.weight"].norm(),
        "model/mean/dense.2.bias": p["dense.2.bias"].mean(),
        "model/max_norm/ebc.embedding_bags.t0.weight": p["ebc.embedding_bags.t0.weight"]
        .abs()
        .max(),
        "model/linalg_norm/ebc.embedding_bags.t1.weight": p["ebc.embedding_bags.t1.weight"].norm(),
    }
    assert set(logged) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(logged[key], value)


def test_unknown_parameter_name_raises_key_error_with_close_names() -> None:
    with pytest.raises(KeyError, match=r"dense\.0\.weigth.*dense\.0\.weight"):
        weights_to_log(Net(), {"dense.0.weigth": l2_norm})


def test_how_to_log_of_wrong_type_raises_type_error() -> None:
    with pytest.raises(TypeError):
        weights_to_log(Net(), 3)  # type: ignore[arg-type]


def test_custom_callable_on_plain_tensors_has_no_rank_suffix() -> None:
    model = Net()

    def numel(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor(t.numel())

    logged = weights_to_log(model, numel)
    assert {k: int(v) for k, v in logged.items()} == {
        f"model/numel/{n}": p.numel() for n, p in _params(model).items()
    }


def test_tied_parameters_are_logged_once() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    expected = [f"model/l2_norm/{n}" for n in ("0.weight", "0.bias", "1.bias")]
    assert list(weights_to_log(model)) == expected


def test_half_precision_is_accumulated_in_float32() -> None:
    model = nn.Linear(1000, 100).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    logged = weights_to_log(model, {"weight": l2_norm})
    torch.testing.assert_close(logged["model/l2_norm/weight"], torch.tensor(math.sqrt(1e5)))


# ---------------------------------------------------------------- log_ebc_norms


def test_ebc_norms_with_full_sample_equal_exact_mean_row_norm() -> None:
    model = Net()
    keys = list(embedding_tables(model))
    logged = log_ebc_norms(model.state_dict(), keys, sample_size=100)
    assert set(logged) == {f"{k}-norm-{s}" for k in keys for s in ("0", "mean")}
    for key in keys:
        exact = model.state_dict()[key].norm(dim=1).mean()
        torch.testing.assert_close(logged[f"{key}-norm-0"], exact)
        torch.testing.assert_close(logged[f"{key}-norm-mean"], exact)
        assert logged[f"{key}-norm-0"].shape == () == logged[f"{key}-norm-mean"].shape
        assert logged[f"{key}-norm-0"].dtype == torch.float32


def test_ebc_norms_report_minus_one_for_a_table_without_rows() -> None:
    logged = log_ebc_norms({"empty": torch.empty(0), "t": torch.ones(3, 4)}, ["empty", "t"])
    assert logged["empty-norm-0"].item() == -1.0
    assert logged["empty-norm-mean"].item() == -1.0
    assert logged["t-norm-0"].item() == 2.0


def test_ebc_norms_argument_errors() -> None:
    with pytest.raises(KeyError, match="ebc.embedding_bags.t0.weight"):  # a close name
        log_ebc_norms(Net().state_dict(), ["ebc.embedding_bags.t0.weigth"])
    with pytest.raises(ValueError, match="sample_size"):
        log_ebc_norms({"t": torch.ones(3, 4)}, ["t"], sample_size=0)
    with pytest.raises(ValueError, match="2-D"):
        log_ebc_norms({"t": torch.ones(3)}, ["t"])


def test_ebc_norms_are_deterministic_under_a_seed() -> None:
    tables = {"t": _row_norm_table(1000)}
    first = log_ebc_norms(tables, ["t"], sample_size=20, seed=7)
    assert first == log_ebc_norms(tables, ["t"], sample_size=20, seed=7)
    others = {
        float(log_ebc_norms(tables, ["t"], sample_size=20, seed=s)["t-norm-0"]) for s in range(5)
    }
    assert len(others) > 1


def test_ebc_norms_sample_is_uniform_without_replacement() -> None:
    rows, k = 1000, 10
    tables = {"t": _row_norm_table(rows)}
    means = torch.stack(
        [log_ebc_norms(tables, ["t"], sample_size=k, seed=s)["t-norm-0"] for s in range(300)]
    )
    sums = means.double() * k  # sums of k distinct row ids
    torch.testing.assert_close(sums, sums.round(), rtol=0, atol=1e-3)
    assert (sums >= k * (k - 1) / 2).all() and (sums <= k * (2 * rows - k - 1) / 2).all()
    assert abs(means.mean().item() - (rows - 1) / 2) < 30  # exact mean 499.5, std of mean ~5


class _RecordOps(TorchDispatchMode):
    """Records the largest floating-point tensor any op allocates (views excluded), and the ops."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_leaves(out):  # new floating-point memory, not views of the inputs
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                if t.untyped_storage().data_ptr() not in inputs:
                    self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("rows", [10_000, 300])  # sparse-draw and randperm sampling paths
def test_ebc_norms_read_only_sample_size_rows(rows: int) -> None:
    dim, k = 8, 100
    table = torch.randn(rows, dim)
    recorder = _RecordOps()
    with recorder:
        log_ebc_norms({"t": table}, ["t"], sample_size=k)
    assert any("index_select" in op for op in recorder.ops)
    assert recorder.largest <= k * dim < table.numel()


def test_sample_positions_are_distinct_sorted_and_in_range() -> None:
    generator = torch.Generator().manual_seed(0)
    for n, k in [(10, 10), (10, 20), (100, 30), (100_000, 50)]:
        positions = sample_positions(n, k, generator)
        assert positions.numel() == min(n, k)
        assert positions.unique().numel() == positions.numel()
        assert torch.equal(positions, positions.sort().values)
        assert positions.min() >= 0 and positions.max() < n
    counts = torch.zeros(50)
    for _ in range(2000):  # sparse path (n > 4k): every position about equally likely
        counts[sample_positions(50, 5, generator)] += 1
    assert counts.min() > 120 and counts.max() < 280  # expected 200 each


def test_sampled_row_norms_combine_local_column_shards_and_row_ranges() -> None:
    full = torch.randn(10, 6)
    shards = [
        LocalShard(full[0:4, 0:2], 0, 0),
        LocalShard(full[0:4, 2:6], 0, 2),  # same rows, other columns: combined per row
        LocalShard(full[7:10, 0:6], 7, 0),  # a second row range; rows 4-6 are not local
    ]
    local = torch.cat([full[0:4], full[7:10]])
    norms, n_rows = sampled_row_norms(shards, 100, torch.Generator())
    assert n_rows == 7
    torch.testing.assert_close(norms.float(), local.norm(dim=1))
    norms, _ = sampled_row_norms(shards, 3, torch.Generator().manual_seed(1))
    assert norms.numel() == 3
    matches = (norms.float()[:, None] - local.norm(dim=1)[None]).abs().min(dim=1).values
    assert (matches < 1e-5).all()
    assert sampled_row_norms([], 3, torch.Generator())[1] == 0


# ---------------------------------------------------------------- sharded.py


def test_shard_info_of_plain_and_tbe_slice_tensors() -> None:
    data = torch.randn(24)
    tbe_slice = TableBatchedEmbeddingSlice(data, 6, 18, 3, 4)
    for tensor in (torch.randn(3, 4), tbe_slice):
        info = shard_info(tensor)
        assert info.replicated and info.global_shape == (3, 4)
        (shard,) = info.shards
        assert (shard.row_offset, shard.col_offset) == (0, 0)
        assert type(shard.tensor) is torch.Tensor and not shard.tensor.requires_grad
    view = shard_info(tbe_slice).shards[0].tensor
    assert view.data_ptr() == data[6:].data_ptr()  # a view, no copy
    assert shard_info(torch.empty(0)).shards == []


def test_log_sharded_tensor_content_single_process() -> None:
    table = torch.randn(5, 3)
    gathered = log_sharded_tensor_content("w", "t", table)
    assert gathered is not None and torch.equal(gathered, table)
    with pytest.raises(ValueError, match=r"5 rows x 3 columns.*max_rows=4"):
        log_sharded_tensor_content("w", "t", table, max_rows=4)


def test_ebc_norms_sample_size_is_a_whole_number_and_a_bad_table_is_named() -> None:
    """4e6 rows is a whole number (it reached randperm(n)[:k] as a float on larger tables)."""
    tables = {"t": _row_norm_table(200)}
    exact = log_ebc_norms(tables, ["t"], sample_size=50, seed=3)
    assert log_ebc_norms(tables, ["t"], sample_size=50.0, seed=3) == exact
    for bad in (2.5, True, "50"):
        with pytest.raises(TypeError, match="whole number of rows"):
            log_ebc_norms(tables, ["t"], sample_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'bias' of shape \(3,\).*2-D"):
        log_ebc_norms({"t": torch.ones(3, 4), "bias": torch.ones(3)}, ["t", "bias"])


@pytest.mark.parametrize(
    ("returned", "error", "says"),
    [
        (
            None,
            ValueError,
            r"returned None \(a missing return\?\) for: \['model/bad/dense\.0\.bias'",
        ),
        ("0.5", TypeError, r"not numbers: \{'model/bad/dense\.0\.bias': 'str'"),
        ([1.0, 2.0], ValueError, r"shapes: \{'model/bad/dense\.0\.bias': \(2,\)"),
        (torch.ones(0), ValueError, r"shapes: \{'model/bad/dense\.0\.bias': \(0,\)"),
        (1 + 2j, TypeError, r"not numbers: \{'model/bad/dense\.0\.bias': 'complex of"),
    ],
    ids=["None", "str", "several", "empty", "complex"],
)
def test_a_callable_returning_no_single_number_is_named_with_its_parameters(
    returned, error, says
) -> None:
    """None or a str reached torch.as_tensor (an unnamed RuntimeError / TypeError).

    ``weights_to_log`` keeps a tensor of several numbers (the original helper logged arrays);
    what must log one number per key (the callback) refuses it.
    """

    def bad(t: torch.Tensor) -> object:
        return returned

    how = {"dense.0.bias": bad, "dense.0.weight": l2_norm}
    values, found = reduce_weights(Net(), how)
    with pytest.raises(error, match=rf"^X must reduce each parameter to one number.*{says}"):
        raise bad_return_error(found, "X")
    if isinstance(returned, list | torch.Tensor):
        kept = weights_to_log(Net(), how)["model/bad/dense.0.bias"]
        assert torch.equal(kept, torch.as_tensor(returned))
        return
    with pytest.raises(error, match=rf"^how_to_log must reduce each parameter to a num.*{says}"):
        weights_to_log(Net(), how)
    with pytest.raises(error, match=r"test_norms\.test_a_callable_returning_no_single_number_is_"):
        weights_to_log(Net(), bad)  # the callable is named by its qualified name


def test_only_the_bad_returns_are_named_and_good_callables_are_unchanged() -> None:
    model = Net()

    def none_for_biases(t: torch.Tensor) -> torch.Tensor | None:
        return None if t.dim() == 1 else t.sum()

    with pytest.raises(ValueError) as caught:
        weights_to_log(model, none_for_biases)
    message = str(caught.value)
    biases = [f"model/none_for_biases/{n}" for n in _params(model) if n.endswith("bias")]
    assert f"returned None (a missing return?) for: {sorted(biases)}" in message
    assert "weight" not in message.split("for: ")[1]
    logged = weights_to_log(model, {n: none_for_biases for n in _params(model) if "weight" in n})
    for key, value in logged.items():
        expected = torch.as_tensor(_params(model)[key.split("/")[-1]].sum())
        assert torch.equal(value, expected) and value.dtype == expected.dtype
