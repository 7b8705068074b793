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
from sim.io.check import json_dumps, load_check_file

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
    if jsonl:
        _, items = load_check_file(f, jsonl=True)
        assert items == [{"__error__": f"{f}:line 1: bad JSON: nested too deeply"}]
    else:
        with pytest.raises(InputError, match="nested too deeply"):
            load_check_file(f)
