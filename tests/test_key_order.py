"""Unit tests of sharding.key_order: outputs in the unsharded module's key order."""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedTensor

from lightning_torchrec.sharding.key_order import DictOrder, KeyedTensorOrder, unsharded_key_order


def test_unsharded_order_names_shared_features_by_table() -> None:
    configs = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=5, feature_names=["a", "s"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=5, feature_names=["s", "b"]),
    ]
    assert unsharded_key_order(configs) == ["a", "s@t0", "s@t1", "b"]
    seq = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["x", "y"])]
    assert unsharded_key_order(seq) == ["x", "y"]


def test_keyed_tensor_columns_follow_the_keys_and_gradients_flow_back() -> None:
    values = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6).requires_grad_()
    kt = KeyedTensor(keys=["b", "a", "c"], length_per_key=[1, 3, 2], values=values)
    order = KeyedTensorOrder(["a", "b", "c"])
    out = order(kt)
    assert out.keys() == ["a", "b", "c"] and out.length_per_key() == [3, 1, 2]
    for key in ("a", "b", "c"):
        assert torch.equal(out[key], kt[key]), key
    weights = torch.arange(6, dtype=torch.float32)
    (out.values() * weights).sum().backward()
    # d/dvalues: each original column gets the weight of the position it moved to.
    expected = torch.tensor([3.0, 0.0, 1.0, 2.0, 4.0, 5.0]).expand(2, 6)
    assert torch.equal(values.grad, expected)
    assert order(out) is out  # already in order: no copy


def test_per_key_reads_are_views_and_the_whole_values_are_permuted_once() -> None:
    source = torch.randn(3, 6, dtype=torch.float64)
    order = KeyedTensorOrder(["a", "b", "c"])

    def grads(read: str) -> tuple[torch.Tensor, torch.Tensor]:
        values = source.clone().requires_grad_()
        kt = KeyedTensor(keys=["b", "a", "c"], length_per_key=[1, 3, 2], values=values)
        out = order(kt)
        if read == "to_dict":
            parts = out.to_dict()
            assert list(parts) == ["a", "b", "c"]
            assert out._ordered is None  # no permuted copy was made
            joined = torch.cat(list(parts.values()), dim=1)
        elif read == "getitem":
            joined = torch.cat([out[k] for k in ("a", "b", "c")], dim=1)
            assert out._ordered is None
        else:
            joined = out.values()
            assert out.values() is joined  # permuted once
        assert out.device() == values.device and out.size_in_bytes() == kt.size_in_bytes()
        (joined * torch.arange(18, dtype=torch.float64).reshape(3, 6)).sum().backward()
        return joined.detach(), values.grad

    whole, whole_grad = grads("values")
    for read in ("to_dict", "getitem"):
        joined, grad = grads(read)
        assert torch.equal(joined, whole), read
        assert torch.equal(grad, whole_grad), read
    expected = torch.cat([source[:, 1:4], source[:, :1], source[:, 4:]], dim=1)
    assert torch.equal(whole, expected)


def test_regroup_reads_the_keys_in_the_target_order() -> None:
    values = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    kt = KeyedTensor(keys=["b", "a", "c"], length_per_key=[1, 3, 2], values=values)
    out = KeyedTensorOrder(["a", "b", "c"])(kt)
    (ab, c) = KeyedTensor.regroup([out], [["a", "b"], ["c"]])
    assert torch.equal(ab, torch.cat([kt["a"], kt["b"]], dim=1))
    assert torch.equal(c, kt["c"])


def test_dict_outputs_are_rekeyed_and_unknown_keys_kept_last() -> None:
    order = DictOrder(["x", "y"])
    out = order({"z": 3, "y": 2, "x": 1})
    assert list(out) == ["x", "y", "z"]
    same = {"x": 1, "y": 2}
    assert order(same) is same
