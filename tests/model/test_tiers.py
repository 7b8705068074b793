"""The tiered CPU manager (:mod:`sim.model.tiers`), as narratives: cascade on
store, promotion on lookup (HIT_PENDING meanwhile), GPU loads from the CPU tier
only, tier eviction, and the counters named after vLLM's tiering metrics."""

from __future__ import annotations

import pytest

from sim.model.cpu_cache import CacheAssertion, ChunkState, EvictionPolicy, LookupResult, OffloadKey
from sim.model.tiers import TieredCache, TierSpec

HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
A, B, C, D = ((h, 0) for h in range(1, 5))


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
