"""Unreadable inputs, unwritable outputs and signals end every command with one line:
``kvsim: error: ...`` and exit 2, or ``kvsim: interrupted (SIG...)`` and exit 130 / 143;
never a traceback, nothing half written, no worker process left behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import sim
from sim.cli import main
from sim.errors import InputError
from sim.tools import fuzz
from sim.tools.regress import write_junit
from tests.helpers import ROOT, alive, children
from tests.tools.test_plots import _sweep_row

DEFAULT = ROOT / "scenarios" / "default.toml"
CRASH = ROOT / "scenarios" / "crash"
SMALL = ["--set", "workload.sessions=6", "--set", "workload.session_rate_per_s=4", "-q"]
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _one_line(err: str, start: str = "kvsim: error:") -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(start), err
    return lines[0]


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``main(argv)`` exits 2 with one ``kvsim: error:`` line on stderr and nothing on stdout."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    return _one_line(err)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- 1. unreadable results folders (kvsim plot, sim.load_results) ---------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("out-errors") / "run"
    assert main(["run", str(DEFAULT), "--out", str(folder), *SMALL]) == 0
    return folder


@pytest.fixture
def run_copy(run_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(run_dir, folder)
    return folder


def _truncate(path: Path, size: int = 300) -> None:
    path.write_bytes(path.read_bytes()[:size])


def test_plot_and_load_results_name_a_truncated_parquet_file(run_copy: Path, capsys):
    bad = run_copy / "requests.parquet"
    _truncate(bad)
    before = _files(run_copy)
    line = _fails(["plot", str(run_copy)], capsys)
    assert f"{bad}: not a readable Parquet file (truncated or corrupt: " in line
    assert line.endswith("; allowed: a complete kvsim results folder (run the command again)")
    assert _files(run_copy) == before and not (run_copy / "plots").exists()
    assert sorted(p.name for p in run_copy.parent.iterdir()) == ["run"]  # no hidden leftovers
    with pytest.raises(InputError, match=r"requests\.parquet: not a readable Parquet file"):
        sim.load_results(run_copy)


@pytest.mark.parametrize("text", [None, '{"status": "ok",', "[1, 2]"],
                         ids=["missing", "corrupt", "not-object"])
def test_plot_and_load_results_on_a_missing_or_corrupt_summary(run_copy: Path, capsys, text: str | None):
    summary = run_copy / "summary.json"
    if text is None:
        summary.unlink()
    else:
        summary.write_text(text)
    line = _fails(["plot", str(run_copy)], capsys)
    assert str(run_copy) in line
    assert not (run_copy / "plots").exists()
    with pytest.raises(InputError, match="summary.json" if text is not None else "no summary.json"):
        sim.load_results(run_copy)


def _sweep(run_dir: Path, folder: Path) -> Path:
    """A sweep folder of one point (the layout kvsim sweep writes)."""
    point = folder / "points" / "000-a"
    shutil.copytree(run_dir, point)
    sc = tomllib.loads((point / "scenario.toml").read_text())
    row = _sweep_row(0, "points/000-a", sc, json.loads((point / "summary.json").read_text()))
    pd.DataFrame([row]).to_parquet(folder / "sweep.parquet")
    (folder / "sweep.toml").write_text('schema = "sweep/1"\nname = "s"\n')
    return folder


@pytest.mark.parametrize("which", ["sweep.parquet", "points/000-a/requests.parquet"])
def test_plot_of_a_sweep_names_its_truncated_parquet_file(run_dir: Path, tmp_path: Path, capsys, which: str):
    folder = _sweep(run_dir, tmp_path / "sweep")
    _truncate(folder / which)
    line = _fails(["plot", str(folder)], capsys)
    assert f"{folder / which}: not a readable Parquet file (truncated or corrupt: " in line
    assert not (folder / "plots").exists()
    assert sorted(p.name for p in folder.iterdir()) == ["points", "sweep.parquet", "sweep.toml"]


# -- 2. kvsim fuzz --out that cannot be written -----------------------------------------------------------


def _never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the fuzzer ran although its --out cannot be written")


@LINUX
@pytest.mark.parametrize("mode", [["--budget", "100"], ["--runs", "4"]], ids=["budget", "runs"])
@pytest.mark.parametrize("out", ["/proc/foo", "afile", "afile/sub", "/proc"])
def test_fuzz_out_not_writable_is_refused_before_fuzzing(tmp_path: Path, monkeypatch, capsys,
                                                         mode: list[str], out: str):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr("sim.cli.fuzz_decisions", _never)
    monkeypatch.setattr("sim.cli.fuzz_runs", _never)
    line = _fails(["fuzz", *mode, "--out", out, "--jobs", "1", "-q"], capsys)
    assert line.startswith("kvsim: error: argument:--out: ") and out in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert (tmp_path / "afile").read_text() == "x"


def test_fuzz_write_failure_is_one_out_line_and_leaves_no_temporary_file(tmp_path: Path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InputError, match="--out"):
        fuzz._write_text(tmp_path / "afile" / "case.toml", "text")
    os.mkdir(tmp_path / "out")
    (tmp_path / "out" / "case.toml.tmp").mkdir()  # the temporary file cannot be written
    with pytest.raises(InputError, match="--out"):
        fuzz._write_text(tmp_path / "out" / "case.toml", "text")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["case.toml.tmp"]


# -- 3. kvsim regress --junit that cannot be written ------------------------------------------------------


@LINUX
@pytest.mark.parametrize("junit", ["/proc/foo/j.xml", "afile/x.xml", "adir"])
def test_regress_junit_not_writable_is_refused_before_the_library(tmp_path: Path, monkeypatch, capsys,
                                                                   junit: str):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    monkeypatch.setattr("sim.cli.run_library", _never)
    line = _fails(["regress", str(CRASH), "--junit", junit, "--jobs", "1"], capsys)
    assert line.startswith("kvsim: error: argument:--junit: ") and junit in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
    assert list((tmp_path / "adir").iterdir()) == []


def test_write_junit_failure_is_one_line_and_leaves_no_temporary_file(tmp_path: Path):
    (tmp_path / "j.xml").mkdir()  # the report's place is taken by a folder
    with pytest.raises(InputError, match="--junit"):
        write_junit([], tmp_path / "j.xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.xml"]


# -- 4. signals end every command with one line and no worker left --------------------------------------


def _catches_sigterm(pid: int) -> bool:
    """The process has a handler for SIGTERM (kvsim's main installed its own)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


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


def _library(folder: Path, copies: int) -> Path:
    folder.mkdir()
    for i in range(copies):
        for f in CRASH.glob("*.toml"):
            shutil.copy(f, folder / f"{i:02d}-{f.name}")
    return folder


def _batch(path: Path) -> Path:
    item = {"schema": "check/1", "blocks_per_chunk": 4, "tokens_per_hash": 8, "num_tokens": 4353,
            "groups": [{"kind": "full", "tokens_per_block": 256},
                       {"kind": "sliding_window", "tokens_per_block": 64, "window": 128},
                       {"kind": "sliding_window", "tokens_per_block": 8, "window": 128}],
            "chunk_states": {"0": {"0..3": "present"}, "1": {"15": "present"}, "2": {"118..121": "present"}}}
    path.write_text((json.dumps(item) + "\n") * 60_000)
    return path


def _trace(path: Path) -> Path:
    with path.open("w") as f:
        for i in range(400_000):
            f.write(f'{{"timestamp": {10 * i}, "input_length": {1000 + i % 24}, "output_length": 20, '
                    f'"hash_ids": [{i % 7}, {i % 7 + 1}]}}\n')
    return path


#: name -> (argv after "kvsim", made in the test's folder; whether it runs a worker pool)
COMMANDS: dict[str, Any] = {
    # 600 copies of the crash library: about 5 s of work here (40 copies, 0.8 s, finished
    # before the signal once the GPU pool's loops were compiled)
    "regress": (lambda d: ["regress", str(_library(d / "lib", 600)), "--jobs", "2",
                           "--junit", str(d / "j.xml")], True),
    "fuzz-budget": (lambda d: ["fuzz", "--budget", "100000000", "--jobs", "2", "--out", str(d / "fz"), "-q"],
                    True),
    "fuzz-runs": (lambda d: ["fuzz", "--runs", "1000000", "--jobs", "2", "--out", str(d / "fz"), "-q"], True),
    "check": (lambda d: ["check", str(_batch(d / "batch.jsonl")), "--jsonl"], False),
    "trace-stats": (lambda d: ["trace", "stats", str(_trace(d / "big.jsonl"))], False),
}


@LINUX
@pytest.mark.parametrize(("name", "sig"), [
    ("regress", signal.SIGTERM), ("fuzz-budget", signal.SIGTERM), ("fuzz-runs", signal.SIGTERM),
    ("check", signal.SIGTERM), ("trace-stats", signal.SIGTERM),
    ("regress", signal.SIGINT), ("fuzz-budget", signal.SIGINT), ("check", signal.SIGINT),
])
def test_signal_ends_any_command_with_one_line_and_no_worker(tmp_path: Path,
                                                            procs: list[subprocess.Popen[str]],
                                                            name: str, sig: signal.Signals):
    make, pool = COMMANDS[name]
    argv = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    p = subprocess.Popen([sys.executable, "-m", "sim.cli", *argv], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    procs.append(p)
    # ready: main's handlers are in place (and the pool's workers started); the command is busy for seconds
    deadline = time.monotonic() + 20
    while not (_catches_sigterm(p.pid) and (not pool or children(p.pid))) and time.monotonic() < deadline:
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    time.sleep(0.3)
    workers = children(p.pid)
    assert p.poll() is None, "the command ended before the signal"
    if sig == signal.SIGINT:
        os.killpg(p.pid, sig)  # Ctrl-C: the whole foreground group, workers included
    else:
        os.kill(p.pid, sig)  # kill PID: the command only; its workers must not survive it
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the command (or a worker holding its pipes) did not end: {err[-2000:]}")
    assert p.returncode == 128 + sig, err
    # main's own line, or sim.startup's when the signal came during the imports: one line either way
    line = _one_line(err, "kvsim: interrupted")
    assert line in (f"kvsim: interrupted ({sig.name})",
                    f"kvsim: interrupted ({sig.name}) while starting; nothing written"), line
    assert out == ""
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if alive(w)], "a worker survived the command"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no report, no fuzz folder
