"""Export: a sharded checkpoint to a quantized model served with ``torch`` and ``torchrec`` only.

``quantize`` streams tables from a checkpoint into TorchRec's quantized modules; ``artifact``
traces and saves the result (``pt2`` or TorchScript) and is the command line
(``python -m lightning_torchrec.export``).
"""

from lightning_torchrec.export.artifact import ExportResult, export, load_artifact

__all__ = ["ExportResult", "export", "load_artifact"]
