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


class ReportingLaunching:
    """Strategy mixin: fork/spawn launches use :class:`ReportingLauncher`.

    Overrides ``_configure_launcher`` (which Fabric's connector calls, lightning 2.0+), keeping
    the parent's choice for ``popen`` and external launchers.
    """

    _launcher: Any
    _start_method: str

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = ReportingLauncher(self, start_method=self._start_method)
