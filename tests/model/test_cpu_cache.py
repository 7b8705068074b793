"""Tests of the CPU chunk cache (spec §3).

Narrative unit tests walk one cache step by step and assert exact slot ids,
ref counts and eviction order; two hypothesis state machines then drive random
operation sequences against a deliberately naive model.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sim.model.cpu_cache import (
    KEY_GROUPS,
    NEVER,
    ArcPolicy,
    BeladyPolicy,
    CacheAssertion,
    CacheInvariantError,
    ChunksEvicted,
    ChunksStored,
    ChunkState,
    CpuChunkCache,
    EvictionPolicy,
    LoadCompleted,
    LoadStarted,
    LookupResult,
    OffloadKey,
    StoreCancelled,
    StoreReservation,
    capacity_from_bytes,
    key_parts,
    offload_key,
)
from sim.model.layout import GroupKind, GroupSpec, Layout, LayoutError
from sim.model.windows import profile

HIT, HIT_PENDING, MISS, RETRY = (
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.MISS,
    LookupResult.RETRY,
)


# ------------------------------------------------------------ the key encoding

hashes = st.integers(min_value=-(2**63), max_value=2**64)
groups = st.integers(min_value=0, max_value=KEY_GROUPS - 1)


@given(st.tuples(hashes, groups), st.tuples(hashes, groups))
def test_offload_key_round_trips_and_orders_as_the_hash_group_pair(a, b):
    ka, kb = offload_key(*a), offload_key(*b)
    assert key_parts(ka) == a and key_parts(kb) == b
    assert (ka == kb) == (a == b)
    assert (ka < kb) == (a < b)     # sorting keys sorts by hash, then group


def test_a_layout_refuses_more_groups_than_a_key_can_name():
    group = GroupSpec(GroupKind.FULL, 16)
    Layout.of([group] * KEY_GROUPS, 16)
    with pytest.raises(LayoutError, match=f"at most {KEY_GROUPS}"):
        Layout.of([group] * (KEY_GROUPS + 1), 16)


# ----------------------------------------------------------------- builders


def k(h: int, g: int = 0) -> OffloadKey:
    """The key of a chunk whose last hash block has hash ``h``, in group ``g``."""
    return offload_key(h, g)


A, B, C, D, E, F, G = (k(h) for h in range(1, 8))


def lru(capacity: int, **kwargs: int) -> CpuChunkCache:
    return CpuChunkCache(capacity, EvictionPolicy.LRU, **kwargs)


def arc(capacity: int) -> CpuChunkCache:
    return CpuChunkCache(capacity, EvictionPolicy.ARC)


def stored(cache: CpuChunkCache, *keys: OffloadKey) -> StoreReservation:
    """Store ``keys`` in one job and complete it; the plan must exist."""
    plan = cache.prepare_store(keys)
    assert plan is not None
    cache.complete_store(keys)
    return plan


def store_plan(cache: CpuChunkCache, *keys: OffloadKey) -> StoreReservation:
    """Prepare (only) a store of ``keys``; the plan must exist."""
    plan = cache.prepare_store(keys)
    assert plan is not None
    return plan


def arc_lists(cache: CpuChunkCache) -> tuple[list[OffloadKey], ...]:
    """(T1, T2, B1, B2), each oldest first."""
    policy = cache._policy
    assert isinstance(policy, ArcPolicy)
    return list(policy.t1), list(policy.t2), list(policy.b1), list(policy.b2)


def arc_p(cache: CpuChunkCache) -> float:
    policy = cache._policy
    assert isinstance(policy, ArcPolicy)
    return policy.p


def eviction_order(cache: CpuChunkCache) -> list[OffloadKey]:
    """Every idle key, next victim first, probed by overflowing a copy of the cache."""
    probe = copy.deepcopy(cache)
    room = probe.num_free_slots + probe.num_evictable
    fresh = [k(-1 - i, 99) for i in range(room)]
    plan = probe.prepare_store(fresh)
    assert plan is not None
    return list(plan.evicted)


# ------------------------------------------------------------ LRU narratives


def test_chunk_lifecycle_states_ref_counts_and_lookups() -> None:
    cache = lru(4)
    assert cache.lookup(A) is MISS
    assert cache.state(A) is ChunkState.MISSING
    assert cache.ref_count(A) is None and cache.slot(A) is None

    plan = cache.prepare_store([A, B])
    assert plan == StoreReservation(keys=(A, B), slots=(0, 1), evicted=())
    assert cache.lookup(A) is HIT_PENDING
    assert cache.state(A) is ChunkState.PENDING
    assert cache.ref_count(A) == -1
    assert (cache.num_pending, cache.num_ready, cache.num_loading) == (2, 0, 0)
    assert (cache.num_used, cache.num_free_slots, cache.num_evictable) == (2, 2, 0)

    cache.complete_store([A, B])
    assert cache.lookup(A) is HIT and cache.state(A) is ChunkState.READY
    assert cache.ref_count(A) == 0 and cache.slot(B) == 1
    assert (cache.num_pending, cache.num_ready, cache.num_evictable) == (0, 2, 2)

    assert cache.prepare_load([B, A]) == (1, 0)
    assert cache.prepare_load([A]) == (0,)
    assert cache.ref_count(A) == 2 and cache.ref_count(B) == 1
    assert cache.state(A) is ChunkState.LOADING
    assert cache.lookup(A) is HIT  # a chunk being read is still a hit
    assert (cache.num_ready, cache.num_loading, cache.num_evictable) == (0, 2, 0)

    cache.complete_load([A, B])
    assert cache.ref_count(A) == 1 and cache.ref_count(B) == 0
    cache.complete_load([A])
    assert cache.ref_count(A) == 0
    assert (cache.num_ready, cache.num_loading, cache.num_used) == (2, 0, 2)
    assert sorted(cache.keys()) == [A, B]
    cache.check_invariants()


def test_lookup_has_no_side_effect_on_recency() -> None:
    cache = lru(2)
    stored(cache, A)
    stored(cache, B)
    for _ in range(3):
        assert cache.lookup(A) is HIT
    assert eviction_order(cache) == [A, B]


def test_slots_never_used_ascending_then_free_list_last_freed_first() -> None:
    cache = lru(4)
    assert stored(cache, A, B, C, D).slots == (0, 1, 2, 3)
    # Full: evicting A (slot 0) then B (slot 1) puts [0, 1] on the free list;
    # allocation pops from its end, so E gets slot 1 and F slot 0.
    plan = cache.prepare_store([E, F])
    assert plan == StoreReservation(keys=(E, F), slots=(1, 0), evicted=(A, B))
    assert cache.slot(E) == 1 and cache.slot(F) == 0
    cache.check_invariants()


def test_never_used_slots_are_taken_before_the_free_list() -> None:
    cache = lru(4)
    stored(cache, A, B)  # slots 0, 1
    cache.prepare_store([C])  # slot 2
    cache.complete_store([C], success=False)  # slot 2 back on the free list
    assert cache.num_free_slots == 2
    # One never-used slot (3) is left: it goes first, then the free list's 2.
    assert stored(cache, D, E).slots == (3, 2)


def test_store_order_is_recency_order() -> None:
    cache = lru(3)
    stored(cache, A, B, C)
    assert eviction_order(cache) == [A, B, C]
    assert cache.prepare_store([D]) == StoreReservation((D,), (0,), (A,))


def test_complete_store_appends_at_most_recent_end_in_completion_order() -> None:
    cache = lru(3)
    cache.prepare_store([A, B, C])
    cache.complete_store([C])
    cache.complete_store([B, A])
    assert eviction_order(cache) == [C, B, A]


def test_touch_walks_keys_backwards_so_the_first_key_is_most_recent() -> None:
    cache = lru(4)
    stored(cache, A, B, C, D)
    cache.touch([A, B])
    # B is moved to the newest end first, then A after it.
    assert eviction_order(cache) == [C, D, B, A]
    assert store_plan(cache, E).evicted == (C,)
    assert store_plan(cache, F).evicted == (D,)


def test_touch_ignores_absent_pending_and_loading_keys() -> None:
    cache = lru(4)
    stored(cache, A, B, C)
    cache.prepare_store([D])  # pending
    cache.prepare_load([B])  # loading
    cache.touch([A, B, D, k(42)])
    assert eviction_order(cache) == [C, A]
    cache.complete_load([B])
    assert eviction_order(cache) == [C, A, B]


def test_completed_load_reinserts_at_the_most_recent_end() -> None:
    cache = lru(3)
    stored(cache, A, B, C)
    cache.prepare_load([A])
    assert eviction_order(cache) == [B, C]
    cache.complete_load([A])
    assert eviction_order(cache) == [B, C, A]
    # A second concurrent load keeps it pinned until the last one completes.
    cache.prepare_load([B])
    cache.prepare_load([B])
    cache.complete_load([B])
    assert eviction_order(cache) == [C, A]
    cache.complete_load([B])
    assert eviction_order(cache) == [C, A, B]


def test_pending_and_loading_chunks_are_never_evicted() -> None:
    cache = lru(3)
    stored(cache, A, B)
    cache.prepare_store([C])  # pending, slot 2
    cache.prepare_load([A])  # loading
    assert cache.prepare_store([D]) == StoreReservation((D,), (1,), (B,))
    # Now A is loading, C pending, D pending: nothing is evictable.
    assert cache.num_evictable == 0
    assert cache.prepare_store([E]) is None
    cache.complete_load([A])
    assert cache.prepare_store([E]) == StoreReservation((E,), (0,), (A,))
    assert [cache.state(key) for key in (C, D, E)] == [ChunkState.PENDING] * 3


def test_prepare_store_is_all_or_nothing() -> None:
    cache = lru(4)
    stored(cache, A, B)
    cache.prepare_store([C])
    cache.take_events()
    # Four new keys need one slot more than free (1) + evictable (A, B).
    assert cache.prepare_store([D, E, F, G]) is None
    assert sorted(cache.keys()) == [A, B, C]
    assert (cache.num_free_slots, cache.num_evictable, cache.num_pending) == (1, 2, 1)
    assert cache.take_events() == []
    assert eviction_order(cache) == [A, B]
    # Three fit exactly.
    assert cache.prepare_store([D, E, F]) == StoreReservation((D, E, F), (3, 1, 0), (A, B))


def test_offered_keys_already_present_are_protected_from_eviction() -> None:
    cache = lru(2)
    stored(cache, A, B)  # A is the LRU victim
    # A is offered again: dropped from the keys to store and protected, so B goes.
    assert cache.prepare_store([A, C]) == StoreReservation((C,), (1,), (B,))
    assert cache.state(A) is ChunkState.READY


def test_prepare_store_fails_when_every_idle_chunk_is_protected() -> None:
    cache = lru(2)
    stored(cache, A, B)
    # Enough evictable chunks by count (2 >= 1), but both are offered: None.
    assert cache.prepare_store([A, B, C]) is None
    assert sorted(cache.keys()) == [A, B]
    assert eviction_order(cache) == [A, B]


def test_present_keys_are_dropped_and_all_present_gives_an_empty_plan() -> None:
    cache = lru(2)
    stored(cache, A)
    cache.prepare_store([B])  # pending, cache now full and B not evictable
    cache.prepare_load([A])  # nothing evictable at all
    plan = cache.prepare_store([B, A])
    assert plan is not None
    assert plan == StoreReservation((), (), ())
    assert cache.prepare_store([]) == StoreReservation((), (), ())
    # Order of the remaining keys is kept.
    cache2 = lru(5)
    stored(cache2, B, D)
    assert cache2.prepare_store([A, B, C, D, E]) == StoreReservation((A, C, E), (2, 3, 4), ())


def test_complete_store_ignores_absent_and_ready_keys() -> None:
    cache = lru(3)
    stored(cache, A)
    cache.prepare_store([B])
    cache.take_events()
    cache.complete_store([A, B, C])
    assert cache.take_events() == [ChunksStored((B,))]
    assert cache.ref_count(A) == 0 and cache.ref_count(B) == 0
    assert cache.lookup(C) is MISS
    cache.complete_store([A, B])
    assert cache.take_events() == []


def test_failed_store_frees_the_slot_and_forgets_the_key() -> None:
    cache = lru(3)
    stored(cache, A)
    cache.prepare_store([B, C])  # slots 1, 2
    cache.prepare_load([A])
    cache.complete_store([C, B, A], success=False)  # A is ready: untouched
    assert cache.lookup(B) is MISS and cache.lookup(C) is MISS
    assert cache.ref_count(A) == 1
    assert (cache.num_free_slots, cache.num_pending) == (2, 0)
    # C's slot (2) was freed first, then B's (1): B's comes back first.
    assert cache.prepare_store([D, E]) == StoreReservation((D, E), (1, 2), ())
    cache.check_invariants()


def test_prepare_load_asserts_like_vllm_but_changes_nothing() -> None:
    cache = lru(4)
    stored(cache, A, B)
    cache.prepare_store([C])
    cache.take_events()

    with pytest.raises(CacheAssertion) as missing:
        cache.prepare_load([A, k(479, 1), C])
    assert missing.value.key == k(479, 1)
    assert missing.value.reason == "missing_chunk"
    assert missing.value.message == "chunk (h=479, group=1) not found in CPU cache"
    assert str(missing.value) == missing.value.message

    with pytest.raises(CacheAssertion) as pending:
        cache.prepare_load([B, C, k(479, 1)])  # the first failing key decides
    assert pending.value.key == C
    assert pending.value.reason == "chunk_not_ready"

    # Deliberately unlike vLLM: A and B were not pinned by the failed calls.
    assert cache.ref_count(A) == 0 and cache.ref_count(B) == 0
    assert cache.num_evictable == 2 and cache.take_events() == []
    assert eviction_order(cache) == [A, B]


def test_prepare_load_of_nothing_is_a_no_op() -> None:
    cache = lru(1)
    assert cache.prepare_load([]) == ()
    assert cache.take_events() == []


def test_complete_load_misuse_is_a_simulator_bug() -> None:
    cache = lru(3)
    stored(cache, A, B)
    cache.prepare_load([A])
    with pytest.raises(CacheInvariantError):
        cache.complete_load([A, C])  # C absent
    with pytest.raises(CacheInvariantError):
        cache.complete_load([A, B])  # B is not being loaded
    assert cache.ref_count(A) == 1  # nothing changed by the failed calls
    cache.complete_load([A])
    with pytest.raises(CacheInvariantError):
        cache.complete_load([A])


def test_a_key_may_appear_only_once_per_call() -> None:
    cache = lru(3)
    with pytest.raises(ValueError, match="more than once"):
        cache.prepare_store([A, A])
    assert cache.num_used == 0
    stored(cache, A)
    with pytest.raises(ValueError, match="more than once"):
        cache.prepare_load([A, A])
    assert cache.ref_count(A) == 0
    cache.prepare_load([A])
    with pytest.raises(ValueError, match="more than once"):
        cache.complete_load([A, A])
    assert cache.ref_count(A) == 1


def test_events_are_typed_ordered_and_drained() -> None:
    cache = lru(2)
    cache.prepare_store([A, B])
    cache.complete_store([B, A])
    cache.prepare_load([A])
    cache.complete_load([A])
    cache.prepare_store([C])  # evicts B, the least recent
    cache.complete_store([C], success=False)
    assert cache.take_events() == [
        ChunksStored((B, A)),
        LoadStarted((A,)),
        LoadCompleted((A,)),
        ChunksEvicted((B,)),
        StoreCancelled((C,)),
    ]
    assert cache.take_events() == []


def test_reset_drops_everything_and_numbers_slots_from_zero_again() -> None:
    cache = lru(3)
    stored(cache, A, B)
    cache.prepare_store([C])
    cache.prepare_load([A])
    cache.mark_uncertain([D])
    cache.take_events()
    cache.reset()
    assert list(cache.keys()) == []
    assert (cache.num_used, cache.num_free_slots) == (0, 3)
    assert (cache.num_pending, cache.num_ready, cache.num_loading) == (0, 0, 0)
    assert cache.lookup(D) is MISS
    assert cache.take_events() == []
    assert stored(cache, D, E).slots == (0, 1)
    cache.check_invariants()


def test_uncertain_keys_answer_retry_until_stored_or_cleared() -> None:
    cache = lru(2)
    stored(cache, A)
    cache.mark_uncertain([A, B, C])
    assert cache.lookup(A) is HIT  # present: the mark does not matter
    assert cache.lookup(B) is RETRY and cache.lookup(C) is RETRY
    assert cache.state(B) is ChunkState.MISSING
    plan = cache.prepare_store([B])
    assert plan is not None and plan.keys == (B,)
    assert cache.lookup(B) is HIT_PENDING
    cache.complete_store([B, C])  # naming C clears it even though it is absent
    assert cache.lookup(C) is MISS
    # B was unmarked when stored: once evicted it is a plain miss.
    cache.touch([A])
    assert cache.prepare_store([D]) == StoreReservation((D,), (1,), (B,))
    assert cache.lookup(B) is MISS
    cache.mark_uncertain([E])
    cache.clear_uncertain([E, F])
    assert cache.lookup(E) is MISS


def test_failed_prepare_store_keeps_the_retry_mark() -> None:
    cache = lru(1)
    cache.prepare_store([A])
    cache.mark_uncertain([B])
    assert cache.prepare_store([B]) is None
    assert cache.lookup(B) is RETRY


def test_zero_capacity_cache_stores_nothing() -> None:
    cache = lru(0)
    assert cache.prepare_store([A]) is None
    assert cache.prepare_store([]) == StoreReservation((), (), ())
    cache.check_invariants()


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        CpuChunkCache(-1)
    with pytest.raises(ValueError):
        CpuChunkCache(1, store_threshold=-1)
    with pytest.raises(ValueError):
        CpuChunkCache(1, tracker_size=0)
    assert CpuChunkCache(1, EvictionPolicy("arc")).policy is EvictionPolicy.ARC


def test_check_invariants_detects_a_corrupted_counter() -> None:
    cache = lru(2)
    stored(cache, A)
    cache.check_invariants()
    cache._num_ready += 1
    with pytest.raises(CacheInvariantError, match="ready counter"):
        cache.check_invariants()


# ----------------------------------------------------------------- capacity


def test_capacity_from_bytes_spec_example() -> None:
    # Spec §8.4 / §6: one KV head of size 1, fp32, one layer per group and
    # block sizes 256 / 64 / 8: a page is 2 (K and V) * 4 bytes * block size.
    per_group = [2 * 4 * bs for bs in (256, 64, 8)]
    assert per_group == [2048, 512, 64]
    kv_bytes_per_block = sum(per_group)  # one block index across all tensors: 2624
    # bpc = 4: 10496 bytes per chunk, rounded up to whole 4 KiB pages: 3 pages.
    slot = 3 * 4096
    assert 2 * 4096 < kv_bytes_per_block * 4 <= slot
    cpu_bytes = 1 << 20
    assert capacity_from_bytes(cpu_bytes, kv_bytes_per_block, 4) == cpu_bytes // slot == 85


def test_capacity_from_bytes_copies_and_alignment() -> None:
    # 2 workers * 1000 bytes * 2 blocks = 4000 -> one page of 4096.
    assert capacity_from_bytes(4096 * 10, 1000, 2, copies=2) == 10
    assert capacity_from_bytes(4096 * 10 - 1, 1000, 2, copies=2) == 9
    # Exactly a page is not rounded further; a custom page size is honoured.
    assert capacity_from_bytes(8192, 2048, 2) == 2
    assert capacity_from_bytes(1000, 10, 1, page_bytes=100) == 10
    assert capacity_from_bytes(100, 4096, 1) == 0


@pytest.mark.parametrize("bad", range(5))
def test_capacity_from_bytes_rejects_non_positive_inputs(bad: int) -> None:
    args = [1 << 20, 1024, 4, 1, 4096]
    args[bad] = 0
    with pytest.raises(ValueError, match="must be positive"):
        capacity_from_bytes(*args)


# ---------------------------------------------------------- admission filter


def test_store_threshold_two_stores_a_key_on_its_second_offer() -> None:
    cache = lru(4, store_threshold=2)
    assert cache.prepare_store([A, B]) == StoreReservation((), (), ())
    assert cache.lookup(A) is MISS
    assert cache.prepare_store([B, C]) == StoreReservation((B,), (0,), ())
    assert cache.prepare_store([A, C]) == StoreReservation((A, C), (1, 2), ())
    # Later offers of an admitted key are harmless: present keys are dropped.
    assert cache.prepare_store([A, B]) == StoreReservation((), (), ())


def test_store_threshold_counts_offers_even_when_the_store_fails() -> None:
    cache = lru(1, store_threshold=2)
    stored(cache, A)
    stored(cache, A)  # admitted and stored on the second offer
    cache.prepare_load([A])
    assert cache.prepare_store([B]) == StoreReservation((), (), ())
    assert cache.prepare_store([B]) is None  # admitted, but no room
    cache.complete_load([A])
    assert cache.prepare_store([B]) == StoreReservation((B,), (0,), (A,))


def test_store_threshold_tracker_forgets_the_least_recently_offered_key() -> None:
    cache = lru(8, store_threshold=2, tracker_size=2)
    cache.prepare_store([A])
    cache.prepare_store([B])
    cache.prepare_store([C])  # tracker full: A is forgotten
    # A is new again (count 1; B, now least recently offered, makes room).
    assert cache.prepare_store([A]) == StoreReservation((), (), ())
    assert store_plan(cache, A).keys == (A,)
    # C survived (count 2 now, admitted); B is new again and takes A's place.
    assert store_plan(cache, B, C).keys == (C,)
    assert store_plan(cache, B).keys == (B,)
    cache.check_invariants()


def test_store_threshold_tracker_never_drops_keys_of_the_same_offer() -> None:
    cache = lru(8, store_threshold=2, tracker_size=2)
    cache.prepare_store([A, B])
    # A and B are refreshed by this offer (count 2, admitted) and protected;
    # C finds the tracker full of protected keys and is not tracked at all.
    assert store_plan(cache, A, B, C).keys == (A, B)
    assert cache.prepare_store([C]) == StoreReservation((), (), ())  # first counted offer
    # C took A's place (A is LRU among unprotected); D replaces B, and the
    # tracker then holds only C and D.
    assert store_plan(cache, C, D).keys == (C,)


# --------------------------------------------------------------- ARC narratives


def test_arc_new_chunks_enter_t1_and_a_touch_promotes_only_ready_ones() -> None:
    cache = arc(4)
    stored(cache, A, B)
    cache.prepare_store([C])  # pending
    assert arc_lists(cache) == ([A, B, C], [], [], [])
    cache.touch([A, B, C])  # backwards: C stays in T1 (newest), then B, A go to T2
    assert arc_lists(cache) == ([C], [B, A], [], [])
    cache.touch([B])
    assert arc_lists(cache) == ([C], [A, B], [], [])
    cache.touch([k(99)])  # neither cached nor a ghost: nothing happens
    assert arc_lists(cache) == ([C], [A, B], [], [])
    assert arc_p(cache) == 0.0


def test_arc_loads_do_not_move_chunks() -> None:
    cache = arc(3)
    stored(cache, A, B)
    cache.prepare_load([A])
    cache.complete_load([A])
    assert arc_lists(cache) == ([A, B], [], [], [])


def test_arc_evicts_from_t1_while_it_is_at_least_p_and_remembers_ghosts() -> None:
    cache = arc(2)
    stored(cache, A, B)
    cache.touch([A])  # T1 [B], T2 [A]
    # p = 0: len(T1) = 1 >= 0, so T1's oldest idle chunk goes, to B1.
    assert cache.prepare_store([C]) == StoreReservation((C,), (1,), (B,))
    assert arc_lists(cache) == ([C], [A], [B], [])
    # T1 holds only pending C: fall through to T2.
    assert cache.prepare_store([D]) == StoreReservation((D,), (0,), (A,))
    assert arc_lists(cache) == ([C, D], [], [B], [A])


def test_arc_ghost_hits_move_p_by_the_ratio_of_the_ghost_lists() -> None:
    x1, x2, x3, y1, y2, y3, z1, z2 = (k(h) for h in range(10, 18))
    cache = arc(3)
    stored(cache, x1, x2, x3)
    for key in (x1, x2, x3):
        cache.touch([key])
    assert arc_lists(cache) == ([], [x1, x2, x3], [], [])
    stored(cache, y1, y2, y3)  # T1 empty: all three victims come from T2
    assert arc_lists(cache) == ([y1, y2, y3], [], [], [x1, x2, x3])
    stored(cache, z1, z2)  # len(T1) = 3 >= int(0): from T1
    assert arc_lists(cache) == ([y3, z1, z2], [], [y1, y2], [x1, x2, x3])

    cache.touch([y1])  # B1 hit: p += max(1, |B2| / |B1|) = 3 / 2
    assert arc_p(cache) == 1.5
    assert arc_lists(cache)[2] == [y2, y1]  # refreshed in B1
    cache.touch([x1])  # B2 hit: p -= max(1, |B1| / |B2|) = max(1, 2 / 3) = 1
    assert arc_p(cache) == 0.5
    assert arc_lists(cache)[3] == [x2, x3, x1]
    cache.touch([x2, x3])  # two more B2 hits: floored at 0
    assert arc_p(cache) == 0.0
    for _ in range(5):
        cache.touch([y2])  # B1 hits: + max(1, 3 / 2) each, capped at capacity
    assert arc_p(cache) == 3.0
    cache.check_invariants()


def test_arc_evicts_from_t2_when_t1_is_below_its_target() -> None:
    cache = arc(2)
    stored(cache, A, B)
    stored(cache, C)  # evicts A from T1
    assert arc_lists(cache) == ([B, C], [], [A], [])
    cache.touch([A])  # p = 1
    cache.touch([C])  # T2 [C]
    stored(cache, D)  # len(T1) = 1 >= int(1): B from T1
    assert arc_lists(cache) == ([D], [C], [A, B], [])
    cache.touch([A])  # p = 2
    assert arc_p(cache) == 2.0
    assert arc_lists(cache)[2] == [B, A]
    # len(T1) = 1 < 2: the victim is C from T2 although D in T1 is idle.
    assert cache.prepare_store([E]) == StoreReservation((E,), (0,), (C,))
    assert arc_lists(cache) == ([D, E], [], [B, A], [C])
    cache.touch([C])  # B2 hit: p -= max(1, |B1| / |B2|) = 2
    assert arc_p(cache) == 0.0


def test_arc_falls_back_to_t1_when_t2_has_no_idle_chunk() -> None:
    cache = arc(3)
    stored(cache, A, B, C)
    stored(cache, D)  # evicts A
    for _ in range(3):
        cache.touch([A])
    assert arc_p(cache) == 3.0
    cache.touch([C])  # T1 [B, D], T2 [C]
    cache.prepare_load([C])  # T2's only chunk is pinned
    # len(T1) = 2 < 3, T2 has no idle chunk: vLLM 0.30 falls back to T1.
    assert cache.prepare_store([E]) == StoreReservation((E,), (1,), (B,))


def test_arc_of_vllm_0_29_refuses_instead_of_falling_back_to_t1() -> None:
    """vLLM 0.29's ARC (the OLD profile, ``arc_t1_last_resort = False``) has no
    last resort: with T1 below its target and T2's only chunk pinned, the
    eviction is refused, so the store is (the same set-up as the test above)."""
    assert profile("old").arc_t1_last_resort is False
    assert profile("new").arc_t1_last_resort and profile("latest").arc_t1_last_resort
    cache = CpuChunkCache(3, EvictionPolicy.ARC, arc_t1_last_resort=False)
    stored(cache, A, B, C)
    stored(cache, D)  # evicts A (T1 is at its target 0)
    for _ in range(3):
        cache.touch([A])
    cache.touch([C])
    cache.prepare_load([C])
    assert cache.prepare_store([E]) is None
    assert arc_lists(cache)[:2] == ([B, D], [C])   # nothing moved
    cache.check_invariants()


def test_arc_t1_size_counts_pinned_chunks() -> None:
    cache = arc(4)
    stored(cache, A, B, C, D)  # slots 0..3
    cache.touch([A])
    cache.touch([B])  # T1 [C, D], T2 [A, B]
    stored(cache, E)  # evicts C; E takes slot 2; T1 [D, E]
    cache.touch([C])
    cache.touch([C])  # two B1 hits: p = 2
    cache.prepare_load([D])
    # len(T1) = 2 counts the pinned D, so 2 >= int(p): T1's idle E goes first;
    # T1 is then virtually 1 < 2 long and the second victim is T2's oldest, A.
    # Freed [2, 0]; the free list is popped from its end.
    assert cache.prepare_store([F, G]) == StoreReservation((F, G), (0, 2), (E, A))
    assert arc_lists(cache) == ([D, F, G], [B], [C, E], [A])


def test_arc_ghost_lists_are_trimmed_to_capacity() -> None:
    cache = arc(2)
    stored(cache, A, B)
    stored(cache, C, D)
    assert arc_lists(cache) == ([C, D], [], [A, B], [])
    stored(cache, E)  # C joins B1, A (oldest ghost) is dropped
    assert arc_lists(cache) == ([D, E], [], [B, C], [])
    cache.touch([A])  # no longer a ghost: p unchanged
    assert arc_p(cache) == 0.0
    cache.check_invariants()


def test_arc_reinserting_a_ghost_removes_it_from_the_ghost_list() -> None:
    cache = arc(2)
    stored(cache, A, B)
    cache.prepare_store([C])  # evicts A
    cache.complete_store([C], success=False)  # and frees a slot again
    assert arc_lists(cache) == ([B], [], [A], [])
    stored(cache, A)
    assert arc_lists(cache) == ([B, A], [], [], [])


def test_arc_protected_and_pending_chunks_are_skipped() -> None:
    cache = arc(2)
    stored(cache, A)
    cache.prepare_store([B])
    assert cache.prepare_store([A, C]) is None  # A protected, B pending
    assert cache.prepare_store([C]) == StoreReservation((C,), (0,), (A,))


def test_arc_failed_store_leaves_no_ghost() -> None:
    cache = arc(2)
    cache.prepare_store([A])
    cache.complete_store([A], success=False)
    assert arc_lists(cache) == ([], [], [], [])


def test_arc_reset_forgets_ghosts_and_target() -> None:
    cache = arc(1)
    stored(cache, A)
    stored(cache, B)
    cache.touch([A])
    assert arc_p(cache) == 1.0
    cache.reset()
    assert arc_lists(cache) == ([], [], [], [])
    assert arc_p(cache) == 0.0


# ------------------------------------------------------- stateful property tests

KEYS = [k(h, h % 2) for h in range(10)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=5, unique=True)
nonempty_key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True)


class LruCacheMachine(RuleBasedStateMachine):
    """Random operations against a naive model: dicts, plain lists, linear scans."""

    policy = EvictionPolicy.LRU

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0
        self.cache = CpuChunkCache(0)
        self.ref: dict[OffloadKey, int] = {}
        self.slots: dict[OffloadKey, int] = {}
        self.recency: list[OffloadKey] = []  # ready keys, next victim first (LRU only)
        self.handed_out = 0
        self.free: list[int] = []
        self.loads: list[list[OffloadKey]] = []  # load jobs in flight
        self.jobs: list[list[OffloadKey]] = []  # store jobs prepared, maybe in flight

    @initialize(
        capacity=st.integers(min_value=1, max_value=6),
        prefill=st.lists(st.sampled_from(KEYS), unique=True, max_size=6),
    )
    def start(self, capacity: int, prefill: list[OffloadKey]) -> None:
        # Start from a random set of READY chunks: hypothesis' swarm testing
        # disables some rules per example, and an empty cache would make many
        # examples vacuous.
        self.capacity = capacity
        self.cache = self.make_cache(capacity)
        if prefill:
            self.prepare_store(prefill[:capacity])
            self.complete_store_job(0, True)

    # -- model helpers

    def make_cache(self, capacity: int) -> CpuChunkCache:
        return CpuChunkCache(capacity, self.policy)

    def choose_victims(self, need: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        victims = [key for key in self.recency if key not in protected][:need]
        return victims if len(victims) == need else None

    def check_victims(
        self, victims: Sequence[OffloadKey], need: int, protected: set[OffloadKey]
    ) -> None:
        assert list(victims) == self.choose_victims(need, protected)

    def make_ready(self, key: OffloadKey) -> None:
        self.ref[key] = 0
        self.recency.append(key)

    # -- rules

    @rule(keys=nonempty_key_lists)
    def prepare_store(self, keys: list[OffloadKey]) -> None:
        plan = self.cache.prepare_store(keys)
        to_store = [key for key in keys if key not in self.ref]
        free = self.capacity - len(self.ref)
        need = len(to_store) - free
        ready = [key for key, ref in self.ref.items() if ref == 0]
        if need > 0:
            possible = [key for key in ready if key not in keys]
            if len(possible) < need:
                assert plan is None
                return
        assert plan is not None
        assert list(plan.keys) == to_store
        if need > 0:
            self.check_victims(plan.evicted, need, set(keys))
        else:
            assert plan.evicted == ()
        for key in plan.evicted:
            assert self.ref[key] == 0
            self.free.append(self.slots.pop(key))
            del self.ref[key]
            if key in self.recency:
                self.recency.remove(key)
        expected_slots = []
        for key in to_store:
            if self.handed_out < self.capacity:
                slot = self.handed_out
                self.handed_out += 1
            else:
                slot = self.free.pop()
            expected_slots.append(slot)
            self.slots[key] = slot
            self.ref[key] = -1
        assert list(plan.slots) == expected_slots
        if plan.keys:
            self.jobs.append(list(plan.keys))

    @precondition(lambda self: bool(self.jobs))
    @rule(index=st.integers(min_value=0, max_value=50), success=st.sampled_from([True] * 5 + [False]))
    def complete_store_job(self, index: int, success: bool) -> None:
        self.complete_store(self.jobs.pop(index % len(self.jobs)), success)

    @rule(keys=key_lists, success=st.booleans())
    def complete_store(self, keys: list[OffloadKey], success: bool) -> None:
        self.cache.complete_store(keys, success=success)
        for key in keys:
            if self.ref.get(key) != -1:
                continue
            if success:
                self.make_ready(key)
            else:
                del self.ref[key]
                self.free.append(self.slots.pop(key))

    @precondition(lambda self: 0 in self.ref.values())
    @rule(data=st.data())
    def prepare_load_ready(self, data: st.DataObject) -> None:
        ready = sorted(key for key, ref in self.ref.items() if ref >= 0)
        self.prepare_load(data.draw(st.lists(st.sampled_from(ready), unique=True, min_size=1, max_size=4)))

    @rule(keys=key_lists)
    def prepare_load(self, keys: list[OffloadKey]) -> None:
        bad = next((key for key in keys if self.ref.get(key, -1) < 0), None)
        if bad is not None:
            before = dict(self.ref)
            try:
                self.cache.prepare_load(keys)
            except CacheAssertion as error:
                assert error.key == bad
                expected = "missing_chunk" if bad not in self.ref else "chunk_not_ready"
                assert error.reason == expected
            else:
                raise AssertionError("prepare_load should have raised")
            assert {key: self.cache.ref_count(key) for key in before} == before
            return
        slots = self.cache.prepare_load(keys)
        assert list(slots) == [self.slots[key] for key in keys]
        for key in keys:
            if self.ref[key] == 0 and key in self.recency:
                self.recency.remove(key)
            self.ref[key] += 1
        if keys:
            self.loads.append(keys)

    @precondition(lambda self: bool(self.loads))
    @rule(index=st.integers(min_value=0, max_value=50))
    def complete_load(self, index: int) -> None:
        keys = self.loads.pop(index % len(self.loads))
        self.cache.complete_load(keys)
        for key in keys:
            self.ref[key] -= 1
            if self.ref[key] == 0:
                self.recency.append(key)

    @precondition(lambda self: bool(self.ref))
    @rule(data=st.data())
    def touch_present(self, data: st.DataObject) -> None:
        present = sorted(self.ref)
        self.touch(data.draw(st.lists(st.sampled_from(present), min_size=1, max_size=6)))

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def touch(self, keys: list[OffloadKey]) -> None:
        self.cache.touch(keys)
        for key in reversed(keys):
            if key in self.recency:
                self.recency.remove(key)
                self.recency.append(key)

    @rule(roll=st.integers(min_value=0, max_value=9))
    def reset(self, roll: int) -> None:
        if roll != 0:  # keep resets rare, or the cache rarely fills up
            return
        self.cache.reset()
        self.ref.clear()
        self.slots.clear()
        self.recency.clear()
        self.free.clear()
        self.handed_out = 0
        self.loads.clear()
        self.jobs.clear()

    # -- checks after every step

    @invariant()
    def states_agree(self) -> None:
        cache = self.cache
        for key in KEYS:
            ref = self.ref.get(key)
            assert cache.ref_count(key) == ref
            assert cache.slot(key) == self.slots.get(key)
            if ref is None:
                assert cache.lookup(key) is MISS
            else:
                assert cache.lookup(key) is (HIT_PENDING if ref < 0 else HIT)
        refs = list(self.ref.values())
        assert cache.num_pending == refs.count(-1)
        assert cache.num_ready == cache.num_evictable == refs.count(0)
        assert cache.num_loading == sum(1 for ref in refs if ref > 0)
        assert cache.num_used == len(refs) <= self.capacity
        assert cache.num_free_slots == self.capacity - len(refs)
        assert len(set(self.slots.values())) == len(self.slots)
        cache.check_invariants()

    @invariant()
    def eviction_order_agrees(self) -> None:
        if self.policy is EvictionPolicy.LRU:
            assert eviction_order(self.cache) == self.recency


class ArcCacheMachine(LruCacheMachine):
    """The same model for ARC: any victims are accepted if they are legal."""

    policy = EvictionPolicy.ARC

    def check_victims(
        self, victims: Sequence[OffloadKey], need: int, protected: set[OffloadKey]
    ) -> None:
        assert len(victims) == len(set(victims)) == need
        for key in victims:
            assert self.ref.get(key) == 0 and key not in protected


MACHINE_SETTINGS = settings(
    max_examples=200, stateful_step_count=30, derandomize=True, deadline=None
)
TestLruCacheMachine = LruCacheMachine.TestCase
TestLruCacheMachine.settings = MACHINE_SETTINGS
TestArcCacheMachine = ArcCacheMachine.TestCase
TestArcCacheMachine.settings = MACHINE_SETTINGS


# ------------------------------------------------------------------ Belady


class FakeFuture:
    """A hand-written oracle: next uses in a dict, moved by the test."""

    def __init__(self, uses: dict[OffloadKey, int] | None = None) -> None:
        self.uses = dict(uses or {})
        self.listeners: list = []

    def next_use(self, key: OffloadKey) -> int:
        return self.uses.get(key, NEVER)

    def subscribe(self, listener) -> None:  # type: ignore[no-untyped-def]
        self.listeners.append(listener)

    def move(self, **later: int) -> None:
        """Move next uses later (keys named by letter) and tell the listeners."""
        keys = [NAMED[name] for name in later]
        for key, nu in zip(keys, later.values(), strict=True):
            self.uses[key] = nu
        for listener in self.listeners:
            listener(keys)


NAMED = dict(zip("ABCDEFG", (A, B, C, D, E, F, G), strict=True))


def belady(capacity: int, future: FakeFuture) -> CpuChunkCache:
    return CpuChunkCache(capacity, EvictionPolicy.BELADY, future=future)


def test_belady_needs_an_oracle() -> None:
    with pytest.raises(ValueError, match="belady"):
        CpuChunkCache(2, EvictionPolicy.BELADY)


def test_belady_evicts_the_farthest_next_use_never_used_first() -> None:
    fut = FakeFuture({A: 5, B: 9, C: 2})          # D is never used again
    cache = belady(4, fut)
    stored(cache, A, B, C, D)
    assert eviction_order(cache) == [D, B, A, C]
    plan = store_plan(cache, E)
    assert plan.evicted == (D,)
    cache.complete_store([E])                      # E: never used
    assert store_plan(cache, F, G).evicted == (E, B)


def test_belady_ties_go_to_the_key_ranked_last() -> None:
    fut = FakeFuture({A: 3, B: 3, C: 3})
    cache = belady(3, fut)
    stored(cache, B, A)                 # one store: ranked in offer order, B then A
    stored(cache, C)
    assert eviction_order(cache) == [C, A, B]


def test_belady_reranks_when_the_oracle_moves_a_next_use() -> None:
    fut = FakeFuture({A: 1, B: 2, C: 3})
    cache = belady(3, fut)
    stored(cache, A, B, C)
    assert eviction_order(cache) == [C, B, A]
    fut.move(A=10)                                  # A's use at 1 was consumed
    assert eviction_order(cache) == [A, C, B]
    assert store_plan(cache, D).evicted == (A,)
    cache.check_invariants()


def test_belady_never_evicts_pending_loading_or_protected_chunks() -> None:
    fut = FakeFuture({A: 1, B: 2})                  # C, D: never again
    cache = belady(4, fut)
    stored(cache, A, B, C)
    cache.prepare_load([C])                         # C loading
    store_plan(cache, D)                            # D pending
    assert store_plan(cache, E, B).evicted == (A,)  # B offered: protected
    assert cache.prepare_store([F, G]) is None      # only B is idle now... and C, D are not
    cache.complete_load([C])
    fut.move(B=7)
    assert cache.prepare_store([F, B]) is not None
    cache.check_invariants()


def test_belady_touch_changes_nothing() -> None:
    fut = FakeFuture({A: 1, B: 2})
    cache = belady(2, fut)
    stored(cache, A, B)
    cache.touch([B, A])
    assert eviction_order(cache) == [B, A]


def test_belady_invariants_catch_a_lost_ranking() -> None:
    fut = FakeFuture({A: 1})
    cache = belady(2, fut)
    stored(cache, A)
    policy = cache._policy
    assert isinstance(policy, BeladyPolicy)
    policy._idle.clear()
    with pytest.raises(CacheInvariantError, match="Belady"):
        cache.check_invariants()


class BeladyCacheMachine(LruCacheMachine):
    """The same model for Belady, with an oracle the machine moves: any legal
    victims are accepted if no eligible key left behind has a farther next use."""

    policy = EvictionPolicy.BELADY

    def make_cache(self, capacity: int) -> CpuChunkCache:
        self.future = FakeFuture({key: 10 * i for i, key in enumerate(KEYS) if i % 3})
        return CpuChunkCache(capacity, self.policy, future=self.future)

    @rule(index=st.integers(min_value=0, max_value=len(KEYS) - 1), step=st.integers(1, 40))
    def consume(self, index: int, step: int) -> None:
        key = KEYS[index]
        now = self.future.uses.get(key)
        if now is not None:
            self.future.uses[key] = now + step
            for listener in self.future.listeners:
                listener([key])

    def check_victims(
        self, victims: Sequence[OffloadKey], need: int, protected: set[OffloadKey]
    ) -> None:
        assert len(victims) == len(set(victims)) == need
        for key in victims:
            assert self.ref.get(key) == 0 and key not in protected
        left = [key for key, ref in self.ref.items()
                if ref == 0 and key not in protected and key not in victims]
        nearest_victim = min(self.future.next_use(key) for key in victims)
        assert all(self.future.next_use(key) <= nearest_victim for key in left)


TestBeladyCacheMachine = BeladyCacheMachine.TestCase
TestBeladyCacheMachine.settings = MACHINE_SETTINGS
