"""Test isolation for in-process trainers."""

from __future__ import annotations

import os
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
    os.environ.clear()
    os.environ.update(env)


def pytest_configure(config: pytest.Config) -> None:
    """The package's upstream-warning filters, also inside pytest's per-test warning capture.

    pytest discards filters set while it collects (that is when ``lightning_torchrec`` is
    imported), so the one list in ``compat.UPSTREAM_WARNINGS`` is applied as ini filters too.
    """
    from lightning_torchrec.compat.upstream import UPSTREAM_WARNINGS

    for message, category, module, _why in UPSTREAM_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{message}:{category.__name__}:{module}")
