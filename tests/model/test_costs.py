"""Tests of the step-time and transfer-time models (sim.model.costs).

The formula tests compare against the literal expression and against a case
where another summation order gives a different float; the profile tests pin
the published GPU figures. The roofline step model (derived from the model
files' shapes) is tested in ``test_costs_roofline.py``.
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
    ZERO_STEP,
    ZERO_TRANSFER,
    GpuProfile,
    HostOverhead,
    RooflineStepModel,
    StepCostModel,
    StepLoad,
    TransferModel,
    before_loads_s,
    kv_bytes_per_token,
)

coef = st.floats(min_value=0.0, max_value=1e3, allow_nan=False, allow_infinity=False)
count = st.integers(min_value=0, max_value=10**7)


#: the linear coefficients earlier releases derived for Llama 3.1 8B on an H100 (docs/costs.md history)
LLAMA_8B_LINEAR = StepCostModel(5.99e-3, 32.48e-6, 32.48e-6, 48.9e-9)


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
    m = LLAMA_8B_LINEAR
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
    m = LLAMA_8B_LINEAR
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
    with pytest.raises(ValueError, match="pieces"):
        TransferModel(1e9).time(1, -1)


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
            assert link.piece_overhead_s == 2.5e-6
        # measured bidirectional DMA copies on an H100: 83.4 GB/s in all against about 50 one way,
        # the most with equal amounts each way: both directions keep the same share, below 2x in all
        assert (g.h2d.duplex_factor, g.d2h.duplex_factor) == (0.834, 0.834)
        assert g.h2d.duplex_factor + g.d2h.duplex_factor < 2.0
        assert g.host == HostOverhead(1.4e-3, 15e-6, 1.5e-6, 1.55e-6, 0.8e-6, 0.22e-3, 0.75e-3, 1e-6)
        assert g.sources and all(s for s in g.sources)
        assert any("nvidia.com" in s for s in g.sources)


def test_the_gh200_loads_over_nvlink_c2c_and_computes_like_an_h100() -> None:
    gh, h100 = GPU_PROFILES["gh200"], GPU_PROFILES["h100"]
    assert (gh.hbm_bytes, gh.hbm_bandwidth_bytes_per_s) == (96e9, 4.0e12)
    assert gh.dense_bf16_flops == h100.dense_bf16_flops and gh.matmul_efficiency == h100.matmul_efficiency
    # measured C2C copies, below the link's 450 GB/s each way; device->host the slower
    assert 450e9 > gh.h2d.bandwidth_bytes_per_s > gh.d2h.bandwidth_bytes_per_s > 250e9
    assert (gh.h2d.duplex_factor, gh.d2h.duplex_factor) == (0.5, 0.5)
    # a 100,000-token Llama-3.1-8B prompt (131,072 bytes a token): its bytes 6.3x faster over C2C than
    # over the H100's PCIe, 4.7x with its 6,250 copies of 2 MB (each paying the same per-copy cost)
    nbytes, pieces = 100_000 * 131_072, 100_000 // 16
    assert h100.h2d.time(nbytes, pieces) / gh.h2d.time(nbytes, pieces) > 4.5
    assert h100.h2d.time(nbytes) / gh.h2d.time(nbytes) > 6.0
    assert any("nvbandwidth" in src for src in gh.sources)


def test_kv_bytes_per_token_helper() -> None:
    assert kv_bytes_per_token(32, 8, 128) == 131_072
    assert kv_bytes_per_token(32, 8, 128, dtype_bytes=1) == 65_536


def test_profile_validation() -> None:
    link = TransferModel(1e9)
    host = HostOverhead()
    with pytest.raises(ValueError, match="hbm_bytes"):
        GpuProfile("x", 0, 1e12, 1e15, link, link, host, ())
    with pytest.raises(ValueError, match="hbm_bandwidth"):
        GpuProfile("x", 1, math.nan, 1e15, link, link, host, ())
    with pytest.raises(ValueError, match="dense_bf16_flops"):
        GpuProfile("x", 1, 1e12, math.inf, link, link, host, ())
    with pytest.raises(ValueError, match="per_request_s"):
        HostOverhead(0.0, -1.0)
    with pytest.raises(ValueError, match="per_hashed_block_s"):
        HostOverhead(0.0, 0.0, math.nan)
    with pytest.raises(ValueError, match="per_block_s"):
        HostOverhead(per_block_s=-1e-6)
    with pytest.raises(ValueError, match="no_forward_step_s"):
        HostOverhead(no_forward_step_s=math.inf)
    with pytest.raises(ValueError, match="eager_layer_s"):
        HostOverhead(eager_layer_s=-1e-3)
    with pytest.raises(ValueError, match="tokenize_token_s"):
        HostOverhead(tokenize_token_s=math.nan)
    with pytest.raises(ValueError, match="launch_s"):
        RooflineStepModel(0.0, 0.0, (), 0.0, 1.0, 1.0, launch_s=math.nan)


def test_the_schedulers_block_time() -> None:
    """The roofline's host time grows with the prompt blocks a step allocates and the
    blocks it loads; a step without a forward pass that issues loads costs the fixed
    no-forward time and the same per-block time; the linear model has neither."""
    host = HostOverhead(1e-3, 1e-5, 0.0, 2e-6, 1e-6, 3e-4)
    m = RooflineStepModel(2e9, 5e8, (3e4,), 4e9, 1e14, 2e12, host)
    base = StepLoad(prefill_tokens=512, requests=1, pairs=(9,))
    with_blocks = StepLoad(prefill_tokens=512, requests=1, pairs=(9,), blocks=32, loaded_blocks=100)
    assert m.scheduler_s(base) == 0.0
    assert m.scheduler_s(with_blocks) == pytest.approx(32 * 2e-6 + 100 * 3e-6)
    assert m.time(with_blocks) - m.time(base) == pytest.approx(m.scheduler_s(with_blocks))
    assert m.no_forward_s(StepLoad(loaded_blocks=100)) == pytest.approx(3e-4 + 100 * 3e-6)
    assert before_loads_s(m, with_blocks, forward=True) == m.scheduler_s(with_blocks)
    loads_only = StepLoad(loaded_blocks=100)
    assert before_loads_s(m, loads_only, forward=False) == m.no_forward_s(loads_only)
    assert before_loads_s(m, StepLoad(), forward=False) == 0.0     # nothing scheduled, nothing loaded
    lin = StepCostModel(0.004, 2e-5, 1e-4, 1e-8)
    assert lin.scheduler_s(with_blocks) == lin.no_forward_s(with_blocks) == 0.0
    assert lin.time(with_blocks) == lin.time(base)


def test_linear_model_time_is_step_time() -> None:
    m = StepCostModel(0.004, 2e-5, 1e-4, 1e-8)
    load = StepLoad(prefill_tokens=100, decode_seqs=3, context_tokens=1234.5, requests=4,
                    kv_read_bytes=99, pairs=(7,))
    assert m.time(load) == m.step_time(100, 3, 1234.5)
    assert ZERO_STEP.time(load) == 0.0


def test_no_simpy_import() -> None:
    import subprocess

    code = "import sys, sim.model.costs; assert 'simpy' not in sys.modules, 'sim.model.costs imported simpy'"
    subprocess.run([sys.executable, "-c", code], check=True)
