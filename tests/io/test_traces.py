"""Raw trace records, statistics, download and conversion (sim.io.traces, kvsim trace)."""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sim.cli import main
from sim.errors import InputError
from sim.io import traces
from sim.io.traces import (
    BadLines,
    KnownTrace,
    TraceRecord,
    convert_trace,
    detect_format,
    fetch_trace,
    iter_records,
    trace_stats,
)

CONV = "conversation_trace.jsonl"
SYNTH = "synthetic_trace.jsonl"
AZ_CONV = "AzureLLMInferenceTrace_conv.csv"
AZ_CODE = "AzureLLMInferenceTrace_code.csv"
CSV_HEADER = ("arrival_s,input_tokens,output_tokens,hash_ids,block_tokens,prefix_group,prefix_tokens,"
              "session_id")
AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def mc(ts: object = 0, inp: object = 1000, out: object = 10, ids: object = None, **extra: object) -> str:
    """One Mooncake line (hash ids default to a fresh chain of the right length)."""
    if ids is None:
        assert isinstance(inp, int)
        ids = list(range(-(-inp // 512)))
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids, **extra})


def write(tmp_path: Path, name: str, lines: list[str]) -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def write_parquet(tmp_path: Path, columns: dict[str, Any], name: str = "t.parquet",
                  row_group_size: int | None = None) -> Path:
    p = tmp_path / name
    pq.write_table(pa.table(columns), p, row_group_size=row_group_size)
    return p


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_cli_error(capsys: pytest.CaptureFixture[str], argv: list[str], prefix: str,
                     contains: str = "") -> str:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2, (out, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"kvsim: error: {prefix}"), err
    assert contains in err, err
    return err


# ----------------------------------------------------------------------------------------------
# bad input, every format
# ----------------------------------------------------------------------------------------------

GOOD_MC = mc(0, 1000, 10)

MOONCAKE_BAD: list[tuple[str, str, str]] = [
    ("bad-json", '{"timestamp": 1, "input_length": ', "invalid JSON"),
    ("not-object", "[1, 2, 3]", "not a JSON object"),
    ("missing-field", json.dumps({"timestamp": 1, "input_length": 10, "hash_ids": [0]}),
     "missing field 'output_length'"),
    ("input-float", mc(3, 1000.5, 10, [0, 1]), "input_length 1000.5"),
    ("input-string", mc(3, "1000", 10, [0, 1]), "input_length '1000'"),
    ("input-zero", mc(3, 0, 10, []), "input_length 0"),
    ("output-negative", mc(3, 1000, -4), "output_length -4"),
    ("output-zero", mc(3, 1000, 0), "output_length 0"),
    ("timestamp-negative", mc(-1), "timestamp -1"),
    ("timestamp-decreasing", mc(1), "timestamp 1 is smaller than the previous"),
    ("hash-ids-short", mc(3, 1025, 10, [0, 1]), "2 hash_ids for input_length 1025"),
    ("hash-ids-long", mc(3, 512, 10, [0, 1]), "2 hash_ids for input_length 512"),
    ("hash-id-negative", mc(3, 1000, 10, [0, -1]), "non-negative integers"),
    ("hash-id-float", mc(3, 1000, 10, [0, 1.5]), "non-negative integers"),
    ("session-not-string", mc(3, 1000, 10, session_id=[1]), "session_id"),
]


@pytest.mark.parametrize(("case", "bad_line", "problem"), MOONCAKE_BAD, ids=[c[0] for c in MOONCAKE_BAD])
def test_mooncake_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, bad_line: str,
                           problem: str) -> None:
    # line 1 good at t=2 ms, line 2 blank (ignored), line 3 the bad one, line 4 good
    p = write(tmp_path, "t.jsonl", [mc(2, 1000, 10), "", bad_line, mc(9, 1000, 10)])
    with pytest.raises(InputError) as ei:
        list(iter_records(p))
    assert (ei.value.source, ei.value.key) == (str(p), "line 3")
    assert problem in ei.value.problem
    assert_cli_error(capsys, ["trace", "stats", str(p)], f"{p}:line 3: ", problem)
    # --skip-bad: counted, never silently dropped
    bad = BadLines()
    recs = list(iter_records(p, skip_bad=True, bad=bad))
    assert [r.line for r in recs] == [1, 4]
    assert bad.count == 1 and bad.examples[0].startswith("line 3: ")


def csv_file(tmp_path: Path, rows: list[str], header: str = CSV_HEADER, name: str = "t.csv") -> Path:
    return write(tmp_path, name, [header, *rows])


def crow(arrival: object = "1.5", inp: object = 1000, out: object = 10, ids: object = "0 1", bt: object = 512,
         group: object = "", ptok: object = "", session: object = "") -> str:
    return ",".join(str(v) for v in (arrival, inp, out, ids, bt, group, ptok, session))


CSV_BAD: list[tuple[str, str, str]] = [
    ("field-count", "1.5,1000,10", "3 fields, expected 8"),
    ("field-count-long", crow() + ",x", "9 fields, expected 8"),
    ("missing-input", crow(inp=""), "missing input_tokens"),
    ("input-float", crow(inp="1000.0"), "input_tokens '1000.0' is not an integer"),
    ("input-text", crow(inp="abc"), "input_tokens 'abc' is not an integer"),
    ("input-zero", crow(inp=0, ids=""), "input_tokens 0"),
    ("output-negative", crow(out=-3), "output_tokens -3"),
    ("arrival-negative", crow(arrival="-0.5"), "arrival_s -0.5"),
    ("arrival-text", crow(arrival="soon"), "arrival_s 'soon' is not a number"),
    ("arrival-nan", crow(arrival="nan"), "arrival_s nan"),
    ("arrival-decreasing", crow(arrival="0.25"), "smaller than the previous"),
    ("hash-ids-count", crow(inp=1025), "2 hash_ids for input_tokens 1025"),
    ("hash-id-negative", crow(ids="0 -1"), "hash id '-1'"),
    ("hash-id-text", crow(ids="0 x"), "hash id 'x'"),
    ("block-tokens-zero", crow(bt=0), "block_tokens 0"),
    ("group-without-tokens", crow(ids="", bt="", group=3), "given together"),
    ("prefix-too-long", crow(ids="", bt="", group=3, ptok=1001), "exceeds input_tokens"),
    ("prefix-inconsistent", crow(ids="", bt="", group=7, ptok=100), "earlier records say 50"),
    ("hash-and-group", crow(group=3, ptok=10), "both hash_ids and prefix_group"),
]


@pytest.mark.parametrize(("case", "bad_row", "problem"), CSV_BAD, ids=[c[0] for c in CSV_BAD])
def test_csv_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, bad_row: str,
                      problem: str) -> None:
    # header = line 1; line 2 good (group 7 has a 50-token prefix); line 3 blank; line 4 bad
    p = csv_file(tmp_path, [crow("1.0", ids="", bt="", group=7, ptok=50), "", bad_row, crow("2.0")])
    with pytest.raises(InputError) as ei:
        list(iter_records(p))
    assert (ei.value.source, ei.value.key) == (str(p), "line 4")
    assert problem in ei.value.problem, ei.value.problem
    assert_cli_error(capsys, ["trace", "stats", str(p)], f"{p}:line 4: ", problem)
    bad = BadLines()
    assert [r.line for r in iter_records(p, skip_bad=True, bad=bad)] == [2, 5]
    assert bad.count == 1


def test_csv_header_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        ("arrival_s,input_tokens", "missing column(s) output_tokens"),
        (CSV_HEADER + ",colour", "unknown column(s) 'colour'"),
        ("arrival_s,input_tokens,output_tokens,input_tokens", "duplicate column(s) 'input_tokens'"),
        (AZ_HEADER, "--format azure"),
    ]
    for header, problem in cases:
        p = csv_file(tmp_path, ["1,2,3"], header=header)
        with pytest.raises(InputError) as ei:
            list(iter_records(p, "csv", skip_bad=True, bad=BadLines()))  # never skippable
        assert ei.value.key == "line 1" and problem in str(ei.value), str(ei.value)
        assert_cli_error(capsys, ["trace", "stats", "--format", "csv", str(p)], f"{p}:line 1: ", problem)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(InputError, match="empty file"):
        list(iter_records(empty))


def test_csv_not_utf8_and_quoted_lines(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_bytes((CSV_HEADER + "\n" + crow("1") + "\n").encode() + b"2,100,1,,,,,caf\xe9\n"
                  + (crow("3", session='"multi\nline"') + "\n" + crow("4") + "\n").encode())
    with pytest.raises(InputError) as ei:
        list(iter_records(p))
    assert ei.value.key == "line 3" and "UTF-8" in ei.value.problem
    bad = BadLines()
    recs = list(iter_records(p, skip_bad=True, bad=bad))
    # the quoted session id spans lines 4-5; the next record starts on line 6
    assert [(r.line, r.session_id) for r in recs] == [(2, None), (4, "multi\nline"), (6, None)]
    assert bad.count == 1


def test_csv_block_tokens_default_and_missing(tmp_path: Path) -> None:
    p = csv_file(tmp_path, ["0.5,1000,10,0 1", "0.5,1000,10,0 2"],
                 header="arrival_s,input_tokens,output_tokens,hash_ids")
    with pytest.raises(InputError, match="hash_ids without block_tokens") as ei:
        list(iter_records(p))
    assert ei.value.key == "line 2"
    recs = list(iter_records(p, block_tokens=512))
    assert [r.hash_ids for r in recs] == [(0, 1), (0, 2)] and recs[0].block_tokens == 512
    with pytest.raises(InputError, match="ceil"):  # 1000 tokens / 256 = 4 ids
        list(iter_records(p, block_tokens=256))


AZURE_BAD: list[tuple[str, str, str]] = [
    ("field-count", "2023-11-16 18:15:47.0000000,10", "2 fields, expected 3"),
    ("timestamp-text", "yesterday,10,10", "TIMESTAMP 'yesterday'"),
    ("timestamp-fraction", "2023-11-16 18:15:47.12x,10,10", "TIMESTAMP"),
    ("timestamp-decreasing", "2023-11-16 18:15:45.9999999,10,10", "earlier than the previous"),
    ("context-zero", "2023-11-16 18:15:47.0000000,0,10", "ContextTokens 0"),
    ("context-float", "2023-11-16 18:15:47.0000000,1.5,10", "ContextTokens '1.5' is not an integer"),
    ("generated-negative", "2023-11-16 18:15:47.0000000,10,-2", "GeneratedTokens -2"),
    ("generated-missing", "2023-11-16 18:15:47.0000000,10,", "missing GeneratedTokens"),
]


@pytest.mark.parametrize(("case", "bad_row", "problem"), AZURE_BAD, ids=[c[0] for c in AZURE_BAD])
def test_azure_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, bad_row: str,
                        problem: str) -> None:
    p = write(tmp_path, "a.csv", [AZ_HEADER, "2023-11-16 18:15:46.6805900,374,44", bad_row,
                                  "2023-11-16 18:15:50.9951690,396,109"])
    assert detect_format(p) == "azure"
    with pytest.raises(InputError) as ei:
        list(iter_records(p))
    assert (ei.value.source, ei.value.key) == (str(p), "line 3")
    assert problem in ei.value.problem, ei.value.problem
    assert_cli_error(capsys, ["trace", "stats", str(p)], f"{p}:line 3: ", problem)
    bad = BadLines()
    assert [r.line for r in iter_records(p, skip_bad=True, bad=bad)] == [2, 4]
    assert bad.count == 1


def test_azure_timestamps_exact_and_relative(tmp_path: Path) -> None:
    p = write(tmp_path, "a.csv", [AZ_HEADER, "2023-11-16 23:59:59.9999999,1,2", "2023-11-17 00:00:00,3,4",
                                  "2023-11-17 00:00:04.3145790,5,6"])
    recs = list(iter_records(p))
    assert [r.arrival_s for r in recs] == [0.0, 100 / 1e9, 4314579100 / 1e9]
    assert recs[1] == TraceRecord(3, 1e-7, 3, 4, None, None, None, None, None)
    bad_header = write(tmp_path, "b.csv", ["TIMESTAMP,Context,Generated", "2023-11-17 00:00:00,3,4"])
    with pytest.raises(InputError) as ei:
        list(iter_records(bad_header, "azure"))
    assert ei.value.key == "line 1" and ei.value.allowed == AZ_HEADER


def parquet_columns(n: int = 4) -> dict[str, Any]:
    return {
        "arrival_s": [float(i) for i in range(n)],
        "input_tokens": [1000] * n,
        "output_tokens": [10] * n,
        "hash_ids": [[0, i + 1] for i in range(n)],
        "block_tokens": [512] * n,
    }


PARQUET_BAD: list[tuple[str, str, object, str]] = [
    ("input-zero", "input_tokens", 0, "input_tokens 0"),
    ("input-null", "input_tokens", None, "missing input_tokens"),
    ("output-negative", "output_tokens", -1, "output_tokens -1"),
    ("arrival-negative", "arrival_s", -2.0, "arrival_s -2.0"),
    ("arrival-decreasing", "arrival_s", 0.5, "smaller than the previous"),
    ("hash-ids-count", "hash_ids", [0], "1 hash_ids for input_tokens 1000"),
    ("hash-id-negative", "hash_ids", [0, -5], "hash id -5"),
]


@pytest.mark.parametrize(("case", "column", "value", "problem"), PARQUET_BAD, ids=[c[0] for c in PARQUET_BAD])
def test_parquet_bad_row(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, column: str,
                         value: object, problem: str) -> None:
    cols = parquet_columns()
    cols[column][2] = value
    p = write_parquet(tmp_path, cols)
    with pytest.raises(InputError) as ei:
        list(iter_records(p))
    assert (ei.value.source, ei.value.key) == (str(p), "line 3")
    assert problem in ei.value.problem, ei.value.problem
    assert_cli_error(capsys, ["trace", "stats", str(p)], f"{p}:line 3: ", problem)
    bad = BadLines()
    assert [r.line for r in iter_records(p, skip_bad=True, bad=bad)] == [1, 2, 4]
    assert bad.count == 1


def test_parquet_types_and_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cols = parquet_columns()
    cols["input_tokens"] = [1000.0, 1000.0, 1000.5, 1000.0]  # a double column: not integers
    p = write_parquet(tmp_path, cols)
    with pytest.raises(InputError, match="is not an integer") as ei:
        list(iter_records(p))
    assert ei.value.key == "line 1"
    cols = parquet_columns()
    del cols["output_tokens"]
    cols["colour"] = ["red"] * 4
    p = write_parquet(tmp_path, cols, "s.parquet")
    err = assert_cli_error(capsys, ["trace", "stats", str(p)], f"{p}:schema: ", "unknown column(s) 'colour'")
    assert "missing column(s) output_tokens" in err
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    assert_cli_error(capsys, ["trace", "stats", str(junk)], f"{junk}: not a readable Parquet file")


# ----------------------------------------------------------------------------------------------
# skip-bad reporting, format detection, arguments
# ----------------------------------------------------------------------------------------------

def test_skip_bad_reported_in_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [mc(0, 1000, 10, [0, 1]), "oops", mc(10, 1000, 10, [0, 2]), mc(5, 600, 1, [0, 3]),
             mc(20, 512, 3, [0])]
    p = write(tmp_path, "t.jsonl", lines)
    stats = trace_stats(p, skip_bad=True)
    assert stats["requests"] == 3
    assert stats["bad_lines"]["count"] == 2
    assert [e.split(":")[0] for e in stats["bad_lines"]["examples"]] == ["line 2", "line 4"]
    # 5 refs (0 1 | 0 2 | 0): 0 seen twice more
    assert stats["hash_ids"]["block_refs"] == 5 and stats["hash_ids"]["unique_blocks"] == 3
    assert stats["hash_ids"]["reuse_ratio"] == pytest.approx(2 / 5)
    rc, out, err = run_cli(capsys, "trace", "stats", str(p), "--skip-bad")
    assert rc == 0 and err == ""
    assert "bad lines skipped    2" in out and "line 2: invalid JSON" in out and "line 4: timestamp 5" in out
    rc, out, _ = run_cli(capsys, "trace", "stats", str(p), "--skip-bad", "--json")
    data = json.loads(out)
    assert rc == 0 and data["bad_lines"]["count"] == 2 and data["requests"] == 3
    # without --skip-bad the first bad line is fatal
    assert_cli_error(capsys, ["trace", "stats", str(p)], f"{p}:line 2: invalid JSON")
    with pytest.raises(ValueError, match="BadLines"):
        iter_records(p, skip_bad=True)


def test_skip_bad_examples_capped_and_all_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(tmp_path, "t.jsonl", ["x"] * 12)
    bad = BadLines()
    assert list(iter_records(p, skip_bad=True, bad=bad)) == []
    assert bad.count == 12 and len(bad.examples) == BadLines.max_examples
    assert_cli_error(capsys, ["trace", "stats", "--skip-bad", str(p)], f"{p}: no requests",
                     "12 bad lines skipped")


def test_detect_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert detect_format(write(tmp_path, "a.jsonl", [GOOD_MC])) == "mooncake"
    assert detect_format(write(tmp_path, "a.csv", [AZ_HEADER])) == "azure"
    assert detect_format(write(tmp_path, "b.csv", [CSV_HEADER])) == "csv"
    assert detect_format(write_parquet(tmp_path, parquet_columns(), "p.parquet")) == "parquet"
    # no telling suffix: sniffed
    assert detect_format(write(tmp_path, "a.txt", [GOOD_MC])) == "mooncake"
    assert detect_format(write(tmp_path, "b.txt", [AZ_HEADER])) == "azure"
    assert detect_format(write(tmp_path, "c.txt", [CSV_HEADER])) == "csv"
    pq_odd = tmp_path / "p.bin"
    pq_odd.write_bytes((tmp_path / "p.parquet").read_bytes())
    assert detect_format(pq_odd) == "parquet"
    odd = write(tmp_path, "d.txt", ["hello"])
    with pytest.raises(InputError) as ei:
        detect_format(odd)
    assert "mooncake|azure|csv|parquet" in ei.value.allowed
    assert_cli_error(capsys, ["trace", "stats", str(odd)], f"{odd}: cannot tell the trace format")
    # explicit --format overrides the name
    odd_mc = write(tmp_path, "e.txt", [GOOD_MC])
    rc, out, _ = run_cli(capsys, "trace", "stats", "--format", "mooncake", str(odd_mc))
    assert rc == 0 and "(mooncake)" in out
    missing = tmp_path / "missing.jsonl"
    assert_cli_error(capsys, ["trace", "stats", str(missing)], f"{missing}: no such file")
    with pytest.raises(InputError, match="no such file"):
        iter_records(missing, "csv")  # raised at the call, not at the first next()


def test_block_tokens_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(tmp_path, "t.jsonl", [mc(0, 1000, 10, [0, 1, 2, 3])])
    assert_cli_error(capsys, ["trace", "stats", str(p)], f"{p}:line 1: 4 hash_ids")
    rc, out, _ = run_cli(capsys, "trace", "stats", str(p), "--block-tokens", "256")
    assert rc == 0 and "256 tokens" in out
    rec = next(iter_records(p, block_tokens=256))
    assert rec.block_tokens == 256 and rec.hash_ids == (0, 1, 2, 3)
    with pytest.raises(InputError, match="--block-tokens"):
        iter_records(p, block_tokens=0)


# ----------------------------------------------------------------------------------------------
# streaming
# ----------------------------------------------------------------------------------------------

def test_streaming_does_not_read_ahead(tmp_path: Path) -> None:
    """The first record comes out although everything after it is garbage."""
    garbage = ["\x01 not a record \x02"] * 200_000
    cases = {
        "t.jsonl": [GOOD_MC, *garbage],
        "t.csv": [CSV_HEADER, crow(), *garbage],
        "a.csv": [AZ_HEADER, "2023-11-16 18:15:46.6805900,374,44", *garbage],
    }
    for name, lines in cases.items():
        p = write(tmp_path, name, lines)
        it = iter_records(p)
        first = next(it)
        assert first.line in (1, 2) and first.input_tokens in (1000, 374)
        with pytest.raises(InputError) as ei:
            next(it)
        assert ei.value.key == f"line {first.line + 1}"
    # Parquet: a bad value in the last of several row groups is not reached by the first record
    n = 3 * traces._PARQUET_BATCH
    cols = parquet_columns(n)
    cols["input_tokens"][-1] = 0
    p = write_parquet(tmp_path, cols, row_group_size=traces._PARQUET_BATCH)
    assert pq.ParquetFile(p).num_row_groups == 3
    it = iter_records(p)
    assert next(it).line == 1
    with pytest.raises(InputError) as ei:
        list(it)
    assert ei.value.key == f"line {n}"


@pytest.mark.slow
def test_streaming_memory_bounded(tmp_path: Path) -> None:
    """Iterating a ~9 MB trace holds far less than the file in memory."""
    lines = [mc(i, 32768, 10, list(range(i * 64, i * 64 + 64))) for i in range(12_000)]
    p = write(tmp_path, "big.jsonl", lines)
    size = p.stat().st_size
    del lines
    tracemalloc.start()
    try:
        count = sum(1 for _ in iter_records(p))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 12_000
    assert size > 5_000_000 and peak < 1_000_000, (size, peak)


# ----------------------------------------------------------------------------------------------
# statistics on the real traces (README figures)
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_stats_conversation(traces_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = trace_stats(traces_dir / CONV)
    assert s["requests"] == 12_031
    assert round(s["duration_s"]) == 3_537 and f"{s['rate_per_s']:.2f}" == "3.40"
    assert round(s["input_tokens"]["mean"]) == 12_035 and s["input_tokens"]["p50"] == 6_909
    assert round(s["input_tokens"]["p99"]) == 85_400 and s["input_tokens"]["max"] == 126_195
    assert s["output_tokens"]["mean"] == pytest.approx(342.6, abs=0.05)
    assert s["output_tokens"]["p50"] == 350 and s["output_tokens"]["p99"] == pytest.approx(1118.5)
    h = s["hash_ids"]
    assert (h["block_refs"], h["unique_blocks"]) == (288_500, 182_790)
    assert f"{h['reuse_ratio']:.3f}" == "0.366"
    assert f"{h['prefix_hit_token_ratio']:.3f}" == "0.374"
    assert h["requests_reusing_ratio"] == 12_030 / 12_031  # all but the first (README: 100%)
    assert f"{h['blocks_per_request']['mean']:.1f}" == "24.0" and h["blocks_per_request"]["p50"] == 14
    assert f"{h['reused_prefix_blocks']['mean']:.1f}" == "8.8"
    assert s["bad_lines"]["count"] == 0 and s["prefix_groups"] is None
    rc, out, err = run_cli(capsys, "trace", "stats", str(traces_dir / CONV))
    assert rc == 0 and err == ""
    assert "12,031" in out and "3,537.0 s" in out and "3.40 req/s" in out and "0.366" in out
    assert "288,500 / 182,790" in out


@pytest.mark.slow
def test_stats_synthetic(traces_dir: Path) -> None:
    s = trace_stats(traces_dir / SYNTH)
    assert s["requests"] == 3_993
    assert round(s["duration_s"]) == 1_022 and f"{s['rate_per_s']:.2f}" == "3.91"
    assert round(s["input_tokens"]["mean"]) == 15_325 and s["input_tokens"]["p50"] == 11_587
    assert s["output_tokens"]["mean"] == pytest.approx(149.1, abs=0.05)
    h = s["hash_ids"]
    assert (h["block_refs"], h["unique_blocks"]) == (121_877, 43_924)
    assert f"{h['reuse_ratio']:.3f}" == "0.640"
    assert f"{h['prefix_hit_token_ratio']:.3f}" == "0.651"
    assert f"{h['requests_reusing_ratio']:.3f}" == "0.446"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "count", "duration", "inp", "out"), [
    (AZ_CONV, 19_366, 3_502, (1154.7, 1_020, 4_142, 14_050), (211.1, 129, 601, 1_000)),
    (AZ_CODE, 8_819, 3_436, (2047.8, 1_469, 7_436, 7_437), (27.9, 13, 251.5, 1_899)),
])
def test_stats_azure(traces_dir: Path, capsys: pytest.CaptureFixture[str], name: str, count: int,
                     duration: int, inp: tuple[float, ...], out: tuple[float, ...]) -> None:
    s = trace_stats(traces_dir / name)
    assert s["format"] == "azure" and s["requests"] == count and round(s["duration_s"]) == duration
    for key, want in (("input_tokens", inp), ("output_tokens", out)):
        d = s[key]
        assert round(d["mean"], 1) == want[0]
        assert (d["p50"], d["p99"], d["max"]) == pytest.approx(want[1:], abs=0.05)
    assert s["hash_ids"] is None
    rc, text, _ = run_cli(capsys, "trace", "stats", "--json", str(traces_dir / name))
    assert rc == 0 and json.loads(text)["requests"] == count


def test_stats_prefix_groups(tmp_path: Path) -> None:
    p = csv_file(tmp_path, [crow("0", 1000, 5, "", "", 1, 400, "s1"), crow("1", 800, 5, "", "", 1, 400, "s1"),
                            crow("2", 200, 5, "", "", 2, 100), crow("3", 500, 5, "", "", 1, 400)])
    s = trace_stats(p)
    assert s["prefix_groups"] == {"requests": 4, "groups": 2, "reuse_token_ratio": 800 / 2500}
    assert s["hash_ids"] is None
    assert s["duration_s"] == 3.0 and s["rate_per_s"] == 4 / 3
    assert s["input_tokens"]["p50"] == 650.0 and s["input_tokens"]["max"] == 1000


# ----------------------------------------------------------------------------------------------
# convert
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_convert_round_trip_real_trace(traces_dir: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    src = traces_dir / CONV
    rc, out, _ = run_cli(capsys, "trace", "convert", str(src), str(tmp_path / "c.csv"))
    assert rc == 0 and "12,031 records" in out
    assert run_cli(capsys, "trace", "convert", str(tmp_path / "c.csv"), str(tmp_path / "c.parquet"))[0] == 0
    back = tmp_path / "back.jsonl"
    assert run_cli(capsys, "trace", "convert", str(tmp_path / "c.parquet"), str(back))[0] == 0
    assert (tmp_path / "back.jsonl").read_bytes() == src.read_bytes()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["back.jsonl", "c.csv", "c.parquet"]


def test_convert_round_trips_small(tmp_path: Path) -> None:
    src = write(tmp_path, "s.jsonl", [mc(0, 1000, 10, [0, 1], session_id="a"), mc(2.5, 100, 1, [0]),
                                      mc(1234567, 513, 7, [5, 6], session_id="b,c")])
    orig = list(iter_records(src))
    for fmt in ("csv", "parquet"):
        mid = tmp_path / f"m.{fmt}"
        back = tmp_path / f"back-{fmt}.jsonl"
        convert_trace(src, mid)
        assert list(iter_records(mid)) == [_relined(r, i, fmt) for i, r in enumerate(orig)]
        convert_trace(mid, back)
        assert list(iter_records(back)) == orig
        assert back.read_text() == src.read_text()
    # kvsim CSV with prefix groups -> Parquet -> CSV: identical file
    csv_src = csv_file(tmp_path, [crow("0.1", 1000, 5, "", "", 1, 400, "s1"),
                                  crow("0.2", 800, 5, "", "", 1, 400), crow("0.3", 300, 2, "0", 512)],
                       name="g.csv")
    convert_trace(csv_src, tmp_path / "g.parquet")
    convert_trace(tmp_path / "g.parquet", tmp_path / "g2.csv")
    assert (tmp_path / "g2.csv").read_text() == csv_src.read_text()


def _relined(r: TraceRecord, i: int, fmt: str) -> TraceRecord:
    from dataclasses import replace

    return replace(r, line=i + 2 if fmt == "csv" else i + 1)


def test_convert_azure(traces_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = traces_dir / AZ_CODE
    out = tmp_path / "code.parquet"
    assert run_cli(capsys, "trace", "convert", str(src), str(out))[0] == 0
    a = [(r.arrival_s, r.input_tokens, r.output_tokens) for r in iter_records(src)]
    b = [(r.arrival_s, r.input_tokens, r.output_tokens) for r in iter_records(out)]
    assert a == b and len(a) == 8_819
    # Azure has no hash ids: no Mooncake output, nothing written
    err = assert_cli_error(capsys, ["trace", "convert", str(src), str(tmp_path / "code.jsonl")],
                           f"{src}:line 2: no hash_ids")
    assert "csv or parquet" in err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["code.parquet"]


def test_convert_failure_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write(tmp_path, "s.jsonl", [GOOD_MC] * 1000 + ["{broken"])
    for suffix in (".csv", ".parquet", ".jsonl"):
        dst = tmp_path / "out" / f"o{suffix}"
        dst.parent.mkdir(exist_ok=True)
        assert_cli_error(capsys, ["trace", "convert", str(src), str(dst)], f"{src}:line 1001: invalid JSON")
        assert list(dst.parent.iterdir()) == []
    # an existing output is kept on failure, replaced only with --force
    dst = tmp_path / "out" / "o.csv"
    dst.write_text("keep me")
    assert_cli_error(capsys, ["trace", "convert", str(src), str(dst)], f"{dst}: already exists", "--force")
    assert_cli_error(capsys, ["trace", "convert", "--force", str(src), str(dst)], f"{src}:line 1001:")
    assert dst.read_text() == "keep me" and len(list(dst.parent.iterdir())) == 1
    rc, out, err = run_cli(capsys, "trace", "convert", "--force", "--skip-bad", str(src), str(dst))
    assert rc == 0 and "1,000 records" in out and "skipped 1 bad line(s): line 1001: invalid JSON" in err
    assert len(dst.read_text().splitlines()) == 1001
    txt = tmp_path / "o.txt"
    assert_cli_error(capsys, ["trace", "convert", str(src), str(txt)], f"{txt}:", "--to mooncake|csv|parquet")
    assert_cli_error(capsys, ["trace", "convert", str(src), str(tmp_path / "nodir" / "o.csv")],
                     f"{tmp_path / 'nodir' / 'o.csv'}: cannot write")


def test_convert_of_a_trace_with_no_request_writes_nothing(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """As ``trace stats`` and ``run`` say of the same input: no requests, exit 2, no file."""
    empty = write(tmp_path, "empty.jsonl", [])
    all_bad = write(tmp_path, "bad.jsonl", ["{broken", "{broken"])
    for suffix in (".csv", ".parquet", ".jsonl"):
        dst = tmp_path / "out" / f"o{suffix}"
        dst.parent.mkdir(exist_ok=True)
        assert_cli_error(capsys, ["trace", "convert", str(empty), str(dst)],
                         f"{empty}: no requests (the file has no request line)", "at least one request")
        assert_cli_error(capsys, ["trace", "convert", "--skip-bad", str(all_bad), str(dst)],
                         f"{all_bad}: no requests (every line was bad: 2 bad lines skipped by --skip-bad)")
        assert list(dst.parent.iterdir()) == []


def test_convert_block_size_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = csv_file(tmp_path, [crow("0", 100, 1, "0 1 2 3 4 5 6", 16), crow("1", 100, 1, "0 1 2 3 4 5 7", 16)])
    dst = tmp_path / "o.jsonl"
    rc, _, err = run_cli(capsys, "trace", "convert", str(src), str(dst))
    assert rc == 0 and "--block-tokens 16" in err
    assert [r.hash_ids for r in iter_records(dst, block_tokens=16)][1] == (0, 1, 2, 3, 4, 5, 7)
    mixed = csv_file(tmp_path, [crow("0", 100, 1, "0 1 2 3 4 5 6", 16), crow("1", 1000, 1, "0 1", 512)],
                     name="mixed.csv")
    assert_cli_error(capsys, ["trace", "convert", str(mixed), str(tmp_path / "m.jsonl")], f"{mixed}:line 3:",
                     "one block size per Mooncake file")


# ----------------------------------------------------------------------------------------------
# fetch (loopback HTTP only)
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def http_server() -> Iterator[tuple[str, dict[str, bytes]]]:
    """A loopback HTTP server serving ``files`` (path -> bytes); 404 otherwise."""
    files: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", files
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/gone.jsonl"


@pytest.fixture
def fake_trace(monkeypatch: pytest.MonkeyPatch) -> Callable[[bytes], KnownTrace]:
    def register(body: bytes) -> KnownTrace:
        blob = hashlib.sha1(b"blob %d\0" % len(body) + body, usedforsecurity=False).hexdigest()
        spec = KnownTrace("test-trace", "test_trace.jsonl", "http://127.0.0.1:9/never",
                          hashlib.sha256(body).hexdigest(), blob, "test")
        monkeypatch.setitem(traces.KNOWN_TRACES, spec.name, spec)
        return spec
    return register


def test_fetch_download_verify_and_cache(http_server: tuple[str, dict[str, bytes]], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str],
                                         fake_trace: Callable[[bytes], KnownTrace]) -> None:
    base, files = http_server
    body = "\n".join([GOOD_MC] * 5000).encode() + b"\n"
    fake_trace(body)
    files["/t.jsonl"] = body
    cache = tmp_path / "cache"
    fetch = ["trace", "fetch", "test-trace", "--cache-dir", str(cache)]
    rc, out, err = run_cli(capsys, *fetch, "--url", f"{base}/t.jsonl")
    assert rc == 0 and err == ""
    assert out == f"{cache / 'test_trace.jsonl'}\n"
    assert (cache / "test_trace.jsonl").read_bytes() == body
    assert [x.name for x in cache.iterdir()] == ["test_trace.jsonl"]
    # cached: no network needed (the URL refuses)
    rc, out, err = run_cli(capsys, *fetch, "--url", refused_url())
    assert rc == 0 and out.strip() == str(cache / "test_trace.jsonl") and "already cached" in err
    # --force with a failing download keeps the cached copy
    assert_cli_error(capsys, ["trace", "fetch", "test-trace", "--cache-dir", str(cache), "--force", "--url",
                              refused_url()], "test-trace: download failed (", "refused")
    assert (cache / "test_trace.jsonl").read_bytes() == body
    assert [x.name for x in cache.iterdir()] == ["test_trace.jsonl"]
    # a tampered cached copy is reported, not used
    (cache / "test_trace.jsonl").write_bytes(body[:-1])
    assert_cli_error(capsys, ["trace", "fetch", "test-trace", "--cache-dir", str(cache)],
                     f"{cache / 'test_trace.jsonl'}: cached copy does not match (sha256 mismatch", "--force")
    rc, _, _ = run_cli(capsys, "trace", "fetch", "test-trace", "--cache-dir", str(cache), "--force", "--url",
                       f"{base}/t.jsonl")
    assert rc == 0 and (cache / "test_trace.jsonl").read_bytes() == body


@pytest.mark.parametrize("case", ["sha256-mismatch", "blob-mismatch", "http-404", "refused", "bad-url"])
def test_fetch_failures_leave_nothing(http_server: tuple[str, dict[str, bytes]], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str],
                                      fake_trace: Callable[[bytes], KnownTrace],
                                      monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    base, files = http_server
    spec = fake_trace(b"the real content\n")
    files["/t.jsonl"] = b"something else\n"
    url, want = {
        "sha256-mismatch": (f"{base}/t.jsonl", "download failed (sha256 mismatch: got "),
        "blob-mismatch": (f"{base}/t.jsonl", "download failed (git blob id mismatch"),
        "http-404": (f"{base}/missing.jsonl", "download failed (HTTP 404 "),
        "refused": (refused_url(), "download failed ("),
        "bad-url": ("not a url", "download failed (unknown url type"),
    }[case]
    if case == "blob-mismatch":
        monkeypatch.setitem(traces.KNOWN_TRACES, spec.name,
                            KnownTrace(spec.name, spec.filename, spec.url, None, spec.git_blob, "test"))
    cache = tmp_path / "cache" / "traces"
    err = assert_cli_error(capsys, ["trace", "fetch", "test-trace", "--cache-dir", str(cache), "--url", url],
                           "test-trace:", want)
    assert "; allowed: " in err
    assert list(tmp_path.iterdir()) == []   # the folders it made for the cache are gone too
    cache.mkdir(parents=True)   # a cache folder that was there stays, empty
    assert_cli_error(capsys, ["trace", "fetch", "test-trace", "--cache-dir", str(cache), "--url", url],
                     "test-trace:", want)
    assert cache.is_dir() and list(cache.iterdir()) == []


def test_fetch_default_cache_dir_and_names(http_server: tuple[str, dict[str, bytes]], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           fake_trace: Callable[[bytes], KnownTrace]) -> None:
    base, files = http_server
    files["/x"] = b"abc\n"
    fake_trace(b"abc\n")
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "env-cache"))
    path, downloaded = fetch_trace("test-trace", url=f"{base}/x")
    assert downloaded and path == tmp_path / "env-cache" / "test_trace.jsonl"
    monkeypatch.delenv("KVSIM_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert traces.default_cache_dir() == tmp_path / "home" / ".cache" / "kvsim" / "traces"
    with pytest.raises(InputError, match="unknown trace name"):
        fetch_trace("nope")
    # the published names, pinned to the snapshot commit the README lists
    names = set(traces.KNOWN_TRACES) - {"test-trace"}
    assert {"mooncake-conversation", "mooncake-toolagent", "mooncake-synthetic"} <= names
    for n in ("mooncake-conversation", "mooncake-toolagent", "mooncake-synthetic"):
        t = traces.KNOWN_TRACES[n]
        assert t.url.startswith("https://raw.githubusercontent.com/kvcache-ai/Mooncake/"
                                "3b5a594133958449a1feaf1c9e0fc1b553e34a28/FAST25-release/traces/")
        assert t.url.endswith("/" + t.filename) and t.git_blob is not None
    with pytest.raises(SystemExit) as se:  # argparse rejects unknown names (exit 2)
        main(["trace", "fetch", "no-such-trace"])
    assert se.value.code == 2


@pytest.mark.slow
def test_fetch_real_trace_digest(http_server: tuple[str, dict[str, bytes]], traces_dir: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The published conversation trace served from loopback passes the pinned sha256 and blob id."""
    base, files = http_server
    files["/conversation_trace.jsonl"] = (traces_dir / CONV).read_bytes()
    rc, out, _ = run_cli(capsys, "trace", "fetch", "mooncake-conversation", "--cache-dir", str(tmp_path),
                         "--url", f"{base}/conversation_trace.jsonl")
    assert rc == 0 and Path(out.strip()) == tmp_path / CONV
    assert trace_stats(tmp_path / CONV)["requests"] == 12_031
