"""Batches and data modules."""

from lightning_torchrec.data.batch import Batch
from lightning_torchrec.data.synthetic import SyntheticClickData, SyntheticClickDataset

__all__ = ["Batch", "SyntheticClickData", "SyntheticClickDataset"]
