"""Secondary storage tiers behind the CPU chunk cache (vLLM 0.33's TieringOffloadingManager).

What it models
    vLLM 0.30+ can put *secondary tiers* (a file system, an object store,
    peers, ...) behind the CPU ("primary") tier of the offloading connector
    (``vllm/v1/kv_offload/tiering/manager.py``). :class:`TieredCache` is that
    manager, clock-free, behind the interface of
    :class:`~sim.model.cpu_cache.CpuChunkCache` that the connector already
    uses (it *is* the primary tier, a subclass, plus the secondary tiers):

    * **cascade on store**: when a GPU->CPU store completes successfully, its
      chunks are written to *every* secondary tier: one cascade job per tier,
      which pins the chunks in the CPU tier (ref count + 1, as a GPU load
      does) until the write completes;
    * **promotion on lookup**: a lookup the CPU tier answers MISS asks the
      secondary tiers in order; the first that holds the chunk starts a
      promotion: a CPU slot is reserved at once (the chunk is PENDING, so a
      repeated lookup sees it in flight), the chunk is pinned in the tier,
      and the lookup answers HIT_PENDING, which makes the connector defer
      the request ("ask again next step"). If no CPU slot can be freed the
      answer is MISS (vLLM's ``promotion_allocation_failures``). The
      promotions queued during one scheduler step are handed out as one job
      per tier (:meth:`TieredCache.take_jobs`);
    * when a promotion completes, the chunk becomes READY in the CPU tier
      (it is not cascaded back) and the GPU load then reads it from the CPU
      tier: **a GPU load only ever reads the CPU tier**;
    * ``touch`` reaches every tier; CPU eviction (LRU / ARC / Belady) is
      unchanged.

    Each secondary tier keeps its own chunk states and eviction in a
    :class:`~sim.model.cpu_cache.CpuChunkCache` (a cascade is a store into
    it, a promotion a load from it); a tier without capacity never evicts.

    The counters are named after vLLM's ``vllm:kv_offload_tiering_*``
    metrics (``chunk_queries``, ``chunk_hits``, ``read_bytes``,
    ``write_bytes``, ``promotion_allocation_failures``, ...), per tier label
    ``"<index>:<kind>"`` with ``"0:primary"`` for the CPU tier, so a run can be
    set beside a real deployment's Prometheus figures.

What it simplifies or adds relative to vLLM 0.33
    * Tier kinds ``nvme``, ``network`` and ``object``, a tier *capacity* and a
      tier *eviction policy* are kvsim's own: vLLM's ``fs`` tier writes one
      file per chunk and never evicts (the disk fills up), its ``example``
      tier is an unbounded dict. A write a full tier cannot place (every
      chunk pinned by a promotion) is skipped for that tier and counted
      (``tier_store_rejections``, kvsim's own).
    * A secondary tier answers a lookup at once (vLLM's ``fs`` tier checks
      file existence on a background thread and answers RETRY until it
      knows): the tier's per-job latency stands for that delay, on the read.
    * A chunk is readable in a tier once its cascade write has completed;
      vLLM's example tier shows it at submission, its fs tier once the file
      exists.
    * Promotions are batched per tier and scheduler step, not per (tier,
      request): the CPU manager interface here carries no request context.
      Chunk queries and hits are counted once per (request, tier, key)
      while the request looks up (the connector names the request with
      :meth:`TieredCache.begin_lookup`), on HIT and MISS answers only, as
      vLLM does until the request is allocated.
    * No back-pressure detector (vLLM drops cascades to a slow tier), no
      request-level tiers, no job failures, no ``reset_cache`` hold, no
      peer-to-peer serving. A promotion the CPU tier's admission filter
      turns away is a MISS (vLLM would queue an empty job).
    * The torch copy path does not move tier data (a run refuses both).

Invariants (:meth:`TieredCache.check_invariants`)
    * the CPU tier's and every secondary tier's own invariants;
    * every job in flight holds its keys: a cascade pins them in the CPU tier
      (LOADING) and has reserved the tier slots of those the tier lacked
      (PENDING there); a promotion has reserved CPU slots (PENDING) and pins
      the chunks in its tier (LOADING);
    * queued promotions are PENDING in the CPU tier and pinned in their tier.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from sim.model.cpu_cache import (
    CacheInvariantError,
    CpuChunkCache,
    EvictionPolicy,
    LookupResult,
    NextUse,
    OffloadKey,
    StoreReservation,
)

__all__ = ["PRIMARY_LABEL", "TierCounters", "TierJob", "TierSpec", "TieredCache"]

TierKind = Literal["fs", "nvme", "network", "object"]

PRIMARY_LABEL = "0:primary"
"""vLLM's tier label of the CPU tier."""

#: capacity of a tier given none (never reached: slots are handed out lazily)
_UNBOUNDED = 1 << 62

_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
_MISS = LookupResult.MISS


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One secondary tier, as the model needs it (the engine adds its link).

    Attributes:
        kind: ``fs`` (vLLM's file-system tier), or kvsim's ``nvme``,
            ``network``, ``object`` (labels: the model is the same).
        capacity_chunks: chunks it holds; None: unbounded (vLLM's tiers).
        policy: its eviction policy (kvsim's own; vLLM's tiers never evict).
    """

    kind: TierKind = "fs"
    capacity_chunks: int | None = None
    policy: EvictionPolicy = EvictionPolicy.LRU


@dataclass(frozen=True, slots=True)
class TierJob:
    """A transfer between the CPU tier and a secondary tier.

    Attributes:
        job_id: unique within the run (its own counter, apart from GPU jobs).
        tier: index of the secondary tier (0 = the first after the CPU).
        keys: the chunks moved.
        is_promotion: True: tier -> CPU (a read of the tier); False: a
            cascade CPU -> tier (a write).
    """

    job_id: int
    tier: int
    keys: tuple[OffloadKey, ...]
    is_promotion: bool


@dataclass(slots=True)
class TierCounters:
    """Counts of one secondary tier, named after vLLM's tiering metrics."""

    label: str
    #: vllm:kv_offload_tiering_chunk_queries / _chunk_hits for this tier
    chunk_queries: int = 0
    chunk_hits: int = 0
    #: jobs registered (vllm:kv_offload_tiering_active_*_jobs counts those in flight)
    promotion_jobs: int = 0
    cascade_jobs: int = 0
    #: chunks of completed jobs (read_bytes / write_bytes are these x chunk bytes)
    read_chunks: int = 0
    write_chunks: int = 0
    #: chunks evicted from this tier (kvsim's own: vLLM's tiers never evict)
    evictions: int = 0
    #: cascades this tier could not place (kvsim's own)
    store_rejections: int = 0
    #: promoted chunks a GPU load then read (the tier served a hit through the CPU)
    promoted_chunks_loaded: int = 0
    #: of the requests' CPU hit tokens (first admission), this tier's share: each
    #: hit split over its load's chunks, promoted ones counting for their tier
    promoted_hit_tokens: float = 0.0


@dataclass(slots=True)
class _Pending:
    """Promotions queued during the current step, per tier."""

    keys: dict[int, list[OffloadKey]] = field(default_factory=dict)


class TieredCache(CpuChunkCache):
    """The CPU tier (this object) plus secondary tiers, as vLLM's tiering manager.

    Args:
        capacity_chunks, policy, store_threshold, tracker_size, future: the
            CPU tier's (see :class:`CpuChunkCache`).
        tiers: the secondary tiers, in lookup order (at least one).
        request_scoped: vLLM 0.33's request-scoped recency for the CPU tier (see
            :class:`~sim.model.cpu_cache.CpuChunkCache`).
        arc_t1_last_resort: ARC's last-resort victim from T1 for the CPU tier (see
            :class:`~sim.model.cpu_cache.ArcPolicy`).
    """

    def __init__(
        self,
        capacity_chunks: int,
        policy: EvictionPolicy = EvictionPolicy.LRU,
        store_threshold: int = 0,
        tracker_size: int = 64_000,
        future: NextUse | None = None,
        *,
        tiers: Sequence[TierSpec],
        request_scoped: bool = False,
        arc_t1_last_resort: bool = True,
    ) -> None:
        super().__init__(capacity_chunks, policy, store_threshold, tracker_size, future,
                         request_scoped=request_scoped, arc_t1_last_resort=arc_t1_last_resort)
        if not tiers:
            raise ValueError("a tiered cache needs at least one secondary tier")
        self.specs: tuple[TierSpec, ...] = tuple(tiers)
        self.tiers: tuple[CpuChunkCache, ...] = tuple(
            CpuChunkCache(_UNBOUNDED if t.capacity_chunks is None else t.capacity_chunks, t.policy,
                          future=future)
            for t in tiers)
        self.counters: tuple[TierCounters, ...] = tuple(
            TierCounters(f"{i + 1}:{t.kind}") for i, t in enumerate(tiers))
        #: vllm:kv_offload_tiering_chunk_queries / _chunk_hits of the CPU tier
        self.primary_queries = 0
        self.primary_hits = 0
        #: vllm:kv_offload_tiering_promotion_allocation_failures
        self.promotion_allocation_failures = 0
        self._job_ids = itertools.count()
        self._jobs: dict[int, TierJob] = {}
        self._ready: list[TierJob] = []
        self._pending = _Pending()
        #: promoted chunks not yet read by a GPU load -> their tier
        self._promoted: dict[OffloadKey, int] = {}
        #: the last GPU load: its chunk count and, per tier, how many of them were
        #: promoted (for :meth:`attribute_hit`); None once attributed
        self._last_load: tuple[int, tuple[int, ...]] | None = None
        #: CPU hit tokens served by chunks that were resident (not promoted)
        self.resident_hit_tokens = 0.0
        #: the request now looking up, and what it has been counted for
        self._asker: str | None = None
        self._observed: dict[str, set[tuple[int, OffloadKey]]] = {}

    # -- the connector's lookup ------------------------------------------------------

    def begin_lookup(self, req_id: str) -> None:
        """The connector starts a lookup for ``req_id`` (chunk query counting)."""
        self._asker = req_id

    def end_lookup(self, req_id: str, definite: bool) -> None:
        """The lookup ended; a definite answer stops the request's counting (vLLM:
        at allocation)."""
        self._asker = None
        if definite:
            self._observed.pop(req_id, None)

    def _observe(self, tier: int, key: OffloadKey, hit: bool) -> None:
        """Count a resolved query (HIT or MISS) of ``key`` in ``tier`` (-1: CPU), once per request."""
        if self._asker is not None:
            seen = self._observed.setdefault(self._asker, set())
            if (tier, key) in seen:
                return
            seen.add((tier, key))
        if tier < 0:
            self.primary_queries += 1
            self.primary_hits += hit
        else:
            c = self.counters[tier]
            c.chunk_queries += 1
            c.chunk_hits += hit

    def lookup(self, key: OffloadKey) -> LookupResult:
        """The CPU tier's answer; on a miss, the secondary tiers', promoting a hit.

        Returns:
            HIT or HIT_PENDING from the CPU tier; HIT_PENDING when a promotion
            has just been started; RETRY for a key marked uncertain; else MISS.
        """
        r = super().lookup(key)
        if r is _HIT or r is _HIT_PENDING:
            if r is _HIT:
                self._observe(-1, key, True)
            return r
        if r is not _MISS:
            return r
        self._observe(-1, key, False)
        for i, tier in enumerate(self.tiers):
            if tier.lookup(key) is not _HIT:
                self._observe(i, key, False)
                continue
            self._observe(i, key, True)
            return _HIT_PENDING if self._promote(i, key) else _MISS
        return _MISS

    def _promote(self, i: int, key: OffloadKey) -> bool:
        """Reserve a CPU slot for ``key`` and pin it in tier ``i``; False if no room."""
        res = super().prepare_store([key])
        if res is None:
            self.promotion_allocation_failures += 1
            return False
        if not res.keys:        # the CPU tier's admission filter turned it away
            return False
        self.tiers[i].prepare_load([key])
        self._pending.keys.setdefault(i, []).append(key)
        self._promoted[key] = i
        return True

    # -- stores and loads -------------------------------------------------------------

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """Finish a GPU->CPU store; on success, cascade its chunks to every tier."""
        keys = tuple(keys)
        super().complete_store(keys, success)
        if not success:
            return
        cpu_lookup = super().lookup
        present = tuple(k for k in keys if cpu_lookup(k) is _HIT)
        if not present:
            return
        for i, tier in enumerate(self.tiers):
            res: StoreReservation | None = tier.prepare_store(present)
            if res is None:
                self.counters[i].store_rejections += 1
                continue
            self.counters[i].evictions += len(res.evicted)
            super().prepare_load(present)       # pin in the CPU tier while written
            self._new_job(i, present, is_promotion=False)

    def prepare_load(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """A GPU load: from the CPU tier only (promoted chunks count as served by their tier)."""
        slots = super().prepare_load(keys)
        promoted = self._promoted
        counts = [0] * len(self.tiers)
        for key in keys:
            tier = promoted.pop(key, None)
            if tier is not None:
                self.counters[tier].promoted_chunks_loaded += 1
                counts[tier] += 1
        self._last_load = (len(keys), tuple(counts))
        return slots

    def attribute_hit(self, tokens: int) -> None:
        """A request's CPU hit of ``tokens`` (first admission) whose load was the
        last :meth:`prepare_load`: split over that load's chunks, a promoted
        chunk's share going to its tier (``promoted_hit_tokens``), the others'
        to the CPU tier (``resident_hit_tokens``). A share, not a count of
        token positions: several groups load the same tokens' KV, each with
        its own chunks (kvsim's own; vLLM attributes per key)."""
        last, self._last_load = self._last_load, None
        if last is None or not last[0]:
            self.resident_hit_tokens += tokens
            return
        n, counts = last
        for i, c in enumerate(counts):
            if c:
                self.counters[i].promoted_hit_tokens += tokens * c / n
        self.resident_hit_tokens += tokens * (n - sum(counts)) / n

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Recency in the CPU tier and in every secondary tier."""
        super().touch(keys)
        for tier in self.tiers:
            tier.touch(keys)

    # -- jobs ------------------------------------------------------------------------------

    def _new_job(self, tier: int, keys: tuple[OffloadKey, ...], *, is_promotion: bool) -> None:
        job = TierJob(next(self._job_ids), tier, keys, is_promotion)
        self._jobs[job.job_id] = job
        self._ready.append(job)
        c = self.counters[tier]
        if is_promotion:
            c.promotion_jobs += 1
        else:
            c.cascade_jobs += 1

    def take_jobs(self) -> list[TierJob]:
        """The jobs to start now: the cascades created since the last call, then this
        step's promotions, one job per tier (vLLM flushes them at the end of a
        scheduler step)."""
        for i in sorted(self._pending.keys):
            self._new_job(i, tuple(self._pending.keys[i]), is_promotion=True)
        self._pending.keys.clear()
        jobs, self._ready = self._ready, []
        return jobs

    def complete_job(self, job_id: int) -> TierJob:
        """A tier job finished: a promoted chunk becomes READY in the CPU tier (and is
        unpinned in its tier); a cascaded chunk becomes readable in the tier (and is
        unpinned in the CPU tier)."""
        job = self._jobs.pop(job_id)
        c = self.counters[job.tier]
        tier = self.tiers[job.tier]
        if job.is_promotion:
            super().complete_store(job.keys)
            tier.complete_load(job.keys)
            c.read_chunks += len(job.keys)
        else:
            tier.complete_store(job.keys)
            super().complete_load(job.keys)
            c.write_chunks += len(job.keys)
        return job

    @property
    def num_tier_jobs(self) -> int:
        """Tier jobs created and not completed (queued promotions included)."""
        return len(self._jobs) + sum(len(v) > 0 for v in self._pending.keys.values())

    def take_events(self) -> list:  # type: ignore[type-arg]
        """The CPU tier's events; the secondary tiers' are drained and dropped."""
        for tier in self.tiers:
            tier.take_events()
        return super().take_events()

    def tier_state(self, i: int) -> tuple[int, int, int, int]:
        """(ready, pending writes, being read, free slots or -1 when unbounded) of tier ``i``."""
        t = self.tiers[i]
        free = -1 if self.specs[i].capacity_chunks is None else t.num_free_slots
        return t.num_ready, t.num_pending, t.num_loading, free

    def check_invariants(self) -> None:
        """The tiers' own invariants, and the pins every job in flight holds."""
        super().check_invariants()
        found: list[str] = []
        for i, tier in enumerate(self.tiers):
            try:
                tier.check_invariants()
            except CacheInvariantError as exc:
                found.append(f"tier {i}: {exc}")
        for job in self._jobs.values():
            tier = self.tiers[job.tier]
            for key in job.keys:
                cpu_ref, tier_ref = self.ref_count(key), tier.ref_count(key)
                if job.is_promotion:
                    ok = cpu_ref == -1 and tier_ref is not None and tier_ref >= 1
                else:       # the tier may have held the chunk already (then it is rewritten)
                    ok = cpu_ref is not None and cpu_ref >= 1
                if not ok:
                    found.append(f"tier job {job.job_id}: key {key}: CPU ref {cpu_ref}, tier ref {tier_ref}")
        for i, keys in self._pending.keys.items():
            for key in keys:
                if self.ref_count(key) != -1 or not (self.tiers[i].ref_count(key) or 0) > 0:
                    found.append(f"queued promotion of {key} is not reserved and pinned")
        if found:
            raise CacheInvariantError("; ".join(found))
