"""Unit tests of sharding.tables: where a model's tables are and what they hold."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.modules.embedding_configs import DataType

from lightning_torchrec.sharding.features import feature_specs
from lightning_torchrec.sharding.tables import (
    configs_of,
    dense_bytes,
    dense_width,
    embedding_modules,
    embedding_tables,
    human_bytes,
    materialized_tables,
    model_tensors,
    module_table_configs,
    table_bytes,
    table_configs,
    table_of_key,
    unwrap,
)
from tests.helpers import one_rank_group  # noqa: F401 - a fixture

META = torch.device("meta")


def bag(
    name: str, rows: int, dim: int = 4, features: list[str] | None = None, **kw
) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name, embedding_dim=dim, num_embeddings=rows, feature_names=features or [name], **kw
    )


def nested(device: torch.device = META) -> nn.Module:
    """An EBC two levels down (on ``device``), an EC (built whole) and a dense layer."""
    ebc = EmbeddingBagCollection(tables=[bag("a", 10), bag("b", 20, 8)], device=device)
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="e", embedding_dim=4, num_embeddings=5, feature_names=["c"])]
    )
    return nn.ModuleDict({"outer": nn.ModuleDict({"ebc": ebc}), "ec": ec, "dense": nn.Linear(3, 4)})


def test_embedding_modules_and_table_configs_of_a_nested_model() -> None:
    model = nested()
    modules = embedding_modules(model)
    assert list(modules) == ["outer.ebc", "ec"]  # model order
    assert [c.name for c in modules["outer.ebc"]] == ["a", "b"]
    assert [c.name for c in modules["ec"]] == ["e"]
    configs = table_configs(model)
    assert list(configs) == ["a", "b", "e"]
    assert (configs["b"].num_embeddings, configs["b"].embedding_dim) == (20, 8)
    ebc = model["outer"]["ebc"]
    assert list(embedding_modules(ebc)) == [""]  # the model itself is one
    assert [c.name for c in configs_of(ebc) or []] == ["a", "b"]
    assert configs_of(model["dense"]) is None


def test_module_table_configs_by_plan_path() -> None:
    model = nested()
    assert list(module_table_configs(model, "outer.ebc")) == ["a", "b"]
    assert list(module_table_configs(model, "ec")) == ["e"]
    assert module_table_configs(model, "outer.nothing") == {}  # missing module
    assert module_table_configs(model, "dense") == {}  # no tables there
    assert list(module_table_configs(model["outer"]["ebc"], "")) == ["a", "b"]


def test_table_bytes_follow_the_data_type() -> None:
    assert table_bytes(bag("t", 10)) == 10 * 4 * 4
    assert table_bytes(bag("t", 10, data_type=DataType.FP16)) == 10 * 4 * 2
    assert table_bytes(bag("t", 3, 8, data_type=DataType.INT8)) == 3 * 8


def test_dense_bytes_exclude_tables_and_count_meta_tensors_and_buffers() -> None:
    model = nested()
    assert dense_bytes(model) == (3 * 4 + 4) * 4  # the Linear only: no table, on meta or not
    model["norm"] = nn.BatchNorm1d(4, device=META)  # weight, bias, 2 running stats, counter
    assert dense_bytes(model) == (3 * 4 + 4) * 4 + 4 * 4 * 4 + 8


def test_human_bytes() -> None:
    assert human_bytes(100) == "100 B"
    assert human_bytes(2048) == "2.0 KiB"
    assert human_bytes(3.5 * 2**20) == "3.5 MiB"
    assert human_bytes(5 * 2**40) == "5120.0 GiB"  # GiB is the largest unit


def test_table_of_key_for_weights_and_optimizer_state() -> None:
    assert table_of_key("model.ebc.embedding_bags.t_cat_0.weight") == "t_cat_0"
    assert table_of_key("ec.embeddings.e.weight") == "e"
    state = "embedding.model.ebc.embedding_bags.t_cat_1.weight.t_cat_1.momentum1"
    assert table_of_key(state) == "t_cat_1"
    assert table_of_key("dense.weight") == "dense.weight"  # no table: the key itself
    assert table_of_key("x.embeddings") == "x.embeddings"


def test_feature_specs_give_a_shared_feature_the_smallest_table() -> None:
    for order in ([("big", 50), ("small", 7)], [("small", 7), ("big", 50)]):
        ebc = EmbeddingBagCollection(
            tables=[bag(n, rows, features=["shared", f"own_{n}"]) for n, rows in order],
            device=META,
        )
        specs = feature_specs(ebc)
        assert (specs["shared"].table, specs["shared"].num_embeddings) == ("small", 7)
        assert (specs["own_big"].table, specs["own_big"].num_embeddings) == ("big", 50)
        assert set(specs) == {"shared", "own_big", "own_small"}


def test_dense_width_from_attribute_or_hparams() -> None:
    module = nn.Module()
    assert dense_width(module) is None
    module.hparams = {"num_dense_features": 13}  # type: ignore[assignment]
    assert dense_width(module) == 13
    module.num_dense_features = 3  # type: ignore[assignment]
    assert dense_width(module) == 3  # the attribute wins


def test_embedding_table_names_find_ebc_and_ec_tables_by_state_dict_key() -> None:
    model = nested(torch.device("cpu"))
    names = list(embedding_tables(model))
    assert names == [
        "outer.ebc.embedding_bags.a.weight",
        "outer.ebc.embedding_bags.b.weight",
        "ec.embeddings.e.weight",
    ]
    assert set(names) <= set(model.state_dict())
    tables = embedding_tables(model)
    assert tables["ec.embeddings.e.weight"] is model["ec"].embeddings["e"].weight


def test_model_tensors_list_tied_parameters_once_and_mark_tables() -> None:
    model = nested()
    model["tied"] = nn.Linear(3, 4)
    model["tied"].weight = model["dense"].weight
    tensors = model_tensors(model)
    assert list(tensors) == [
        "outer.ebc.embedding_bags.a.weight",
        "outer.ebc.embedding_bags.b.weight",
        "ec.embeddings.e.weight",
        "dense.weight",
        "dense.bias",
        "tied.bias",
    ]
    assert [is_table for _, is_table in tensors.values()] == [True] * 3 + [False] * 3


def test_materialized_tables_are_the_ones_not_on_meta_detached() -> None:
    model = nested()  # the EBC on meta, the EC built whole
    found = materialized_tables(model)
    assert list(found) == ["ec.embeddings.e.weight"]
    assert not found["ec.embeddings.e.weight"].requires_grad
    assert torch.equal(found["ec.embeddings.e.weight"], model["ec"].embeddings["e"].weight)
    assert list(materialized_tables(nested(torch.device("cpu")))) == [
        "outer.ebc.embedding_bags.a.weight",
        "outer.ebc.embedding_bags.b.weight",
        "ec.embeddings.e.weight",
    ]


def test_unwrap_sees_through_torch_compile() -> None:
    model = nested()
    compiled = torch.compile(model)  # wraps lazily: nothing is compiled until called
    assert compiled is not model and unwrap(compiled) is model
    assert unwrap(model) is model
    assert list(embedding_modules(compiled)) == ["outer.ebc", "ec"]
    assert list(embedding_tables(compiled)) == list(embedding_tables(model))


@pytest.mark.usefixtures("one_rank_group")
def test_unwrap_sees_through_ddp_inside_torch_compile() -> None:
    inner = nn.Linear(3, 4)
    wrapped = torch.compile(nn.parallel.DistributedDataParallel(inner))
    assert unwrap(wrapped) is inner
    assert list(model_tensors(wrapped)) == ["weight", "bias"]  # no wrapper prefixes
