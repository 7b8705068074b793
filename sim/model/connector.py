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
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Literal, Protocol

from sim.model.cpu_cache import CacheAssertion, ChunkState, CpuChunkCache, LookupResult, OffloadKey
from sim.model.gpu_cache import NULL_BLOCK_ID, Block
from sim.model.layout import GroupSpec, Layout, cdiv
from sim.model.windows import WindowProfile

__all__ = [
    "CrashKind",
    "DeferReason",
    "Hazard",
    "LoadPlan",
    "MatchResult",
    "ModelledCrash",
    "ModelledCrashError",
    "OffloadingScheduler",
    "RequestLike",
    "StorePlan",
]

CrashKind = Literal["missing_chunk", "chunk_not_ready", "assertion"]
DeferReason = Literal["in_flight_jobs", "pending_or_retry", "being_loaded"]

_HIT = LookupResult.HIT
_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY
_MISS = LookupResult.MISS


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

    kind: Literal["double_load", "unsafe_read"]
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
class _Job:
    req_id: str
    keys: tuple[OffloadKey, ...]
    is_store: bool
    #: window-group blocks, fenced from creation
    fenced: tuple[int, ...] = ()
    #: full-attention blocks, fenced once the request has finished
    deferred: tuple[int, ...] = ()


@dataclass(slots=True)
class _ReqState:
    req: RequestLike
    keys: list[list[OffloadKey]]
    block_ids: list[list[int]]
    next_stored: list[int]
    num_hit_chunks: list[int]
    local_tokens: int = 0
    jobs: set[int] = field(default_factory=set)
    finished: bool = False
    #: every prompt chunk is past ``next_stored`` and only prompt KV is offloaded:
    #: until the request finishes (or is looked up again) no store can be built
    store_quiet: bool = False


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
        self._reqs: dict[str, _ReqState] = {}
        self._jobs: dict[int, _Job] = {}
        self._job_ids = itertools.count()
        #: block id -> pending store jobs reading it (flush fences, spec §7.6)
        self.block_fences: dict[int, set[int]] = {}
        #: ``prepare_store`` answered "no room" (the chunks are offered again later)
        self.store_rejections = 0
        # hot-path tables
        self._groups: tuple[GroupSpec, ...] = layout.groups
        self._tpc = layout.tokens_per_chunk
        self._hpc = layout.hashes_per_chunk
        self._w = layout.window_chunks
        self._bs = tuple(g.tokens_per_block for g in layout.groups)
        self._order = layout.lookup_order
        self._window_groups = layout.window_groups
        self._mamba_align = layout.mamba_align

    # -- requests ----------------------------------------------------------------

    def on_new_request(self, req: RequestLike) -> None:
        """Create the request's state (empty key lists)."""
        n = len(self._groups)
        self._reqs[req.req_id] = _ReqState(
            req, [[] for _ in range(n)], [[] for _ in range(n)], [0] * n, [0] * n
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
                keys.extend(zip(hashes[start::hpc], repeat(g)))

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
        if st.jobs:
            return MatchResult(None, False, "in_flight_jobs")
        self._refresh_keys(st)
        st.local_tokens = local_tokens
        hit, reason = self._lookup(st)
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
        """The joint complete-chunk lookup (spec §4.2 with the §4.6 profile hooks)."""
        prof = self.profile
        scan = prof.window_scan
        lookup = self.cpu.lookup
        tpcs, ws, groups, eagle = self._tpc, self._w, self._groups, self.eagle
        c = st.local_tokens
        m = st.req.num_tokens
        if self._window_groups:
            m -= 1  # the last token is always recomputed
            if self._mamba_align:
                m -= m % self._mamba_align
        hit = 0
        deferred = False
        todo: tuple[int, ...] = self._order
        popped: set[int] = set()
        while todo:
            swept_window = False
            current, todo = todo, ()
            for g in current:
                keys = st.keys[g]
                n = len(keys)
                tpc = tpcs[g]
                m = min(m, n * tpc)
                if m - c < tpc:
                    return 0, None
                fresh = eagle[g] and g not in popped
                w = ws[g]
                query = m
                if fresh and prof.eagle_widens(groups[g]):
                    query = min(m + tpc, n * tpc)
                end = min(-(-query // tpc), n)
                start = c // tpc
                window = keys[start:end]
                if w is None:
                    r = self._prefix_lookup(window)
                else:
                    init = prof.initial_window(groups[g], tpc, w, min(m, (end - fresh) * tpc))
                    r = scan(lookup, window, w + fresh, None if init is None else init + fresh)
                if r == 0:
                    return 0, None
                if r is None:
                    deferred = True
                else:
                    if fresh:
                        r -= 1
                        popped.add(g)
                    m = min(m, tpc * (start + r))
                new_hit = m - c
                if new_hit < tpc:
                    return 0, None
                if new_hit < hit:
                    if not eagle[g]:
                        popped.clear()
                    if deferred:
                        deferred = False
                        todo = self._order
                    elif swept_window and not todo:
                        todo = self._window_groups
                swept_window = swept_window or w is not None
                hit = new_hit
        if deferred:
            return None, "pending_or_retry"
        if self.being_loaded and self._hits_being_loaded(st, c, hit):
            return None, "being_loaded"
        return hit, None

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
        prof = self.profile
        bpc = self.layout.blocks_per_chunk
        c = st.local_tokens
        n_cached = c + external_tokens
        keys_to_load: list[OffloadKey] = []
        chunks: list[tuple[int, int]] = []
        dst: list[int] = []
        sizes: list[int] = []
        firsts: list[int] = []
        next_stored: list[int] = []
        for g, blist in enumerate(blocks):
            bs = self._bs[g]
            nb = cdiv(n_cached, bs)
            if len(blist) < nb:
                self._crash("assertion", g, None,
                            f"group {g} has {len(blist)} GPU blocks, fewer than the {nb} the hit needs")
            first = nb
            search = prof.load_search_start(c, bs)
            if null_prefix is not None and null_prefix[g] > search:
                search = null_prefix[g]
            for i in range(search, nb):
                b = blist[i]
                if b.block_id != NULL_BLOCK_ID and b.block_hash is None:
                    first = i
                    break
            msg = prof.local_boundary_violation(c, first, bs)
            if msg is not None:
                self._crash("assertion", g, first // bpc, f"group {g}: {msg}")
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
                keys_to_load.extend(keys[start:nc])
                chunks.extend((g, j) for j in range(start, nc))
            dst.extend(b.block_id for b in blist[first:nb])
            sizes.append(pending)
            firsts.append(first)
            next_stored.append(nc)
        if st.jobs:
            self._crash("assertion", None, None, "a load issued while other jobs are pending")
        hazards: tuple[Hazard, ...] = ()
        if self.being_loaded:
            hazards = tuple(Hazard("double_load", g, j)
                            for k, (g, j) in zip(keys_to_load, chunks, strict=True)
                            if k in self.being_loaded)
        unsafe: tuple[OffloadKey, ...] = ()
        pinned = keys_to_load
        if not self.assertions:
            unsafe, pinned = self._strip_assertions(req.req_id, keys_to_load, chunks, dst, sizes, firsts)
            hazards += tuple(Hazard("unsafe_read", g, j)
                             for k, (g, j) in zip(keys_to_load, chunks, strict=True) if k in unsafe)
        try:
            pinned_slots = self.cpu.prepare_load(pinned)
        except CacheAssertion as exc:
            g, j = chunks[keys_to_load.index(exc.key)]
            attempt = LoadPlan(-1, req.req_id, tuple(keys_to_load), tuple(chunks), (), tuple(dst),
                               tuple(sizes), tuple(firsts), hazards)
            crash = ModelledCrash(exc.reason, g, j, exc.message, "prepare_load")
            raise ModelledCrashError(crash, attempt) from None
        if unsafe:
            by_key = dict(zip(pinned, pinned_slots, strict=True))
            slots = tuple(by_key[k] if k in by_key else self.cpu.slot(k) or 0 for k in keys_to_load)
        else:
            slots = pinned_slots
        job_id = next(self._job_ids)
        self._jobs[job_id] = _Job(req.req_id, tuple(pinned), is_store=False)
        st.jobs.add(job_id)
        st.next_stored = next_stored
        st.store_quiet = False
        if self.being_loaded is not None:
            self.being_loaded.update(pinned)
        return LoadPlan(job_id, req.req_id, tuple(keys_to_load), tuple(chunks), slots,
                        tuple(dst), tuple(sizes), tuple(firsts), hazards, unsafe)

    def _strip_assertions(self, req_id: str, keys: list[OffloadKey], chunks: list[tuple[int, int]],
                          dst: list[int], sizes: list[int], firsts: list[int]
                          ) -> tuple[tuple[OffloadKey, ...], list[OffloadKey]]:
        """``python -O``: split the keys into not-ready ones (read unpinned) and
        the rest; a missing key still kills vLLM (AttributeError on None)."""
        state = self.cpu.state
        unsafe: list[OffloadKey] = []
        pinned: list[OffloadKey] = []
        for k, (g, j) in zip(keys, chunks, strict=True):
            st = state(k)
            if st is ChunkState.MISSING:
                attempt = LoadPlan(-1, req_id, tuple(keys), tuple(chunks), (), tuple(dst), tuple(sizes),
                                   tuple(firsts), ())
                crash = ModelledCrash("missing_chunk", g, j,
                                      f"chunk {k!r} is not in the CPU cache: with assertions stripped the "
                                      "manager's lookup returns None and AttributeError: 'NoneType' object "
                                      "has no attribute 'ref_cnt' kills the scheduler", "prepare_load")
                raise ModelledCrashError(crash, attempt)
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

    def zero_block_ids(self, req_id: str, group: int, block_ids: set[int]) -> None:
        """Forget blocks of a window group that were freed and re-allocated
        before being stored (spec §7.6): their entries become 0."""
        ids = self._reqs[req_id].block_ids[group]
        start = self._reqs[req_id].next_stored[group] * self.layout.blocks_per_chunk
        for i in range(start, len(ids)):
            if ids[i] in block_ids:
                ids[i] = NULL_BLOCK_ID

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
        for st in self._reqs.values():
            for g in self._window_groups:
                if st.store_quiet:
                    break
                ids = st.block_ids[g]
                for i in self._zero_range(st, g):
                    if ids[i] in allocated:
                        ids[i] = NULL_BLOCK_ID

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
        if st.store_quiet and tokens_after_step is not None:
            return None
        req = st.req
        self._refresh_keys(st)
        if tokens_after_step is None:
            tokens_after_step = self.profile.finished_store_tokens(req.num_prompt_tokens, req.num_tokens)
        tokens = self._offloadable(st, tokens_after_step)
        prompt_chunks_tokens = self._offloadable(st, req.num_prompt_tokens)
        bpc = self.layout.blocks_per_chunk
        offered: list[OffloadKey] = []
        ranges: list[tuple[int, int]] = []
        for g in range(len(self._groups)):
            n = self._storable(st, g, tokens)
            start = st.next_stored[g]
            ranges.append((start, n))
            if n <= start:
                continue
            keys = st.keys[g][start:n]
            last_ids = st.block_ids[g][start * bpc + bpc - 1 : n * bpc : bpc]
            mask = None
            if self._w[g] is not None:
                horizon = self._store_horizon(st, g, n, prompt_chunks_tokens // self._tpc[g])
                mask = self.profile.reachable_chunks(self.layout, g, self.eagle[g], start, n, n, horizon)
            for k, (key, bid) in enumerate(zip(keys, last_ids, strict=True)):
                if bid == NULL_BLOCK_ID or (mask is not None and not mask[k]):
                    continue
                offered.append(key)
        if not offered:
            self._advance(st, tokens)
            self._check_quiet(st)
            return None
        plan = self.cpu.prepare_store(offered)
        if plan is None:
            self.store_rejections += 1
            return None
        if not plan.keys:
            self._advance(st, tokens)
            self._check_quiet(st)
            return None
        self._touch(st)
        accepted = set(plan.keys)
        src: list[int] = []
        sizes: list[int] = []
        firsts: list[int] = []
        chunks: list[tuple[int, int]] = []
        fenced: list[int] = []
        deferred: list[int] = []
        for g, (start, n) in enumerate(ranges):
            ids = st.block_ids[g]
            count = 0
            first: int | None = None
            for j in range(start, max(start, n)):
                if st.keys[g][j] not in accepted:
                    continue
                chunks.append((g, j))
                for i in range(j * bpc, j * bpc + bpc):
                    bid = ids[i]
                    if bid == NULL_BLOCK_ID:
                        continue
                    if first is None:
                        first = i
                    src.append(bid)
                    count += 1
                    if self._w[g] is not None:
                        fenced.append(bid)
                    else:
                        deferred.append(bid)
            sizes.append(count)
            firsts.append(first or 0)
            st.next_stored[g] = max(st.next_stored[g], n)
        self._check_quiet(st)
        job_id = next(self._job_ids)
        if st.jobs and not all(self._jobs[j].is_store for j in st.jobs):
            self._crash("assertion", None, None, "a store issued while a load is pending", "build_store_jobs")
        st.jobs.add(job_id)
        self._jobs[job_id] = _Job(req_id, plan.keys, True, tuple(fenced), tuple(deferred))
        for bid in fenced:
            self.block_fences.setdefault(bid, set()).add(job_id)
        flush_now = False
        if st.finished:
            for bid in deferred:
                self.block_fences.setdefault(bid, set()).add(job_id)
            flush_now = any(bid in allocated for bid in deferred)
        return StorePlan(job_id, req_id, plan.keys, tuple(chunks), plan.slots, tuple(src),
                         tuple(sizes), tuple(firsts), plan.evicted, flush_now)

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
        out: set[int] = set()
        for bid in block_ids:
            out |= self.block_fences.get(bid, set())
        return out

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
            fences = self.block_fences
            for bid in (*job.fenced, *job.deferred):
                jobs = fences.get(bid)
                if jobs is not None:
                    jobs.discard(job_id)
                    if not jobs:
                        del fences[bid]
        else:
            self.cpu.complete_load(job.keys)
            if self.being_loaded is not None:
                self.being_loaded.difference_update(job.keys)
        st = self._reqs.get(job.req_id)
        if st is not None:
            st.jobs.discard(job_id)
            if st.finished and not st.jobs:
                del self._reqs[job.req_id]
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
            if job.is_store:
                for bid in job.deferred:
                    self.block_fences.setdefault(bid, set()).add(j)

    def drop_if_idle(self, req_id: str) -> None:
        """Forget a finished request once it has no job in flight."""
        st = self._reqs.get(req_id)
        if st is not None and st.finished and not st.jobs:
            del self._reqs[req_id]

    def cancel_load(self, req_id: str) -> None:
        """Undo a load job that was never started (used when the engine records
        a crash and drops the request's external hit)."""
        st = self._reqs[req_id]
        for j in list(st.jobs):
            job = self._jobs[j]
            if not job.is_store:
                self.complete_job(j)
