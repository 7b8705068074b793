"""Tests of the step-time and transfer-time models (sim.model.costs).

The formula tests compare against the literal expression and against a case
where another summation order gives a different float; the profile tests pin
the published figures (recomputed here from the config numbers) and check the
derived step models for plausibility against published decode latencies.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.model.costs import (
    GPU_PROFILES,
    MODEL_COST_PROFILES,
    ZERO_STEP,
    ZERO_TRANSFER,
    GpuProfile,
    ModelCostProfile,
    StepCostModel,
    TransferModel,
    kv_bytes_per_token,
    step_model_for,
)

coef = st.floats(min_value=0.0, max_value=1e3, allow_nan=False, allow_infinity=False)
count = st.integers(min_value=0, max_value=10**7)


def literal(m: StepCostModel, p: int, d: int, c: int) -> float:
    return m.overhead_s + m.prefill_token_s * p + m.decode_seq_s * d + m.context_token_s * c


# -- StepCostModel -------------------------------------------------------------------------------------


@given(coef, coef, coef, coef, count, count, count)
def test_step_time_is_the_literal_expression(
    o: float, pt: float, ds: float, ct: float, p: int, d: int, c: int
) -> None:
    m = StepCostModel(o, pt, ds, ct)
    got = m.step_time(p, d, c)
    assert got == literal(m, p, d, c)
    assert isinstance(got, float)


def test_step_time_sums_left_to_right() -> None:
    # (1 + e) + e rounds back to 1.0 at each addition; any order that adds the two small
    # terms first (or fsum) gives 1 + 2e rounded up: the order of evaluation shows.
    e = 1e-16
    assert 1.0 + (e + e) != 1.0
    assert math.fsum([1.0, e, e]) != 1.0
    m = StepCostModel(overhead_s=1.0, prefill_token_s=e, decode_seq_s=e, context_token_s=0.0)
    assert m.step_time(1, 1, 0) == 1.0
    m = StepCostModel(overhead_s=1.0, prefill_token_s=0.0, decode_seq_s=e, context_token_s=e)
    assert m.step_time(0, 1, 1) == 1.0
    m = StepCostModel(overhead_s=1.0, prefill_token_s=e, decode_seq_s=0.0, context_token_s=e)
    assert m.step_time(1, 0, 1) == 1.0


def test_step_time_bit_identical_across_calls() -> None:
    m = step_model_for("h100", "llama-3.1-8b")
    a = m.step_time(123, 45, 67_891)
    b = StepCostModel(m.overhead_s, m.prefill_token_s, m.decode_seq_s, m.context_token_s).step_time(
        123, 45, 67_891
    )
    assert a.hex() == b.hex()


@given(coef, coef, coef, coef, count, count, count)
def test_step_time_monotone_in_each_count(
    o: float, pt: float, ds: float, ct: float, p: int, d: int, c: int
) -> None:
    m = StepCostModel(o, pt, ds, ct)
    base = m.step_time(p, d, c)
    assert m.step_time(p + 1, d, c) >= base
    assert m.step_time(p, d + 1, c) >= base
    assert m.step_time(p, d, c + 1) >= base


def test_step_time_strictly_increases_for_a_real_model() -> None:
    m = step_model_for("h100", "llama-3.1-8b")
    base = m.step_time(100, 10, 10_000)
    assert m.step_time(101, 10, 10_000) > base
    assert m.step_time(100, 11, 10_000) > base
    assert m.step_time(100, 10, 10_001) > base


def test_zero_model() -> None:
    assert StepCostModel(0.0, 0.0, 0.0, 0.0) == ZERO_STEP
    t = ZERO_STEP.step_time(0, 0, 0)
    assert t == 0.0
    assert isinstance(t, float)
    assert ZERO_STEP.step_time(10**6, 10**3, 10**9) == 0.0


def test_int_coefficients_become_floats() -> None:
    m = StepCostModel(1, 0, 0, 0)
    assert isinstance(m.overhead_s, float)
    assert isinstance(m.step_time(0, 0, 0), float)


@pytest.mark.parametrize("field", ["overhead_s", "prefill_token_s", "decode_seq_s", "context_token_s"])
@pytest.mark.parametrize("bad", [-1e-9, -1.0, math.nan, math.inf, -math.inf])
def test_step_model_rejects_bad_coefficients(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=field):
        StepCostModel(**{field: bad})


def test_step_model_is_frozen() -> None:
    m = StepCostModel(1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.overhead_s = 2.0  # type: ignore[misc]


# -- TransferModel -------------------------------------------------------------------------------------


def test_transfer_time_formula() -> None:
    t = TransferModel(50e9, 1e-5)
    assert t.time(0) == 1e-5
    assert t.time(2 * 1024 * 1024) == 1e-5 + 2 * 1024 * 1024 / 50e9
    assert t.time(50 * 10**9) == pytest.approx(1.0 + 1e-5)


def test_transfer_infinite_bandwidth_counts_only_latency() -> None:
    t = TransferModel(math.inf, 3e-6)
    assert t.time(0) == 3e-6
    assert t.time(10**15) == 3e-6
    assert ZERO_TRANSFER.time(10**12) == 0.0
    assert TransferModel(math.inf, 0.0) == ZERO_TRANSFER


@given(st.integers(min_value=0, max_value=10**13), st.integers(min_value=0, max_value=10**13))
def test_transfer_time_monotone(a: int, b: int) -> None:
    t = GPU_PROFILES["h100"].h2d
    lo, hi = sorted((a, b))
    assert t.time(lo) <= t.time(hi)


@pytest.mark.parametrize("bw", [0.0, -1.0, math.nan, -math.inf])
def test_transfer_rejects_bad_bandwidth(bw: float) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        TransferModel(bw)


@pytest.mark.parametrize("lat", [-1e-6, math.nan, math.inf])
def test_transfer_rejects_bad_latency(lat: float) -> None:
    with pytest.raises(ValueError, match="latency"):
        TransferModel(1e9, lat)


def test_transfer_rejects_negative_bytes() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        TransferModel(1e9).time(-1)


# -- profiles ------------------------------------------------------------------------------------------


def test_gpu_profiles_datasheet_figures() -> None:
    h100, h200 = GPU_PROFILES["h100"], GPU_PROFILES["h200"]
    assert (h100.hbm_bytes, h100.hbm_bandwidth_bytes_per_s, h100.dense_bf16_flops) == (80e9, 3.35e12, 989e12)
    assert (h200.hbm_bytes, h200.hbm_bandwidth_bytes_per_s, h200.dense_bf16_flops) == (141e9, 4.8e12, 989e12)
    for g in (h100, h200):
        # effective PCIe Gen5 x16: below the 63 GB/s raw rate, above 45 GB/s
        for link in (g.h2d, g.d2h):
            assert 45e9 <= link.bandwidth_bytes_per_s < 63e9
            assert 0.0 <= link.latency_s < 1e-3
        assert g.sources and all(s for s in g.sources)
        assert any("nvidia.com" in s for s in g.sources)


# (layers, kv heads, head dim, total params, active params) from the model cards / config.json
CONFIGS = {
    "llama-3.1-8b": (32, 8, 128, 8_030_261_248, 8_030_261_248),
    "llama-3.1-70b": (80, 8, 128, 70_553_706_496, 70_553_706_496),
    "qwen3-8b": (36, 8, 128, 8_190_735_360, 8_190_735_360),
    "qwen3-32b": (64, 8, 128, 32_762_123_264, 32_762_123_264),
    "qwen3-30b-a3b": (48, 4, 128, 30_532_122_624, 3_353_032_704),
}


def test_model_profiles_match_configs() -> None:
    assert set(CONFIGS) <= set(MODEL_COST_PROFILES)
    for name, (layers, kv, hd, total, active) in CONFIGS.items():
        p = MODEL_COST_PROFILES[name]
        assert p.name == name
        assert p.kv_bytes_per_token == 2 * layers * kv * hd * 2
        assert p.weight_bytes == 2 * total
        assert p.active_params == active
        assert p.sources and all("huggingface.co" in s or s.startswith("assumption") for s in p.sources)
    assert MODEL_COST_PROFILES["llama-3.1-8b"].kv_bytes_per_token == 131_072  # 128 KiB per token


def test_kv_bytes_per_token_helper() -> None:
    assert kv_bytes_per_token(32, 8, 128) == 131_072
    assert kv_bytes_per_token(32, 8, 128, dtype_bytes=1) == 65_536


def test_profile_validation() -> None:
    link = TransferModel(1e9)
    with pytest.raises(ValueError, match="hbm_bytes"):
        GpuProfile("x", 0, 1e12, 1e15, link, link, ())
    with pytest.raises(ValueError, match="hbm_bandwidth"):
        GpuProfile("x", 1, math.nan, 1e15, link, link, ())
    with pytest.raises(ValueError, match="dense_bf16_flops"):
        GpuProfile("x", 1, 1e12, math.inf, link, link, ())
    with pytest.raises(ValueError, match="active_params"):
        ModelCostProfile("m", -1.0, 1.0, 1, ())
    with pytest.raises(ValueError, match="weight_bytes"):
        ModelCostProfile("m", 1.0, math.nan, 1, ())
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        ModelCostProfile("m", 1.0, 1.0, 0, ())


# -- step_model_for ------------------------------------------------------------------------------------

PAIRS = [(g, m) for g in GPU_PROFILES for m in MODEL_COST_PROFILES]


@pytest.mark.parametrize(("gpu", "model"), PAIRS)
def test_step_model_for_positive(gpu: str, model: str) -> None:
    s = step_model_for(gpu, model)
    for v in (s.overhead_s, s.prefill_token_s, s.decode_seq_s, s.context_token_s):
        assert 0.0 < v < 1.0
        assert math.isfinite(v)
    # a decode token is cheap next to the weight read; a prefill token costs what a decode token does
    assert s.decode_seq_s < s.overhead_s
    assert s.prefill_token_s == s.decode_seq_s


@pytest.mark.parametrize("model", list(MODEL_COST_PROFILES))
def test_h200_not_slower_than_h100(model: str) -> None:
    a, b = step_model_for("h100", model), step_model_for("h200", model)
    assert b.overhead_s < a.overhead_s  # more HBM bandwidth
    assert b.context_token_s < a.context_token_s
    assert b.prefill_token_s <= a.prefill_token_s  # same compute
    assert b.decode_seq_s <= a.decode_seq_s
    for p, d, c in [(0, 1, 0), (0, 64, 200_000), (8192, 0, 8192), (2048, 128, 10**6)]:
        assert b.step_time(p, d, c) <= a.step_time(p, d, c)


def test_derivation() -> None:
    g, m = GPU_PROFILES["h100"], MODEL_COST_PROFILES["llama-3.1-70b"]
    s = step_model_for("h100", "llama-3.1-70b", tensor_parallel=4, mfu=0.4, mbu=0.7)
    bw = 4 * g.hbm_bandwidth_bytes_per_s * 0.7
    fl = 4 * g.dense_bf16_flops * 0.4
    assert s.overhead_s == pytest.approx(m.weight_bytes / bw, rel=1e-12)
    assert s.prefill_token_s == pytest.approx(2 * m.active_params / fl, rel=1e-12)
    assert s.context_token_s == pytest.approx(m.kv_bytes_per_token / bw, rel=1e-12)


def test_tensor_parallel_scales_down() -> None:
    one = step_model_for("h100", "llama-3.1-70b")
    two = step_model_for("h100", "llama-3.1-70b", tensor_parallel=2)
    assert two.overhead_s == pytest.approx(one.overhead_s / 2)
    assert two.prefill_token_s == pytest.approx(one.prefill_token_s / 2)


def test_higher_efficiency_is_faster() -> None:
    lo = step_model_for("h100", "qwen3-32b", mfu=0.3, mbu=0.6)
    hi = step_model_for("h100", "qwen3-32b", mfu=0.6, mbu=0.9)
    assert hi.overhead_s < lo.overhead_s
    assert hi.prefill_token_s < lo.prefill_token_s


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tensor_parallel": 0},
        {"tensor_parallel": -2},
        {"tensor_parallel": 1.5},
        {"tensor_parallel": True},
        {"mfu": 0.0},
        {"mfu": 1.5},
        {"mfu": math.nan},
        {"mbu": -0.1},
        {"mbu": math.nan},
    ],
)
def test_step_model_for_rejects_bad_arguments(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        step_model_for("h100", "llama-3.1-8b", **kwargs)  # type: ignore[arg-type]


def test_unknown_names_list_known_ones() -> None:
    with pytest.raises(KeyError) as gpu_err:
        step_model_for("a100", "llama-3.1-8b")
    msg = str(gpu_err.value)
    assert "a100" in msg
    assert all(name in msg for name in GPU_PROFILES)
    with pytest.raises(KeyError) as model_err:
        step_model_for("h100", "gpt-5")
    msg = str(model_err.value)
    assert "gpt-5" in msg
    assert all(name in msg for name in MODEL_COST_PROFILES)


def test_llama_8b_decode_on_h100_is_plausible() -> None:
    # BF16 weight floor at peak bandwidth is 16.06 GB / 3.35 TB/s = 4.8 ms; published batch-1
    # inter-token latencies of 8B models on H100 are a few ms (docs/costs.md): 3-30 ms is plausible.
    s = step_model_for("h100", "llama-3.1-8b")
    t = s.step_time(0, 1, 1_000)
    assert 3e-3 <= t <= 30e-3
    assert t >= 16.06e9 / 3.35e12  # never beats the bandwidth floor
    # 2048-token prefill on one H100: tens of ms, not seconds
    assert 20e-3 <= s.step_time(2048, 0, 2048) <= 500e-3


def test_no_simpy_import() -> None:
    import subprocess

    code = "import sys, sim.model.costs; assert 'simpy' not in sys.modules, 'sim.model.costs imported simpy'"
    subprocess.run([sys.executable, "-c", code], check=True)
