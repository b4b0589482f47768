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


def test_dict_outputs_are_rekeyed_and_unknown_keys_kept_last() -> None:
    order = DictOrder(["x", "y"])
    out = order({"z": 3, "y": 2, "x": 1})
    assert list(out) == ["x", "y", "z"]
    same = {"x": 1, "y": 2}
    assert order(same) is same
