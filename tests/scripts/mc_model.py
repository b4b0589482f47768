"""The managed-collision click model, its raw-id data and strategy, shared by the 2-rank script
(``mc_ranks.py``, imported as a sibling) and the one-rank loads of its checkpoint in the tests
(``tests.scripts.mc_model``).

:func:`lookup` is the model's id -> embedding mapping: an eval forward of the managed-collision
collection for :func:`probe_ids` (every raw id the data holds, and some it never holds).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import (
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import SyntheticClickData, TorchRecStrategy
from lightning_torchrec.data.batch import Batch
from lightning_torchrec.data.synthetic import SyntheticClickDataset
from lightning_torchrec.lightning.module import TorchRecModule
from lightning_torchrec.models.model_and_loss import ModelAndLoss

STEPS, STOP = 8, 4
ROWS, ZCH, DIM, FEATURES = 200, 32, 4, 2  # 200 distinct ids per feature for 32 rows: evictions
#: Odd, so ``id -> id * MULT mod 2**40`` is one-to-one: the ids spread over [0, 2**40).
MULT, SPAN = 0x9E3779B97F4A7C15 % 2**40 | 1, 2**40
#: Ids the data never holds (``raw(v)`` for ``v >= ROWS``), in both halves of the range.
UNSEEN = 8
#: Both ends of the raw-id range and of each rank's bucket (2 ranks: ``[0, SPAN / 2)``, ...).
EDGES = (0, SPAN // 2 - 1, SPAN // 2, SPAN - 1)


def raw(v: torch.Tensor) -> torch.Tensor:
    """The raw id of the data's id ``v``."""
    return ((v + 1) * MULT) % SPAN


class RawIds(SyntheticClickDataset):
    def __getitem__(self, index: int) -> Batch:
        b = super().__getitem__(index)
        kjt = b.sparse_features
        return Batch(
            b.dense_features,
            KeyedJaggedTensor(keys=kjt.keys(), values=raw(kjt.values()), lengths=kjt.lengths()),
            b.labels,
        )


class RawIdData(SyntheticClickData):
    def dataset(self, split: str) -> RawIds:
        d = super().dataset(split)
        return RawIds(
            d.num_embeddings_per_feature,
            num_batches=d.num_batches,
            batch_size=d.batch_size,
            num_dense_features=d.num_dense_features,
            ids_per_feature=d.ids_per_feature,
            seed=d.seed,
            split=split,
            signal_strength=d.signal_strength,
        )


class MCClick(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingConfig(
                name=f"t_cat_{i}",
                embedding_dim=DIM,
                num_embeddings=ZCH,
                feature_names=[f"cat_{i}"],
                # Evicted rows are re-initialised with init_fn; a random one draws from the
                # global RNG, which the checkpoint does not hold, so resume would part there.
                init_fn=nn.init.zeros_,
            )
            for i in range(FEATURES)
        ]
        mc = ManagedCollisionCollection(
            {
                t.name: MCHManagedCollisionModule(
                    zch_size=ZCH,
                    device=torch.device("cpu"),
                    eviction_policy=LFU_EvictionPolicy(),
                    eviction_interval=2,
                    input_hash_size=SPAN,  # the raw-id range, split evenly over the ranks
                    buckets=2,
                    name=t.name,
                )
                for t in tables
            },
            tables,
        )
        self.mc_ec = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables, device=torch.device("meta")), mc
        )
        self.over = nn.Linear(13 + FEATURES * DIM, 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out, _ = self.mc_ec(kjt)
        pooled = []
        for f in range(FEATURES):
            jt = out[f"cat_{f}"]
            lens = jt.lengths()
            size = lens.shape[0]  # not len(): torch.export would fix the batch size
            sample = torch.repeat_interleave(  # output_size: torch.export needs it
                torch.arange(size), lens, output_size=jt.values().shape[0]
            )
            sums = torch.zeros(size, DIM).index_add_(0, sample, jt.values())
            pooled.append(sums / lens.clamp_min(1).unsqueeze(1))
        return self.over(torch.cat([dense, *pooled], dim=1)).squeeze(1)


def data() -> RawIdData:
    return RawIdData(
        num_embeddings=ROWS, num_sparse_features=FEATURES, batch_size=32, train_batches=16
    )


def module() -> TorchRecModule:
    return TorchRecModule(ModelAndLoss(MCClick()), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2))


def strategy() -> TorchRecStrategy:
    return TorchRecStrategy(
        constraints={
            f"t_cat_{i}": ParameterConstraints(sharding_types=["row_wise"]) for i in range(FEATURES)
        },
        fused_params={"optimizer": "exact_sgd", "learning_rate": 0.1},
        log_plan=False,
    )


def probe_ids() -> torch.Tensor:
    """Every raw id of the data, then :data:`UNSEEN` ids it never holds."""
    return raw(torch.arange(ROWS + UNSEEN))


def probe_batch() -> tuple[torch.Tensor, KeyedJaggedTensor]:
    """A request holding every probe id and :data:`EDGES` in each feature, 4 ids a sample."""
    ids = torch.cat([probe_ids(), torch.tensor(EDGES)])
    samples = len(ids) // 4
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([ids, ids[torch.randperm(len(ids), generator=gen)]][:FEATURES])
    kjt = KeyedJaggedTensor(
        keys=[f"cat_{f}" for f in range(FEATURES)],
        values=values,
        lengths=torch.full((FEATURES * samples,), 4, dtype=torch.int32),
    )
    return torch.randn(samples, 13, generator=gen), kjt


@torch.no_grad()
def lookup(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{feature: [len(probe_ids()), DIM]}``: the embedding each probe id gets (eval forward).

    Collective on a sharded model: every rank looks up the same ids.
    """
    mc_ec = next(m for n, m in model.named_modules() if n.endswith("mc_ec"))
    ids = probe_ids()
    kjt = KeyedJaggedTensor(
        keys=[f"cat_{f}" for f in range(FEATURES)],
        values=ids.repeat(FEATURES),
        lengths=torch.ones(FEATURES * len(ids), dtype=torch.int32),
    )
    was = mc_ec.training
    mc_ec.eval()
    try:
        out, _ = mc_ec(kjt)
    finally:
        mc_ec.train(was)
    return {k: out[k].values().detach().clone() for k in kjt.keys()}
