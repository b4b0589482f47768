"""Command line: ``python -m lightning_torchrec.export CKPT OUT --module pkg.Class``.

See :func:`lightning_torchrec.export.artifact.main`.
"""

from lightning_torchrec.export.artifact import main

main()
