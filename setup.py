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

import hashlib
import os
import sys
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
#: the same list as sim._native.NATIVE_MODULES (kept in step by tests/test_native.py)
NATIVE_MODULES = (
    "sim.model.gpu_fast",
    "sim.model.scheduler",
)


def _forget_previous_build() -> None:
    """Remove compiled copies left in the tree by an earlier in-place build, and its stamp,
    so that a build that fails or is skipped cannot leave old code standing for new sources."""
    from importlib.machinery import EXTENSION_SUFFIXES  # noqa: PLC0415

    for name in (*NATIVE_MODULES, "sim.model._native__mypyc"):
        base = ROOT.joinpath(*name.split("."))
        for suffix in EXTENSION_SUFFIXES:
            base.with_name(base.name + suffix).unlink(missing_ok=True)
    (ROOT / "sim" / "_native_stamp.py").unlink(missing_ok=True)


def _native_extensions() -> list[Extension]:
    _forget_previous_build()
    if os.environ.get("KVSIM_PURE") == "1":
        return []
    try:
        from mypyc.build import mypycify  # noqa: PLC0415 -- a build requirement that may be missing
    except ImportError:
        print("kvsim: mypyc not available, the Python sources will run", file=sys.stderr)
        return []
    paths = [str(Path(*m.split(".")).with_suffix(".py")) for m in NATIVE_MODULES]
    digests = {m: hashlib.sha256((ROOT / p).read_bytes()).hexdigest()
               for m, p in zip(NATIVE_MODULES, paths, strict=True)}
    stamp = "".join(f"    {m!r}: {d!r},\n" for m, d in digests.items())
    (ROOT / "sim" / "_native_stamp.py").write_text(
        '"""Written by setup.py: the SHA-256 of each source mypyc compiled (see sim/_native.py)."""\n\n'
        f"SOURCES = {{\n{stamp}}}\n")
    try:
        # mypy's types only, not the project's lint settings (pyproject's strict [tool.mypy]):
        # the build environment has mypy and numpy, not kvsim's other dependencies
        options = ["--config-file=", "--python-version=3.11", "--ignore-missing-imports",
                   "--follow-imports=silent"]
        exts = mypycify([*options, *paths], opt_level="3", group_name="sim.model._native")
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
