"""Signals on long commands, in a subprocess: SIGINT / SIGTERM end ``kvsim run`` and
``kvsim compare`` with one line and exit 130 / 143, keep the previous result and
the rows that did finish; SIGKILL of ``kvsim compare`` leaves no worker behind,
and the next command removes the temporary folder it left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers import ROOT, alive, children

DEFAULT = ROOT / "scenarios" / "default.toml"
#: a run of minutes: it is always interrupted long before its end
LONG = ["--set", "workload.sessions=2000", "--set", "workload.session_rate_per_s=20", "-q"]
#: a run of about a second
SMALL = ["--set", "workload.sessions=12", "--set", "workload.session_rate_per_s=4", "-q"]


def kvsim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sim.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def start(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sim.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_until(cond: object, proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Started commands; whatever is left of their sessions is killed at the end."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
            p.communicate(timeout=10)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# -- kvsim run ---------------------------------------------------------------------------------------


def test_sigint_on_run_overwrite_keeps_the_previous_run(tmp_path: Path, procs: list[subprocess.Popen[str]]):
    out = tmp_path / "results" / "demo"
    assert kvsim("run", str(DEFAULT), "--out", str(out), *SMALL, cwd=tmp_path).returncode == 0
    before = _tree(out)
    proc = start("run", str(DEFAULT), "--out", str(out), "--overwrite", *LONG, cwd=tmp_path)
    procs.append(proc)
    tmp = out.parent / f".demo.tmp-{proc.pid}"
    wait_until(tmp.is_dir, proc)
    time.sleep(2.5)  # some requests finish
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    line = _one_line(err)
    assert line.startswith("kvsim: interrupted (SIGINT)") and str(out) in line
    assert _tree(out) == before                     # the previous run, untouched
    kept = out.parent / "demo.interrupted"
    assert str(kept) in line
    summary = json.loads((kept / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert pq.read_metadata(kept / "requests.parquet").num_rows > 0  # the rows that did finish
    assert hidden(out.parent) == []


def test_sigterm_on_a_new_run_keeps_the_partial_run(tmp_path: Path, procs: list[subprocess.Popen[str]]):
    out = tmp_path / "results" / "demo"
    proc = start("run", str(DEFAULT), "--out", str(out), *LONG, cwd=tmp_path)
    procs.append(proc)
    wait_until((out.parent / f".demo.tmp-{proc.pid}").is_dir, proc)
    time.sleep(2.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    line = _one_line(err)
    assert line.startswith("kvsim: interrupted (SIGTERM)") and str(out) in line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert pq.read_metadata(out / "requests.parquet").num_rows > 0
    assert hidden(out.parent) == []


# -- kvsim compare -----------------------------------------------------------------------------------


def _workers_started(proc: subprocess.Popen[str], tmp: Path) -> bool:
    """Both runs write into the compare's temporary folder."""
    return tmp.is_dir() and len([p for p in tmp.iterdir() if p.name.startswith(".")]) >= 2


def test_sigint_on_compare_overwrite_keeps_the_previous_compare(tmp_path: Path,
                                                              procs: list[subprocess.Popen[str]]):
    out = tmp_path / "cmp"  # a previous compare (its contents do not matter here)
    (out / "old").mkdir(parents=True)
    (out / "old" / "summary.json").write_text('{"status": "ok"}\n')
    (out / "compare.json").write_text('{"status": "ok"}\n')
    before = _tree(out)
    proc = start("compare", str(DEFAULT), "--out", str(out), "--overwrite", *LONG, cwd=tmp_path)
    procs.append(proc)
    tmp = tmp_path / f".cmp.tmp-{proc.pid}"
    wait_until(lambda: _workers_started(proc, tmp), proc)
    workers = children(proc.pid)
    proc.send_signal(signal.SIGINT)  # the parent only: it stops its workers itself
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    line = _one_line(err)
    assert line.startswith("kvsim: interrupted (SIGINT)") and str(out) in line
    assert _tree(out) == before
    assert hidden(tmp_path) == []
    deadline = time.monotonic() + 5
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if alive(w)]


def test_sigkill_on_compare_leaves_no_worker_and_the_next_command_cleans_up(
        tmp_path: Path, procs: list[subprocess.Popen[str]]):
    proc = start("compare", str(DEFAULT), "--out", str(tmp_path / "cmp"), *LONG, cwd=tmp_path)
    procs.append(proc)
    tmp = tmp_path / f".cmp.tmp-{proc.pid}"
    wait_until(lambda: _workers_started(proc, tmp), proc)
    workers = children(proc.pid)
    assert len(workers) >= 2
    proc.kill()
    proc.wait(timeout=10)  # not communicate(): an orphaned worker would hold the pipes open
    deadline = time.monotonic() + 5
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if alive(w)], "orphaned workers"
    assert tmp.is_dir()  # left behind by the killed command ...
    result = kvsim("run", str(DEFAULT), "--out", str(tmp_path / "next"), *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert hidden(tmp_path) == []  # ... and removed by the next one writing beside it


def test_a_signal_while_starting_ends_in_one_line() -> None:
    """SIGTERM before ``main`` runs (during the heavy imports) still ends in one line:
    ``sim.cli`` imports ``sim.startup`` first."""
    code = ("import os, signal, time\nimport sim.startup\n"
            "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(10)\n")
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=30)
    assert p.returncode == 143
    assert p.stderr == "kvsim: interrupted (SIGTERM) while starting; nothing written\n"
