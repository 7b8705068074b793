"""Bad inputs end in one located line on stderr, exit 2, never a traceback, nothing written.

The cases of the "Reliability" issue (items 5-7): the copy path without torch,
sizes beyond the documented limits, tensor parallelism that does not divide
the KV heads, a huge check prompt (alone and inside ``kvsim regress``), JSON
batches with bad items, overlapping or repeated values, and errors caused by
``--set`` attributed to ``--set``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from sim.cli import main
from sim.io.schema import MAX_BYTES, MAX_CPU_CHUNKS, MAX_GPU_BLOCKS, MAX_REQUESTS, MAX_TOKENS
from tests.helpers import ROOT

CRASH = ROOT / "scenarios" / "crash"

#: a run of a few requests (fast even when a bad value is not refused)
TINY = """\
schema = "run/1"
name = "tiny"
[model]
name = "hybrid-demo"
[hardware]
gpu_blocks = 4000
[cpu_cache]
chunks = 100
[workload]
kind = "multiturn"
sessions = 3
limit = 5
"""

S6: dict[str, Any] = {
    "schema": "check/1", "blocks_per_chunk": 4, "tokens_per_hash": 8, "num_tokens": 4353,
    "groups": [{"kind": "full", "tokens_per_block": 256},
               {"kind": "sliding_window", "tokens_per_block": 64, "window": 128},
               {"kind": "sliding_window", "tokens_per_block": 8, "window": 128}],
    "chunk_states": {"0": {"0..3": "present"}, "1": {"15": "present"},
                     "2": {"118..121": "present"}},
}

SWEEP_BASE = """\
schema = "sweep/1"
name = "sw"
[model]
name = "hybrid-demo"
[hardware]
gpu_blocks = 4000
[cpu_cache]
capacity = "64GiB"
[workload]
kind = "multiturn"
sessions = 3
limit = 5
"""


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str, *needles: str) -> str:
    """The single stderr line, checked to be a located ``kvsim: error:`` naming every needle."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("kvsim: error: "), line
    for n in needles:
        assert n in line, line
    return line


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def check_toml(data: dict[str, Any]) -> str:
    """A check/1 TOML file of ``data`` (JSON-like values only)."""
    from sim.io.check import toml_value

    lines = []
    tables = []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {toml_value(v)}")
    for k, v in tables:
        for g, table in v.items():
            lines += ["", f"[{k}.\"{g}\"]"] + [f'"{r}" = {toml_value(s)}' for r, s in table.items()]
    return "\n".join(lines) + "\n"


# -- A: the copy path without torch -----------------------------------------------------------


@pytest.fixture
def no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch looks not installed: ``find_spec`` finds nothing and ``import torch`` fails."""
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        if name == "torch" or name.startswith("torch."):
            return None
        return real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "sim.engine.copypath", raising=False)


@pytest.mark.parametrize("command", ["run", "compare"])
def test_a_copy_path_without_torch_is_refused_before_writing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_torch: None, command: str) -> None:
    f = write(tmp_path, TINY + "[copy_path]\nenabled = true\n")
    out = tmp_path / "out"
    extra = ["--jobs", "1"] if command == "compare" else []
    code, _, err = run([command, str(f), "--out", str(out), "-q", *extra], capsys)
    assert code == 2
    line = one_line(err, f"{f}:copy_path.enabled", "torch", "pip install 'kvsim[torch]'")
    assert "not installed" in line
    assert not out.exists()


def test_a_copy_path_from_set_without_torch_names_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_torch: None) -> None:
    f = write(tmp_path, TINY)
    out = tmp_path / "out"
    code, _, err = run(["run", str(f), "--out", str(out), "-q", "--set", "copy_path.enabled=true"], capsys)
    assert code == 2
    one_line(err, "--set:copy_path.enabled", "pip install 'kvsim[torch]'")
    assert not out.exists()


def test_a_check_copy_path_without_torch(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         no_torch: None) -> None:
    f = tmp_path / "s6.json"
    f.write_text(json.dumps(S6))
    code, out, err = run(["check", str(f), "--copy-path"], capsys)
    assert code == 2 and out == ""
    one_line(err, "--copy-path", "pip install 'kvsim[torch]'")


# -- B: sizes beyond the documented limits ---------------------------------------------------------


@pytest.mark.parametrize(("old", "new", "key", "limit"), [
    ("chunks = 100", 'capacity = "1e30GiB"', "cpu_cache.capacity", f"{MAX_BYTES:,}"),
    ("gpu_blocks = 4000", "gpu_blocks = 10000000000", "hardware.gpu_blocks", f"{MAX_GPU_BLOCKS:,}"),
    ("gpu_blocks = 4000", 'gpu_kv_bytes = "1e30B"', "hardware.gpu_kv_bytes", f"{MAX_BYTES:,}"),
    ("gpu_blocks = 4000", 'gpu_kv_bytes = "1000000TiB"', "hardware.gpu_kv_bytes", f"{MAX_GPU_BLOCKS:,}"),
    ("sessions = 3", "sessions = 1000000000000", "workload.sessions", f"{MAX_REQUESTS:,}"),
    ("chunks = 100", "chunks = 2000000000000", "cpu_cache.chunks", f"{MAX_CPU_CHUNKS:,}"),
    ('name = "tiny"', 'name = "tiny"\n[scheduler]\nmax_num_batched_tokens = 100000000000',
     "scheduler.max_num_batched_tokens", f"{MAX_TOKENS:,}"),
    ('name = "tiny"', 'name = "tiny"\nseed = 10000000000000000000', "seed", f"{2**63 - 1:,}"),
])
def test_b_sizes_beyond_the_limits_are_refused_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, key: str, limit: str) -> None:
    assert old in TINY
    f = write(tmp_path, TINY.replace(old, new, 1))
    code, _, err = run(["validate", str(f)], capsys)
    assert code == 2
    line = one_line(err, f"{f}:{key}", limit)
    assert "limit" in line
    out = tmp_path / "out"
    code, _, err = run(["run", str(f), "--out", str(out), "-q"], capsys)
    assert code == 2 and not out.exists()
    one_line(err, f"{f}:{key}")


def test_b_a_1_tib_cache_of_2_mib_chunks_is_accepted(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # hybrid-demo: 576 KiB per block id; 4 blocks per chunk: 2.25 MiB slots. (10 TiB is
    # refused since the node-RAM bound: an H200 node has 2 TB; 1 TiB gets a warning only)
    text = TINY.replace("chunks = 100", 'capacity = "1TiB"') + "[scheduler]\nblocks_per_chunk = 4\n"
    f = write(tmp_path, text)
    code, _, err = run(["validate", str(f)], capsys)
    assert code == 0, err


# -- C: tensor parallelism must divide the KV heads --------------------------------------------


def test_c_tensor_parallel_not_dividing_kv_heads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path, TINY + "[costs]\ntensor_parallel = 3\n")
    code, _, err = run(["validate", str(f)], capsys)
    assert code == 2
    one_line(err, f"{f}:costs.tensor_parallel", "3", "8 KV heads")
    out = tmp_path / "out"
    code, _, err = run(["run", str(f), "--out", str(out), "-q"], capsys)
    assert code == 2 and not out.exists()
    one_line(err, "costs.tensor_parallel")


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_c_divisors_and_multiples_of_the_kv_heads_are_accepted(tmp_path: Path, tp: int,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path, TINY + f"[costs]\ntensor_parallel = {tp}\n")
    code, _, err = run(["validate", str(f)], capsys)
    assert code == 0, err


# -- D: a huge check prompt; one bad case never stops kvsim regress -----------------------------------


def test_d_huge_num_tokens_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path, check_toml(dict(S6, num_tokens=100_000_000_000)), "huge.toml")
    code, out, err = run(["validate", str(f)], capsys)
    assert code == 2
    one_line(err, f"{f}:num_tokens", f"{MAX_TOKENS:,}")
    code, out, err = run(["check", str(f)], capsys)
    assert code == 2 and out == ""
    one_line(err, f"{f}:num_tokens", f"{MAX_TOKENS:,}")


def test_d_regress_reports_a_bad_case_and_runs_the_rest(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copy(CRASH / "s6-b3904-left-missing.toml", lib / "a-good.toml")
    shutil.copy(CRASH / "s6-b3904-left-present.toml", lib / "c-good.toml")
    text = (CRASH / "s6-b3904-left-missing.toml").read_text()
    assert "num_tokens = 4353" in text
    (lib / "b-huge.toml").write_text(text.replace("num_tokens = 4353", "num_tokens = 100000000000"))
    code, out, err = run(["regress", str(lib), "--jobs", "1"], capsys)
    assert code != 0
    one_line(err, "b-huge.toml:num_tokens", f"{MAX_TOKENS:,}")
    assert "2 passed, 1 failed" in out
    rows = {ln.split()[0]: ln.split()[-1] for ln in out.splitlines() if ln.endswith(("ok", "FAIL"))}
    assert rows == {"a-good.toml": "ok", "b-huge.toml": "FAIL", "c-good.toml": "ok"}


# -- E: a JSON batch with bad items exits 1 after printing every item ------------------------------


def test_e_json_batch_with_an_error_item_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "batch.json"
    f.write_text(json.dumps([S6, dict(S6, num_tokens=-5), S6]))
    code, out, _ = run(["check", str(f), "--json"], capsys)
    assert code == 1
    res = json.loads(out)
    assert len(res) == 3 and "num_tokens" in res[1]["error"]
    assert res[0]["old"]["external_tokens"] == res[2]["old"]["external_tokens"] == 3904


def test_e_jsonl_batch_with_an_error_item_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "batch.jsonl"
    f.write_text(json.dumps(S6) + "\n{not json\n" + json.dumps(S6) + "\n")
    code, out, _ = run(["check", str(f), "--jsonl"], capsys)
    assert code == 1
    lines = out.strip().splitlines()
    assert len(lines) == 3 and "line 2" in json.loads(lines[1])["error"]


def test_e_text_batch_prints_the_error_item_and_exits_1(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "batch.json"
    f.write_text(json.dumps([S6, dict(S6, num_tokens=-5)]))
    code, out, _ = run(["check", str(f)], capsys)
    assert code == 1
    assert f"{f}[1]" in out and "num_tokens" in out


# -- F: overlapping ranges, repeated points, equal grid values, an empty grid -----------------------


def test_f_overlapping_chunk_state_ranges(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(json.dumps(S6))
    data["chunk_states"]["2"] = {"110..121": "present", "118..119": "pending"}
    f = tmp_path / "overlap.json"
    f.write_text(json.dumps(data))
    code, out, err = run(["check", str(f)], capsys)
    assert code == 2 and out == ""
    one_line(err, f"{f}:chunk_states.2", '"110..121"', '"118..119"', "118")


def _sweep(tmp_path: Path, sweep: str) -> Path:
    return write(tmp_path, SWEEP_BASE + sweep, "sw.toml")


def _sweep_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], f: Path, *needles: str) -> None:
    code, _, err = run(["validate", str(f)], capsys)
    assert code == 2
    one_line(err, *needles)
    out = tmp_path / "out"
    code, _, err = run(["sweep", str(f), "--out", str(out), "-q", "--jobs", "1"], capsys)
    assert code == 2 and not out.exists()
    one_line(err, *needles)


def test_f_repeated_sweep_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _sweep(tmp_path, '[sweep]\npoints = [{ "cpu_cache.policy" = "lru" }, { "cpu_cache.policy" = "arc" },'
                         ' { "cpu_cache.policy" = "lru" }]\n')
    _sweep_refused(tmp_path, capsys, f, f"{f}:sweep.points[2]", "sweep.points[0]", "lru")


def test_f_sweep_grid_values_equal_after_unit_parsing(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    f = _sweep(tmp_path, '[sweep]\ngrid = { "cpu_cache.capacity" = ["1GiB", "2GiB", "1024MiB"] }\n')
    _sweep_refused(tmp_path, capsys, f, f'{f}:sweep.grid."cpu_cache.capacity"', "'1GiB'", "'1024MiB'")
    f = _sweep(tmp_path, '[sweep]\ngrid = { "cpu_cache.capacity" = ["1GiB", 1073741824] }\n')
    _sweep_refused(tmp_path, capsys, f, f'{f}:sweep.grid."cpu_cache.capacity"', "'1GiB'", "1073741824")


def test_f_empty_sweep_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _sweep(tmp_path, "[sweep]\ngrid = {}\n")
    _sweep_refused(tmp_path, capsys, f, f"{f}:sweep.grid", "empty")


# -- G: errors caused by --set name --set -------------------------------------------------------------


@pytest.mark.parametrize(("item", "key"), [
    ("model.name=nope", "model.name"),
    ("hardware.profile=nope", "hardware.profile"),
    ("hardware.gpu_kv_bytes=1", "hardware.gpu_kv_bytes"),
    ("cpu_cache.capacity=1", "cpu_cache.capacity"),
    ("costs.tensor_parallel=3", "costs.tensor_parallel"),
    ('cpu_cache.capacity="1e30GiB"', "cpu_cache.capacity"),
])
@pytest.mark.parametrize("command", ["run", "compare"])
def test_g_errors_caused_by_set_name_set(tmp_path: Path, capsys: pytest.CaptureFixture[str], item: str,
                                         key: str, command: str) -> None:
    f = write(tmp_path, TINY)
    out = tmp_path / "out"
    extra = ["--jobs", "1"] if command == "compare" else []
    code, _, err = run([command, str(f), "--out", str(out), "-q", "--set", item, *extra], capsys)
    assert code == 2
    line = one_line(err, f"kvsim: error: --set:{key}: ")
    assert str(f) not in line
    assert not out.exists()


def test_local_hit_without_prefix_caching_is_refused(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # a GPU hit needs the GPU prefix cache: this once reached the model and raised there
    f = tmp_path / "c.toml"
    f.write_text('schema = "check/1"\ntokens_per_hash = 16\nnum_tokens = 64\n'
                 'groups = [{kind = "full", tokens_per_block = 16}]\n'
                 'gpu_computed_tokens = 32\nprefix_caching = false\n', encoding="utf-8")
    code, _, err = run(["check", str(f)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "gpu_computed_tokens" in err and "prefix_caching" in err


@pytest.mark.parametrize("step", ['"zero"', "{overhead_s = 0.001}"])
def test_enforce_eager_without_the_roofline_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       step: str) -> None:
    # the launch floor counts the model's decoder layers: a step table or "zero" has none
    f = write(tmp_path, TINY + f"[costs]\nenforce_eager = true\nstep = {step}\n")
    out = tmp_path / "out"
    code, _, err = run(["run", str(f), "--out", str(out), "-q"], capsys)
    assert code == 2
    one_line(err, f"kvsim: error: {f}:costs.enforce_eager: ", 'costs.step = "auto"')
    assert not out.exists()


@pytest.mark.parametrize(("setting", "allowed"), [
    ('costs.tokenize="yes"', "a valid boolean"),
    ("hardware.host_tokenize_token_s=-1", "greater than or equal to 0"),
])
def test_a_bad_tokenize_setting_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            setting: str, allowed: str) -> None:
    f = write(tmp_path, TINY)
    out = tmp_path / "out"
    code, _, err = run(["run", str(f), "--set", setting, "--out", str(out), "-q"], capsys)
    assert code == 2
    one_line(err, f"kvsim: error: --set:{setting.split('=')[0]}: ", allowed)
    assert not out.exists()
