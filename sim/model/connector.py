"""The offloading scheduler: lookup, load plans, store plans, job completion.

What it models
    The scheduler side of vLLM's OffloadingConnector
    (``OffloadingConnectorScheduler``) for one engine, clock-free:

    * :meth:`OffloadingScheduler.get_num_new_matched_tokens` (spec §4): the
      joint lookup over all groups (prefix lookup for full attention, suffix
      window lookup for the other kinds, lookup order, the -1 token when
      window groups exist, Mamba alignment, EAGLE peek and pop, the
      convergence loop), the "chunks being loaded" delay, then the touch;
    * :meth:`OffloadingScheduler.update_state_after_alloc` (spec §5.2): the load
      plan from the request's GPU block lists after allocation, with vLLM's
      assertions and the CPU manager's ``prepare_load`` (whose assertions are
      the headline crash);
    * :meth:`OffloadingScheduler.build_store_jobs` (spec §7.1-§7.4): storable
      chunks, ``offload_prompt_only``, the EAGLE volatile tail, store
      reachability, ``prepare_store``, touch;
    * job completion (spec §9 step 3b) and request finish.

    With secondary tiers the CPU manager is a :class:`sim.model.tiers.TieredCache`
    (same interface; a lookup may start a promotion and answer HIT_PENDING,
    which defers the request like a pending store); the connector only names
    the request around each lookup, for vLLM's per-request chunk-query counts.

    Everything that differs between vLLM 0.29 and 0.30 is asked of the
    :mod:`sim.model.windows` profile; this module never branches on the version.

    A vLLM assertion is not a simulator error: it is raised as
    :class:`ModelledCrashError` carrying a :class:`ModelledCrash`, and the
    scheduler's state is left as it was before the failing call, so that a
    caller may record the crash and go on.

Simplifications
    * One worker (job completion needs one report); no partial tails (spec
      §7.5), no per-request ``max_offload_tokens`` or ``max_num_new_tokens``
      caps, no ``prefix_cache_retention_interval``, no request-level policies
      (the CPU manager's chunk-level policy is the one modelled).
    * Flush fences (spec §7.6) are tracked per block id, and the engine asks
      which pending stores read a re-allocated block.
    * ``update_state_after_alloc`` and ``prepare_load`` are atomic here (vLLM
      mutates some state before asserting; its process then dies).

Invariants
    * a request has either one load job or any number of store jobs in flight;
    * a key is in the being-loaded set only while some load job of it runs.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Literal, Protocol, runtime_checkable

from sim.model.cpu_cache import (
    KEY_GROUPS,
    CacheAssertion,
    ChunkState,
    CpuChunkCache,
    LookupResult,
    OffloadKey,
)
from sim.model.gpu_cache import NULL_BLOCK_ID, Block
from sim.model.layout import GroupKind, GroupSpec, Layout, cdiv
from sim.model.windows import WindowProfile, store_alignment

__all__ = [
    "CrashKind",
    "DeferReason",
    "Hazard",
    "HazardKind",
    "LoadPlan",
    "MatchResult",
    "ModelledCrash",
    "ModelledCrashError",
    "OffloadingScheduler",
    "RequestLike",
    "StorePlan",
]

CrashKind = Literal["missing_chunk", "chunk_not_ready", "assertion"]
HazardKind = Literal["double_load", "unsafe_read"]
DeferReason = Literal["in_flight_jobs", "pending_or_retry", "being_loaded"]

_HIT = LookupResult.HIT
_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY
_MISS = LookupResult.MISS


@runtime_checkable
class _TieredLookup(Protocol):
    """What a tiered CPU manager (:class:`sim.model.tiers.TieredCache`) adds to a lookup."""

    def begin_lookup(self, req_id: str) -> None: ...
    def end_lookup(self, req_id: str, definite: bool) -> None: ...


class RequestLike(Protocol):
    """What the scheduler reads of a request."""

    @property
    def req_id(self) -> str: ...
    @property
    def block_hashes(self) -> Sequence[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ModelledCrash:
    """An assertion the modelled vLLM scheduler would hit (its process dies)."""

    kind: CrashKind
    group: int | None
    chunk: int | None
    message: str
    where: str

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "group": self.group, "chunk": self.chunk, "message": self.message}


class ModelledCrashError(Exception):
    """Raised where vLLM asserts; carries the :class:`ModelledCrash`."""

    def __init__(self, crash: ModelledCrash, attempt: LoadPlan | None = None) -> None:
        super().__init__(f"{crash.where}: {crash.kind}: {crash.message}")
        self.crash = crash
        #: the load that was being issued when ``prepare_load`` asserted
        self.attempt = attempt


@dataclass(frozen=True, slots=True)
class Hazard:
    """A silent misbehaviour of the modelled system (no crash)."""

    kind: HazardKind
    group: int
    chunk: int


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Answer of :meth:`OffloadingScheduler.get_num_new_matched_tokens`.

    ``tokens`` is None when the request must ask again next step.
    """

    tokens: int | None
    load_async: bool
    defer_reason: DeferReason | None = None


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """One load job (CPU -> GPU) as ``update_state_after_alloc`` builds it."""

    job_id: int
    req_id: str
    keys: tuple[OffloadKey, ...]
    chunks: tuple[tuple[int, int], ...]  #: (group, chunk) of each key, in load order
    slots: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    hazards: tuple[Hazard, ...]
    #: keys read although not ready (assertions stripped): no pin, stale data
    unsafe: tuple[OffloadKey, ...] = ()


@dataclass(frozen=True, slots=True)
class StorePlan:
    """One store job (GPU -> CPU) as ``build_store_jobs`` builds it."""

    job_id: int
    req_id: str
    keys: tuple[OffloadKey, ...]
    chunks: tuple[tuple[int, int], ...]
    slots: tuple[int, ...]
    src_block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    evicted: tuple[OffloadKey, ...]
    #: a finished request's store reads a block re-allocated this step: the
    #: worker must wait for it before the forward pass (spec §7.6)
    flush_now: bool = False


@dataclass(slots=True)
class _LoadDraft:
    """A load job being built by ``update_state_after_alloc``, group by group."""

    keys: list[OffloadKey] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)
    #: per group, the request's next chunk to store once loaded (cdiv(N, tpc))
    next_stored: list[int] = field(default_factory=list)

    def attempt(self, req_id: str, hazards: tuple[Hazard, ...] = ()) -> LoadPlan:
        """The load as it was being issued when vLLM asserted (no job id, no slots)."""
        return LoadPlan(-1, req_id, tuple(self.keys), tuple(self.chunks), (), tuple(self.dst),
                        tuple(self.sizes), tuple(self.firsts), hazards)


@dataclass(slots=True)
class _StoreBlocks:
    """The GPU side of a store job being built by ``build_store_job``."""

    chunks: list[tuple[int, int]] = field(default_factory=list)
    #: source block ids, in store order
    block_ids: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)
    #: window-group blocks, fenced from creation
    fenced: list[int] = field(default_factory=list)
    #: full-attention blocks, fenced once the request has finished
    deferred: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Job:
    req_id: str
    keys: tuple[OffloadKey, ...]
    is_store: bool
    #: window-group blocks, fenced from creation
    fenced: tuple[int, ...] = ()
    #: full-attention blocks, fenced once the request has finished
    deferred: tuple[int, ...] = ()
    #: whether ``deferred`` is fenced (the request finished)
    deferred_fenced: bool = False


@dataclass(slots=True)
class _ReqState:
    req: RequestLike
    keys: list[list[OffloadKey]]
    block_ids: list[list[int]]
    next_stored: list[int]
    num_hit_chunks: list[int]
    local_tokens: int = 0
    jobs: set[int] = field(default_factory=set)
    #: end token of each key (filled only for request-scoped CPU recency)
    ends: dict[OffloadKey, int] = field(default_factory=dict)
    finished: bool = False
    #: the finished request's final stores were built (vLLM's ``finished_signaled``): only
    #: then does the completion of its last job forget it
    signaled: bool = False
    #: every prompt chunk is past ``next_stored`` and only prompt KV is offloaded:
    #: until the request finishes (or is looked up again) no store can be built
    store_quiet: bool = False
    #: per group: the set of ids in :meth:`OffloadingScheduler._zero_range`'s
    #: slice, and that slice's ``(start, stop)`` when the set was made (None:
    #: make it again); see :meth:`OffloadingScheduler._unstored_ids`
    unstored: list[tuple[int, int, set[int]] | None] = field(default_factory=list)
    #: 0-slot cache: a full-attention group offered a chunk at this many
    #: offloadable tokens; until the next lookup every step with as many offers
    #: again (see :meth:`OffloadingScheduler.build_store_job`)
    offer_pin: int | None = None


class OffloadingScheduler:
    """Clock-free model of the OffloadingConnector's scheduler side.

    Args:
        layout: KV cache groups and chunking.
        cpu: the CPU chunk cache (the offloading manager).
        profile: OLD or NEW behaviour (:mod:`sim.model.windows`).
        prefix_caching: GPU prefix caching on (enables the being-loaded set).
        offload_prompt_only: store prompt KV only (vLLM's default: True).
        assertions: False models vLLM run with ``python -O``: the CPU
            manager's ``prepare_load`` no longer asserts readiness, so a chunk
            whose store is still in flight is read as it is (no pin, a hazard
            ``unsafe_read``); a missing chunk still kills vLLM (its lookup
            returns None and the next attribute access raises), recorded as
            the ``missing_chunk`` crash with that message. The scheduler's own
            assertions are kept.
        spec_decode_eagle: EAGLE speculative decoding is on; with no group
            annotated as EAGLE, the profile decides whether all or none are.
    """

    def __init__(
        self,
        layout: Layout,
        cpu: CpuChunkCache,
        profile: WindowProfile,
        *,
        prefix_caching: bool = True,
        offload_prompt_only: bool = True,
        spec_decode_eagle: bool = False,
        assertions: bool = True,
    ) -> None:
        self.layout = layout
        self.cpu = cpu
        self.profile = profile
        self.offload_prompt_only = offload_prompt_only
        self.assertions = assertions
        eagle = [g.eagle for g in layout.groups]
        if spec_decode_eagle and not any(eagle) and profile.unannotated_eagle_means_all:
            eagle = [True] * len(eagle)
        self.eagle: tuple[bool, ...] = tuple(eagle)
        self.being_loaded: set[OffloadKey] | None = set() if prefix_caching else None
        #: the CPU manager when it has secondary tiers (chunk-query counting per request)
        self._tiered: _TieredLookup | None = cpu if isinstance(cpu, _TieredLookup) else None
        self._reqs: dict[str, _ReqState] = {}
        #: the states holding block ids (learned since their last lookup): the
        #: only ones :meth:`zero_reallocated` can change (a waiting request holds none)
        self._holding: dict[str, _ReqState] = {}
        self._jobs: dict[int, _Job] = {}
        self._job_ids = itertools.count()
        #: block id -> how many pending store jobs read it (flush fences, spec
        #: §7.6; which jobs: :meth:`stores_reading`)
        self.block_fences: dict[int, int] = {}
        #: ``prepare_store`` answered "no room" (the chunks are offered again later)
        self.store_rejections = 0
        # hot-path tables
        self._groups: tuple[GroupSpec, ...] = layout.groups
        self._tpc = layout.tokens_per_chunk
        self._hpc = layout.hashes_per_chunk
        self._w = profile.window_chunks(layout)
        self._bs = tuple(g.tokens_per_block for g in layout.groups)
        self._order = profile.lookup_order(layout)
        self._window_groups = profile.window_groups(layout)
        self._mamba_align = layout.mamba_align
        self._scoped = profile.request_scoped_recency

    # -- requests ----------------------------------------------------------------

    def on_new_request(self, req: RequestLike) -> None:
        """Create the request's state (empty key lists)."""
        n = len(self._groups)
        self._holding.pop(req.req_id, None)
        self._reqs[req.req_id] = _ReqState(
            req, [[] for _ in range(n)], [[] for _ in range(n)], [0] * n, [0] * n, unstored=[None] * n
        )

    def has_request(self, req_id: str) -> bool:
        return req_id in self._reqs

    def in_flight_jobs(self, req_id: str) -> int:
        st = self._reqs.get(req_id)
        return len(st.jobs) if st else 0

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def _refresh_keys(self, st: _ReqState) -> None:
        hashes = st.req.block_hashes
        for g, keys in enumerate(st.keys):
            hpc = self._hpc[g]
            start = hpc * len(keys) + hpc - 1
            if start < len(hashes):
                n = len(keys)
                keys.extend(map(g.__add__, map(KEY_GROUPS.__mul__, hashes[start::hpc])))   # offload_key
                if self._scoped:
                    tpc = self._tpc[g]
                    st.ends.update((keys[j], (j + 1) * tpc) for j in range(n, len(keys)))

    def keys_of(self, req_id: str, group: int) -> list[OffloadKey]:
        """The request's current key list of ``group`` (refreshed)."""
        st = self._reqs[req_id]
        self._refresh_keys(st)
        return st.keys[group]

    # -- lookup (spec §4) --------------------------------------------------------------

    def get_num_new_matched_tokens(self, req: RequestLike, local_tokens: int) -> MatchResult:
        """How many tokens beyond ``local_tokens`` can be loaded from the CPU cache.

        Args:
            req: the request (must have been announced with :meth:`on_new_request`).
            local_tokens: L, the local GPU prefix-cache hit.

        Returns:
            The hit (None: ask again next step) and whether it loads asynchronously.
        """
        st = self._reqs[req.req_id]
        st.store_quiet = False
        for ids in st.block_ids:
            ids.clear()
        st.unstored = [None] * len(st.unstored)
        st.offer_pin = None
        self._holding.pop(req.req_id, None)
        if self.profile.restarts_store_index_on_lookup:
            st.next_stored = [0] * len(st.next_stored)
        if st.jobs:
            return MatchResult(None, False, "in_flight_jobs")
        self._refresh_keys(st)
        st.local_tokens = local_tokens
        tiered = self._tiered
        if tiered is not None:
            tiered.begin_lookup(req.req_id)
        hit, reason = self._lookup(st)
        if tiered is not None:
            tiered.end_lookup(req.req_id, hit is not None)
        total = local_tokens + (hit or 0)
        for g in range(len(self._groups)):
            st.num_hit_chunks[g] = total // self._tpc[g]
        self._touch(st)
        return MatchResult(hit, bool(hit), reason)

    def _prefix_lookup(self, keys: Sequence[OffloadKey]) -> int | None:
        lookup = self.cpu.lookup
        count = 0
        deferred = False
        for key in keys:
            r = lookup(key)
            if r is _HIT:
                count += 1
            elif r is _PENDING:
                count += 1
                deferred = True
            elif r is _RETRY:
                deferred = True
            else:
                break
        return None if deferred else count

    def _lookup(self, st: _ReqState) -> tuple[int | None, DeferReason | None]:
        """The joint complete-chunk lookup (spec §4.2 with the §4.6 profile hooks).

        The groups are asked in lookup order, each capping the common boundary;
        when a group shrinks it, every group is asked again if an answer was
        deferred, else the window groups once a window group has been asked in
        this round, until the boundary holds."""
        c = st.local_tokens
        m = self._lookup_limit(st)
        hit = 0
        deferred = False
        todo: tuple[int, ...] = self._order
        popped: set[int] = set()
        while todo:
            swept_window = False
            current, todo = todo, ()
            for g in current:
                step = self._lookup_group(st, g, c, m, popped)
                if step is None:
                    return 0, None
                m, group_deferred = step
                deferred = deferred or group_deferred
                new_hit = m - c
                if new_hit < hit:
                    todo, deferred = self._after_shrink(g, todo, deferred, swept_window, popped)
                swept_window = swept_window or self._w[g] is not None
                hit = new_hit
        if deferred:
            return None, "pending_or_retry"
        if self.being_loaded and self._hits_being_loaded(st, c, hit):
            return None, "being_loaded"
        return hit, None

    def _lookup_limit(self, st: _ReqState) -> int:
        """Tokens the lookup may cover: all of them, less the last token (always
        recomputed) when window groups exist, aligned down for Mamba."""
        m = st.req.num_tokens
        if self._window_groups:
            m -= 1  # the last token is always recomputed
            if self._mamba_align:
                m -= m % self._mamba_align
        return m

    def _lookup_group(self, st: _ReqState, g: int, c: int, m: int,
                      popped: set[int]) -> tuple[int, bool] | None:
        """One group's turn in the joint lookup: cap the boundary ``m`` by the
        group's keys and its CPU hit (prefix or window lookup), popping the
        EAGLE chunk the first time an EAGLE group hits.

        Returns:
            None when less than one chunk beyond the local hit ``c`` remains
            (the joint hit is 0), else ``(m, deferred)``: the new boundary, and
            whether the group's answer is pending or retry (``m`` then capped
            by the group's keys only).
        """
        tpc = self._tpc[g]
        m = min(m, len(st.keys[g]) * tpc)
        if m - c < tpc:
            return None
        fresh = self.eagle[g] and g not in popped
        r = self._query_group(st, g, c, m, fresh)
        if r == 0:
            return None
        deferred = r is None
        if r is not None:
            if fresh:
                r -= 1
                popped.add(g)
            m = min(m, tpc * (c // tpc + r))
        if m - c < tpc:
            return None
        return m, deferred

    def _query_group(self, st: _ReqState, g: int, c: int, m: int, fresh: bool) -> int | None:
        """Ask the CPU cache about group ``g``'s chunks from the local hit ``c``
        up to ``m`` (one more for a fresh EAGLE group where the profile widens):
        the prefix lookup for full attention, the profile's window scan for the
        other kinds. Returns the chunks hit, None when deferred."""
        prof = self.profile
        keys = st.keys[g]
        n = len(keys)
        tpc = self._tpc[g]
        query = m
        if fresh and prof.eagle_widens(self._groups[g]):
            query = min(m + tpc, n * tpc)
        end = min(-(-query // tpc), n)
        window = keys[c // tpc : end]
        w = self._w[g]
        if w is None:
            return self._prefix_lookup(window)
        init = prof.initial_window(self._groups[g], tpc, w, min(m, (end - fresh) * tpc))
        return prof.window_scan(self.cpu.lookup, window, w + fresh, None if init is None else init + fresh)

    def _after_shrink(self, g: int, todo: tuple[int, ...], deferred: bool, swept_window: bool,
                      popped: set[int]) -> tuple[tuple[int, ...], bool]:
        """Group ``g`` shrank the joint hit: a non-EAGLE group un-pops the EAGLE
        chunks; a deferral is dropped and every group asked again, else the
        window groups are asked again once a window group was passed this round.

        Returns:
            The groups still to ask and the new deferred flag.
        """
        if not self.eagle[g]:
            popped.clear()
        if deferred:
            return self._order, False
        if swept_window and not todo:
            return self._window_groups, deferred
        return todo, deferred

    def _hits_being_loaded(self, st: _ReqState, c: int, hit: int) -> bool:
        loading = self.being_loaded
        assert loading is not None
        boundary = c + hit
        for g, keys in enumerate(st.keys):
            tpc = self._tpc[g]
            window = keys[c // tpc : cdiv(boundary, tpc)]
            win = self.profile.being_loaded_window(self._groups[g], tpc, self._w[g], boundary)
            if win is not None:
                window = window[-win:]
            if any(k in loading for k in window):
                return True
        return False

    def _touch(self, st: _ReqState) -> None:
        """Recency update of the request's chunks (spec §7.4)."""
        if self._scoped:    # vLLM 0.33: no touches (the CPU cache ranks per request)
            return
        touch = self.cpu.touch
        for g, keys in enumerate(st.keys):
            w = self._w[g]
            if w is None:
                touch(keys)
            else:
                touch(keys[max(0, st.num_hit_chunks[g] - w) :])

    # -- load plan (spec §5.2) -----------------------------------------------------------

    def update_state_after_alloc(
        self,
        req: RequestLike,
        blocks: Sequence[Sequence[Block]],
        external_tokens: int,
        null_prefix: Sequence[int] | None = None,
    ) -> LoadPlan | None:
        """Build and start the load job after a successful GPU allocation.

        Args:
            req: the request.
            blocks: the request's per-group block lists after allocation.
            external_tokens: E, the hit returned by the lookup (0: nothing to do).
            null_prefix: optional per-group count of leading null blocks (known
                to the allocator); lets the search skip them without changing
                its result.

        Returns:
            The load plan, or None when ``external_tokens`` is 0.

        Raises:
            ModelledCrashError: where vLLM asserts (state unchanged).
        """
        if external_tokens == 0:
            return None
        st = self._reqs[req.req_id]
        draft = _LoadDraft()
        n_cached = st.local_tokens + external_tokens
        for g, blist in enumerate(blocks):
            self._draft_group_load(st, g, blist, n_cached, null_prefix, draft)
        if st.jobs:
            self._crash("assertion", None, None, "a load issued while other jobs are pending")
        hazards = self._double_loads(draft)
        unsafe: tuple[OffloadKey, ...] = ()
        pinned = draft.keys
        if not self.assertions:
            unsafe, pinned = self._strip_assertions(req.req_id, draft)
            hazards += tuple(Hazard("unsafe_read", g, j)
                             for k, (g, j) in zip(draft.keys, draft.chunks, strict=True) if k in unsafe)
        slots = self._prepare_load(req.req_id, draft, pinned, unsafe, hazards)
        job_id = self._start_load_job(st, req.req_id, pinned, draft.next_stored)
        return LoadPlan(job_id, req.req_id, tuple(draft.keys), tuple(draft.chunks), slots,
                        tuple(draft.dst), tuple(draft.sizes), tuple(draft.firsts), hazards, unsafe)

    def _draft_group_load(self, st: _ReqState, g: int, blist: Sequence[Block], n_cached: int,
                          null_prefix: Sequence[int] | None, draft: _LoadDraft) -> None:
        """Add group ``g``'s part of the load to ``draft``: the blocks from the
        first one to load up to ``cdiv(n_cached, bs)`` and the chunks they
        belong to, with vLLM's assertions on the block count, the window size
        and the key count."""
        bpc = self.layout.blocks_per_chunk
        nb = cdiv(n_cached, self._bs[g])
        if len(blist) < nb:
            self._crash("assertion", g, None,
                        f"group {g} has {len(blist)} GPU blocks, fewer than the {nb} the hit needs")
        first = self._first_block_to_load(st.local_tokens, g, blist, nb, null_prefix)
        pending = nb - first
        w = self._w[g]
        if w is not None and pending > w * bpc + 1:
            self._crash("assertion", g, first // bpc,
                        f"group {g}: {pending} blocks to load exceed the window "
                        f"of {w} chunks x {bpc} blocks + 1")
        nc = cdiv(n_cached, self._tpc[g])
        if pending:
            keys = st.keys[g]
            if len(keys) < nc:
                self._crash("assertion", g, len(keys),
                            f"group {g} has {len(keys)} keys, fewer than the {nc} chunks to load")
            start = first // bpc
            draft.keys.extend(keys[start:nc])
            draft.chunks.extend((g, j) for j in range(start, nc))
        draft.dst.extend(b.block_id for b in blist[first:nb])
        draft.sizes.append(pending)
        draft.firsts.append(first)
        draft.next_stored.append(nc)

    def _first_block_to_load(self, local_tokens: int, g: int, blist: Sequence[Block], nb: int,
                             null_prefix: Sequence[int] | None) -> int:
        """Index of group ``g``'s first fresh (real, unhashed) block below ``nb``,
        searched from the profile's start (``nb`` when there is none), checked
        against the local-hit boundary as the profile asserts."""
        prof = self.profile
        bs = self._bs[g]
        first = nb
        search = prof.load_search_start(local_tokens, bs)
        if null_prefix is not None and null_prefix[g] > search:
            search = null_prefix[g]
        for i in range(search, nb):
            b = blist[i]
            if b.block_id != NULL_BLOCK_ID and b.block_hash is None:
                first = i
                break
        msg = prof.local_boundary_violation(local_tokens, first, bs)
        if msg is not None:
            self._crash("assertion", g, first // self.layout.blocks_per_chunk, f"group {g}: {msg}")
        return first

    def _double_loads(self, draft: _LoadDraft) -> tuple[Hazard, ...]:
        """Hazards for chunks to load that another load job is loading already."""
        if not self.being_loaded:
            return ()
        loading = self.being_loaded
        return tuple(Hazard("double_load", g, j)
                     for k, (g, j) in zip(draft.keys, draft.chunks, strict=True) if k in loading)

    def _prepare_load(self, req_id: str, draft: _LoadDraft, pinned: list[OffloadKey],
                      unsafe: tuple[OffloadKey, ...], hazards: tuple[Hazard, ...]) -> tuple[int, ...]:
        """The CPU manager's ``prepare_load`` of the pinned keys (its assertion
        raised as a crash carrying the attempted load); the slots of every key
        to load, the unsafe ones read where they lie."""
        try:
            pinned_slots = self.cpu.prepare_load(pinned)
        except CacheAssertion as exc:
            g, j = draft.chunks[draft.keys.index(exc.key)]
            crash = ModelledCrash(exc.reason, g, j, exc.message, "prepare_load")
            raise ModelledCrashError(crash, draft.attempt(req_id, hazards)) from None
        if self._scoped and pinned:
            self.cpu.observe_load(req_id, pinned, self._reqs[req_id].ends)
        if not unsafe:
            return pinned_slots
        by_key = dict(zip(pinned, pinned_slots, strict=True))
        return tuple(by_key[k] if k in by_key else self.cpu.slot(k) or 0 for k in draft.keys)

    def _start_load_job(self, st: _ReqState, req_id: str, pinned: list[OffloadKey],
                        next_stored: list[int]) -> int:
        """Register the load job; the loaded chunks count as stored and the
        pinned ones as being loaded. Returns the job id."""
        job_id = next(self._job_ids)
        self._jobs[job_id] = _Job(req_id, tuple(pinned), is_store=False)
        st.jobs.add(job_id)
        st.next_stored = next_stored
        st.store_quiet = False
        if self.being_loaded is not None:
            self.being_loaded.update(pinned)
        return job_id

    def _strip_assertions(self, req_id: str, draft: _LoadDraft
                          ) -> tuple[tuple[OffloadKey, ...], list[OffloadKey]]:
        """``python -O``: split the keys into not-ready ones (read unpinned) and
        the rest; a missing key still kills vLLM (AttributeError on None)."""
        state = self.cpu.state
        unsafe: list[OffloadKey] = []
        pinned: list[OffloadKey] = []
        for k, (g, j) in zip(draft.keys, draft.chunks, strict=True):
            st = state(k)
            if st is ChunkState.MISSING:
                crash = ModelledCrash("missing_chunk", g, j,
                                      f"chunk {k!r} is not in the CPU cache: with assertions stripped the "
                                      "manager's lookup returns None and AttributeError: 'NoneType' object "
                                      "has no attribute 'ref_cnt' kills the scheduler", "prepare_load")
                raise ModelledCrashError(crash, draft.attempt(req_id))
            (unsafe if st is ChunkState.PENDING else pinned).append(k)
        return tuple(unsafe), pinned

    @staticmethod
    def _crash(kind: CrashKind, group: int | None, chunk: int | None, message: str,
               where: str = "update_state_after_alloc") -> None:
        raise ModelledCrashError(ModelledCrash(kind, group, chunk, message, where))

    # -- store plans (spec §7) --------------------------------------------------------

    def update_block_ids(self, req_id: str, new_block_ids: Sequence[Sequence[int]]) -> None:
        """Learn the request's newly allocated GPU block ids (per group)."""
        st = self._reqs[req_id]
        for ids, new in zip(st.block_ids, new_block_ids, strict=True):
            ids.extend(new)
        self._holding[req_id] = st

    def _zero_range(self, st: _ReqState, g: int) -> range:
        bpc = self.layout.blocks_per_chunk
        end = len(st.block_ids[g])
        if self.offload_prompt_only:
            # entries past the prompt are never stored: zeroing them is unobservable
            end = min(end, st.req.num_prompt_tokens // self._tpc[g] * bpc)
        return range(st.next_stored[g] * bpc, end)

    def zero_reallocated(self, allocated: set[int]) -> None:
        """Every request: zero the not-yet-stored window-group entries whose
        block was re-allocated this step (call before learning this step's
        new block ids, spec §7.6)."""
        if not allocated or not self._window_groups:
            return
        for st in self._holding.values():
            if st.store_quiet:
                continue
            for g in self._window_groups:
                rng = self._zero_range(st, g)
                if not rng:
                    continue
                live = self._unstored_ids(st, g, rng)
                if allocated.isdisjoint(live):   # the common case: set against set, at C speed
                    continue
                ids = st.block_ids[g]
                for i in rng:
                    if ids[i] in allocated:
                        ids[i] = NULL_BLOCK_ID
                live -= allocated   # every occurrence in the slice was zeroed

    @staticmethod
    def _unstored_ids(st: _ReqState, g: int, rng: range) -> set[int]:
        """The ids of ``st.block_ids[g][rng]`` as a set, kept across steps.

        While ``rng.start`` (``next_stored``) stays put the slice only grows at
        its end (ids are appended) or has entries zeroed (the caller takes
        those out): the set is extended by the new tail. A moved start or a
        shorter slice (the ids were cleared at a lookup, which also drops the
        set) makes it anew. So it always equals ``set(ids[rng])`` but for the
        null id (zeroed entries are not added; the step's allocated ids never
        hold it), without building that slice every step."""
        cached = st.unstored[g]
        if cached is not None:
            start, stop, live = cached
            if start == rng.start and stop <= rng.stop:
                if stop < rng.stop:
                    live.update(st.block_ids[g][stop : rng.stop])
                    st.unstored[g] = (start, rng.stop, live)
                return live
        live = set(st.block_ids[g][rng.start : rng.stop])
        st.unstored[g] = (rng.start, rng.stop, live)
        return live

    def store_idle(self, req_id: str, tokens_after_step: int) -> bool:
        """True when :meth:`build_store_job` would find nothing to offer for
        this many tokens and no entry is pending a store (decode fast-forward)."""
        st = self._reqs[req_id]
        if st.store_quiet:
            return True
        tokens = self._offloadable(st, tokens_after_step)
        for g in range(len(self._groups)):
            if self._storable(st, g, tokens) > st.next_stored[g]:
                return False
            if g in self._window_groups and self._zero_range(st, g):
                return False
        return True

    def _no_chunk_due(self, st: _ReqState, tokens_after_step: int) -> bool:
        """No group has a whole chunk beyond ``next_stored`` at this many
        tokens: :meth:`build_store_job` would offer nothing and change nothing
        (``_storable`` only lowers ``tokens // tpc``), so it need not refresh
        the keys or scan the groups (the steady decode step's common case)."""
        tokens = self._offloadable(st, tokens_after_step)
        return all(tokens < (n + 1) * tpc for n, tpc in zip(st.next_stored, self._tpc, strict=True))

    def _storable(self, st: _ReqState, g: int, tokens: int) -> int:
        n = tokens // self._tpc[g]
        decoding = tokens > st.req.num_prompt_tokens
        if self.eagle[g] and self.profile.eagle_tail_excluded(decoding, st.finished):
            n = max(0, n - 1)
        n = min(n, len(st.block_ids[g]) // self.layout.blocks_per_chunk)
        if self.profile.caps_storable_by_keys:
            n = min(n, len(st.keys[g]))
        return n

    def _offloadable(self, st: _ReqState, tokens: int) -> int:
        n = min(tokens, st.req.num_tokens)
        if self.offload_prompt_only:
            n = min(n, st.req.num_prompt_tokens)
        return n

    def build_store_job(self, req_id: str, tokens_after_step: int | None = None,
                        allocated: set[int] | frozenset[int] = frozenset()) -> StorePlan | None:
        """Store job for one request this step (spec §7.1).

        Args:
            req_id: the request.
            tokens_after_step: tokens computed by the end of this step's forward
                pass; None for a finished request (the profile decides how many).
            allocated: block ids allocated this step; a finished request's
                store reading one of them must be flushed (``flush_now``).

        Returns:
            The store plan, or None when nothing is stored (nothing new, all
            already on CPU, or no room: then the same chunks are offered next step).
        """
        st = self._reqs[req_id]
        if tokens_after_step is not None:
            if st.store_quiet:
                return None
            pin = st.offer_pin
            if pin is not None and self._offloadable(st, tokens_after_step) >= pin:
                self._refresh_keys(st)
                self.store_rejections += 1     # the offer the pin stands for, refused
                return None
            if self._no_chunk_due(st, tokens_after_step):
                self._check_quiet(st)   # as the path below does when nothing is offered
                return None
        req = st.req
        self._refresh_keys(st)
        if tokens_after_step is None:
            tokens_after_step = self.profile.finished_store_tokens(req.num_prompt_tokens, req.num_tokens)
        tokens = self._offloadable(st, tokens_after_step)
        if self.cpu.never_stores:   # a 0-slot cache: every offer is refused; only whether one is made counts
            self._refuse_offer(st, tokens)
            return None
        offered, ranges = self._offer_chunks(st, tokens)
        if not offered:
            self._advance(st, tokens)
            self._check_quiet(st)
            return None
        reservation = (self.cpu.prepare_store(offered, req_id, st.ends) if self._scoped
                       else self.cpu.prepare_store(offered))
        if reservation is None:
            self.store_rejections += 1
            return None
        if not reservation.keys:
            self._advance(st, tokens)
            self._check_quiet(st)
            return None
        self._touch(st)
        src = self._collect_store_blocks(st, ranges, set(reservation.keys))
        for g, (_, n) in enumerate(ranges):
            st.next_stored[g] = max(st.next_stored[g], n)
        self._check_quiet(st)
        job_id = next(self._job_ids)
        if st.jobs and not all(self._jobs[j].is_store for j in st.jobs):
            self._crash("assertion", None, None, "a store issued while a load is pending", "build_store_jobs")
        flush_now = self._start_store_job(st, req_id, job_id, reservation.keys, src, allocated)
        return StorePlan(job_id, req_id, reservation.keys, tuple(src.chunks), reservation.slots,
                         tuple(src.block_ids), tuple(src.sizes), tuple(src.firsts), reservation.evicted,
                         flush_now)

    def _offer_chunks(self, st: _ReqState, tokens: int) -> tuple[list[OffloadKey], list[tuple[int, int]]]:
        """The chunks to offer the CPU cache with ``tokens`` offloadable (spec §7.1-§7.3).

        Returns:
            The offered keys, group by group, and per group the chunk range
            ``(next_stored, storable)`` considered.
        """
        prompt_tokens = self._offloadable(st, st.req.num_prompt_tokens)
        offered: list[OffloadKey] = []
        ranges: list[tuple[int, int]] = []
        for g in range(len(self._groups)):
            n = self._storable(st, g, tokens)
            start = st.next_stored[g]
            prompt_chunks = prompt_tokens // self._tpc[g]
            tail = self._final_tail(st, g, n, prompt_chunks)
            if tail is not None and tail < start:
                ranges.append((tail, n))
                offered.extend(self._reconsidered_keys(st, g, tail, start, n, prompt_chunks))
                continue
            ranges.append((start, n))
            if n > start:
                offered.extend(self._reachable_keys(st, g, start, n, prompt_chunks))
        return offered, ranges

    def _final_tail(self, st: _ReqState, g: int, n: int, prompt_chunks: int) -> int | None:
        """The first chunk of the final partial segment that a finished request's
        sliding-window group (not EAGLE) looks at again when its last store is built
        (:attr:`~sim.model.windows.WindowProfile.reconsiders_final_window_tail`, vLLM 0.30
        and 0.33), or None: with ``n`` storable chunks other than the prompt's, the
        segment of the store alignment's grid (:func:`~sim.model.windows.store_alignment`)
        that ends at ``n`` chunks; its chunks the prompt's horizon deemed unreachable may
        be reachable at the final horizon."""
        if not (st.finished and self.profile.reconsiders_final_window_tail) or self.eagle[g] \
                or n == prompt_chunks or self._groups[g].kind is not GroupKind.SLIDING_WINDOW:
            return None
        align = store_alignment(self.layout)
        bs = self._groups[g].tokens_per_block
        if align is None or align % bs:
            return None
        bpc = self.layout.blocks_per_chunk
        blocks = n * bpc
        return (blocks - blocks % (align // bs)) // bpc

    def _reconsidered_keys(self, st: _ReqState, g: int, tail: int, start: int, n: int,
                           prompt_chunks: int) -> list[OffloadKey]:
        """Keys of group ``g``'s chunks ``[tail, n)`` a finished request stores (see
        :meth:`_final_tail`): those from ``start`` (``next_stored``) on as
        :meth:`_reachable_keys` finds them, and before it those that the prompt's horizon
        deemed unreachable and the final horizon (``n``) deems reachable; a chunk whose
        last block is null is never stored."""
        keys, last_ids, mask = self._reach(st, g, tail, n, prompt_chunks)
        before = self.profile.reachable_chunks(self.layout, g, self.eagle[g], tail, n, n, prompt_chunks,
                                               st.block_ids[g])
        out = []
        for k, (key, bid) in enumerate(zip(keys, last_ids, strict=True)):
            if bid == NULL_BLOCK_ID or (mask is not None and not mask[k]):
                continue
            if tail + k < start and (before is None or before[k]):
                continue     # considered before, reachable then: stored or offered already
            out.append(key)
        return out

    def _refuse_offer(self, st: _ReqState, tokens: int) -> None:
        """A 0-slot cache's store step: count the offer, if one is made (and pin
        a full-attention group's, see :meth:`_offering_group`), or move on."""
        g = self._offering_group(st, tokens)
        if g is None:
            self._advance(st, tokens)
            self._check_quiet(st)
            return
        self.store_rejections += 1
        pins = self._w[g] is None and not self.eagle[g] and self.profile.caps_storable_by_keys
        if pins and not st.finished:
            st.offer_pin = tokens

    def _offering_group(self, st: _ReqState, tokens: int) -> int | None:
        """The group of the first chunk :meth:`_offer_chunks` would offer (None:
        ``_offer_chunks(st, tokens)[0]`` is empty), stopping there (a 0-slot
        cache refuses every offer, so nothing else of the offer matters).
        Full-attention groups are asked first where the order cannot matter (the
        profile caps storable chunks by keys, so no group's scan can raise).

        Why a full-attention group's offer pins (``offer_pin``): its storable
        count only grows with the tokens, the ids and the keys (all only
        appended to until the next lookup, which drops the pin); its
        ``next_stored`` moves only when nothing is offered or a store is made
        (never, on a 0-slot cache); its ids are never zeroed (only window
        groups' are). So with at least as many tokens it offers again, and it
        is asked before any window group. EAGLE groups (whose storable count
        depends on decoding and finishing) and profiles that do not cap by
        keys (whose window scans may raise first) do not pin."""
        prompt_tokens = self._offloadable(st, st.req.num_prompt_tokens)
        order = sorted(range(len(self._groups)), key=lambda g: self._w[g] is not None) \
            if self.profile.caps_storable_by_keys else range(len(self._groups))
        for g in order:
            n = self._storable(st, g, tokens)
            start = st.next_stored[g]
            pc = prompt_tokens // self._tpc[g]
            tail = self._final_tail(st, g, n, pc)
            if tail is not None and tail < start:
                if self._reconsidered_keys(st, g, tail, start, n, pc):
                    return g
                continue
            if n <= start:
                continue
            keys, last_ids, mask = self._reach(st, g, start, n, prompt_tokens // self._tpc[g])
            if len(keys) != len(last_ids):
                self._reachable_keys(st, g, start, n, prompt_tokens // self._tpc[g])   # raises, as there
            if any(bid != NULL_BLOCK_ID and (mask is None or mask[k]) for k, bid in enumerate(last_ids)):
                return g
        return None

    def _reach(self, st: _ReqState, g: int, start: int, n: int, prompt_chunks: int
               ) -> tuple[list[OffloadKey], list[int], list[bool] | None]:
        """Group ``g``'s chunks ``[start, n)``: their keys, the ids of their
        last blocks, and the profile's store-reachability mask (None: all; full
        attention has none)."""
        bpc = self.layout.blocks_per_chunk
        keys = st.keys[g][start:n]
        last_ids = st.block_ids[g][start * bpc + bpc - 1 : n * bpc : bpc]
        mask = None
        if self._w[g] is not None:
            horizon = self._store_horizon(st, g, n, prompt_chunks)
            mask = self.profile.reachable_chunks(self.layout, g, self.eagle[g], start, n, n, horizon,
                                                 st.block_ids[g])
        return keys, last_ids, mask

    def _reachable_keys(self, st: _ReqState, g: int, start: int, n: int,
                        prompt_chunks: int) -> list[OffloadKey]:
        """Keys of group ``g``'s chunks ``[start, n)`` worth storing: the chunk's
        last block is real and, for a window group, the profile deems the chunk
        reachable by a later lookup (store reachability, spec §7.3)."""
        keys, last_ids, mask = self._reach(st, g, start, n, prompt_chunks)
        return [key for k, (key, bid) in enumerate(zip(keys, last_ids, strict=True))
                if bid != NULL_BLOCK_ID and (mask is None or mask[k])]

    def _collect_store_blocks(self, st: _ReqState, ranges: Sequence[tuple[int, int]],
                              accepted: set[OffloadKey]) -> _StoreBlocks:
        """The GPU blocks of the accepted chunks, group by group (null blocks
        left out), with the fences they take (spec §7.6)."""
        bpc = self.layout.blocks_per_chunk
        out = _StoreBlocks()
        for g, (start, n) in enumerate(ranges):
            ids = st.block_ids[g]
            keys = st.keys[g]
            taken = [j for j in range(start, n) if keys[j] in accepted]
            out.chunks += [(g, j) for j in taken]
            # the accepted chunks' blocks in order, by slices: one when the chunks are
            # consecutive (the usual case), else one per chunk; null blocks (a window
            # group's skipped ones) are left out; ``first``: the index of the first real one
            if taken and taken[-1] - taken[0] + 1 == len(taken):
                spans = [(taken[0] * bpc, (taken[-1] + 1) * bpc)]
            else:
                spans = [(j * bpc, j * bpc + bpc) for j in taken]
            if spans and spans[-1][1] > len(ids):   # a slice would cut short what indexing refuses
                raise IndexError(f"group {g}: chunk {taken[-1]} lies past the request's {len(ids)} block ids")
            gids: list[int] = []
            first: int | None = None
            for lo, hi in spans:
                seg = ids[lo:hi]
                if NULL_BLOCK_ID in seg:
                    if first is None:
                        first = next((lo + i for i, bid in enumerate(seg) if bid != NULL_BLOCK_ID), None)
                    seg = [bid for bid in seg if bid != NULL_BLOCK_ID]
                elif first is None:
                    first = lo
                gids += seg
            out.block_ids += gids
            (out.fenced if self._w[g] is not None else out.deferred).extend(gids)
            out.sizes.append(len(gids))
            out.firsts.append(first or 0)
        return out

    def _start_store_job(self, st: _ReqState, req_id: str, job_id: int, keys: tuple[OffloadKey, ...],
                         src: _StoreBlocks, allocated: set[int] | frozenset[int]) -> bool:
        """Register the store job and its flush fences (a finished request's
        full-attention blocks are fenced at once). Returns ``flush_now``:
        whether the store reads a block re-allocated this step."""
        st.jobs.add(job_id)
        job = self._jobs[job_id] = _Job(req_id, keys, True, tuple(src.fenced), tuple(src.deferred))
        self._fence(job.fenced)
        if not st.finished:
            return False
        self._fence_deferred(job)
        return any(bid in allocated for bid in src.deferred)

    def _fence_deferred(self, job: _Job) -> None:
        job.deferred_fenced = True
        self._fence(job.deferred)

    def _fence(self, blocks: Sequence[int]) -> None:
        """Count one more job reading each of ``blocks`` (distinct ids: a job's blocks
        are distinct slots of its request's block tables), at C speed."""
        fences = self.block_fences
        fences.update(zip(blocks, map((1).__add__, map(fences.get, blocks, repeat(0))), strict=True))

    def _unfence(self, blocks: Sequence[int]) -> None:
        """One job fewer reads each of ``blocks``."""
        fences = self.block_fences
        if all(map((1).__eq__, map(fences.__getitem__, blocks))):   # the usual case, in C
            deque(map(fences.__delitem__, blocks), maxlen=0)
            return
        for bid in blocks:
            n = fences[bid]
            if n == 1:
                del fences[bid]
            else:
                fences[bid] = n - 1

    def _store_horizon(self, st: _ReqState, g: int, n: int, prompt_chunks: int) -> int | None:
        if self.eagle[g]:
            return None
        if st.finished:
            return n
        return prompt_chunks if n <= prompt_chunks else None

    def _check_quiet(self, st: _ReqState) -> None:
        if not self.offload_prompt_only or st.finished:
            return
        cap = self._offloadable(st, st.req.num_prompt_tokens)
        st.store_quiet = all(n >= cap // t for n, t in zip(st.next_stored, self._tpc, strict=True))

    def _advance(self, st: _ReqState, tokens: int) -> None:
        for g in range(len(self._groups)):
            st.next_stored[g] = max(st.next_stored[g], self._storable(st, g, tokens))

    def stores_reading(self, block_ids: set[int]) -> set[int]:
        """Pending store jobs that read any of ``block_ids`` (to flush, spec §7.6)."""
        hit = self.block_fences.keys() & block_ids    # the fenced ones, found at C speed
        if not hit:
            return set()
        return {j for j, job in self._jobs.items() if job.is_store and (
            not hit.isdisjoint(job.fenced) or (job.deferred_fenced and not hit.isdisjoint(job.deferred)))}

    def store_jobs_of(self, req_id: str) -> set[int]:
        st = self._reqs.get(req_id)
        return {j for j in st.jobs if self._jobs[j].is_store} if st else set()

    # -- completion and finish (spec §9) ------------------------------------------------

    def complete_job(self, job_id: int) -> tuple[str, bool]:
        """A transfer job finished on the (single) worker.

        Returns:
            ``(req_id, is_store)`` of the job.
        """
        job = self._jobs.pop(job_id)
        if job.is_store:
            self.cpu.complete_store(job.keys)
            self._unfence(job.fenced)
            if job.deferred_fenced:
                self._unfence(job.deferred)
        else:
            self.cpu.complete_load(job.keys)
            if self.being_loaded is not None:
                self.being_loaded.difference_update(job.keys)
        st = self._reqs.get(job.req_id)
        if st is not None:
            st.jobs.discard(job_id)
            if st.signaled and not st.jobs:   # not before its final stores were built
                self._forget(job.req_id)
        return job.req_id, job.is_store

    def request_finished(self, req_id: str) -> None:
        """The request finished; its final stores come with the next step's
        :meth:`build_store_job` (call it with ``tokens_after_step=None``)."""
        st = self._reqs[req_id]
        self._refresh_keys(st)
        st.finished = True
        st.store_quiet = False
        for j in st.jobs:
            job = self._jobs[j]
            if job.is_store and not job.deferred_fenced:
                self._fence_deferred(job)

    def finish_recency(self, req_id: str) -> None:
        """The request's final stores are prepared: the CPU cache commits its
        uses (request-scoped recency only; vLLM 0.33 does this after the step's
        store jobs are built)."""
        if self._scoped:
            self.cpu.finish_request(req_id)

    def drop_if_idle(self, req_id: str) -> None:
        """A finished request's final stores are built (vLLM: ``finished_signaled``): forget
        it now if it has no job in flight, else when its last job completes."""
        st = self._reqs.get(req_id)
        if st is None or not st.finished:
            return
        st.signaled = True
        if not st.jobs:
            self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        del self._reqs[req_id]
        self._holding.pop(req_id, None)
