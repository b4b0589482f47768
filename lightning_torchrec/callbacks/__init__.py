"""Lightning callbacks: weight norms and sampled embedding-table norms."""

from lightning_torchrec.callbacks.norms import EmbeddingNormCallback, WeightNormCallback

__all__ = ["EmbeddingNormCallback", "WeightNormCallback"]
