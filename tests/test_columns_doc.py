"""The data dictionary (docs/columns.md): every table column, summary.json key and sweep column
has a unit and a meaning in the code, and the file is what `python -m sim.io.columns` writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import sim
from sim.cli import main
from sim.engine.metrics import COLUMN_DOCS, OPTIONAL_TABLES, TABLES
from sim.io import columns
from sim.io.columns import (
    COUNT_NAMES,
    RESOLVED_DOCS,
    RUN_KEY_DOCS,
    SUMMARY_KEYS,
    SWEEP_HEAD_DOCS,
    flat_columns,
    render,
)
from sim.io.results import arrow_schema
from sim.tools.sweep import HEAD_COLUMNS, RESOLVED_COLUMNS, build_table, read_sweep
from tests.helpers import ROOT

DOC = ROOT / "docs" / "columns.md"
DEFAULT = ROOT / "scenarios" / "default.toml"


def test_every_table_column_is_described():
    assert set(COLUMN_DOCS) == set(TABLES)
    for table, cols in TABLES.items():
        assert list(COLUMN_DOCS[table]) == [c for c, _ in cols], table
        for col, (unit, meaning) in COLUMN_DOCS[table].items():
            assert unit and meaning.strip(), f"{table}.{col}"


def _keys(summary: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of summary.json; a table of counts is one key."""
    out = []
    for k, v in summary.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in COUNT_NAMES:
            out += _keys(v, key + ".")
        else:
            out.append(key)
    return out


@pytest.fixture(scope="module")
def summaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The summary.json of a real ok run and of a failed one."""
    import sim.engine.loop
    import sim.tools.run

    base = tmp_path_factory.mktemp("doc")
    assert main(["run", str(DEFAULT), "--out", str(base / "ok"), "--set", "workload.sessions=3", "-q"]) == 0

    def broken(*args: object, **kwargs: object) -> object:
        raise sim.engine.loop.InvariantViolation("boom")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sim.tools.run, "simulate", broken)
        assert main(["run", str(DEFAULT), "--out", str(base / "failed"), "--set", "workload.sessions=3",
                     "-q"]) == 1
    return {name: json.loads((base / name / "summary.json").read_text()) for name in ("ok", "failed")}


def test_every_summary_key_is_described(summaries: dict[str, dict[str, Any]]):
    for name, summary in summaries.items():
        missing = [k for k in _keys(summary) if k not in SUMMARY_KEYS]
        assert not missing, f"{name} run: summary.json keys without a description in SUMMARY_KEYS: {missing}"
    for key, doc in SUMMARY_KEYS.items():
        assert doc.type in ("int", "int?", "float", "float?", "str", "bool", "counts", "list"), key
        assert doc.unit and doc.meaning.strip(), key
        assert doc.type != "counts" or COUNT_NAMES[key], key


def test_every_sweep_and_long_table_column_is_described(summaries: dict[str, dict[str, Any]],
                                                        tmp_path: Path):
    f = tmp_path / "s.toml"
    f.write_text('schema = "sweep/1"\n[model]\nname = "hybrid-demo"\n[hardware]\ngpu_kv_bytes = "1GiB"\n'
                 '[cpu_cache]\ncapacity = "1GiB"\n[workload]\nkind = "uniform"\nrequests = 3\n'
                 '[sweep]\ngrid = { "cpu_cache.policy" = ["lru", "arc"] }\n')
    sweep = read_sweep(f)
    table = build_table(sweep, {0: summaries["ok"], 1: {"status": "failed", "error": "boom"}})
    documented = {*SWEEP_HEAD_DOCS, *RESOLVED_DOCS, *flat_columns(), *sweep.keys}
    assert [c for c in table.column_names if c not in documented] == []
    assert tuple(SWEEP_HEAD_DOCS) == HEAD_COLUMNS and tuple(RESOLVED_DOCS) == RESOLVED_COLUMNS
    # the long tables' identity columns too
    names = set(RUN_KEY_DOCS) | set(RESOLVED_DOCS)
    ok = tmp_path / "ok"
    ok.mkdir()
    (ok / "summary.json").write_text(json.dumps(summaries["ok"]))
    for name in TABLES:   # an ok run writes every table (load_runs refuses one without its requests)
        if name not in OPTIONAL_TABLES:
            pq.write_table(arrow_schema(name).empty_table(), ok / f"{name}.parquet")
    long = sim.load_runs([ok])
    assert [c for c in long.columns if c not in names and c not in COLUMN_DOCS["requests"]] == []
    assert [c for c in sim.summaries([ok]).columns if c not in names and c not in flat_columns()] == []


def test_docs_columns_md_is_current():
    assert DOC.read_text(encoding="utf-8") == render(), \
        "docs/columns.md is not current: run `python -m sim.io.columns`"
    assert columns.main(["--check", str(DOC)]) == 0
    for table, cols in TABLES.items():
        assert f"### `{table}`" in render()
        for col, _ in cols:
            assert f"| `{col}` |" in render(), f"{table}.{col}"
    assert "(metrics.md)" in render()


def test_the_check_fails_on_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    stale = tmp_path / "columns.md"
    stale.write_text(render().replace("`ttft_s_p50`", "`ttft_s.p50`"))
    assert columns.main(["--check", str(stale)]) == 1
    assert "not current" in capsys.readouterr().err
    assert columns.main([str(stale)]) == 0 and stale.read_text() == render()
