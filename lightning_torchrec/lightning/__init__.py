"""The Lightning Trainer glue: the strategy, its checkpoint and data hooks, modules, callbacks.

Everything here is for ``lightning.Trainer`` users; the core below (``sharding``, ``training``,
``checkpoint``, ``export``, ``models``, ``data``) imports nothing of it.
"""

from lightning_torchrec.lightning.dlrm import DLRMClickModule
from lightning_torchrec.lightning.mc_callbacks import ManagedCollisionStatsCallback
from lightning_torchrec.lightning.module import TorchRecModule
from lightning_torchrec.lightning.norm_callbacks import EmbeddingNormCallback, WeightNormCallback
from lightning_torchrec.lightning.preemption import PreemptionCheckpoint, SLURMRequeue
from lightning_torchrec.lightning.progressive import ProgressiveEvaluation
from lightning_torchrec.lightning.publisher import DeltaPublisher
from lightning_torchrec.lightning.strategy import TorchRecStrategy

__all__ = [
    "DLRMClickModule",
    "DeltaPublisher",
    "EmbeddingNormCallback",
    "ManagedCollisionStatsCallback",
    "PreemptionCheckpoint",
    "ProgressiveEvaluation",
    "SLURMRequeue",
    "TorchRecModule",
    "TorchRecStrategy",
    "WeightNormCallback",
]
