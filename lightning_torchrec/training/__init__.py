"""The training step's pieces: batch checks, the step guard, optimizers, norms, metrics, pipelines.

Free of any front end: the Trainer glue (``lightning_torchrec.lightning``) and a user's own loop
call the same functions.
"""
