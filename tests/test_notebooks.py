"""The notebooks: each ``.ipynb`` matches its jupytext ``.py`` twin, and each runs top to bottom.

Every notebook runs in a fresh kernel (its own process) with a temporary working directory, so
its logs and checkpoints do not land in the repository.
"""

from __future__ import annotations

import time
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TWINS = sorted(NOTEBOOKS.glob("*.py"))
CELL_TIMEOUT_S = 900


def _cells(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_every_notebook_has_a_twin() -> None:
    notebooks = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    twins = [p.stem for p in TWINS]
    assert notebooks == twins, "each notebook needs its .py twin (jupytext --sync notebooks/*.py)"
    assert len(twins) >= 3


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_notebook_matches_its_twin(twin: Path) -> None:
    ipynb = jupytext.read(twin.with_suffix(".ipynb"))
    py = jupytext.read(twin)
    assert _cells(ipynb) == _cells(py), (
        f"{twin.name} and its .ipynb differ: run `jupytext --sync {twin}` after editing either"
    )


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_notebook_runs(twin: Path, tmp_path: Path) -> None:
    nb = jupytext.read(twin)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    start = time.perf_counter()
    client.execute()
    print(f"{twin.stem}: {time.perf_counter() - start:.1f} s")
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
