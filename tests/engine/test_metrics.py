"""Recorder batching, percentiles, summary figures, error round trip."""

from __future__ import annotations

import pytest

from sim.engine.metrics import (
    OPTIONAL_TABLES,
    ROW_TYPES,
    TABLES,
    EventRow,
    MemorySink,
    Recorder,
    RunSummary,
    percentile,
)
from sim.errors import InputError


def test_recorder_flushes_in_batches_and_keeps_order() -> None:
    writes: list[tuple[str, int]] = []

    class Spy(MemorySink):
        def write(self, table: str, columns: dict[str, list[object]]) -> None:
            writes.append((table, len(columns["t_s"])))
            super().write(table, columns)

    sink = Spy()
    rec = Recorder(sink, batch_rows=3)
    for i in range(7):
        rec.add(EventRow(float(i), "crash", "missing_chunk", f"r{i}", 1, 2, "m"))
    assert writes == [("events", 3), ("events", 3)]
    rec.flush()
    assert writes[-1] == ("events", 1)
    ev = sink.frames()["events"]
    assert list(ev.columns) == [c for c, _ in TABLES["events"]]
    assert list(ev.t_s) == [float(i) for i in range(7)]
    assert rec.rows_written["events"] == 7


def test_recorder_rejects_a_plain_tuple() -> None:
    rec = Recorder(MemorySink(), batch_rows=1)
    with pytest.raises(TypeError, match="not a row"):
        rec.add((0.0, "crash"))  # type: ignore[arg-type]


def test_tables_follow_the_row_types() -> None:
    """The schema is the row types' fields, typed by their annotations."""
    assert list(TABLES) == ["requests", "steps", "transfers", "occupancy", "events", "tiers"]
    assert {"tiers"} == OPTIONAL_TABLES          # written only by runs with secondary tiers
    assert dict(TABLES["tiers"])["capacity_chunks"] == "int?"
    for table, row in ROW_TYPES.items():
        assert [c for c, _ in TABLES[table]] == list(row._fields)
    assert TABLES["events"] == (("t_s", "float"), ("kind", "str"), ("detail", "str"), ("req_id", "str?"),
                                ("group", "int"), ("chunk", "int"), ("message", "str"))
    assert dict(TABLES["requests"])["scheduled_s"] == "float?"
    assert dict(TABLES["transfers"])["flushed"] == "bool"


def test_percentile_interpolates_like_numpy_linear() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile([], 50) is None


def test_summary_rates() -> None:
    s = RunSummary(prompt_tokens=1000, gpu_hit_tokens=100, cpu_hit_tokens=300, cpu_reload_tokens=100,
                   computed_tokens=600, requests_finished=4, output_tokens=40, sim_time_s=8.0,
                   h2d_busy_s=2.0, ttft_s=[1.0, 2.0, 3.0, 4.0])
    f = s.figures()
    assert f["gpu_hit_rate"] == 0.1 and f["cpu_hit_rate"] == 0.3
    assert f["recompute_saved"] == 400 / 1000
    assert f["throughput"] == {"requests_per_s": 0.5, "output_tokens_per_s": 5.0}
    assert f["transfers"]["h2d_utilisation"] == 0.25
    assert f["ttft_s"]["p50"] == 2.5
    empty = RunSummary().figures()
    assert empty["recompute_saved"] == 0.0 and empty["throughput"]["requests_per_s"] is None


def test_input_error_survives_being_rebuilt_from_its_args() -> None:
    """SimPy re-raises a process's exception as ``type(e)(*e.args)``."""
    e = InputError("trace.jsonl", "line 3", "bad JSON", "one JSON object per line")
    again = type(e)(*e.args)
    assert str(again) == str(e) == "trace.jsonl:line 3: bad JSON; allowed: one JSON object per line"
    assert (again.source, again.key) == ("trace.jsonl", "line 3")
