"""The step's vote under Lightning's loop: decided after each step, carrying Lightning's SIGTERM.

With more than one rank, each training step's one small vote (:class:`~lightning_torchrec.
training.step_guard.StepGuard`) also carries a stop request: Lightning's own per-step SIGTERM
broadcast (a collective, and on CUDA a GPU-to-host sync, every step) is switched off while the
strategy trains (:func:`take_over_step_votes`). A vote started during a step (the vote ahead) is
decided by a callback placed after every other (:class:`StepVote`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_torchrec.compat.lightning import take_over_sigterm_broadcast
from lightning_torchrec.errors import StopRequested
from lightning_torchrec.training.steps import StepRunner


class StepVote(Callback):
    """Decides, after each training step, the vote on the next step that ran during it.

    ``TorchRecStrategy`` puts it last among the Trainer's callbacks for a fit whose steps vote
    ahead (:class:`~lightning_torchrec.training.steps.StepMode`'s ``ahead``), and
    takes it out at teardown: every rank decides the vote at the same point, after the step's
    update and after the other callbacks (a checkpoint of this step is written even when the
    next batch is bad), and stops there together when it says so.

    Args:
        runner: the strategy's step runner.
    """

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        try:
            self.runner.after_step()
        except StopRequested:
            # Every rank stops after the same step, as after Lightning's own SIGTERM broadcast.
            raise SIGTERMException() from None


def take_over_step_votes(trainer: Any, runner: StepRunner) -> Any:
    """The step's vote carries Lightning's SIGTERM flag, and is decided by a :class:`StepVote`.

    Lightning's per-step SIGTERM broadcast (a GPU sync per step) is switched off meanwhile.

    Args:
        trainer: the Trainer about to fit (more than one rank).
        runner: the strategy's step runner.

    Returns:
        What undoes both (call at teardown).
    """
    runner.guard.carries_stop = True
    undo_broadcast = take_over_sigterm_broadcast(trainer)
    vote = StepVote(runner) if runner.vote_ahead else None
    if vote is not None:
        trainer.callbacks.append(vote)

    def undo() -> None:
        undo_broadcast()
        if vote is not None and vote in trainer.callbacks:
            trainer.callbacks.remove(vote)

    return undo
