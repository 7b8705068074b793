"""The compiled hot modules (mypyc, ``sim/_native.py``): built in CI, the same outputs as
their Python sources, and the sources take over when asked to or when stale."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim import _native

ROOT = Path(__file__).resolve().parent.parent


def test_the_compiled_modules_run_in_ci():
    for module in _native.NATIVE_MODULES:   # imported, to be seen by compiled()
        importlib.import_module(module)

    if os.environ.get(_native.PURE_ENV) == "1":
        pytest.skip("KVSIM_PURE=1: the sources run on purpose")
    if list(_native.compiled()) != list(_native.NATIVE_MODULES):
        if os.environ.get("CI"):
            pytest.fail(f"compiled: {_native.compiled()} of {_native.NATIVE_MODULES} "
                        "(pip install -e . compiles them with mypyc)")
        pytest.skip("the compiled modules are not built here")


def test_a_compiled_copy_of_a_module_no_longer_compiled_is_a_leftover(tmp_path, monkeypatch):
    """An earlier build's compiled copy of a module that is no longer in the list runs from
    source (and setup.py removes it): its code is no longer in the group library."""
    pkg = tmp_path / "sim" / "model"
    pkg.mkdir(parents=True)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for stem in ("old_hot", "scheduler", "_poolops"):
        (pkg / f"{stem}{suffix}").write_bytes(b"")
    (pkg / "old_hot.py").write_text("")
    (pkg / "scheduler.py").write_text("")
    monkeypatch.setattr(_native, "_ROOT", tmp_path)
    # a listed module is not a leftover; an extension with no .py (the C pool) is not one
    assert _native.leftovers() == ["sim.model.old_hot"]


def _compiled_in_child(env_extra: dict[str, str]) -> str:
    env = {**os.environ, **env_extra}
    code = ("import sim.model.scheduler, sim.model.gpu_fast; from sim import _native; "
            "print(','.join(_native.compiled()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_kvsim_pure_runs_the_sources():
    assert _compiled_in_child({_native.PURE_ENV: "1"}) == ""


def test_a_source_that_no_longer_matches_is_stale(monkeypatch):
    if not any(_native._has_compiled(m) for m in _native.NATIVE_MODULES):
        assert _native._stale() is None   # nothing compiled: nothing can be stale
        return
    assert _native._stale() is None       # a build matches its sources
    monkeypatch.setattr(_native, "source_digest", lambda m: "0" * 64)
    why = _native._stale()
    assert why is not None and "sim/model/" in why and "changed since it was compiled" in why


def _run(out: Path, scenario: str, sets: list[str], pure: bool) -> dict[str, bytes]:
    env = {**os.environ}
    env.pop(_native.PURE_ENV, None)
    if pure:
        env[_native.PURE_ENV] = "1"
    cmd = [sys.executable, "-m", "sim.cli", "run", scenario, "--out", str(out), "-q"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())
            if p.suffix == ".parquet" or p.name == "summary.json"}


SPEC6 = ['model.name="spec6"', 'model.cost_profile="qwen3-30b-a3b"', 'hardware.profile="h200"',
         "hardware.gpu_blocks=6000", "cpu_cache.chunks=4000", 'cpu_cache.policy="lru"',
         "scheduler.blocks_per_chunk=4", "scheduler.tokens_per_hash=8", "scheduler.prefix_caching=true",
         'workload={kind="mooncake", trace="mooncake-conversation", limit=400}',
         'costs.step="auto"', 'costs.transfer="hardware"']


@pytest.mark.slow
@pytest.mark.parametrize("case", ["default", "spec6-mooncake-400"])
def test_compiled_and_source_write_the_same_files(case, tmp_path, request):
    """Every Parquet file and summary.json byte-identical, compiled or not (in CI both run)."""
    if case == "default":
        scenario, sets = str(ROOT / "scenarios" / "default.toml"), []
    else:
        request.getfixturevalue("traces_dir")
        scenario, sets = str(ROOT / "scenarios" / "default.toml"), SPEC6
    if os.environ.get("CI"):   # the comparison must pit the compiled modules against the sources
        assert _compiled_in_child({}) == ",".join(_native.NATIVE_MODULES)
    compiled = _run(tmp_path / "compiled", scenario, sets, pure=False)
    source = _run(tmp_path / "source", scenario, sets, pure=True)
    assert "summary.json" in compiled and any(n.endswith(".parquet") for n in compiled)
    assert compiled.keys() == source.keys()
    differ = [n for n in compiled if compiled[n] != source[n]]
    assert not differ, f"compiled and source runs differ in {differ}"
