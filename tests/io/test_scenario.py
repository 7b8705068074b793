"""``run/1``, ``model/1`` and ``hardware/1`` files: defaults, units, errors, overrides, round trips."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from sim.errors import InputError
from sim.io.scenario import (
    RunScenario,
    group_spec,
    load_model_file,
    load_run,
    model_shape,
    parse_bandwidth,
    parse_size,
    scenarios_dir,
    step_model_for,
)
from sim.io.validate import validate_file
from sim.io.workload import MultiTurnParams
from sim.model.costs import (
    DEFAULT_ATTENTION_EFFICIENCY,
    DEFAULT_MBU,
    DEFAULT_MFU,
    GPU_PROFILES,
    ZERO_STEP,
    ZERO_TRANSFER,
    RooflineStepModel,
    StepCostModel,
    roofline_step_model,
)
from sim.model.cpu_cache import EvictionPolicy, capacity_from_bytes
from sim.model.layout import GroupKind
from tests.helpers import ROOT


def borrowed_step(profile: str, tp: int = 1, model: str = "hybrid-demo") -> RooflineStepModel:
    """The step model of ``model`` borrowing ``profile``'s shape: the profile's parameters and
    weights, the model's own groups for the attention FLOPs, the H200's figures."""
    models = scenarios_dir() / "models"
    p, m = load_model_file(models / f"{profile}.toml"), load_model_file(models / f"{model}.toml")
    assert p.shape is not None
    shape = model_shape(p.name, p.shape, p.groups, p.weights_bytes, profile, "")
    return roofline_step_model(GPU_PROFILES["h200"], shape, [group_spec(g, tp) for g in m.groups],
                               param_groups=[group_spec(g, 1) for g in p.groups], tensor_parallel=tp)


#: hybrid-demo: 16 tokens x 18 layers x 2 (K, V) x 8 heads x 64 x 2 bytes, worked by hand
HYBRID_BLOCK = 16 * 18 * 2 * 8 * 64 * 2
GIB = 2**30

MINIMAL = """
schema = "run/1"
[model]
name = "hybrid-demo"
[cpu_cache]
chunks = 100
"""

INLINE_GROUPS = """
groups = [
  { kind = "full", tokens_per_block = 16, layers = 18, kv_heads = 8, head_size = 64 },
  { kind = "sliding_window", tokens_per_block = 16, window = 128, layers = 18, kv_heads = 8, head_size = 64 },
]
"""


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def error_of(path: Path, overrides: list[str] | None = None) -> InputError:
    with pytest.raises(InputError) as info:
        load_run(path, overrides or [])
    return info.value


# -- defaults ---------------------------------------------------------------------------------


def test_every_default_is_applied(tmp_path: Path):
    spec = load_run(write(tmp_path, MINIMAL, "my-study.toml"))
    sc = spec.scenario
    assert spec.name == "my-study"  # the file stem
    assert (sc.seed, sc.window_logic, sc.on_crash) == (0, "new", "record")
    assert sc.hardware.profile == "h200" and spec.hardware.name == "h200"
    assert sc.cpu_cache.policy == "lru"
    s = sc.scheduler
    assert (s.max_num_batched_tokens, s.max_num_seqs, s.prefix_caching, s.blocks_per_chunk,
            s.tokens_per_hash, s.offload_prompt_only, s.offloading, s.fast_forward) == (
        8192, 256, True, 1, 16, True, True, True)
    assert sc.workload.kind == "multiturn" and sc.workload.limit is None
    assert spec.multiturn_params() == dataclasses.asdict(MultiTurnParams())
    assert (sc.costs.step, sc.costs.transfer, sc.costs.tensor_parallel) == ("auto", "hardware", 1)
    assert sc.copy_path.enabled is False
    assert (sc.output.occupancy_interval_s, sc.output.max_sim_time_s, sc.output.stop_at_waiting) == (
        1.0, None, None)

    # derived: 90% of 141 GB minus 30.5e9 parameters x 2 bytes, in blocks of 589,824 B
    assert spec.block_bytes == HYBRID_BLOCK == 589_824
    assert spec.gpu_kv_bytes == int(0.9 * 141e9) - 61_000_000_000
    assert spec.gpu_blocks == (int(0.9 * 141e9) - 61_000_000_000) // 589_824
    assert spec.cpu_chunks == 100

    cfg = spec.engine_config()
    assert cfg.gpu_blocks == spec.gpu_blocks and cfg.cpu_capacity_chunks == 100
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.prefix_caching, cfg.offloading,
            cfg.offload_prompt_only, cfg.fast_forward) == (8192, 256, True, True, True, True)
    assert cfg.eviction is EvictionPolicy.LRU
    assert (cfg.window_logic, cfg.on_crash) == ("new", "record")
    assert cfg.step_cost == borrowed_step("qwen3-30b-a3b")
    h200 = GPU_PROFILES["h200"]
    assert cfg.h2d == h200.h2d and cfg.d2h == h200.d2h  # the hardware file agrees with sim.model.costs
    assert (cfg.occupancy_interval_s, cfg.max_sim_time_s) == (1.0, None)
    assert [g.kind for g in cfg.layout.groups] == [GroupKind.FULL, GroupKind.SLIDING_WINDOW]
    assert cfg.layout.tokens_per_hash == 16 and cfg.layout.blocks_per_chunk == 1


def test_hardware_profiles_match_the_cost_model():
    for name in sorted(GPU_PROFILES):
        hw = tomllib.loads((scenarios_dir() / "hardware" / f"{name}.toml").read_text())
        assert hw["gpu"] == name
        assert parse_size(hw["hbm_bytes"]) == GPU_PROFILES[name].hbm_bytes
        for d in ("h2d", "d2h"):
            link = getattr(GPU_PROFILES[name], d)
            assert parse_bandwidth(hw[f"{d}_bandwidth"]) == link.bandwidth_bytes_per_s
            assert hw[f"{d}_latency_s"] == link.latency_s
            assert hw[f"{d}_piece_overhead_s"] == link.piece_overhead_s
            assert hw[f"{d}_duplex_factor"] == link.duplex_factor
        host = GPU_PROFILES[name].host
        assert (hw["host_step_s"], hw["host_per_request_s"], hw["host_per_hashed_block_s"]) == (
            host.step_s, host.per_request_s, host.per_hashed_block_s)


def test_cpu_capacity_in_bytes_follows_spec_3_1(tmp_path: Path):
    text = MINIMAL.replace("chunks = 100", 'capacity = "16GiB"') + "[scheduler]\nblocks_per_chunk = 4\n"
    spec = load_run(write(tmp_path, text))
    # one slot = one block id (all groups' tensors) x 4 blocks, page aligned
    slot = 4 * HYBRID_BLOCK
    assert slot % 4096 == 0
    assert spec.cpu_chunks == 16 * GIB // slot == 7281
    assert spec.cpu_chunks == capacity_from_bytes(16 * GIB, HYBRID_BLOCK, 4)
    assert spec.cpu_slot_bytes == slot and spec.cpu_cache_bytes == 16 * GIB
    # given in slots: the bytes those slots take; no offloading: no CPU cache
    chunks = load_run(write(tmp_path, MINIMAL + "[scheduler]\nblocks_per_chunk = 4\n"))
    assert chunks.cpu_chunks == 100 and chunks.cpu_cache_bytes == 100 * slot
    off = load_run(write(tmp_path, text), ["scheduler.offloading=false"])
    assert off.cpu_cache_bytes == 0


def test_tensor_parallel_shards_heads_and_counts_copies(tmp_path: Path):
    text = (MINIMAL.replace("chunks = 100", 'capacity = "16GiB"')
            + '[hardware]\ngpu_kv_bytes = "8GiB"\n[costs]\ntensor_parallel = 2\n')
    spec = load_run(write(tmp_path, text))
    assert spec.block_bytes == HYBRID_BLOCK // 2  # 4 of the 8 KV heads per worker
    assert spec.gpu_blocks == 8 * GIB // (HYBRID_BLOCK // 2)
    assert spec.cpu_chunks == 16 * GIB // HYBRID_BLOCK  # two copies of a half-size slot
    assert spec.step_cost == borrowed_step("qwen3-30b-a3b", tp=2)


def test_explicit_gpu_pool(tmp_path: Path):
    spec = load_run(write(tmp_path, MINIMAL + "[hardware]\ngpu_blocks = 5000\n"))
    assert spec.gpu_blocks == 5000 and spec.gpu_kv_bytes is None
    spec = load_run(write(tmp_path, MINIMAL + '[hardware]\ngpu_kv_bytes = "1GiB"\n'))
    assert spec.gpu_blocks == GIB // HYBRID_BLOCK == 1820


# -- units ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [
    ("64GiB", 64 * 2**30), ("500MB", 500_000_000), ("1.5KiB", 1536), ("2 TB", 2 * 10**12),
    ("7", 7), ("10B", 10), ("3kb", 3000), (12345, 12345), ("1e3MB", 10**9),
])
def test_parse_size(text: object, value: int):
    assert parse_size(text) == value


@pytest.mark.parametrize(("text", "value"), [
    ("55GB/s", 55 * 10**9), ("55GB", 55 * 10**9), ("1 GiB/s", 2**30), (1e9, 10**9), (10, 10),
])
def test_parse_bandwidth(text: object, value: int):
    assert parse_bandwidth(text) == value


@pytest.mark.parametrize("bad", ["64GX", "lots", "", "GiB", True, [1]])
def test_bad_sizes(bad: object):
    with pytest.raises(ValueError, match="GiB"):
        parse_size(bad)


def test_bad_unit_names_the_key_and_the_units(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL.replace("chunks = 100", 'capacity = "64GX"')))
    assert err.key == "cpu_cache.capacity"
    assert "'64GX'" in err.problem
    assert "GiB" in err.allowed and "MB" in err.allowed
    assert str(err).startswith(f"{tmp_path / 'run.toml'}:cpu_cache.capacity: ")


def test_bad_bandwidth(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL + '[hardware]\nh2d_bandwidth = "fast"\n'))
    assert err.key == "hardware.h2d_bandwidth" and "/s" in err.allowed


# -- unknown keys, types, schema --------------------------------------------------------------


def test_unknown_top_level_key(tmp_path: Path):
    err = error_of(write(tmp_path, 'colour = "red"\n' + MINIMAL))
    assert (err.key, err.problem) == ("colour", "unknown key")
    assert "window_logic" in err.allowed and "cpu_cache" in err.allowed


def test_unknown_nested_key(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL + "capacty = 5\n"))
    assert (err.key, err.problem) == ("cpu_cache.capacty", "unknown key")
    assert err.allowed == "capacity, chunks, policy"


def test_unknown_key_in_a_group_and_in_a_workload(tmp_path: Path):
    groups = INLINE_GROUPS.replace("head_size = 64 }", "head_size = 64, x = 1 }", 1)
    text = MINIMAL.replace('name = "hybrid-demo"', groups)
    err = error_of(write(tmp_path, text))
    assert err.key == "model.groups.0.x" and "tokens_per_block" in err.allowed
    text = MINIMAL + '[workload]\nkind = "mooncake"\npath = "t.jsonl"\nsessions = 3\n'
    err = error_of(write(tmp_path, text))
    assert err.key == "workload.sessions" and "time_scale" in err.allowed


def test_wrong_types_and_values(tmp_path: Path):
    err = error_of(write(tmp_path, "seed = 1.5\n" + MINIMAL))
    assert err.key == "seed" and "1.5" in err.problem and "integer" in err.allowed
    err = error_of(write(tmp_path, 'window_logic = "newest"\n' + MINIMAL))
    assert err.key == "window_logic" and "'newest'" in err.problem and "'old'" in err.allowed
    err = error_of(write(tmp_path, MINIMAL + 'policy = "fifo"\n'))
    assert err.key == "cpu_cache.policy" and "'lru'" in err.allowed
    err = error_of(write(tmp_path, MINIMAL + "[scheduler]\nmax_num_seqs = 0\n"))
    assert err.key == "scheduler.max_num_seqs" and "greater than 0" in err.allowed
    err = error_of(write(tmp_path, MINIMAL + '[scheduler]\nprefix_caching = "yes"\n'))
    assert err.key == "scheduler.prefix_caching"
    err = error_of(write(tmp_path, MINIMAL + '[workload]\nkind = "poisson"\n'))
    assert err.key == "workload.kind" and "multiturn" in err.allowed
    spec = load_run(write(tmp_path, MINIMAL + "[workload]\nsessions = 3\n"))
    assert spec.scenario.workload.kind == "multiturn"
    err = error_of(write(tmp_path, 'name = "../x"\n' + MINIMAL))
    assert err.key == "name"


def test_wrong_and_missing_schema(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL.replace('"run/1"', '"run/2"')))
    assert err.key == "schema" and "'run/2'" in err.problem and err.allowed == '"run/1"'
    err = error_of(write(tmp_path, MINIMAL.replace('schema = "run/1"', "")))
    assert (err.key, err.problem) == ("schema", "missing")


def test_missing_model_section(tmp_path: Path):
    err = error_of(write(tmp_path, 'schema = "run/1"\n[cpu_cache]\nchunks = 1\n'))
    assert (err.key, err.problem) == ("model", "required key missing")


def test_toml_syntax_error_names_the_line(tmp_path: Path):
    err = error_of(write(tmp_path, 'schema = "run/1"\nseed = = 3\n'))
    assert err.key == "line 2" and "bad TOML" in err.problem


def test_missing_file():
    err = error_of(Path("/nonexistent/run.toml"))
    assert err.source == "/nonexistent/run.toml" and err.problem == "no such file"


def test_copy_path_section_and_assertions(tmp_path: Path):
    head = MINIMAL.replace('schema = "run/1"', 'schema = "run/1"\nassertions = false')
    spec = load_run(write(tmp_path, head
                          + '[copy_path]\nenabled = true\nmode = "realistic"\ntiming = "measured"\n'
                          'memory_limit = "2GiB"\n'))
    cfg = spec.engine_config()
    assert cfg.assertions is False and cfg.copy_path is not None
    assert (cfg.copy_path.mode, cfg.copy_path.timing, cfg.copy_path.memory_limit_bytes) == (
        "realistic", "measured", 2 * 2**30)
    assert load_run(write(tmp_path, MINIMAL, "b.toml")).engine_config().copy_path is None
    err = error_of(write(tmp_path, MINIMAL + '[copy_path]\nmode = "fast"\n', "c.toml"))
    assert err.key == "copy_path.mode" and "fingerprint" in err.allowed


# -- model: by name, path, inline -------------------------------------------------------------


def test_model_by_name_path_and_inline_agree(tmp_path: Path):
    by_name = load_run(write(tmp_path, MINIMAL, "a.toml"))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.toml").write_text(
        (scenarios_dir() / "models" / "hybrid-demo.toml").read_text())
    by_path = load_run(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"', 'path = "models/m.toml"'),
                             "b.toml"))
    inline = load_run(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"', INLINE_GROUPS
                                                      + 'cost_profile = "qwen3-30b-a3b"\nparams_b = 30.5\n'),
                            "c.toml"))
    assert by_name.layout == by_path.layout == inline.layout
    assert by_name.engine_config() == by_path.engine_config() == inline.engine_config()
    assert by_name.model.label == "hybrid-demo" and inline.model.label == "inline"


def test_model_section_overrides_the_file(tmp_path: Path):
    spec = load_run(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"',
                                                    'name = "hybrid-demo"\ncost_profile = "llama-3.1-8b"')))
    assert spec.step_cost == borrowed_step("llama-3.1-8b")
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"',
                                                   'name = "hybrid-demo"\ncost_profile = "gpt-9"')))
    assert err.key == "model.cost_profile" and "llama-3.1-8b" in err.allowed


def test_model_exactly_one_source(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"',
                                                   'name = "hybrid-demo"\npath = "x.toml"')))
    assert err.key == "model" and "name, path" in err.problem
    assert err.allowed == "exactly one of name, path, groups"
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"', 'cost_profile = "qwen3-8b"')))
    assert err.key == "model" and err.allowed == "exactly one of name, path, groups"


def test_unknown_model_name_lists_the_shipped_ones(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL.replace("hybrid-demo", "nope")))
    assert err.key == "model.name" and "hybrid-demo" in err.allowed and "spec6" in err.allowed


def test_missing_model_path(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"', 'path = "no/such.toml"')))
    assert err.key == "model.path" and "no such file" in err.problem


def test_layout_errors_are_located(tmp_path: Path):
    bad = INLINE_GROUPS.replace("kind = \"full\", tokens_per_block = 16",
                                "kind = \"full\", tokens_per_block = 16, window = 64")
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"', bad)))
    assert err.key == "model.groups.0.window" and "sliding_window" in err.allowed
    # a named model's block size against the scenario's tokens_per_hash: reported in the model file
    err = error_of(write(tmp_path, MINIMAL + "[scheduler]\ntokens_per_hash = 32\n"))
    assert err.source.endswith("hybrid-demo.toml") and err.key == "groups.0.tokens_per_block"
    assert "tokens_per_hash=32" in err.problem


def test_bad_dtype(tmp_path: Path):
    bad = INLINE_GROUPS.replace("head_size = 64 }", 'head_size = 64, dtype = "bf17" }', 1)
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"', bad)))
    assert err.key == "model.groups.0.dtype" and "bf16" in err.allowed


# -- exactly-one sections -----------------------------------------------------------------------


def test_cpu_cache_exactly_one(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL + 'capacity = "1GiB"\n'))
    assert err.key == "cpu_cache" and "at most one of capacity, chunks" in err.allowed
    err = error_of(write(tmp_path, MINIMAL.replace("chunks = 100", "")))
    assert err.key == "cpu_cache" and "exactly one of capacity, chunks" in err.allowed
    text = MINIMAL.replace("chunks = 100", "") + "[scheduler]\noffloading = false\n"
    spec = load_run(write(tmp_path, text))
    assert spec.cpu_chunks == 0 and spec.engine_config().offloading is False


def test_capacity_too_small_for_one_slot(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL.replace("chunks = 100", 'capacity = "100kB"')))
    assert err.key == "cpu_cache.capacity" and "no chunk slot" in err.problem


def test_hardware_at_most_one_pool_size(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL + '[hardware]\ngpu_blocks = 10\ngpu_kv_bytes = "1GiB"\n'))
    assert err.key == "hardware" and err.allowed == "at most one of gpu_kv_bytes, gpu_blocks"


def test_gpu_budget_too_small(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL + "[hardware]\ngpu_kv_bytes = 1000\n"))
    assert err.key == "hardware.gpu_kv_bytes" and "2 blocks" in err.allowed


def test_unknown_hardware_profile(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL + '[hardware]\nprofile = "mi300x"\n'))
    assert err.key == "hardware.profile" and "h100" in err.allowed and "h200" in err.allowed
    hw = write(tmp_path, (scenarios_dir() / "hardware" / "h100.toml").read_text(), "my-gpu.toml")
    spec = load_run(write(tmp_path, MINIMAL + '[hardware]\nprofile = "my-gpu.toml"\n'))
    assert spec.hardware.name == "h100" and spec.hardware.profile == str(hw)


# -- costs --------------------------------------------------------------------------------------


def test_costs_variants(tmp_path: Path):
    spec = load_run(write(tmp_path, MINIMAL + '[costs]\nstep = "zero"\ntransfer = "zero"\n'))
    assert spec.step_cost == ZERO_STEP and spec.h2d == ZERO_TRANSFER == spec.d2h
    text = MINIMAL + "[costs]\nstep = { overhead_s = 0.01, prefill_token_s = 1e-5 }\n"
    spec = load_run(write(tmp_path, text))
    assert spec.step_cost == StepCostModel(0.01, 1e-5, 0.0, 0.0)
    err = error_of(write(tmp_path, MINIMAL + '[costs]\nstep = "fast"\n'))
    assert err.key == "costs.step" and "'auto'" in err.allowed
    err = error_of(write(tmp_path, MINIMAL + "[costs]\nstep = { overhead = 1 }\n"))
    assert err.key == "costs.step.overhead" and "overhead_s" in err.allowed
    text = MINIMAL + '[hardware]\nh2d_bandwidth = "10GB/s"\nd2h_latency_s = 0.001\n'
    spec = load_run(write(tmp_path, text))
    assert spec.h2d.bandwidth_bytes_per_s == 1e10 and spec.d2h.latency_s == 0.001


def test_auto_step_needs_a_cost_profile(tmp_path: Path):
    text = (MINIMAL.replace("hybrid-demo", "spec6")
            + "[hardware]\ngpu_blocks = 1000\n[scheduler]\ntokens_per_hash = 8\nblocks_per_chunk = 4\n")
    err = error_of(write(tmp_path, text))
    assert err.key == "costs.step" and "cost_profile" in err.problem
    spec = load_run(write(tmp_path, text + '[costs]\nstep = "zero"\n'))
    assert spec.layout.tokens_per_chunk == (1024, 256, 32)  # spec §1.1
    assert [spec.layout.kv_bytes_per_block(g) for g in range(3)] == [2048, 512, 64]  # spec §8.4


def test_shipped_cost_profiles_exist():
    models = scenarios_dir() / "models"
    for f in models.glob("*.toml"):
        data = tomllib.loads(f.read_text())
        if data.get("cost_profile") is not None:
            assert "shape" in tomllib.loads((models / f"{data['cost_profile']}.toml").read_text())


# -- workload -----------------------------------------------------------------------------------


def test_multiturn_parameters_and_requests(tmp_path: Path):
    spec = load_run(write(tmp_path, MINIMAL + '[workload]\nkind = "multiturn"\nsessions = 4\nlimit = 5\n'
                                              "first_user_tokens_mean = 500\n"))
    params = spec.multiturn_params()
    assert params["sessions"] == 4 and params["first_user_tokens_mean"] == 500
    assert params["think_time_mean_s"] == MultiTurnParams().think_time_mean_s
    first = list(spec.requests())
    assert 0 < len(first) <= 5 and spec.expected_requests == 5
    assert [r.req_id for r in spec.requests()] == [r.req_id for r in first]  # a fresh iterator each call
    assert all(r.tokens_per_hash == 16 for r in first)
    other = load_run(write(tmp_path, "seed = 9\n" + MINIMAL + '[workload]\nkind = "multiturn"\nsessions = 4\n'
                                                             "limit = 5\nfirst_user_tokens_mean = 500\n"))
    assert [r.block_hashes for r in other.requests()] != [r.block_hashes for r in first]


def test_multiturn_ranges_checked_by_the_generator(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL + '[workload]\nkind = "multiturn"\nturns_mean = 0.5\n'))
    assert err.key == "workload.turns_mean" and err.source == str(tmp_path / "run.toml")


def _trace(tmp_path: Path, lines: list[dict[str, object]]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def test_mooncake_workload(tmp_path: Path):
    _trace(tmp_path, [{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]},
                      {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]}])
    spec = load_run(write(tmp_path, MINIMAL + '[workload]\nkind = "mooncake"\npath = "trace.jsonl"\n'
                                              "time_scale = 0.5\n"))
    reqs = list(spec.requests())
    assert [r.prompt_tokens for r in reqs] == [600, 1100]
    assert [r.arrival_s for r in reqs] == [0.0, 0.5]
    assert spec.workload_path == tmp_path / "trace.jsonl"


def test_mooncake_missing_trace_and_block_size(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL + '[workload]\nkind = "mooncake"\npath = "none.jsonl"\n'))
    assert err.key == "workload.path" and "no such file" in err.problem
    _trace(tmp_path, [])
    err = error_of(write(tmp_path, MINIMAL + '[workload]\nkind = "mooncake"\npath = "trace.jsonl"\n'
                                             "block_tokens = 24\n"))
    assert err.key == "workload.block_tokens"


# -- --set overrides ----------------------------------------------------------------------------


def test_overrides_top_level_and_nested(tmp_path: Path):
    p = write(tmp_path, MINIMAL)
    spec = load_run(p, ["seed=3", "cpu_cache.capacity=128GiB", "cpu_cache.policy=arc", "window_logic=old",
                        "scheduler.prefix_caching=false", "output.max_sim_time_s=60"])
    sc = spec.scenario
    assert sc.seed == 3 and sc.window_logic == "old" and sc.output.max_sim_time_s == 60.0
    # setting capacity drops the file's chunks (an exclusive pair)
    assert sc.cpu_cache.capacity == 128 * GIB and sc.cpu_cache.chunks is None
    assert spec.cpu_chunks == capacity_from_bytes(128 * GIB, HYBRID_BLOCK, 1)
    assert spec.engine_config().eviction is EvictionPolicy.ARC
    assert sc.scheduler.prefix_caching is False


def test_overrides_create_sections_and_inline_tables(tmp_path: Path):
    p = write(tmp_path, MINIMAL)
    spec = load_run(p, ["costs.step={ overhead_s = 0.5 }", "hardware.gpu_blocks=77",
                        "workload.kind=multiturn", "workload.sessions=2"])
    assert spec.step_cost == StepCostModel(0.5, 0.0, 0.0, 0.0)
    assert spec.gpu_blocks == 77
    assert spec.multiturn_params()["sessions"] == 2
    assert load_run(p, ["workload.limit=3"]).expected_requests == 3  # kind defaults to multiturn
    spec = load_run(p, ["costs.step={ overhead_s = 0.5 }", "costs.step.decode_seq_s=0.25"])
    assert spec.step_cost == StepCostModel(0.5, 0.0, 0.25, 0.0)


def test_rightmost_override_wins(tmp_path: Path):
    p = write(tmp_path, MINIMAL)
    assert load_run(p, ["seed=1", ("--seed", "seed=2")]).scenario.seed == 2
    assert load_run(p, [("--seed", "seed=2"), "seed=1"]).scenario.seed == 1
    assert load_run(p, ["cpu_cache.capacity=1GiB", "cpu_cache.chunks=5"]).cpu_chunks == 5


def test_override_errors(tmp_path: Path):
    p = write(tmp_path, MINIMAL)
    err = error_of(p, ["seed=abc"])
    assert (err.source, err.key) == ("--set", "seed") and "'abc'" in err.problem
    err = error_of(p, ["colour=red"])
    assert (err.source, err.key, err.problem) == ("--set", "colour", "unknown key")
    err = error_of(p, ["cpu_cache.size=1"])
    assert (err.source, err.key) == ("--set", "cpu_cache.size") and "capacity" in err.allowed
    err = error_of(p, ["seed"])
    assert err.source == "--set" and err.problem == "not key=value"
    err = error_of(p, ["seed.x=1"])
    assert (err.source, err.key, err.problem) == ("--set", "seed", "not a table")
    err = error_of(p, ["cpu_cache.capacity=12XB"])
    assert (err.source, err.key) == ("--set", "cpu_cache.capacity") and "GiB" in err.allowed
    with pytest.raises(InputError) as info:
        load_run(p, [("--logic", "window_logic=both")])
    assert (info.value.source, info.value.key) == ("--logic", "window_logic")


# -- resolved scenario --------------------------------------------------------------------------


def _round_trip(tmp_path: Path, spec_path: Path, overrides: list[str] | None = None) -> None:
    spec = load_run(spec_path, overrides or [])
    text = spec.resolved_toml()
    assert text == load_run(spec_path, overrides or []).resolved_toml()  # deterministic
    data = tomllib.loads(text)
    assert next(iter(data)) == "schema" and data["schema"] == "run/1"
    assert data["kvsim_version"] and data["seed"] == spec.scenario.seed and data["name"] == spec.name
    again = load_run(write(tmp_path, text, "resolved.toml"))
    assert again.engine_config() == spec.engine_config()
    assert again.name == spec.name
    assert [r.req_id for r in again.requests()] == [r.req_id for r in spec.requests()]
    assert again.resolved_toml() == text


def test_resolved_toml_round_trips_default(tmp_path: Path):
    _round_trip(tmp_path, ROOT / "scenarios" / "default.toml", ["workload.limit=5"])


def test_resolved_toml_round_trips_variants(tmp_path: Path):
    _trace(tmp_path, [{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}])
    text = (MINIMAL.replace('name = "hybrid-demo"', INLINE_GROUPS)
            + '[workload]\nkind = "mooncake"\npath = "trace.jsonl"\n'
            + '[costs]\nstep = "zero"\ntensor_parallel = 2\n[hardware]\ngpu_blocks = 99\n')
    p = write(tmp_path, text, "variant.toml")
    _round_trip(tmp_path, p, ["seed=4", "output.max_sim_time_s=10"])


def test_json_schema_is_available():
    schema = RunScenario.model_json_schema(by_alias=True)
    assert "cpu_cache" in schema["properties"]


# -- validate any file --------------------------------------------------------------------------


def test_validate_every_shipped_file():
    files = sorted((ROOT / "scenarios").rglob("*.toml"))
    assert any("crash" in f.parts for f in files)
    for f in files:
        desc = validate_file(f)
        schema = tomllib.loads(f.read_text())["schema"]
        assert desc.startswith(schema + ":"), (f, desc)


def test_validate_unknown_and_missing_schema(tmp_path: Path):
    with pytest.raises(InputError) as info:
        validate_file(write(tmp_path, 'schema = "plot/1"\n'))
    assert info.value.key == "schema"
    assert '"run/1"' in info.value.allowed and '"check/1"' in info.value.allowed
    with pytest.raises(InputError) as info:
        validate_file(write(tmp_path, "x = 1\n"))
    assert (info.value.key, info.value.problem) == ("schema", "missing")
    with pytest.raises(InputError) as info:
        validate_file(write(tmp_path, 'schema = "sweep/1"\n'))
    assert (info.value.key, info.value.problem) == ("sweep", "required table missing")


def test_validate_model_and_hardware_errors(tmp_path: Path):
    model = (scenarios_dir() / "models" / "hybrid-demo.toml").read_text()
    with pytest.raises(InputError) as info:
        validate_file(write(tmp_path, model.replace('window = 128, ', ''), "m.toml"))
    assert info.value.key == "groups.1.window" and info.value.problem == "missing"
    with pytest.raises(InputError) as info:
        validate_file(write(tmp_path, model + "layers = 3\n", "m.toml"))
    assert info.value.key == "layers" and info.value.problem == "unknown key"
    hw = (scenarios_dir() / "hardware" / "h200.toml").read_text()
    with pytest.raises(InputError) as info:
        validate_file(write(tmp_path, hw.replace('gpu = "h200"', 'gpu = "tpu"'), "h.toml"))
    assert info.value.key == "gpu" and "h100" in info.value.allowed
    with pytest.raises(InputError) as info:
        validate_file(write(tmp_path, hw.replace('"55GB/s"', '"55 furlongs"', 1), "h.toml"))
    assert info.value.key == "h2d_bandwidth"


def test_validate_check_files(tmp_path: Path):
    src = (ROOT / "scenarios" / "crash" / "s6-b3904-left-missing.toml").read_text()
    assert validate_file(write(tmp_path, src, "c.toml")).startswith("check/1:")
    with pytest.raises(InputError) as info:
        validate_file(write(tmp_path, src.replace("num_tokens", "num_tokenz"), "c.toml"))
    assert info.value.key in ("num_tokens", "num_tokenz")
    batch = tmp_path / "b.json"
    batch.write_text(json.dumps([tomllib.loads(src), tomllib.loads(src)]))
    assert validate_file(batch) == "check/1: 2 scenarios"


# -- shapes, copy pieces, link and host figures (issue 17) ---------------------------------------

LLAMA8 = MINIMAL.replace('name = "hybrid-demo"', 'name = "llama-3.1-8b"') + '[hardware]\nprofile = "h100"\n'
SHAPE = ('shape = { hidden_size = 1024, vocab_size = 32000, query_heads = 16, intermediate_size = 4096 }\n')


def test_resolved_toml_round_trips_a_shape_and_the_link_figures(tmp_path: Path):
    p = write(tmp_path, LLAMA8, "llama.toml")
    _round_trip(tmp_path, p, ["hardware.h2d_duplex_factor=0.6", "hardware.host_per_request_s=2e-5",
                              "model.kv_transfer_piece=\"block\""])
    inline = MINIMAL.replace('name = "hybrid-demo"', INLINE_GROUPS + SHAPE)
    _round_trip(tmp_path, write(tmp_path, inline, "inline.toml"), ["workload.limit=3"])


def test_shipped_model_shape_gives_the_roofline_and_the_hardware_figures(tmp_path: Path):
    spec = load_run(write(tmp_path, LLAMA8))
    assert isinstance(spec.step_cost, RooflineStepModel)
    assert spec.step_cost == step_model_for("h100", "llama-3.1-8b")
    # default KV budget from the shape's weights (8,029,995,008 parameters x 2 bytes, no params_b)
    assert spec.gpu_kv_bytes == int(0.9 * 80e9) - 2 * 8_029_995_008
    h100 = GPU_PROFILES["h100"]
    assert spec.h2d == h100.h2d and spec.d2h == h100.d2h
    assert spec.step_cost.host == h100.host
    cfg = spec.engine_config()
    assert cfg.transfer_piece == "layer"
    over = load_run(write(tmp_path, LLAMA8), ["hardware.h2d_piece_overhead_s=1e-5",
                                               "hardware.d2h_duplex_factor=1", "hardware.host_step_s=0",
                                               "hardware.host_per_hashed_block_s=4e-6",
                                               "model.kv_transfer_piece=\"block\""])
    assert over.h2d.piece_overhead_s == 1e-5 and over.d2h.duplex_factor == 1.0
    assert isinstance(over.step_cost, RooflineStepModel) and over.step_cost.host.step_s == 0.0
    assert over.step_cost.host.per_hashed_block_s == 4e-6
    assert over.engine_config().prompt_hash_s_per_block == 4e-6
    assert spec.engine_config().prompt_hash_s_per_block == h100.host.per_hashed_block_s > 0
    # an inline step table (or "zero") has no host figures: no hashing delay
    table = load_run(write(tmp_path, LLAMA8), ["costs.step={overhead_s=1e-3, prefill_token_s=1e-5}"])
    assert table.engine_config().prompt_hash_s_per_block == 0.0
    assert over.engine_config().transfer_piece == "block"


def test_a_hardware_file_without_the_new_keys_takes_its_gpus_figures(tmp_path: Path):
    hw = (scenarios_dir() / "hardware" / "h200.toml").read_text()
    keep = [line for line in hw.splitlines() if not line.startswith(("h2d_piece", "d2h_piece", "h2d_duplex",
                                                                     "d2h_duplex", "host_"))]
    (tmp_path / "old.toml").write_text("\n".join(keep) + "\n")
    spec = load_run(write(tmp_path, MINIMAL + '[hardware]\nprofile = "old.toml"\n'))
    h200 = GPU_PROFILES["h200"]
    assert spec.h2d == h200.h2d and spec.d2h == h200.d2h
    assert isinstance(spec.step_cost, RooflineStepModel) and spec.step_cost.host == h200.host



def _gpu_file(tmp_path: Path, gpu: str, extra: str = "") -> Path:
    """The shipped h100 profile as a file for ``gpu`` (its figures given by ``extra``)."""
    hw = (scenarios_dir() / "hardware" / "h100.toml").read_text().replace('gpu = "h100"', f'gpu = "{gpu}"')
    return write(tmp_path, hw + extra, "gpu.toml")


def test_a_hardware_file_describes_a_gpu_not_shipped(tmp_path: Path):
    """A GPU kvsim does not ship is described by its peak and HBM bandwidth: the step model
    is then the roofline of those figures, at the default matmul and attention efficiencies."""
    _gpu_file(tmp_path, "a10g-like", 'dense_bf16_flops = 125e12\nhbm_bandwidth = "600GB/s"\n')
    spec = load_run(write(tmp_path, LLAMA8.replace('profile = "h100"', 'profile = "gpu.toml"')))
    g = spec.hardware.gpu_profile
    assert (g.name, g.dense_bf16_flops, g.hbm_bandwidth_bytes_per_s) == ("a10g-like", 125e12, 600e9)
    assert g.matmul_efficiency == () and g.attention_efficiency is None
    assert str(tmp_path / "gpu.toml") in g.sources[0]
    step = spec.step_cost
    assert isinstance(step, RooflineStepModel)
    assert step.flops_per_s == pytest.approx(125e12 * DEFAULT_MFU)
    assert step.bytes_per_s == pytest.approx(600e9 * DEFAULT_MBU)
    assert step.token_rate_curve == ()
    assert step.pair_flops_per_s == pytest.approx((125e12 * DEFAULT_ATTENTION_EFFICIENCY,))
    # the same figures under the shipped name, with the same constant efficiency: the same model
    h100 = load_run(write(tmp_path, LLAMA8), ["hardware.mfu=0.5"]).step_cost
    assert isinstance(h100, RooflineStepModel)
    ratio = step.flops_per_s / h100.flops_per_s
    assert ratio == pytest.approx(125 / 989)
    assert (step.token_flops, step.pair_flops, step.weight_bytes) == (
        h100.token_flops, h100.pair_flops, h100.weight_bytes)


def test_a_hardware_file_can_replace_a_shipped_gpus_figures(tmp_path: Path):
    _gpu_file(tmp_path, "h100", "dense_bf16_flops = 494.5e12\nattention_efficiency = 0.31\n")
    spec = load_run(write(tmp_path, LLAMA8.replace('profile = "h100"', 'profile = "gpu.toml"')))
    shipped = load_run(write(tmp_path, LLAMA8))
    step, base = spec.step_cost, shipped.step_cost
    assert isinstance(step, RooflineStepModel) and isinstance(base, RooflineStepModel)
    # the measured curve (a fraction of peak) now applies to half the peak; attention at 0.31 of it
    assert step.flops_per_s == pytest.approx(base.flops_per_s / 2)
    assert [r for _, r in step.token_rate_curve] == pytest.approx([r / 2 for _, r in base.token_rate_curve])
    assert step.pair_flops_per_s == pytest.approx((494.5e12 * 0.31,))
    assert step.bytes_per_s == base.bytes_per_s
    assert spec.hardware.gpu_profile.sources[1:] == GPU_PROFILES["h100"].sources


@pytest.mark.parametrize(("extra", "problem"), [
    ("", "no dense_bf16_flops or hbm_bandwidth"),
    ("dense_bf16_flops = 1e14\n", "no hbm_bandwidth"),
    ('hbm_bandwidth = "1TB/s"\n', "no dense_bf16_flops"),
])
def test_a_gpu_not_shipped_without_its_figures_is_one_line(tmp_path: Path, extra: str, problem: str):
    path = _gpu_file(tmp_path, "mystery", extra)
    with pytest.raises(InputError) as info:
        validate_file(path)
    err = info.value
    assert err.key == "gpu" and err.problem.endswith(problem) and "h100" in err.allowed
    assert "\n" not in str(err)
    run = write(tmp_path, LLAMA8.replace('profile = "h100"', 'profile = "gpu.toml"'))
    assert error_of(run).key == "gpu"


@pytest.mark.parametrize(("extra", "key"), [
    ("dense_bf16_flops = 0\nhbm_bandwidth = \"1TB/s\"\n", "dense_bf16_flops"),
    ("dense_bf16_flops = inf\nhbm_bandwidth = \"1TB/s\"\n", "dense_bf16_flops"),
    ("dense_bf16_flops = 1e14\nhbm_bandwidth = \"fast\"\n", "hbm_bandwidth"),
    ("dense_bf16_flops = 1e14\nhbm_bandwidth = \"1TB/s\"\nattention_efficiency = 1.2\n",
     "attention_efficiency"),
])
def test_bad_gpu_figures_are_one_line(tmp_path: Path, extra: str, key: str):
    with pytest.raises(InputError) as info:
        validate_file(_gpu_file(tmp_path, "mystery", extra))
    assert info.value.key == key and "\n" not in str(info.value)


@pytest.mark.parametrize(("extra", "key", "allowed"), [
    ("[hardware]\nh2d_duplex_factor = 1.5\n", "hardware.h2d_duplex_factor", "1"),
    ("[hardware]\nd2h_duplex_factor = 0\n", "hardware.d2h_duplex_factor", "0"),
    ("[hardware]\nhost_step_s = -1.0\n", "hardware.host_step_s", "0"),
    ("[hardware]\nh2d_piece_overhead_s = -1e-6\n", "hardware.h2d_piece_overhead_s", "0"),
    ("[hardware]\nhost_per_request_s = \"fast\"\n", "hardware.host_per_request_s", "number"),
    ("[hardware]\nhost_per_hashed_block_s = -1e-6\n", "hardware.host_per_hashed_block_s", "0"),
])
def test_bad_link_and_host_figures_are_one_line(tmp_path: Path, extra: str, key: str, allowed: str):
    err = error_of(write(tmp_path, MINIMAL + extra))
    assert err.key == key and allowed in err.allowed
    assert "\n" not in str(err)


@pytest.mark.parametrize(("shape", "key", "allowed"), [
    ("{ hidden_size = 1024, vocab_size = 32000 }", "model.shape.query_heads", ""),
    ("{ hidden_size = 1024, vocab_size = 32000, query_heads = 16 }", "model.shape.intermediate_size",
     "positive"),
    ("{ hidden_size = 1024, vocab_size = 32000, query_heads = 16, intermediate_size = 8, params = 9 }",
     "model.shape", "both"),
    ("{ hidden_size = 1024, vocab_size = 32000, query_heads = 16, experts = 8, experts_per_token = 9, "
     "expert_intermediate_size = 64 }", "model.shape.experts_per_token", "1 to 8"),
    ("{ hidden_size = 1024, vocab_size = 32000, query_heads = 16, experts = 8, experts_per_token = 2 }",
     "model.shape.expert_intermediate_size", "positive"),
    ("{ hidden_size = 1024, vocab_size = 32000, query_heads = 16, intermediate_size = 8, "
     "weight_dtype = \"fp6\" }", "model.shape.weight_dtype", "bf16"),
    ("{ hidden_size = 1024, vocab_size = 32000, query_heads = 16, intermediate_size = 8, speed = 1 }",
     "model.shape.speed", "hidden_size"),
    ("{ hidden_size = 1024, vocab_size = 32000, query_heads = 16, intermediate_size = 8, "
     "params = 10, active_params = 20 }", "model.shape.active_params", "<="),
    ("{ hidden_size = 1024, vocab_size = 32000, query_heads = 16, intermediate_size = 8, "
     "expert_weights_bytes = \"1 GB\" }", "model.shape.expert_weights_bytes", "experts > 0"),
    ("{ hidden_size = 1024, vocab_size = 32000, query_heads = 16, experts = 8, experts_per_token = 2, "
     "expert_intermediate_size = 64, expert_weights_bytes = \"1 TB\" }", "model.shape.expert_weights_bytes",
     "at most"),
])
def test_bad_shapes_are_one_line(tmp_path: Path, shape: str, key: str, allowed: str):
    text = MINIMAL.replace('name = "hybrid-demo"', INLINE_GROUPS + f"shape = {shape}\n")
    err = error_of(write(tmp_path, text))
    assert err.key == key and allowed in err.allowed
    assert "\n" not in str(err)


def test_mamba_and_mla_groups_need_the_counts_and_the_state(tmp_path: Path):
    mamba = INLINE_GROUPS.replace('{ kind = "sliding_window", tokens_per_block = 16, window = 128,',
                                  '{ kind = "mamba", tokens_per_block = 16,')
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"', mamba + SHAPE)))
    assert err.key == "model.shape.params" and "active_params" in err.allowed
    counted = SHAPE.replace("}", ", params = 10000000000, active_params = 1000000000 }")
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"', mamba + counted)))
    assert err.key == "model.shape.mamba_state_elements"
    ok = counted.replace("}", ", mamba_state_elements = 65536 }")
    spec = load_run(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"', mamba + ok)))
    assert isinstance(spec.step_cost, RooflineStepModel)
    assert spec.step_cost.pair_flops[1] == 7 * 65536 * 18


def test_cost_profile_must_name_a_shipped_model_with_a_shape(tmp_path: Path):
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"',
                                                   'name = "hybrid-demo"\ncost_profile = "spec6"')))
    assert err.key == "model.cost_profile" and "no [shape]" in err.problem and "llama-3.1-8b" in err.allowed
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"',
                                                   'name = "hybrid-demo"\ncost_profile = "../etc/x"')))
    assert err.key == "model.cost_profile"
    err = error_of(write(tmp_path, MINIMAL.replace('name = "hybrid-demo"',
                                                   'name = "hybrid-demo"\nkv_transfer_piece = "page"')))
    assert err.key == "model.kv_transfer_piece" and "layer" in err.allowed


def test_stop_at_waiting_reaches_the_engine_and_refuses_what_is_not_a_positive_count(tmp_path: Path):
    p = write(tmp_path, MINIMAL)
    assert load_run(p, ["output.stop_at_waiting=500"]).engine_config().stop_at_waiting == 500
    assert load_run(p).engine_config().stop_at_waiting is None
    for bad, allowed in (("0", "greater than or equal to 1"), ("'many'", "a valid integer")):
        with pytest.raises(InputError, match=f"output.stop_at_waiting.*{allowed}"):
            load_run(p, [f"output.stop_at_waiting={bad}"])


def test_the_documented_gpu_not_shipped_validates(tmp_path: Path):
    """docs/costs.md's example of a GPU kvsim does not ship is a valid hardware/1 file."""
    text = (ROOT / "docs" / "costs.md").read_text()
    section = text.split("### A GPU kvsim does not ship", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    described = validate_file(write(tmp_path, example, "a10g.toml"))
    assert described.startswith("hardware/1: my-a10g (gpu a10g: 125 TFLOPS, 0.6 TB/s)")


def test_a_run_can_replace_the_gpus_figures_for_a_what_if(tmp_path: Path):
    """[hardware] takes the GPU's figures too (a sweep over a faster GPU), and the resolved
    scenario keeps them, so it loads back to the same step model."""
    base = load_run(write(tmp_path, LLAMA8))
    over = ["hardware.dense_bf16_flops=1978e12", 'hardware.hbm_bandwidth="6.7TB/s"',
            "hardware.attention_efficiency=0.7"]
    spec = load_run(write(tmp_path, LLAMA8), over)
    step, ref = spec.step_cost, base.step_cost
    assert isinstance(step, RooflineStepModel) and isinstance(ref, RooflineStepModel)
    assert step.flops_per_s == pytest.approx(2 * ref.flops_per_s)
    assert step.bytes_per_s == pytest.approx(ref.bytes_per_s * 6.7 / 3.35)
    assert step.pair_flops_per_s == pytest.approx((1978e12 * 0.7,))
    assert spec.hardware.gpu_profile.sources[0].endswith("[hardware]: dense_bf16_flops, "
                                                         "hbm_bandwidth_bytes_per_s, attention_efficiency")
    _round_trip(tmp_path, write(tmp_path, LLAMA8, "llama.toml"), over)
    resolved = tomllib.loads(spec.resolved_toml())["hardware"]
    assert (resolved["dense_bf16_flops"], resolved["hbm_bandwidth"]) == (1978e12, 6_700_000_000_000)
    assert "dense_bf16_flops" not in tomllib.loads(base.resolved_toml())["hardware"]
    bad = error_of(write(tmp_path, LLAMA8), ["hardware.dense_bf16_flops=-1"])
    assert bad.key == "hardware.dense_bf16_flops"
