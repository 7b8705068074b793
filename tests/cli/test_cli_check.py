"""`kvsim check` and `kvsim regress` from the command line: outputs and exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sim.cli import main
from tests.helpers import ROOT

CRASH = ROOT / "scenarios" / "crash"
S6 = {
    "schema": "check/1", "blocks_per_chunk": 4, "tokens_per_hash": 8, "num_tokens": 4353,
    "groups": [{"kind": "full", "tokens_per_block": 256},
               {"kind": "sliding_window", "tokens_per_block": 64, "window": 128},
               {"kind": "sliding_window", "tokens_per_block": 8, "window": 128}],
    "chunk_states": {"0": {"0..3": "present"}, "1": {"15": "present"},
                     "2": {"118..121": "present"}},
}


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_single_json_both_logics(tmp_path: Path, capsys):
    f = tmp_path / "s6.json"
    f.write_text(json.dumps(S6))
    code, out, _ = run(["check", str(f), "--json"], capsys)
    assert code == 0
    res = json.loads(out)
    assert res["old"]["external_tokens"] == 3904
    assert res["old"]["crash"]["kind"] == "missing_chunk"
    assert (res["old"]["crash"]["group"], res["old"]["crash"]["chunk"]) == (1, 14)
    assert res["old"]["load_async"] is False
    assert res["new"] == {"external_tokens": 0, "load_async": False, "load_keys": [],
                          "group_sizes": [], "block_indices": [], "crash": None, "hazards": []}


def test_the_collector_thresholds_come_back_after_a_batch(tmp_path: Path, capsys):
    # check --json raises the collector's thresholds while it decides a batch (speed);
    # the caller's come back after it, on success and on a failed item alike
    import gc
    before = gc.get_threshold()
    f = tmp_path / "batch.json"
    f.write_text(json.dumps([S6, dict(S6, num_tokens=-5)]))
    code, out, _ = run(["check", str(f), "--json"], capsys)
    assert code == 1 and len(json.loads(out)) == 2
    assert gc.get_threshold() == before


def test_batch_list_keeps_order_and_reports_bad_items_in_place(tmp_path: Path, capsys):
    present = json.loads(json.dumps(S6))
    present["chunk_states"]["1"]["14"] = "present"
    present["window_logic"] = "new"
    bad = dict(S6, num_tokens=-5)
    f = tmp_path / "batch.json"
    f.write_text(json.dumps([S6, bad, present]))
    code, out, _ = run(["check", str(f), "--json"], capsys)
    assert code == 1  # a bad item fails the batch, after every item is reported
    res = json.loads(out)
    assert len(res) == 3
    assert res[0]["new"]["external_tokens"] == 0
    assert "num_tokens" in res[1]["error"]
    assert res[2]["external_tokens"] == 3904 and res[2]["load_async"] is True
    assert res[2]["group_sizes"] == [16, 2, 16] and res[2]["block_indices"] == [0, 59, 472]
    assert [1, 14] in res[2]["load_keys"] and [1, 15] in res[2]["load_keys"]


def test_jsonl_in_and_out(tmp_path: Path, capsys):
    f = tmp_path / "b.jsonl"
    f.write_text(json.dumps(S6) + "\n" + "{not json\n")
    code, out, _ = run(["check", str(f), "--jsonl"], capsys)
    lines = out.strip().splitlines()
    assert code == 1 and len(lines) == 2  # the bad line fails the batch
    assert json.loads(lines[0])["old"]["external_tokens"] == 3904
    assert "line 2" in json.loads(lines[1])["error"]


def test_expectation_mismatch_exits_1_with_a_readable_diff(tmp_path: Path, capsys):
    f = tmp_path / "x.json"
    f.write_text(json.dumps(dict(S6, expect={"new": {"external_tokens": 3904}})))
    code, out, _ = run(["check", str(f)], capsys)
    assert code == 1
    assert "external_tokens: expected 3904, got 0" in out


@pytest.mark.parametrize("patch,where", [
    ({"groups": [{"kind": "full", "tokens_per_block": 12}]}, "groups.0.tokens_per_block"),
    ({"groups": [{"kind": "full", "tokens_per_block": 16, "colour": 1}]}, "groups.0.colour"),
    ({"chunk_states": {"7": {"0": "present"}}}, "chunk_states.7"),
    ({"chunk_states": {"1": {"17": "present"}}}, "chunk_states.1.17"),
    ({"chunk_states": {"1": {"3": "gone"}}}, "chunk_states.1.3"),
    ({"schema": "run/1"}, "schema"),
    ({"gpu_computed_tokens": 100}, "gpu_computed_tokens"),
    ({"cpu_capacity_chunks": 2}, "cpu_capacity_chunks"),
])
def test_bad_input_is_one_located_line_and_exit_2(tmp_path: Path, capsys, patch, where):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(dict(S6, **patch)))
    code, out, err = run(["check", str(f)], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvsim: error: {f}:")
    assert where in lines[0]


def test_not_a_scenario_exits_2(tmp_path: Path, capsys):
    f = tmp_path / "n.json"
    f.write_text("42")
    assert run(["check", str(f)], capsys)[0] == 2


def test_regress_library_passes_and_writes_junit(tmp_path: Path, capsys):
    junit = tmp_path / "j.xml"
    code, out, _ = run(["regress", str(CRASH), "--junit", str(junit)], capsys)
    assert code == 0, out
    n = len(list(CRASH.rglob("*.toml")))
    assert n >= 30 and f"{n} passed, 0 failed" in out
    assert junit.read_text().count("<testcase") == n


def test_regress_fails_on_one_flipped_expectation(tmp_path: Path, capsys):
    lib = tmp_path / "lib"
    shutil.copytree(CRASH, lib)
    f = lib / "s6-b3904-left-missing.toml"
    text = f.read_text()
    assert 'crash = "missing_chunk"' in text
    f.write_text(text.replace('crash = "missing_chunk"', 'crash = "none"', 1))
    code, out, _ = run(["regress", str(lib)], capsys)
    assert code == 1
    assert 'MISMATCH s6-b3904-left-missing.toml [old] crash: expected "none", got "missing_chunk"' in out


def test_console_script_and_module_entry_point():
    res = subprocess.run([sys.executable, "-m", "sim.cli", "regress", str(CRASH)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_a_closed_pipe_is_not_a_traceback() -> None:
    # `kvsim check --json FILE | head -c 1`: the reader leaves early
    path = CRASH / "s6-b3904-left-missing.toml"
    res = subprocess.run(f"{sys.executable} -m sim.cli check --json {path} | head -c 1",
                         shell=True, capture_output=True, text=True, check=False)
    assert res.stdout == "{"
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr
