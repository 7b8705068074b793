"""The worked numbers of spec §6 (the unaligned sliding-window hit), step by step."""

from __future__ import annotations

import pytest

from sim.model.connector import ModelledCrashError
from sim.model.cpu_cache import LookupResult, key_parts, offload_key
from sim.model.windows import NEW, OLD
from tests.helpers import SPEC6, World, make_req


def setup(logic: str, boundary: int, left: str, eagle: bool = False) -> tuple[World, object]:
    layout = SPEC6
    if eagle:
        from sim.model.layout import Layout
        from tests.helpers import fa, swa
        layout = Layout.of([fa(256), swa(64, 128, eagle=True), swa(8, 128)], 8, 4)
    w = World(layout, logic)
    req = make_req(layout, 4353)
    end = -(-boundary // 256)
    w.store(req, 0, range(4))
    w.store(req, 1, [end - 1] + ([end] if eagle else []))
    w.store(req, 2, range(boundary // 32 - 4, boundary // 32))
    left_key = w.key(req, 1, end - 2)
    if left in ("present", "loading"):
        w.store(req, 1, [end - 2])
    if left == "pending":
        w.store(req, 1, [end - 2], complete=False)
    if left == "loading":
        w.cpu.prepare_load([left_key])
        w.sched.being_loaded.add(left_key)
    w.sched.on_new_request(req)
    return w, req


def admit(w: World, req):
    m = w.sched.get_num_new_matched_tokens(req, 0)
    if not m.tokens:
        return m, None
    alloc = w.gpu.allocate_new(req.req_id, ([], [], []), 0, m.tokens, m.tokens)
    return m, w.sched.update_state_after_alloc(req, alloc.blocks, m.tokens)


def test_lookup_order_puts_the_larger_window_first():
    assert SPEC6.tokens_per_chunk == (1024, 256, 32)
    assert SPEC6.window_chunks == (None, 1, 4)
    assert SPEC6.lookup_order == (0, 2, 1)
    assert [SPEC6.num_keys(g, 4353) for g in range(3)] == [4, 17, 136]


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("logic", ["old", "new"])
@pytest.mark.parametrize("left", ["present", "missing", "pending", "loading"])
def test_boundary_3840_is_aligned_and_safe_in_every_state(logic, left, eagle):
    w, req = setup(logic, 3840, left, eagle)
    m, plan = admit(w, req)
    assert (m.tokens, m.load_async) == (3840, True)
    assert plan.group_sizes == (15, 2, 16)
    assert plan.block_indices == (0, 58, 464)
    assert plan.chunks == tuple([(0, j) for j in range(4)] + [(1, 14)]
                                + [(2, j) for j in range(116, 120)])
    assert plan.hazards == ()


@pytest.mark.parametrize("eagle", [False, True])
def test_new_3904_present_loads_the_left_chunk(eagle):
    w, req = setup("new", 3904, "present", eagle)
    m, plan = admit(w, req)
    assert m.tokens == 3904
    assert plan.group_sizes == (16, 2, 16)
    assert plan.block_indices == (0, 59, 472)
    assert {(1, 14), (1, 15)} <= set(plan.chunks)
    assert len(plan.keys) == 10 and len(plan.dst_block_ids) == 34
    # the loaded chunks are pinned and in the being-loaded set
    assert all(w.cpu.ref_count(k) == 1 for k in plan.keys)
    assert set(plan.keys) <= w.sched.being_loaded


@pytest.mark.parametrize("eagle", [False, True])
def test_new_3904_missing_gives_zero(eagle):
    w, req = setup("new", 3904, "missing", eagle)
    m, plan = admit(w, req)
    assert (m.tokens, m.load_async, plan) == (0, False, None)


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("left,reason", [("pending", "pending_or_retry"), ("loading", "being_loaded")])
def test_new_3904_pending_or_loading_defers(left, reason, eagle):
    w, req = setup("new", 3904, left, eagle)
    m, plan = admit(w, req)
    assert (m.tokens, m.load_async, m.defer_reason, plan) == (None, False, reason, None)


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("left,kind", [("missing", "missing_chunk"), ("pending", "chunk_not_ready")])
def test_old_3904_crashes_in_prepare_load_on_swa_14(left, kind, eagle):
    w, req = setup("old", 3904, left, eagle)
    m = w.sched.get_num_new_matched_tokens(req, 0)
    assert (m.tokens, m.load_async) == (3904, True)
    alloc = w.gpu.allocate_new(req.req_id, ([], [], []), 0, 3904, 3904)
    before = {k: w.cpu.ref_count(k) for k in w.cpu.keys()}
    with pytest.raises(ModelledCrashError) as info:
        w.sched.update_state_after_alloc(req, alloc.blocks, 3904)
    crash = info.value.crash
    assert (crash.kind, crash.group, crash.chunk, crash.where) == (kind, 1, 14, "prepare_load")
    # the failed call left the CPU cache and the scheduler untouched
    assert {k: w.cpu.ref_count(k) for k in w.cpu.keys()} == before
    assert w.sched.num_jobs == 0 and not w.sched.being_loaded


@pytest.mark.parametrize("eagle", [False, True])
def test_old_3904_loading_is_a_double_load(eagle):
    w, req = setup("old", 3904, "loading", eagle)
    m, plan = admit(w, req)
    assert m.tokens == 3904
    assert [(h.kind, h.group, h.chunk) for h in plan.hazards] == [("double_load", 1, 14)]
    left = w.key(req, 1, 14)
    assert w.cpu.ref_count(left) == 2
    # E11: the first completion clears the key although the second load still runs
    w.cpu.complete_load([left])
    w.sched.being_loaded.discard(left)
    w.sched.complete_job(plan.job_id)
    assert w.cpu.ref_count(left) == 0 and left not in w.sched.being_loaded


def test_old_3904_only_ever_looks_up_swa_15():
    w, req = setup("old", 3904, "missing")
    seen = []
    real = w.cpu.lookup
    w.cpu.lookup = lambda k: (seen.append(k), real(k))[1]  # spy on this instance only
    w.sched.get_num_new_matched_tokens(req, 0)
    assert [w.key(req, 1, j) for j in (15,)] == [k for k in seen if key_parts(k)[1] == 1]


KEYS = [offload_key(i, 0) for i in range(5)]


def scan(profile, middle):
    results = dict.fromkeys(KEYS, LookupResult.HIT)
    results[KEYS[2]] = middle
    return profile.window_scan(results.__getitem__, KEYS, 2, 3 if profile is NEW else None)


@pytest.mark.parametrize("middle,new", [
    (LookupResult.MISS, 2), (LookupResult.RETRY, None),
    (LookupResult.HIT_PENDING, None), (LookupResult.HIT, 5)])
def test_sliding_window_unaligned_initial_run(middle, new):
    """Spec §6.4: five keys, window 2, initial window 3."""
    assert scan(NEW, middle) == new
    assert scan(OLD, middle) == 5
