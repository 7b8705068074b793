"""run/1 workloads that name a trace (``trace = "mooncake-conversation"``): resolution through
$KVSIM_TRACES and the fetch cache, the resolved scenario (name + content sha256, no machine path),
``--set`` between ``path`` and ``trace``, and the one-line errors."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import pytest

from sim.cli import main
from sim.errors import InputError
from sim.io.scenario import load_run

TINY = "".join(json.dumps({"timestamp": i * 100, "input_length": 1000, "output_length": 10,
                           "hash_ids": [0, i + 1]}) + "\n" for i in range(3))
SCENARIO = ('schema = "run/1"\nname = "named"\n[model]\nname = "hybrid-demo"\n'
            '[cpu_cache]\ncapacity = "8GiB"\n'
            '[workload]\nkind = "mooncake"\ntrace = "mooncake-conversation"\n')


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "conversation_trace.jsonl").write_text(TINY, encoding="utf-8")
    monkeypatch.setenv("KVSIM_TRACES", str(folder))
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "no-cache"))
    return folder


def scenario(tmp_path: Path, text: str = SCENARIO) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(text, encoding="utf-8")
    return p


def test_trace_by_name_resolves_and_records_name_and_digest(traces: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_run(scenario(tmp_path))
    assert spec.workload_path == traces / "conversation_trace.jsonl"
    assert len(list(spec.requests())) == 3
    wl = spec.resolved()["workload"]
    assert wl["trace"] == "mooncake-conversation" and "path" not in wl
    assert wl["sha256"] == hashlib.sha256(TINY.encode()).hexdigest()
    text = spec.resolved_toml()
    assert str(traces) not in text
    # the resolved scenario loads back to the same thing
    again = tmp_path / "resolved.toml"
    again.write_text(text, encoding="utf-8")
    assert load_run(again).resolved_toml() == text
    # another machine, the same trace elsewhere (here: the fetch cache): the same resolved scenario
    other = tmp_path / "cache"
    other.mkdir()
    (other / "conversation_trace.jsonl").write_text(TINY, encoding="utf-8")
    monkeypatch.delenv("KVSIM_TRACES")
    monkeypatch.setenv("KVSIM_CACHE", str(other))
    assert load_run(scenario(tmp_path)).resolved_toml() == text
    # a different file under the name: the recorded digest says so
    (other / "conversation_trace.jsonl").write_text(TINY + TINY.replace("100", "900"), encoding="utf-8")
    with pytest.raises(InputError) as ei:
        load_run(again)
    assert ei.value.key == "workload.sha256"


def test_missing_named_trace_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVSIM_TRACES", raising=False)
    monkeypatch.setenv("KVSIM_CACHE", str(tmp_path / "no-cache"))
    p = scenario(tmp_path)
    assert main(["validate", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{p}:workload.trace" in err[0]
    assert "kvsim trace fetch mooncake-conversation" in err[0]


def test_path_and_trace(traces: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="exactly one of path, trace"):
        load_run(scenario(tmp_path, SCENARIO + 'path = "x.jsonl"\n'))
    with pytest.raises(InputError, match="unknown trace name 'nope'"):
        load_run(scenario(tmp_path, SCENARIO.replace("mooncake-conversation", "nope")))
    # --set path replaces the name, and the other way round
    local = tmp_path / "local.jsonl"
    local.write_text(TINY, encoding="utf-8")
    spec = load_run(scenario(tmp_path), [f'workload.path="{local}"'])
    assert spec.workload_path == local and spec.scenario.workload.trace is None
    by_path = SCENARIO.replace('trace = "mooncake-conversation"', f'path = "{local.name}"')
    spec = load_run(scenario(tmp_path, by_path), ['workload.trace="mooncake-conversation"'])
    assert spec.workload_path == traces / "conversation_trace.jsonl"


def test_shipped_scenarios_name_their_traces() -> None:
    from tests.helpers import ROOT

    shipped = [p for p in (ROOT / "scenarios").rglob("*.toml") if "shared/traces" in
               "\n".join(ln for ln in p.read_text().splitlines() if not ln.lstrip().startswith("#"))]
    assert shipped == []
    named = [p for p in (ROOT / "scenarios").rglob("*.toml")
             if 'trace = "mooncake-conversation"' in p.read_text()]
    assert len(named) >= 5   # the Mooncake scenarios, the what-ifs and the planner sweep
    assert all(tomllib.loads(p.read_text()) for p in named)
