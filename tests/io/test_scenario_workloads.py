"""Workload kinds of run/1 files: agentic, uniform, trace (any format), transforms, skip_bad."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from sim.cli import main
from sim.errors import InputError
from sim.io.scenario import load_run

HEAD = """schema = "run/1"
name = "w"
[model]
groups = [{ kind = "full", tokens_per_block = 16, layers = 2, kv_heads = 2, head_size = 64 }]
[hardware]
gpu_blocks = 4000
[cpu_cache]
chunks = 1000
[costs]
step = "zero"
transfer = "zero"
"""


def scenario(tmp_path: Path, workload: str) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(HEAD + "[workload]\n" + workload)
    return p


def test_agentic_kind_takes_the_preset_and_overrides(tmp_path: Path) -> None:
    spec = load_run(scenario(tmp_path, 'kind = "agentic"\nturns_mean = 3.0\nlimit = 20\n'))
    params = spec.multiturn_params()
    assert params["system_prompt_tokens"] == 6144 and params["turns_mean"] == 3.0
    reqs = list(spec.requests())
    assert len(reqs) == 20 and all(r.prompt_tokens >= 6144 for r in reqs)
    resolved = tomllib.loads(spec.resolved_toml())["workload"]
    assert resolved["kind"] == "agentic" and resolved["turns_mean"] == 3.0


def test_uniform_kind_and_expected_requests(tmp_path: Path) -> None:
    spec = load_run(scenario(tmp_path, 'kind = "uniform"\nrequests = 30\ninput_tokens_max = 600\n'))
    assert spec.expected_requests == 30
    reqs = list(spec.requests())
    assert len(reqs) == 30 and max(r.prompt_tokens for r in reqs) <= 600
    with pytest.raises(InputError, match=r"workload\.input_tokens_max"):
        load_run(scenario(tmp_path, 'kind = "uniform"\ninput_tokens_min = 900\ninput_tokens_max = 600\n'))


def test_transforms_sample_rate_limit(tmp_path: Path) -> None:
    base = list(load_run(scenario(tmp_path, 'kind = "uniform"\nrequests = 400\n')).requests())
    spec = load_run(scenario(tmp_path, 'kind = "uniform"\nrequests = 400\nsample = 0.5\n'
                                       'rate_scale = 2.0\nlimit = 50\n'))
    got = list(spec.requests())
    assert len(got) == 50
    by_id = {r.req_id: r for r in base}
    assert all(r.arrival_s == by_id[r.req_id].arrival_s / 2.0 for r in got)
    assert len({r.req_id for r in got}) == 50 and {r.req_id for r in got} < set(by_id)


def _azure(tmp_path: Path) -> Path:
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n"
                 "2023-11-16 18:15:51.0000000,879,1\n")
    return p


def test_trace_kind_reads_azure_and_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _azure(tmp_path)
    p = scenario(tmp_path, 'kind = "trace"\npath = "az.csv"\n')
    reqs = list(load_run(p).requests())
    assert [r.prompt_tokens for r in reqs] == [374, 396, 879]
    assert reqs[0].arrival_s == 0.0 and reqs[1].arrival_s == pytest.approx(4.314579)
    # nothing shared (no prefix information in Azure traces)
    assert reqs[0].block_hashes[0] != reqs[1].block_hashes[0]
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(p), "--quiet"]) == 0
    summary = json.loads((tmp_path / "results" / "w" / "summary.json").read_text())
    assert summary["requests"]["finished"] == 3 and summary["workload"]["bad_lines_skipped"] == 0


def test_csv_prefix_groups_share_their_prefix(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("arrival_s,input_tokens,output_tokens,prefix_group,prefix_tokens\n"
                                    "0.0,300,5,7,256\n1.0,400,5,7,256\n2.0,400,5,8,256\n")
    reqs = list(load_run(scenario(tmp_path, 'kind = "trace"\npath = "t.csv"\n')).requests())
    a, b, c = (list(r.block_hashes) for r in reqs)
    assert a[:16] == b[:16] and a[16] != b[16]          # 256 tokens = 16 hashes shared
    assert a[0] != c[0]


def test_skip_bad_counts_lines_in_the_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    lines = [json.dumps({"timestamp": 10 * i, "input_length": 600, "output_length": 3,
                         "hash_ids": [i, 100 + i]}) for i in range(6)]
    lines[2] = '{"timestamp": 20'
    lines[4] = json.dumps({"timestamp": 40, "input_length": 0, "output_length": 3, "hash_ids": []})
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    p = scenario(tmp_path, 'kind = "mooncake"\npath = "t.jsonl"\nskip_bad = true\n')
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(p), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "bad trace lines skipped       2 (first: line 3:" in out
    summary = json.loads((tmp_path / "results" / "w" / "summary.json").read_text())
    assert summary["workload"]["bad_lines_skipped"] == 2
    assert summary["requests"]["arrived"] == 4
    # without skip_bad: exit 2, one line naming the file and line, nothing written
    assert main(["run", str(p), "--quiet", "--overwrite", "--out", "other",
                 "--set", "workload.skip_bad=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvsim: error: {tmp_path / 't.jsonl'}:line 3:")
    assert not (tmp_path / "other").exists()


def test_mooncake_kind_with_and_without_skip_bad_gives_the_same_hashes(tmp_path: Path) -> None:
    lines = [json.dumps({"timestamp": 10 * i, "input_length": 700, "output_length": 3,
                         "hash_ids": [0, 100 + i]}) for i in range(4)]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    fast = list(load_run(scenario(tmp_path, 'kind = "mooncake"\npath = "t.jsonl"\n')).requests())
    slow = list(load_run(scenario(tmp_path, 'kind = "mooncake"\npath = "t.jsonl"\nskip_bad = true\n')
                         ).requests())
    assert [list(r.block_hashes) for r in fast] == [list(r.block_hashes) for r in slow]
    assert fast[0].block_hashes[:32] == fast[1].block_hashes[:32]   # trace block 0 shared (tph 16)


def test_unknown_workload_kind_is_named(tmp_path: Path) -> None:
    with pytest.raises(InputError) as ei:
        load_run(scenario(tmp_path, 'kind = "poisson"\n'))
    assert ei.value.key.startswith("workload") and "uniform" in ei.value.allowed
