"""Batches and data modules."""

from lightning_torchrec.data.batch import Batch
from lightning_torchrec.data.criteo import CriteoDataModule, CriteoIterableDataset
from lightning_torchrec.data.parquet import ParquetClickData, ParquetClickDataset
from lightning_torchrec.data.resumable import ResumableDataLoader
from lightning_torchrec.data.stream import (
    Partition,
    PartitionStreamData,
    PartitionStreamDataset,
    PartitionStreamLoader,
)
from lightning_torchrec.data.synthetic import SyntheticClickData, SyntheticClickDataset

__all__ = [
    "Batch",
    "CriteoDataModule",
    "CriteoIterableDataset",
    "ParquetClickData",
    "ParquetClickDataset",
    "Partition",
    "PartitionStreamData",
    "PartitionStreamDataset",
    "PartitionStreamLoader",
    "ResumableDataLoader",
    "SyntheticClickData",
    "SyntheticClickDataset",
]
