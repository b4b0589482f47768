"""The package's import contract, checked on its source (AST): layers, no cycles, privates.

* Imports inside the package run downward only: every module has a layer, and may import package
  modules of lower layers only. This rules out cycles.
* The Lightning glue (strategy, callbacks, demo) is imported by nothing below it.
* No function-local imports: every import is at module level (optional dependencies would be
  listed in ``OPTIONAL``).
* Private names of torch, TorchRec, fbgemm and Lightning (``from torch.x._y import``,
  ``from x import _y``, ``obj._attr`` on anything but ``self``/``cls``) appear only in compat.py
  (and compat_pipelines.py, the subclasses of TorchRec's train pipelines).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_torchrec"

#: Lower layers first. A module may import package modules of strictly lower layers.
LAYERS: list[set[str]] = [
    {"errors"},
    {"compat", "compat_pipelines"},
    {"distributed"},
    {"tables", "checkpoint_files"},
    {"layout", "plan_summary", "key_order", "sharders", "batch_checks", "safe_load"},
    {"pipeline_feed"},
    {"setup_checks", "norms", "ebc_norms", "faults", "optim", "model_and_loss", "metrics"},
    {
        "planning",
        "checkpoint_base",
        "data.batch",
        "data.sampling",
        "data.resumable",
        "data.criteo_files",
        "pipelines",
    },
    {"checkpoint_save", "checkpoint_load", "unsharded"},
    {"checkpoint"},
    {"consolidate", "module", "quantize", "data.synthetic", "data.criteo", "data.parquet"},
    {"data"},
    {"dlrm", "strategy_checkpoints", "strategy_data"},
    {"export"},
    {"strategy", "callbacks.norms", "callbacks.preemption"},
    {"callbacks"},
    {"demo", "__init__"},
]
GLUE = {
    "strategy",
    "strategy_checkpoints",
    "strategy_data",
    "callbacks",
    "callbacks.norms",
    "callbacks.preemption",
    "demo",
    "__init__",
}
#: Imports allowed inside functions (optional dependencies): none today.
OPTIONAL: set[str] = set()


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
LAYER_OF = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _package_imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("lightning_torchrec"):
                base = node.module.removeprefix("lightning_torchrec").lstrip(".")
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    found.add(sub if sub in MODULES else base or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning_torchrec."):
                    found.add(alias.name.removeprefix("lightning_torchrec."))
    return found


def test_every_module_has_a_layer() -> None:
    assert sorted(set(MODULES) - set(LAYER_OF)) == []
    assert sorted(set(LAYER_OF) - set(MODULES)) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downward(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    for imported in sorted(_package_imports(tree)):
        assert LAYER_OF[imported] < LAYER_OF[module], (
            f"{module} (layer {LAYER_OF[module]}) imports {imported} "
            f"(layer {LAYER_OF[imported]}): imports must run to lower layers"
        )
        if imported in GLUE:
            assert module in GLUE, f"{module} imports the Lightning glue module {imported}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_local_imports(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    local = []
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(func):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    names = [node.module] if isinstance(node, ast.ImportFrom) else []
                    names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                    if not any(n and n.split(".")[0] in OPTIONAL for n in names):
                        local.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert local == [], f"{module} imports inside functions: {local}"


def _private_uses(tree: ast.AST) -> list[str]:
    uses = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.module.startswith("lightning_torchrec")
        ):
            parts = node.module.split(".")
            if parts == ["__future__"]:
                continue
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts) or any(
                n.startswith("_") and not n.startswith("__") for n in names
            ):
                uses.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__") and node.attr.endswith("__"):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            uses.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # getattr(obj, "_private") spelled as a string
            value = node.value
            if (
                len(value) > 1
                and value.startswith("_")
                and not value.startswith("__")
                and value.isidentifier()
            ):
                uses.append(f"line {node.lineno}: {value!r}")
    return uses


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("compat")))
def test_private_names_only_in_compat(module: str) -> None:
    uses = _private_uses(ast.parse(MODULES[module].read_text()))
    assert uses == [], f"{module} uses private names (move them into compat.py): {uses}"


def test_compat_holds_the_private_names_it_documents() -> None:
    uses = _private_uses(ast.parse(MODULES["compat"].read_text()))
    assert len(uses) >= 5  # the contract above is not vacuous: compat is where they went
