"""TorchRec's own test models under ``strategy="torchrec"`` on 2 CPU ranks, in one launch.

Phases (each rank writes ``{phase}_rank{r}.pt`` into argv[1]):

1. ``sparse_nn``: TorchRec's ``TestSparseNN`` (unweighted and weighted tables) for each sharding
   type of argv[2] (comma-separated), trained ``STEPS`` steps with fused and dense SGD (lr 0.1)
   on this rank's part of ``ModelInput.generate``'s batches; beside it, an unsharded copy
   trained on the global batches, as ``torchrec.distributed.test_utils.test_sharding``'s
   ``sharding_single_rank_test`` does. Saves both models' predictions on a held-out batch.
2. ``mixed``: TorchRec's ``TestMixedEmbeddingSparseArch`` (an EBC and an EC) the same way,
   table-wise, comparing the pooled and sequence outputs.
3. ``resume_{name}``: ``torchrec.models``' ``DLRM_DCN`` (row-wise tables) and ``DeepFM``
   trained ``2 * HALF`` steps with a checkpoint after ``HALF``, then a fresh model resumed from
   it; saves both end states.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.test_utils.test_model import (
    ModelInput,
    TestMixedEmbeddingSparseArch,
    TestSparseNN,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import TorchRecStrategy, dense_parameters

OUT = Path(sys.argv[1]) if __name__ == "__main__" else Path()
TYPES = sys.argv[2].split(",") if __name__ == "__main__" and len(sys.argv) > 2 else []
STEPS = int(os.environ.get("CONFORMANCE_STEPS", "3"))
HALF = 2
RAW = 4000  # managed-collision tables: raw ids below this, remapped into 40 rows
BATCH = 8
SGD = {"optimizer": "exact_sgd", "learning_rate": 0.1}
QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 2,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
    "use_distributed_sampler": False,  # PerRank gives each rank its own part
}

TABLES = [
    EmbeddingBagConfig(
        num_embeddings=(i + 1) * 10,
        embedding_dim=(i + 2) * 4,
        name=f"table_{i}",
        feature_names=[f"feature_{i}"],
    )
    for i in range(4)
]
WEIGHTED = [
    EmbeddingBagConfig(
        num_embeddings=(i + 1) * 10,
        embedding_dim=(i + 2) * 4,
        name=f"weighted_table_{i}",
        feature_names=[f"weighted_feature_{i}"],
    )
    for i in range(2)
]


class Wrapped(L.LightningModule):
    """A plain LightningModule around a TorchRec test model returning ``(loss, pred)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _ = self.model(batch)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(dense_parameters(self), lr=0.1)


def batches(step_seed: int, tables: list[Any], weighted: list[Any]) -> tuple[Any, list[Any]]:
    """The global batch of a step and each rank's part (the same on every rank)."""
    torch.manual_seed(step_seed)
    return ModelInput.generate(
        batch_size=BATCH,
        world_size=2,
        num_float_features=10,
        tables=tables,
        weighted_tables=weighted,
        random_seed=step_seed,
    )


def constrained(names: list[str], sharding_type: str) -> dict[str, ParameterConstraints]:
    return {n: ParameterConstraints(sharding_types=[sharding_type]) for n in names}


def train_global(model: nn.Module, inputs: list[ModelInput]) -> None:
    """The unsharded copy, on the global batches: SGD over every parameter (TorchRec's test)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for batch in inputs:
        opt.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        opt.step()


class PerRank(torch.utils.data.Dataset):
    """``parts[r][i]`` on rank ``r``: the rank is known only once Lightning has launched it."""

    def __init__(self, parts: list[list[Any]]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return len(self.parts[0])

    def __getitem__(self, i: int) -> Any:
        return self.parts[rank()][i]


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def fit(module: L.LightningModule, data: PerRank, strategy: TorchRecStrategy, **kw: Any) -> Any:
    ckpt_path = kw.pop("ckpt_path", None)
    trainer = L.Trainer(strategy=strategy, max_steps=kw.pop("max_steps", len(data)), **QUIET | kw)
    trainer.fit(module, DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    return trainer


def against_unsharded(
    tag: str, build: Any, tables: list[Any], weighted: list[Any], types: list[str]
) -> None:
    """``build()`` sharded by each of ``types`` vs. its unsharded copy on the global batches."""
    steps = [batches(100 + s, tables, weighted) for s in range(STEPS)]
    held_out = batches(999, tables, weighted)
    names = [t.name for t in tables + weighted]
    out: dict[str, Any] = {}
    for sharding_type in types:
        torch.manual_seed(0)
        model = build()  # tables built whole on the CPU: the shards take their values
        unsharded = copy.deepcopy(model)
        with torch.no_grad():
            before = copy.deepcopy(model).eval()(held_out[0]).detach()
        module = Wrapped(model)
        strategy = TorchRecStrategy(
            constraints=constrained(names, sharding_type), fused_params=SGD, log_plan=False
        )
        trainer = fit(module, PerRank([[loc[r] for _, loc in steps] for r in range(2)]), strategy)
        plan = trainer.strategy.sharding_plan.plan
        train_global(unsharded, [g for g, _ in steps])
        module.eval()
        unsharded.eval()
        with torch.no_grad():
            out[sharding_type] = {
                "plan": {t: ps.sharding_type for m in plan.values() for t, ps in m.items()},
                "local": module.model(held_out[1][rank()]).detach(),
                "global": unsharded(held_out[0]).detach(),
                "before": before,
            }
    torch.save(out, OUT / f"{tag}_rank{rank()}.pt")


def sparse_nn() -> None:
    """TestSparseNN, unweighted and weighted tables, on every sharding type of argv[2]."""
    cpu = torch.device("cpu")

    def build() -> nn.Module:
        return TestSparseNN(
            tables=TABLES, weighted_tables=WEIGHTED, dense_device=cpu, sparse_device=cpu
        )

    against_unsharded("sparse_nn", build, TABLES, WEIGHTED, TYPES)


def mixed() -> None:
    """TestMixedEmbeddingSparseArch: an EBC and an EC table, on the types both run on CPU."""
    tables: list[Any] = [
        EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="bag", feature_names=["f0"]),
        EmbeddingConfig(num_embeddings=30, embedding_dim=8, name="seq", feature_names=["f1"]),
    ]
    cpu = torch.device("cpu")

    def build() -> nn.Module:
        return TestMixedEmbeddingSparseArch(
            tables=tables, dense_device=cpu, sparse_device=cpu, device=cpu
        )

    types = [t for t in ("table_wise", "column_wise", "row_wise") if t in TYPES]
    against_unsharded("mixed", build, tables, [], types)


class ManagedBags(nn.Module):
    """A ``ManagedCollisionEmbeddingBagCollection`` (raw ids below ``RAW``) and a linear head."""

    def __init__(self, tables: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        from torchrec.modules.mc_embedding_modules import (
            ManagedCollisionEmbeddingBagCollection,
        )
        from torchrec.modules.mc_modules import (
            LFU_EvictionPolicy,
            ManagedCollisionCollection,
            MCHManagedCollisionModule,
        )

        # Evicted rows are re-initialised with init_fn: zeros keeps resume exact.
        tables = [dataclasses.replace(t, init_fn=nn.init.zeros_) for t in tables]
        mc = ManagedCollisionCollection(
            {
                t.name: MCHManagedCollisionModule(
                    zch_size=t.num_embeddings,
                    device=torch.device("cpu"),
                    eviction_policy=LFU_EvictionPolicy(),
                    eviction_interval=1,
                    input_hash_size=RAW,
                    buckets=2,
                    name=t.name,
                )
                for t in tables
            },
            tables,
        )
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.mc_ebc = ManagedCollisionEmbeddingBagCollection(ebc, mc)
        self.over = nn.Linear(4 + 2 * 8, 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled, _ = self.mc_ebc(kjt)
        return self.over(torch.cat([dense, pooled["f0"], pooled["f1"]], dim=1))


class DLRMWrapped(L.LightningModule):
    """``torchrec.models``' DLRM_DCN or DeepFM with a BCE loss on ``(dense, kjt, labels)``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        from torchrec.models.deepfm import SimpleDeepFMNN
        from torchrec.models.dlrm import DLRM_DCN

        torch.manual_seed(0)
        tables = [
            EmbeddingBagConfig(
                num_embeddings=40, embedding_dim=8, name=f"t{i}", feature_names=[f"f{i}"]
            )
            for i in range(2)
        ]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        if kind == "mc_ebc":
            self.model = ManagedBags(tables)
        elif kind == "dlrm_dcn":
            self.model: nn.Module = DLRM_DCN(
                ebc,
                dense_in_features=4,
                dense_arch_layer_sizes=[8, 8],
                over_arch_layer_sizes=[8, 1],
                dcn_num_layers=2,
                dcn_low_rank_dim=4,
            )
        else:
            self.model = SimpleDeepFMNN(
                num_dense_features=4,
                embedding_bag_collection=ebc,
                hidden_layer_size=8,
                deep_fm_dimension=4,
            )

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.model(dense, kjt)

    def example_inputs(self) -> tuple[torch.Tensor, KeyedJaggedTensor]:
        """Inputs to export with (a batch of the data)."""
        dense, kjt, _ = click_batches(0, 1)[0]
        return dense, kjt

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        dense, kjt, labels = batch
        logits = self(dense, kjt).squeeze(-1)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(dense_parameters(self), lr=0.05)


def click_batches(
    r: int, n: int, ids_below: int = 40
) -> list[tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(1000 * r + s)
        lengths = torch.randint(0, 3, (2 * BATCH,), generator=g)
        ids = torch.randint(0, ids_below, (int(lengths.sum()),), generator=g)
        out.append(
            (
                torch.randn(BATCH, 4, generator=g),
                KeyedJaggedTensor(["f0", "f1"], ids, lengths=lengths),
                torch.randint(0, 2, (BATCH,), generator=g).float(),
            )
        )
    return out


def resume() -> None:
    """Each model: 2 epochs of HALF steps, a checkpoint after the first; then resumed from it.

    At an epoch's end: Lightning replays an epoch from its start when resuming mid-epoch from a
    loader without ``state_dict``.
    """
    from rank_state import local_view  # sibling module (script directory; the tests import this)

    row_wise = "row_wise" if "row_wise" in TYPES else "table_wise"  # where gloo can
    runs: list[tuple[str, str | None]] = [("dlrm_dcn", row_wise), ("deepfm", "table_wise")]
    if "row_wise" in TYPES:  # managed collision: row-wise only, offered by the planner itself
        runs.append(("mc_ebc", None))
    for kind, sharding_type in runs:
        data = PerRank([click_batches(r, HALF, RAW if kind == "mc_ebc" else 40) for r in range(2)])
        states = {}
        # A row-wise checkpoint also resumes table-wise (resharded through the checkpoint).
        resharded = kind == "dlrm_dcn" and sharding_type == "row_wise"
        for run in ("straight", "resumed", "resharded")[: 3 if resharded else 2]:
            module = DLRMWrapped(kind)
            types = "table_wise" if run == "resharded" else sharding_type
            strategy = TorchRecStrategy(
                constraints=constrained(["t0", "t1"], types) if types else None,
                fused_params=SGD if kind == "mc_ebc" else None,  # CPU: no Adagrad state reset
                log_plan=False,
            )
            extra: dict[str, Any] = {"max_steps": 2 * HALF}
            if run != "resumed":
                every = ModelCheckpoint(
                    OUT / f"ckpt_{kind}_{run}",
                    every_n_epochs=1,
                    save_top_k=-1,
                    save_on_train_epoch_end=True,
                )
                extra |= {"callbacks": [every], "enable_checkpointing": True}
            if run != "straight":
                extra["ckpt_path"] = str(OUT / f"ckpt_{kind}_straight/epoch=0-step={HALF}.ckpt")
            trainer = fit(module, data, strategy, **extra)
            assert trainer.global_step == 2 * HALF, trainer.global_step
            plan = trainer.strategy.sharding_plan.plan
            types_run = {t: ps.sharding_type for m in plan.values() for t, ps in m.items()}
            if run == "resharded":
                states["resharded_plan"] = types_run
                continue
            states[run] = local_view(module.state_dict())
            states.setdefault("plan", types_run)
        torch.save(states, OUT / f"resume_{kind}_rank{rank()}.pt")


def main() -> None:
    phases = sys.argv[3].split(",") if len(sys.argv) > 3 else ["sparse_nn", "mixed", "resume"]
    for phase in phases:
        {"sparse_nn": sparse_nn, "mixed": mixed, "resume": resume}[phase]()


if __name__ == "__main__":
    main()
