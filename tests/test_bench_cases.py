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
