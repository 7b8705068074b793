"""The steady-state verdict (offered vs served load, queue trend, drain), the
per-request TTFT/TPOT and deferral columns, and TTFT with rejected requests."""

from __future__ import annotations

from typing import get_args

import pytest

from sim.engine.loop import EngineConfig
from sim.engine.metrics import (
    DRAIN_MIN_PEAK,
    GROWTH_MIN_REQUESTS,
    TABLES,
    RunSummary,
    _quantile_with_missing,
    load_verdict,
    percentile,
)
from sim.io.results import summary_table, summary_warnings
from sim.model.connector import DeferReason
from sim.model.costs import StepCostModel
from tests.engine.worlds import FA16, req, run

# one step costs 10 ms + 1 ms per 16 prefill tokens: a 320-token prompt takes
# about 30 ms of prefill, its 4 decode steps 40 ms more
COST = StepCostModel(overhead_s=0.01, prefill_token_s=1e-3 / 16)


def _cfg(**kw: object) -> EngineConfig:
    return EngineConfig(layout=FA16, gpu_blocks=4000, cpu_capacity_chunks=0, step_cost=COST,
                        max_num_seqs=2, occupancy_interval_s=0.5, **kw)  # type: ignore[arg-type]


def _stream(n: int, gap_s: float) -> list:
    return [req(f"r{i}", i * gap_s, 320, 5, prefix=i) for i in range(n)]


def test_a_stable_and_an_overloaded_run_of_the_same_workload_are_told_apart() -> None:
    # capacity: two sequences at a time, ~70 ms each: ~25 req/s; offered 5 vs 100 req/s
    _, stable = run(_cfg(), _stream(200, 0.2))
    _, over = run(_cfg(), _stream(200, 0.01))
    assert stable["overloaded"] is False
    assert stable["load"]["queue_trend"] == "stable"
    assert stable["load"]["peak_waiting"] < GROWTH_MIN_REQUESTS
    assert over["overloaded"] is True
    assert over["load"]["queue_trend"] == "growing"
    assert "grew by about" in over["load"]["reason"]
    assert over["load"]["offered_requests_per_s"] == pytest.approx(100, rel=0.01)
    assert over["load"]["served_requests_per_s"] < 0.5 * over["load"]["offered_requests_per_s"]
    assert over["load"]["drain_s"] > over["load"]["arrival_span_s"]
    # the summary table and the warnings say it; a stable run gets no warning
    assert "OVERLOADED" in summary_table({**over, "status": "ok"})
    assert any(w.startswith("overloaded:") for w in summary_warnings({**over, "status": "ok"}))
    assert "stable" in summary_table({**stable, "status": "ok"})
    assert summary_warnings({**stable, "status": "ok"}) == []


def _summary(arrivals: tuple[float, float], end: float, samples: list[tuple[float, int]],
             peak: int, arrived: int = 100) -> RunSummary:
    s = RunSummary(requests_arrived=arrived, requests_finished=arrived, sim_time_s=end,
                   first_arrival_s=arrivals[0], last_arrival_s=arrivals[1], peak_waiting=peak)
    for t, n in samples:
        s.queue_t.append(t)
        s.queue_n.append(n)
    return s


def test_the_criterion_growth_drain_and_bursts() -> None:
    # a queue that grows linearly by 50 over the window: overloaded by its trend
    grow = _summary((0, 100), 110, [(t, t // 2) for t in range(0, 101, 5)], peak=50)
    v = load_verdict(grow)
    assert v["overloaded"] and v["queue_trend"] == "growing"
    assert v["queue_growth_requests"] == pytest.approx(50, abs=2)
    # a burst early that drains before the last arrival: stable, whatever the peak
    burst = _summary((0, 100), 103, [(t, 80 if t < 20 else 0) for t in range(0, 101, 5)], peak=80)
    assert not load_verdict(burst)["overloaded"]
    assert load_verdict(burst)["queue_trend"] == "stable"
    # a flat queue that takes long to drain after the last arrival (a backlog held
    # at a steady level): overloaded by the drain
    held = _summary((0, 100), 200, [(t, 30) for t in range(0, 101, 5)], peak=30)
    v = load_verdict(held)
    assert v["overloaded"] and "draining the queue" in v["reason"]
    # a long drain with a short queue (one long request at the end): stable
    tail = _summary((0, 100), 200, [(t, 1) for t in range(0, 101, 5)], peak=DRAIN_MIN_PEAK - 1)
    assert not load_verdict(tail)["overloaded"]
    # everything at once: no window, no trend
    batch = _summary((0, 0), 10, [(0, 100)], peak=100)
    assert load_verdict(batch)["queue_trend"] == "n/a"
    assert load_verdict(batch)["offered_requests_per_s"] is None


def test_ttft_and_tpot_columns_match_the_timestamps_and_the_summary() -> None:
    frames, fig = run(_cfg(), _stream(30, 0.2))
    r = frames["requests"]
    assert (r["ttft_s"] == r["first_token_s"] - r["arrival_s"]).all()
    tpot = (r["finish_s"] - r["first_token_s"]) / (r["output_tokens"] - 1)
    assert (r["tpot_s"] - tpot).abs().max() < 1e-12
    assert fig["ttft_s"]["p50"] == percentile(sorted(r["ttft_s"]), 50)


def test_deferral_columns_cover_every_reason() -> None:
    cols = {c for c, _ in TABLES["requests"]}
    assert {f"deferrals_{why}" for why in get_args(DeferReason)} <= cols
    assert "deferred_s" in cols


def test_ttft_with_rejected_counts_them_as_never_served() -> None:
    served = [1.0, 2.0, 3.0]
    assert _quantile_with_missing(served, 0, 50) == percentile(served, 50)
    # 3 served + 1 rejected: p50 at position 1.5 -> between 2.0 and 3.0
    assert _quantile_with_missing(served, 1, 50) == pytest.approx(2.5)
    # p90 at position 2.7 -> between 3.0 and the rejected one: never
    assert _quantile_with_missing(served, 1, 90) is None
    assert _quantile_with_missing([], 2, 50) is None


def test_a_run_with_rejected_requests_warns_and_shows_both_percentiles() -> None:
    cfg = EngineConfig(layout=FA16, gpu_blocks=40, cpu_capacity_chunks=0, step_cost=COST)
    reqs = [req("short", 0.0, 320, 5, prefix=1), req("huge", 0.1, 4000, 5, prefix=2),
            req("short2", 0.2, 320, 5, prefix=3)]
    _, fig = run(cfg, reqs)
    assert fig["requests"]["rejected"] == 1
    assert fig["requests"]["rejected_share"] == pytest.approx(1 / 3)
    table = summary_table({**fig, "status": "ok"})
    assert "TTFT p50 / p90 / p99 (served)" in table
    assert "(rejected = never)" in table
    warnings = summary_warnings({**fig, "status": "ok"})
    assert any("1 of 3 requests" in w and "rejected" in w for w in warnings)


def test_a_run_stops_when_its_queue_reaches_stop_at_waiting() -> None:
    # offered 100 req/s against ~25: the queue passes 30 within the first second
    frames, over = run(_cfg(stop_at_waiting=30), _stream(200, 0.01))
    assert over["status"] == "queue_limit"
    assert over["overloaded"] is True
    load = over["load"]
    # stopped at the first step boundary with 30 or more waiting (a step may admit several arrivals)
    waiting = frames["steps"]["waiting"].tolist()
    assert waiting[-1] >= 30 and max(waiting[:-1]) < 30
    assert load["peak_waiting"] == waiting[-1]
    assert f"reached {waiting[-1]} requests" in load["reason"] and "stop_at_waiting" in load["reason"]
    assert load["drain_s"] is None              # nothing drained after the stop
    arrived = over["requests"]["arrived"]
    assert 30 < arrived < 200                   # the rest of the trace never arrived
    # the arrival window is what did arrive: its last arrival is the last request counted
    assert load["arrival_span_s"] == pytest.approx((arrived - 1) * 0.01)
    assert load["offered_requests_per_s"] == pytest.approx(100, rel=0.05)
    # every arrived request has its row; the unfinished ones say so
    rows = frames["requests"]
    assert len(rows) == arrived
    assert (rows["status"] == "unfinished").sum() == arrived - over["requests"]["finished"] > 0
    assert any("stop_at_waiting" in w for w in summary_warnings({**over, "status": "ok"}))


def test_a_queue_limit_never_reached_changes_nothing() -> None:
    # a limit just above the stable run's queue peak is never reached: every row stays as it was
    plain_frames, plain = run(_cfg(), _stream(200, 0.2))
    limit = plain["load"]["peak_waiting"] + 1
    capped_frames, capped = run(_cfg(stop_at_waiting=limit), _stream(200, 0.2))
    assert capped == plain and capped["status"] == "ok"
    for name in TABLES:
        assert capped_frames[name].equals(plain_frames[name]), name


def test_stop_at_waiting_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stop_at_waiting"):
        _cfg(stop_at_waiting=0)
