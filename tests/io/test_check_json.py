"""The check format's JSON: ``sim.io.check.json_dumps`` writes a batch's results with
orjson (about 9x the standard library here) and falls back to the standard library where
orjson cannot write, so a batch's output reads back as exactly what ``json.dumps`` would
have written (up to whitespace); a check file nested too deeply for the standard library's
reader is one clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.errors import InputError
from sim.io.check import json_dumps, load_check_file, prepare_check

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
           | st.floats(allow_nan=False, allow_infinity=False))
values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=20)


@given(values)
def test_reads_back_as_the_standard_librarys_output(obj: Any) -> None:
    assert json.loads(json_dumps(obj)) == json.loads(json.dumps(obj))


def test_the_output_is_compact_and_falls_back_for_huge_integers() -> None:
    assert json_dumps({"a": [1, 2], 3: None}) == '{"a":[1,2],"3":null}'
    assert json_dumps([2**80, -(2**70)]) == f"[{2**80},{-(2**70)}]"


@pytest.mark.parametrize("jsonl", [False, True])
def test_a_file_nested_too_deeply_is_one_clear_error(tmp_path: Path, jsonl: bool) -> None:
    f = tmp_path / ("deep.jsonl" if jsonl else "deep.json")
    f.write_text("[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    with pytest.raises(InputError, match="nested too deeply"):   # the whole file (no line is JSON)
        load_check_file(f, jsonl=jsonl)
    if jsonl:   # one line of a batch: that item's error, the others run
        f.write_text('{"schema": "check/1"}\n' + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
        _, items = load_check_file(f, jsonl=True)
        assert items == [{"schema": "check/1"}, {"__error__": f"{f}:line 2: bad JSON: nested too deeply"}]


@pytest.mark.parametrize("name", ["bin.toml", "bin.json", "bin.jsonl"])
def test_a_file_that_is_not_utf8_is_one_clear_error(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_bytes(b"\xff\xfe\x00x")
    with pytest.raises(InputError, match="cannot read: 'utf-8' codec") as info:
        load_check_file(f, jsonl=name.endswith(".jsonl"))
    assert "UTF-8" in info.value.allowed


def test_a_toml_file_read_as_json_lines_is_one_error_a_missing_schema_says_so(tmp_path: Path) -> None:
    f = tmp_path / "case.toml"
    f.write_text('schema = "check/1"\nwindow_logic = "new"\n', encoding="utf-8")
    with pytest.raises(InputError, match="no line of the file is JSON") as info:
        load_check_file(f, jsonl=True)
    assert info.value.key == "line 1"
    empty = tmp_path / "empty.toml"
    empty.write_text("", encoding="utf-8")
    _, items = load_check_file(empty)
    with pytest.raises(InputError) as missing:
        prepare_check(items[0], str(empty))
    assert (missing.value.key, missing.value.problem) == ("schema", "missing")
