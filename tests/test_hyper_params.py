"""Hyper-parameters, step counters and LR-scheduler states matched across plans (no processes)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim import apply_optimizer_in_backward

from lightning_torchrec.checkpoint.common import hyper_params
from lightning_torchrec.checkpoint.hyper_params import (
    apply_hyper_params,
    group_sources,
    merge_run_records,
    read_run_record,
    run_record,
    scheduler_state,
)
from lightning_torchrec.errors import CheckpointCorruptError
from lightning_torchrec.lightning.checkpoint_hooks import match_scheduler_states
from lightning_torchrec.sharding.planning import maybe_shard_model
from lightning_torchrec.training.optim import combine_optimizers, dense_parameters
from tests.helpers import one_rank_group  # noqa: F401 - a fixture
from tests.scripts.factory import table_wise

FUSED = {"learning_rate": 0.05}


def test_dense_groups_line_up_and_fused_groups_take_a_saved_fused_groups_values() -> None:
    assert group_sources((2, 3), (2, 3)) == [0, 1, 2, 3, 4]  # same plan: one to one
    assert group_sources((2, 1), (2, 3)) == [0, 1, 2, 2, 2]  # never the dense group's values
    assert group_sources((1, 3), (1, 2)) == [0, 1, 1]
    assert group_sources((1, 0), (1, 2)) == [0, None, None]  # no fused group saved here
    assert group_sources((1, 2), (2, 2)) == [0, 0, 1, 2]  # another dense optimizer


def test_the_run_record_takes_the_largest_counter_and_a_saved_fused_group() -> None:
    ranks = [
        [{"step": None, "fused_group": None}],
        [{"step": 7, "fused_group": {"lr": 0.1}}],
        [{"step": 6, "fused_group": {"lr": 0.1}}],
    ]
    assert merge_run_records(ranks) == [{"step": 7, "fused_group": {"lr": 0.1}, "fused_tables": {}}]
    assert merge_run_records([[{"step": None, "fused_group": None}]] * 2) == [
        {"step": None, "fused_group": None, "fused_tables": {}}
    ]


def test_the_run_record_keeps_every_ranks_tables_with_their_own_values() -> None:
    ranks = [
        [{"step": 3, "fused_group": {"lr": 0.5}, "fused_tables": {"a": {"lr": 0.5}}}],
        [{"step": 3, "fused_group": {"lr": 0.1}, "fused_tables": {"b": {"lr": 0.1}}}],
        [{"step": 3, "fused_group": {"lr": 0.5}, "fused_tables": {"a": {"lr": 0.5}}}],
    ]
    (merged,) = merge_run_records(ranks)
    assert merged["fused_tables"] == {"a": {"lr": 0.5}, "b": {"lr": 0.1}}
    meta = {"pkg": {"optimizers": [merged]}}
    assert read_run_record(meta, "pkg", "ckpt/meta.pt") == [merged]


@pytest.mark.parametrize(
    "record",
    [
        "not a list",
        [{"step": -1, "fused_group": None}],
        [{"step": 1.5, "fused_group": None}],
        [{"step": True, "fused_group": None}],
        [{"step": 1, "fused_group": {1: 0.1}}],
        [{"step": 1}],
        [{"step": 1, "fused_group": None, "code": "x"}],
        [{"step": 1, "fused_group": None, "fused_tables": ["a"]}],
        [{"step": 1, "fused_group": None, "fused_tables": {"a": 0.1}}],
        [{"step": 1, "fused_group": None, "fused_tables": {"a": {2: 0.1}}}],
        [{"step": 1, "fused_group": None, "fused_tables": {3: {"lr": 0.1}}}],
    ],
)
def test_a_crafted_run_record_is_refused_naming_the_file(record: object) -> None:
    with pytest.raises(CheckpointCorruptError, match="meta.pt: its record of the optimizers"):
        read_run_record({"pkg": {"optimizers": record}}, "pkg", "ckpt/meta.pt")
    assert read_run_record({}, "pkg", "ckpt/meta.pt") == []  # older checkpoints: none


class Groups:
    """A keyed optimizer's param groups as ``group_split`` reads them (all dense)."""

    def __init__(self, lrs: list[float]) -> None:
        self.param_groups = [{"lr": lr, "initial_lr": lr} for lr in lrs]


def test_scheduler_lists_follow_the_groups_and_nested_schedulers_too() -> None:
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    opt = torch.optim.SGD([{"params": [p]} for p in params], lr=0.1)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    fresh = lam.state_dict()
    saved = {"base_lrs": [0.5], "_last_lr": [0.25], "last_epoch": 3, "lr_lambdas": [None]}
    matched = scheduler_state(saved, Groups([0.1, 0.2, 0.3]), fresh)
    # all three groups count as dense here: the first saved group's values for the others
    assert matched["base_lrs"] == [0.5, 0.5, 0.5] and matched["_last_lr"] == [0.25] * 3
    assert matched["last_epoch"] == 3 and matched["lr_lambdas"] == [None] * 3
    nested = scheduler_state({"_schedulers": [saved, 4]}, Groups([0.1, 0.2]))
    assert nested["_schedulers"][0]["base_lrs"] == [0.5, 0.5] and nested["_schedulers"][1] == 4
    lined_up = {"base_lrs": [0.5, 0.6], "_last_lr": [0.1, 0.2]}
    assert scheduler_state(lined_up, Groups([0.1, 0.2])) == lined_up


def test_a_scheduler_on_a_plain_optimizer_is_matched_as_all_dense() -> None:
    # A scheduler built on the dense torch optimizer alone (warned about, still supported).
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    dense = torch.optim.SGD([{"params": [p]} for p in params], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(dense, lambda s: 1 / (1 + s))
    trainer = SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
    saved = scheduler.state_dict()
    meta = {"lr_schedulers": [saved]}
    match_scheduler_states(meta, trainer)
    assert meta["lr_schedulers"] == [saved]
    meta = {"lr_schedulers": [{**saved, "base_lrs": [0.3]}]}  # saved with one group
    match_scheduler_states(meta, trainer)
    assert meta["lr_schedulers"][0]["base_lrs"] == [0.3, 0.3]


class Towers(nn.Module):
    """A user tower and an item tower, each with a table named ``t`` on its own SGD rate."""

    def __init__(self) -> None:
        super().__init__()
        for tower, lr in (("user", 0.3), ("item", 0.01)):
            table = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10)
            table.feature_names = [f"{tower}_id"]
            ebc = EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
            with warnings.catch_warnings():  # TorchRec points to torch's private equivalent
                warnings.simplefilter("ignore", DeprecationWarning)
                apply_optimizer_in_backward(
                    torch.optim.SGD, [ebc.embedding_bags["t"].weight], {"lr": lr}
                )
            setattr(self, tower, ebc)
        self.head = nn.Linear(8, 1)


@pytest.mark.usefixtures("one_rank_group")
def test_same_named_tables_of_two_collections_resume_their_own_rates() -> None:
    # Keyed by table name alone, the item tower's table resumed at the user tower's rate (30x).
    sharded = maybe_shard_model(Towers(), torch.device("cpu"))
    opt = combine_optimizers(torch.optim.SGD(dense_parameters(sharded), lr=0.1), sharded)
    record = merge_run_records([run_record([opt])])
    tables = record[0]["fused_tables"]
    assert {k: v["lr"] for k, v in tables.items()} == pytest.approx({"user/t": 0.3, "item/t": 0.01})
    saved = {"param_groups": [hyper_params(opt)]}
    for group in opt.param_groups:
        group["lr"] = 1.0
    apply_hyper_params(saved, record, 0, opt)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.3, 0.01])
    # Another wrapping of the model (other paths): each table found by its name, when unique.
    renamed = [{**record[0], "fused_tables": {"tower/t": {"lr": 0.5}}}]
    apply_hyper_params({"param_groups": [[]]}, renamed, 0, opt)
    assert [g["lr"] for g in opt.param_groups][1:] == [0.5, 0.5]


@pytest.mark.usefixtures("one_rank_group")
def test_tables_saved_at_different_rates_now_in_one_kernel_keep_its_own_and_say_so() -> None:
    # Each took the first saved fused group's rate (a table saved at 0.01 trained at 0.3).
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=10, feature_names=[n])
        for n in ("a", "b")
    ]
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model.head = nn.Linear(8, 1)
    sharded = maybe_shard_model(
        model, torch.device("cpu"), constraints=table_wise(["a", "b"]), fused_params=FUSED
    )
    opt = combine_optimizers(torch.optim.SGD(dense_parameters(sharded), lr=0.1), sharded)
    saved = {"a": {"lr": 0.3}, "b": {"lr": 0.01}}  # two tables of their own optimizers
    record = [{"step": 3, "fused_group": {"lr": 0.3}, "fused_tables": saved}]
    with pytest.warns(UserWarning, match=r"\['ebc/a', 'ebc/b'\] share one fused kernel now"):
        apply_hyper_params({"param_groups": [[{"lr": 0.1}, {"lr": 0.3}]]}, record, 0, opt)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.05])
