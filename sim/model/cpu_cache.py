"""The CPU chunk cache of vLLM's offloading connector (spec §3).

What it models
    vLLM keeps offloaded KV data in a fixed pool of host-memory *slots*; each
    slot holds one offload chunk of any KV cache group. The scheduler-side
    manager only does bookkeeping: which :data:`OffloadKey` sits in which slot,
    and a reference count per chunk:

    ========  ==========  ===============  =========
    state     ref count   lookup answer    evictable
    ========  ==========  ===============  =========
    MISSING   (absent)    MISS             n/a
    PENDING   -1          HIT_PENDING      no
    READY     0           HIT              yes
    LOADING   k >= 1      HIT              no
    ========  ==========  ===============  =========

    A store is two-phase: :meth:`CpuChunkCache.prepare_store` reserves slots
    (evicting idle chunks if it must, all or nothing) and inserts the keys as
    PENDING; :meth:`CpuChunkCache.complete_store` makes them READY once the
    simulated GPU->CPU copy has finished. A load is two-phase too:
    :meth:`CpuChunkCache.prepare_load` pins READY chunks (ref count + 1) and
    :meth:`CpuChunkCache.complete_load` unpins them.

    Slot ids are handed out exactly as vLLM does: slots never used before in
    ascending order first, then slots freed by eviction (or by a failed store)
    taken back from the end of the free list, last freed first.

    Two replacement policies are modelled behind one small protocol and chosen
    through an explicit table (:data:`_POLICY_TABLE`):

    * :class:`LruPolicy` (vLLM's default): an ordered set of idle chunks, oldest
      first. A chunk enters it at the newest end when its store completes or
      its last load completes; ``touch`` walks its keys back to front, so the
      *first* key touched ends up the most recently used.
    * :class:`ArcPolicy`: adaptive replacement with lists T1/T2, ghost lists
      B1/B2 and a float target ``p`` for T1, including vLLM's single forward
      scan of each list while choosing a batch of victims.
    * vLLM 0.33 (``request_scoped=True``, the LATEST logic) ranks per request
      instead of by touches: the cache records each request's first offer
      and first load of a chunk (:meth:`CpuChunkCache.prepare_store` and
      :meth:`CpuChunkCache.observe_load` with the request's id and end tokens)
      and commits them at :meth:`CpuChunkCache.finish_request`;
      :class:`RankedLruPolicy` and :class:`RequestArcPolicy` take those
      (table :data:`_REQUEST_SCOPED_TABLE`).
    * :class:`BeladyPolicy` (kvsim's own, not in vLLM): clairvoyant eviction of
      the idle chunk whose next use lies farthest in the future, asked of a
      :class:`NextUse` oracle built from the workload
      (:mod:`sim.model.future`, which also says what "next use" means in a
      closed-loop simulation and why it is a reference point rather than a
      proven bound). It needs that oracle, so it can only be used where the
      whole workload is known in advance (a run, not ``kvsim check``).

    Optionally (``store_threshold >= 2``) an admission filter lets a key be
    stored only once it has been offered that many times, counted in a bounded
    least-recently-offered tracker (``tracker_size`` entries).

What it simplifies or adds relative to vLLM
    * ``prepare_load`` checks every key before it changes anything, so the
      :class:`CacheAssertion` it raises leaves the cache untouched. vLLM asserts
      key by key and has already pinned the earlier keys when it fails; its
      scheduler process dies at that point, so the difference cannot be
      observed in vLLM, while a simulator that records the crash and carries on
      needs an intact cache.
    * vLLM's CPU manager never answers ``RETRY``; only its tiered backends,
      whose lookups may still be in flight, do. :meth:`CpuChunkCache.mark_uncertain`
      lets a simulation model such a tier: an absent, marked key answers
      ``RETRY`` instead of ``MISS``.
    * Events are always recorded, as typed frozen records in a list drained by
      :meth:`CpuChunkCache.take_events` (vLLM records only stores and evictions,
      and only when enabled). ``reset`` emits no event, as in vLLM.
    * Arguments naming the same key twice in one call are rejected with
      ``ValueError``; vLLM's manager has no such check and would leak a slot.
    * vLLM's metrics side-counters (skipped stores, allocation sizes) are left
      to the caller, which sees every reservation and every event.

Invariants (verified by :meth:`CpuChunkCache.check_invariants`)
    * occupied slots + free-list slots == slots ever handed out <= capacity;
      every present key owns a distinct slot, none of them on the free list;
    * the O(1) counters of PENDING, READY (= evictable) and LOADING chunks
      agree with a recount, and no ref count is below -1;
    * LRU: the idle list holds exactly the READY keys; Belady: so does its
      ranking, each with a live heap entry; ranked LRU (0.33): every present
      key has a rank and the idle set, each with a live heap entry, is
      exactly the READY keys;
      ARC: T1 and T2 partition the present keys, the ghost lists hold no
      present key and at most ``capacity`` keys each, and ``0 <= p <= capacity``;
    * the admission tracker holds at most ``tracker_size`` keys.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Final, Literal, Protocol, TypeAlias

__all__ = [
    "KEY_GROUPS",
    "NEVER",
    "ArcPolicy",
    "AssertionReason",
    "BeladyPolicy",
    "CacheAssertion",
    "CacheEvent",
    "CacheInvariantError",
    "ChunkState",
    "ChunksEvicted",
    "ChunksStored",
    "CpuChunkCache",
    "EvictionPolicy",
    "LoadCompleted",
    "LoadStarted",
    "LookupResult",
    "LruPolicy",
    "NextUse",
    "OffloadKey",
    "StoreCancelled",
    "StoreReservation",
    "capacity_from_bytes",
    "key_parts",
    "offload_key",
    "slot_bytes",
]

OffloadKey: TypeAlias = int
"""A chunk of a group, named by the hash of its last hash block: ``block_hash * 256 +
group_index`` (:func:`offload_key`; :func:`key_parts` gives the two back). One int rather
than a ``(hash, group)`` tuple: a key is one object (about 32 bytes instead of about 90
with its hash), hashes without visiting a tuple, and is not tracked by the cyclic garbage
collector. The encoding keeps the tuples' order (by hash, then group) for any hash."""

#: groups a key can name (the layout refuses more)
KEY_GROUPS = 256


def offload_key(block_hash: int, group: int) -> OffloadKey:
    """The key of ``group``'s chunk whose last hash block has ``block_hash``."""
    return block_hash * KEY_GROUPS + group


def key_parts(key: OffloadKey) -> tuple[int, int]:
    """``(block_hash, group)`` of a key (:func:`offload_key` inverted)."""
    return divmod(key, KEY_GROUPS)


class LookupResult(enum.Enum):
    """Answer of :meth:`CpuChunkCache.lookup` for one key."""

    HIT = "hit"
    """Present and readable (READY or LOADING)."""
    HIT_PENDING = "hit_pending"
    """Present, but its store has not completed yet."""
    MISS = "miss"
    """Absent."""
    RETRY = "retry"
    """Absent, but marked uncertain: an asynchronous tier has not answered yet."""


class ChunkState(enum.Enum):
    """State of one key in the cache (see the table in the module docstring)."""

    MISSING = "missing"
    PENDING = "pending"
    READY = "ready"
    LOADING = "loading"


class EvictionPolicy(enum.StrEnum):
    """Replacement policy, named as in vLLM's ``eviction_policy`` option.

    A ``StrEnum`` (so a ``str`` and an ``Enum``, with ``str()`` giving the value).
    """

    LRU = "lru"
    ARC = "arc"
    BELADY = "belady"
    """kvsim's own: clairvoyant (optimal-eviction reference), needs a :class:`NextUse` oracle."""


AssertionReason: TypeAlias = Literal["missing_chunk", "chunk_not_ready"]
"""Why :class:`CacheAssertion` was raised: the key is absent, or its store is pending."""


class CacheAssertion(Exception):  # noqa: N818 -- named after the vLLM assertion it stands for
    """A condition on which vLLM's CPU manager fails an ``assert``.

    In vLLM this kills the scheduler process; a simulation records it as a
    crash of the modelled system.

    Attributes:
        key: The offending key.
        reason: ``"missing_chunk"`` (the key is absent) or ``"chunk_not_ready"``
            (its store is still pending).
        message: A human-readable description.
    """

    def __init__(self, key: OffloadKey, reason: AssertionReason) -> None:
        if reason == "missing_chunk":
            what = "not found in CPU cache"
        else:
            what = "not ready to be read: its store is still pending"
        h, g = key_parts(key)
        message = f"chunk (h={h}, group={g}) {what}"
        super().__init__(message)
        self.key: OffloadKey = key
        self.reason: AssertionReason = reason
        self.message: str = message


class CacheInvariantError(RuntimeError):
    """The simulator used the cache in a way vLLM never does, or its state is inconsistent.

    Unlike :class:`CacheAssertion`, this is a bug in kvsim, not a modelled crash.
    """


@dataclass(frozen=True, slots=True)
class ChunksStored:
    """Pending chunks whose store completed; they are now READY."""

    keys: tuple[OffloadKey, ...]


@dataclass(frozen=True, slots=True)
class ChunksEvicted:
    """Idle chunks evicted by ``prepare_store`` to make room; their slots were freed."""

    keys: tuple[OffloadKey, ...]


@dataclass(frozen=True, slots=True)
class LoadStarted:
    """Chunks pinned by ``prepare_load`` (one more reader each)."""

    keys: tuple[OffloadKey, ...]


@dataclass(frozen=True, slots=True)
class LoadCompleted:
    """Chunks released by ``complete_load`` (one reader fewer each)."""

    keys: tuple[OffloadKey, ...]


@dataclass(frozen=True, slots=True)
class StoreCancelled:
    """Pending chunks dropped by ``complete_store(success=False)``; their slots were freed."""

    keys: tuple[OffloadKey, ...]


CacheEvent: TypeAlias = ChunksStored | ChunksEvicted | LoadStarted | LoadCompleted | StoreCancelled


@dataclass(frozen=True, slots=True)
class StoreReservation:
    """Result of a successful :meth:`CpuChunkCache.prepare_store`.

    Attributes:
        keys: The keys inserted as PENDING, in offer order (offered keys that
            were already present, or not yet admitted, are left out).
        slots: The slot reserved for each of ``keys``, same order.
        evicted: Keys evicted to make room, in eviction order.
    """

    keys: tuple[OffloadKey, ...]
    slots: tuple[int, ...]
    evicted: tuple[OffloadKey, ...]


_EMPTY_RESERVATION: Final = StoreReservation((), (), ())


def capacity_from_bytes(
    cpu_bytes: int,
    kv_bytes_per_block: int,
    blocks_per_chunk: int,
    copies: int = 1,
    page_bytes: int = 4096,
) -> int:
    """Number of chunk slots a host-memory budget holds (spec §3.1).

    A slot holds ``blocks_per_chunk`` GPU blocks for each of ``copies`` workers,
    rounded up to a whole number of pages.

    Args:
        cpu_bytes: Host budget for all workers together, in bytes.
        kv_bytes_per_block: Bytes of one GPU block index across all KV tensors
            of one worker.
        blocks_per_chunk: GPU blocks per offload chunk.
        copies: Number of per-worker copies (the world size; 1 for replicated MLA).
        page_bytes: Alignment of one slot, in bytes.

    Returns:
        ``cpu_bytes // round_up(kv_bytes_per_block * copies * blocks_per_chunk, page_bytes)``.

    Raises:
        ValueError: If any argument is not a positive integer.
    """
    args = {
        "cpu_bytes": cpu_bytes,
        "kv_bytes_per_block": kv_bytes_per_block,
        "blocks_per_chunk": blocks_per_chunk,
        "copies": copies,
        "page_bytes": page_bytes,
    }
    for name, value in args.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return cpu_bytes // slot_bytes(kv_bytes_per_block, blocks_per_chunk, copies, page_bytes)


def slot_bytes(kv_bytes_per_block: int, blocks_per_chunk: int, copies: int = 1,
               page_bytes: int = 4096) -> int:
    """Host bytes of one chunk slot (spec §3.1): ``blocks_per_chunk`` GPU blocks for
    each of ``copies`` workers, rounded up to whole pages."""
    chunk_bytes = kv_bytes_per_block * copies * blocks_per_chunk
    return -(-chunk_bytes // page_bytes) * page_bytes


class _Chunk:
    """Mutable per-key record: the slot it occupies and its reference count."""

    __slots__ = ("ref", "slot")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        #: -1 while the store is pending, else the number of loads reading it.
        self.ref = -1


class _Policy(Protocol):
    """What the cache asks of a replacement policy.

    The cache owns the key -> :class:`_Chunk` map and all counters; a policy
    owns only recency order (and, for ARC, ghosts and the adaptive target).
    """

    def insert(self, key: OffloadKey, chunk: _Chunk) -> None:
        """Take note of a key just inserted as PENDING."""

    def remove(self, key: OffloadKey) -> None:
        """Forget a PENDING key whose store failed."""

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record a use of ``keys`` (absent keys are ignored)."""

    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        """Forget and return ``n`` READY keys not in ``protected``, or return None (no change)."""

    def mark_evictable(self, key: OffloadKey) -> None:
        """The key's ref count has just become 0."""

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """The key's ref count has just left 0 (a load started)."""

    def clear(self) -> None:
        """Forget everything, adaptive state included."""

    def problems(self, chunks: Mapping[OffloadKey, _Chunk]) -> list[str]:
        """Describe every disagreement between the policy's state and ``chunks``."""


class _RequestScoped(_Policy, Protocol):
    """What the cache asks in addition of a vLLM 0.33 policy (request-scoped recency)."""

    def insert_for(self, key: OffloadKey, chunk: _Chunk, req_id: str, end_token: int) -> None:
        """``req_id`` stored ``key``, which ends at token ``end_token`` of the request."""

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """First offers by a request of absent keys, before they are inserted."""

    def observe(self, req_id: str, keys: Sequence[tuple[OffloadKey, int]]) -> None:
        """First offers or reads by ``req_id`` of ``(key, end token)``."""

    def commit(self, keys: Sequence[OffloadKey], stored_only: Set[OffloadKey],
               reused: Set[OffloadKey]) -> None:
        """A request finished having used ``keys`` (head to tail)."""

    def forget_request(self, req_id: str) -> None:
        """``req_id`` will use nothing more."""


@dataclass(slots=True)
class _RequestAccess:
    """What one request has done to the cache so far (request-scoped policies only)."""

    #: keys offered (and storable or READY) or read, with their end token
    seen: dict[OffloadKey, int]
    #: keys this request stored
    stored: set[OffloadKey]
    #: keys this request read while READY and had not stored itself
    reused: set[OffloadKey]
    #: keys whose store miss has been reported to the policy
    missed: set[OffloadKey]


class LruPolicy:
    """Least recently used eviction over the READY chunks.

    Only READY (idle) chunks are ordered: a chunk joins the order at the newest
    end when it becomes idle (store completed, or its last load completed) and
    leaves it while loading. ``touch`` walks its keys from last to first, so the
    first key of a touch ends up newest: a request's early prefix chunks, which
    every later request sharing the prefix needs, are evicted last.
    """

    __slots__ = ("_idle",)

    def __init__(self, capacity: int) -> None:
        del capacity  # the order never exceeds the cache, so LRU needs no bound
        #: READY keys, oldest (next victim) first.
        self._idle: OrderedDict[OffloadKey, None] = OrderedDict()

    def order(self) -> list[OffloadKey]:
        """READY keys from the next victim to the most recently used."""
        return list(self._idle)

    def insert(self, key: OffloadKey, chunk: _Chunk) -> None:
        """Pending chunks are not ordered until their store completes."""

    def remove(self, key: OffloadKey) -> None:
        """Forget ``key`` (a pending key is not in the order; nothing to do then)."""
        self._idle.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Move the READY ones of ``keys`` to the newest end, last key first."""
        idle = self._idle
        to_newest = idle.move_to_end
        # most keys of a touch are absent: the membership test runs in C (filter)
        for key in filter(idle.__contains__, reversed(keys)):
            to_newest(key)

    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        """Take the ``n`` oldest READY keys not in ``protected``, or None if there are fewer."""
        if n <= 0:
            return []
        victims: list[OffloadKey] = []
        for key in self._idle:
            if key in protected:
                continue
            victims.append(key)
            if len(victims) == n:
                break
        else:
            return None
        idle = self._idle
        for key in victims:
            del idle[key]
        return victims

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key`` became idle: it is now the most recently used."""
        self._idle[key] = None

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key`` is being loaded: out of the order until its last load completes."""
        del self._idle[key]

    def clear(self) -> None:
        """Forget every key."""
        self._idle.clear()

    def problems(self, chunks: Mapping[OffloadKey, _Chunk]) -> list[str]:
        """The idle order must hold exactly the keys with ref count 0."""
        ready = {key for key, chunk in chunks.items() if chunk.ref == 0}
        if ready != set(self._idle):
            return [f"LRU idle list {sorted(self._idle)} != READY keys {sorted(ready)}"]
        return []


class RankedLruPolicy:
    """vLLM 0.33's LRU: recency as ranks given per request, committed when it finishes.

    Every present chunk (pending and loading ones too) carries a rank
    ``(major, minor)``; the victim is the idle chunk of lowest rank. One
    counter hands out majors. A request draws its own major the first time it
    offers or reads a chunk; a chunk it stores or first observes gets
    ``(request major, -end token)``, so within a request the tail goes before
    the head, and an observation only ever raises a chunk's rank. When the
    request finishes, :meth:`commit` walks its chunks from tail to head giving
    each a fresh major of its own: the head ends up the most recently used.
    Between equal ranks (the chunks of one boundary in several groups) the
    lower group index goes first, as vLLM's heap compares keys whose hash is
    equal. ``touch`` (fresh majors, last key first) is kept for callers that
    use it; vLLM 0.33's connector does not.
    """

    __slots__ = ("_clock", "_heap", "_idle", "_rank", "_request_major")

    def __init__(self, capacity: int) -> None:
        del capacity
        #: rank of every present key
        self._rank: dict[OffloadKey, tuple[int, int]] = {}
        #: READY keys
        self._idle: set[OffloadKey] = set()
        #: (rank, key) of idle keys; an entry whose rank is no longer the key's,
        #: or whose key is no longer idle, is stale and skipped
        self._heap: list[tuple[tuple[int, int], OffloadKey]] = []
        self._clock = 0
        #: major drawn by each request that has offered or read a chunk
        self._request_major: dict[str, int] = {}

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _major_of(self, req_id: str) -> int:
        major = self._request_major.get(req_id)
        if major is None:
            major = self._request_major[req_id] = self._tick()
        return major

    def _set(self, key: OffloadKey, rank: tuple[int, int]) -> None:
        self._rank[key] = rank
        if key in self._idle:
            heapq.heappush(self._heap, (rank, key))

    def order(self) -> list[OffloadKey]:
        """READY keys from the next victim to the most recently used."""
        return sorted(self._idle, key=lambda k: (self._rank[k], k))

    def insert(self, key: OffloadKey, chunk: _Chunk) -> None:
        """A key stored without a known position: a fresh major."""
        self._rank[key] = (self._tick(), 0)

    def insert_for(self, key: OffloadKey, chunk: _Chunk, req_id: str, end_token: int) -> None:
        """A key stored by ``req_id``, ending at ``end_token``: the request's provisional rank."""
        self._rank[key] = (self._major_of(req_id), -end_token)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """Nothing: vLLM touches store misses here, but they are absent, so no rank changes."""

    def observe(self, req_id: str, keys: Sequence[tuple[OffloadKey, int]]) -> None:
        """First offers or reads by ``req_id`` of ``(key, end token)``: raise each present
        key to the request's provisional rank (never lower it)."""
        major = self._major_of(req_id)
        rank = self._rank
        for key, end_token in keys:
            old = rank.get(key)
            if old is not None and old < (major, -end_token):
                self._set(key, (major, -end_token))

    def commit(self, keys: Sequence[OffloadKey], stored_only: Set[OffloadKey],
               reused: Set[OffloadKey]) -> None:
        """A request finished; ``keys`` are the ones it used, head to tail (how it used them
        does not matter to LRU)."""
        self.touch(keys)

    def forget_request(self, req_id: str) -> None:
        """``req_id`` will offer and read nothing more."""
        self._request_major.pop(req_id, None)

    def remove(self, key: OffloadKey) -> None:
        """Forget ``key``."""
        self._rank.pop(key, None)
        self._idle.discard(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """A fresh major for each present key, last key first."""
        rank = self._rank
        for key in reversed(keys):
            if key in rank:
                self._set(key, (self._tick(), 0))

    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        """Take the ``n`` lowest-ranked READY keys not in ``protected``, or None if there are fewer."""
        if n <= 0:
            return []
        heap, rank, idle = self._heap, self._rank, self._idle
        taken: list[tuple[tuple[int, int], OffloadKey]] = []
        chosen: set[OffloadKey] = set()
        skipped: list[tuple[tuple[int, int], OffloadKey]] = []
        while heap and len(taken) < n:
            entry = heapq.heappop(heap)
            r, key = entry
            if key not in idle or rank.get(key) != r or key in chosen:
                continue
            if key in protected:
                skipped.append(entry)
                continue
            taken.append(entry)
            chosen.add(key)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(taken) < n:
            for entry in taken:
                heapq.heappush(heap, entry)
            return None
        for _, key in taken:
            idle.remove(key)
            del rank[key]
        if len(heap) > max(64, 2 * len(idle)):
            self._rebuild()
        return [key for _, key in taken]

    def _rebuild(self) -> None:
        self._heap = [(self._rank[k], k) for k in self._idle]
        heapq.heapify(self._heap)

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key`` became idle; it keeps its rank."""
        self._idle.add(key)
        heapq.heappush(self._heap, (self._rank[key], key))

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key`` is being loaded: not a victim until its last load completes (rank kept)."""
        self._idle.remove(key)

    def clear(self) -> None:
        """Forget every key and every request's major; the counter starts again."""
        self._rank.clear()
        self._idle.clear()
        self._heap.clear()
        self._request_major.clear()
        self._clock = 0

    def problems(self, chunks: Mapping[OffloadKey, _Chunk]) -> list[str]:
        """Ranks cover exactly the present keys; the idle set is exactly the READY keys."""
        found = []
        if set(self._rank) != set(chunks):
            found.append("ranked LRU: ranked keys != present keys")
        ready = {key for key, chunk in chunks.items() if chunk.ref == 0}
        if ready != self._idle:
            found.append(f"ranked LRU idle set {sorted(self._idle)} != READY keys {sorted(ready)}")
        live = {k for r, k in self._heap if k in self._idle and self._rank[k] == r}
        if live != self._idle:
            found.append("ranked LRU: an idle key has no live heap entry")
        return found


class ArcPolicy:
    """Adaptive replacement cache, as vLLM adapts it to pinned chunks.

    * ``t1``: chunks seen once (stored, not touched since while ready), oldest first.
    * ``t2``: chunks touched again after their store completed, oldest first.
    * ``b1`` / ``b2``: ghosts, keys recently evicted from ``t1`` / ``t2``.
    * ``p``: target size of ``t1``, a float in ``[0, capacity]``; a touch of a
      ``b1`` ghost raises it by ``max(1, |b2| / |b1|)``, a touch of a ``b2``
      ghost lowers it by ``max(1, |b1| / |b2|)``.

    Eviction eligibility is the ref count alone (0 means idle); pending and
    loading chunks keep their list position but are skipped by victim scans.

    ``t1_last_resort``: when neither the ``t1`` turn nor ``t2`` yields a
    victim, take one from ``t1`` (vLLM 0.30 on); vLLM 0.29 refuses the
    eviction instead (the store is then rejected). The window profile says
    which (``arc_t1_last_resort``).
    """

    __slots__ = ("_listed", "b1", "b2", "capacity", "p", "t1", "t1_last_resort", "t2")

    def __init__(self, capacity: int, t1_last_resort: bool = True) -> None:
        self.capacity = capacity
        self.t1_last_resort = t1_last_resort
        #: Adaptive target for ``len(t1)``; compared through ``int(p)``.
        self.p = 0.0
        self.t1: OrderedDict[OffloadKey, _Chunk] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, _Chunk] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        #: the keys of the four lists (they are disjoint): a touch skips the
        #: others at C speed (most keys of a touch are in no list)
        self._listed: set[OffloadKey] = set()

    def insert(self, key: OffloadKey, chunk: _Chunk) -> None:
        """New chunks enter ``t1`` at the newest end and stop being ghosts."""
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        self._listed.add(key)

    def remove(self, key: OffloadKey) -> None:
        """Forget ``key`` without leaving a ghost."""
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)
        self._listed.discard(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Promote, refresh or adapt for each key, walking ``keys`` from last to first."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        for key in filter(self._listed.__contains__, reversed(keys)):
            chunk = t1.pop(key, None)
            if chunk is not None:
                if chunk.ref < 0:
                    # Just reserved by a store: not a second use, stay in t1 as newest.
                    t1[key] = chunk
                else:
                    t2[key] = chunk
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1:
                step = max(1, len(b2) / len(b1))
                self.p = float(min(self.p + step, self.capacity))
                b1.move_to_end(key)
            elif key in b2:
                step = max(1, len(b1) / len(b2))
                self.p = float(max(self.p - step, 0))
                b2.move_to_end(key)

    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        """Choose ``n`` idle victims, then apply them (all or nothing).

        For each victim: if the size ``t1`` would have after the victims chosen
        so far from it is at least ``int(p)``, try ``t1``; otherwise, or if that
        fails, try ``t2``; then ``t1`` as a last resort (unless
        ``t1_last_resort`` is off: then None). Each list is read by a
        single forward cursor over the whole call, so a list that once came up
        empty is never rescanned. Victims become ghosts; each ghost list is
        then cut back to ``capacity`` keys, oldest first.
        """
        if n <= 0:
            return []
        t1_cursor = iter(self.t1.items())
        t2_cursor = iter(self.t2.items())
        t1_size = len(self.t1)
        target = int(self.p)
        chosen: list[tuple[OffloadKey, bool]] = []  # (key, taken from t1)
        for _ in range(n):
            pick = self._choose(t1_size >= target, t1_cursor, t2_cursor, protected)
            if pick is None:
                return None
            if pick[1]:
                t1_size -= 1
            chosen.append(pick)

        victims: list[OffloadKey] = []
        for key, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            victims.append(key)
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.capacity):
                self._listed.discard(ghosts.popitem(last=False)[0])
        return victims

    def _choose(self, t1_turn: bool, t1_cursor: Iterator[tuple[OffloadKey, _Chunk]],
                t2_cursor: Iterator[tuple[OffloadKey, _Chunk]], protected: Set[OffloadKey]
                ) -> tuple[OffloadKey, bool] | None:
        """One victim of :meth:`evict` and whether it comes from ``t1``; None if none."""
        if t1_turn:
            key = _next_idle(t1_cursor, protected)
            if key is not None:
                return key, True
        key = _next_idle(t2_cursor, protected)
        if key is not None:
            return key, False
        if not self.t1_last_resort:
            return None
        key = _next_idle(t1_cursor, protected)
        return None if key is None else (key, True)

    def mark_evictable(self, key: OffloadKey) -> None:
        """ARC keeps list positions when a chunk becomes idle."""

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """ARC keeps list positions when a load starts."""

    def clear(self) -> None:
        """Forget every key, ghost and the adaptive target."""
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self._listed.clear()
        self.p = 0.0

    def problems(self, chunks: Mapping[OffloadKey, _Chunk]) -> list[str]:
        """Check the four lists and ``p`` against the present keys."""
        found: list[str] = []
        t1, t2 = set(self.t1), set(self.t2)
        if t1 & t2:
            found.append(f"ARC keys in both t1 and t2: {sorted(t1 & t2)}")
        if t1 | t2 != set(chunks):
            found.append("ARC t1 | t2 differs from the present keys")
        for name, lst in (("t1", self.t1), ("t2", self.t2)):
            for key, chunk in lst.items():
                if chunks.get(key) is not chunk:
                    found.append(f"ARC {name} holds a stale record for {key}")
        ghosts = set(self.b1) | set(self.b2)
        if set(self.b1) & set(self.b2):
            found.append("ARC keys in both ghost lists")
        if ghosts & set(chunks):
            found.append(f"ARC ghosts that are present: {sorted(ghosts & set(chunks))}")
        if len(self.b1) > self.capacity or len(self.b2) > self.capacity:
            found.append(f"ARC ghost lists over capacity: {len(self.b1)}, {len(self.b2)}")
        if not 0.0 <= self.p <= self.capacity:
            found.append(f"ARC target p={self.p} outside [0, {self.capacity}]")
        if self._listed != t1 | t2 | ghosts:
            found.append("ARC: the listed-key index differs from t1 | t2 | b1 | b2")
        return found


class RequestArcPolicy(ArcPolicy):
    """vLLM 0.33's ARC: the same lists and victim scan, fed per request.

    Nothing is touched while a request runs. A store miss of a ghost adapts
    ``p`` (once per key and request, before the store re-inserts the key).
    When the request finishes, its keys are walked from tail to head: a key
    it only stored moves to the newest end of the list it is in (a store is
    not a second use); a key it read while ready (a load, or an offer of a
    READY chunk) goes from ``t1`` to the newest end of ``t2``, or to the
    newest end of ``t2`` if already there; other keys are left alone.
    """

    __slots__ = ()

    def insert_for(self, key: OffloadKey, chunk: _Chunk, req_id: str, end_token: int) -> None:
        """As :meth:`insert`: the storing request does not matter to ARC."""
        self.insert(key, chunk)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """Adapt ``p`` for each ghost among ``keys``, last key first."""
        b1, b2 = self.b1, self.b2
        for key in reversed(keys):
            if key in b1:
                self.p = float(min(self.p + max(1, len(b2) / len(b1)), self.capacity))
                b1.move_to_end(key)
            elif key in b2:
                self.p = float(max(self.p - max(1, len(b1) / len(b2)), 0))
                b2.move_to_end(key)

    def observe(self, req_id: str, keys: Sequence[tuple[OffloadKey, int]]) -> None:
        """ARC learns nothing while a request runs."""

    def commit(self, keys: Sequence[OffloadKey], stored_only: Set[OffloadKey],
               reused: Set[OffloadKey]) -> None:
        """A request finished; ``keys`` are the ones it used, head to tail."""
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            if key in stored_only:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused:
                chunk = t1.pop(key, None)
                if chunk is not None:
                    t2[key] = chunk
                elif key in t2:
                    t2.move_to_end(key)

    def forget_request(self, req_id: str) -> None:
        """ARC keeps nothing per request."""


NEVER: Final = 1 << 62
"""Next use of a chunk no future request needs (larger than any request position)."""


class NextUse(Protocol):
    """What :class:`BeladyPolicy` asks of the future (see :mod:`sim.model.future`)."""

    def next_use(self, key: OffloadKey) -> int:
        """Position of the next request that will use ``key``, or :data:`NEVER`."""

    def subscribe(self, listener: Callable[[Sequence[OffloadKey]], None]) -> None:
        """Call ``listener`` with the keys whose next use has just moved later."""


class BeladyPolicy:
    """Belady's MIN rule over the READY chunks: evict the farthest next use.

    Each READY key sits in a max-heap by its next use (as the oracle answers
    when the key became idle or its next use last moved). Ties go to the key
    ranked *last*: keys of one store are ranked in prompt order, and when two
    chunks serve the same next request, losing the deeper one costs less of
    that request's prefix hit (a hit ends at the first missing chunk). The
    choice is deterministic. Entries go stale when a key leaves READY or its next use
    moves: the heap is cleaned lazily on eviction and rebuilt when stale
    entries outnumber live ones. ``touch`` changes nothing (recency does not
    matter to a clairvoyant policy); the oracle tells the policy when next uses
    move.
    """

    __slots__ = ("_future", "_heap", "_idle", "_seq")

    def __init__(self, capacity: int, future: NextUse) -> None:
        del capacity
        self._future = future
        #: READY key -> (next use, tie-break sequence) of its live heap entry.
        self._idle: dict[OffloadKey, tuple[int, int]] = {}
        #: (-next use, -sequence, key): farthest use first, then the last ranked;
        #: entries not matching ``_idle`` are stale.
        self._heap: list[tuple[int, int, OffloadKey]] = []
        self._seq = 0
        future.subscribe(self._moved)

    def _push(self, key: OffloadKey) -> None:
        nu = self._future.next_use(key)
        self._seq += 1
        self._idle[key] = (nu, self._seq)
        heapq.heappush(self._heap, (-nu, -self._seq, key))
        if len(self._heap) > 2 * len(self._idle) + 64:
            self._heap = [(-nu, -seq, k) for k, (nu, seq) in self._idle.items()]
            heapq.heapify(self._heap)

    def _moved(self, keys: Sequence[OffloadKey]) -> None:
        """The oracle moved the next use of ``keys``: re-rank the READY ones."""
        idle = self._idle
        for key in keys:
            if key in idle and idle[key][0] != self._future.next_use(key):
                self._push(key)

    def next_use_of(self, key: OffloadKey) -> int | None:
        """The next use a READY key is ranked by, or None if it is not READY."""
        entry = self._idle.get(key)
        return None if entry is None else entry[0]

    def insert(self, key: OffloadKey, chunk: _Chunk) -> None:
        """Pending chunks are not ranked until their store completes."""

    def remove(self, key: OffloadKey) -> None:
        """Forget ``key`` (its heap entry goes stale)."""
        self._idle.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Recency is irrelevant to a clairvoyant policy."""

    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        """Take the ``n`` READY keys not in ``protected`` with the farthest next use."""
        if n <= 0:
            return []
        idle, heap = self._idle, self._heap
        if len(idle) - len(protected & idle.keys()) < n:
            return None
        victims: list[OffloadKey] = []
        skipped: list[tuple[int, int, OffloadKey]] = []
        while len(victims) < n:
            entry = heapq.heappop(heap)
            neg, negseq, key = entry
            if idle.get(key) != (-neg, -negseq):
                continue            # stale
            if key in protected:
                skipped.append(entry)
                continue
            victims.append(key)
            del idle[key]
        for entry in skipped:
            heapq.heappush(heap, entry)
        return victims

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key`` became idle: rank it by its next use now."""
        self._push(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key`` is being loaded: not a candidate until its last load completes."""
        del self._idle[key]

    def clear(self) -> None:
        """Forget every key (the oracle's knowledge of the future stays)."""
        self._idle.clear()
        self._heap.clear()

    def problems(self, chunks: Mapping[OffloadKey, _Chunk]) -> list[str]:
        """The ranked keys are exactly the READY keys, each with a live heap entry."""
        ready = {key for key, chunk in chunks.items() if chunk.ref == 0}
        found: list[str] = []
        if ready != set(self._idle):
            found.append(f"Belady ranked keys {sorted(self._idle)} != READY keys {sorted(ready)}")
        live = {(-neg, -negseq, key) for neg, negseq, key in self._heap}
        for key, (nu, seq) in self._idle.items():
            if (nu, seq, key) not in live:
                found.append(f"Belady key {key} has no live heap entry")
        return found


def _next_idle(
    cursor: Iterator[tuple[OffloadKey, _Chunk]], protected: Set[OffloadKey]
) -> OffloadKey | None:
    """Advance ``cursor`` to the next idle, unprotected key and return it (None when exhausted)."""
    for key, chunk in cursor:
        if chunk.ref == 0 and key not in protected:
            return key
    return None


def _belady(capacity: int, future: NextUse | None) -> _Policy:
    if future is None:
        raise ValueError("the belady policy needs the workload's future (a NextUse oracle)")
    return BeladyPolicy(capacity, future)


#: The one place a policy name is turned into a policy (capacity, oracle -> policy).
#: (capacity, oracle, ARC's t1 last resort -> policy)
_POLICY_TABLE: Final[Mapping[EvictionPolicy, Callable[[int, NextUse | None, bool], _Policy]]] = {
    EvictionPolicy.LRU: lambda capacity, future, t1_last_resort: LruPolicy(capacity),
    EvictionPolicy.ARC: lambda capacity, future, t1_last_resort: ArcPolicy(capacity, t1_last_resort),
    EvictionPolicy.BELADY: lambda capacity, future, t1_last_resort: _belady(capacity, future),
}

#: vLLM 0.33's request-scoped policies (``request_scoped=True``); Belady ignores recency.
_REQUEST_SCOPED_TABLE: Final[Mapping[EvictionPolicy, Callable[[int], _RequestScoped]]] = {
    EvictionPolicy.LRU: RankedLruPolicy,
    EvictionPolicy.ARC: RequestArcPolicy,
}

_HIT: Final = LookupResult.HIT
_HIT_PENDING: Final = LookupResult.HIT_PENDING
_MISS: Final = LookupResult.MISS
_RETRY: Final = LookupResult.RETRY


def _require_distinct(keys: Sequence[OffloadKey], method: str) -> None:
    if len(set(keys)) != len(keys):
        raise ValueError(f"{method}: a key appears more than once in {list(keys)}")


class CpuChunkCache:
    """Slot pool, per-chunk ref counts and replacement policy of vLLM's CPU offloading manager.

    See the module docstring for the states, the simplifications and the
    invariants. All methods are synchronous and clock-free.

    Args:
        capacity_chunks: Number of slots (see :func:`capacity_from_bytes`).
        policy: Replacement policy.
        store_threshold: Offers a key needs before it is stored; values below 2
            switch the admission filter off (vLLM's default is 1).
        tracker_size: Most keys the admission filter remembers.
        future: The workload's next uses; required by (and only used by) the
            ``belady`` policy.
        request_scoped: vLLM 0.33's policies (:class:`RankedLruPolicy`,
            :class:`RequestArcPolicy`): recency comes from the request arguments
            of :meth:`prepare_store` and :meth:`observe_load` and from
            :meth:`finish_request`, not from :meth:`touch`.
        arc_t1_last_resort: ARC's last-resort victim from ``t1`` (vLLM 0.30 on;
            False: vLLM 0.29, see :class:`ArcPolicy`).

    Raises:
        ValueError: On a negative capacity or threshold, a tracker size below 1,
            or the ``belady`` policy without ``future``.
    """

    def __init__(
        self,
        capacity_chunks: int,
        policy: EvictionPolicy = EvictionPolicy.LRU,
        store_threshold: int = 0,
        tracker_size: int = 64_000,
        future: NextUse | None = None,
        request_scoped: bool = False,
        arc_t1_last_resort: bool = True,
    ) -> None:
        if capacity_chunks < 0:
            raise ValueError(f"capacity_chunks must be >= 0, got {capacity_chunks}")
        if store_threshold < 0:
            raise ValueError(f"store_threshold must be >= 0, got {store_threshold}")
        if tracker_size < 1:
            raise ValueError(f"tracker_size must be >= 1, got {tracker_size}")
        self._capacity = capacity_chunks
        self._policy_kind = EvictionPolicy(policy)
        scoped_kind = _REQUEST_SCOPED_TABLE.get(self._policy_kind) if request_scoped else None
        #: the policy again, when it is request-scoped (vLLM 0.33)
        self._scoped: _RequestScoped | None = None if scoped_kind is None else scoped_kind(capacity_chunks)
        self._policy: _Policy = (self._scoped if self._scoped is not None
                                 else _POLICY_TABLE[self._policy_kind](capacity_chunks, future,
                                                               arc_t1_last_resort))
        #: per-request accesses (request-scoped policies only), by request id
        self._accesses: dict[str, _RequestAccess] = {}
        self._store_threshold = store_threshold
        self._tracker_size = tracker_size
        #: Offer counts for admission, least recently offered first; None when off.
        self._offers: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        self._chunks: dict[OffloadKey, _Chunk] = {}
        #: Slots 0 .. _num_handed_out - 1 have been used at least once.
        self._num_handed_out = 0
        #: Freed slots; allocation pops from the end (last freed, first reused).
        self._free_list: list[int] = []
        self._num_pending = 0
        self._num_ready = 0
        self._num_loading = 0
        #: Absent keys for which lookup answers RETRY instead of MISS.
        self._uncertain: set[OffloadKey] = set()
        self._events: list[CacheEvent] = []

    # ------------------------------------------------------------------ sizes

    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self._capacity

    @property
    def never_stores(self) -> bool:
        """No slot and no offer counting: :meth:`prepare_store` of any key not
        stored answers None (no room) and changes nothing."""
        return self._capacity == 0 and self._offers is None

    @property
    def policy(self) -> EvictionPolicy:
        """The replacement policy in use."""
        return self._policy_kind

    @property
    def num_free_slots(self) -> int:
        """Slots holding no chunk: never used, or on the free list."""
        return self._capacity - self._num_handed_out + len(self._free_list)

    @property
    def num_evictable(self) -> int:
        """Chunks an eviction may take (ref count 0); always equal to :attr:`num_ready`."""
        return self._num_ready

    @property
    def num_pending(self) -> int:
        """Chunks whose store is in flight (ref count -1)."""
        return self._num_pending

    @property
    def num_loading(self) -> int:
        """Chunks read by at least one load in flight (ref count >= 1)."""
        return self._num_loading

    @property
    def num_ready(self) -> int:
        """Idle readable chunks (ref count 0)."""
        return self._num_ready

    @property
    def num_used(self) -> int:
        """Occupied slots: ``num_pending + num_ready + num_loading``.

        vLLM's usage gauge counts only the non-evictable part,
        ``num_pending + num_loading``.
        """
        return len(self._chunks)

    # --------------------------------------------------------------- queries

    def lookup(self, key: OffloadKey) -> LookupResult:
        """Say whether ``key`` can be loaded, without changing anything (no recency update).

        Args:
            key: The chunk asked for.

        Returns:
            HIT if present and readable, HIT_PENDING if its store is in flight,
            RETRY if absent but marked uncertain, MISS otherwise.
        """
        chunk = self._chunks.get(key)
        if chunk is None:
            return _RETRY if key in self._uncertain else _MISS
        return _HIT_PENDING if chunk.ref < 0 else _HIT

    def state(self, key: OffloadKey) -> ChunkState:
        """Return the state of ``key`` (MISSING if absent)."""
        chunk = self._chunks.get(key)
        if chunk is None:
            return ChunkState.MISSING
        if chunk.ref < 0:
            return ChunkState.PENDING
        return ChunkState.READY if chunk.ref == 0 else ChunkState.LOADING

    def ref_count(self, key: OffloadKey) -> int | None:
        """Return the ref count of ``key`` (-1 pending, 0 idle, k loads), or None if absent."""
        chunk = self._chunks.get(key)
        return None if chunk is None else chunk.ref

    def slot(self, key: OffloadKey) -> int | None:
        """Return the slot id of ``key``, or None if absent."""
        chunk = self._chunks.get(key)
        return None if chunk is None else chunk.slot

    def keys(self) -> Iterator[OffloadKey]:
        """Iterate over a snapshot of the present keys, in insertion order."""
        return iter(list(self._chunks))

    # ------------------------------------------------------------ uncertainty

    def mark_uncertain(self, keys: Iterable[OffloadKey]) -> None:
        """Mark keys whose answer from an asynchronous tier is still in flight.

        While absent, a marked key looks up as RETRY. The mark is cleared when
        ``prepare_store`` inserts the key, when ``complete_store`` names it, by
        :meth:`clear_uncertain` and by :meth:`reset`. vLLM's CPU manager itself
        never answers RETRY; this models its tiered backends.

        Args:
            keys: Keys to mark.
        """
        self._uncertain.update(keys)

    def clear_uncertain(self, keys: Iterable[OffloadKey]) -> None:
        """Remove the RETRY mark of ``keys`` (the slower tier has answered).

        Args:
            keys: Keys to unmark; unmarked keys are ignored.
        """
        self._uncertain.difference_update(keys)

    # ----------------------------------------------------------------- stores

    def prepare_store(self, keys: Sequence[OffloadKey], req_id: str | None = None,
                      positions: Mapping[OffloadKey, int] | None = None) -> StoreReservation | None:
        """Reserve slots for the absent ones of ``keys`` and insert them as PENDING.

        With the admission filter on, every offer is counted first (even when
        the call then returns None, as in vLLM) and only keys offered at least
        ``store_threshold`` times go on. Present keys, whatever their state,
        are dropped. If free slots do not suffice, idle chunks not among
        ``keys`` are evicted by the policy; if that is impossible nothing
        changes and None is returned.

        With a request-scoped policy and ``req_id`` given (vLLM 0.33), the offer
        is recorded first, as the request's first use of each key to be stored
        or already READY; every key offered is then protected from eviction,
        and a stored key is ranked by the request.

        Args:
            keys: Keys offered for storing, each at most once.
            req_id: The offering request (used by request-scoped policies only).
            positions: End token of each key in that request.

        Returns:
            The reservation (possibly empty, when nothing needs storing), or None when
            there is no room.

        Raises:
            ValueError: If a key appears twice.
        """
        _require_distinct(keys, "prepare_store")
        offered = keys
        if self._offers is not None:
            offers = self._offers
            self._count_offers(offers, keys)
            threshold = self._store_threshold
            keys = [key for key in keys if offers.get(key, 0) >= threshold]
        chunks = self._chunks
        to_store = [key for key in keys if key not in chunks]
        scoped = self._scoped if req_id is not None else None
        if scoped is not None:
            assert req_id is not None and positions is not None
            self._record_offer(scoped, req_id, positions, offered, to_store)
            keys = offered
        if not to_store:
            return _EMPTY_RESERVATION

        evicted: list[OffloadKey] = []
        shortfall = len(to_store) - self.num_free_slots
        if shortfall > 0:
            if shortfall > self._num_ready:
                return None
            victims = self._policy.evict(shortfall, set(keys))
            if victims is None:
                return None
            free_list = self._free_list
            for key in victims:
                free_list.append(chunks.pop(key).slot)
            self._num_ready -= len(victims)
            evicted = victims
            self._events.append(ChunksEvicted(tuple(victims)))

        slots = self._allocate(len(to_store))
        insert = self._policy.insert
        uncertain = self._uncertain
        for key, slot_id in zip(to_store, slots, strict=True):
            chunk = _Chunk(slot_id)
            chunks[key] = chunk
            if scoped is not None:
                assert req_id is not None and positions is not None
                scoped.insert_for(key, chunk, req_id, positions[key])
            else:
                insert(key, chunk)
            uncertain.discard(key)
        if scoped is not None:
            assert req_id is not None
            self._accesses[req_id].stored.update(to_store)
        self._num_pending += len(to_store)
        return StoreReservation(tuple(to_store), tuple(slots), tuple(evicted))

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """Finish the stores of ``keys``.

        On success every named PENDING key becomes READY (idle, and for LRU the
        most recently used). On failure every named PENDING key is removed and
        its slot freed. Absent or already readable keys are ignored. Every named
        key loses its RETRY mark.

        Args:
            keys: Keys of the finished store job.
            success: Whether the copy succeeded.
        """
        chunks = self._chunks
        policy = self._policy
        done: list[OffloadKey] = []
        for key in keys:
            self._uncertain.discard(key)
            chunk = chunks.get(key)
            if chunk is None or chunk.ref >= 0:
                continue
            if success:
                chunk.ref = 0
                policy.mark_evictable(key)
            else:
                policy.remove(key)
                del chunks[key]
                self._free_list.append(chunk.slot)
            done.append(key)
        if not done:
            return
        self._num_pending -= len(done)
        if success:
            self._num_ready += len(done)
            self._events.append(ChunksStored(tuple(done)))
        else:
            self._events.append(StoreCancelled(tuple(done)))

    # ------------------------------------------------------------------ loads

    def prepare_load(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """Pin ``keys`` for reading (ref count + 1) and return their slots.

        Every key is checked before anything changes, so a raise leaves the
        cache as it was. (vLLM checks and pins key by key; it has pinned the
        earlier keys when it fails, but its process dies there anyway.)

        Args:
            keys: Keys to load, each at most once.

        Returns:
            The slot id of each key, in key order.

        Raises:
            CacheAssertion: For the first key, in order, that is absent
                (``missing_chunk``) or still pending (``chunk_not_ready``).
            ValueError: If a key appears twice.
        """
        chunks = self._chunks
        found: list[_Chunk] = []
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None:
                raise CacheAssertion(key, "missing_chunk")
            if chunk.ref < 0:
                raise CacheAssertion(key, "chunk_not_ready")
            found.append(chunk)
        _require_distinct(keys, "prepare_load")
        if not found:
            return ()
        policy = self._policy
        started = 0
        for key, chunk in zip(keys, found, strict=True):
            if chunk.ref == 0:
                policy.mark_non_evictable(key)
                started += 1
            chunk.ref += 1
        self._num_ready -= started
        self._num_loading += started
        self._events.append(LoadStarted(tuple(keys)))
        return tuple(chunk.slot for chunk in found)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Unpin ``keys`` after a load (ref count - 1).

        A chunk whose last load completes becomes idle again (for LRU, the most
        recently used).

        Args:
            keys: Keys of the finished load job, each at most once.

        Raises:
            CacheInvariantError: If a key is absent or not being loaded (a
                simulator bug: vLLM never does this); nothing is changed then.
            ValueError: If a key appears twice.
        """
        chunks = self._chunks
        found: list[_Chunk] = []
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None or chunk.ref <= 0:
                what = "absent" if chunk is None else f"not being loaded (ref {chunk.ref})"
                raise CacheInvariantError(f"complete_load of chunk {key}: {what}")
            found.append(chunk)
        _require_distinct(keys, "complete_load")
        if not found:
            return
        policy = self._policy
        finished = 0
        for key, chunk in zip(keys, found, strict=True):
            chunk.ref -= 1
            if chunk.ref == 0:
                policy.mark_evictable(key)
                finished += 1
        self._num_loading -= finished
        self._num_ready += finished
        self._events.append(LoadCompleted(tuple(keys)))

    # ---------------------------------------------------------------- recency

    def observe_load(self, req_id: str, keys: Sequence[OffloadKey],
                     positions: Mapping[OffloadKey, int]) -> None:
        """``req_id`` has just pinned ``keys`` for a load (request-scoped policies only).

        Args:
            keys: The pinned keys.
            req_id: The loading request.
            positions: End token of each key in that request.
        """
        scoped = self._scoped
        if scoped is not None:
            self._record(scoped, req_id, self._access(req_id), positions, keys, keys)

    def finish_request(self, req_id: str) -> None:
        """``req_id`` finished and its final stores are prepared: commit its uses
        to a request-scoped policy, head to tail (by end token, then group);
        nothing for other policies.

        Args:
            req_id: The finished request.
        """
        access = self._accesses.pop(req_id, None)
        scoped = self._scoped
        if scoped is None:
            return
        if access is not None:
            seen = access.seen
            order = sorted(seen, key=lambda key: (seen[key], key % KEY_GROUPS))
            scoped.commit(order, access.stored - access.reused, access.reused)
        scoped.forget_request(req_id)

    def _access(self, req_id: str) -> _RequestAccess:
        access = self._accesses.get(req_id)
        if access is None:
            access = self._accesses[req_id] = _RequestAccess({}, set(), set(), set())
        return access

    def _record_offer(self, scoped: _RequestScoped, req_id: str, positions: Mapping[OffloadKey, int],
                      offered: Sequence[OffloadKey], to_store: Sequence[OffloadKey]) -> None:
        """An offer, as vLLM 0.33 records it: store misses first, then the first
        use of each key to be stored or READY (pending keys are not a use)."""
        access = self._access(req_id)
        misses = [key for key in to_store if key not in access.missed]
        if misses:
            scoped.on_store_miss(misses)
            access.missed.update(misses)
        chunks = self._chunks
        ready = [key for key in offered if (c := chunks.get(key)) is not None and c.ref >= 0]
        used = set(to_store).union(ready)
        self._record(scoped, req_id, access, positions, [key for key in offered if key in used], ready)

    @staticmethod
    def _record(scoped: _RequestScoped, req_id: str, access: _RequestAccess,
                positions: Mapping[OffloadKey, int], keys: Sequence[OffloadKey],
                reused: Sequence[OffloadKey]) -> None:
        seen = access.seen
        first = [(key, positions[key]) for key in keys if key not in seen]
        if first:
            seen.update(first)
            scoped.observe(req_id, first)
        access.reused.update(key for key in reused if key not in access.stored)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record a use of ``keys`` for the replacement policy (absent keys are ignored).

        Keys are applied from last to first, so the first key counts as the
        most recent use.

        Args:
            keys: Keys in request order.
        """
        self._policy.touch(keys)

    # ------------------------------------------------------------------ misc

    def take_events(self) -> list[CacheEvent]:
        """Return the events recorded since the previous call, oldest first, and forget them."""
        events = self._events
        self._events = []
        return events

    def reset(self) -> None:
        """Drop every chunk, whatever its state, and every RETRY mark.

        As in vLLM, no event is recorded, slot numbering starts again from 0,
        and the admission filter keeps its counts.
        """
        self._chunks.clear()
        self._policy.clear()
        self._accesses.clear()
        self._num_handed_out = 0
        self._free_list.clear()
        self._num_pending = self._num_ready = self._num_loading = 0
        self._uncertain.clear()

    def check_invariants(self) -> None:
        """Recount everything and compare with the incremental state.

        Raises:
            CacheInvariantError: Listing every disagreement found.
        """
        found: list[str] = []
        chunks = self._chunks
        pending = sum(1 for c in chunks.values() if c.ref == -1)
        ready = sum(1 for c in chunks.values() if c.ref == 0)
        loading = sum(1 for c in chunks.values() if c.ref > 0)
        if any(c.ref < -1 for c in chunks.values()):
            found.append("a ref count is below -1")
        for name, counted, kept in (
            ("pending", pending, self._num_pending),
            ("ready", ready, self._num_ready),
            ("loading", loading, self._num_loading),
        ):
            if counted != kept:
                found.append(f"{name} counter {kept} != recount {counted}")
        if not 0 <= self._num_handed_out <= self._capacity:
            found.append(f"{self._num_handed_out} slots handed out, capacity {self._capacity}")
        used = [c.slot for c in chunks.values()]
        all_slots = used + self._free_list
        if len(set(all_slots)) != len(all_slots):
            found.append("a slot is owned twice or is both owned and free")
        if len(all_slots) != self._num_handed_out:
            found.append(
                f"{len(used)} owned + {len(self._free_list)} free slots"
                f" != {self._num_handed_out} handed out"
            )
        if any(not 0 <= s < self._num_handed_out for s in all_slots):
            found.append("a slot id outside the handed-out range")
        if self._offers is not None and len(self._offers) > self._tracker_size:
            found.append(f"admission tracker holds {len(self._offers)} > {self._tracker_size}")
        found.extend(self._policy.problems(chunks))
        if found:
            raise CacheInvariantError("; ".join(found))

    # -------------------------------------------------------------- internals

    def _allocate(self, n: int) -> list[int]:
        """Hand out ``n`` slots: never-used ids ascending, then the free list from its end."""
        fresh = min(n, self._capacity - self._num_handed_out)
        start = self._num_handed_out
        slots = list(range(start, start + fresh))
        self._num_handed_out += fresh
        pop = self._free_list.pop
        slots.extend(pop() for _ in range(n - fresh))
        return slots

    def _count_offers(
        self, offers: OrderedDict[OffloadKey, int], keys: Sequence[OffloadKey]
    ) -> None:
        """Count one offer of each key in the bounded admission tracker.

        Keys already tracked are counted and refreshed first; they, and keys
        newly tracked by this call, are never dropped to make room for this
        call's other keys. A new key takes the place of the least recently
        offered unprotected key when the tracker is full, and is not tracked
        at all when every tracked key is protected.
        """
        refreshed = 0
        for key in keys:
            if key in offers:
                offers.move_to_end(key)
                offers[key] += 1
                refreshed += 1
        droppable = len(offers) - refreshed
        for key in keys:
            if key in offers:
                continue
            if len(offers) >= self._tracker_size:
                if droppable == 0:
                    continue
                offers.popitem(last=False)
                droppable -= 1
            offers[key] = 1
