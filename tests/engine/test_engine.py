"""Engine tests: hand-built timelines, fast-forward equivalence, behaviour, invariants."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.engine import loop
from sim.engine.loop import ArrivalPath, Engine, EngineConfig, InvariantViolation, one_event_delay, simulate
from sim.engine.metrics import MemorySink, Recorder
from sim.io.workload import MultiTurnParams, Request, iter_multiturn
from sim.model.costs import HostOverhead, RooflineStepModel, StepCostModel, TransferModel
from sim.model.layout import GroupKind, GroupSpec, KVShape, Layout
from sim.model.scheduler import max_model_len
from tests.engine.worlds import (
    FA16,
    HALF_S_LINK,
    HYBRID,
    ONE_S,
    SPEC6,
    crash_world,
    req,
    run,
    timeline,
)

# -- timelines -----------------------------------------------------------------------


def test_timeline_store_then_cpu_hit() -> None:
    """Request a computes 32 tokens (2 chunks), its store is deferred to the next
    step; b repeats the prompt after a's blocks left the GPU (no prefix caching):
    its lookup hits 32 tokens, the load takes 0.5 s, the request is promoted at
    the step after the completion is reported and recomputes the last token."""
    cfg = EngineConfig(layout=FA16, gpu_blocks=100, prefix_caching=False, cpu_capacity_chunks=10,
                       step_cost=ONE_S, h2d=HALF_S_LINK, d2h=HALF_S_LINK)
    f, s = run(cfg, [req("a", 0, 32, 3, prefix=1), req("b", 10, 32, 2, prefix=1)])
    assert timeline(f) == [
        ("a", "arrival", 0.0), ("a", "scheduled", 0.0),
        ("a", "first_token", 1.0),           # prefill step 0..1
        ("a", "d2h_submit", 1.0),            # stored at the start of the next step
        ("a", "d2h_end", 1.5),
        ("a", "finish", 3.0),                # two decode steps
        ("b", "arrival", 10.0), ("b", "scheduled", 10.0), ("b", "h2d_submit", 10.0),
        ("b", "h2d_end", 10.5),
        ("b", "first_token", 11.5),          # 1-token prefill from 10.5
        ("b", "finish", 12.5),
    ]
    rb = f["requests"].set_index("req_id").loc["b"]
    assert (rb.cpu_hit_tokens, rb.computed_tokens, rb.loaded_bytes, rb.load_jobs) == (32, 1, 2000, 1)
    assert s["status"] == "ok"


def test_a_loads_admission_costs_the_schedulers_block_time_before_the_load() -> None:
    """vLLM's scheduler works per block: a prefill step's time grows with the blocks its
    prompt tokens begin; the step that admits b's CPU hit runs no forward pass but costs
    the scheduler's fixed no-forward time and its time per loaded block, and the load is
    submitted only after it (docs/costs.md, benchmarks/vllm_load_overhead.py)."""
    host = HostOverhead(0.01, 0.0, 0.0, per_block_s=0.001, per_loaded_block_s=0.0005, no_forward_step_s=0.2)
    fast = RooflineStepModel(1.0, 1.0, (1.0,), 1.0, 1e15, 1e15, host)     # forward passes of nanoseconds
    cfg = EngineConfig(layout=FA16, gpu_blocks=100, prefix_caching=False, cpu_capacity_chunks=10,
                       step_cost=fast, h2d=HALF_S_LINK, d2h=HALF_S_LINK)
    f, _ = run(cfg, [req("a", 0, 32, 3, prefix=1), req("b", 10, 32, 2, prefix=1)])
    t = {(r, what): when for r, what, when in timeline(f)}
    assert t["a", "first_token"] == pytest.approx(0.01 + 2 * 0.001, abs=1e-8)    # 2 blocks of 16 tokens
    assert t["b", "scheduled"] == 10.0
    assert t["b", "h2d_submit"] == pytest.approx(10.0 + 0.2 + 2 * (0.001 + 0.0005), abs=1e-9)
    assert t["b", "h2d_end"] - t["b", "h2d_submit"] == pytest.approx(0.5)
    # the last token's step begins no block: the step's host time alone
    assert t["b", "first_token"] - t["b", "h2d_end"] == pytest.approx(0.01, abs=1e-8)
    steps = f["steps"]
    admit = steps[(steps.start_s == 10.0)].iloc[0]
    assert (admit.n_steps, admit.loads) == (0, 1) and admit.duration_s == pytest.approx(0.203)


def test_timeline_full_gpu_hit_still_loads_the_last_chunk() -> None:
    """With GPU prefix caching the local hit stops one token short of the prompt,
    rounded down to a block (16 of 32); the connector (full attention only: no
    -1 rule) then finds the second chunk on CPU and loads it, and the last token
    is recomputed: vLLM's behaviour for a fully cached prompt."""
    cfg = EngineConfig(layout=FA16, gpu_blocks=100, cpu_capacity_chunks=10,
                       step_cost=ONE_S, h2d=HALF_S_LINK, d2h=HALF_S_LINK)
    f, _ = run(cfg, [req("a", 0, 32, 3, prefix=1), req("b", 10, 32, 2, prefix=1)])
    rb = f["requests"].set_index("req_id").loc["b"]
    assert (rb.gpu_hit_tokens, rb.cpu_hit_tokens, rb.computed_tokens) == (16, 16, 1)
    assert [x for x in timeline(f) if x[0] == "b"] == [
        ("b", "arrival", 10.0), ("b", "scheduled", 10.0), ("b", "h2d_submit", 10.0),
        ("b", "h2d_end", 10.5), ("b", "first_token", 11.5), ("b", "finish", 12.5)]


def test_timeline_same_time_arrival_is_seen_by_the_step() -> None:
    """An arrival at the instant a step starts joins that step (documented order)."""
    cfg = EngineConfig(layout=FA16, gpu_blocks=100, cpu_capacity_chunks=10, step_cost=ONE_S)
    f, _ = run(cfg, [req("a", 0, 16, 3, prefix=1), req("b", 1.0, 16, 1, prefix=2)])
    steps = f["steps"]
    row = steps[steps.start_s == 1.0].iloc[0]
    assert (row.prefill_tokens, row.decode_seqs) == (16, 1)
    assert f["requests"].set_index("req_id").loc["b"].first_token_s == 2.0


def test_timeline_preemption_recomputes() -> None:
    """Two requests share a 5-block pool; at 48 tokens the second cannot grow and
    is preempted (it is the last running one), then resumes after a finishes
    and recomputes its prompt and generated tokens."""
    cfg = EngineConfig(layout=FA16, gpu_blocks=6, prefix_caching=False, offloading=False,
                       step_cost=ONE_S)
    f, s = run(cfg, [req("a", 0, 32, 20, prefix=1), req("b", 0, 32, 20, prefix=2)])
    r = f["requests"].set_index("req_id")
    assert r.loc["a"].preemptions == 0 and r.loc["b"].preemptions >= 1
    # b computed its prompt, then recomputed prompt + generated tokens
    assert r.loc["b"].recomputed_tokens > 0
    assert r.loc["b"].computed_tokens == 32 + r.loc["b"].recomputed_tokens + (
        r.loc["b"].computed_tokens - 32 - r.loc["b"].recomputed_tokens)
    assert r.loc["b"].finish_s > r.loc["a"].finish_s
    assert (r.output_tokens == 20).all()
    assert s["engine"]["preemptions"] == r.preemptions.sum()


# -- fast-forward ------------------------------------------------------------------------


def _workload(seed: int, n: int, tph: int = 16) -> list[Request]:
    p = MultiTurnParams(sessions=12, session_rate_per_s=4.0, turns_mean=3.0, system_prompt_tokens=512,
                        first_user_tokens_mean=1200.0, followup_user_tokens_mean=200.0,
                        output_tokens_mean=80.0, max_context_tokens=6000, think_time_mean_s=3.0)
    return list(iter_multiturn(p, seed, tph, limit=n))


FF_CASES = {
    "hybrid-roomy": EngineConfig(layout=HYBRID, gpu_blocks=3000, cpu_capacity_chunks=400,
                                 step_cost=StepCostModel(0.004, 2e-5, 1e-4, 1e-8),
                                 h2d=TransferModel(2e9, 1e-4), d2h=TransferModel(2e9, 1e-4)),
    "hybrid-tight": EngineConfig(layout=HYBRID, gpu_blocks=700, cpu_capacity_chunks=120,
                                 max_num_seqs=6, max_num_batched_tokens=1024,
                                 step_cost=StepCostModel(0.004, 2e-5, 1e-4, 1e-8),
                                 h2d=TransferModel(5e8, 1e-4), d2h=TransferModel(5e8, 1e-4)),
    "spec6-old": EngineConfig(layout=SPEC6, gpu_blocks=4000, cpu_capacity_chunks=300, window_logic="old",
                              step_cost=StepCostModel(0.004, 2e-5, 1e-4, 1e-8),
                              h2d=TransferModel(1e8, 1e-4), d2h=TransferModel(1e8, 1e-4),
                              occupancy_interval_s=0.37),
    "fa-zero-time": EngineConfig(layout=FA16, gpu_blocks=2000, prefix_caching=False, cpu_capacity_chunks=100),
    # the roofline (pairs per group, KV bytes, host time per request), per-layer copies, duplex links
    # (and prompts hashed before the scheduler sees them: arrivals delayed, queued in bursts)
    "hybrid-roofline": EngineConfig(layout=HYBRID, gpu_blocks=1500, cpu_capacity_chunks=200,
                                    step_cost=RooflineStepModel(2e9, 5e8, (3e4, 3e4), 4e9, 1e14, 2e12,
                                                                HostOverhead(1e-3, 2e-5, 0.0, 2e-6, 1e-6,
                                                                             3e-4)),
                                    prompt_hash_s_per_block=3e-5,
                                    h2d=TransferModel(2e9, 1e-4, 3e-6, 0.47),
                                    d2h=TransferModel(2e9, 1e-4, 3e-6, 0.95)),
    "chunked-mamba-roofline": EngineConfig(
        layout=Layout.of([GroupSpec(GroupKind.FULL, 16, shape=KVShape(2, 2, 64)),
                          GroupSpec(GroupKind.CHUNKED_LOCAL, 16, attention_chunk=256,
                                    shape=KVShape(2, 2, 64)),
                          GroupSpec(GroupKind.MAMBA, 16, shape=KVShape(2, 4, 64))],
                         tokens_per_hash=16, blocks_per_chunk=2),
        gpu_blocks=2500, cpu_capacity_chunks=300,
        step_cost=RooflineStepModel(2e9, 5e8, (3e4, 3e4, 9e4), 4e9, 1e14, 2e12, HostOverhead(1e-3, 2e-5)),
        h2d=TransferModel(1e9, 1e-4, 3e-6, 0.5), d2h=TransferModel(1e9, 1e-4, 3e-6, 0.9)),
}


@given(start=st.floats(0.0, 1e5), durations=st.lists(st.floats(1e-9, 10.0), min_size=1, max_size=40))
def test_one_event_delay_lands_where_one_event_per_step_would(start: float, durations: list[float]) -> None:
    """The fast-forward's one event ends on the very float that k events, each adding its
    duration to the clock, reach; where no delay does, there is none."""
    end = start
    for d in durations:
        end += d
    delay = one_event_delay(start, durations)
    assert delay is None or start + delay == end
    if start == 0.0:
        assert delay == end


def test_one_event_delay_refuses_a_sum_it_cannot_reach() -> None:
    # 0.1 + 0.2 + 0.05 is 0.35000000000000003 step by step; 0.1 + (that - 0.1) is 0.35
    assert one_event_delay(0.1, [0.2, 0.05]) is None
    assert one_event_delay(1.0, [0.25, 0.5]) == 0.75


def test_fast_forward_in_one_event_is_one_event_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's two ways of running a fast-forward (one event for its k steps, or one
    per step where one delay cannot land on the same float) give the same run."""
    cfg = FF_CASES["spec6-old"]
    reqs = _workload(seed=7, n=60, tph=cfg.layout.tokens_per_hash)
    one, s_one = run(cfg, reqs)
    monkeypatch.setattr(loop, "one_event_delay", lambda start, durations: None)
    per_step, s_per_step = run(cfg, reqs)
    for table in ("requests", "transfers", "events", "occupancy", "steps"):
        pd.testing.assert_frame_equal(one[table], per_step[table], check_exact=True)
    assert s_one == s_per_step
    assert (one["steps"].n_steps > 1).any()


@pytest.mark.parametrize("case", sorted(FF_CASES))
def test_fast_forward_is_identical_to_stepping(case: str) -> None:
    cfg = FF_CASES[case]
    tph = cfg.layout.tokens_per_hash
    reqs = _workload(seed=len(case), n=60, tph=tph)
    fast, s_fast = run(cfg, reqs)
    slow, s_slow = run(replace(cfg, fast_forward=False), reqs)
    for table in ("requests", "transfers", "events", "occupancy"):
        pd.testing.assert_frame_equal(fast[table], slow[table], check_exact=True)
    s_fast["engine"].pop("step_rows")
    s_slow["engine"].pop("step_rows")
    assert s_fast == s_slow
    # it did collapse steps, and stepping is step-by-step
    assert (fast["steps"].n_steps > 1).any()
    assert (slow["steps"].n_steps <= 1).all()
    assert fast["steps"].n_steps.sum() == slow["steps"].n_steps.sum()


# -- behaviour ----------------------------------------------------------------------------


def test_a_request_reaches_the_scheduler_once_its_prompt_is_hashed() -> None:
    """vLLM's engine core hashes a new request's prompt (one hash block at a time, one
    request after another) before the scheduler sees it; the TTFT counts from the arrival."""
    fast = RooflineStepModel(1.0, 1.0, (1.0,), 1.0, 1e15, 1e15)   # steps of nanoseconds
    cfg = EngineConfig(layout=FA16, gpu_blocks=400, cpu_capacity_chunks=50, step_cost=fast,
                       prompt_hash_s_per_block=1e-3)                 # 1 ms per 16-token hash block
    reqs = [req("a", 0.0, 256, 2, prefix=1), req("b", 0.0, 520, 2, prefix=2), req("c", 1.0, 160, 2, prefix=3)]
    f, _ = run(cfg, reqs)
    rq = f["requests"].set_index("req_id")
    assert rq.loc["a"].scheduled_s == pytest.approx(0.016, abs=1e-9)    # 16 blocks
    assert rq.loc["b"].scheduled_s == pytest.approx(0.048, abs=1e-9)    # after a's, then its 32 full blocks
    assert rq.loc["c"].scheduled_s == pytest.approx(1.010, abs=1e-9)    # the thread was free again
    assert rq.loc["b"].arrival_s == 0.0 and rq.loc["b"].ttft_s > 0.048
    # without it, no delay
    f, _ = run(replace(cfg, prompt_hash_s_per_block=0.0), reqs)
    assert f["requests"].set_index("req_id").loc["b"].scheduled_s == 0.0


def test_a_text_prompt_is_tokenized_then_hashed_one_request_after_another() -> None:
    """With text prompts (costs.tokenize) vLLM's OpenAI server tokenizes each prompt in its one
    tokenizer worker, then the engine core hashes it: two serial stages, each taking the
    requests in arrival order, so a burst queues at both; the TTFT counts from the arrival."""
    fast = RooflineStepModel(1.0, 1.0, (1.0,), 1.0, 1e15, 1e15)   # steps of nanoseconds
    cfg = EngineConfig(layout=FA16, gpu_blocks=400, cpu_capacity_chunks=50, step_cost=fast,
                       prompt_tokenize_s_per_token=1e-4,          # 0.1 ms per prompt token
                       prompt_hash_s_per_block=1e-3)              # 1 ms per 16-token hash block
    reqs = [req("a", 0.0, 256, 2, prefix=1), req("b", 0.0, 520, 2, prefix=2), req("c", 1.0, 160, 2, prefix=3)]
    f, _ = run(cfg, reqs)
    rq = f["requests"].set_index("req_id")
    # a: tokenized by 25.6 ms, hashed by 41.6 ms; b: tokenized after a, by 25.6 + 52 = 77.6 ms (its
    # hashing waits for that, not for a's), hashed by 77.6 + 32 = 109.6 ms; c: both stages free again
    assert rq.loc["a"].scheduled_s == pytest.approx(0.0416, abs=1e-9)
    assert rq.loc["b"].scheduled_s == pytest.approx(0.1096, abs=1e-9)
    assert rq.loc["c"].scheduled_s == pytest.approx(1.026, abs=1e-9)
    assert (rq.ttft_s > rq.scheduled_s - rq.arrival_s).all()
    # the requests table says when the scheduler saw each one (here it admits them at once)
    assert list(rq.loc[["a", "b", "c"]].seen_s) == pytest.approx([0.0416, 0.1096, 1.026], abs=1e-9)
    assert (rq.seen_s <= rq.scheduled_s).all() and (rq.seen_s >= rq.arrival_s).all()
    # a path that only tokenizes: the stages are independent
    f, _ = run(replace(cfg, prompt_hash_s_per_block=0.0), reqs)
    rq = f["requests"].set_index("req_id")
    assert list(rq.loc[["a", "b", "c"]].scheduled_s) == pytest.approx([0.0256, 0.0776, 1.016], abs=1e-9)


def test_a_burst_of_text_prompts_queues_at_the_tokenizer() -> None:
    # ArrivalPath alone (the engine and kvsim calibrate --from-run both run it): ten 1,000-token
    # prompts arriving together leave the tokenizer 1 ms apart; without delays, at their arrival
    path = ArrivalPath(1e-6, 0.0)
    seen = [path.seen_at(req(f"r{i}", 0.5, 1000, 2, prefix=i)) for i in range(10)]
    assert seen == pytest.approx([0.5 + 1e-3 * (i + 1) for i in range(10)], abs=1e-12)
    assert ArrivalPath(0.0, 0.0).seen_at(req("x", 2.0, 1000, 2, prefix=1)) == 2.0


def _repeat_after_eviction(offloading: bool) -> pd.DataFrame:
    """a's prompt, then enough other traffic to push a's blocks out of a small
    GPU pool, then a's prompt again."""
    reqs = [req("a", 0, 256, 2, prefix=1)]
    reqs += [req(f"x{i}", 1 + i, 256, 2, prefix=10 + i) for i in range(6)]
    reqs.append(req("a2", 20, 256, 2, prefix=1))
    cfg = EngineConfig(layout=FA16, gpu_blocks=40, cpu_capacity_chunks=200, offloading=offloading,
                       step_cost=StepCostModel(0.01, 1e-5), h2d=TransferModel(1e9), d2h=TransferModel(1e9))
    f, _ = run(cfg, reqs)
    return f["requests"].set_index("req_id")


def test_repeat_after_gpu_eviction_hits_cpu_only_with_offloading() -> None:
    on = _repeat_after_eviction(True)
    off = _repeat_after_eviction(False)
    assert on.loc["a2"].gpu_hit_tokens == 0 and off.loc["a2"].gpu_hit_tokens == 0
    assert on.loc["a2"].cpu_hit_tokens == 256
    assert off.loc["a2"].cpu_hit_tokens == 0
    assert on.loc["a2"].computed_tokens < off.loc["a2"].computed_tokens


def test_the_cpu_cache_event_log_is_drained_every_step() -> None:
    """The CPU cache's events are taken after every step (memory stays bounded
    on long traces): at most one step's worth is ever held."""
    eng = Engine(FF_CASES["hybrid-tight"], _workload(seed=3, n=30), Recorder(MemorySink()))
    cpu = eng.cpu
    assert cpu is not None
    taken: list[int] = []
    real_take = cpu.take_events

    def take() -> list[object]:
        events = real_take()
        taken.append(len(events))
        return events  # type: ignore[return-value]

    cpu.take_events = take  # type: ignore[method-assign]
    res = eng.run()
    assert res.status == "ok" and sum(taken) > 0
    assert len(taken) >= res.summary.step_rows
    assert real_take() == []


def test_larger_lru_cache_never_lowers_the_hit_rate() -> None:
    reqs = _workload(seed=7, n=120)
    rates = []
    for cap in (0, 16, 64, 256, 1024, 4096):
        cfg = EngineConfig(layout=HYBRID, gpu_blocks=600, cpu_capacity_chunks=cap, prefix_caching=False)
        _, s = run(cfg, reqs)
        rates.append(s["cpu_hit_rate"])
    assert rates == sorted(rates)
    assert rates[0] == 0 and rates[-1] > 0.2


def test_ttft_rises_as_h2d_bandwidth_falls() -> None:
    reqs = _workload(seed=3, n=80)
    p50 = []
    for bw in (64e9, 8e9, 1e9, 1.25e8):
        cfg = EngineConfig(layout=HYBRID, gpu_blocks=600, cpu_capacity_chunks=4096, prefix_caching=False,
                           step_cost=StepCostModel(0.005, 2e-5, 1e-4), h2d=TransferModel(bw, 1e-5),
                           d2h=TransferModel(64e9, 1e-5))
        _, s = run(cfg, reqs)
        p50.append(s["ttft_s"]["p90"])
    assert p50 == sorted(p50) and p50[-1] > p50[0]


def test_old_crash_is_recorded_and_the_request_recomputes() -> None:
    f, res = crash_world("record", "old")
    assert res.status == "ok"
    ev = f["events"]
    assert list(zip(ev.kind, ev.detail, ev.req_id, ev.group, ev.chunk, strict=True)) == [
        ("crash", "missing_chunk", "b", 1, 14)]
    r = f["requests"].set_index("req_id")
    assert r.loc["b"].crash == "missing_chunk" and r.loc["b"].status == "finished"
    assert r.loc["b"].cpu_hit_tokens == 0 and r.loc["b"].computed_tokens == 4353
    assert r.loc["c"].status == "finished" and pd.isna(r.loc["c"].crash)
    s = res.summary.figures()
    assert s["crashes"] == {"count": 1, "kinds": {"missing_chunk": 1}, "first_s": 1.0}


def test_old_crash_can_stop_the_run_cleanly() -> None:
    f, res = crash_world("stop", "old")
    assert res.status == "stopped_on_crash"
    assert list(f["events"].kind) == ["crash"]
    r = f["requests"].set_index("req_id")
    assert r.loc["b"].status == "unfinished" and r.loc["b"].crash == "missing_chunk"
    assert res.summary.sim_time_s == 1.0


def test_new_logic_does_not_crash_in_the_same_world() -> None:
    f, res = crash_world("record", "new")
    assert res.status == "ok" and res.summary.crashes == 0 and f["events"].empty
    r = f["requests"].set_index("req_id")
    assert r.loc["b"].cpu_hit_tokens == 0 and (r.status == "finished").all()


# -- invariants -----------------------------------------------------------------------


@pytest.mark.parametrize("accounting", ["reference", "fast"])
def test_leak_fails_the_run_loudly(monkeypatch: pytest.MonkeyPatch, accounting: str) -> None:
    from sim.model.scheduler import GPU_CACHES

    cls = GPU_CACHES[accounting]
    real_free = cls.free

    def leaky_free(self: object, req_id: str) -> None:
        if req_id == "b":
            return   # forget to free b's blocks
        real_free(self, req_id)  # type: ignore[arg-type]

    monkeypatch.setattr(cls, "free", leaky_free)
    cfg = EngineConfig(layout=FA16, gpu_blocks=100, cpu_capacity_chunks=10,
                       block_accounting=accounting)  # type: ignore[arg-type]
    with pytest.raises(InvariantViolation, match="GPU blocks still referenced"):
        run(cfg, [req("a", 0, 32, 3, prefix=1), req("b", 1, 32, 3, prefix=2)])


def test_requests_must_arrive_in_order() -> None:
    cfg = EngineConfig(layout=FA16, gpu_blocks=100)
    with pytest.raises(ValueError, match="sorted"):
        run(cfg, [req("a", 5, 32, 3, prefix=1), req("b", 1, 32, 3, prefix=2)])


def test_too_long_request_is_rejected_not_stuck() -> None:
    cfg = EngineConfig(layout=FA16, gpu_blocks=10, cpu_capacity_chunks=10)
    f, s = run(cfg, [req("big", 0, 400, 3, prefix=1), req("ok", 1, 32, 3, prefix=2)])
    r = f["requests"].set_index("req_id")
    assert r.loc["big"].status == "rejected" and r.loc["ok"].status == "finished"
    assert s["requests"]["rejected"] == 1
    ev = f["events"]
    assert list(ev.kind) == ["rejected"] and ev.iloc[0].req_id == "big"


@pytest.mark.parametrize(("trace", "chunks"), [("tiny_pool_hang.csv", 11), ("tiny_pool_deadlock.csv", 15)])
def test_tiny_gpu_pool_never_hangs(trace: str, chunks: int, tmp_path: Path) -> None:
    """Found by `kvsim compare` tests: a 300-block pool on the spec §6 layout
    with 2048-token prefill chunks. A request that cannot take its next chunk
    even alone used to preempt itself forever (zero step time: a hang); loaded
    requests holding blocks with nothing running used to deadlock. Now the
    first is rejected and the second broken by preempting the holders.

    Since requests longer than ``max_model_len`` are rejected on arrival, as vLLM does
    (on this pool about 2k tokens: vLLM would not start with a longer one), the traces'
    4k-token requests no longer reach those paths (tests/model/test_scheduler.py tests
    them); the run still ends, each of them rejected when it arrives."""
    from sim.io.scenario import load_run

    data = Path(__file__).parents[1] / "data" / trace
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(f'''schema = "run/1"
name = "tiny"
[model]
name = "spec6"
[hardware]
gpu_blocks = 300
[cpu_cache]
chunks = {chunks}
policy = "arc"
[scheduler]
tokens_per_hash = 8
blocks_per_chunk = 4
max_num_batched_tokens = 2048
prefix_caching = false
# chunk-by-chunk admission: the paths these traces found (self-preemption, holders
# deadlocked) only arise without vLLM's full-input reservation
reserve_full_isl = false
[costs]
step = "zero"
[workload]
kind = "trace"
path = "{data}"
''')
    spec = load_run(scenario)
    res = simulate(spec.engine_config(), spec.requests(), Recorder(MemorySink()))
    assert res.status == "ok"
    s = res.summary
    assert s.requests_arrived == 5 and s.requests_finished + s.requests_rejected == 5
    cfg = spec.engine_config()
    limit = max_model_len(cfg.layout, cfg.gpu_blocks, cfg.max_num_batched_tokens,
                          prefix_caching=cfg.prefix_caching)
    assert 2000 < limit < 4000
    long = sum(r.prompt_tokens + r.output_tokens > limit for r in spec.requests())
    assert s.requests_rejected == long == 4 and s.requests_finished == 1


@pytest.mark.parametrize(("piece", "per_block"), [("layer", 2), ("block", 1)])
def test_transfer_time_counts_vllm_copy_pieces(piece: str, per_block: int) -> None:
    """Every job costs latency + pieces x overhead + bytes / bandwidth; HYBRID's groups have 2
    layers each, so a block is 2 copies per layer-page, or 1 packed."""
    reqs = [req("a", 0, 256, 2, prefix=1), req("b", 5, 256, 2, prefix=1)]
    link = TransferModel(1e9, 1e-4, 1e-3)
    cfg = EngineConfig(layout=HYBRID, gpu_blocks=3000, cpu_capacity_chunks=100, prefix_caching=False,
                       step_cost=StepCostModel(0.01, 1e-5), h2d=link, d2h=link,
                       transfer_piece=piece)  # type: ignore[arg-type]
    f, _ = run(cfg, reqs)
    x = f["transfers"]
    assert set(x.direction) == {"h2d", "d2h"}
    for row in x.itertuples():
        want = 1e-4 + row.blocks * per_block * 1e-3 + row.bytes / 1e9
        assert row.end_s - row.start_s == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("limit_s", [0.3, 1.0])
def test_link_utilisation_of_a_run_stopped_early_counts_only_time_before_its_end(limit_s: float) -> None:
    """A run stopped by its time limit while a slow load is in flight: the job that
    completes after the end counts as it does in the transfers table (not at all), so
    the link is busy at most the whole run (before: 100.5 % and 185.8 % in such runs)."""
    from sim.io.scenario import build_run
    from sim.tools import fuzz

    data = fuzz.run_config(fuzz._rng_for(5, 523))   # a 200 KB/s host-to-device link
    data = {**data, "window_logic": "new", "output": {**data["output"], "max_sim_time_s": limit_s}}
    spec = build_run(data, Path("fuzz-s5-i523.toml"))
    engine = Engine(spec.engine_config(), spec.requests(), Recorder(MemorySink()))
    res = engine.run()
    assert res.status == "time_limit"
    transfers = res.summary.figures()["transfers"]
    assert 0.0 < transfers["h2d_utilisation"] <= 1.0
    assert engine.h2d.busy_s > engine.busy_at_end[0]   # a load was in flight at the end
    assert res.summary.h2d_busy_s == engine.busy_at_end[0]
    assert res.summary.h2d_busy_s <= res.summary.sim_time_s
