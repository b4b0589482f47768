"""Benchmarks of lightning-torchrec: overhead against raw TorchRec, callbacks, norms, checkpoints.

Run them all with ``python -m benchmarks.run`` (``--quick`` for tiny sizes); each benchmark is also
a module with its own ``main``. Results go to ``benchmarks/results/*.json`` and a Markdown table
``benchmarks/results/README.md``. Ratios are the headline: bare times depend on the machine.
"""
