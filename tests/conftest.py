"""Test isolation for in-process trainers."""

from __future__ import annotations

import gc
import os
import sys
import warnings
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    """Each test file starts without a process group and with the environment it found.

    In-process trainers (world size 1) create the default process group and set WORLD_SIZE,
    MASTER_PORT, ...; later files, the subprocesses they launch and the notebook kernels they start
    must not inherit either.
    """
    env = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    # Finalize the file's process groups here: left to a later collection, one may be finalized
    # in a forked DataLoader worker, where ProcessGroupGloo's destructor waits for its threads,
    # which the fork did not copy, forever.
    gc.collect()
    os.environ.clear()
    os.environ.update(env)


def _module_of(filename: str) -> str | None:
    """The dotted name of the imported module defined in ``filename``."""
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == filename:
            return name
    return None


def _module_or_path(module: str) -> str:
    """A module regex that also matches the module's file path (without ``.py``).

    ``pytest.warns`` re-emits the warnings it did not expect with ``warnings.warn_explicit`` and
    no module (pytest 8), so Python names them by their file's path: ``torchrec\\.datasets``
    must then match ``.../torchrec/datasets``.
    """
    path = module.replace(r"\.", "/")
    return f"({module}|.*/{path})"


def pytest_configure(config: pytest.Config) -> None:
    """The package's upstream-warning filters, also inside pytest's per-test warning capture.

    pytest discards filters set while it collects (that is when ``lightning_torchrec`` is
    imported), so the one list in ``compat.UPSTREAM_WARNINGS`` is applied as ini filters too.
    Reading the list imports the package and its dependencies, some of which warn while they are
    imported: those warnings are recorded and then replayed under the ini filters (pyproject.toml
    makes deprecations errors), so a warning the list does not name still fails the run.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from lightning_torchrec.compat.upstream_warnings import UPSTREAM_WARNINGS

    for message, category, module, _why in UPSTREAM_WARNINGS:
        config.addinivalue_line(
            "filterwarnings", f"ignore:{message}:{category.__name__}:{_module_or_path(module)}"
        )
    with warnings.catch_warnings():
        for message, category, module, _why in UPSTREAM_WARNINGS:
            warnings.filterwarnings("ignore", message, category, module)
        for w in caught:
            warnings.warn_explicit(
                w.message, w.category, w.filename, w.lineno, module=_module_of(w.filename)
            )
