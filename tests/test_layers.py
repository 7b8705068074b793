"""The import rule of docs/architecture.md: model < engine < io < tools < cli.

Every module of ``sim`` may import from its own layer and the layers below it,
never from a layer above (imports inside functions and ``TYPE_CHECKING``
blocks count too). ``sim.errors`` (and ``sim._native``, which picks compiled modules or
their sources) is the floor every layer may use; the
package ``sim`` itself, ``sim.cli`` and the compatibility shims ``sim.compare``
and ``sim.plots`` are the top, and nothing inside ``sim`` imports them.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from tests.helpers import ROOT

SIM = ROOT / "sim"

#: layer of each top-level part of ``sim`` (higher may import lower)
RANK = {
    "errors": 0,
    "_native": 0,         # which modules run compiled (imported first by the package)
    "_native_stamp": 0,   # written by setup.py: the sources it compiled
    "model": 1,
    "engine": 2,
    "io": 3,
    "tools": 4,
    "cli": 5,
    "startup": 5,
    "compare": 5,
    "plots": 5,
    "__init__": 5,
}
#: modules nothing inside sim may import
TOP_ONLY = {"cli", "compare", "plots", "__init__", "startup"}


def _part(module: str) -> str:
    """``sim.model.layout`` -> ``model``; ``sim`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path, top: Path) -> str:
    rel = path.relative_to(top).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1] if len(parts) > 2 else [*parts[:-1], "__init__"]
    return ".".join(parts)


def sim_imports(path: Path, top: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a ``sim`` module in ``path`` (``top``: the
    folder that holds the ``sim`` package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path, top).rsplit(".", 1)[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "sim"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "sim":
                continue
            if mod == "sim":   # from sim import x: x is a sub-module or package attribute
                out += [(node.lineno, f"sim.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
    return out


def upward_imports(root: Path = SIM) -> list[str]:
    """Every import that breaks the layer rule, as ``file:line: a -> b``."""
    problems = []
    top = root.parent
    for path in sorted(root.rglob("*.py")):
        me = _part(_module_name(path, top))
        assert me in RANK, f"{path}: not in a layer; add it to RANK"
        for line, mod in sim_imports(path, top):
            target = _part(mod)
            if target not in RANK:
                problems.append(f"{path.relative_to(top)}:{line}: imports unknown {mod}")
            elif target in TOP_ONLY and me not in TOP_ONLY:
                problems.append(f"{path.relative_to(top)}:{line}: {me} -> {mod} (top-level only)")
            elif RANK[target] > RANK[me]:
                problems.append(f"{path.relative_to(top)}:{line}: {me} -> {mod} (upward)")
    return problems


def test_no_module_imports_upward() -> None:
    assert upward_imports() == []


def test_every_module_is_in_a_layer() -> None:
    parts = {_part(_module_name(p, ROOT)) for p in SIM.rglob("*.py")}
    assert parts <= set(RANK), parts - set(RANK)
    assert {"model", "engine", "io", "tools"} <= parts


@pytest.mark.parametrize(("where", "statement"), [
    ("model/layout.py", "from sim.engine.loop import simulate"),
    ("engine/loop.py", "from sim.io.results import load_results"),
    ("io/scenario.py", "from sim.tools.sweep import run_sweep"),
    ("tools/compare.py", "from sim.cli import main"),
    ("model/windows.py", "    from sim.io import check  # inside a function"),
])
def test_an_upward_import_is_caught(tmp_path: Path, where: str, statement: str) -> None:
    """The checker fails on a deliberately added upward import, even one inside
    a function (a copy of the package, so the real tree is untouched)."""
    copy = tmp_path / "sim"
    shutil.copytree(SIM, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / where
    body = statement.strip().split("  #")[0]
    if statement.startswith("    "):
        target.write_text(target.read_text() + f"\n\ndef _added() -> None:\n    {body}\n")
    else:
        target.write_text(target.read_text() + f"\n{body}\n")
    problems = upward_imports(copy)
    assert len(problems) == 1, problems
    assert where in problems[0]
