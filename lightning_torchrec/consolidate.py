"""Command line: ``python -m lightning_torchrec.consolidate CHECKPOINT_DIR OUTPUT``.

See :func:`lightning_torchrec.checkpoint.consolidate.consolidate`.
"""

from lightning_torchrec.checkpoint.consolidate import main

if __name__ == "__main__":
    main()
