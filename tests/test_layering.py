"""The package's import contract (``lightning_torchrec.architecture``), checked on its source (AST).

Each rule of ``architecture.py``'s docstring has a test here; each test also proves on a
hand-made violation that it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_torchrec.architecture import (
    APP_MODULES,
    LAYERS,
    LIGHTNING_PRIVATE_USERS,
    layer_of,
    markdown_table,
)

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_torchrec"
DOCS = Path(__file__).resolve().parents[1] / "docs"
LAYER = {layer.name: layer for layer in LAYERS}
#: Modules are cut by concept, not by size (a strategy class reads best whole, as Lightning's
#: ~700-line strategies do); past this a module surely holds more than one concept.
MAX_LINES = 1000


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}


def _resolve(base: str, alias: str) -> str:
    sub = f"{base}.{alias}" if base else alias
    return sub if sub in MODULES else base or "__init__"


def _package_imports(tree: ast.AST) -> set[str]:
    """Package modules a module imports (``from pkg.sub import mod`` resolves to ``sub.mod``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] == "lightning_torchrec":
                base = node.module.removeprefix("lightning_torchrec").lstrip(".")
                found.update(_resolve(base, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning_torchrec."):
                    found.add(alias.name.removeprefix("lightning_torchrec."))
                elif alias.name == "lightning_torchrec":
                    found.add("__init__")
    return found


GRAPH = {m: _package_imports(t) for m, t in TREES.items()}


def _layer_violations(module: str, imports: set[str]) -> list[str]:
    own = layer_of(module)
    allowed = {own, *LAYER[own].may_import}
    bad = [f"{module} ({own}) imports {m} ({layer_of(m)})" for m in imports]
    bad = [b for b, m in zip(bad, imports, strict=True) if layer_of(m) not in allowed]
    lightning_compat = sorted(m for m in imports if _lightning_compat(m))
    if own not in LIGHTNING_PRIVATE_USERS and lightning_compat:
        bad.append(f"{module} ({own}) imports {lightning_compat}, which are for the glue only")
    return bad


def _lightning_compat(module: str) -> bool:
    """``compat.lightning`` and its siblings ``compat.lightning_*``: Lightning's private names."""
    return module == "compat.lightning" or module.startswith("compat.lightning_")


def _trainer_imports(tree: ast.AST) -> list[str]:
    """``lightning.pytorch`` imports (``import lightning`` loads it too)."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for n in names:
            if n == "lightning" or n.startswith("lightning.pytorch") or n.startswith("lightning."):
                if not n.startswith("lightning.fabric"):
                    found.append(n)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def _private_imports(tree: ast.AST) -> list[str]:
    return [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("lightning_torchrec")
        and any(a.name.startswith("_") and not a.name.startswith("__") for a in node.names)
    ]


def _function_local_imports(tree: ast.AST) -> list[str]:
    return [
        f"line {node.lineno}: {ast.unparse(node)}"
        for func in ast.walk(tree)
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(func)
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]


def _upstream_private_uses(tree: ast.AST) -> list[str]:
    uses = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.module.startswith(("lightning_torchrec", "__future__"))
        ):
            parts = node.module.split(".")
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
            value = node.value  # getattr(obj, "_private") spelled as a string
            if (
                len(value) > 1
                and value.startswith("_")
                and not value.startswith("__")
                and value.isidentifier()
                and not value[1:].isupper()  # a file name such as Hadoop's "_SUCCESS" marker
            ):
                uses.append(f"line {node.lineno}: {value!r}")
    return uses


# ----------------------------------------------------------------------------- the rules


def test_every_module_has_a_layer_and_every_layer_a_module() -> None:
    unplaced = []
    for module in MODULES:
        try:
            layer_of(module)
        except KeyError as e:
            unplaced.append(str(e))
    assert unplaced == []
    used = {layer_of(m) for m in MODULES}
    assert sorted(set(LAYER) - used) == []
    assert set(APP_MODULES) <= set(MODULES)


def test_may_import_lists_only_lower_layers() -> None:
    order = [layer.name for layer in LAYERS]
    for layer in LAYERS:
        for lower in layer.may_import:
            assert order.index(lower) < order.index(layer.name), (layer.name, lower)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module: str) -> None:
    assert _layer_violations(module, GRAPH[module]) == []


def test_layer_rule_can_fail() -> None:
    assert _layer_violations("sharding.planning", {"lightning.strategy"})
    assert _layer_violations("training.optim", {"compat.lightning"})
    assert _layer_violations("lightning.strategy", {"compat.lightning"}) == []
    assert _layer_violations("training.optim", {"compat.lightning_callbacks"})


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_glue_imports_the_trainer(module: str) -> None:
    layer = LAYER[layer_of(module)]
    found = _trainer_imports(TREES[module])
    if layer.name == "data":  # data modules subclass LightningDataModule, nothing else
        found = [n for n in found if n != "lightning.pytorch.LightningDataModule"]
    elif layer.trainer or _lightning_compat(module):  # compat.lightning*: for the glue only
        found = []
    assert found == [], f"{module} is core and imports the Trainer: {found}"


def test_trainer_rule_can_fail() -> None:
    assert _trainer_imports(ast.parse("import lightning as L"))
    assert _trainer_imports(ast.parse("from lightning.pytorch import Trainer"))
    assert _trainer_imports(ast.parse("from lightning.fabric import Fabric")) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module: str) -> None:
    assert _private_imports(TREES[module]) == []


def test_private_import_rule_can_fail() -> None:
    assert _private_imports(ast.parse("from lightning_torchrec.checkpoint.common import _rank"))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_local_imports(module: str) -> None:
    assert _function_local_imports(TREES[module]) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) != "compat"))
def test_upstream_private_names_only_in_compat(module: str) -> None:
    uses = _upstream_private_uses(TREES[module])
    assert uses == [], f"{module} uses private names (move them into compat): {uses}"


def test_compat_holds_the_private_names_it_documents() -> None:
    for module in (
        "compat.upstream",
        "compat.lightning",
        "compat.lightning_callbacks",
        "compat.pipelines",
    ):
        assert len(_upstream_private_uses(TREES[module])) >= 1, module


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_states_its_one_concept(module: str) -> None:
    docstring = ast.get_docstring(TREES[module])
    assert docstring, f"{module} has no docstring saying what it holds"
    assert docstring.splitlines()[0].strip(), f"{module}'s docstring starts with a blank line"
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines: it holds more than one concept"


def test_docs_show_the_generated_table() -> None:
    concepts = (DOCS / "concepts.md").read_text()
    assert "<!-- architecture-table -->" in concepts  # docs/conf.py puts markdown_table() there
    table = markdown_table()
    assert all(f"`{layer.name}`" in table for layer in LAYERS if layer.name != "app")
