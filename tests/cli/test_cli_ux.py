"""Small command-line things: ``kvsim --version``, help texts that name what they accept and
their defaults, the run progress bar's total for generated workloads, counts with nouns."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest

from sim.cli import main
from sim.io import workload
from sim.io.scenario import load_run
from tests.helpers import ROOT

DEFAULT = ROOT / "scenarios" / "default.toml"


def _help(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as ei:
        main(args)
    assert ei.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert _help(["--version"], capsys) == f"kvsim {version('kvsim')}"


def test_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    assert "sweep/1" in _help(["validate", "--help"], capsys)
    assert "default: scenarios/crash" in _help(["regress", "--help"], capsys)


@pytest.mark.parametrize("sets", [[], ["workload.sessions=30"], ["workload.sample=0.5"],
                                  ["workload.limit=7"], ['workload.kind="agentic"', "workload.sessions=5"],
                                  ['workload={kind="uniform", requests=40}', "workload.sample=0.3"]])
def test_progress_total_is_the_request_count(sets: list[str]) -> None:
    spec = load_run(DEFAULT, sets)
    total = workload.request_total(spec)
    assert total is not None and total == sum(1 for _ in spec.requests())


def test_trace_total_without_limit_is_unknown(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]})
                     + "\n", encoding="utf-8")
    sc = tmp_path / "s.toml"
    sc.write_text('schema = "run/1"\n[model]\nname = "hybrid-demo"\n[cpu_cache]\ncapacity = "8GiB"\n'
                  '[workload]\nkind = "mooncake"\npath = "t.jsonl"\n', encoding="utf-8")
    assert workload.request_total(load_run(sc)) is None
    assert workload.request_total(load_run(sc, ["workload.limit=5"])) == 5


def test_counts_agree_with_their_noun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]})
                   + "\n", encoding="utf-8")
    assert main(["trace", "convert", str(src), str(tmp_path / "one.csv")]) == 0
    assert "wrote 1 record to" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["bogus"], ["check", "x.toml", "--logic", "newest"], ["trace", "stats"],
                                  ["run", "x.toml", "--jobs", "3"], ["sweep"], ["plot"]])
def test_command_line_errors_are_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(args)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("kvsim") and ": error: " in err and "--help" in err
