"""Command line: ``python -m lightning_torchrec.criteo preprocess IN OUT_DIR [options]``.

Criteo TSV files to TorchRec's npy days; see :func:`lightning_torchrec.data.criteo.main`. (The
package imports :mod:`lightning_torchrec.data.criteo` itself, so running that module with
``-m`` makes Python warn that it was already imported.)
"""

from lightning_torchrec.data.criteo import main

if __name__ == "__main__":
    main(prog="python -m lightning_torchrec.criteo")
