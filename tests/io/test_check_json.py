"""The check format's JSON reader and writer (``sim.io.check.json_loads`` / ``json_dumps``):
orjson for speed, and the standard library's answers wherever orjson refuses, so a batch
reads and writes exactly what ``json`` would (up to whitespace in the output)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.errors import InputError
from sim.io.check import json_dumps, json_loads, load_check_file

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
           | st.floats(allow_nan=False, allow_infinity=False))
values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=20)


@given(values)
def test_the_same_objects_as_the_standard_library(obj: Any) -> None:
    text = json.dumps(obj)
    assert json_loads(text) == json.loads(text)
    assert json.loads(json_dumps(obj)) == json.loads(text)


@pytest.mark.parametrize("text", ["[NaN, Infinity]", '{"a": 1, "a": 2}',
                                  "[18446744073709551616, -9223372036854775809]",
                                  '"\\ud800"', "[" * 900 + "]" * 900])
def test_what_orjson_refuses_the_standard_library_reads(text: str) -> None:
    expected = json.loads(text)
    got = json_loads(text)
    assert json.dumps(got) == json.dumps(expected)


@pytest.mark.parametrize("text", ["[1, 2", "{'a': 1}", "", "[1,]"])
def test_bad_json_raises_the_standard_librarys_error(text: str) -> None:
    with pytest.raises(json.JSONDecodeError) as ours:
        json_loads(text)
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(text)
    assert (ours.value.msg, ours.value.lineno, ours.value.colno) == \
        (theirs.value.msg, theirs.value.lineno, theirs.value.colno)


def test_the_output_is_compact_and_falls_back_for_huge_integers() -> None:
    assert json_dumps({"a": [1, 2], 3: None}) == '{"a":[1,2],"3":null}'
    assert json_dumps([2**80]) == f"[{2**80}]"


@pytest.mark.parametrize("jsonl", [False, True])
def test_a_file_nested_too_deeply_is_one_clear_error(tmp_path: Path, jsonl: bool) -> None:
    f = tmp_path / ("deep.jsonl" if jsonl else "deep.json")
    f.write_text("[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    if jsonl:
        _, items = load_check_file(f, jsonl=True)
        assert items == [{"__error__": f"{f}:line 1: bad JSON: nested too deeply"}]
    else:
        with pytest.raises(InputError, match="nested too deeply"):
            load_check_file(f)
