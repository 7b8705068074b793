"""Tests of the roofline step model, the attention pairs per group kind and the
transfer pieces (sim.model.costs), with the shapes of the shipped model files.

The parameter counts are checked against counts made independently from each
model's config.json (the figures of docs/costs.md, norms included, so the
derivation, which leaves norms out, must come within 0.01 %); the pairs
against brute-force sums over the causal mask; the acceptance check of issue
17 (a 90,000-token prefill of Llama 3.1 8B costs more than 90 times a
1,000-token one) against the engine-independent chunked prefill.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.io.scenario import group_spec, load_model_file, load_run, scenarios_dir, step_model_for
from sim.model.costs import (
    AMPERE_MATMUL_EFFICIENCY,
    DEFAULT_MFU,
    GPU_PROFILES,
    HOPPER_MATMUL_EFFICIENCY,
    HostOverhead,
    ModelShape,
    RooflineStepModel,
    StepCostModel,
    StepLoad,
    TransferModel,
    attended_tokens,
    attention_pairs,
    chunked_prefill_time,
    decode_timer,
    pieces_per_block,
    roofline_step_model,
)
from sim.model.layout import GroupKind, GroupSpec, KVShape, Layout


def brute_pairs(kind: GroupKind, span: int, p: int, c: int) -> int:
    """Keys each new token at position t attends to, summed (or one state update each)."""
    total = 0
    for t in range(p, p + c):
        if kind is GroupKind.FULL:
            total += t + 1
        elif kind is GroupKind.SLIDING_WINDOW:
            total += min(t + 1, span)
        elif kind is GroupKind.CHUNKED_LOCAL:
            total += t % span + 1
        else:
            total += 1
    return total


KINDS = [GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL, GroupKind.MAMBA]


@given(st.sampled_from(KINDS), st.integers(1, 300), st.integers(0, 2000), st.integers(0, 700))
def test_pairs_are_the_causal_mask(kind: GroupKind, span: int, p: int, c: int) -> None:
    assert attention_pairs(kind, span, p, c) == brute_pairs(kind, span, p, c)


def test_pairs_worked_examples() -> None:
    # full attention: a chunk of c new tokens after p cached ones: c x p + c (c + 1) / 2
    assert attention_pairs(GroupKind.FULL, 0, 0, 1000) == 500_500
    assert attention_pairs(GroupKind.FULL, 0, 8192, 8192) == 8192 * 8192 + 8192 * 8193 // 2
    # sliding window 128: bounded by 128 keys per query, whatever the prefix
    assert attention_pairs(GroupKind.SLIDING_WINDOW, 128, 10**6, 1000) == 128_000
    assert attention_pairs(GroupKind.SLIDING_WINDOW, 128, 0, 200) == 128 * 129 // 2 + 72 * 128
    # chunked local 8192: a chunk starting at a chunk boundary sees only itself
    assert attention_pairs(GroupKind.CHUNKED_LOCAL, 8192, 8192, 8192) == 8192 * 8193 // 2
    # mamba: one state update per new token
    assert attention_pairs(GroupKind.MAMBA, 544, 10**6, 37) == 37
    # decode (c = 1): the keys one token reads = the tokens the group attends
    for kind, span in [(GroupKind.FULL, 0), (GroupKind.SLIDING_WINDOW, 128), (GroupKind.CHUNKED_LOCAL, 100)]:
        for p in (0, 5, 127, 128, 129, 1000):
            assert attention_pairs(kind, span, p, 1) == attended_tokens(kind, span, p + 1)


# -- shapes of the shipped models -------------------------------------------------------------------------

#: (total, active) parameters counted from config.json with the norms (docs/costs.md); the models
#: whose files give the counts (gpt-oss, Qwen3-Next, DeepSeek) are checked for equality
RECOUNTS = {
    "llama-3.1-8b": (8_030_261_248, 8_030_261_248),
    "llama-3.1-70b": (70_553_706_496, 70_553_706_496),
    "qwen3-8b": (8_190_735_360, 8_190_735_360),
    "qwen3-32b": (32_762_123_264, 32_762_123_264),
    "mistral-7b": (7_248_023_552, 7_248_023_552),
    "qwen2.5-72b": (72_706_203_648, 72_706_203_648),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "gemma-3-27b": (27_009_346_304, 27_009_346_304),
    "llama-4-scout": (107_769_861_120, 17_172_894_720),
    "gpt-oss-120b": (116_829_156_672, 5_711_982_912),
    "qwen3-next-80b-a3b": (79_674_391_296, 3_874_929_408),
}


def shipped(name: str) -> tuple[ModelShape, list[GroupSpec]]:
    mf = load_model_file(scenarios_dir() / "models" / f"{name}.toml")
    assert mf.shape is not None
    from sim.io.scenario import model_shape

    return model_shape(mf.name, mf.shape, mf.groups, mf.weights_bytes, name, ""), [
        group_spec(g, 1) for g in mf.groups]


@pytest.mark.parametrize("name", sorted(RECOUNTS))
def test_parameter_counts_match_the_config_recounts(name: str) -> None:
    shape, groups = shipped(name)
    total, active = shape.param_counts(groups)
    want_total, want_active = RECOUNTS[name]
    assert total == pytest.approx(want_total, rel=1e-4)
    assert active == pytest.approx(want_active, rel=1e-4)
    assert total <= want_total and active <= want_active   # the derivation leaves the norms out


def test_llama_8b_derivation_by_hand() -> None:
    shape, groups = shipped("llama-3.1-8b")
    h, v, layers = 4096, 128256, 32
    attn = h * 128 * (2 * 32 + 2 * 8)
    mlp = 3 * h * 14336
    assert shape.param_counts(groups) == (layers * (attn + mlp) + 2 * v * h,) * 2
    assert shape.total_weight_bytes(groups) == 2 * (layers * (attn + mlp) + 2 * v * h)


def test_shape_validation() -> None:
    with pytest.raises(ValueError, match="both params"):
        ModelShape("m", 8, 8, 1, intermediate_size=8, params=10)
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelShape("m", 8, 8, 1, experts=4, experts_per_token=5, expert_intermediate_size=8)
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelShape("m", 8, 8, 1)
    mamba = GroupSpec(GroupKind.MAMBA, 16, shape=KVShape(2, 1, 8))
    with pytest.raises(ValueError, match="params"):
        ModelShape("m", 8, 8, 1, intermediate_size=8).param_counts([mamba])


# -- the roofline ----------------------------------------------------------------------------------------


def llama8b(gpu: str = "h100", tp: int = 1) -> tuple[RooflineStepModel, Layout]:
    mf = load_model_file(scenarios_dir() / "models" / "llama-3.1-8b.toml")
    return step_model_for(gpu, "llama-3.1-8b", tensor_parallel=tp), Layout.of(
        [group_spec(g, tp) for g in mf.groups], 16, 1)


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_90k_prefill_costs_more_than_90x_a_1k_prefill(gpu: str) -> None:
    """Issue 17's acceptance check: causal attention is quadratic in the prompt."""
    m, layout = llama8b(gpu)
    short = chunked_prefill_time(m, layout, 1_000, 8192)
    long = chunked_prefill_time(m, layout, 90_000, 8192)
    assert long > 90 * short
    # and it is the attention term that does it: without it the ratio stays below 90
    linear = dataclasses.replace(m, pair_flops=(0.0,))
    assert chunked_prefill_time(linear, layout, 90_000, 8192) < 90 * chunked_prefill_time(
        linear, layout, 1_000, 8192)


def test_llama_8b_prefill_figures_by_hand() -> None:
    m, layout = llama8b("h100")
    g = GPU_PROFILES["h100"]
    params = 8_029_995_008
    emb = 128256 * 4096
    matmuls = 2 * (params - 2 * emb) * 1000 + 2 * emb
    # at the H100's measured matmul efficiency for 1,000 tokens: between its points
    # (516, 0.488) and (1032, 0.591)
    mfu = 0.488 + (0.591 - 0.488) * (1000 - 516) / (1032 - 516)
    attention = 4 * 32 * 128 * 32 * 500_500                 # at the attention efficiency 0.62
    compute = matmuls / (g.dense_bf16_flops * mfu) + attention / (g.dense_bf16_flops * 0.62)
    memory = (2 * params + 1000 * 131_072) / (g.hbm_bandwidth_bytes_per_s * 0.8)
    assert compute > memory                    # a 1,000-token prefill is compute-bound
    scheduler = 1.55e-6 * 63                   # the 63 blocks of 16 tokens its prompt begins
    want = 1.4e-3 + 15e-6 + scheduler + compute
    assert chunked_prefill_time(m, layout, 1000, 8192) == pytest.approx(want, rel=1e-12)


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    m, _ = llama8b("h100")
    one = StepLoad(decode_seqs=1, requests=1, kv_read_bytes=1000 * 131_072, pairs=(1000,))
    assert m.memory_s(one) > m.compute_s(one)
    assert m.time(one) == pytest.approx(1.4e-3 + 15e-6 + m.memory_s(one), rel=1e-12)
    # the weight-bandwidth floor: 16.06 GB at 3.35 TB/s
    assert m.time(one) > 16.06e9 / 3.35e12
    big = StepLoad(prefill_tokens=8192, requests=1, kv_read_bytes=8192 * 131_072, pairs=(8192 * 8193 // 2,))
    assert m.compute_s(big) > m.memory_s(big)


def test_host_overhead_grows_with_the_batch() -> None:
    m, _ = llama8b("h100")
    quiet = dataclasses.replace(m, host=HostOverhead(0.0, 0.0))
    for n in (1, 64, 256):
        load = StepLoad(decode_seqs=n, requests=n, kv_read_bytes=n * 100, pairs=(n * 100,))
        assert m.time(load) - quiet.time(load) == pytest.approx(1.4e-3 + 15e-6 * n, rel=1e-9)


def test_h200_not_slower_and_tensor_parallel_splits() -> None:
    a, _ = llama8b("h100")
    b, _ = llama8b("h200")
    two, _ = llama8b("h100", tp=2)
    load = StepLoad(prefill_tokens=512, decode_seqs=32, requests=33, kv_read_bytes=10**9, pairs=(10**7,))
    assert b.time(load) <= a.time(load)
    assert two.token_flops == pytest.approx(a.token_flops / 2)
    assert two.weight_bytes == pytest.approx(a.weight_bytes / 2)
    assert two.pair_flops[0] == pytest.approx(a.pair_flops[0] / 2)


def test_moe_computes_with_active_and_reads_the_experts_its_tokens_use() -> None:
    m = step_model_for("h100", "qwen3-30b-a3b")
    shape, groups = shipped("qwen3-30b-a3b")
    total, active = shape.param_counts(groups)
    assert m.weight_bytes == 2 * total
    assert m.token_flops == 2 * (active - 2 * 151936 * 2048)
    # the routed experts by hand: 48 layers x 128 experts x a gated MLP of 2048 x 768
    experts = 48 * 128 * 3 * 2048 * 768
    assert shape.routed_expert_params(groups) == experts
    assert m.expert_bytes == 2 * experts
    assert m.expert_idle == 1 - 8 / 128
    # one decode token reads its 8 experts per layer: the active parameters' bytes
    one = StepLoad(decode_seqs=1, requests=1)
    assert m.weights_read(one) == pytest.approx(2 * active, rel=1e-12)
    # 64 tokens leave an expert idle with probability (120/128)^64, about 1.6 %
    wide = StepLoad(prefill_tokens=60, decode_seqs=4, requests=5)
    assert m.weights_read(wide) == pytest.approx(2 * total - 2 * experts * (120 / 128) ** 64, rel=1e-12)
    assert 0.98 < (m.weights_read(wide) - (2 * total - 2 * experts)) / (2 * experts) < 0.99
    # a prefill chunk of thousands of tokens reads every expert
    assert m.weights_read(StepLoad(prefill_tokens=8192, requests=1)) == pytest.approx(2 * total, rel=1e-12)
    # so a batch-1 decode step is about the active weights' read, not the whole model's
    ctx = StepLoad(decode_seqs=1, requests=1, kv_read_bytes=1000 * 98_304, pairs=(1000,))
    g = GPU_PROFILES["h100"]
    bandwidth = g.hbm_bandwidth_bytes_per_s * 0.8
    assert m.memory_s(ctx) == pytest.approx((2 * active + 1000 * 98_304) / bandwidth)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b", "llama-4-scout", "qwen3-next-80b-a3b",
                                  "deepseek-v4-style"])
def test_moe_weights_read_grow_with_the_tokens_from_active_to_all(name: str) -> None:
    tp = 2 if name in ("llama-4-scout", "qwen3-next-80b-a3b", "deepseek-v4-style") else 1
    tph = 8 if name == "deepseek-v4-style" else 16
    m = step_model_for("h200", name, tensor_parallel=tp, tokens_per_hash=tph)
    assert 0 < m.expert_bytes < m.weight_bytes
    reads = [m.weights_read(StepLoad(decode_seqs=n, requests=n)) for n in (1, 2, 8, 64, 512, 10**5)]
    assert reads == sorted(reads) and len(set(reads)) > 3
    assert reads[-1] == pytest.approx(m.weight_bytes, rel=1e-9)
    # one token: everything but the experts, and experts_per_token / experts of them
    shape, _ = shipped(name)
    want = m.weight_bytes - m.expert_bytes + m.expert_bytes * shape.experts_per_token / shape.experts
    assert reads[0] == pytest.approx(want, rel=1e-12)


def test_moe_expert_bytes_given_derived_or_in_proportion() -> None:
    # gpt-oss-120b states its MXFP4 experts' bytes: 114,661,785,600 parameters at 4.25 bits
    shape, groups = shipped("gpt-oss-120b")
    assert shape.routed_expert_bytes(groups) == 114_661_785_600 * 17 // 32
    # the derived count comes within 0.1 % of the recount (biases and sinks aside)
    assert shape.routed_expert_params(groups) == pytest.approx(114_661_785_600, rel=1e-3)
    # weights given without the experts' bytes: their share in proportion to parameters
    plain = dataclasses.replace(shape, expert_weight_bytes=None)
    total = shape.param_counts(groups)[0]
    assert plain.routed_expert_bytes(groups) == 65_248_815_744 * plain.routed_expert_params(groups) // total
    # a dense model, or one whose every expert is active, has no routed experts to skip
    dense, dgroups = shipped("llama-3.1-8b")
    assert dense.routed_expert_params(dgroups) == 0
    m = step_model_for("h100", "llama-3.1-8b")
    assert m.expert_bytes == 0 and m.weights_read(StepLoad(decode_seqs=1, requests=1)) == m.weight_bytes
    every = ModelShape("m", 64, 100, 2, experts=4, experts_per_token=4, expert_intermediate_size=8)
    spec = [GroupSpec(GroupKind.FULL, 16, shape=KVShape(2, 1, 8))]
    assert every.routed_expert_params(spec) == 0
    with pytest.raises(ValueError, match="expert_weight_bytes"):
        ModelShape("m", 8, 8, 1, intermediate_size=8, expert_weight_bytes=10)
    with pytest.raises(ValueError, match="exceeds"):
        dataclasses.replace(shape, expert_weight_bytes=shape.weight_bytes + 1)
    with pytest.raises(ValueError, match="expert_idle"):
        RooflineStepModel(1.0, 1.0, (), 10.0, 1.0, 1.0, expert_bytes=5.0, expert_idle=1.0)
    with pytest.raises(ValueError, match="exceeds"):
        RooflineStepModel(1.0, 1.0, (), 10.0, 1.0, 1.0, expert_bytes=11.0, expert_idle=0.5)


def test_pair_flops_per_kind() -> None:
    # gpt-oss-120b: 64 query heads of 64 in 18 sliding and 18 full layers
    m = step_model_for("h200", "gpt-oss-120b")
    assert m.pair_flops == (4 * 64 * 64 * 18, 4 * 64 * 64 * 18)
    # Qwen3-Next: 3 mamba groups of 12 Gated DeltaNet layers (524,288 state elements), 12 full
    q = step_model_for("h200", "qwen3-next-80b-a3b", tensor_parallel=2)
    assert q.pair_flops == (7 * 524_288 * 12 / 2,) * 3 + (4 * 16 * 256 * 12 / 2,)
    # attention pairs run at the attention efficiency (FlashAttention-3's measured 0.62 of peak),
    # mamba updates at the matmuls' large-step efficiency (the H200 curve's last point, 0.633)
    peak = GPU_PROFILES["h200"].dense_bf16_flops
    assert m.pair_flops_per_s == (peak * 0.62, peak * 0.62)
    assert q.pair_flops_per_s == (peak * 0.633,) * 3 + (peak * 0.62,)
    assert q.flops_per_s == peak * 0.633


def test_attention_efficiency_is_the_gpus_measurement_where_one_exists() -> None:
    # the H20's FlashAttention-3 measurement (0.85 of its 148 TFLOPS) replaces the H100's 0.62;
    # an explicit figure still wins, and the matmuls keep mfu
    shape, groups = shipped("llama-3.1-8b")
    h20 = GPU_PROFILES["h20"]
    assert h20.attention_efficiency == 0.85
    assert GPU_PROFILES["h100"].attention_efficiency is None
    m = roofline_step_model(h20, shape, groups)
    assert m.pair_flops_per_s == (148e12 * 0.85,)
    assert m.flops_per_s == 148e12 * 0.84
    forced = roofline_step_model(h20, shape, groups, attention_efficiency=0.62)
    assert forced.pair_flops_per_s == (148e12 * 0.62,)
    # a long prefill is attention-bound: the measured rate makes it faster than the default would
    load = StepLoad(prefill_tokens=8192, decode_seqs=0, requests=1, kv_read_bytes=0,
                    pairs=(attention_pairs(GroupKind.FULL, 0, 57344, 8192),))
    assert m.time(load) < forced.time(load)
    with pytest.raises(ValueError, match="attention_efficiency"):
        dataclasses.replace(h20, attention_efficiency=1.5)


def test_the_h20s_matmuls_run_at_its_measured_gemm_rate_for_every_step() -> None:
    # a GEMM of 8,192 x 8,192 x 3,696 per H20 and its reduce-scatter in 4.01 ms (Triton-distributed
    # issue 48): >= 124 TFLOP/s, 0.84 of 148; one point, so flat: a step of 100 tokens and one of
    # 16,384 get the same rate (the A100's curve, a third of the H100's peak, is nearly flat)
    h20 = GPU_PROFILES["h20"]
    assert h20.matmul_efficiency == ((8192, 0.84),) and h20.large_step_mfu == 0.84
    shape, groups = shipped("llama-3.1-8b")
    m = roofline_step_model(h20, shape, groups)
    assert m.token_rate(100) == m.token_rate(8192) == m.token_rate(16384) == pytest.approx(148e12 * 0.84)
    # a constant mfu (a hardware file's, a run's or calibrate's) still replaces the curve
    assert roofline_step_model(h20, shape, groups, mfu=0.5).token_rate(100) == pytest.approx(148e12 * 0.5)


def test_the_b200_prefills_faster_than_the_h100_by_its_peak_and_decodes_by_its_bandwidth() -> None:
    # B200: 2,250 TFLOPS dense at the H100's measured matmul curve scaled by the two GPUs' maximum
    # achievable matmul efficiency (77.6 % against 80.3 %), attention at the H100's 0.62, 7.67 TB/s
    b200, h100 = GPU_PROFILES["b200"], GPU_PROFILES["h100"]
    assert [n for n, _ in b200.matmul_efficiency] == [n for n, _ in h100.matmul_efficiency]
    for (_, eb), (_, eh) in zip(b200.matmul_efficiency, h100.matmul_efficiency, strict=True):
        assert eb == pytest.approx(eh * 0.776 / 0.803, abs=5e-4)
    assert b200.attention_efficiency is None and b200.h2d == h100.h2d
    shape, groups = shipped("llama-3.1-8b")
    mb, mh = roofline_step_model(b200, shape, groups), roofline_step_model(h100, shape, groups)
    # a long prefill chunk's compute: the B200 takes about 989 / 2,250 of the time (0.456 for the
    # matmuls at the scaled curve, 0.440 for the attention at the same 0.62)
    prefill = StepLoad(prefill_tokens=8192, decode_seqs=0, requests=1, kv_read_bytes=0,
                       pairs=(attention_pairs(GroupKind.FULL, 0, 57344, 8192),))
    ratio = mb.compute_s(prefill) / mh.compute_s(prefill)
    assert 0.440 < ratio < 0.456, ratio
    assert mb.time(prefill) < 0.5 * mh.time(prefill)
    # a decode batch's memory time: the ratio of the bandwidths, 3.35 / 7.67
    decode = StepLoad(prefill_tokens=0, decode_seqs=64, requests=64, kv_read_bytes=64 * 4000 * 131072,
                      pairs=(64 * 4000,))
    assert mb.memory_s(decode) / mh.memory_s(decode) == pytest.approx(3.35 / 7.67, rel=1e-9)
    assert mb.time(decode) < mh.time(decode)


def test_roofline_rejects_bad_arguments() -> None:
    shape, groups = shipped("llama-3.1-8b")
    g = GPU_PROFILES["h100"]
    for kwargs in ({"tensor_parallel": 0}, {"tensor_parallel": True}, {"mfu": 0.0}, {"mbu": 1.5},
                   {"attention_efficiency": 0.0}, {"attention_efficiency": 1.1}):
        with pytest.raises(ValueError):
            roofline_step_model(g, shape, groups, **kwargs)  # type: ignore[arg-type]
    mamba = GroupSpec(GroupKind.MAMBA, 16, shape=KVShape(2, 1, 8))
    no_state = ModelShape("m", 8, 8, 1, params=1000, active_params=1000)
    with pytest.raises(ValueError, match="mamba_state_elements"):
        roofline_step_model(g, no_state, [mamba])


# -- transfer pieces ----------------------------------------------------------------------------------------


def test_pieces_per_block() -> None:
    spec = GroupSpec(GroupKind.FULL, 16, shape=KVShape(32, 8, 128))
    assert pieces_per_block(spec, "layer") == 32
    assert pieces_per_block(spec, "block") == 1
    assert pieces_per_block(GroupSpec(GroupKind.FULL, 16), "layer") == 1
    # vLLM 0.11 with FlashAttention: keys and values apart, a Llama 3.1 8B block in 64 pieces of
    # 32 KiB (the vLLM blog's table of physical block sizes: "32 KB" old, "2 MB" new)
    assert pieces_per_block(spec, "kv") == 64
    assert spec.shape is not None and spec.shape.bytes_per_block(16) // 64 == 32 * 1024
    mla = GroupSpec(GroupKind.FULL, 64, shape=KVShape(61, 1, 576, mla=True))
    assert pieces_per_block(mla, "kv") == pieces_per_block(mla, "layer") == 61
    mamba = GroupSpec(GroupKind.MAMBA, 16, shape=KVShape(4, 8, 128))
    assert pieces_per_block(mamba, "kv") == 4
    assert pieces_per_block(GroupSpec(GroupKind.FULL, 16), "kv") == 1


def test_piece_overhead_and_the_bandwidth_curve() -> None:
    link = GPU_PROFILES["h100"].h2d
    # one 16-token Llama 3.1 8B block: 32 per-layer pages of 64 KiB
    assert link.time(2 * 2**20, 32) == 10e-6 + 32 * 2.5e-6 + 2 * 2**20 / 55e9
    assert TransferModel(55e9, 10e-6).time(2 * 2**20, 32) == 10e-6 + 2 * 2**20 / 55e9
    curve = [link.piece_bandwidth(2**k) for k in range(10, 27)]
    assert curve == sorted(curve)                         # slow for small pieces, rising ...
    assert curve[0] < 0.01 * 55e9 and curve[-1] > 0.95 * 55e9   # ... towards the peak
    half = link.piece_overhead_s * link.bandwidth_bytes_per_s  # the size at half the peak
    assert link.piece_bandwidth(round(half)) == pytest.approx(55e9 / 2, rel=1e-3)


@pytest.mark.parametrize("factor", [0.0, -0.5, 1.5, float("nan")])
def test_transfer_rejects_bad_duplex_factor(factor: float) -> None:
    with pytest.raises(ValueError, match="duplex_factor"):
        TransferModel(1e9, 0.0, 0.0, factor)


counts = st.integers(min_value=0, max_value=10**6)


@given(counts, counts, counts, st.integers(0, 10**12), counts, counts, st.sampled_from([0.0, 0.5, 0.97]))
def test_roofline_time_is_monotone_in_every_input(p: int, d: int, n: int, kv: int, a: int, b: int,
                                                  idle: float) -> None:
    m = RooflineStepModel(2e9, 5e8, (3e4, 7e4), 4e9, 1e14, 2e12, HostOverhead(1e-3, 2e-5),
                          expert_bytes=3e9 if idle else 0.0, expert_idle=idle)
    base = StepLoad(p, d, 0.0, n, kv, (a, b))
    t = m.time(base)
    assert t >= 1e-3 + 2e-5 * n
    more = [{"prefill_tokens": p + 1}, {"decode_seqs": d + 1}, {"requests": n + 1},
            {"kv_read_bytes": kv + 10**6}, {"pairs": (a + 1, b)}, {"pairs": (a, b + 1)}]
    for change in more:
        assert m.time(dataclasses.replace(base, **change)) >= t  # type: ignore[arg-type]


# -- the matmul efficiency by tokens per step ---------------------------------------------------------


def test_hopper_curve_is_what_the_measured_rows_give() -> None:
    """HOPPER_MATMUL_EFFICIENCY is benchmarks/matmul_efficiency.py's derivation from
    Vidur's H100 operator profile, not a number typed in."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "matmul_efficiency.py"
    spec = importlib.util.spec_from_file_location("matmul_efficiency", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.window_points() == HOPPER_MATMUL_EFFICIENCY
    # the measured shape: small steps reach less of the peak than large ones
    effs = [e for _, e in HOPPER_MATMUL_EFFICIENCY]
    assert effs == sorted(effs) and effs[0] < 0.5 < effs[-1]
    # the A100's rows, the same way over its own peak: flatter (its peak is a third of the H100's)
    assert mod.window_points("a100") == AMPERE_MATMUL_EFFICIENCY == GPU_PROFILES["a100"].matmul_efficiency
    assert GPU_PROFILES["a100"].dense_bf16_flops == mod.A100_PEAK
    amp = [e for _, e in AMPERE_MATMUL_EFFICIENCY]
    assert max(amp) - min(amp) < 0.05 < effs[-1] - effs[0]


def test_token_rate_interpolates_between_points_and_is_flat_outside() -> None:
    m = RooflineStepModel(token_flops=1.0, sample_flops=0.0, pair_flops=(), weight_bytes=0.0,
                          flops_per_s=3.0, bytes_per_s=1.0, token_rate_curve=((100, 1.0), (300, 2.0)))
    assert m.token_rate(1) == 1.0
    assert m.token_rate(100) == 1.0
    assert m.token_rate(200) == 1.5
    assert m.token_rate(300) == 2.0
    assert m.token_rate(10_000) == 2.0
    # 200 token FLOPs at 1.5 FLOP/s
    assert m.compute_s(StepLoad(prefill_tokens=150, decode_seqs=50, requests=0)) == 200 / 1.5
    flat = dataclasses.replace(m, token_rate_curve=())
    assert flat.token_rate(200) == 3.0
    for bad in (((300, 1.0), (100, 2.0)), ((100, 1.0), (100, 2.0)), ((0, 1.0),), ((100, 0.0),)):
        with pytest.raises(ValueError):
            dataclasses.replace(m, token_rate_curve=bad)


def test_profiles_with_a_measured_curve_use_it_unless_mfu_is_given() -> None:
    shape, groups = shipped("llama-3.1-8b")
    for name in ("h100", "h200"):
        g = GPU_PROFILES[name]
        assert g.matmul_efficiency == HOPPER_MATMUL_EFFICIENCY
        m = roofline_step_model(g, shape, groups)
        assert m.token_rate_curve == tuple((t, g.dense_bf16_flops * e) for t, e in HOPPER_MATMUL_EFFICIENCY)
        assert m.flops_per_s == g.dense_bf16_flops * HOPPER_MATMUL_EFFICIENCY[-1][1]
        small = StepLoad(prefill_tokens=256, decode_seqs=0, requests=1, pairs=(0,))
        big = StepLoad(prefill_tokens=8192, decode_seqs=0, requests=1, pairs=(0,))
        # per token, a small step's matmuls take longer than a large step's
        assert m.compute_s(small) / 256 > m.compute_s(big) / 8192
        fixed = roofline_step_model(g, shape, groups, mfu=0.5)
        assert fixed.token_rate_curve == () and fixed.flops_per_s == g.dense_bf16_flops * 0.5
    # no measurement for the L40S: the default constant
    l40s = roofline_step_model(GPU_PROFILES["l40s"], shape, groups)
    assert l40s.token_rate_curve == ()
    assert l40s.flops_per_s == GPU_PROFILES["l40s"].dense_bf16_flops * DEFAULT_MFU


def test_scenario_mfu_replaces_the_curve() -> None:
    """A run's ``hardware.mfu`` (or a hardware file's) is a constant for every step; left
    out, the run gets its GPU's curve, and its resolved scenario does not name an mfu."""
    default = scenarios_dir() / "default.toml"
    curve = load_run(default, []).step_cost
    assert isinstance(curve, RooflineStepModel) and curve.token_rate_curve
    assert "mfu" not in load_run(default, []).resolved()["hardware"]
    run = load_run(default, ["hardware.mfu=0.42"])
    fixed = run.step_cost
    assert isinstance(fixed, RooflineStepModel) and fixed.token_rate_curve == ()
    assert fixed.flops_per_s == GPU_PROFILES["h200"].dense_bf16_flops * 0.42
    assert run.resolved()["hardware"]["mfu"] == 0.42


def test_eager_passes_take_at_least_their_layers_launches() -> None:
    """``enforce_eager``: a forward pass takes the longer of its GPU time and the host's
    launches, decoder layers x ``eager_layer_s`` (Llama 3.1 8B: 32 x 0.75 ms); a batch-1
    decode step is launch-bound, a long prefill chunk still compute-bound, and with graphs
    (the default) nothing changes."""
    graphs, _ = llama8b("h100")
    mf = load_model_file(scenarios_dir() / "models" / "llama-3.1-8b.toml")
    eager = step_model_for("h100", "llama-3.1-8b", enforce_eager=True)
    assert graphs.launch_s == 0.0
    assert sum(g.layers for g in mf.groups) == 32
    assert eager.launch_s == pytest.approx(32 * 0.75e-3, rel=1e-12)
    assert eager.launch_s == pytest.approx(32 * GPU_PROFILES["h100"].host.eager_layer_s, rel=1e-12)
    one = StepLoad(decode_seqs=1, requests=1, kv_read_bytes=1000 * 131_072, pairs=(1000,))
    assert max(graphs.compute_s(one), graphs.memory_s(one)) < eager.launch_s
    assert eager.time(one) == pytest.approx(1.4e-3 + 15e-6 + 32 * 0.75e-3, rel=1e-12)
    assert graphs.time(one) == pytest.approx(1.4e-3 + 15e-6 + graphs.memory_s(one), rel=1e-12)
    big = StepLoad(prefill_tokens=8192, requests=1, kv_read_bytes=8192 * 131_072, pairs=(8192 * 8193 // 2,))
    assert graphs.compute_s(big) > eager.launch_s
    assert eager.time(big) == graphs.time(big)
    # tensor parallelism divides the GPU time, not the launches: every worker launches every layer
    tp4 = step_model_for("h100", "llama-3.1-8b", tensor_parallel=4, enforce_eager=True)
    assert tp4.launch_s == eager.launch_s


def test_a_hybrid_models_launches_count_every_decoder_layer() -> None:
    """The layer count is the model's own (every group's layers; a borrowed cost profile's
    when the model has one): gpt-oss-120b's 18 full and 18 sliding-window layers are 36."""
    eager = step_model_for("h200", "gpt-oss-120b", enforce_eager=True)
    mf = load_model_file(scenarios_dir() / "models" / "gpt-oss-120b.toml")
    assert len(mf.groups) >= 2
    layers = sum(g.layers for g in mf.groups)
    assert layers == 36
    assert eager.launch_s == pytest.approx(layers * 0.75e-3, rel=1e-12)


def test_scenario_enforce_eager_and_its_host_figure() -> None:
    """``costs.enforce_eager`` gives the roofline its launch floor with the hardware's
    ``host_eager_layer_s`` (a run may set it); off, the resolved scenario names neither, so
    earlier resolved scenarios (and their digests) are unchanged."""
    default = scenarios_dir() / "default.toml"
    off = load_run(default, [])
    assert isinstance(off.step_cost, RooflineStepModel) and off.step_cost.launch_s == 0.0
    assert "enforce_eager" not in off.resolved()["costs"]
    assert "host_eager_layer_s" not in off.resolved()["hardware"]
    run = load_run(default, ["costs.enforce_eager=true", "hardware.host_eager_layer_s=0.0005"])
    step = run.step_cost
    assert isinstance(step, RooflineStepModel)
    layers = sum(g.layers for g in run.model.cost_groups)
    assert step.launch_s == pytest.approx(layers * 0.0005, rel=1e-12)
    res = run.resolved()
    assert res["costs"]["enforce_eager"] is True and res["hardware"]["host_eager_layer_s"] == 0.0005
    again = load_run(default, ["costs.enforce_eager=true"])
    assert again.resolved()["hardware"]["host_eager_layer_s"] == GPU_PROFILES["h200"].host.eager_layer_s


def test_scenario_tokenize_and_its_host_figure() -> None:
    """``costs.tokenize`` (text prompts through vLLM's OpenAI server) delays each arrival by the
    hardware's ``host_tokenize_token_s`` per prompt token (a run may set it), whatever the step
    model; off, the engine gets token ids and the resolved scenario names neither key."""
    default = scenarios_dir() / "default.toml"
    off = load_run(default, [])
    assert off.engine_config().prompt_tokenize_s_per_token == 0.0
    assert "tokenize" not in off.resolved()["costs"]
    assert "host_tokenize_token_s" not in off.resolved()["hardware"]
    run = load_run(default, ["costs.tokenize=true"])
    per_token = run.engine_config().prompt_tokenize_s_per_token
    assert per_token == GPU_PROFILES["h200"].host.tokenize_token_s == 1e-6
    res = run.resolved()
    assert res["costs"]["tokenize"] is True and res["hardware"]["host_tokenize_token_s"] == 1e-6
    assert run.step_cost == off.step_cost   # the forward pass does not change
    over = load_run(default, ["costs.tokenize=true", "hardware.host_tokenize_token_s=2.5e-6",
                              'costs.step="zero"'])
    assert over.engine_config().prompt_tokenize_s_per_token == 2.5e-6
    assert over.resolved()["hardware"]["host_tokenize_token_s"] == 2.5e-6


def test_the_eager_figure_gives_back_its_source() -> None:
    """docs/costs.md derives host_eager_layer_s from vLLM's Qwen2.5-7B decoder on an A800: 22-23 ms
    per output token eager, 13 ms with CUDA graphs. The shipped files replay the eager figure (by
    construction) and come within 20 % of the graph one (the roofline's own check)."""
    one = StepLoad(decode_seqs=1, requests=1, kv_read_bytes=500 * 57_344, pairs=(500,))
    eager = step_model_for("a100", "qwen2.5-7b", enforce_eager=True).time(one)
    graphs = step_model_for("a100", "qwen2.5-7b").time(one)
    assert 22e-3 <= eager <= 23e-3
    assert abs(graphs / 13e-3 - 1) <= 0.20


_pos = st.floats(min_value=1e-3, max_value=1e15, allow_nan=False, allow_infinity=False)
_pairs = st.lists(st.integers(0, 10**9), min_size=4, max_size=4)
_decode_steps = st.lists(st.tuples(st.integers(0, 10**12), _pairs), min_size=1, max_size=6)


@given(n=st.integers(1, 512), groups=st.integers(1, 4), rates=st.booleans(), idle=st.floats(0.0, 0.99),
       launch=st.sampled_from([0.0, 0.02]), curve=st.booleans(), token_flops=_pos, weight_bytes=_pos,
       steps=_decode_steps)
def test_decode_timer_is_time_bit_for_bit(n, groups, rates, idle, launch, curve, token_flops, weight_bytes,
                                          steps):
    """The fast-forward's per-step timer (its constant part evaluated once) gives exactly
    :meth:`RooflineStepModel.time` of the step's load, whatever the model's terms; a model
    without one (the linear model) is timed through its own ``time``."""
    m = RooflineStepModel(token_flops, 5e8, tuple(3e4 * (g + 1) for g in range(groups)), weight_bytes,
                          1e14, 2e12,
                          HostOverhead(1e-3, 2e-5, 1e-6, 1.5e-6, 8e-7),
                          pair_flops_per_s=tuple(6e14 / (g + 1) for g in range(groups)) if rates else (),
                          expert_bytes=weight_bytes * 0.9, expert_idle=idle,
                          token_rate_curve=((16, 2e14), (256, 9e14)) if curve else (), launch_s=launch)
    linear = StepCostModel(1e-3, 2e-6, 3e-5, 4e-9)
    for model in (m, linear):
        timed = decode_timer(model, n)
        for kv, pairs in steps:
            load = StepLoad(0, n, kv / 7, n, kv, tuple(pairs[:groups]))
            assert timed(kv / 7, kv, tuple(pairs[:groups])) == model.time(load)
