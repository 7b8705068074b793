"""The model library ``scenarios/models/``: every file loads, builds layouts, has the shapes its
step cost needs (one home: the file), runs in a scenario and simulates; the published facts of
each model hold."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from sim.engine.metrics import Recorder
from sim.io.scenario import (
    ModelFile,
    ModelGroup,
    group_spec,
    load_model_file,
    load_run,
    model_shape,
    scenarios_dir,
    step_model_for,
)
from sim.model.layout import DTYPE_BYTES, GroupKind, GroupSpec, KVShape, Layout, LayoutError

MODELS_DIR = scenarios_dir() / "models"
FILES = sorted(MODELS_DIR.glob("*.toml"))
#: the model library of the "Workloads and models" issue (other files may be shipped too)
LIBRARY = ("gpt-oss-120b", "gemma-3-27b", "llama-4-scout", "deepseek-v4-style",
           "qwen3-next-80b-a3b", "llama-3.1-70b")


def ids(files: list[Path]) -> list[str]:
    return [f.stem for f in files]


def model(name: str) -> ModelFile:
    return load_model_file(MODELS_DIR / f"{name}.toml")


def tokens_per_hash(mf: ModelFile) -> int:
    """16 (vLLM's default hash block) when every block size allows it, else the largest divisor."""
    sizes = [g.tokens_per_block for g in mf.groups]
    return 16 if all(s % 16 == 0 for s in sizes) else math.gcd(*sizes)


def spec_of(g: ModelGroup) -> GroupSpec:
    shape = KVShape(g.layers, g.kv_heads, g.head_size, DTYPE_BYTES[g.dtype], g.mla)
    return GroupSpec(GroupKind(g.kind), g.tokens_per_block, g.window, g.attention_chunk,
                     g.extra_retained_tokens, g.eagle, shape=shape)


def kv_bytes_per_token(mf: ModelFile) -> int:
    """Sum over groups of the group's KV bytes per token (block bytes / block tokens), TP 1."""
    total = 0
    for g in mf.groups:
        block = KVShape(g.layers, g.kv_heads, g.head_size, DTYPE_BYTES[g.dtype], g.mla).bytes_per_block(
            g.tokens_per_block)
        assert block % g.tokens_per_block == 0
        total += block // g.tokens_per_block
    return total


def layers_by_kind(mf: ModelFile) -> Counter[str]:
    c: Counter[str] = Counter()
    for g in mf.groups:
        c[g.kind] += g.layers
    return c


# -- every file -----------------------------------------------------------------------------------


def test_the_library_is_shipped() -> None:
    assert set(LIBRARY) <= set(ids(FILES))


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
def test_loads_with_sane_groups(path: Path) -> None:
    mf = load_model_file(path)
    assert mf.name == path.stem
    assert mf.description
    for g in mf.groups:
        assert g.layers > 0 and g.kv_heads > 0 and g.head_size > 0 and g.tokens_per_block > 0


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
@pytest.mark.parametrize("bpc", [1, 4])
def test_builds_a_layout(path: Path, bpc: int) -> None:
    mf = load_model_file(path)
    tph = tokens_per_hash(mf)
    layout = Layout.of([spec_of(g) for g in mf.groups], tokens_per_hash=tph, blocks_per_chunk=bpc)
    assert layout.tokens_per_chunk == tuple(g.tokens_per_block * bpc for g in mf.groups)
    assert all(layout.kv_bytes_per_block(i) for i in range(len(mf.groups)))
    full = [i for i, g in enumerate(mf.groups) if g.kind == "full"]
    assert list(layout.lookup_order[: len(full)]) == full  # spec §2: full attention first
    assert layout.window_groups == layout.lookup_order[len(full):]


def test_only_the_deepseek_layout_needs_8_token_hashes() -> None:
    for name in LIBRARY:
        mf = model(name)
        want = 8 if name == "deepseek-v4-style" else 16
        assert tokens_per_hash(mf) == want, name
    with pytest.raises(LayoutError) as info:
        Layout.of([spec_of(g) for g in model("deepseek-v4-style").groups], tokens_per_hash=16)
    assert info.value.key == "groups.2.tokens_per_block"


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
def test_shapes_give_a_step_model(path: Path) -> None:
    """A file's [shape] gives a parameter count and a step model; a file without one borrows a
    shipped model's (cost_profile, which must have a shape), or has no step model at all."""
    mf = load_model_file(path)
    if mf.shape is None:
        if mf.cost_profile is not None:
            assert model(mf.cost_profile).shape is not None
        return
    assert mf.cost_profile is None          # one home: no second profile beside the own shape
    shape = model_shape(mf.name, mf.shape, mf.groups, mf.weights_bytes, mf.name, "")
    total, active = shape.param_counts([group_spec(g, 1) for g in mf.groups])
    assert 0 < active <= total
    assert shape.total_weight_bytes([group_spec(g, 1) for g in mf.groups]) >= active  # >= 1 byte/param
    step = step_model_for("h200", mf.name, tensor_parallel=1, tokens_per_hash=tokens_per_hash(mf))
    assert len(step.pair_flops) == len(mf.groups) and all(f > 0 for f in step.pair_flops)


def test_library_models_have_their_own_shape() -> None:
    for name in LIBRARY:
        mf = model(name)
        assert mf.shape is not None and mf.cost_profile is None, name
        assert mf.params_b is None, name     # the weights come from the shape (or weights_bytes)


def test_kv_bytes_check_can_fail() -> None:
    mf = model("gemma-3-27b")
    assert kv_bytes_per_token(mf) == 507_904
    changed = mf.model_copy(update={"groups": [*mf.groups[:-1],
                                               mf.groups[-1].model_copy(update={"layers": 11})]})
    assert kv_bytes_per_token(changed) != 507_904


def test_readme_table_matches_the_files() -> None:
    """scenarios/models/README.md lists every file, with the KV bytes per token it gives."""
    rows = {}
    for line in (MODELS_DIR / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) > 4:
            rows[cells[0].strip("`")] = int(cells[4].split()[0].replace(",", ""))
    assert set(rows) == set(ids(FILES))
    for path in FILES:
        assert rows[path.stem] == kv_bytes_per_token(load_model_file(path)), path.stem


# -- published facts, per model --------------------------------------------------------------------


def test_gpt_oss_120b() -> None:
    mf = model("gpt-oss-120b")
    assert layers_by_kind(mf) == {"sliding_window": 18, "full": 18}  # 36 alternating layers
    assert [g.window for g in mf.groups if g.kind == "sliding_window"] == [128]
    shapes = {(g.kv_heads, g.head_size, g.dtype, g.tokens_per_block) for g in mf.groups}
    assert shapes == {(8, 64, "bf16", 16)}
    assert kv_bytes_per_token(mf) == 36 * 2 * 8 * 64 * 2
    assert mf.weights_bytes == 65_248_815_744  # MXFP4 experts: 60.77 GiB, the card's 60.8 GiB
    assert mf.weights_bytes / 2**30 == pytest.approx(60.8, abs=0.05)


def test_gemma_3_27b() -> None:
    mf = model("gemma-3-27b")
    kinds = layers_by_kind(mf)
    assert kinds == {"sliding_window": 52, "full": 10}  # 62 layers
    assert kinds["sliding_window"] // kinds["full"] == 5  # 5 local : 1 global (+ 2 trailing local)
    # layer i is global when (i + 1) % 6 == 0
    assert sum((i + 1) % 6 == 0 for i in range(62)) == kinds["full"]
    assert {g.window for g in mf.groups if g.kind == "sliding_window"} == {1024}
    assert {(g.kv_heads, g.head_size, g.tokens_per_block) for g in mf.groups} == {(16, 128, 16)}
    # vLLM: group size 10 (the global count); the 52 local layers dealt round-robin into 6 groups
    assert [g.layers for g in mf.groups] == [len(range(i, 52, 6)) for i in range(6)] + [10]
    assert max(g.layers for g in mf.groups) == 10


def test_llama_4_scout() -> None:
    mf = model("llama-4-scout")
    assert layers_by_kind(mf) == {"chunked_local": 36, "full": 12}  # no_rope_layers [1, 1, 1, 0] x 12
    assert {g.attention_chunk for g in mf.groups if g.kind == "chunked_local"} == {8192}
    shapes = {(g.kv_heads, g.head_size, g.dtype, g.tokens_per_block) for g in mf.groups}
    assert shapes == {(8, 128, "bf16", 16)}
    assert [g.layers for g in mf.groups] == [12, 12, 12, 12]


def test_deepseek_v4_style() -> None:
    mf = model("deepseek-v4-style")
    assert [(g.kind, g.tokens_per_block, g.window) for g in mf.groups] == [
        ("full", 256, None), ("sliding_window", 64, 128), ("sliding_window", 8, 128)]  # spec §6.1
    assert all(g.mla for g in mf.groups)
    layout = Layout.of([spec_of(g) for g in mf.groups], tokens_per_hash=8, blocks_per_chunk=4)
    assert layout.tokens_per_chunk == (1024, 256, 32)  # spec §1.1
    assert layout.lookup_order == (0, 2, 1)  # spec §2
    # the raw window KV of V4-Flash: 43 layers, 37,440 B per 64-token block and layer
    window = mf.groups[1]
    assert window.layers == 43 and window.tokens_per_block * window.head_size == 37_440


def test_qwen3_next_80b_a3b() -> None:
    mf = model("qwen3-next-80b-a3b")
    assert layers_by_kind(mf) == {"mamba": 36, "full": 12}  # 12 x (3 Gated DeltaNet + 1 attention)
    full = next(g for g in mf.groups if g.kind == "full")
    assert (full.kv_heads, full.head_size, full.dtype) == (2, 256, "bf16")
    # vLLM's attention block size: 16 x cdiv(state page, 16 x attention page per token)
    state = 32 * 128 * 128 * 2 + (2 * 16 * 128 + 32 * 128) * 3 * 2
    attn_token = 2 * full.kv_heads * full.head_size * 2
    assert state == 1_097_728
    assert {g.tokens_per_block for g in mf.groups} == {16 * -(-state // (16 * attn_token))} == {544}
    # one mamba block of one layer is the padded state page, within 2 % of the real state
    for g in mf.groups:
        if g.kind == "mamba":
            one_layer = KVShape(1, g.kv_heads, g.head_size, DTYPE_BYTES[g.dtype])
            page = one_layer.bytes_per_block(g.tokens_per_block)
            assert page == 544 * attn_token and 0 <= page / state - 1 < 0.02


def test_llama_3_1_70b() -> None:
    mf = model("llama-3.1-70b")
    assert [(g.kind, g.tokens_per_block, g.layers, g.kv_heads, g.head_size, g.dtype) for g in mf.groups] == [
        ("full", 16, 80, 8, 128, "bf16")]
    assert kv_bytes_per_token(mf) == 327_680


# -- scenarios and the engine -----------------------------------------------------------------------


def run_toml(mf: ModelFile, *, limit: int, pool: str, tp: int = 1) -> str:
    step = "auto" if mf.cost_profile is not None or mf.shape is not None else "zero"
    return f"""
schema = "run/1"
seed = 1
[model]
name = "{mf.name}"
[hardware]
profile = "h200"
{pool}
[cpu_cache]
chunks = 2000
[scheduler]
tokens_per_hash = {tokens_per_hash(mf)}
blocks_per_chunk = 4
max_num_batched_tokens = 4096
[workload]
kind = "multiturn"
sessions = 40
session_rate_per_s = 4.0
turns_mean = 3.0
think_time_mean_s = 2.0
first_user_tokens_mean = 1500
max_context_tokens = 12000
limit = {limit}
[costs]
step = "{step}"
tensor_parallel = {tp}
"""


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
def test_run_scenario_validates(path: Path, tmp_path: Path) -> None:
    mf = load_model_file(path)
    f = tmp_path / "run.toml"
    f.write_text(run_toml(mf, limit=5, pool="gpu_blocks = 4000"))
    spec = load_run(f)
    assert spec.model.label == mf.name and len(spec.layout.groups) == len(mf.groups)
    cfg = spec.engine_config()
    assert cfg.gpu_blocks == 4000 and cfg.cpu_capacity_chunks == 2000
    assert len(list(spec.requests())) == 5


@pytest.mark.parametrize("name", LIBRARY)
def test_default_kv_budget_on_two_h200(name: str, tmp_path: Path) -> None:
    """With tensor_parallel = 2 every library model's weights leave room for KV on an H200."""
    mf = model(name)
    f = tmp_path / "run.toml"
    f.write_text(run_toml(mf, limit=5, pool="", tp=2))
    spec = load_run(f)
    assert spec.gpu_kv_bytes is not None and spec.gpu_kv_bytes > 10 * 2**30
    assert spec.gpu_blocks == spec.gpu_kv_bytes // spec.block_bytes
    step = step_model_for("h200", name, tensor_parallel=2, tokens_per_hash=tokens_per_hash(mf))
    assert spec.step_cost == step


class _Discard:
    def write(self, table: str, columns: dict[str, list[object]]) -> None:
        pass


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
def test_simulates_30_requests(path: Path, tmp_path: Path) -> None:
    from sim.engine.loop import simulate

    mf = load_model_file(path)
    f = tmp_path / "run.toml"
    f.write_text(run_toml(mf, limit=30, pool="gpu_blocks = 4000"))
    spec = load_run(f)
    res = simulate(spec.engine_config(), spec.requests(), Recorder(_Discard()))
    s = res.summary
    assert res.status == "ok"
    assert s.requests_arrived == s.requests_finished == 30 and s.integrity_violations == 0
    if not any(g.extra_retained_tokens for g in mf.groups):
        assert s.crashes == 0
    # with multi-module MTP (spec §10 E4) NEW crashes only on a hit through the
    # chunk its store mask never wrote; this small workload has none: real vLLM
    # 0.30.0 replays it without a crash too (`--decisions differential`: 0
    # divergences in 12,096 decisions). The crash itself is tested on the
    # Mooncake trace (tests/tools/test_compare_traces.py, test_vllm_mode.py).
    assert s.store_jobs > 0 and s.stored_bytes > 0
