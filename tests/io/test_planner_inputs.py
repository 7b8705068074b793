"""Inputs a capacity planner relies on: host RAM and GPUs of the node (hardware bounds,
the tensor parallelism that fits) and ``--set`` on the workload's kind and key removal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sim.errors import InputError
from sim.io.scenario import HARDWARE_WARNINGS_KEY, load_hardware_file, load_run, scenarios_dir
from sim.io.validate import validate_file
from sim.io.workload import MultiTurnParams

BASE = """
schema = "run/1"
[model]
name = "hybrid-demo"
[hardware]
profile = "{profile}"
gpu_kv_bytes = "8GiB"
[cpu_cache]
capacity = "{capacity}"
[costs]
tensor_parallel = {tp}
"""

#: a DGX H200: 2 TB of host RAM for 8 GPUs
NODE_GIB = 2e12 / 2**30          # 1862.6 GiB
SHARE_TP1_GIB = NODE_GIB / 8     # 232.8 GiB
RAW_BYTES = re.compile(r"\d{7,}")  # a byte count written out (sizes must be in GiB)


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def run(tmp_path: Path, capacity: str = "64GiB", tp: int = 1, profile: str = "h200",
        overrides: list[str] | None = None):
    return load_run(write(tmp_path, BASE.format(profile=profile, capacity=capacity, tp=tp)), overrides or [])


def error_of(tmp_path: Path, text: str, overrides: list[str] | None = None) -> InputError:
    with pytest.raises(InputError) as info:
        load_run(write(tmp_path, text), overrides or [])
    return info.value


# -- hardware bounds ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "gpus", "ram"), [("h100", 8, 2 * 10**12), ("h200", 8, 2 * 10**12),
                                                   ("b200", 8, 18 * 10**11), ("gh200", 1, 480 * 10**9)])
def test_shipped_profiles_state_the_node(name: str, gpus: int, ram: int):
    hw = load_hardware_file(scenarios_dir() / "hardware" / f"{name}.toml")
    assert hw.gpus_per_node == gpus and hw.cpu_ram_bytes == ram


def test_cpu_cache_beyond_the_node_ram_is_refused(tmp_path: Path):
    with pytest.raises(InputError) as info:
        run(tmp_path, capacity="2000GiB", tp=8)
    err = info.value
    assert err.key == "cpu_cache.capacity"
    text = str(err)
    assert "2,000 GiB" in text and f"{NODE_GIB:,.1f} GiB" in text and "h200" in text
    assert not RAW_BYTES.search(text), text


def test_cpu_cache_in_chunks_beyond_the_node_ram_is_refused(tmp_path: Path):
    text = BASE.format(profile="h200", capacity="1GiB", tp=1)
    text = text.replace('capacity = "1GiB"', "chunks = 1_000_000_000")
    err = error_of(tmp_path, text)
    assert err.key == "cpu_cache.chunks" and "GiB" in err.problem
    assert not RAW_BYTES.search(str(err)), str(err)


def test_cpu_cache_beyond_the_share_warns(tmp_path: Path):
    spec = run(tmp_path, capacity="256GiB", tp=1)
    assert len(spec.warnings) == 1
    (line,) = spec.warnings
    assert "\n" not in line and "cpu_cache.capacity" in line
    assert "256 GiB" in line and f"{SHARE_TP1_GIB:,.1f} GiB" in line and "8 GPUs" in line
    assert not RAW_BYTES.search(line), line
    assert HARDWARE_WARNINGS_KEY == "hardware_warnings"
    # within the share: no warning; the share grows with the tensor parallelism
    assert run(tmp_path, capacity="128GiB", tp=1).warnings == []
    assert run(tmp_path, capacity="256GiB", tp=2).warnings == []
    assert run(tmp_path, capacity="64GiB").warnings == []


def test_whatif_capacities_on_one_h200_stay_valid(tmp_path: Path):
    for capacity in ("256GiB", "512GiB"):
        spec = load_run(scenarios_dir() / "default.toml", [f"cpu_cache.capacity={capacity}"])
        assert spec.cpu_cache_bytes == int(capacity[:-3]) * 2**30 and len(spec.warnings) == 1
    for name in ("cpu-ram.toml", "pcie.toml"):
        validate_file(scenarios_dir() / "whatif" / name)


LLAMA = """
schema = "run/1"
[model]
name = "llama-3.1-70b"
[hardware]
profile = "{profile}"
[cpu_cache]
capacity = "64GiB"
"""


@pytest.mark.parametrize("profile", ["h100", "h200"])
def test_a_model_too_big_for_the_gpu_names_the_tensor_parallelism_that_fits(tmp_path: Path, profile: str):
    err = error_of(tmp_path, LLAMA.format(profile=profile))
    text = str(err)
    assert err.key == "hardware.gpu_kv_bytes"
    assert "tensor_parallel = 2" in text and "GiB" in text and "llama-3.1-70b" in text
    assert not RAW_BYTES.search(text), text
    # and the suggestion is right: TP 2 validates
    load_run(write(tmp_path, LLAMA.format(profile=profile) + "[costs]\ntensor_parallel = 2\n"))


SIX_HEADS = """
schema = "run/1"
[model]
groups = [{ kind = "full", tokens_per_block = 16, layers = 8, kv_heads = 6, head_size = 64 }]
weights_bytes = "300GB"
[hardware]
profile = "h200"
[cpu_cache]
capacity = "1GiB"
"""


def test_no_tensor_parallelism_fits(tmp_path: Path):
    # 300 GB of weights need 4 H200s, and 4 (or 8) GPUs cannot share 6 KV heads
    err = error_of(tmp_path, SIX_HEADS)
    assert err.key == "hardware.gpu_kv_bytes" and "no tensor_parallel" in str(err)
    assert not RAW_BYTES.search(str(err)), str(err)
    # with 12 heads, 4 GPUs fit
    err = error_of(tmp_path, SIX_HEADS.replace("kv_heads = 6", "kv_heads = 12"))
    assert "tensor_parallel = 4" in str(err)


def test_the_suggestion_stays_within_the_node(tmp_path: Path):
    hw = (scenarios_dir() / "hardware" / "h200.toml").read_text(encoding="utf-8")
    write(tmp_path, hw.replace("gpus_per_node = 8", "gpus_per_node = 2"), "two.toml")
    err = error_of(tmp_path, SIX_HEADS.replace("kv_heads = 6", "kv_heads = 12").replace(
        'profile = "h200"', 'profile = "two.toml"'))
    assert "no tensor_parallel" in str(err) and "2 GPUs" in str(err)


# -- --set on the workload's kind -------------------------------------------------------------

TRACE_LINES = "".join(
    f'{{"timestamp": {i * 100}, "input_length": 1000, "output_length": 10, "hash_ids": [0, {i + 1}]}}\n'
    for i in range(5))

GENERATOR = """
schema = "run/1"
[model]
name = "hybrid-demo"
[hardware]
gpu_kv_bytes = "8GiB"
[cpu_cache]
capacity = "1GiB"
[workload]
kind = "multiturn"
sessions = 3
think_time_mean_s = 5.0
limit = 4
"""

TRACE = GENERATOR.replace('kind = "multiturn"\nsessions = 3\nthink_time_mean_s = 5.0\n',
                          'kind = "mooncake"\npath = "t.jsonl"\ntime_scale = 2.0\n')


def test_kind_switch_from_a_generator_to_a_trace(tmp_path: Path):
    write(tmp_path, TRACE_LINES, "t.jsonl")
    p = write(tmp_path, GENERATOR)
    spec = load_run(p, ['workload.kind="mooncake"', 'workload.path="t.jsonl"'])
    wl = spec.scenario.workload
    assert wl.kind == "mooncake" and spec.workload_path == tmp_path / "t.jsonl"
    assert wl.limit == 4   # a key both kinds have stays
    assert len(list(spec.requests())) == 4
    spec = load_run(p, ['workload.kind="uniform"', "workload.requests=2"])
    assert spec.scenario.workload.kind == "uniform" and len(list(spec.requests())) == 2


def test_kind_switch_from_a_trace_to_a_generator(tmp_path: Path):
    write(tmp_path, TRACE_LINES, "t.jsonl")
    p = write(tmp_path, TRACE)
    spec = load_run(p, ['workload.kind="multiturn"', "workload.sessions=2"])
    assert spec.scenario.workload.kind == "multiturn" and spec.multiturn_params()["sessions"] == 2
    spec = load_run(p, ['workload.kind="uniform"'])
    assert spec.scenario.workload.kind == "uniform"
    # trace and mooncake share a model: nothing is dropped
    assert load_run(p, ['workload.kind="trace"']).scenario.workload.time_scale == 2.0


def test_kind_switch_to_a_named_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    write(tmp_path, TRACE_LINES, "conversation_trace.jsonl")
    monkeypatch.setenv("KVSIM_TRACES", str(tmp_path))
    spec = load_run(scenarios_dir() / "default.toml",
                    ['workload.kind="mooncake"', 'workload.trace="mooncake-conversation"'])
    assert spec.scenario.workload.kind == "mooncake"


def test_a_key_of_another_kind_names_the_kind_and_its_keys(tmp_path: Path):
    write(tmp_path, TRACE_LINES, "t.jsonl")
    err = error_of(tmp_path, GENERATOR, ['workload.trace="x"'])
    assert (err.source, err.key) == ("--set", "workload.trace")
    assert "'multiturn'" in err.problem and "sessions" in err.allowed and "think_time_mean_s" in err.allowed
    assert 'workload.kind="mooncake"' in err.allowed   # what to do
    err = error_of(tmp_path, TRACE, ["workload.sessions=3"])
    assert (err.source, err.key) == ("--set", "workload.sessions")
    assert "'mooncake'" in err.problem and "time_scale" in err.allowed
    # in the file
    err = error_of(tmp_path, GENERATOR.replace("sessions = 3", "requests = 3"))
    assert err.key == "workload.requests" and "'multiturn'" in err.problem and "sessions" in err.allowed
    err = error_of(tmp_path, GENERATOR.replace("sessions = 3", 'trace = "x"'))
    assert err.key == "workload.trace" and "'multiturn'" in err.problem


# -- removing a key with --set ---------------------------------------------------------------


def test_set_null_removes_a_key(tmp_path: Path):
    write(tmp_path, TRACE_LINES, "t.jsonl")
    text = GENERATOR.replace('schema = "run/1"', 'schema = "run/1"\nname = "given"')
    p = write(tmp_path, text.replace("[workload]", "[output]\nmax_sim_time_s = 9.0\n[workload]"))
    spec = load_run(p, ["workload.sessions=null", "output.max_sim_time_s=null", "name=null",
                        "workload.limit=null", "costs.tensor_parallel=null"])
    assert spec.multiturn_params()["sessions"] == MultiTurnParams().sessions
    assert spec.scenario.output.max_sim_time_s is None and spec.name == "run"
    assert spec.scenario.workload.limit is None
    # a key not given, or a table: removed all the same
    assert load_run(p, ["copy_path.memory_limit=null"]).scenario.copy_path.memory_limit is None
    assert load_run(p, ["workload=null"]).scenario.workload.kind == "multiturn"
    # a quoted "null" is the string
    assert load_run(p, ['name="null"']).name == "null"
    # removing a required key is an error of the option
    err = error_of(tmp_path, GENERATOR, ["cpu_cache.capacity=null"])
    assert err.key == "cpu_cache" and "capacity" in err.allowed
