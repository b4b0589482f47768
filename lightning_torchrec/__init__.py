"""lightning-torchrec: train TorchRec models with sharded embedding tables using lightning.Trainer.

Importing the package registers ``Trainer(strategy="torchrec")`` and
``Fabric(strategy="torchrec")`` (and ``"torchrec_spawn"``, ``"torchrec_fork"``,
``"torchrec_notebook"``).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_torchrec.checkpoint import is_sharded_checkpoint, load_unsharded
from lightning_torchrec.checkpoint.consolidate import consolidate, load_plain_weights
from lightning_torchrec.compat.upstream_warnings import filter_upstream_warnings
from lightning_torchrec.data import Batch, SyntheticClickData
from lightning_torchrec.errors import (
    BatchValidationError,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointWriteError,
    ManagedCollisionLayoutError,
    MidStepCheckpointError,
    NonFiniteCheckpointError,
    NonFiniteLossError,
    PeerFailureError,
    Preempted,
    RankFailureError,
    ShardingConflictError,
    UnevenDataError,
    UnsafeCheckpointError,
)
from lightning_torchrec.fabric import TorchRecFabricStrategy
from lightning_torchrec.lightning import (
    DLRMClickModule,
    EmbeddingNormCallback,
    ManagedCollisionStatsCallback,
    PreemptionCheckpoint,
    SLURMRequeue,
    TorchRecModule,
    TorchRecStrategy,
    WeightNormCallback,
)
from lightning_torchrec.models.model_and_loss import ModelAndLoss, weighted_bce_with_logits
from lightning_torchrec.sharding.layout import log_sharded_tensor_content
from lightning_torchrec.sharding.plan_summary import PlanSummary, summarize_plan
from lightning_torchrec.sharding.planning import maybe_shard_model, shard_model
from lightning_torchrec.sharding.tables import embedding_tables
from lightning_torchrec.training.ebc_norms import log_ebc_norms
from lightning_torchrec.training.norms import weights_to_log
from lightning_torchrec.training.optim import (
    DenseAndFusedOptimizer,
    combine_optimizers,
    dense_parameters,
)

TorchRecStrategy.register_strategies(StrategyRegistry)
TorchRecFabricStrategy.register_strategies(STRATEGY_REGISTRY)
filter_upstream_warnings()

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BatchValidationError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "DLRMClickModule",
    "DenseAndFusedOptimizer",
    "EmbeddingNormCallback",
    "ManagedCollisionLayoutError",
    "ManagedCollisionStatsCallback",
    "MidStepCheckpointError",
    "ModelAndLoss",
    "NonFiniteCheckpointError",
    "NonFiniteLossError",
    "PeerFailureError",
    "PlanSummary",
    "Preempted",
    "PreemptionCheckpoint",
    "RankFailureError",
    "SLURMRequeue",
    "ShardingConflictError",
    "SyntheticClickData",
    "TorchRecFabricStrategy",
    "TorchRecModule",
    "TorchRecStrategy",
    "UnevenDataError",
    "UnsafeCheckpointError",
    "WeightNormCallback",
    "combine_optimizers",
    "consolidate",
    "dense_parameters",
    "embedding_tables",
    "is_sharded_checkpoint",
    "load_plain_weights",
    "load_unsharded",
    "log_ebc_norms",
    "log_sharded_tensor_content",
    "maybe_shard_model",
    "shard_model",
    "summarize_plan",
    "weighted_bce_with_logits",
    "weights_to_log",
]
