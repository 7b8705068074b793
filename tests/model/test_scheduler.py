"""The clock-free scheduler, driven step by step without SimPy (in the style of
vLLM's tests/v1/core/test_scheduler.py): admission, chunked prefill,
preemption, async loads, lookup deferral, rejection, the decode fast-forward."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.io.workload import chain_hash
from sim.model.connector import LoadPlan, StorePlan
from sim.model.costs import StepCostModel
from sim.model.layout import GroupKind, GroupSpec, Layout
from sim.model.request import LiveRequest, Request, RequestStatus
from sim.model.scheduler import (
    MAX_POSITIONS,
    AttendedContext,
    ModelEvent,
    Scheduler,
    SchedulerConfig,
    SchedulerHooks,
    StepOutput,
    StepPlan,
    admission_caps,
    lookup_assertion,
    max_model_len,
)
from sim.model.windows import profile

#: one full-attention group, 16-token blocks, one block per chunk, 1000 bytes a block
FA16 = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=1000)], tokens_per_hash=16,
                 blocks_per_chunk=1)


def make_request(rid: str, prompt: int, out: int, prefix: int) -> Request:
    """Prompt hashes depend only on ``prefix``; output hashes are the request's own."""
    hashes: list[int] = []
    h = 0
    for j in range((prompt + out) // 16):
        h = chain_hash(h, prefix * 1_000_003 + j if j < prompt // 16 else sum(map(ord, rid)) * 7919 + j)
        hashes.append(h)
    return Request(rid, 0.0, prompt, out, hashes)


class World:
    """A scheduler and what its hooks saw."""

    def __init__(self, **cfg: object) -> None:
        self.events: list[ModelEvent] = []
        self.released: list[str] = []
        hooks = SchedulerHooks(event=self.events.append, release=lambda r: self.released.append(r.req_id))
        self.sched = Scheduler(SchedulerConfig(layout=FA16, **cfg), hooks)  # type: ignore[arg-type]
        self.t = 0.0

    def add(self, rid: str, prompt: int, out: int, prefix: int) -> LiveRequest:
        return self.sched.add_request(make_request(rid, prompt, out, prefix))

    def step(self, completed: list[LoadPlan | StorePlan] | None = None) -> tuple[StepPlan, StepOutput]:
        """One step: schedule at t, the forward pass takes 1 s, output at t + 1."""
        plan = self.sched.schedule(self.t)
        self.t += 1.0
        return plan, self.sched.update_from_output(self.t, plan, completed or [])

    def blocks(self, rid: str) -> int:
        return len(self.sched.gpu.req_blocks[rid][0]) if rid in self.sched.gpu.req_blocks else 0


def batch(plan: StepPlan) -> list[tuple[str, int]]:
    return [(r.req_id, num_new) for r, num_new, _ in plan.scheduled]


def test_chunked_prefill_takes_the_budget_per_step_then_decodes() -> None:
    """150 prompt tokens with a 64-token budget: 64 + 64 + 22 (the last chunk
    samples the first token), one decode step samples the second and the
    request finishes: blocks freed, released at once (no connector)."""
    w = World(gpu_blocks=101, max_num_batched_tokens=64, offloading=False)
    a = w.add("a", 150, 2, prefix=1)
    plan, _ = w.step()
    assert batch(plan) == [("a", 64)] and plan.admitted == (a,)
    assert plan.prefill_tokens == 64 and plan.decode_seqs == 0 and plan.context_tokens == 64.0
    assert plan.scheduled[0][2] is None      # a new request: the connector syncs all its blocks
    assert a.status is RequestStatus.RUNNING and a.num_computed == 64 and w.blocks("a") == 4
    assert a.scheduled_s == 0.0
    plan, _ = w.step()
    assert batch(plan) == [("a", 64)] and plan.scheduled[0][2] == ((5, 6, 7, 8),)
    assert a.num_computed == 128 and a.generated == 0 and w.blocks("a") == 8
    plan, _ = w.step()
    assert batch(plan) == [("a", 22)] and plan.prefill_tokens == 22
    assert a.num_computed == 150 and a.num_tokens == 151 and a.generated == 1 and a.first_token_s == 3.0
    assert w.blocks("a") == 10
    plan, out = w.step()
    assert batch(plan) == [("a", 1)] and plan.prefill_tokens == 0 and plan.decode_seqs == 1
    assert out.finished == (a,) and a.status is RequestStatus.FINISHED and a.finish_s == 4.0
    assert w.released == ["a"] and not w.sched.requests and w.sched.gpu.pool.num_used == 0
    assert a.computed_tokens == 150 and w.sched.stats.computed_tokens == 150
    plan, _ = w.step()
    assert not plan.busy


def test_preemption_sends_the_last_running_request_back_to_the_front_to_recompute() -> None:
    """10 usable blocks, two 64-token prompts (4 blocks each, a 5th for the
    first decode token). At 80 tokens ``a`` needs a 6th block: ``b``, the last
    running request, is preempted (its 5 blocks freed, back to the front of
    the waiting queue) and waits until ``a`` finishes; then it recomputes all
    81 tokens, 80 of them again."""
    w = World(gpu_blocks=11, prefix_caching=False, offloading=False)
    a = w.add("a", 64, 40, prefix=1)
    b = w.add("b", 64, 40, prefix=2)
    plan, _ = w.step()
    assert batch(plan) == [("a", 64), ("b", 64)] and w.sched.gpu.pool.num_used == 8
    plan, _ = w.step()
    assert batch(plan) == [("a", 1), ("b", 1)] and w.sched.gpu.pool.num_used == 10
    for _ in range(15):
        plan, _ = w.step()
        assert not plan.preempted
    assert a.num_computed == 80 and b.num_computed == 80 and b.generated == 17
    plan, _ = w.step()                      # step 18: a needs its 6th block
    assert plan.preempted == (b,) and batch(plan) == [("a", 1)] and not plan.admitted
    assert b.status is RequestStatus.WAITING and b.num_computed == 0 and b.num_tokens == 81
    assert b.preemptions == 1 and w.sched.stats.preemptions == 1
    assert list(w.sched.waiting) == [b] and w.sched.running == [a]
    assert w.blocks("b") == 0 and w.blocks("a") == 6 and w.sched.gpu.pool.num_used == 6
    plan, _ = w.step()                      # 81 tokens need 6 blocks, 4 are free: FCFS stops
    assert batch(plan) == [("a", 1)] and not plan.admitted and b.status is RequestStatus.WAITING
    while a.status is not RequestStatus.FINISHED:
        plan, _ = w.step()
    assert a.generated == 40 and w.sched.gpu.pool.num_used == 0
    plan, _ = w.step()
    assert batch(plan) == [("b", 81)] and plan.admitted == (b,) and plan.prefill_tokens == 81
    assert b.recomputed_tokens == 80 and b.computed_tokens == 64 + 81 and b.generated == 18


def _with_cpu_chunks(pending: bool = False) -> tuple[World, Request]:
    """A CPU cache holding the 4 complete chunks of a 72-token prompt (stored,
    or still pending their store)."""
    w = World(gpu_blocks=101, cpu_capacity_chunks=10)
    r = make_request("b", 72, 4, prefix=3)
    cpu = w.sched.cpu
    assert cpu is not None
    plan = cpu.prepare_store(FA16.offload_keys(0, r.block_hashes[: 72 // 16]))
    assert plan is not None
    if not pending:
        cpu.complete_store(plan.keys)
    return w, r


def test_async_load_waits_for_kv_until_its_completion_is_applied() -> None:
    """The CPU cache holds 64 of 72 prompt tokens: the request is admitted
    with a 4-chunk load and waits for remote KV (nothing scheduled, skipped
    every step) until the load's completion is applied; then it is promoted
    and prefills the last 8 tokens."""
    w, r = _with_cpu_chunks()
    b = w.sched.add_request(r)
    plan, _ = w.step()
    assert plan.admitted == (b,) and not plan.scheduled
    assert [(j.direction, j.chunks, j.blocks, j.nbytes) for j in plan.loads] == [("h2d", 4, 4, 4000)]
    assert b.status is RequestStatus.WAITING_FOR_KV and b.num_computed == 64 and b.cpu_hit_tokens == 64
    assert w.blocks("b") == 4 and list(w.sched.skipped) == [b] and b.scheduled_s == 0.0
    assert b.loaded_bytes == 4000 and b.load_jobs == 1 and w.sched.in_flight == {plan.loads[0].job_id}
    load = plan.loads[0].plan
    plan, _ = w.step()                      # the load is in flight: nothing to do
    assert not plan.busy and b.status is RequestStatus.WAITING_FOR_KV
    plan, out = w.step([load])              # the load completes during this step
    assert out.polled == 1 and b.load_ready and not w.sched.in_flight
    assert not plan.scheduled and b.status is RequestStatus.WAITING_FOR_KV
    plan, _ = w.step()
    assert batch(plan) == [("b", 8)] and plan.scheduled[0][2] == ((5,),)
    assert b.status is RequestStatus.RUNNING and b.num_computed == 72 and b.generated == 1
    assert b.first_token_s == 4.0 and b.computed_tokens == 8 and b.gpu_hit_tokens == 0


def test_an_async_load_is_admitted_only_beside_what_in_flight_prefills_still_need() -> None:
    """vLLM's admission reservation for asynchronous loads (0.29-0.33,
    ``_inflight_prefill_reserved_blocks``). The CPU cache holds 64 tokens of two prompts;
    "a" (88 tokens) is admitted with its load and 4 blocks, and still needs 2 to finish
    its prompt. "b" (72 tokens) needs 4 blocks for its load and 5 for its whole input:
    both fit in the 5 free blocks, but not its load beside a's 2 held back, so it waits
    (without the reservation it would be admitted in the first step). Once a's prefill is
    done a holds nothing back; b is admitted when a's blocks come back."""
    w = World(gpu_blocks=10, cpu_capacity_chunks=10)
    cpu = w.sched.cpu
    assert cpu is not None
    ra, rb = make_request("a", 88, 2, prefix=3), make_request("b", 72, 2, prefix=5)
    for r in (ra, rb):
        stored = cpu.prepare_store(FA16.offload_keys(0, r.block_hashes[:4]))
        assert stored is not None
        cpu.complete_store(stored.keys)
    a, b = w.sched.add_request(ra), w.sched.add_request(rb)
    plan, _ = w.step()
    assert plan.admitted == (a,) and [j.chunks for j in plan.loads] == [4]
    assert b.status is RequestStatus.WAITING and w.blocks("b") == 0
    assert w.sched.gpu.pool.num_free == 5
    load = plan.loads[0].plan
    plan, _ = w.step([load])          # a's load completes during this step; b still waits
    assert not plan.admitted and b.status is RequestStatus.WAITING
    plan, _ = w.step()                # a is promoted and prefills its last 24 tokens
    assert batch(plan) == [("a", 24)] and not plan.loads
    assert "a" not in w.sched._inflight   # its input is complete: nothing held back for it
    while a.status is not RequestStatus.FINISHED:
        plan, _ = w.step()
        assert not plan.admitted          # a's 6 blocks leave 3: b's whole input does not fit
    plan, _ = w.step()
    assert plan.admitted == (b,) and [j.chunks for j in plan.loads] == [4]
    assert b.status is RequestStatus.WAITING_FOR_KV and "b" in w.sched._inflight


def test_lookup_deferral_is_counted_and_retried_next_step() -> None:
    """The chunks are still pending their store: the lookup asks to be asked
    again (counted per reason), the request stays at the head of the skipped
    queue; once the store completes it is admitted with its load."""
    w, r = _with_cpu_chunks(pending=True)
    b = w.sched.add_request(r)
    plan, _ = w.step()
    assert not plan.busy and not plan.admitted and b.status is RequestStatus.WAITING
    assert b.deferrals == 1 and w.sched.stats.deferral_reasons == {"pending_or_retry": 1}
    assert list(w.sched.skipped) == [b] and not w.sched.waiting and w.blocks("b") == 0
    w.step()
    assert b.deferrals == 2 and w.sched.stats.deferrals == 2
    cpu = w.sched.cpu
    assert cpu is not None
    cpu.complete_store(FA16.offload_keys(0, r.block_hashes[: 72 // 16]))
    plan, _ = w.step()
    assert plan.admitted == (b,) and [j.chunks for j in plan.loads] == [4]
    assert b.status is RequestStatus.WAITING_FOR_KV and b.deferrals == 2 and b.cpu_hit_tokens == 64


def deferred_behind_preempted(logic: str) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """``b``'s chunks stay pending, so its lookup defers every step while ``a`` and ``c``
    decode in an 11-block pool (their stores complete at once) until ``c`` is preempted,
    as in the preemption test above; the step after that, ``c`` does not fit (its whole
    input needs 6 blocks) and admission stops at it. Returns the queues (skipped ids, "|",
    waiting ids) after ``b``'s first deferral and after the step that follows the
    preemption, and whether that step looked ``b`` up again."""
    w = World(gpu_blocks=11, prefix_caching=False, cpu_capacity_chunks=40, window_logic=logic)
    cpu = w.sched.cpu
    assert cpu is not None
    rb = make_request("b", 72, 4, prefix=3)
    assert cpu.prepare_store(FA16.offload_keys(0, rb.block_hashes[: 72 // 16])) is not None
    w.add("a", 64, 40, prefix=1)
    c = w.add("c", 64, 40, prefix=2)
    b = w.sched.add_request(rb)
    done: list[LoadPlan | StorePlan] = []

    def step() -> StepPlan:
        nonlocal done
        plan, _ = w.step(done)
        done = [j.plan for j in plan.stores]     # every store completes during the next step
        return plan

    def ids(q: object) -> tuple[str, ...]:
        return tuple(r.req_id for r in q)  # type: ignore[attr-defined]

    plan = step()
    assert batch(plan) == [("a", 64), ("c", 64)] and b.deferrals == 1
    first = (*ids(w.sched.skipped), "|", *ids(w.sched.waiting))
    while not plan.preempted:
        plan = step()
    assert plan.preempted == (c,)
    deferrals = b.deferrals
    plan = step()
    assert not plan.admitted and c.status is RequestStatus.WAITING and c.num_computed == 0
    after = (*ids(w.sched.skipped), "|", *ids(w.sched.waiting))
    return first, after, b.deferrals > deferrals


@pytest.mark.parametrize("logic", ["old", "new", "latest"])
def test_where_a_deferred_request_waits_behind_a_preempted_one(logic: str) -> None:
    """vLLM 0.29/0.30 keep a skipped request in ``skipped_waiting``, drained before
    ``waiting``: after the preemption ``b`` is looked up again before ``c``, which then
    does not fit. vLLM 0.33 puts a skipped request that holds no KV blocks back at the
    front of ``waiting``, where the preempted ``c`` goes in front of it: ``c`` does not
    fit, admission stops, and ``b`` is not looked up in that step (found by
    ``--decisions differential`` against vLLM 0.33.0 on gemma-3-27b; docs/vllm.md,
    finding 12)."""
    first, after, looked_up = deferred_behind_preempted(logic)
    if logic == "latest":
        assert first == ("|", "b") and after == ("|", "c", "b") and not looked_up
    else:
        assert first == ("b", "|") and after == ("b", "|", "c") and looked_up


def test_a_request_longer_than_max_model_len_is_rejected_on_arrival() -> None:
    """4 usable blocks of 16 tokens: ``max_model_len`` is 64, as vLLM would require of a
    pool that small. A request of 62 + 2 tokens is queued; one of 62 + 3 is rejected when it
    arrives (an event at the given time, never queued, nothing held), as vLLM refuses it."""
    w = World(gpu_blocks=5, offloading=False)
    assert w.sched.max_model_len == 64
    w.sched.now = 3.0
    ok = w.sched.add_request(make_request("ok", 62, 2, 1))
    big = w.sched.add_request(make_request("big", 62, 3, 2), 7.5)
    assert ok.status is RequestStatus.WAITING and list(w.sched.requests) == ["ok"]
    assert big.status is RequestStatus.REJECTED and big.finish_s == 7.5
    assert w.events == [ModelEvent(7.5, "rejected", "too_long", "big", -1, -1,
                                   "62 prompt and 3 output tokens: 65 exceed max_model_len 64 "
                                   "(the longest request the GPU block pool holds)")]
    assert w.sched.stats.requests_arrived == 2 and w.released == []
    plan, _ = w.step()
    assert batch(plan) == [("ok", 62)] and w.sched.gpu.pool.num_used == 4


def test_max_model_len_is_each_groups_worst_case() -> None:
    """A sliding-window group holds at most its window, one step's tokens and a partial block
    (:func:`admission_caps`), so ``max_model_len`` grows with the pool only through the
    full-attention group: 1 null block, 16 window blocks of 8 tokens (cdiv(63 + 64, 8) + 1),
    the rest for 16-token full-attention blocks."""
    layout = Layout.of([GroupSpec(GroupKind.FULL, 16), GroupSpec(GroupKind.SLIDING_WINDOW, 8, window=64)],
                       tokens_per_hash=8, blocks_per_chunk=1)
    assert admission_caps(layout, 64) == (None, 17)
    for blocks in (100, 1000):
        n = max_model_len(layout, blocks, 64, prefix_caching=True)
        assert n == 16 * (blocks - 1 - 17), blocks   # the full group's blocks, once the window is capped
    # without full attention any length fits: the bound is the position limit kvsim gives vLLM
    windows = Layout.of([GroupSpec(GroupKind.SLIDING_WINDOW, 8, window=64)], tokens_per_hash=8,
                        blocks_per_chunk=1)
    assert max_model_len(windows, 100, 64, prefix_caching=True) == MAX_POSITIONS == 1 << 24
    # a Mamba group holds a state block per block with prefix caching ("all"), else one
    hybrid = Layout.of([GroupSpec(GroupKind.FULL, 16), GroupSpec(GroupKind.MAMBA, 16)], tokens_per_hash=8,
                       blocks_per_chunk=1)
    assert max_model_len(hybrid, 46, 64, prefix_caching=True) == 16 * 22
    assert max_model_len(hybrid, 46, 64, prefix_caching=False) == 16 * 44


def test_a_request_that_never_fits_is_rejected_and_the_next_one_admitted() -> None:
    """The fallback behind the arrival check (a bound looser than what the model allocates,
    set by hand here): 4 usable blocks (64 tokens), a 100-token prompt cannot be allocated
    even in an empty pool: rejected (an event, released), and the request behind it is
    admitted in the same step."""
    w = World(gpu_blocks=5, offloading=False)
    w.sched.max_model_len = 10**6
    big = w.add("big", 100, 2, prefix=4)
    small = w.add("small", 32, 2, prefix=5)
    plan, _ = w.step()
    assert big.status is RequestStatus.REJECTED and big.finish_s == 0.0
    assert batch(plan) == [("small", 32)] and plan.admitted == (small,)
    assert w.events == [ModelEvent(0.0, "rejected", "too_long", "big", -1, -1,
                                   "100 prompt tokens: does not fit in the GPU block pool (5 blocks)")]
    assert w.released == ["big"] and list(w.sched.requests) == ["small"]


def test_the_full_input_reservation_rejects_a_prompt_the_pool_cannot_hold_at_once() -> None:
    """vLLM's full-input admission (``scheduler_reserve_full_isl``, the default): the
    100-token prompt needs 7 blocks of the 4 free, so it is never given a chunk; with the
    pool to itself it is rejected in the first step, holding nothing."""
    w = World(gpu_blocks=5, max_num_batched_tokens=32, offloading=False)
    w.sched.max_model_len = 10**6   # past the arrival check, as in the test above
    big = w.add("big", 100, 2, prefix=4)
    plan, _ = w.step()
    assert not plan.scheduled and big.status is RequestStatus.REJECTED
    assert w.sched.gpu.pool.num_used == 0 and w.released == ["big"]
    assert w.events[0].message == "100 prompt tokens: does not fit in the GPU block pool (5 blocks)"
    assert w.sched.invariant_problems() == []


def test_the_full_input_reservation_holds_back_a_second_prompt() -> None:
    """A running request holds 4 of 9 usable blocks; a 90-token prompt needs 6: without the
    reservation its first 32-token chunk (2 blocks) is admitted at once, with it the
    request waits (the 5 free blocks cannot hold its whole input)."""
    for reserve, admitted_in_step_2 in ((True, False), (False, True)):
        w = World(gpu_blocks=10, max_num_batched_tokens=32, offloading=False, reserve_full_isl=reserve)
        w.add("a", 60, 3, prefix=1)
        w.step()
        w.step()   # a's prefill done (64 slots: 4 blocks)
        b = w.add("b", 90, 2, prefix=2)
        plan, _ = w.step()
        assert w.sched.gpu.pool.num_used == 4 + 2 * admitted_in_step_2
        assert (b.req_id in [rid for rid, _ in batch(plan)]) is admitted_in_step_2, reserve


def test_a_chunked_prefill_that_outgrows_the_pool_alone_is_rejected() -> None:
    """Without the full-input reservation, with a 32-token budget the 100-token prompt
    gets 2 chunks (4 blocks); its third chunk does not fit even with the pool to itself:
    rejected, the step counts as a deadlock break (no endless self-preemption)."""
    w = World(gpu_blocks=5, max_num_batched_tokens=32, offloading=False, reserve_full_isl=False)
    w.sched.max_model_len = 10**6   # past the arrival check, as in the tests above
    big = w.add("big", 100, 2, prefix=4)
    assert [batch(w.step()[0]) for _ in range(2)] == [[("big", 32)], [("big", 32)]]
    assert w.sched.gpu.pool.num_used == 4
    plan, _ = w.step()
    assert not plan.scheduled and not plan.preempted and plan.broke_deadlock and plan.busy
    assert big.status is RequestStatus.REJECTED and w.sched.gpu.pool.num_used == 0
    assert w.events[0].message == ("100 prompt tokens: its next prefill chunk does not fit in the GPU "
                                   "block pool (5 blocks) even alone")
    assert w.sched.invariant_problems() == []


@pytest.mark.parametrize("apply", ["step by step", "all at once"])
def test_fast_forward_is_stepping_in_one_go(apply: str) -> None:
    """Two decoding requests, 1 s steps, a horizon at 3.5 s: 4 steps start
    before it. Applying them step by step (``fast_forward_step``), or all at once
    (``fast_forward_all``, as the engine does), gives the state plain steps give."""
    def world() -> tuple[World, list[LiveRequest]]:
        w = World(gpu_blocks=101, offloading=False, step_cost=StepCostModel(overhead_s=1.0))
        rs = [w.add("a", 60, 20, prefix=1), w.add("b", 30, 20, prefix=2)]
        w.step()
        return w, rs

    ff_world, ff_reqs = world()
    sched = ff_world.sched
    assert sched.can_fast_forward()
    ff = sched.plan_fast_forward(1.0, 4.5)
    assert ff is not None and ff.durations == (1.0, 1.0, 1.0, 1.0) and ff.context0 == 61 + 31
    if apply == "all at once":
        sched.fast_forward_all(ff)
    else:
        for s in range(ff.k):
            sched.fast_forward_step(ff, s)
    assert not ff.heap   # every request's due steps were applied
    sched.finish_fast_forward(ff)
    step_world, step_reqs = world()
    for _ in range(4):
        assert step_world.step()[0].decode_seqs == 2
    for x, y in zip(ff_reqs, step_reqs, strict=True):
        assert (x.num_computed, x.num_tokens, x.generated, x.high_water) == \
               (y.num_computed, y.num_tokens, y.generated, y.high_water)
        assert x.num_computed == x.num_prompt_tokens + 4
        assert [b.block_id for b in sched.gpu.req_blocks[x.req_id][0]] == \
               [b.block_id for b in step_world.sched.gpu.req_blocks[y.req_id][0]]
    # a request two tokens from its end: no fast-forward
    w = World(gpu_blocks=101, offloading=False)
    w.add("c", 30, 3, prefix=3)
    w.step()
    assert not w.sched.can_fast_forward()


def test_attended_context_counts_what_each_kind_reads() -> None:
    """The step's context term: full attention reads the whole context, a
    sliding window its last W tokens, chunked local its current chunk, mamba
    one state block; weighted by bytes per token."""
    layout = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=16 * 10),
                        GroupSpec(GroupKind.SLIDING_WINDOW, 16, window=128, bytes_per_block=16 * 3),
                        GroupSpec(GroupKind.CHUNKED_LOCAL, 16, attention_chunk=64, bytes_per_block=16 * 2),
                        GroupSpec(GroupKind.MAMBA, 32, bytes_per_block=32 * 5)],
                       tokens_per_hash=16, blocks_per_chunk=1)
    ctx = AttendedContext(layout)
    assert ctx.bytes_per_token == 20
    assert ctx.attended(1000) == 1000 * 10 + 128 * 3 + (1000 - 960) * 2 + 32 * 5
    assert ctx.attended(64) == 64 * 10 + 64 * 3 + 64 * 2 + 32 * 5
    assert ctx.attended(65) == 65 * 10 + 65 * 3 + 1 * 2 + 32 * 5
    assert ctx.attended(5) == 5 * 10 + 5 * 3 + 5 * 2 + 5 * 5

    # the vectorised form used by fast-forward agrees with the scalar one
    def live(nc: int) -> LiveRequest:
        r = LiveRequest(Request(f"r{nc}", 0.0, 1000, 100, [0] * (1100 // 16)), 16)
        r.num_computed = nc
        return r

    rs = [live(3), live(63), live(127), live(900)]
    runs = ctx.attended_runs(rs, 70)
    assert runs == [sum(ctx.attended(r.num_computed + 1 + s) for r in rs) for s in range(70)]
    # a full-attention-only layout keeps the plain token count
    fa_only = AttendedContext(FA16)
    assert fa_only.attended(777) / fa_only.bytes_per_token == 777

    # the step load: a 200-token prefill chunk after 900 computed tokens and one decode at 63
    load = ctx.load([(900, 200, False), (63, 1, True)])
    assert (load.prefill_tokens, load.decode_seqs, load.requests) == (200, 1, 2)
    assert load.kv_read_bytes == ctx.attended(1100) + ctx.attended(64)
    assert load.context_tokens == load.kv_read_bytes / 20
    assert load.pairs == (
        200 * 900 + 200 * 201 // 2 + 64,                     # full: causal, quadratic in the chunk
        200 * 128 + 64,                                       # sliding window: 128 keys per query
        sum(t % 64 + 1 for t in range(900, 1100)) + 64,       # chunked local: its own chunk
        200 + 1,                                              # mamba: a state update per token
    )
    # fast-forward's vectorised decode loads are the same integers as stepping's
    bytes_, pairs = ctx.decode_runs(rs, 70)
    for s in range(70):
        step = ctx.load([(r.num_computed + s, 1, True) for r in rs])
        assert (bytes_[s], pairs[s]) == (step.kv_read_bytes, step.pairs)


def test_a_finished_request_whose_last_store_completes_as_it_finishes_still_stores() -> None:
    """vLLM keeps a finished request's connector state until its final stores are built
    (``finished_signaled``, set by the next ``build_connector_meta``), even when its last
    store job completes in the very update in which it finishes. Here "a" (63 prompt
    tokens, one output token, OLD logic, all tokens offloaded) prefills in two steps
    storing chunks 0-1 and 2; both stores complete in the update where it finishes; its
    final store (chunk 3: OLD stores up to the sampled token) comes with the next step.
    kvsim forgot the request at that completion and built no final store (found by the
    differential mode: gemma-3-27b, 8 GiB ARC, vLLM 0.29, a refused offer made again at
    the finish)."""
    w = World(gpu_blocks=20, cpu_capacity_chunks=100, window_logic="old", offload_prompt_only=False,
              max_num_batched_tokens=32)
    a = w.add("a", 63, 1, prefix=1)
    plan, _ = w.step()
    assert batch(plan) == [("a", 32)] and [j.chunks for j in plan.stores] == [2]
    first = plan.stores[0].plan
    assert isinstance(first, StorePlan)
    plan = w.sched.schedule(1.0)
    assert batch(plan) == [("a", 31)] and [j.chunks for j in plan.stores] == [1]
    second = plan.stores[0].plan
    assert isinstance(second, StorePlan)
    out = w.sched.update_from_output(2.0, plan, [first, second])   # both done as "a" finishes
    assert [r.req_id for r in out.finished] == ["a"] and out.polled == 2 and a.num_tokens == 64
    plan = w.sched.schedule(2.0)
    assert [(j.req_id, j.chunks) for j in plan.stores] == [("a", 1)]
    final = plan.stores[0].plan
    assert isinstance(final, StorePlan) and list(final.keys) == FA16.offload_keys(0, a.block_hashes[3:4])
    w.sched.update_from_output(3.0, plan, [final])
    assert w.released == ["a"] and not w.sched.conn.has_request("a")


def test_a_finished_request_frees_its_skipped_window_blocks_first() -> None:
    """With offloading, vLLM's ``_connector_finished`` frees the window blocks a finished
    request no longer attends over (``remove_skipped_blocks``) before its other blocks, so
    they go to the free queue first. Here the 62-token prompt's one decode step takes the
    window (32 tokens) past sliding-window block 1 (id 6); the request then frees it alone
    (hashed: to the tail), then full attention tail first (partial block 4 to the head,
    3, 2, 1 to the tail), then the window group (partial block 8 to the head, 7 to the
    tail). Found by the differential mode (a block id that differed from vLLM's)."""
    layout = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=1000),
                        GroupSpec(GroupKind.SLIDING_WINDOW, 16, window=32, bytes_per_block=1000)],
                       tokens_per_hash=16, blocks_per_chunk=1)
    sched = Scheduler(SchedulerConfig(layout=layout, gpu_blocks=20, cpu_capacity_chunks=100))
    r = sched.add_request(make_request("a", 62, 2, 1))
    plan = sched.schedule(0.0)
    sched.update_from_output(1.0, plan, [])
    plan = sched.schedule(1.0)
    assert sched.gpu.block_ids("a") == [[1, 2, 3, 4], [0, 6, 7, 8]]
    out = sched.update_from_output(2.0, plan, [])
    assert [f.req_id for f in out.finished] == ["a"] and r.num_computed == 63
    assert sched.gpu.pool.free_ids_head(19) == [8, 4, *range(9, 20), 5, 6, 3, 2, 1, 7]


def test_admitting_a_request_fences_the_blocks_it_hit() -> None:
    """vLLM's connector counts every block of a newly scheduled request as allocated in
    the step, its prefix-cache hits included (``_update_req_states`` over the whole block
    table), so a store still reading a block that another request's hit takes is flushed.
    Here ``a``'s store job 0 reads its sliding-window blocks 5-8; ``b`` hits ``a``'s 64
    tokens and takes blocks 7 and 8: job 0 is flushed. Found by the differential mode
    (vLLM 0.29, the DeepSeek-V4-style MTP layout)."""
    layout = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=1000),
                        GroupSpec(GroupKind.SLIDING_WINDOW, 16, window=32, bytes_per_block=1000)],
                       tokens_per_hash=16, blocks_per_chunk=1)
    sched = Scheduler(SchedulerConfig(layout=layout, gpu_blocks=40, cpu_capacity_chunks=100))
    sched.add_request(make_request("a", 64, 8, 1))
    plan = sched.schedule(0.0)
    assert [j.job_id for j in plan.stores] == [0] and not plan.flush
    sched.update_from_output(1.0, plan, [])   # job 0 still in flight
    b = sched.add_request(make_request("b", 80, 8, 1))
    plan = sched.schedule(1.0)
    assert [r.req_id for r in plan.admitted] == ["b"] and b.gpu_hit_tokens == 64
    assert sched.gpu.block_ids("b") == [[1, 2, 3, 4, 11], [0, 0, 7, 8, 12]]
    assert plan.flush == frozenset({0})


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 512), st.data())
def test_attended_context_load_equals_the_reference(window: int, chunk: int, data: st.DataObject) -> None:
    """The step load summed per distinct (kind, span) equals the per-request,
    per-group reference exactly: every kind, windows and chunks below and above
    the contexts, zero-token entries, and two equal window groups sharing sums."""
    layout = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=16 * 7),
                        GroupSpec(GroupKind.SLIDING_WINDOW, 16, window=window, bytes_per_block=16 * 3),
                        GroupSpec(GroupKind.CHUNKED_LOCAL, 16, attention_chunk=chunk * 16,
                                  bytes_per_block=16 * 2),
                        GroupSpec(GroupKind.MAMBA, 32, bytes_per_block=32 * 5),
                        GroupSpec(GroupKind.SLIDING_WINDOW, 16, window=window, bytes_per_block=16 * 4)],
                       tokens_per_hash=16, blocks_per_chunk=1)
    edges = [window, chunk * 16, 32]                 # contexts near a window, a chunk, a state block
    near = st.sampled_from(edges).flatmap(lambda e: st.integers(max(0, e - 3), e + 3))
    work = data.draw(st.lists(st.tuples(st.one_of(st.integers(0, 300_000), near),
                                        st.integers(0, 9_000) | st.integers(0, 3), st.booleans()),
                              max_size=60))
    ctx = AttendedContext(layout)
    assert ctx.load(work) == ctx.load_reference(work)
    assert ctx.load(work, 7) == ctx.load_reference(work, 7)


def test_releasing_finished_requests_alone_is_no_work() -> None:
    """A step that only released the connector state of requests finished in the previous
    step is not busy (the engine takes no further step at the same time for it, as with
    vLLM deciding); a store it builds, or a deadlock it breaks, is."""
    assert not StepPlan(released_finished=True).busy
    assert StepPlan(released_finished=True, broke_deadlock=True).busy
    assert StepPlan(flush=frozenset({3})).busy


def _chunked_local_layout(cl_block: int) -> Layout:
    return Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=1000),
                      GroupSpec(GroupKind.CHUNKED_LOCAL, cl_block, attention_chunk=32, bytes_per_block=1000)],
                     tokens_per_hash=8, blocks_per_chunk=1)


def test_lookup_assertion_is_a_chunked_local_group_off_the_hybrid_alignment() -> None:
    """vLLM 0.29-0.33 (kv_cache_coordinator / single_type_kv_cache_manager): a hybrid hit is
    aligned to the groups' least common block size, and the chunked-local finder asserts
    that its own block size is that alignment."""
    assert lookup_assertion(_chunked_local_layout(16)) is None      # aligned: 16 = lcm(16, 16)
    msg = lookup_assertion(_chunked_local_layout(8))
    assert msg is not None and msg.startswith("group 1: chunked local attention with 8-token blocks in a "
                                              "layout aligned to 16 tokens")
    one = Layout.of([GroupSpec(GroupKind.CHUNKED_LOCAL, 8, attention_chunk=32)], tokens_per_hash=8,
                    blocks_per_chunk=1)
    assert lookup_assertion(one) is None                             # one group: no hybrid coordinator


@pytest.mark.parametrize("on_crash", ["record", "stop"])
def test_a_layout_vllm_asserts_on_at_lookup_records_a_crash(on_crash: str) -> None:
    """With prefix caching, every local lookup of such a layout asserts in vLLM: the first
    lookup of each request is a recorded crash (kind ``assertion``); with ``record`` the
    request goes on with no local hit (its prefix was cached by the request before), with
    ``stop`` the run stops at the first. Without prefix caching nothing is looked up."""
    def world(cl_block: int = 8, **cfg: object) -> World:
        w = World.__new__(World)
        w.events, w.released, w.t = [], [], 0.0
        hooks = SchedulerHooks(event=w.events.append, release=lambda r: w.released.append(r.req_id))
        w.sched = Scheduler(SchedulerConfig(layout=_chunked_local_layout(cl_block), gpu_blocks=200,
                                            offloading=False, **cfg), hooks)  # type: ignore[arg-type]
        return w

    w = world(on_crash=on_crash)
    a = w.add("a", 64, 2, prefix=1)
    plan, _ = w.step()
    assert [e.kind for e in w.events] == ["crash"] and a.crash == "assertion"
    assert w.events[0].message.startswith("vLLM kv_cache_coordinator: find_longest_cache_hit: group 1")
    if on_crash == "stop":
        assert plan.stopped
        return
    assert batch(plan) == [("a", 64)]
    while a.status is not RequestStatus.FINISHED:
        w.step()
    b = w.add("b", 64, 2, prefix=1)   # the same prompt: cached, but the lookup asserted
    w.step()
    assert b.crash == "assertion" and b.gpu_hit_tokens == 0 and w.sched.stats.crashes == 2
    aligned = world(cl_block=16)   # the same two requests where vLLM does not assert: b hits
    a = aligned.add("a", 64, 2, prefix=1)
    while a.status is not RequestStatus.FINISHED:
        aligned.step()
    b = aligned.add("b", 64, 2, prefix=1)
    aligned.step()
    assert b.gpu_hit_tokens == 32 and aligned.events == []
    quiet = world(prefix_caching=False)
    quiet.add("a", 64, 2, prefix=1)
    quiet.step()
    assert quiet.events == []



def _final_store_keys(logic: str) -> tuple[list[tuple[int, int]], Request]:
    """Run one request (100 prompt and 20 output tokens, all offloaded) to its finish on
    full attention of 64-token blocks beside a 2-token sliding window of 16-token blocks
    (one block per chunk); return the (group, chunk) of every key of its last store."""
    layout = Layout.of([GroupSpec(GroupKind.FULL, 64, bytes_per_block=1000),
                        GroupSpec(GroupKind.SLIDING_WINDOW, 16, window=2, bytes_per_block=1000)],
                       tokens_per_hash=16, blocks_per_chunk=1)
    sched = Scheduler(SchedulerConfig(layout=layout, gpu_blocks=64, max_num_batched_tokens=128,
                                      cpu_capacity_chunks=100, window_logic=logic,  # type: ignore[arg-type]
                                      offload_prompt_only=False), SchedulerHooks())
    req = make_request("a", 100, 20, prefix=1)
    sched.add_request(req)
    t, last = 0.0, None
    while sched.requests:
        plan = sched.schedule(t)
        done = [s.plan for s in plan.stores]
        if done:
            last = plan.stores
        t += 1.0
        sched.update_from_output(t, plan, done)   # every store completes within its step
    assert last is not None
    hashes = req.block_hashes
    where = {key: (g, j) for g in range(2) for j, key in enumerate(layout.offload_keys(g, hashes))}
    return sorted(where[k] for s in last for k in s.plan.keys), req


def test_a_finished_request_stores_the_window_chunk_its_final_segment_reaches() -> None:
    """vLLM 0.30 and 0.33 look again, at a finished request's last store, at a sliding-window
    group's final partial segment of the store grid (``reconsider_final_swa_tail``): a chunk
    that the prompt's horizon deemed unreachable, and the decode frontier skipped, is
    reachable at the final horizon. Here the grid is 64 tokens (4 window chunks), the prompt
    holds 6 chunks, the finished request 7: window chunk 6 (tokens 96-112) was skipped
    while decoding and is stored at the finish under NEW and LATEST; without that second
    look it is never stored. Found in lockstep with vLLM 0.30.0 (the run fuzzer's seed 9
    run 12)."""
    for logic in ("new", "latest"):
        keys, _ = _final_store_keys(logic)
        assert keys == [(1, 6)], (logic, keys)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(profile(logic)), "reconsiders_final_window_tail", False)
            keys, _ = _final_store_keys(logic)
        assert (1, 6) not in keys, (logic, keys)
