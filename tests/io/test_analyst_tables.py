"""Tables for analysts (docs/columns.md): `sim.load_runs`, `sim.summaries`, the sweep table's
column names and types, `SweepResults.requests()` and `.run(point)`, older sweep folders read
back, and `kvsim export` (CSV beside the Parquet files)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sim
from sim.cli import main
from sim.engine.metrics import OPTIONAL_TABLES, TABLES
from sim.errors import InputError
from sim.io.results import load_results
from sim.tools.sweep import HEAD_COLUMNS, RESOLVED_COLUMNS, SweepResults, read_sweep, run_sweep
from tests.helpers import ROOT, SWEEP_POLICIES

DEFAULT = ROOT / "scenarios" / "default.toml"
SMALL = ["--set", "workload.sessions=10", "-q"]
KEYS = ["run_id", "run_dir", "name", "run_status", *RESOLVED_COLUMNS]
SWEEP = SWEEP_POLICIES


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("runs")
    a, b = base / "a", base / "b"
    assert main(["run", str(DEFAULT), "--out", str(a), *SMALL]) == 0
    assert main(["run", str(DEFAULT), "--out", str(b), *SMALL, "--logic", "old", "--seed", "3",
                 "--set", 'cpu_cache.capacity="16GiB"', "--set", 'cpu_cache.policy="arc"']) == 0
    return [a, b]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("sweep")
    (base / "s.toml").write_text(SWEEP)
    report = run_sweep(read_sweep(base / "s.toml"), base / "out", jobs=1)
    assert report.failed == [] and report.ran == 2
    return base / "out"


# -- 6b: many runs as one table ---------------------------------------------------------------------


def test_load_runs_is_one_long_table_with_the_runs_keys(runs: list[Path]):
    df = sim.load_runs(runs)
    requests = [load_results(r).requests for r in runs]
    assert list(df.columns) == KEYS + [c for c, _ in TABLES["requests"]]
    assert len(df) == sum(len(r) for r in requests)
    first = df[df["run_id"] == "a"]
    second = df[df["run_id"] == "b"]
    assert list(first["req_id"]) == list(requests[0]["req_id"])
    assert set(first["window_logic"]) == {"new"} and set(second["window_logic"]) == {"old"}
    assert set(first["seed"]) == {0} and set(second["seed"]) == {3}
    assert set(second["cpu_cache_bytes"]) == {16 << 30} and set(second["cpu_cache_policy"]) == {"arc"}
    assert set(df["model"]) == {"hybrid-demo"} and set(df["hardware"]) == {"h200"}
    assert set(df["workload"]) == {"multiturn"} and set(df["run_status"]) == {"ok"}
    assert set(df["run_dir"]) == {str(r) for r in runs} and set(df["name"]) == {"default"}
    # the per-request figures analysts ask for are there, as in requests.parquet
    for col in ("ttft_s", "tpot_s", "deferrals_in_flight_jobs", "deferrals_pending_or_retry",
                "deferrals_being_loaded", "deferred_s"):
        np.testing.assert_array_equal(first[col].to_numpy(), requests[0][col].to_numpy())
    assert df["seed"].dtype == np.int64 and df["cpu_cache_bytes"].dtype == np.int64
    # one path, or none
    assert len(sim.load_runs(runs[0])) == len(requests[0])
    empty = sim.load_runs([])
    assert empty.empty and list(empty.columns) == list(df.columns)


def test_load_runs_refuses_a_folder_that_is_not_a_run(tmp_path: Path, runs: list[Path]):
    with pytest.raises(InputError, match="not a run folder"):
        sim.load_runs([runs[0], tmp_path])
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(InputError, match="not a readable JSON file"):
        sim.summaries([tmp_path])


def test_summaries_one_row_per_run_named_as_the_sweep_table(runs: list[Path], sweep_dir: Path):
    df = sim.summaries(runs)
    assert len(df) == 2 and list(df["run_id"]) == ["a", "b"]
    assert list(df.columns[:5]) == ["run_id", "run_dir", "name", "status", "error"]
    assert list(df.columns[5:15]) == list(RESOLVED_COLUMNS)
    summary = json.loads((runs[1] / "summary.json").read_text())
    row = df.iloc[1]
    assert row["requests_finished"] == summary["requests"]["finished"]
    assert row["ttft_s_p50"] == summary["ttft_s"]["p50"]
    assert row["load_peak_waiting"] == summary["load"]["peak_waiting"]
    assert row["window_logic"] == "old" and row["status"] == "ok" and row["error"] == ""
    assert df["overloaded"].dtype == bool and df["load_overloaded"].dtype == bool
    assert (df["crashes_kinds_missing_chunk"] == 0).all() and (df["hardware_warnings_count"] == 0).all()
    # the same summary columns, in the same order, as sweep.parquet
    table = sim.load_sweep(sweep_dir).table
    start = list(table.columns).index("seed") + 1
    assert list(df.columns[15:]) == list(table.columns[start:])


# -- 6c: sweep.parquet columns ----------------------------------------------------------------------


def _summary_columns(table: pd.DataFrame) -> list[str]:
    return list(table.columns[list(table.columns).index("seed") + 1:])


def test_sweep_columns_have_underscores_and_proper_types(sweep_dir: Path):
    res = sim.load_sweep(sweep_dir)
    t = res.table
    assert list(t.columns[:5]) == list(HEAD_COLUMNS) and res.swept == ["cpu_cache.policy"]
    summary_cols = _summary_columns(t)
    assert not [c for c in summary_cols if "." in c]
    for col in ("ttft_s_p50", "requests_finished", "tokens_cpu_hit", "overloaded", "load_overloaded",
                "load_queue_trend", "load_offered_requests_per_s", "engine_deferral_reasons_being_loaded",
                "engine_deferral_reasons_in_flight_jobs", "crashes_kinds_missing_chunk",
                "hazards_kinds_double_load", "hardware_warnings_count", "hardware_warnings"):
        assert col in summary_cols, col
    assert t["overloaded"].dtype == bool and t["load_overloaded"].dtype == bool
    assert t["requests_finished"].dtype == np.int64 and t["crashes_kinds_assertion"].dtype == np.int64
    assert t["ttft_s_p50"].dtype == np.float64
    # no JSON text anywhere
    for col in t.columns:
        if t[col].dtype == object or pd.api.types.is_string_dtype(t[col]):
            assert not t[col].astype(str).str.match(r"^[\[{]").any(), col
    # a point's row is its folder's summary, flattened
    runs = sim.summaries([sweep_dir / d for d in t["run_dir"]])
    pd.testing.assert_frame_equal(t[summary_cols].reset_index(drop=True), runs[summary_cols])


def _old_flat(summary: dict[str, Any]) -> dict[str, Any]:
    """How sweep.parquet was flattened before: dotted names, deeper tables and lists as JSON."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        if key in ("status", "error", "run"):
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                out[f"{key}.{k}"] = json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else v
        elif isinstance(value, list):
            out[key] = json.dumps(value, sort_keys=True)
        else:
            out[key] = value
    return out


def test_an_older_sweep_folder_reads_with_todays_columns(sweep_dir: Path, tmp_path: Path):
    new = sim.load_sweep(sweep_dir).table
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    head = new[[c for c in new.columns if c not in _summary_columns(new)]]
    flats = [_old_flat(json.loads((sweep_dir / d / "summary.json").read_text())) for d in new["run_dir"]]
    flats[1]["hardware_warnings"] = json.dumps(["CPU cache beyond the node's RAM"])
    old = pd.concat([head, pd.DataFrame(flats)[sorted({k for f in flats for k in f})]], axis=1)
    assert "ttft_s.p50" in old.columns and old["crashes.kinds"][0] == "{}"
    pq.write_table(pa.Table.from_pandas(old, preserve_index=False), old_dir / "sweep.parquet")
    back = sim.load_sweep(old_dir).table
    assert back["hardware_warnings_count"].tolist() == [0, 1]
    back = back.drop(columns=["hardware_warnings_count", "hardware_warnings"])
    pd.testing.assert_frame_equal(back, new.drop(columns=["hardware_warnings_count", "hardware_warnings"]))


# -- 6b, 6e: a sweep's requests, a point by any integer ----------------------------------------------


def test_sweep_requests_is_one_long_table_with_the_point_keys(sweep_dir: Path):
    res = sim.load_sweep(sweep_dir)
    df = res.requests()
    head = ["point", "run_id", "run_dir", "run_status", "cpu_cache.policy", *RESOLVED_COLUMNS]
    assert list(df.columns) == head + [c for c, _ in TABLES["requests"]]
    per_point = [res.run(i).requests for i in range(2)]
    assert len(df) == sum(len(r) for r in per_point)
    assert df.groupby("point")["cpu_cache.policy"].first().tolist() == ["lru", "arc"]
    assert df.groupby("point")["cpu_cache_policy"].first().tolist() == ["lru", "arc"]
    one = df[df["point"] == 1]
    np.testing.assert_array_equal(one["ttft_s"].to_numpy(), per_point[1]["ttft_s"].to_numpy())
    # a failed point is left out unless asked for
    t = res.table.copy()
    t.loc[0, "status"] = "failed"
    partial = SweepResults(path=res.path, table=t, spec=res.spec)
    assert set(partial.requests()["point"]) == {1}
    assert set(partial.requests(include_failed=True)["run_status"]) == {"failed", "ok"}


@pytest.mark.parametrize("which", [1, np.int64(1), np.int32(1), np.uint8(1), "1", "001", "001-policy_arc"])
def test_sweep_run_takes_any_integer_or_a_point_id(sweep_dir: Path, which: Any):
    res = sim.load_sweep(sweep_dir)
    assert res.run(which).path == sweep_dir / "points" / "001-policy_arc"


@pytest.mark.parametrize("which", [7, np.int64(-1), "7", "nope", True, 1.0])
def test_sweep_run_refuses_what_is_not_a_point(sweep_dir: Path, which: Any):
    with pytest.raises(KeyError):
        sim.load_sweep(sweep_dir).run(which)


# -- 6d: kvsim export --------------------------------------------------------------------------------


def test_export_writes_csv_beside_the_parquet_files(runs: list[Path], sweep_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]):
    run = runs[0]
    (run / "requests.csv").write_text("stale\n")
    assert main(["export", str(run)]) == 0
    printed = capsys.readouterr().out.split()
    written = [t for t in TABLES if t not in OPTIONAL_TABLES]      # no tiers.parquet without tiers
    assert printed == [str(run / f"{t}.csv") for t in written] + [str(run / "summary.csv")]
    for t in written:
        back = pd.read_csv(run / f"{t}.csv")
        parquet = pq.read_table(run / f"{t}.parquet").to_pandas()
        assert list(back.columns) == list(parquet.columns) and len(back) == len(parquet)
    req = pd.read_csv(run / "requests.csv")
    np.testing.assert_allclose(req["ttft_s"], load_results(run).requests["ttft_s"])
    summary = pd.read_csv(run / "summary.csv")
    assert len(summary) == 1
    assert summary["requests_finished"][0] == sim.summaries([run])["requests_finished"][0]
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]   # no temporary file left

    assert main(["export", str(sweep_dir), "--points"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[0] == str(sweep_dir / "sweep.csv") and len(printed) == 1 + 2 * (len(written) + 1)
    table = pd.read_csv(sweep_dir / "sweep.csv")
    assert list(table.columns) == list(sim.load_sweep(sweep_dir).table.columns)
    assert (sweep_dir / "points" / "000-policy_lru" / "requests.csv").is_file()


def test_export_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["export", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a results folder" in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["summary", "parquet", "missing"])
def test_export_and_plot_of_a_damaged_run_write_nothing(runs: list[Path], tmp_path: Path, damage: str,
                                                       capsys: pytest.CaptureFixture[str]):
    """A corrupt summary, a corrupt table or a table missing from an ok run: one line naming
    the file, exit 2, and no CSV or figure of the command left behind."""

    run = tmp_path / "run"
    shutil.copytree(runs[0], run, ignore=shutil.ignore_patterns("*.csv"))
    bad = {"summary": run / "summary.json", "parquet": run / "occupancy.parquet",
           "missing": run / "requests.parquet"}[damage]
    if damage == "missing":
        bad.unlink()
    else:
        bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])
    before = sorted(p.name for p in run.iterdir())
    for args in (["export", str(run)], ["plot", str(run), "--out", str(tmp_path / "figs")]):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(bad) in err[0], (args, err)
        assert sorted(p.name for p in run.iterdir()) == before
        assert not (tmp_path / "figs").exists()
    if damage == "missing":
        with pytest.raises(InputError, match="missing"):
            load_results(run)


def test_a_run_read_back_shows_as_one_short_line(runs: list[Path]):
    """In a notebook, ``sim.load_results(folder)`` echoes the folder, status and table sizes,
    not every table and the whole summary."""
    r = sim.load_results(runs[0])
    text = repr(r)
    assert "\n" not in text and len(text) < 300
    assert text.startswith(f"RunResults({str(runs[0])!r}, status 'ok'; rows: requests {len(r.requests):,}")
    assert f"steps {len(r.steps):,}" in text


def test_tables_missing_from_ok_runs_are_errors_in_every_loader(runs: list[Path], sweep_dir: Path,
                                                               tmp_path: Path):
    """``load_runs`` and a sweep's ``requests()`` once returned no rows for an ok run whose
    requests table was missing (``load_results`` refused it): a run vanished silently."""

    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    (run / "requests.parquet").unlink()
    with pytest.raises(InputError, match="missing") as info:
        sim.load_runs([runs[1], run])
    assert info.value.source == str(run / "requests.parquet")
    sweep = tmp_path / "sweep"
    shutil.copytree(sweep_dir, sweep)
    point = sweep / str(sim.load_sweep(sweep).table["run_dir"].iloc[1])
    shutil.rmtree(point)   # an ok point's whole folder
    with pytest.raises(InputError, match="missing") as info:
        sim.load_sweep(sweep).requests()
    assert info.value.source == str(point / "requests.parquet")


def test_the_result_objects_compare_and_show_as_a_notebook_expects(runs: list[Path], sweep_dir: Path):
    """``==`` between two loaded results raised pandas' ValueError; a sweep's repr printed
    its table and all of sweep.toml. Identity comparison, and one short line each."""

    a, b = sim.load_results(runs[0]), sim.load_results(runs[0])
    assert a == a and a != b
    sw = sim.load_sweep(sweep_dir)
    assert sw == sw and sw != sim.load_sweep(sweep_dir)
    text = repr(sw)
    assert "\n" not in text and text.startswith(f"SweepResults({str(sweep_dir)!r}, 2 points (2 ok); swept: ")
    # any path-like names one folder (a DirEntry, say), bytes are refused in one line
    entry = next(e for e in os.scandir(runs[0].parent) if e.name == runs[0].name)
    assert len(sim.load_runs(entry)) == len(sim.load_runs(runs[0]))
    with pytest.raises(InputError, match="bytes"):
        sim.load_runs(os.fsencode(runs[0]))


def test_a_table_file_holding_another_table_is_named(runs: list[Path], sweep_dir: Path, tmp_path: Path):
    """A readable Parquet file of the wrong table was taken as the requests (steps' columns
    under ``requests``), and a run's requests as a sweep table (a KeyError later)."""
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    shutil.copy(run / "steps.parquet", run / "requests.parquet")
    for load in (sim.load_results, lambda p: sim.load_runs([p])):
        with pytest.raises(InputError, match="not a requests table") as info:
            load(run)
        assert info.value.source == str(run / "requests.parquet")
    fake = tmp_path / "fake-sweep"
    fake.mkdir()
    shutil.copy(runs[0] / "requests.parquet", fake / "sweep.parquet")
    with pytest.raises(InputError, match="not a sweep table"):
        sim.load_sweep(fake)
    assert len(sim.load_sweep(sweep_dir).requests()) > 0   # the real ones read as before
