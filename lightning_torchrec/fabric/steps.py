"""The step of ``TorchRecFabricStrategy``: each forward of the set-up module checked, the loss kept.

Fabric adds no loop, so the strategy learns of a step from the module's forwards and from
``fabric.backward``. Before each forward of the set-up module (a forward pre-hook; or where the
loop calls :meth:`FabricSteps.check_batch` itself) one small vote of
:class:`~lightning_torchrec.training.step_guard.StepGuard` decides, on every rank, whether any
rank's batch is bad:

* a training forward (the module in ``train()`` mode) also carries the previous step's loss
  verdict, as under the Trainer;
* an evaluation forward (``eval()`` mode) is checked too: fbgemm reads an out-of-range id as row 0
  without an error, and the metrics of such an evaluation would be silently wrong. Its vote says
  that the rank is evaluating, so a rank with an evaluation batch more than the others meets
  their next training vote (or :meth:`FabricSteps.finish`) and every rank raises
  ``UnevenDataError``. It costs what the Trainer's validation check costs: one pass over the ids
  and one vote per forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_torchrec.training.optim import DenseAndFusedOptimizer
from lightning_torchrec.training.step_runner import StepRunner


class FabricSteps:
    """Mixin for ``TorchRecFabricStrategy`` (before Fabric's ``DDPStrategy`` in its bases)."""

    check_in_forward: bool
    step: int
    _collective: Any  # FabricCollectives'
    _dmp: Any
    _runner: StepRunner | None
    _optimizers: list[DenseAndFusedOptimizer]
    #: ``check_batch`` was called for the coming forward.
    _prechecked: bool = False
    #: Evaluation forwards since the last training vote (the index of the next one).
    _evaluated: int = 0

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: Any) -> None:
        if module.training:
            # The fused kernels read the LR during backward; a scheduler's change made after the
            # last step must reach them before this forward.
            self._push_fused_lr()
        if self.check_in_forward and not self._prechecked:  # every forward (several a step too)
            inputs = (*args, *kwargs.values())  # model(batch) or model(batch=batch)
            self._check(inputs[0] if len(inputs) == 1 else inputs, explicit=False)
        self._prechecked = False

    def _name_dead_peers_in_forward(self, module: nn.Module) -> None:
        """The set-up module's forward runs under ``run_collective``, as the Trainer's step does.

        Its collectives (the sparse features' all-to-all) wait for every rank: a rank that failed
        in its own forward (an error in the user's model code before the all-to-all) would leave
        the others with gloo's bare "Connection closed by peer" instead of a
        ``PeerFailureError`` that names it.

        Args:
            module: the ``DistributedModelParallel`` (its forward is replaced on the instance;
                hooks still run around it).
        """
        forward = module.forward

        def named(*args: Any, **kwargs: Any) -> Any:
            return self._collective(forward, *args, **kwargs)

        module.forward = named  # type: ignore[method-assign]

    def check_batch(self, batch: Any, last: bool = False) -> None:
        """The agreed checks of the coming forward; call before it. Collective.

        One small collective decides whether any rank's batch is bad (ids out of range, unknown
        keys, bad lengths or dtypes, non-finite dense features) and whether any rank's previous
        loss was NaN/inf. Runs by itself before every forward unless ``check_in_forward=False``;
        calling it first makes the next forward skip it. With the module in ``eval()`` mode it
        checks an evaluation batch (always, whatever ``validate_batches`` says).

        Args:
            batch: this rank's batch.
            last: whether this rank has no batch after this one (in training, or in this
                evaluation; ranks that disagree raise ``UnevenDataError``).

        Raises:
            BatchValidationError: on every rank, naming the rank and step, when some rank's
                batch is bad.
            NonFiniteLossError: on every rank when some rank's previous loss was NaN/inf.
            UnevenDataError: on every rank when the ranks' batch counts part.
            RuntimeError: before ``setup_module``.
        """
        self._check(batch, last)
        self._prechecked = True

    def _check(self, batch: Any, last: bool = False, explicit: bool = True) -> None:
        runner = self._require_runner()
        step, guard = self.step, runner.guard
        if self._dmp.training:  # set up with the runner
            self._evaluated = 0
            runner.collective(guard.before_training_step, batch, step, step, last, None, batch)
            return
        index, self._evaluated = self._evaluated, self._evaluated + 1
        if explicit or guard.checks(index) or guard.on_nonfinite_loss == "raise":  # as the Trainer
            where = f"evaluation forward {index} after step {step}"
            runner.collective(guard.before_loop_eval, batch, where, index, last)

    def finish(self) -> None:
        """Judges the last step's loss on every rank; call once after the training loop.

        Raises:
            NonFiniteLossError: on every rank when some rank's last loss was NaN/inf.
            UnevenDataError: on every rank when another rank is still training, or still
                evaluating.
        """
        runner = self._require_runner()
        self._evaluated = 0
        runner.collective(runner.guard.flush, self.step)

    def _require_runner(self) -> StepRunner:
        if self._runner is None:
            raise RuntimeError("call `fabric.setup_module(model)` (or `fabric.setup`) first")
        return self._runner

    def _push_fused_lr(self) -> None:
        for optimizer in self._optimizers:
            optimizer.push_fused_lr()

    @override
    def backward(
        self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kw: Any
    ) -> None:
        # The loss is judged at the next step's vote; the backward runs collectives too (the
        # sparse all-to-all, the dense all-reduce) and updates the fused tables.
        if self._runner is not None and (module is None or module.training):
            self._runner.guard.record_loss(tensor, self.step)
            self.step += 1
        self._collective(super().backward, tensor, module, *args, **kw)  # type: ignore[misc]
