"""Lightning Fabric's private launcher, for ``TorchRecFabricStrategy``'s failure reports.

Fabric launches a function with ``start_method="spawn"``/``"fork"`` through
``lightning.fabric.strategies.launchers.multiprocessing._MultiProcessingLauncher`` (lightning
2.0+; its ``_wrapping_function`` runs the function in each process), chosen in the strategy's
``_configure_launcher``. torch's process wrapper catches what the function raises, so
``sys.excepthook`` never sees it: :class:`ReportingLauncher` hands it to the strategy's
``report_failure`` first (see :mod:`lightning_torchrec.fabric.failures`).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from typing_extensions import override


class ReportingLauncher(_MultiProcessingLauncher):
    """Fabric's fork/spawn launcher; a process's error goes to ``strategy.report_failure``."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException as error:
            report = getattr(self._strategy, "report_failure", None)
            if report is not None:
                report(error)
            raise


def reporting_launcher(strategy: Any, parent: Any) -> None:
    """Fabric's launcher for ``strategy``, with fork/spawn as :class:`ReportingLauncher`.

    The body of the strategy's ``_configure_launcher`` override (which Fabric's connector calls,
    lightning 2.0+): Fabric's own choice first, keeping ``popen`` and external launchers.

    Args:
        strategy: the strategy being configured.
        parent: ``super()`` in the strategy's override (Fabric's implementation).
    """
    parent._configure_launcher()
    if isinstance(strategy._launcher, _MultiProcessingLauncher):
        strategy._launcher = ReportingLauncher(strategy, start_method=strategy._start_method)
