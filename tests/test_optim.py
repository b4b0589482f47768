"""Unit tests of training.optim: dense vs fused parameters, the combined optimizer.

Fused tables exist only once a model is sharded: those tests shard a small model on a one-rank
gloo group (one fused table-wise table, one data-parallel table, a dense layer).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim.keyed import KeyedOptimizer

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.compat.fused import kernel_values
from lightning_torchrec.compat.upstream import fused_kernels, kernel_learning_rate
from lightning_torchrec.sharding.planning import maybe_shard_model
from lightning_torchrec.training.optim import (
    DenseAndFusedOptimizer,
    _name_fused_groups,
    combine_optimizers,
    combine_with_schedulers,
    dense_named_parameters,
    dense_parameters,
    fused_optimizers,
    init_optimizer_state,
    is_fused_parameter,
    keyed_optimizer,
    optimizer_steps,
    set_optimizer_steps,
)
from tests.helpers import one_rank_group  # noqa: F401 - a fixture
from tests.scripts.factory import (
    Capture,
    cpu_trainer,
    pooled_module,
    sharding_constraints,
    table_wise,
    tiny_data,
)

FUSED_KEY = "ebc.embedding_bags.tw.weight"
DP_KEY = "ebc.embedding_bags.dp.weight"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=10, feature_names=[n])
            for n in ("tw", "dp")
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.dense = nn.Linear(3, 4)


@pytest.fixture
def sharded(one_rank_group: None) -> nn.Module:  # noqa: F811 - the fixture imported above
    """The model sharded on one rank: ``tw`` fused (learning rate 0.25), ``dp`` data-parallel."""
    return maybe_shard_model(
        Model(),
        torch.device("cpu"),
        constraints=sharding_constraints({"tw": "table_wise", "dp": "data_parallel"}),
        fused_params={"learning_rate": 0.25},
    )


def combined(module: nn.Module, lr: float = 0.1) -> DenseAndFusedOptimizer:
    opt = combine_optimizers(torch.optim.SGD(dense_parameters(module), lr=lr), module)
    assert isinstance(opt, DenseAndFusedOptimizer)
    return opt


# ---------------------------------------------------------------- which parameters are dense


def test_plain_parameters_are_not_fused() -> None:
    model = nn.Linear(3, 4)
    assert not any(is_fused_parameter(p) for p in model.parameters())
    assert dense_parameters(model) == list(model.parameters())
    model.bias.requires_grad_(False)
    assert [n for n, _ in dense_named_parameters(model)] == ["weight"]  # frozen: left out


def test_dense_parameters_exclude_fused_tables_only(sharded: nn.Module) -> None:
    params = dict(sharded.named_parameters())
    assert is_fused_parameter(params[FUSED_KEY])
    assert not is_fused_parameter(params[DP_KEY])  # data-parallel: the dense optimizer's
    assert [n for n, _ in dense_named_parameters(sharded)] == [
        DP_KEY,
        "dense.weight",
        "dense.bias",
    ]
    assert dense_parameters(sharded) == [
        params[DP_KEY],
        params["dense.weight"],
        params["dense.bias"],
    ]


def test_fused_optimizers_are_found_by_module_path(sharded: nn.Module) -> None:
    assert fused_optimizers(Model()) == []  # unsharded: nothing fused
    ((path, opt),) = fused_optimizers(nn.ModuleDict({"model": sharded}))
    assert path == "model" and isinstance(opt, KeyedOptimizer)
    assert list(opt.params) == [FUSED_KEY]


# ---------------------------------------------------------------- the combined optimizer


def test_combine_optimizers_refuses_table_parameters_naming_them(sharded: nn.Module) -> None:
    with pytest.raises(ValueError, match=rf"\['{FUSED_KEY}'\].*dense_parameters\(self\)"):
        combine_optimizers(torch.optim.SGD(sharded.parameters(), lr=0.1), sharded)


def test_param_groups_list_dense_then_fused(sharded: nn.Module) -> None:
    opt = combined(sharded, lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.25]
    assert opt.fused is not None and isinstance(opt.dense_optimizer, torch.optim.SGD)
    assert combine_optimizers(opt, sharded) is opt  # already combined
    assert set(opt.state_dict()["state"]) == {f"embedding.{FUSED_KEY}"}  # SGD keeps no state


def test_push_fused_lr_reaches_the_kernel(sharded: nn.Module) -> None:
    opt = combined(sharded)
    (kernel,) = fused_kernels(opt)
    assert kernel_learning_rate(kernel) == pytest.approx(0.25)
    opt.param_groups[-1]["lr"] = 0.5  # what an LR scheduler does
    assert kernel_learning_rate(kernel) == pytest.approx(0.25)  # not yet
    opt.push_fused_lr()
    assert kernel_learning_rate(kernel) == pytest.approx(0.5)


def test_without_fused_tables_the_combined_optimizer_is_dense_only() -> None:
    model = nn.Linear(3, 4)
    opt = combined(model)
    assert opt.fused is None and [g["lr"] for g in opt.param_groups] == [0.1]
    opt.push_fused_lr()  # nothing to push
    assert optimizer_steps(opt) == []


def test_optimizer_steps_are_read_and_set_on_every_kernel(sharded: nn.Module) -> None:
    opt = combined(sharded)
    assert optimizer_steps(opt) == [0]
    set_optimizer_steps(opt, 17)
    assert optimizer_steps(opt) == [17]
    assert optimizer_steps(opt.fused) == [17]  # type: ignore[arg-type]


def test_a_scheduler_on_the_dense_optimizer_alone_is_warned_about(
    sharded: nn.Module, recwarn: pytest.WarningsRecorder
) -> None:
    dense = torch.optim.SGD(dense_parameters(sharded), lr=0.1)
    on_dense = torch.optim.lr_scheduler.StepLR(dense, 1)
    with pytest.warns(UserWarning, match="drives the dense optimizer only"):
        opt = combine_with_schedulers(dense, sharded, [on_dense])
    assert isinstance(opt, DenseAndFusedOptimizer) and opt.fused is not None
    recwarn.clear()
    on_combined = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert combine_with_schedulers(opt, sharded, [on_combined]) is opt  # already combined
    assert not [w for w in recwarn if "drives the dense optimizer" in str(w.message)]


def test_momentum_cycling_schedulers_and_monitors_see_the_dense_settings(
    sharded: nn.Module, recwarn: pytest.WarningsRecorder
) -> None:
    # The combined optimizer showed TorchRec's defaults ({'_save_param_groups': False}) and
    # fused groups of 'lr' alone: OneCycleLR/CyclicLR refused it, LearningRateMonitor's
    # weight decay raised KeyError and its momentum read 0 for Adam.
    dense = torch.optim.Adam(dense_parameters(sharded), lr=0.1, weight_decay=0.01)
    opt = combine_optimizers(dense, sharded)
    assert isinstance(opt, DenseAndFusedOptimizer)
    assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["weight_decay"] == 0.01
    assert not opt.defaults["_save_param_groups"]
    (kernel,) = fused_kernels(opt)
    fused = opt.param_groups[-1]
    args = kernel.optimizer_args  # the kernel's own values, not the dense optimizer's
    assert fused["weight_decay"] == args.weight_decay and fused["eps"] == pytest.approx(args.eps)
    # The default kernel (row-wise Adagrad) applies no momentum: fbgemm's unused beta1 of 0.9
    # was shown (a LearningRateMonitor logs betas[0] as the momentum).
    assert fused["betas"] == (0.0, pytest.approx(args.beta2)) and args.beta1 == pytest.approx(0.9)
    assert "momentum" not in fused  # Adam has none: only the dense optimizer's keys are added
    assert opt.off_kernel_values() == []
    recwarn.clear()
    torch.optim.lr_scheduler.StepLR(opt, 1)
    combine_with_schedulers(opt, sharded, [])
    assert not [w for w in recwarn if "sets" in str(w.message)]
    cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10)
    assert [g["betas"][0] for g in opt.param_groups] == [0.95, 0.95]
    with pytest.warns(UserWarning, match=r"sets \['betas'\] of the fused embedding param groups"):
        combine_with_schedulers(opt, sharded, [cycle])
    cycle.step()
    opt.push_fused_lr()
    assert kernel_learning_rate(kernel) == pytest.approx(fused["lr"])  # the lr still reaches it
    sgd = combine_optimizers(
        torch.optim.SGD(dense_parameters(sharded), lr=0.1, momentum=0.9), sharded
    )
    assert sgd.param_groups[-1]["momentum"] == 0.0 and args.momentum == pytest.approx(0.9)
    torch.optim.lr_scheduler.CyclicLR(sgd, 0.01, 0.1)  # cycles momentum: was refused


@pytest.mark.parametrize(
    ("kind", "momentum"),
    [
        (EmbOptimType.EXACT_SGD, 0.0),
        (EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.0),
        (EmbOptimType.LARS_SGD, 0.5),  # its own momentum
        (EmbOptimType.ADAM, 0.8),  # its beta1
        (EmbOptimType.PARTIAL_ROWWISE_LAMB, 0.8),
    ],
)
def test_a_kernels_momentum_is_what_its_update_applies(kind: EmbOptimType, momentum: float) -> None:
    args = SimpleNamespace(momentum=0.5, beta1=0.8, beta2=0.99, weight_decay=0.0, eps=1e-8)
    values = kernel_values(SimpleNamespace(optimizer=kind, optimizer_args=args))
    assert values["momentum"] == values["betas"][0] == momentum
    assert values["betas"][1] == 0.99


def test_init_optimizer_state_materialises_adam_state() -> None:
    model = nn.Linear(3, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = combine_optimizers(torch.optim.Adam(model.parameters(), lr=0.1), model)
    assert isinstance(opt, DenseAndFusedOptimizer) and len(opt.dense.state) == 0
    init_optimizer_state(opt)
    assert set(opt.dense.state) == set(opt.dense.params.values())
    for p in model.parameters():
        assert {"step", "exp_avg", "exp_avg_sq"} <= set(opt.dense.state[p])
        assert p.grad is None
    for n, p in model.named_parameters():  # a step on zero gradients moves nothing
        assert torch.equal(p, before[n]), n
    assert set(opt.state_dict()["state"]) == {"dense.weight", "dense.bias"}


def test_keyed_optimizer_unwraps_lightning_and_refuses_plain_torch() -> None:
    model = nn.Linear(3, 4)
    opt = combined(model)
    assert keyed_optimizer(opt) is opt
    assert keyed_optimizer(LightningOptimizer(opt)) is opt
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    for wrapped in (plain, LightningOptimizer(plain)):
        with pytest.raises(TypeError, match="got SGD.*combine_optimizers"):
            keyed_optimizer(wrapped)


def test_learning_rate_monitor_names_fused_groups_by_their_tables(tmp_path: Path) -> None:
    # It named them by position (pg2, pg3): which tables a curve belonged to depended on the plan.
    module = pooled_module(own_lrs=(0.1, 0.02))
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False)
    logger = Capture()
    trainer = cpu_trainer(
        strategy,
        max_steps=2,
        limit_val_batches=0,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor(logging_interval="step", log_momentum=True)],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=tiny_data(40, 2, batch_size=16, train_batches=4, seed=2))
    logged = logger.metrics[0]
    prefix = "lr-DenseAndFusedOptimizer"
    assert logged[f"{prefix}/pg1"] == pytest.approx(1e-2)  # the dense group keeps its name
    assert logged[f"{prefix}/tables:t_cat_0"] == pytest.approx(0.1)
    assert logged[f"{prefix}/tables:t_cat_1"] == pytest.approx(0.02)
    # The tables' SGD kernels apply no momentum: it read fbgemm's unused 0.9 (Adam's beta1 is
    # the dense group's).
    assert logged[f"{prefix}/pg1-momentum"] == pytest.approx(0.9)
    assert logged[f"{prefix}/tables:t_cat_0-momentum"] == 0.0
    assert logged[f"{prefix}/tables:t_cat_1-momentum"] == 0.0


def test_fused_group_names_are_short_and_unique() -> None:
    def kernel(*tables: str) -> SimpleNamespace:
        return SimpleNamespace(table_names=list(tables))

    many = [f"t{i}" for i in range(6)]
    groups: list[dict] = [{}, {}, {}, {}, {"name": "mine"}]
    kernels = [kernel(*many), kernel(*many), kernel("a", "a", "b"), kernel(), kernel("c")]
    _name_fused_groups(list(zip(groups, kernels, strict=True)), dense=1)
    assert [g.get("name") for g in groups] == [
        "tables:t0,t1,t2,t3,+2 more",
        "tables:t0,t1,t2,t3,+2 more (pg3)",  # LearningRateMonitor refuses two alike
        "tables:a,b",  # a column-wise table's shards name it once
        None,  # a kernel built without names: Lightning's pgN
        "mine",  # a name given by the user stays
    ]
