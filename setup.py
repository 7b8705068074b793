"""The optional compiled parts of kvsim (everything else is in pyproject.toml).

* ``sim/model/_poolops.c``: the GPU block pool's per-block loops.
* The modules of ``sim._native.NATIVE_MODULES`` (the scheduler and the fast GPU
  cache), compiled from their own source by mypyc, with ``sim/_native_stamp.py``
  recording the SHA-256 of each source compiled.

Both are optional: without a C compiler or mypy (or with ``KVSIM_PURE=1`` set at
install time) the install goes on without them and the Python sources run, with
the same results; ``sim/_native.py`` also runs the sources when one of them no
longer matches what was compiled.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent


def _load_native():
    """``sim/_native.py`` (standard library only) by path: the module list, the group
    library, the switch and the digest live there; importing ``sim`` would need its dependencies."""
    spec = importlib.util.spec_from_file_location("_kvsim_native", ROOT / "sim" / "_native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


native = _load_native()


def _forget_previous_build() -> None:
    """Remove compiled copies left in the tree by an earlier in-place build, and its stamp,
    so that a build that fails or is skipped cannot leave old code standing for new sources."""
    from importlib.machinery import EXTENSION_SUFFIXES  # noqa: PLC0415

    for name in (*native.NATIVE_MODULES, *native.leftovers(), native.GROUP_LIBRARY):
        base = ROOT.joinpath(*name.split("."))
        for suffix in EXTENSION_SUFFIXES:
            base.with_name(base.name + suffix).unlink(missing_ok=True)
    (ROOT / "sim" / "_native_stamp.py").unlink(missing_ok=True)


def _native_extensions() -> list[Extension]:
    _forget_previous_build()
    if os.environ.get(native.PURE_ENV) == "1":
        return []
    try:
        from mypyc.build import mypycify  # noqa: PLC0415 -- a build requirement that may be missing
    except ImportError:
        print("kvsim: mypyc not available, the Python sources will run", file=sys.stderr)
        return []
    paths = [str(native.source_path(m).relative_to(ROOT)) for m in native.NATIVE_MODULES]
    stamp = "".join(f"    {m!r}: {native.source_digest(m)!r},\n" for m in native.NATIVE_MODULES)
    (ROOT / "sim" / "_native_stamp.py").write_text(
        '"""Written by setup.py: the SHA-256 of each source mypyc compiled (see sim/_native.py)."""\n\n'
        f"SOURCES = {{\n{stamp}}}\n")
    try:
        # mypy's types only, not the project's lint settings (pyproject's strict [tool.mypy]):
        # the build environment has mypy and numpy, not kvsim's other dependencies
        options = ["--config-file=", "--python-version=3.11", "--ignore-missing-imports",
                   "--follow-imports=silent"]
        group = native.GROUP_LIBRARY.removesuffix("__mypyc")   # mypyc appends the suffix
        exts = mypycify([*options, *paths], opt_level="3", group_name=group)
    except Exception as exc:   # a type error or a missing tool: the sources run
        print(f"kvsim: mypyc failed ({exc}), the Python sources will run", file=sys.stderr)
        (ROOT / "sim" / "_native_stamp.py").unlink(missing_ok=True)
        return []
    for ext in exts:
        ext.optional = True
    return exts


setup(
    ext_modules=[
        Extension("sim.model._poolops", ["sim/model/_poolops.c"], optional=True,
                  extra_compile_args=["-O2"]),
        *_native_extensions(),
    ],
)
