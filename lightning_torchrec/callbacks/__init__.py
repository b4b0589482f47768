"""Lightning callbacks: weight norms, sampled embedding-table norms, preemption checkpoints."""

from lightning_torchrec.callbacks.norms import EmbeddingNormCallback, WeightNormCallback
from lightning_torchrec.callbacks.preemption import PreemptionCheckpoint

__all__ = ["EmbeddingNormCallback", "PreemptionCheckpoint", "WeightNormCallback"]
