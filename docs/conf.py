"""Sphinx configuration of the lightning-torchrec documentation."""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

project = "lightning-torchrec"
author = "lightning-torchrec contributors"
copyright = "lightning-torchrec contributors"  # noqa: A001

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" as fields: NamedTuple/dataclass fields are documented by autodoc already.
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options = {"members": True, "show-inheritance": True}
# TorchRec/fbgemm register custom ops at import; documenting needs the real stack installed.
autodoc_mock_imports: list[str] = []

html_theme = "furo"
html_title = "lightning-torchrec"
html_static_path = ["_static"]

#: Where the benchmark tables come from; the page says so when they are not there yet.
BENCHMARK_RESULTS = ROOT / "benchmarks" / "results" / "README.md"
_MARKER = "<!-- benchmark-results -->"


def _demote_headings(markdown: str) -> str:
    """Moves every heading one level down (outside code fences) to nest it in the page."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced and re.match(r"#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out)


def _insert_benchmarks(app, docname: str, source: list[str]) -> None:  # noqa: ANN001
    if docname != "benchmarks" or _MARKER not in source[0]:
        return
    if BENCHMARK_RESULTS.is_file():
        text = _demote_headings(BENCHMARK_RESULTS.read_text())
    else:
        text = (
            "```{note}\nNo results yet: `benchmarks/results/README.md` is written by the "
            "benchmark scripts (see above).\n```"
        )
    source[0] = source[0].replace(_MARKER, text)


#: Where ``concepts.md`` shows the layers of ``lightning_torchrec.architecture`` (one source).
_ARCHITECTURE_MARKER = "<!-- architecture-table -->"


def _insert_architecture(app, docname: str, source: list[str]) -> None:  # noqa: ANN001
    if docname != "concepts" or _ARCHITECTURE_MARKER not in source[0]:
        return
    from lightning_torchrec.architecture import markdown_table

    source[0] = source[0].replace(_ARCHITECTURE_MARKER, markdown_table())


def setup(app) -> None:  # noqa: ANN001
    """Inserts the benchmark results into ``benchmarks.md`` and the layers into ``concepts.md``."""
    app.add_config_value("benchmark_results", str(BENCHMARK_RESULTS), "env")
    app.connect("source-read", _insert_benchmarks)
    app.connect("source-read", _insert_architecture)
