"""The run folder: Parquet sink, atomic writer, reading a run back (no engine needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import sim
from sim.engine.metrics import (
    OPTIONAL_TABLES,
    ROW_TYPES,
    TABLES,
    EventRow,
    Recorder,
    RunSummary,
    TierOccupancyRow,
    TransferRow,
)
from sim.errors import InputError
from sim.io import results
from sim.io.results import (
    ParquetSink,
    RunWriter,
    arrow_schema,
    load_results,
    summary_table,
    write_json_atomic,
)
from tests.helpers import ROOT


def _fill(folder: Path, n: int = 5, batch_rows: int = 2) -> None:
    sink = ParquetSink(folder)
    rec = Recorder(sink, batch_rows=batch_rows)
    for i in range(n):
        rec.add(EventRow(0.5 * i, "crash", "missing_chunk", None if i % 2 else f"r{i}", 1, i, "m"))
        rec.add(TransferRow(i, f"r{i}", "h2d", 2, 8, 4096 * i, 0.1 * i, 0.1 * i, 0.2 * i, i == 3))
    rec.flush()
    sink.close()


def test_parquet_output_is_byte_identical(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _fill(a)
    _fill(b)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(f"{t}.parquet" for t in TABLES if t not in OPTIONAL_TABLES)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_every_table_is_written_with_its_schema_even_when_empty(tmp_path: Path):
    _fill(tmp_path)
    for table, cols in TABLES.items():
        if table in OPTIONAL_TABLES:
            assert not (tmp_path / f"{table}.parquet").exists()    # no rows: no file
            continue
        t = pq.read_table(tmp_path / f"{table}.parquet")
        assert t.schema.names == [c for c, _ in cols]
        assert t.schema == arrow_schema(table)
    assert pq.read_table(tmp_path / "steps.parquet").num_rows == 0
    assert pq.read_table(tmp_path / "events.parquet").num_rows == 5


def test_an_optional_table_with_rows_is_written_and_read_back(tmp_path: Path):
    sink = ParquetSink(tmp_path)
    rec = Recorder(sink)
    rec.add(TierOccupancyRow(1.0, "1:nvme", 3, 1, 0, 4, 10))
    rec.add(TierOccupancyRow(1.0, "2:fs", 2, 0, 1, 3, None))     # unbounded: null capacity
    rec.flush()
    sink.close()
    t = pq.read_table(tmp_path / "tiers.parquet")
    assert t.schema == arrow_schema("tiers")
    assert t.column("capacity_chunks").to_pylist() == [10, None]


def test_arrow_types_follow_the_table_types():
    s = arrow_schema("requests")
    assert str(s.field("req_id").type) == "string" and not s.field("req_id").nullable
    assert s.field("session_id").nullable
    assert str(s.field("prompt_tokens").type) == "int64"
    assert str(s.field("first_token_s").type) == "double" and s.field("first_token_s").nullable
    assert str(arrow_schema("transfers").field("flushed").type) == "bool"


def test_null_in_a_non_nullable_column_is_refused(tmp_path: Path):
    sink = ParquetSink(tmp_path)
    row = dict(zip([c for c, _ in TABLES["events"]], [[0.0], [None], ["x"], [None], [1], [2], ["m"]],
                   strict=True))
    with pytest.raises(Exception, match=r"null|None|non-nullable"):
        sink.write("events", row)


def _write_run(target: Path, overwrite: bool = False, status: str = "ok") -> Path:
    w = RunWriter(target, overwrite)
    folder = w.start()
    assert folder.name == f".{target.name}.tmp-{os.getpid()}" and folder.parent == target.parent
    _fill(folder)
    summary = RunSummary().figures() if status == "ok" else {"error": "RuntimeError: boom"}
    return w.finish(status, summary, 'schema = "run/1"\nseed = 3\n', {"wall_clock_s": 1.5, "argv": ["x"]})


def test_run_writer_writes_the_folder_and_leaves_no_temp(tmp_path: Path):
    target = tmp_path / "results" / "demo"
    assert _write_run(target) == target
    names = sorted(p.name for p in target.iterdir())
    assert names == sorted([f"{t}.parquet" for t in TABLES if t not in OPTIONAL_TABLES]
                           + ["summary.json", "scenario.toml", "run_info.json"])
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["demo"]  # no .tmp / .old left
    summary = json.loads((target / "summary.json").read_text())
    assert summary["status"] == "ok"
    text = (target / "summary.json").read_text()
    assert text == json.dumps(summary, sort_keys=True, indent=2) + "\n"


@pytest.mark.parametrize("overwrite", [False, True])
def test_run_writer_refuses_a_non_empty_foreign_target(tmp_path: Path, overwrite: bool):
    """Without --overwrite any non-empty folder is refused; with it, one kvsim did not write."""
    target = tmp_path / "demo"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(InputError) as info:
        RunWriter(target, overwrite=overwrite)
    assert info.value.source == str(target)
    if overwrite:
        assert "'keep.txt'" in info.value.problem and "not a kvsim results folder" in info.value.problem
    else:
        assert "--overwrite" in info.value.allowed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
    assert (target / "keep.txt").read_text() == "mine"


def test_run_writer_accepts_an_empty_target_and_overwrites(tmp_path: Path):
    target = tmp_path / "demo"
    target.mkdir()
    _write_run(target)
    (target / "extra.txt").write_text("old")
    _write_run(target, overwrite=True)
    assert not (target / "extra.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_run_writer_overwrites_only_what_kvsim_wrote(tmp_path: Path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("keep")
    RunWriter(mine, overwrite=True, replace_any=True)   # a sweep's own point folders
    leftovers = tmp_path / "only-leftovers"
    leftovers.mkdir()
    (leftovers / ".x.tmp-1").mkdir()
    RunWriter(leftovers, overwrite=True)   # nothing of the user's in it
    for kind, name in results.RESULT_MARKERS.items():
        folder = tmp_path / kind
        folder.mkdir()
        (folder / name).touch()
        (folder / "more").touch()
        assert results.result_kind(folder) == kind
        RunWriter(folder, overwrite=True)


def test_run_writer_refuses_a_file_target(tmp_path: Path):
    (tmp_path / "demo").write_text("x")
    with pytest.raises(InputError):
        RunWriter(tmp_path / "demo", overwrite=True)


def test_failed_status_is_written(tmp_path: Path):
    target = _write_run(tmp_path / "demo", status="failed")
    summary = json.loads((target / "summary.json").read_text())
    assert summary == {"error": "RuntimeError: boom", "status": "failed"}
    res = load_results(target)
    assert res.summary["status"] == "failed"


def test_abort_removes_the_temp_folder(tmp_path: Path):
    w = RunWriter(tmp_path / "demo")
    w.start()
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_load_results_returns_frames(tmp_path: Path):
    target = _write_run(tmp_path / "demo")
    res = sim.load_results(target)
    for table, cols in TABLES.items():
        frame = getattr(res, table)
        assert list(frame.columns) == [c for c, _ in cols], table
    assert len(res.events) == 5 and len(res.steps) == 0
    assert res.events["req_id"].isna().sum() == 2
    assert res.transfers["flushed"].tolist() == [False, False, False, True, False]
    assert res.scenario == {"schema": "run/1", "seed": 3}
    assert res.run_info["wall_clock_s"] == 1.5
    assert res.summary["status"] == "ok"


def test_load_results_of_a_missing_table_is_empty_unless_the_run_is_ok(tmp_path: Path):
    target = _write_run(tmp_path / "demo", status="failed")   # a failed run may have written none
    (target / "occupancy.parquet").unlink()
    res = load_results(target)
    assert list(res.occupancy.columns) == [c for c, _ in TABLES["occupancy"]] and res.occupancy.empty
    ok = _write_run(tmp_path / "ok")
    (ok / "occupancy.parquet").unlink()
    with pytest.raises(InputError) as info:   # an ok run writes every table: this one is damaged
        load_results(ok)
    assert info.value.source == str(ok / "occupancy.parquet")


def test_load_results_refuses_a_non_run_folder(tmp_path: Path):
    with pytest.raises(InputError, match=r"summary\.json"):
        load_results(tmp_path)


def test_write_json_atomic_sorted_and_no_temp(tmp_path: Path):
    p = tmp_path / "x.json"
    write_json_atomic(p, {"b": 1, "a": [1, 2]})
    assert p.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    assert [q.name for q in tmp_path.iterdir()] == ["x.json"]


def test_summary_table_has_every_figure(tmp_path: Path):
    s = RunSummary(requests_arrived=3, requests_finished=2, prompt_tokens=100, cpu_hit_tokens=25,
                   loaded_bytes=3 * 2**30, crashes=1, crash_kinds={"missing_chunk": 1}, first_crash_s=1.25,
                   sim_time_s=10.0, ttft_s=[0.1, 0.2], tpot_s=[0.01])
    text = summary_table({**s.figures(), "status": "ok", "end": "ok"}, tmp_path)
    for label in ("requests finished / arrived", "GPU hit rate", "CPU hit rate", "recompute saved",
                  "TTFT p50 / p90 / p99", "TPOT mean / p50", "throughput", "bytes moved H2D / D2H",
                  "link utilisation H2D / D2H", "preemptions", "deferrals", "crashes", "hazards", "results"):
        assert label in text, label
    assert "2 / 3" in text and "25.0%" in text and "3.00 GiB" in text
    assert "missing_chunk 1; first at 1.250 s" in text
    assert str(tmp_path) in text
    failed = summary_table({"status": "failed", "error": "RuntimeError: boom"})
    assert "FAILED" in failed and "boom" in failed


def test_import_sim_stays_light():
    code = ("import sys, sim; heavy = [m for m in ('pandas', 'pyarrow', 'pydantic', 'simpy', 'matplotlib') "
            "if m in sys.modules]; print(heavy); assert callable(sim.load_results)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _rows_of_every_type(n: int) -> list[object]:
    """``n`` rows of every table, each column filled by its type (nulls, ints in
    float columns and 64-bit ints included)."""

    def value(kind: str, i: int) -> object:
        if kind.endswith("?") and i % 3 == 1:
            return None
        base = kind.rstrip("?")
        if base == "float":
            return i if i % 2 else i * 1.25 - 1e9   # an int in a float column stays a float
        if base == "int":
            return i * 2**40 - 7
        if base == "bool":
            return i % 2 == 0
        return f"v{i}"

    return [ROW_TYPES[t](*(value(kind, i) for _, kind in TABLES[t])) for t in TABLES for i in range(n)]


def test_parquet_from_typed_buffers_is_byte_identical_to_parquet_from_lists(tmp_path: Path) -> None:
    """The recorder hands ParquetSink its int and float columns as typed arrays
    (``takes_buffers``); the files must be the bytes the lists would give."""

    class ListSink(ParquetSink):
        takes_buffers = False

    folders = {}
    for name, cls in (("buffers", ParquetSink), ("lists", ListSink)):
        folder = tmp_path / name
        folder.mkdir()
        sink = cls(folder)
        rec = Recorder(sink, batch_rows=4)
        for row in _rows_of_every_type(11):     # 2 full batches and a partial one per table
            rec.add(row)  # type: ignore[arg-type]
        rec.flush()
        sink.close()
        folders[name] = folder
    assert Recorder(ParquetSink(tmp_path))._buffers and not Recorder(ListSink(tmp_path))._buffers
    for table in TABLES:
        a = (folders["buffers"] / f"{table}.parquet").read_bytes()
        assert a == (folders["lists"] / f"{table}.parquet").read_bytes(), table
        assert pq.read_table(folders["buffers"] / f"{table}.parquet").num_rows == 11


def test_durations_on_one_line_keep_one_unit():
    """A run's TTFT p50 / p90 / p99 once read ``8173.2 ms / 31.76 s / 44.67 s``: one line, one unit."""
    assert results.duration_text(8.1732) == "8173.2 ms" and results.duration_text(31.76) == "31.76 s"
    assert results.durations_text([8.1732, 31.76, 44.67]) == "8.17 s / 31.76 s / 44.67 s"
    assert results.durations_text([0.0375, 0.0536, 0.0611]) == "37.5 ms / 53.6 ms / 61.1 ms"
    assert results.durations_text([None, 12.0], missing="never") == "never / 12.00 s"
    assert results.durations_text([None, None]) == "- / -"
