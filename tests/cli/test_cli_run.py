"""`kvsim run` and `kvsim validate` from the command line: folders, exit codes, error lines.

The tests in the first part need only the scenario layer; the ones under
"runs (need sim.engine.loop)" run the simulator on small workloads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sim.cli import build_parser, main
from sim.engine.metrics import OPTIONAL_TABLES, TABLES
from sim.io.scenario import load_run
from tests.helpers import ROOT

DEFAULT = ROOT / "scenarios" / "default.toml"
#: a short run of the default scenario (a few seconds at most)
SMALL = ["--set", "workload.sessions=12", "--set", "workload.session_rate_per_s=4", "-q"]
#: no tiers.parquet: the run has no secondary tiers
FILES = sorted([f"{t}.parquet" for t in TABLES if t not in OPTIONAL_TABLES]
               + ["summary.json", "scenario.toml", "run_info.json"])


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, prefix: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kvsim: error: {prefix}"), lines[0]


# -- bad input: exit 2, one line, nothing created --------------------------------------------------


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_bad_key_in_scenario(in_tmp: Path, capsys):
    f = in_tmp / "s.toml"
    f.write_text(DEFAULT.read_text().replace("[cpu_cache]", "[cpu_cache]\ncolour = 1"))
    code, out, err = run(["run", str(f)], capsys)
    assert code == 2 and out == ""
    one_error_line(err, f"{f}:cpu_cache.colour: unknown key")
    assert sorted(p.name for p in in_tmp.iterdir()) == ["s.toml"]


def test_bad_unit_in_scenario(in_tmp: Path, capsys):
    f = in_tmp / "s.toml"
    f.write_text(DEFAULT.read_text().replace('capacity = "64GiB"', 'capacity = "16 gigs"'))
    code, _, err = run(["run", str(f)], capsys)
    assert code == 2
    one_error_line(err, f"{f}:cpu_cache.capacity: ")
    assert not (in_tmp / "results").exists()


def test_missing_scenario(in_tmp: Path, capsys):
    code, _, err = run(["run", "nope.toml"], capsys)
    assert code == 2
    one_error_line(err, "nope.toml: no such file")


def test_bad_override(in_tmp: Path, capsys):
    code, _, err = run(["run", str(DEFAULT), "--set", "cpu_cache.colour=blue"], capsys)
    assert code == 2
    one_error_line(err, "--set:cpu_cache.colour: unknown key")
    code, _, err = run(["run", str(DEFAULT), "--seed", "x"], capsys)
    assert code == 2
    one_error_line(err, "--seed:seed: 'x' is invalid")
    code, _, err = run(["run", str(DEFAULT), "--logic", "both"], capsys)
    assert code == 2
    one_error_line(err, "--logic:window_logic: 'both' is invalid")
    assert list(in_tmp.iterdir()) == []


def test_non_empty_target_is_refused(in_tmp: Path, capsys):
    out_dir = in_tmp / "mine"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("keep")
    code, _, err = run(["run", str(DEFAULT), "--out", str(out_dir)], capsys)
    assert code == 2
    one_error_line(err, f"{out_dir}: results folder exists and is not empty")
    assert sorted(p.name for p in in_tmp.iterdir()) == ["mine"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["notes.txt"]


def test_subprocess_error_line(tmp_path: Path):
    f = tmp_path / "s.toml"
    f.write_text('schema = "run/1"\nseed = -1\n[model]\nname = "hybrid-demo"\n[cpu_cache]\nchunks = 1\n')
    proc = subprocess.run([sys.executable, "-m", "sim.cli", "run", str(f)], cwd=tmp_path,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"kvsim: error: {f}:seed: -1 is invalid; allowed: ")
    assert len(proc.stderr.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


# -- overrides: shorthands in command-line order ---------------------------------------------------


@pytest.mark.parametrize(("args", "seed", "logic"), [
    (["--seed", "1", "--set", "seed=2"], 2, "new"),
    (["--set", "seed=2", "--seed", "1"], 1, "new"),
    (["--logic", "old", "--set", "window_logic=new", "--logic", "old"], 0, "old"),
    (["--set", "window_logic=old", "--logic", "new"], 0, "new"),
])
def test_shorthands_rightmost_wins(args: list[str], seed: int, logic: str):
    ns = build_parser().parse_args(["run", str(DEFAULT), *args])
    spec = load_run(ns.scenario, ns.overrides)
    assert (spec.scenario.seed, spec.scenario.window_logic) == (seed, logic)


def test_parser_defaults():
    ns = build_parser().parse_args(["run", str(DEFAULT)])
    assert ns.overrides == [] and ns.out is None and not ns.overwrite and not ns.plots


# -- validate ------------------------------------------------------------------------------------


def test_validate_ok_and_bad(tmp_path: Path, capsys):
    code, out, err = run(["validate", str(DEFAULT)], capsys)
    assert code == 0 and err == ""
    assert out.startswith(f"{DEFAULT}: ok (run/1: 'default'")
    code, out, _ = run(["validate", *map(str, sorted((ROOT / "scenarios").rglob("*.toml")))], capsys)
    assert code == 0 and all(": ok (" in line for line in out.splitlines())
    bad = tmp_path / "bad.toml"
    bad.write_text('schema = "hardware/1"\nname = "x"\n')
    code, out, err = run(["validate", str(bad)], capsys)
    assert code == 2 and out == ""
    one_error_line(err, f"{bad}:gpu: required key missing")
    unknown = tmp_path / "u.toml"
    unknown.write_text('schema = "recipe/1"\n')
    code, _, err = run(["validate", str(unknown)], capsys)
    assert code == 2
    one_error_line(err, f"{unknown}:schema: 'recipe/1' is not a known schema; allowed: \"run/1\"")


# -- runs (need sim.engine.loop) ------------------------------------------------------------------------


def test_run_writes_the_folder(in_tmp: Path, capsys):
    code, out, err = run(["run", str(DEFAULT), *SMALL], capsys)
    assert code == 0, err
    target = in_tmp / "results" / "default"
    assert sorted(p.name for p in target.iterdir()) == FILES
    assert sorted(p.name for p in (in_tmp / "results").iterdir()) == ["default"]
    for label in ("requests finished / arrived", "GPU hit rate", "CPU hit rate", "TTFT p50 / p90 / p99",
                  "bytes moved H2D / D2H", "crashes", "results"):
        assert label in out
    assert "results/default" in out

    import sim

    res = sim.load_results(target)
    assert res.summary["status"] == "ok"
    assert res.summary["requests"]["finished"] == len(res.requests) > 0
    for table, cols in TABLES.items():
        assert list(getattr(res, table).columns) == [c for c, _ in cols]
    assert res.scenario["seed"] == 0 and res.scenario["kvsim_version"]
    assert res.scenario["workload"]["sessions"] == 12
    # the resolved scenario reproduces the run's configuration
    again = load_run(target / "scenario.toml")
    assert again.engine_config() == load_run(DEFAULT, ["workload.sessions=12",
                                                       "workload.session_rate_per_s=4"]).engine_config()
    info = json.loads((target / "run_info.json").read_text())
    assert info["wall_clock_s"] > 0 and info["versions"]["kvsim"]


def test_run_overwrite_and_plots(in_tmp: Path, capsys):
    out_dir = in_tmp / "o"
    assert run(["run", str(DEFAULT), "--out", str(out_dir), *SMALL], capsys)[0] == 0
    code, _, err = run(["run", str(DEFAULT), "--out", str(out_dir), *SMALL], capsys)
    assert code == 2 and "not empty" in err
    code, _, err = run(["run", str(DEFAULT), "--out", str(out_dir), "--overwrite", "--plots", "--seed", "5",
                        *SMALL], capsys)
    assert code == 0
    assert sorted(p.name for p in (out_dir / "plots").iterdir()) == [
        "link_utilisation.png", "occupancy.png", "ttft_cdf.png"]
    assert tomllib.loads((out_dir / "scenario.toml").read_text())["seed"] == 5
    assert sorted(p.name for p in in_tmp.iterdir()) == ["o"]


def test_same_seed_gives_identical_files(tmp_path: Path):
    outs = []
    for i, hashseed in enumerate(("1", "12345")):
        out_dir = tmp_path / f"run{i}"
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        cmd = [sys.executable, "-m", "sim.cli", "run", str(DEFAULT), "--out", str(out_dir), *SMALL]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
        outs.append(out_dir)
    for name in FILES:
        if name != "run_info.json":
            assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_engine_failure_leaves_a_failed_summary(in_tmp: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    import sim.engine.loop
    import sim.tools.run

    def broken(*args: object, **kwargs: object) -> object:
        raise sim.engine.loop.InvariantViolation("3 GPU blocks leaked")

    monkeypatch.setattr(sim.tools.run, "simulate", broken)  # where the run lifecycle looks it up
    code, _, err = run(["run", str(DEFAULT), "--out", "f", *SMALL], capsys)
    assert code == 1
    assert "Traceback" in err and "InvariantViolation: 3 GPU blocks leaked" in err
    summary = json.loads((in_tmp / "f" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"] == "sim.model.scheduler.InvariantViolation: 3 GPU blocks leaked"
    assert (in_tmp / "f" / "scenario.toml").is_file()
    assert sorted(p.name for p in in_tmp.iterdir()) == ["f"]


def test_bad_trace_line_found_while_running_creates_nothing(in_tmp: Path, capsys):
    trace = in_tmp / "t.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    trace.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n{not json}\n")
    f = in_tmp / "s.toml"
    f.write_text('schema = "run/1"\n[model]\nname = "hybrid-demo"\n[hardware]\ngpu_kv_bytes = "1GiB"\n'
                 '[cpu_cache]\nchunks = 100\n[workload]\nkind = "mooncake"\npath = "t.jsonl"\n')
    code, _, err = run(["run", str(f), "-q"], capsys)
    assert code == 2
    one_error_line(err, f"{trace}:line 3: ")
    assert sorted(p.name for p in in_tmp.iterdir()) == ["results", "s.toml", "t.jsonl"]
    assert list((in_tmp / "results").iterdir()) == []


def test_an_idle_gap_of_millions_of_samples_is_refused_before_the_rows(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]):
    """One session every 30 years: the run would write an occupancy row a second for
    the gap. It is refused in one line (naming the interval) before anything is written,
    and runs once the interval, or a time limit, bounds the rows."""
    out = tmp_path / "r"
    rare = ["--set", "workload.session_rate_per_s=1e-9", "--set", "workload.limit=3", "-q"]
    code, _, err = run(["run", str(DEFAULT), "--out", str(out), *rare], capsys)
    assert code == 2 and f"{DEFAULT}:output.occupancy_interval_s: " in err and "occupancy rows" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    code, _, _ = run(["run", str(DEFAULT), "--out", str(out), *rare, "--set", "output.max_sim_time_s=120"],
                     capsys)
    assert code == 0 and json.loads((out / "summary.json").read_text())["end"] == "time_limit"
