"""Every case of ``benchmarks/bench_engine.py`` loads and replays its first requests under
both block accountings with the same figures: a case that a scenario or model change
broke shows here, not at the next measurement."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sim.engine.loop import simulate
from sim.engine.metrics import Recorder
from sim.io.scenario import load_run

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 30


def _bench_engine() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "benchmarks" / "bench_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench_engine()


@pytest.mark.parametrize("case", sorted(BENCH.CASES))
def test_every_bench_engine_case_replays(case: str, request: pytest.FixtureRequest):
    if case != "default":   # the others replay a public trace
        request.getfixturevalue("traces_dir")
    spec = BENCH.CASES[case]
    figures = {}
    for accounting in BENCH.ACCOUNTINGS:
        run = load_run(spec["scenario"], [*spec["set"], f"workload.limit={LIMIT}",
                                          f'scheduler.block_accounting="{accounting}"'])
        res = simulate(run.engine_config(), run.requests(), Recorder(BENCH._Discard()))
        assert res.status == "ok", (case, accounting, res.status)
        assert res.summary.requests_finished == LIMIT
        figures[accounting] = res.summary.figures()
    assert figures["fast"] == figures["reference"]


def test_rss_growth_script_measures_and_attributes():
    """``benchmarks/rss_growth.py`` (the memory check of the speed issue) runs end to end on
    the embedded default study: both lengths replayed, the ratio printed, sites attributed."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "rss_growth.py"), "--case", "default",
           "--short", "40", "--top", "3"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"^\| short \| 40 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
    assert re.search(r"^\| whole \| 302 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
    ratio = r"^peak RSS, whole / short: [+-][\d.]+% \((within|over) the issue's 10%\)$"
    assert re.search(ratio, out, re.M), out
    sites = re.findall(r"^\| (sim/\S+:\d+) \|", out, re.M)
    assert sites, out   # the model's own allocation sites are named, relative to the checkout


def test_rss_growth_script_refuses_bad_arguments():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rss_growth.py"), "--short", "0"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--short and --top must be at least 1")
    assert proc.stdout == ""


def test_rss_growth_script_ends_on_ctrl_c_with_one_line():
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) halfway: one line, exit
    130, no child left running."""
    import os
    import signal
    import time

    cmd = [sys.executable, str(ROOT / "benchmarks" / "rss_growth.py"), "--case", "default", "--short", "40"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    time.sleep(3)   # the whole script takes about 12 s: this is inside its runs
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["rss_growth: interrupted (SIGINT)"], err
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)   # the group is gone: no child outlived the script


@pytest.mark.parametrize("delay", [0.4, 1.5])
def test_bench_engine_ends_on_ctrl_c_with_one_line(delay: float):
    """Ctrl-C to the process group while the script imports (0.4 s) or while a timed child runs
    (1.5 s): one line, exit 130, no child left. The children ignore SIGINT (a Ctrl-C landing in
    a child's import once printed "Exception ignored" and a traceback) and are killed by the
    script on its way out."""
    import os
    import signal
    import time

    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--case", "default",
           "--limit", "300", "--repeat", "3", "--profile-limit", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    lines = err.strip().splitlines()
    one = "bench_engine: interrupted (SIGINT)"
    assert len(lines) == 1 and lines[0] in (one, f"{one} while starting; nothing written"), err
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


def test_native_profile_summary_folds_helpers_into_their_callers():
    """py-spy's raw stacks: a compiled function is named as in its source, the CPython and
    mypyc helpers below it are its own time, Python frames keep their file, and samples
    outside the replay are counted apart from the shares."""
    harness = ("<module> (bench_engine.py:1);child (bench_engine.py:2);simulate (sim/engine/loop.py:3);"
               "Engine.run (sim/engine/loop.py:4);Environment.step (simpy/core.py:5);"
               "Engine._step (sim/engine/loop.py:6)")
    raw = "\n".join([
        f"{harness};CPyPy_scheduler___Scheduler___schedule (__native.c:1);"
        "CPyDef_scheduler___Scheduler___schedule (__native.c:2);Py_DECREF (object.h:3) 6",
        f"{harness};CPyDef_scheduler___Scheduler___schedule (__native.c:2);"
        "CPyDef_gpu_fast___FastBlockPool____pop_head (__native.c:9);list_dealloc (listobject.c:1) 2",
        f"{harness};CPyDef_scheduler___Scheduler___schedule (__native.c:2);"
        "poolops_take (sim/model/_poolops.c:68);PyDict_DelItem (dictobject.c:1) 1",
        f"{harness};LruPolicy.touch (sim/model/cpu_cache.py:435) 1",
        "<module> (bench_engine.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 10",
    ])
    out = BENCH.summarize_native(raw, top=10)
    assert out.startswith("20 samples, 10 of them inside the replay"), out
    cells = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| ")]
    own = {r[2]: (float(r[0]), float(r[1])) for r in cells if len(r) == 3 and r[0] != "own %"}
    incl = {r[1]: float(r[0]) for r in cells if len(r) == 2 and r[0] != "with callees %"}
    assert own == {"Scheduler.schedule [scheduler, compiled]": (60.0, 90.0),
                   "FastBlockPool._pop_head [gpu_fast, compiled]": (20.0, 20.0),
                   "take [_poolops, C]": (10.0, 10.0),
                   "LruPolicy.touch [cpu_cache.py]": (10.0, 10.0)}
    assert incl["Engine._step [loop.py]"] == 100.0   # the step itself, below the harness
    assert not any(name.startswith(("simulate", "Engine.run", "Environment")) for name in incl)


@pytest.mark.parametrize("spy", ["missing", "failing"])
def test_bench_engine_profile_falls_back_to_cprofile_and_says_why(spy: str, monkeypatch, capsys):
    monkeypatch.setattr(BENCH, "_py_spy", lambda: None if spy == "missing" else "/bin/false")
    BENCH.profile("default", 20)
    out = capsys.readouterr().out
    why = "py-spy is not installed" if spy == "missing" else "py-spy failed (exit 1)"
    assert f"cProfile of the Python sources, KVSIM_PURE=1, because {why}" in out, out
    assert "Ordered by: internal time" in out, out
    assert re.search(r"sim/model/\w+\.py:\d+\(\w+\)$", out, re.M), out   # the model's own functions


def test_bench_engine_profiles_the_run_as_timed_with_py_spy():
    """The README's benchmark command prints a py-spy profile of the fast accounting (the
    ``[test]`` extra installs py-spy): the scheduler's step is in it, compiled where the
    install compiled it."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--case", "default",
           "--accounting", "fast", "--limit", "20", "--profile-case", "default", "--profile-limit", "60"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "profile: fast accounting, default, first 60 requests (py-spy --native" in out, out
    assert re.search(r"^\| [\d.]+ \| Scheduler\.schedule \[scheduler(, compiled|\.py)\] \|$", out, re.M), out


def test_bench_engine_ends_on_ctrl_c_while_py_spy_profiles():
    """Ctrl-C while the profile runs under py-spy (its own session, so the terminal's signal
    does not make it exit without its child): one line, exit 130, and neither py-spy nor the
    run it samples outlives the script, not even as a zombie."""
    import os
    import signal
    import time

    marker = "--profile-limit 301"   # this test's profile, told apart from other tests' runs
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--case", "default",
           "--accounting", "fast", "--limit", "20", "--profile-case", "default", *marker.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    def children() -> bytes:
        return subprocess.run(["pgrep", "-a", "-P", str(proc.pid)], check=False, capture_output=True).stdout

    while b"py-spy" not in children():
        assert time.monotonic() < deadline and proc.poll() is None, "the profile never started"
        time.sleep(0.1)
    time.sleep(1.0)   # inside the sampled run
    found = subprocess.run(["pgrep", "-f", "--", "--limit 301"], check=False, capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    assert len(pids) == 2, pids   # py-spy and the run it samples
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["bench_engine: interrupted (SIGINT)"], err
    for pid in pids:   # gone and reaped: a zombie would still take a signal 0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(("argv", "why"), [
    (["--limit", "1"], "--limit must be at least 2"),
    (["--base", "no-such-commit"], "--base: 'no-such-commit' is not a commit of this repository"),
])
def test_instructions_script_refuses_bad_arguments(argv: list[str], why: str):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "instructions.py"), *argv],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(why), proc.stderr
    assert proc.stdout == ""


def test_instructions_script_reads_which_modules_a_tree_compiles(tmp_path: Path) -> None:
    """The script tells a stale or failed build from a commit that compiles other modules by
    reading each tree's own module list (not importing it: the base is another commit)."""
    from sim import _native

    spec = importlib.util.spec_from_file_location("instructions", ROOT / "benchmarks" / "instructions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.native_modules(ROOT) == list(_native.NATIVE_MODULES)
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "_native.py").write_text('NATIVE_MODULES: tuple[str, ...] = ("sim.model.a",)\n')
    assert module.native_modules(tmp_path) == ["sim.model.a"]


def test_instructions_script_counts_both_codes_of_a_case():
    """The A/B by instruction counts (valgrind; no build with --sources): HEAD against the
    working tree on the default study's first requests, a figure for each and their ratio."""
    import os
    import shutil

    if shutil.which("valgrind") is None and not os.environ.get("CI"):
        pytest.skip("valgrind not installed here")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "instructions.py"), "--case", "default", "--limit", "4",
           "--sources"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^\| (\w+|working tree) \| (.*?) \| ([\d,]+) \| ([\d.]+) \|$", proc.stdout, re.M)
    assert len(rows) == 2 and rows[1][0] == "working tree", proc.stdout
    base, new = (int(r[2].replace(",", "")) for r in rows)
    assert base > 10_000 and new > 10_000   # a replayed request takes far more than start-up noise
    assert float(rows[1][3]) == pytest.approx(new / base, abs=0.001)


@pytest.mark.parametrize(("argv", "why"), [
    (["--repeat", "0"], "--repeat must be at least 1"),
    (["--profile-limit", "-1"], "--profile-limit must be 0 (no profile) or more"),
])
def test_bench_engine_refuses_bad_arguments_before_printing(argv: list[str], why: str):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--case", "default", *argv]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(why), proc.stderr
    assert proc.stdout == ""
