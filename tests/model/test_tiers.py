"""The tiered CPU manager (:mod:`sim.model.tiers`), as narratives: cascade on
store, promotion on lookup (HIT_PENDING meanwhile), GPU loads from the CPU tier
only, tier eviction, and the counters named after vLLM's tiering metrics."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sim.model.cpu_cache import (
    CacheAssertion,
    ChunkState,
    EvictionPolicy,
    LookupResult,
    OffloadKey,
    offload_key,
)
from sim.model.tiers import TieredCache, TierSpec

HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
A, B, C, D = (offload_key(h, 0) for h in range(1, 5))
#: promotions seen by the state machine (to check it exercises them)
PROMOTIONS: list[int] = []


def tiered(cpu: int, *tiers: TierSpec) -> TieredCache:
    return TieredCache(cpu, tiers=tiers or (TierSpec("nvme"),))


def store(cache: TieredCache, *keys: OffloadKey) -> None:
    """A GPU->CPU store job, completed."""
    assert cache.prepare_store(keys) is not None
    cache.complete_store(keys)


def finish_all(cache: TieredCache) -> list:
    done = []
    for job in cache.take_jobs():
        cache.complete_job(job.job_id)
        done.append((job.tier, job.keys, job.is_promotion))
    return done


def test_a_completed_store_is_cascaded_to_every_tier_pinning_the_cpu_chunks() -> None:
    cache = tiered(4, TierSpec("nvme"), TierSpec("object"))
    store(cache, A, B)
    assert cache.state(A) is ChunkState.LOADING and cache.ref_count(A) == 2   # pinned by two cascades
    jobs = cache.take_jobs()
    assert [(j.tier, j.keys, j.is_promotion) for j in jobs] == [(0, (A, B), False), (1, (A, B), False)]
    assert cache.tiers[0].state(A) is ChunkState.PENDING          # not readable in the tier yet
    cache.complete_job(jobs[0].job_id)
    assert cache.tiers[0].state(A) is ChunkState.READY and cache.ref_count(A) == 1
    cache.complete_job(jobs[1].job_id)
    assert cache.state(A) is ChunkState.READY
    assert [c.write_chunks for c in cache.counters] == [2, 2]
    assert [c.cascade_jobs for c in cache.counters] == [1, 1]
    cache.check_invariants()


def test_a_failed_store_cascades_nothing() -> None:
    cache = tiered(2)
    assert cache.prepare_store([A]) is not None
    cache.complete_store([A], success=False)
    assert cache.take_jobs() == []


def test_a_chunk_only_in_a_tier_is_promoted_while_the_lookup_answers_hit_pending() -> None:
    cache = tiered(1)
    store(cache, A)
    finish_all(cache)
    store(cache, B)                                  # evicts A from the 1-slot CPU tier
    finish_all(cache)
    assert cache.state(A) is ChunkState.MISSING and cache.tiers[0].state(A) is ChunkState.READY
    assert cache.lookup(A) is HIT_PENDING            # promotion started: B evicted for it
    assert cache.state(A) is ChunkState.PENDING and cache.tiers[0].state(A) is ChunkState.LOADING
    assert cache.lookup(A) is HIT_PENDING            # asking again starts nothing new
    with pytest.raises(CacheAssertion, match="not ready"):
        cache.prepare_load([A])                      # never straight from the tier to GPU
    cache.check_invariants()
    [job] = cache.take_jobs()
    assert (job.tier, job.keys, job.is_promotion) == (0, (A,), True)
    cache.complete_job(job.job_id)
    assert cache.lookup(A) is HIT and cache.tiers[0].state(A) is ChunkState.READY
    assert cache.take_jobs() == []                   # a promoted chunk is not cascaded back
    cache.prepare_load([A])
    c = cache.counters[0]
    assert (c.promotion_jobs, c.read_chunks, c.promoted_chunks_loaded) == (1, 1, 1)


def test_a_hit_is_split_over_its_loads_chunks_resident_or_promoted() -> None:
    cache = tiered(2)
    store(cache, A)
    finish_all(cache)
    store(cache, B)
    finish_all(cache)
    store(cache, C)                                  # evicts A from the 2-slot CPU tier
    finish_all(cache)
    assert cache.lookup(A) is HIT_PENDING            # promoted (evicting B) ...
    finish_all(cache)
    cache.prepare_load([A, C])                       # ... then loaded with C, resident
    cache.attribute_hit(48)                          # a hit of 48 tokens on that load
    assert (cache.counters[0].promoted_hit_tokens, cache.resident_hit_tokens) == (24.0, 24.0)
    cache.complete_load([A, C])
    cache.prepare_load([A])                          # A again: resident now
    cache.attribute_hit(16)
    assert (cache.counters[0].promoted_hit_tokens, cache.resident_hit_tokens) == (24.0, 40.0)
    cache.attribute_hit(8)                           # no load recorded: counted resident
    assert cache.resident_hit_tokens == 48.0


def test_a_promotion_with_no_cpu_room_is_a_miss() -> None:
    cache = tiered(1)
    store(cache, A)
    finish_all(cache)
    store(cache, B)
    finish_all(cache)
    cache.prepare_load([B])                          # B pinned: nothing to evict
    assert cache.lookup(A) is MISS
    assert cache.promotion_allocation_failures == 1
    assert cache.take_jobs() == []


def test_promotions_of_one_step_are_one_job_per_tier() -> None:
    cache = tiered(2, TierSpec("nvme"), TierSpec("network"))
    store(cache, A, B)
    finish_all(cache)
    store(cache, C, D)                               # A, B evicted from the CPU tier
    finish_all(cache)
    assert cache.lookup(A) is HIT_PENDING and cache.lookup(B) is HIT_PENDING
    jobs = cache.take_jobs()
    assert [(j.tier, j.keys) for j in jobs] == [(0, (A, B))]   # the first tier holding them serves
    cache.check_invariants()


def test_a_bounded_tier_evicts_with_its_own_policy() -> None:
    cache = tiered(4, TierSpec("nvme", capacity_chunks=2, policy=EvictionPolicy.LRU))
    store(cache, A)
    finish_all(cache)
    store(cache, B)
    finish_all(cache)
    store(cache, C)
    finish_all(cache)
    assert cache.tiers[0].state(A) is ChunkState.MISSING and cache.counters[0].evictions == 1


def test_chunk_queries_are_counted_once_per_request_and_tier() -> None:
    cache = tiered(1)
    store(cache, A)
    finish_all(cache)
    store(cache, B)
    finish_all(cache)
    cache.begin_lookup("r1")
    for _ in range(3):                               # the connector may ask several times
        cache.lookup(A)
        cache.lookup(C)
    cache.end_lookup("r1", definite=False)
    # CPU: A miss (then pending: not resolved), C miss; tier: A hit, C miss
    assert (cache.primary_queries, cache.primary_hits) == (2, 0)
    assert (cache.counters[0].chunk_queries, cache.counters[0].chunk_hits) == (2, 1)
    finish_all(cache)
    cache.begin_lookup("r1")
    assert cache.lookup(A) is HIT                    # resolved for r1 already: not counted again
    cache.end_lookup("r1", definite=True)            # (vLLM: until the request is allocated)
    assert (cache.primary_queries, cache.primary_hits) == (2, 0)
    cache.begin_lookup("r1")                         # asked again later (a preemption)
    cache.lookup(A)
    cache.end_lookup("r1", definite=True)
    assert (cache.primary_queries, cache.primary_hits) == (3, 1)


def test_touch_reaches_every_tier() -> None:
    cache = tiered(4, TierSpec("nvme", capacity_chunks=2))
    store(cache, A, B)
    finish_all(cache)
    cache.touch([A])                                 # A most recent in the tier too
    store(cache, C)
    finish_all(cache)
    assert cache.tiers[0].state(B) is ChunkState.MISSING and cache.tiers[0].state(A) is ChunkState.READY


def test_a_tiered_cache_needs_a_tier() -> None:
    with pytest.raises(ValueError, match="at least one"):
        TieredCache(4, tiers=())


# ------------------------------------------------------------------ random sequences

KEYS = [offload_key(h, 0) for h in range(8)]


class TieredMachine(RuleBasedStateMachine):
    """Random stores, lookups, loads, touches and job completions; after every step the
    tiers' invariants hold, a tier never holds more than its capacity, a tier only ever
    holds chunks that were stored to the CPU tier, and a GPU load of a chunk that is not
    readable in the CPU tier is refused (it is never read from a secondary tier)."""

    @initialize(cpu=st.integers(1, 4), cap=st.one_of(st.none(), st.integers(1, 5)),
                two=st.booleans(), policy=st.sampled_from([EvictionPolicy.LRU, EvictionPolicy.ARC]))
    def start(self, cpu: int, cap: int | None, two: bool, policy: EvictionPolicy) -> None:
        tiers = [TierSpec("nvme", cap, policy)] + ([TierSpec("object")] if two else [])
        self.cache = TieredCache(cpu, tiers=tiers)
        self.cap = cap
        self.stored_ever: set[OffloadKey] = set()
        self.gpu_stores: list[tuple[OffloadKey, ...]] = []
        self.loads: list[list[OffloadKey]] = []
        self.jobs: list[int] = []

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=3))
    def gpu_store(self, keys: list[OffloadKey]) -> None:
        res = self.cache.prepare_store(keys)
        if res is not None and res.keys:
            self.gpu_stores.append(res.keys)

    @precondition(lambda self: bool(self.gpu_stores))
    @rule(i=st.integers(0, 9), ok=st.sampled_from([True, True, True, False]))
    def gpu_store_done(self, i: int, ok: bool) -> None:
        keys = self.gpu_stores.pop(i % len(self.gpu_stores))
        self.cache.complete_store(keys, success=ok)
        if ok:
            self.stored_ever.update(keys)

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key: OffloadKey) -> None:
        was = self.cache.state(key)
        r = self.cache.lookup(key)
        if r is HIT_PENDING and was is ChunkState.MISSING:
            assert self.cache.state(key) is ChunkState.PENDING     # a promotion reserved a slot
            assert any(t.state(key) is ChunkState.LOADING for t in self.cache.tiers)
            PROMOTIONS.append(1)

    @rule()
    def end_of_step(self) -> None:
        self.jobs.extend(j.job_id for j in self.cache.take_jobs())

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=2))
    def store_and_settle(self, keys: list[OffloadKey]) -> None:
        """A whole store: GPU -> CPU, then cascaded to the tiers (a short cut to promotions)."""
        res = self.cache.prepare_store(keys)
        if res is not None and res.keys:
            self.cache.complete_store(res.keys)
            self.stored_ever.update(res.keys)
        self.settle()

    @rule()
    def settle(self) -> None:
        """End the step and let every tier job finish (cascades land, promotions arrive)."""
        self.end_of_step()
        while self.jobs:
            self.cache.complete_job(self.jobs.pop(0))

    @precondition(lambda self: bool(self.jobs))
    @rule(i=st.integers(0, 9))
    def job_done(self, i: int) -> None:
        self.cache.complete_job(self.jobs.pop(i % len(self.jobs)))

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=3))
    def gpu_load(self, keys: list[OffloadKey]) -> None:
        readable = all(self.cache.state(k) in (ChunkState.READY, ChunkState.LOADING) for k in keys)
        if readable:
            self.cache.prepare_load(keys)
            self.loads.append(keys)
        else:
            with pytest.raises(CacheAssertion):
                self.cache.prepare_load(keys)

    @precondition(lambda self: bool(self.loads))
    @rule(i=st.integers(0, 9))
    def gpu_load_done(self, i: int) -> None:
        self.cache.complete_load(self.loads.pop(i % len(self.loads)))

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def touch(self, keys: list[OffloadKey]) -> None:
        self.cache.touch(keys)

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        for i, tier in enumerate(self.cache.tiers):
            held = set(tier.keys())
            assert held <= self.stored_ever
            if i == 0 and self.cap is not None:
                assert len(held) <= self.cap


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=150, stateful_step_count=40, derandomize=True,
                                      deadline=None)


def test_seeded_random_walks_reach_promotions_and_keep_every_invariant() -> None:
    """The machine's rules driven by one seeded generator (deterministic, unlike a
    count of what hypothesis happened to draw): promotions are reached, so the
    machine's checks cover them."""
    rng = random.Random(0)
    before = len(PROMOTIONS)
    for _ in range(40):
        m = TieredMachine()
        m.start(cpu=rng.randint(1, 4), cap=rng.choice([None, 1, 3, 5]), two=rng.random() < 0.5,
                policy=rng.choice([EvictionPolicy.LRU, EvictionPolicy.ARC]))
        for _ in range(60):
            keys = rng.sample(KEYS, rng.randint(1, 2))
            pick = rng.randrange(8)
            if pick == 0:
                m.store_and_settle(keys)
            elif pick == 1:
                m.gpu_store(keys)
            elif pick == 2 and m.gpu_stores:
                m.gpu_store_done(rng.randrange(10), rng.random() < 0.8)
            elif pick == 3:
                m.settle()
            elif pick == 4:
                m.gpu_load(keys)
            elif pick == 5 and m.loads:
                m.gpu_load_done(rng.randrange(10))
            elif pick == 6:
                m.touch(keys)
            else:
                m.lookup(keys[0])
            m.consistent()
    assert len(PROMOTIONS) - before > 10


def test_after_every_job_completes_nothing_stays_pinned() -> None:
    cache = tiered(2, TierSpec("nvme"), TierSpec("network", capacity_chunks=1))
    store(cache, A, B)
    finish_all(cache)
    store(cache, C, D)
    finish_all(cache)
    assert cache.lookup(A) is HIT_PENDING
    finish_all(cache)
    assert cache.num_loading == cache.num_pending == 0 and cache.num_tier_jobs == 0
    assert all(t.num_loading == t.num_pending == 0 for t in cache.tiers)
    cache.check_invariants()
