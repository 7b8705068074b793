"""`kvsim compare --logics`: two or three window logics side by side.

One three-logic compare of a small multiturn run (``scenarios/default.toml``
with 10 sessions) through the command line, and one two-logic compare of the
same run with the defaults, serve every test of the folder layout, the
table, the diverged files and the figure. The OLD-vs-NEW output of the
default is held byte-identical to earlier releases by ``benchmarks/golden.py
--only compare``; here its first two logics are held equal to the default's.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from sim.cli import main
from sim.errors import InputError
from sim.tools import plots
from sim.tools.compare import (
    DIVERGED_COLUMNS,
    compare_runs,
    compare_table,
    describe_divergence,
    diverged_columns,
    load_compare,
    markdown_report,
    parse_logics,
)
from tests.helpers import ROOT

DEFAULT = ROOT / "scenarios" / "default.toml"
SMALL = ["--set", "workload.sessions=10"]
HEADERS = ("OLD (vLLM 0.29.0)", "NEW (vLLM 0.30.0)", "LATEST (vLLM 0.33.0)")


def run_cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``kvsim compare --logics old,new,latest`` (worker processes, one per logic) and what it printed."""
    out = tmp_path_factory.mktemp("three") / "cmp"
    code, stdout, err = run_cli(["compare", str(DEFAULT), *SMALL, "--logics", "old,new,latest",
                                 "--out", str(out), "-q"])
    assert code == 0, err
    return out, stdout


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same scenario with the default logics (in this process)."""
    out = tmp_path_factory.mktemp("two") / "cmp"
    res = compare_runs(DEFAULT, out, ["workload.sessions=10"], jobs=1)
    assert res.status == "ok" and res.logics == ("old", "new")
    return out


def _bytes(folder: Path) -> dict[str, bytes]:
    skip = {"run_info.json", "compare.json", "compare.md", "compare.png"}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in skip and "plots" not in p.parts}


def test_folder_layout(three: tuple[Path, str]) -> None:
    folder, _ = three
    assert {p.name for p in folder.iterdir()} == {
        "old", "new", "latest", "compare.md", "compare.json", "compare.png", "diverged.parquet",
        "diverged-old-latest.parquet"}
    for lg in ("old", "new", "latest"):
        assert f'window_logic = "{lg}"' in (folder / lg / "scenario.toml").read_text()
    figures = json.loads((folder / "compare.json").read_text())
    assert figures["logics"] == ["old", "new", "latest"]
    assert set(figures["runs"]) == {"old", "new", "latest"}
    assert figures["timing"]["jobs"] == 3 and "latest_wall_clock_s" in figures["timing"]
    pair = figures["diverged_pairs"]["old-latest"]
    assert pair["file"] == "diverged-old-latest.parquet"
    assert pair["requests"] == figures["diverged"]["requests"]


def test_table_and_report_have_a_column_per_logic(three: tuple[Path, str]) -> None:
    folder, stdout = three
    lines = stdout.splitlines()
    head = lines[0]
    assert [head.index(h) for h in HEADERS] == sorted(head.index(h) for h in HEADERS)
    crashes = next(line for line in lines if line.startswith("crashes"))
    assert crashes.split() == ["crashes", "0", "0", "0"]
    assert any(line.startswith("diverging OLD vs NEW ") for line in lines)
    assert any(line.startswith("diverging OLD vs LATEST ") for line in lines)
    assert compare_table(load_compare(folder).figures, folder) == stdout.rstrip("\n")
    md = (folder / "compare.md").read_text()
    assert "| | OLD | NEW | LATEST |\n| --- | --- | --- | --- |" in md
    assert "run three times" in md and "`\"latest\"` (vLLM 0.33.0) in `latest/`" in md
    assert "### OLD vs LATEST" in md and "`diverged-old-latest.parquet`" in md
    assert "## Timing" in md and ", all " in md


def test_diverged_files_and_load_compare(three: tuple[Path, str]) -> None:
    folder, _ = three
    res = load_compare(folder)
    assert res.logics == ("old", "new", "latest")
    assert list(res.runs) == ["old", "new", "latest"]
    assert list(res.diverged.columns) == list(DIVERGED_COLUMNS)
    latest = res.diverged_pairs["old-latest"]
    assert list(latest.columns) == list(diverged_columns("old", "latest"))
    assert list(pd.read_parquet(folder / "diverged-old-latest.parquet").columns) == list(latest.columns)


def test_default_equals_the_first_two_of_three(two: Path, three: tuple[Path, str]) -> None:
    folder, _ = three
    assert sorted(p.name for p in two.iterdir()) == [
        "compare.json", "compare.md", "compare.png", "diverged.parquet", "new", "old"]
    figures = json.loads((two / "compare.json").read_text())
    assert "logics" not in figures and "diverged_pairs" not in figures  # as before --logics
    same = _bytes(two)
    both = {k: v for k, v in _bytes(folder).items() if not k.startswith(("latest/", "diverged-"))}
    assert same == both  # the OLD and NEW runs and diverged.parquet, byte for byte
    three_fig = json.loads((folder / "compare.json").read_text())
    assert {lg: three_fig["runs"][lg] for lg in ("old", "new")} == figures["runs"]
    assert three_fig["diverged"] == figures["diverged"]
    md = (two / "compare.md").read_text()
    assert "run twice with the same requests: `window_logic = \"old\"` (vLLM 0.29.0) in `old/` and " \
           "`\"new\"` (vLLM 0.30.0) in `new/`." in md
    assert "| | OLD | NEW |\n" in md and "### OLD vs NEW" not in md
    assert markdown_report(figures) == md
    table = compare_table(figures)
    assert table.splitlines()[0].rstrip().endswith(HEADERS[1]) and HEADERS[2] not in table
    assert "\ndiverging requests  " in table


def test_plot_of_a_three_logic_folder(three: tuple[Path, str]) -> None:
    folder, _ = three
    fig = plots.old_vs_new(folder)
    assert len(fig.axes) == 9 and plots.layout_problems(fig) == []
    assert [fig.axes[i].get_title().split(":")[0] for i in range(3)] == list(HEADERS)
    code, out, err = run_cli(["plot", str(folder)])
    assert code == 0, err
    names = [Path(line).name for line in out.splitlines()]
    assert names == ["old_vs_new.png", "ttft_cdf.png", "old-occupancy.png", "old-link_utilisation.png",
                     "new-occupancy.png", "new-link_utilisation.png", "latest-occupancy.png",
                     "latest-link_utilisation.png"]


def test_two_logics_in_another_order(tmp_path: Path) -> None:
    res = compare_runs(DEFAULT, tmp_path / "cmp", ["workload.sessions=3"], jobs=1, logics="latest,old")
    assert res.logics == ("latest", "old") and sorted(res.runs) == ["latest", "old"]
    assert list(res.diverged.columns) == list(diverged_columns("latest", "old"))
    assert sorted(p.name for p in res.path.iterdir()) == [
        "compare.json", "compare.md", "compare.png", "diverged.parquet", "latest", "old"]
    assert res.figures["logics"] == ["latest", "old"] and res.figures["timing"]["jobs"] == 1
    head = compare_table(res.figures).splitlines()[0]
    assert head.index(HEADERS[2]) < head.index(HEADERS[0])
    back = load_compare(res.path)
    assert back.logics == ("latest", "old") and back.diverged_pairs == {}


@pytest.mark.parametrize("value", ["old", "old,old", "old,nwe", "old,new,latest,old", "", "old,,new"])
def test_bad_logics_exit_2_with_one_line(value: str, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(["compare", str(DEFAULT), "--logics", value, "--out", str(out), "-q"])
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and "--logics" in err and "old,new,latest" in err
    assert not out.exists()


def test_parse_logics() -> None:
    assert parse_logics("old, new,latest") == ("old", "new", "latest")
    assert parse_logics(["new", "latest"]) == ("new", "latest")
    with pytest.raises(InputError, match="--logics"):
        parse_logics(["new"])


def test_bad_jobs_exit_2(tmp_path: Path) -> None:
    code, stdout, err = run_cli(["compare", str(DEFAULT), "--jobs", "0", "--out", str(tmp_path / "c"), "-q"])
    assert code == 2 and stdout == "" and err.count("\n") == 1 and "--jobs" in err


@pytest.mark.parametrize(("a", "b", "how"), [
    ({"status": "finished", "crash": None, "cpu_hit_tokens": 96},
     {"status": "finished", "crash": "missing_chunk", "cpu_hit_tokens": 96},
     "NEW loaded 96 tokens, LATEST crashed (missing_chunk)"),
    ({"status": "finished", "deferrals": 0}, {"status": "finished", "deferrals": 2},
     "LATEST deferred 2 times"),
    ({"status": "absent"}, {"status": "finished"}, "only in LATEST (finished); NEW never recorded it"),
])
def test_how_names_the_compared_logics(a: dict[str, Any], b: dict[str, Any], how: str) -> None:
    assert describe_divergence(a, b, ("NEW", "LATEST")) == how


def test_check_prints_the_latest_line_of_a_both_file() -> None:
    case = ROOT / "scenarios" / "crash" / "e04-extra-retained-tokens-swa7-missing.toml"
    text = case.read_text()
    assert 'window_logic = "both"' in text or "window_logic" not in text
    assert "[expect.latest]" in text
    code, out, err = run_cli(["check", str(case)])
    assert code == 0, err
    logics = [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "] " in line]
    assert logics == ["old", "new", "latest"]
    assert out.splitlines()[-1].endswith("  ok")
    # --json is unchanged: the outcomes of OLD and NEW only
    code, out, _ = run_cli(["check", str(case), "--json"])
    assert code == 0 and sorted(json.loads(out)) == ["new", "old"]
