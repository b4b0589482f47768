"""Per-rank body of tests/test_norms_distributed.py (importable by spawned processes).

One process per rank, gloo on CPU. Builds one EBC model with a table of each CPU sharding type
(table-wise x2, column-wise, table-column-wise, data-parallel) plus a dense layer, fills every
table with values known from a seed, runs the functions under test and saves what it saw to
``{out_dir}/rank{rank}.pt`` for the parent process to check.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from lightning_torchrec.lightning.norm_callbacks import WeightNormCallback
from lightning_torchrec.sharding.layout import log_sharded_tensor_content
from lightning_torchrec.sharding.planning import maybe_shard_model
from lightning_torchrec.sharding.tables import embedding_tables
from lightning_torchrec.training.ebc_norms import log_ebc_norms
from lightning_torchrec.training.norms import l1_norm, max_norm, weights_to_log
from tests.scripts.factory import sharding_constraints  # the spawn copies the parent's sys.path

# name: (rows, dim, sharding type)
TABLES = {
    "tw_a": (40, 8, "table_wise"),
    "tw_b": (40, 8, "table_wise"),
    "cw": (30, 16, "column_wise"),
    "twcw": (24, 24, "table_column_wise"),
    "dp": (12, 4, "data_parallel"),
}
SAMPLE = 5  # rows per sampled log_ebc_norms call, fewer than any table's local rows


def full_table(name: str) -> torch.Tensor:
    """The values every test table is filled with: known to the parent without gathering."""
    rows, dim, _ = TABLES[name]
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(rows, dim, generator=generator)


def table_key(name: str) -> str:
    return f"ebc.embedding_bags.{name}.weight"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
            for n, (r, d, _) in TABLES.items()
        ]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        self.dense = nn.Linear(4, 3)


def numel(tensor: torch.Tensor) -> torch.Tensor:
    """A custom (not built-in) reduction: applied to local shards, so per rank."""
    return torch.tensor(tensor.numel())


def none_on_rank_one(tensor: torch.Tensor) -> torch.Tensor | None:
    """One number on rank 0, None on rank 1 (a forgotten ``return``): only rank 1 sees it."""
    return None if dist.get_rank() == 1 else tensor.sum()


def _raised_by_weight_norms(dmp: nn.Module) -> tuple[str, str]:
    """What ``WeightNormCallback(none_on_rank_one)`` raises on this rank at a logging step."""
    try:
        WeightNormCallback(none_on_rank_one)._compute(dmp)  # type: ignore[arg-type]
    except Exception as error:  # noqa: BLE001 - the test checks which
        return type(error).__name__, str(error)
    return "nothing", ""


def _fill(tables: dict[str, torch.Tensor]) -> None:
    """Write the known values into this rank's pieces, through TorchRec's own shard metadata."""
    with torch.no_grad():
        for key, tensor in tables.items():
            full = full_table(key.split(".")[-2])
            if isinstance(tensor, ShardedTensor):
                for shard in tensor.local_shards():
                    (r, c), (h, w) = shard.metadata.shard_offsets, shard.tensor.shape
                    shard.tensor.copy_(full[r : r + h, c : c + w])
            elif hasattr(tensor, "_local_tensor"):  # TorchRec DTensor (LocalShardsWrapper)
                local = tensor._local_tensor
                for piece, (r, c) in zip(local.local_shards(), local.local_offsets(), strict=False):
                    piece.copy_(full[r : r + piece.shape[0], c : c + piece.shape[1]])
            else:
                tensor.copy_(full)


def _naive_local_mean_row_norm(tensor: torch.Tensor) -> float:
    """Exact mean row norm of this rank's rows, straight from the state dict's local shards."""
    if isinstance(tensor, ShardedTensor):
        shards = sorted(tensor.local_shards(), key=lambda s: s.metadata.shard_offsets[1])
        if not shards:
            return -1.0
        tensor = torch.cat([s.tensor for s in shards], dim=1)  # CW/TWCW pieces hold every row
    return float(torch.linalg.vector_norm(tensor.float(), dim=1).mean())


def _sharder() -> EmbeddingBagCollectionSharder:
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    return EmbeddingBagCollectionSharder(fused_params=fused)


def run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Entry point for ``torch.multiprocessing.spawn``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        _run(rank, out_dir)
    finally:
        dist.destroy_process_group()


def _run(rank: int, out_dir: str) -> None:
    torch.manual_seed(0)
    model = Model()
    unwrapped_names = [name for name, _ in model.named_parameters()]
    types = {name: kind for name, (_, _, kind) in TABLES.items()}
    constraints = sharding_constraints(types, min_partition=8)
    sharder = _sharder()
    dmp = maybe_shard_model(model, torch.device("cpu"), sharders=[sharder], constraints=constraints)
    assert isinstance(dmp, DistributedModelParallel)
    tables = embedding_tables(dmp)
    _fill(tables)
    params = dict(dmp.named_parameters())
    state = dmp.state_dict()
    keys = list(embedding_tables(dmp))
    out = {
        "plan_types": {
            t: s.sharding_type
            for t, s in dmp.plan.plan["ebc"].items()  # type: ignore[union-attr]
        },
        "unwrapped_names": unwrapped_names,
        "table_keys": keys,
        "state_table_keys": [k for k in state if "embedding_bags" in k],
        "dense_weight": params["dense.weight"].detach().clone(),
        "dense_bias": params["dense.bias"].detach().clone(),
        # the fill reached the fused (TBE) weights that training updates
        "tbe_slices": {
            t: params[table_key(t)].detach().clone() for t in TABLES if params[table_key(t)].numel()
        },
        "l2": weights_to_log(dmp),
        "l1": weights_to_log(dmp, l1_norm),
        "max": weights_to_log(dmp, max_norm),
        "torch_norms": weights_to_log(
            dmp, {"dense.weight": torch.norm, table_key("cw"): torch.linalg.norm}
        ),
        "custom": weights_to_log(dmp, numel),
        "gathered": {
            t: log_sharded_tensor_content(table_key(t), t, tables[table_key(t)]) for t in TABLES
        },
        "naive_local_mean": {t: _naive_local_mean_row_norm(state[table_key(t)]) for t in TABLES},
        "ebc_state_dict": log_ebc_norms(state, keys, sample_size=10**6),
        "ebc_tables": log_ebc_norms(tables, keys, sample_size=10**6),
        "sampled": [log_ebc_norms(tables, keys, SAMPLE, seed=s) for s in (1, 1, 2)],
        "bad_return": _raised_by_weight_norms(dmp),
    }
    # The same plan with TorchRec's DTensor state (output_dtensor=True): LocalShardsWrapper pieces,
    # table-wise tables whose placements read Replicate() though they live on one rank.
    env = ShardingEnv(dist.get_world_size(), rank, dist.GroupMember.WORLD, output_dtensor=True)
    dtensor_dmp = DistributedModelParallel(
        Model(), env=env, device=torch.device("cpu"), plan=dmp.plan, sharders=[_sharder()]
    )
    dtensor_tables = embedding_tables(dtensor_dmp)
    _fill(dtensor_tables)
    out["dtensor_types"] = {k: type(v).__name__ for k, v in dtensor_tables.items()}
    out["dtensor_l2"] = weights_to_log(dtensor_dmp)
    out["dtensor_ebc"] = log_ebc_norms(dtensor_tables, keys, sample_size=10**6)
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
