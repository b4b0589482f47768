"""Export: a sharded checkpoint to a quantized model served with ``torch`` and ``torchrec`` only.

``quantize`` streams tables from a checkpoint into TorchRec's quantized modules; ``artifact``
traces and saves the result (``pt2`` or TorchScript) and is the command line
(``python -m lightning_torchrec.export``); ``fresh`` keeps a served artifact fresh with the
trainer's deltas (standalone: a serving process loads it by file path).
"""

from lightning_torchrec.export.artifact import ExportResult, export, load_artifact
from lightning_torchrec.export.fresh import FreshModel, read_delta

__all__ = ["ExportResult", "FreshModel", "export", "load_artifact", "read_delta"]
