"""Which of kvsim's hot modules run compiled (mypyc), and the switch back to their source.

``pip install`` compiles the modules of :data:`NATIVE_MODULES` with mypyc where
it can (``setup.py``; a C compiler and the build requirement ``mypy`` are
needed, otherwise the install goes on without them). The compiled modules are
the same source, so they decide the same; they only run faster. Next to them the
build writes ``sim/_native_stamp.py``: the SHA-256 of each source it compiled.

This module (imported by ``sim/__init__.py`` before anything else of kvsim)
makes the ``.py`` sources load instead of the compiled modules when

* ``KVSIM_PURE=1`` is set (to debug, profile line by line, or compare), or
* any source differs from the one compiled (an editable install whose
  ``.py`` was edited, or another commit checked out, since the last build):
  one warning names the first such file and how to rebuild.

All or none: the compiled modules call each other natively, so mixing a
compiled module with the source of another would run stale code.
A compiled copy of a module that the list no longer names (left in the tree by
an in-place build of another commit) never runs: :func:`leftovers` finds such
copies, their sources load instead, and the next build removes them.
:func:`compiled` tells which modules run compiled in this process.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

#: The modules ``setup.py`` compiles, in dependency order (source paths: :func:`source_path`).
NATIVE_MODULES: tuple[str, ...] = (
    "sim.model.request",
    "sim.model.gpu_fast",
    "sim.model.scheduler",
)
#: The shared library the compiled modules live in (``setup.py``'s mypyc group).
GROUP_LIBRARY = "sim.model._native__mypyc"
#: Environment variable that forces the sources (``1``).
PURE_ENV = "KVSIM_PURE"
_ROOT = Path(__file__).resolve().parent.parent


def source_path(module: str) -> Path:
    """The ``.py`` file of ``module`` (one of :data:`NATIVE_MODULES`)."""
    return _ROOT.joinpath(*module.split(".")).with_suffix(".py")


def source_digest(module: str) -> str:
    """SHA-256 (hex) of ``module``'s source file."""
    return hashlib.sha256(source_path(module).read_bytes()).hexdigest()


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Finds the listed modules as their ``.py`` files, ahead of any compiled file."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = frozenset(modules)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


def _has_compiled(module: str) -> bool:
    src = source_path(module)
    return any(src.with_name(src.stem + suffix).is_file()
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def leftovers() -> list[str]:
    """Modules outside :data:`NATIVE_MODULES` with a compiled copy next to their source: left
    in the tree by an earlier in-place build that compiled them (another commit's list).
    They always run from source (a compiled copy would look for its code in the group
    library, which no longer has it); ``setup.py`` removes them."""
    found: set[str] = set()
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for lib in (_ROOT / "sim").rglob("*" + suffix):
            src = lib.with_name(lib.name[: -len(suffix)] + ".py")
            if src.is_file():
                name = ".".join(src.relative_to(_ROOT).with_suffix("").parts)
                if name not in NATIVE_MODULES:
                    found.add(name)
    return sorted(found)


def _stale() -> str | None:
    """Why the compiled modules must not run; None when they may, or when there are none."""
    if not any(_has_compiled(m) for m in NATIVE_MODULES):
        return None
    if not all(_has_compiled(m) for m in (*NATIVE_MODULES, GROUP_LIBRARY)):
        return "some compiled modules are missing (a partial build)"
    try:
        stamp = importlib.import_module("sim._native_stamp")   # written by the build
    except ImportError:
        return "no build stamp (sim/_native_stamp.py) next to the compiled modules"
    built: dict[str, str] = getattr(stamp, "SOURCES", {})
    for m in NATIVE_MODULES:
        if built.get(m) != source_digest(m):
            return f"{source_path(m).relative_to(_ROOT)} changed since it was compiled"
    return None


def install() -> None:
    """Route :data:`NATIVE_MODULES` to their sources when asked to or when stale (once)."""
    if (any(isinstance(f, _SourceFirst) for f in sys.meta_path)
            or any(m in sys.modules for m in NATIVE_MODULES)):
        return
    routed = leftovers()
    why = "KVSIM_PURE=1" if os.environ.get(PURE_ENV) == "1" else _stale()
    if why is not None:
        routed += NATIVE_MODULES
        if why != "KVSIM_PURE=1":
            warnings.warn(f"kvsim: {why}; running the Python sources (rebuild: pip install -e . "
                          "or python setup.py build_ext --inplace)", RuntimeWarning, stacklevel=2)
    if routed:
        sys.meta_path.insert(0, _SourceFirst(routed))


def compiled() -> list[str]:
    """The modules of :data:`NATIVE_MODULES` imported so far that run compiled."""
    return [m for m in NATIVE_MODULES
            if m in sys.modules and not str(getattr(sys.modules[m], "__file__", "")).endswith(".py")]
