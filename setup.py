"""The optional compiled parts of kvsim (everything else is in pyproject.toml).

* ``sim/model/_poolops.c``: the GPU block pool's per-block loops.
* The modules of ``sim._native.NATIVE_MODULES`` (the scheduler, the fast GPU
  cache and the request), compiled from their own source by mypyc, with ``sim/_native_stamp.py``
  recording the SHA-256 of each source compiled.

Both are optional: without a C compiler or mypy (or with ``KVSIM_PURE=1`` set at
install time) the install goes on without them and the Python sources run, with
the same results; ``sim/_native.py`` also runs the sources when one of them no
longer matches what was compiled.
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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


#: run in a child process by :func:`_mypycify`: mypycify, then the extensions it returns as
#: JSON (argv: the options and paths as JSON, the group name, the output file)
_MYPYCIFY_CHILD = """
import json, os, sys
from mypyc.build import mypycify
exts = mypycify(json.loads(sys.argv[1]), opt_level="3", group_name=sys.argv[2])
with open(sys.argv[3], "w") as out:
    json.dump([{"name": e.name, "sources": e.sources,
                **{k: getattr(e, k) for k in sys.argv[4].split(",")}} for e in exts], out)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)   # not freeing mypy's build graph: about a minute on a 2-core machine
"""

#: the ``Extension`` fields the child hands back
_FIELDS = ("include_dirs", "define_macros", "undef_macros", "library_dirs", "libraries",
           "runtime_library_dirs", "extra_objects", "extra_compile_args", "extra_link_args",
           "export_symbols", "depends", "language")


def _mypycify(args: list[str], group: str) -> list[Extension]:
    """mypycify ``args`` in a child process and rebuild its extensions here.

    In this process mypy's type check leaves about five million objects that
    Python then spends about a minute freeing at exit (a ``pip install`` waits
    for it); the child writes the C files and the extensions' fields, and exits
    without freeing them.

    Raises:
        RuntimeError: mypyc failed (a type error, a missing tool).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "extensions.json"
        res = subprocess.run([sys.executable, "-c", _MYPYCIFY_CHILD, json.dumps(args), group,
                              str(out), ",".join(_FIELDS)], cwd=ROOT, check=False)
        if res.returncode != 0 or not out.is_file():
            raise RuntimeError(f"mypyc exited with status {res.returncode}")
        described = json.loads(out.read_text())
    exts = []
    for d in described:
        d["define_macros"] = [tuple(m) for m in d["define_macros"]]
        exts.append(Extension(d.pop("name"), d.pop("sources"), **d))
    return exts


def _stamp_text() -> str:
    """``sim/_native_stamp.py`` for the sources as they are now."""
    stamp = "".join(f"    {m!r}: {native.source_digest(m)!r},\n" for m in native.NATIVE_MODULES)
    return ('"""Written by setup.py: the SHA-256 of each source mypyc compiled (see sim/_native.py)."""\n\n'
            f"SOURCES = {{\n{stamp}}}\n")


def _native_extensions() -> list[Extension]:
    """The mypyc extensions of :data:`native.NATIVE_MODULES`, or none (one line says why)."""
    if os.environ.get(native.PURE_ENV) == "1":
        return []
    if importlib.util.find_spec("mypyc") is None:   # a build requirement that may be missing
        print("kvsim: mypyc not available, the Python sources will run", file=sys.stderr)
        return []
    paths = [str(native.source_path(m).relative_to(ROOT)) for m in native.NATIVE_MODULES]
    try:
        # mypy's types only, not the project's lint settings (pyproject's strict [tool.mypy]):
        # the build environment has mypy and numpy, not kvsim's other dependencies
        options = ["--config-file=", "--python-version=3.11", "--ignore-missing-imports",
                   "--follow-imports=silent"]
        group = native.GROUP_LIBRARY.removesuffix("__mypyc")   # mypyc appends the suffix
        exts = _mypycify([*options, *paths], group)
    except Exception as exc:   # a type error or a missing tool: the sources run
        print(f"kvsim: mypyc failed ({exc}), the Python sources will run", file=sys.stderr)
        return []
    for ext in exts:
        ext.optional = True
    return exts


#: setup.py commands that only describe the package: they finalize ``build_ext`` to list
#: its sources, and need no compiled module
_METADATA_COMMANDS = frozenset({"egg_info", "dist_info", "sdist"})


class BuildExt(build_ext):
    """``build_ext`` that adds the mypyc extensions only for a build, and stamps them.

    Not each time ``setup.py`` is read: pip runs it three times for one install
    (build requirements and metadata, which finalize ``build_ext`` to list its
    sources, then the build), and mypyc's type check and C generation took about
    90 s each time on a 2-core machine. They are added before the options are
    finalized (setuptools prepares each extension there), once per process.

    The stamp (``sim/_native_stamp.py``, the digests of the sources compiled) goes
    where the compiled modules go, decided when the build runs (pip finalizes a
    first ``build_ext`` for an editable install before it sets the editable mode).
    An in-place build (``pip install -e .``, ``setup.py build_ext --inplace``)
    first removes the tree's earlier compiled copies and stamp, so that a build
    that fails or is skipped cannot leave old code standing for new sources, and
    writes the new stamp into the tree. Any other build (``pip wheel .``, ``pip
    install .``) leaves the tree alone and writes the stamp into its build folder:
    a wheel built in a developer's checkout does not take the checkout's compiled
    modules away."""

    _native_added = False
    #: the stamp of the mypyc extensions added, None when none were
    _stamp: str | None = None

    def finalize_options(self) -> None:
        commands = set(self.distribution.commands)
        if not BuildExt._native_added and not commands <= _METADATA_COMMANDS:
            BuildExt._native_added = True
            exts = _native_extensions()
            BuildExt._stamp = _stamp_text() if exts else None
            self.distribution.ext_modules = [*(self.distribution.ext_modules or []), *exts]
        super().finalize_options()

    def run(self) -> None:
        if self.inplace:
            _forget_previous_build()
            stamp = ROOT / "sim" / "_native_stamp.py"
        else:   # build_py copied the tree's stamp, if any, with the sources
            stamp = Path(self.build_lib) / "sim" / "_native_stamp.py"
            stamp.unlink(missing_ok=True)
        super().run()
        if BuildExt._stamp is not None:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(BuildExt._stamp)


setup(
    ext_modules=[
        Extension("sim.model._poolops", ["sim/model/_poolops.c"], optional=True,
                  extra_compile_args=["-O2"]),
    ],
    cmdclass={"build_ext": BuildExt},
)
