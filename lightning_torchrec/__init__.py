"""lightning-torchrec: train TorchRec models with sharded embedding tables using lightning.Trainer.

Importing the package registers ``Trainer(strategy="torchrec")`` (and ``"torchrec_spawn"``,
``"torchrec_fork"``, ``"torchrec_notebook"``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_torchrec.callbacks import (
    EmbeddingNormCallback,
    PreemptionCheckpoint,
    WeightNormCallback,
)
from lightning_torchrec.checkpoint import is_sharded_checkpoint, load_unsharded
from lightning_torchrec.compat import filter_upstream_warnings
from lightning_torchrec.consolidate import consolidate, load_plain_weights
from lightning_torchrec.data import Batch, SyntheticClickData
from lightning_torchrec.dlrm import DLRMClickModule
from lightning_torchrec.ebc_norms import log_ebc_norms
from lightning_torchrec.errors import (
    BatchValidationError,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointWriteError,
    NonFiniteCheckpointError,
    NonFiniteLossError,
    PeerFailureError,
    Preempted,
    RankFailureError,
    UnevenDataError,
    UnsafeCheckpointError,
)
from lightning_torchrec.layout import log_sharded_tensor_content
from lightning_torchrec.model_and_loss import ModelAndLoss, weighted_bce_with_logits
from lightning_torchrec.module import TorchRecModule
from lightning_torchrec.norms import weights_to_log
from lightning_torchrec.optim import (
    DenseAndFusedOptimizer,
    combine_optimizers,
    dense_parameters,
)
from lightning_torchrec.plan_summary import PlanSummary, summarize_plan
from lightning_torchrec.planning import maybe_shard_model, shard_model
from lightning_torchrec.strategy import TorchRecStrategy
from lightning_torchrec.tables import embedding_tables

TorchRecStrategy.register_strategies(StrategyRegistry)
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
    "ModelAndLoss",
    "NonFiniteCheckpointError",
    "NonFiniteLossError",
    "PeerFailureError",
    "PlanSummary",
    "Preempted",
    "PreemptionCheckpoint",
    "RankFailureError",
    "SyntheticClickData",
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
