"""Traces by name ($KVSIM_TRACES, then the fetch cache), gzip-compressed traces, and empty traces
(sim.io.traces.resolve_trace / trace_digest, sim.io.workload streams, kvsim run)."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from sim.cli import main
from sim.errors import InputError
from sim.io import traces
from sim.io.traces import KNOWN_TRACES, BadLines, detect_format, fetch_trace, iter_records, trace_stats
from sim.io.workload import iter_mooncake, iter_trace

CONV = KNOWN_TRACES["mooncake-conversation"].filename  # conversation_trace.jsonl


def mc(ts: int = 0, inp: int = 1000, out: int = 10) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out,
                       "hash_ids": list(range(-(-inp // 512)))})


TINY = "".join(mc(ts=i * 100) + "\n" for i in range(3))


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Neither $KVSIM_TRACES nor a fetched copy: an empty home and cache."""
    monkeypatch.delenv("KVSIM_TRACES", raising=False)
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def put(folder: Path, name: str = CONV, text: str = TINY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text(text, encoding="utf-8")
    return p


# ----------------------------------------------------------------------------------------------
# resolution
# ----------------------------------------------------------------------------------------------

def test_name_found_in_kvsim_traces(no_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = put(no_env / "traces")
    monkeypatch.setenv("KVSIM_TRACES", str(no_env / "traces"))
    assert traces.resolve_trace("mooncake-conversation") == p


def test_name_found_in_fetch_cache(no_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = put(no_env / "cache")
    monkeypatch.setenv("KVSIM_CACHE", str(no_env / "cache"))
    assert traces.resolve_trace("mooncake-conversation") == p
    # $KVSIM_TRACES set but without the file: the cache still answers
    (no_env / "traces").mkdir()
    monkeypatch.setenv("KVSIM_TRACES", str(no_env / "traces"))
    assert traces.resolve_trace("mooncake-conversation") == p


def test_default_cache_under_home(no_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSIM_CACHE")
    p = put(no_env / "home" / ".cache" / "kvsim" / "traces")
    assert traces.resolve_trace("mooncake-conversation") == p


def test_kvsim_traces_comes_first(no_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    put(no_env / "cache")
    first = put(no_env / "traces")
    monkeypatch.setenv("KVSIM_CACHE", str(no_env / "cache"))
    monkeypatch.setenv("KVSIM_TRACES", str(no_env / "traces"))
    assert traces.resolve_trace("mooncake-conversation") == first


def test_gzip_copy_under_the_name(no_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = no_env / "traces"
    folder.mkdir()
    gz = folder / (CONV + ".gz")
    gz.write_bytes(gzip.compress(TINY.encode()))
    monkeypatch.setenv("KVSIM_TRACES", str(folder))
    assert traces.resolve_trace("mooncake-conversation") == gz


def test_missing_trace_names_the_fetch_command(no_env: Path) -> None:
    with pytest.raises(InputError) as ei:
        traces.resolve_trace("mooncake-conversation", source="s.toml", key="workload.trace")
    err = ei.value
    text = str(err)
    assert "\n" not in text
    assert err.source == "s.toml" and err.key == "workload.trace"
    assert "kvsim trace fetch mooncake-conversation" in text
    assert CONV in text and "KVSIM_TRACES" in text


def test_unknown_name_lists_the_known_ones(no_env: Path) -> None:
    with pytest.raises(InputError) as ei:
        traces.resolve_trace("mooncake-chat", source="s.toml", key="workload.trace")
    text = str(ei.value)
    assert "\n" not in text and "'mooncake-chat'" in text
    assert all(name in text for name in KNOWN_TRACES)


def test_digest_is_of_the_content(tmp_path: Path) -> None:
    plain = put(tmp_path, "a.jsonl")
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(TINY.encode(), mtime=0))
    want = hashlib.sha256(TINY.encode()).hexdigest()
    assert traces.trace_digest(plain) == want
    assert traces.trace_digest(gz) == want  # the same requests, whether compressed or not


# ----------------------------------------------------------------------------------------------
# gzip
# ----------------------------------------------------------------------------------------------

def _gz(path: Path, text: str) -> Path:
    path.write_bytes(gzip.compress(text.encode("utf-8")))
    return path


def test_gzip_mooncake_and_csv_read(tmp_path: Path) -> None:
    plain = [r.arrival_s for r in iter_records(put(tmp_path, "t.jsonl"))]
    assert len(plain) == 3
    gz = _gz(tmp_path / "t.jsonl.gz", TINY)
    assert detect_format(gz) == "mooncake"
    assert [r.arrival_s for r in iter_records(gz)] == plain
    # gzip magic without a .gz name
    magic = _gz(tmp_path / "t2.jsonl", TINY)
    assert [r.arrival_s for r in iter_records(magic)] == plain
    assert [r.req_id for r in iter_mooncake(magic, 16)] == ["r000000", "r000001", "r000002"]
    csv = "arrival_s,input_tokens,output_tokens\n0.0,100,10\n0.5,200,20\n"
    c = _gz(tmp_path / "t.csv.gz", csv)
    assert detect_format(c) == "csv"
    assert [(r.arrival_s, r.input_tokens) for r in iter_records(c)] == [(0.0, 100), (0.5, 200)]
    az = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
    a = _gz(tmp_path / "az.csv.gz", az)
    assert detect_format(a) == "azure" and len(list(iter_records(a))) == 1
    assert trace_stats(gz)["requests"] == 3
    assert len(list(iter_trace(c, 16))) == 2


def test_truncated_gzip_is_one_line_error(tmp_path: Path) -> None:
    data = gzip.compress((TINY * 200).encode())
    p = tmp_path / "cut.jsonl.gz"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError) as ei:
        list(iter_records(p))
    assert ei.value.source == str(p) and "corrupt gzip data" in ei.value.problem
    assert "\n" not in str(ei.value)


# ----------------------------------------------------------------------------------------------
# empty traces
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "text"), [
    ("e.jsonl", ""), ("blank.jsonl", "\n\n  \n"), ("h.csv", "arrival_s,input_tokens,output_tokens\n"),
    ("e.jsonl.gz", None)])
def test_empty_trace_fails_at_the_call(tmp_path: Path, name: str, text: str | None) -> None:
    p = tmp_path / name
    if text is None:
        p.write_bytes(gzip.compress(b""))
    else:
        p.write_text(text, encoding="utf-8")
    for make in ((lambda: iter_trace(p, 16)),) + (((lambda: iter_mooncake(p, 16)),)
                                                  if name.endswith((".jsonl", ".jsonl.gz")) else ()):
        with pytest.raises(InputError) as ei:
            make()
        assert ei.value.source == str(p) and "no requests" in ei.value.problem


def test_all_lines_skipped_fails_at_the_end(tmp_path: Path) -> None:
    p = put(tmp_path, "bad.jsonl", "x\ny\n")
    bad = BadLines()
    it = iter_trace(p, 16, skip_bad=True, bad=bad)
    with pytest.raises(InputError) as ei:
        list(it)
    assert ei.value.source == str(p) and "no requests" in ei.value.problem
    assert "2 bad lines skipped" in ei.value.problem


def test_run_of_an_empty_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = put(tmp_path, "e.jsonl", "")
    sc = tmp_path / "s.toml"
    sc.write_text('schema = "run/1"\n[model]\nname = "hybrid-demo"\n[cpu_cache]\ncapacity = "8GiB"\n'
                  f'[workload]\nkind = "mooncake"\npath = "{trace.name}"\n', encoding="utf-8")
    code = main(["run", str(sc), "--out", str(tmp_path / "out"), "-q"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(trace) in lines[0] and "no requests" in lines[0]
    assert not (tmp_path / "out").exists()


def test_run_where_every_line_is_skipped_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = put(tmp_path, "bad.jsonl", "x\n{}\n")
    sc = tmp_path / "s.toml"
    sc.write_text('schema = "run/1"\n[model]\nname = "hybrid-demo"\n[cpu_cache]\ncapacity = "8GiB"\n'
                  f'[workload]\nkind = "mooncake"\nskip_bad = true\npath = "{trace.name}"\n',
                  encoding="utf-8")
    code = main(["run", str(sc), "--out", str(tmp_path / "out"), "-q"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and str(trace) in lines[0] and "no requests" in lines[0]


def test_fetch_reuses_a_matching_copy_in_kvsim_traces(traces_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, with the trace already in $KVSIM_TRACES, ``kvsim trace fetch`` succeeds
    without downloading (the README's "fetch it first" step)."""
    monkeypatch.setenv("KVSIM_TRACES", str(traces_dir))
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "cache"))
    path, downloaded = fetch_trace("mooncake-conversation", url="http://127.0.0.1:9/unreachable")
    assert (path, downloaded) == (traces_dir / "conversation_trace.jsonl", False)
    assert not (tmp_path / "cache").exists()
