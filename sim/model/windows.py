"""OLD (vLLM 0.29.0), NEW (vLLM 0.30.0) and LATEST (vLLM 0.33.0) behaviour profiles.

Every rule in which the versions of the OffloadingConnector scheduler differ
lives here, as a method or flag of a small profile object that the connector
(and the decision kernel) consults. No other module branches on the window
logic.

The headline difference (spec §4.6, §6): the lookup verifies a window of
``w_g = cdiv(W, tpc)`` chunks whose right edge is rounded UP to the group's
chunk grid, but GPU allocation retains the window that ends at the actual hit
boundary N, which for an unaligned N reaches one chunk further left. OLD then
loads a chunk it never looked up; NEW demands ``loadwin_g(N)`` chunks for the
first (rightmost) run of the window search, tracks store-pending chunks only
inside the run it returns, and uses ``loadwin_g(N)`` for the
"chunks being loaded" check as well. LATEST adds a sliding-window group's
``extra_retained_tokens`` e (multi-module MTP) to every window it sizes, which
NEW ignores (spec §10 E4: OLD and NEW crash there); see docs/latest.md.

The differences modelled (W: the window in tokens, e: its
``extra_retained_tokens``; ``loadwin(N) = max(w_g, cdiv(W - 1 + pad, tpc))``
with ``pad = -N mod tpc``, and ``loadwin_e`` the same with ``W - 1 + e``):

===============================  ======================  =========================  =========================
rule                             OLD (0.29.0)            NEW (0.30.0)               LATEST (0.33.0)
===============================  ======================  =========================  =========================
window chunks of a window group  cdiv(W, tpc)            cdiv(W, tpc)               max(it, cdiv(W-1+e, tpc))
window search, first run         need chunks             loadwin(cand) (+1 eagle)   loadwin_e(cand), +1 eagle
HIT_PENDING in the window scan   defers, wherever it is  defers in the run only     defers in the run only
EAGLE query widening (peek)      window groups only      every EAGLE group          every EAGLE group
being-loaded check window        w_g                     loadwin(C + hit)           loadwin_e(C + hit)
load start search after alloc    block 0, C <= first*bs  cdiv(C, bs)                cdiv(C, bs)
store length at finish           num_tokens              max(prompt, tokens - 1)    max(prompt, tokens - 1)
EAGLE tail excluded from stores  while decoding          decoding, not finished     decoding, not finished
storable chunks capped by keys   no                      yes                        yes
spec decode, no group annotated  every group is EAGLE    no group is EAGLE          no group is EAGLE
store reachability (window)      frontier segments       block mask, store horizon  that mask over W + e
null block in a stored chunk     last block checked      last block checked         reachable blocks checked
store index at a lookup          kept                    kept                       restarts at chunk 0
CPU recency (LRU / ARC)          touch at lookup, store  touch at lookup, store     per request, at finish
ARC, T1 and T2 both declined    eviction refused        last victim from T1        last victim from T1
skipped request holding no KV    skipped queue (first)   skipped queue (first)      front of the waiting queue
===============================  ======================  =========================  =========================

The window chunks feed the lookup order (window groups by ``w_g``
descending), the ordinary window of the search and the assertion
``pending <= w_g * bpc + 1`` of the load plan (spec §10 E7).

CPU recency: OLD and NEW touch a request's chunks at each lookup and after
each store it prepares; LATEST (0.33) does not touch: the CPU manager's
policy sees a request's first offer or read of each chunk and commits its
chunks when it finishes (:class:`sim.model.cpu_cache.RankedLruPolicy`,
:class:`sim.model.cpu_cache.RequestArcPolicy`); the profile says which
through ``request_scoped_recency``. Not modelled for LATEST: its
per-request ``max_load_tokens`` cap and the synchronous-load budget (off
by default).

CPU eviction under ARC: when neither T1's turn nor T2 yields a victim, 0.30
and 0.33 take one from T1 as a last resort; 0.29 refuses the eviction (and
so the store): ``arc_t1_last_resort``.

The waiting queues: a request the scheduler skips in a step (its lookup
deferred, or its load still in flight) goes, in 0.29 and 0.30, to a
``skipped_waiting`` queue that the next step drains before ``waiting``;
0.33 keeps only the requests that hold KV blocks (a load in flight, or
tokens already computed) in such a queue (``kv_holding_waiting``) and puts
the others back at the front of ``waiting``, where a request preempted
later goes in front of them: ``requeues_skipped_without_kv``.
"""


from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import ClassVar

from sim.model.cpu_cache import LookupResult, OffloadKey
from sim.model.layout import GroupKind, GroupSpec, Layout, cdiv

__all__ = ["LATEST", "NEW", "OLD", "WindowLogic", "WindowProfile", "profile"]

_HIT = LookupResult.HIT
_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY

Lookup = Callable[[OffloadKey], LookupResult]


class WindowLogic(enum.StrEnum):
    """Which vLLM version's scheduler logic to model."""

    OLD = "old"
    NEW = "new"
    LATEST = "latest"


class WindowProfile:
    """Behaviour shared by both versions; subclasses override what differs."""

    logic: ClassVar[WindowLogic]
    #: EAGLE peek widening applies to full-attention EAGLE groups too.
    widens_full_attention_eagle: ClassVar[bool]
    #: when speculative decoding is on and no group is annotated as a drafter,
    #: every group is treated as an EAGLE group (OLD) or none is (NEW).
    unannotated_eagle_means_all: ClassVar[bool]
    #: storable chunks are capped by the number of keys of the group.
    caps_storable_by_keys: ClassVar[bool]

    #: every lookup restarts the request's store index at chunk 0 (LATEST)
    restarts_store_index_on_lookup: ClassVar[bool] = False
    #: the CPU cache's recency is request-scoped (vLLM 0.33): the connector
    #: never touches; it reports offers, loads and finishes to the cache
    request_scoped_recency: ClassVar[bool] = False
    #: ARC takes a last-resort victim from T1 when T2 has none (0.30 on; 0.29
    #: refuses the eviction)
    arc_t1_last_resort: ClassVar[bool] = True
    #: a skipped request that holds no KV blocks goes back to the front of the
    #: waiting queue, not to the queue of skipped requests drained first (0.33)
    requeues_skipped_without_kv: ClassVar[bool] = False
    #: a hybrid local lookup lets an EAGLE group match one block past the candidate
    #: length up to the request's hashed tokens, not only up to the hit limit (the
    #: prompt less one token) (0.33; :func:`sim.model.gpu_cache.eagle_hit`)
    eagle_margin_past_limit: ClassVar[bool] = False
    #: a finished request's last store looks again at a sliding-window group's final
    #: partial segment: chunks the prompt's horizon deemed unreachable may be stored
    #: (0.30 and 0.33; ``OffloadingConnectorScheduler._build_store_jobs``)
    reconsiders_final_window_tail: ClassVar[bool] = False

    # -- group configuration ----------------------------------------------------------

    def window_chunks(self, layout: Layout) -> tuple[int | None, ...]:
        """``w_g`` of every group (None for full attention)."""
        return layout.window_chunks

    def lookup_order(self, layout: Layout) -> tuple[int, ...]:
        """Full-attention groups in index order, then window-type groups by
        this profile's ``w_g`` descending (stable)."""
        return layout.lookup_order

    def window_groups(self, layout: Layout) -> tuple[int, ...]:
        """Window-type groups in lookup order."""
        return layout.window_groups

    # -- lookup -------------------------------------------------------------------

    def window_scan(
        self, lookup: Lookup, keys: Sequence[OffloadKey], need: int, initial: int | None
    ) -> int | None:
        """Suffix-window search (spec §4.4): end index (exclusive, relative to
        ``keys``) of the rightmost run of hits long enough, scanning right to left;
        the leftover run touching index 0 when none is; None to defer."""
        raise NotImplementedError

    def initial_window(self, group: GroupSpec, tpc: int, w: int, cand: int) -> int | None:
        """Chunks the first (rightmost) run must have, before any EAGLE term;
        None to use the ordinary window."""
        raise NotImplementedError

    def eagle_widens(self, group: GroupSpec) -> bool:
        """Whether an unverified EAGLE group's query peeks one chunk further right."""
        return group.kind is not GroupKind.FULL or self.widens_full_attention_eagle

    def being_loaded_window(self, group: GroupSpec, tpc: int, w: int | None, boundary: int) -> int | None:
        """How many trailing chunks of a window group's hit range the
        being-loaded check inspects (None: the whole range, full attention)."""
        raise NotImplementedError

    # -- load job construction (update_state_after_alloc) ---------------------------

    def load_search_start(self, local_tokens: int, tokens_per_block: int) -> int:
        """Block index where the search for the first fresh block starts."""
        raise NotImplementedError

    def local_boundary_violation(self, local_tokens: int, first: int, tokens_per_block: int) -> str | None:
        """The assertion on the local boundary; a message when it fails."""
        raise NotImplementedError

    # -- store path -----------------------------------------------------------------

    def finished_store_tokens(self, num_prompt_tokens: int, num_tokens: int) -> int:
        """Tokens whose KV may be stored once a request has finished (spec §7.1)."""
        raise NotImplementedError

    def eagle_tail_excluded(self, decoding: bool, finished: bool) -> bool:
        """Whether an EAGLE group's last chunk is kept out of stores."""
        raise NotImplementedError

    def reachable_chunks(
        self,
        layout: Layout,
        g: int,
        eagle: bool,
        start: int,
        end: int,
        storable: int,
        horizon: int | None,
        block_ids: Sequence[int] | None = None,
    ) -> list[bool] | None:
        """Store reachability of chunks ``[start, end)`` of window group ``g``
        (spec §7.3); None means every chunk is reachable. ``block_ids`` (the
        request's known GPU block ids of the group, 0 for a null block) is
        read only by profiles that refuse a chunk with a reachable null block."""
        raise NotImplementedError


def load_window(group: GroupSpec, tpc: int, w: int, boundary: int, extra: int = 0) -> int:
    """``loadwin_g(N)`` (spec §4.6): chunks that GPU allocation retains for a
    hit ending at ``boundary``; ``w`` for every kind but sliding window.
    ``extra`` is the group's ``extra_retained_tokens`` where the version
    counts them (0.33), 0 where it ignores them (0.30)."""
    if group.kind is not GroupKind.SLIDING_WINDOW:
        return w
    assert group.window is not None
    pad = -boundary % tpc
    return max(w, cdiv(group.window - 1 + extra + pad, tpc))


class _Old(WindowProfile):
    logic = WindowLogic.OLD
    widens_full_attention_eagle = False
    unannotated_eagle_means_all = True
    caps_storable_by_keys = False
    arc_t1_last_resort = False

    def window_scan(
        self, lookup: Lookup, keys: Sequence[OffloadKey], need: int, initial: int | None
    ) -> int | None:
        run = 0
        deferred = False
        for idx in range(len(keys) - 1, -1, -1):
            r = lookup(keys[idx])
            if r is _HIT:
                run += 1
            elif r is _PENDING:
                run += 1
                deferred = True
            else:
                run = 0
                if r is _RETRY:
                    deferred = True
            if run == need:
                return None if deferred else idx + need
        return None if deferred else run

    def initial_window(self, group: GroupSpec, tpc: int, w: int, cand: int) -> int | None:
        return None

    def being_loaded_window(self, group: GroupSpec, tpc: int, w: int | None, boundary: int) -> int | None:
        return w

    def load_search_start(self, local_tokens: int, tokens_per_block: int) -> int:
        return 0

    def local_boundary_violation(self, local_tokens: int, first: int, tokens_per_block: int) -> str | None:
        if local_tokens <= first * tokens_per_block:
            return None
        return (
            f"load would start at block {first} (token {first * tokens_per_block}) "
            f"below the local boundary {local_tokens}"
        )

    def finished_store_tokens(self, num_prompt_tokens: int, num_tokens: int) -> int:
        return num_tokens

    def eagle_tail_excluded(self, decoding: bool, finished: bool) -> bool:
        return decoding

    def reachable_chunks(
        self,
        layout: Layout,
        g: int,
        eagle: bool,
        start: int,
        end: int,
        storable: int,
        horizon: int | None,
        block_ids: Sequence[int] | None = None,
    ) -> list[bool] | None:
        # Segments of the full-attention chunk grid; within each, only the last
        # w (+1 eagle) chunks can serve a hit. The partial last segment is judged
        # against the current frontier ``storable``.
        align = layout.alignment_tokens
        tpc = layout.tokens_per_chunk[g]
        w = layout.window_chunks[g]
        if align is None or w is None or align <= tpc:
            return None
        per_segment = align // tpc
        if w >= per_segment:
            return None
        tail = w + int(eagle)
        mask = []
        for a in range(start, end):
            pos = a % per_segment
            seg_len = min(per_segment, storable - (a - pos))
            mask.append(pos >= seg_len - tail)
        return mask


class _New(WindowProfile):
    logic = WindowLogic.NEW
    widens_full_attention_eagle = True
    unannotated_eagle_means_all = False
    caps_storable_by_keys = True
    reconsiders_final_window_tail = True

    def window_scan(
        self, lookup: Lookup, keys: Sequence[OffloadKey], need: int, initial: int | None
    ) -> int | None:
        required = initial or need
        run = 0
        deferred = False
        pending_in_run = False
        for idx in range(len(keys) - 1, -1, -1):
            r = lookup(keys[idx])
            if r is _HIT:
                run += 1
            elif r is _PENDING:
                run += 1
                pending_in_run = True
            else:
                # A gap: any window left of it ends chunk-aligned, so the
                # ordinary window suffices from here on.
                run = 0
                pending_in_run = False
                required = need
                if r is _RETRY:
                    deferred = True
            if run == required:
                return None if deferred or pending_in_run else idx + required
        return None if deferred or pending_in_run else run

    def initial_window(self, group: GroupSpec, tpc: int, w: int, cand: int) -> int | None:
        return load_window(group, tpc, w, cand)

    def being_loaded_window(self, group: GroupSpec, tpc: int, w: int | None, boundary: int) -> int | None:
        return None if w is None else load_window(group, tpc, w, boundary)

    def load_search_start(self, local_tokens: int, tokens_per_block: int) -> int:
        return cdiv(local_tokens, tokens_per_block)

    def local_boundary_violation(self, local_tokens: int, first: int, tokens_per_block: int) -> str | None:
        if local_tokens % tokens_per_block == 0:
            return None
        return f"local boundary {local_tokens} is not a multiple of the block size {tokens_per_block}"

    def finished_store_tokens(self, num_prompt_tokens: int, num_tokens: int) -> int:
        return max(num_prompt_tokens, num_tokens - 1)

    def eagle_tail_excluded(self, decoding: bool, finished: bool) -> bool:
        return decoding and not finished

    def reachable_chunks(
        self,
        layout: Layout,
        g: int,
        eagle: bool,
        start: int,
        end: int,
        storable: int,
        horizon: int | None,
        block_ids: Sequence[int] | None = None,
    ) -> list[bool] | None:
        blocks = _block_mask(layout, g, eagle, start, end, horizon, 0)
        if blocks is None:
            return None
        bpc = layout.blocks_per_chunk
        return _chunks_any(blocks, bpc)


def _periodic_mask(b0: int, b1: int, shift: int, per: int, need: int) -> list[bool]:
    """``[i >= shift and (i - shift) % per >= per - need for i in range(b0, b1)]``,
    built by tiling one period (the last ``need`` of every ``per`` blocks from
    ``shift``) instead of testing every index."""
    if b1 <= b0:
        return []
    lo = min(max(b0, shift), b1)
    out = [False] * (lo - b0)
    if lo < b1:
        off = (lo - shift) % per
        period = [False] * (per - need) + [True] * need
        out += (period * ((off + b1 - lo) // per + 1))[off : off + b1 - lo]
    return out


def _chunks_any(blocks: list[bool], bpc: int) -> list[bool]:
    """Per chunk of ``bpc`` blocks, whether any of its blocks is set:
    ``[any(blocks[k * bpc : (k + 1) * bpc]) for k in range(len(blocks) // bpc)]``
    (``len(blocks)`` is a multiple of ``bpc``), with the per-chunk loop in C."""
    if bpc == 1:
        return list(blocks)
    return list(map(any, zip(*(blocks[j::bpc] for j in range(bpc)), strict=True)))


def store_alignment(layout: Layout) -> int | None:
    """The chunk grid vLLM 0.30 and 0.33 judge a window group's store mask on: the
    full-attention tokens per chunk when all full-attention groups agree (as 0.29,
    :attr:`~sim.model.layout.Layout.alignment_tokens`); with no full-attention group
    the largest tokens per chunk of all groups (0.29: none, every chunk reachable);
    None when full-attention groups disagree."""
    if any(w is None for w in layout.window_chunks):
        return layout.alignment_tokens
    return max(layout.tokens_per_chunk)


def _block_mask(layout: Layout, g: int, eagle: bool, start: int, end: int, horizon: int | None,
                extra: int) -> list[bool] | None:
    """The sliding-window GPU manager's block mask (0.30 and 0.33) over the
    blocks of chunks ``[start, end)``: the last ``need`` blocks of every
    full-attention segment (shifted right by one for EAGLE); the final partial
    segment judged against the store horizon (in chunks) rather than the
    frontier. ``extra`` widens the window (0.33 adds ``extra_retained_tokens``).
    None: every block is reachable."""
    group = layout.groups[g]
    if group.kind is not GroupKind.SLIDING_WINDOW:
        return None  # chunked-local and mamba masks are not modelled: dense
    align = store_alignment(layout)
    bs = group.tokens_per_block
    if align is None or align % bs:
        return None
    assert group.window is not None
    need = cdiv(group.window + extra - 1, bs) + int(eagle)
    per_segment = align // bs
    if need >= per_segment:
        return None
    shift = int(eagle)
    bpc = layout.blocks_per_chunk
    b0, b1 = start * bpc, end * bpc
    blocks = _periodic_mask(b0, b1, shift, per_segment, need)
    if horizon is not None and not eagle:
        final_end = horizon * bpc
        final_size = final_end % per_segment
        if final_size:
            tail_start = max(final_end - final_size, final_end - need)
            for i in range(max(b0, tail_start), min(b1, final_end)):
                blocks[i - b0] = True
    return blocks


def latest_window_chunks(group: GroupSpec, tpc: int) -> int | None:
    """``w_g`` in vLLM 0.33: a sliding-window group's window also spans its
    ``extra_retained_tokens`` (``max(cdiv(W, t), cdiv(W - 1 + e, t))``); the
    other kinds as before."""
    if group.kind is GroupKind.FULL:
        return None
    if group.kind is GroupKind.SLIDING_WINDOW:
        assert group.window is not None
        return max(cdiv(group.window, tpc), cdiv(group.window - 1 + group.extra_retained_tokens, tpc))
    if group.kind is GroupKind.CHUNKED_LOCAL:
        assert group.attention_chunk is not None
        return cdiv(group.attention_chunk, tpc)
    return 1


class _Latest(_New):
    """vLLM 0.33.0: NEW plus ``extra_retained_tokens`` in every window size
    (lookup window, load window, store mask), a chunk with a reachable null
    block is not stored, the store index restarts at each lookup, CPU
    recency is request-scoped (no touches; see docs/latest.md), and a
    skipped request without KV blocks waits in the waiting queue."""

    logic = WindowLogic.LATEST
    restarts_store_index_on_lookup = True
    request_scoped_recency = True
    requeues_skipped_without_kv = True
    eagle_margin_past_limit = True

    def window_chunks(self, layout: Layout) -> tuple[int | None, ...]:
        return tuple(latest_window_chunks(g, t) for g, t in zip(layout.groups, layout.tokens_per_chunk,
                                                                   strict=True))

    def lookup_order(self, layout: Layout) -> tuple[int, ...]:
        w = self.window_chunks(layout)
        fa = [i for i, x in enumerate(w) if x is None]
        sw = sorted((i for i, x in enumerate(w) if x is not None), key=lambda i: -(w[i] or 0))
        return tuple(fa + sw)

    def window_groups(self, layout: Layout) -> tuple[int, ...]:
        w = self.window_chunks(layout)
        return tuple(i for i in self.lookup_order(layout) if w[i] is not None)

    def initial_window(self, group: GroupSpec, tpc: int, w: int, cand: int) -> int | None:
        return load_window(group, tpc, w, cand, group.extra_retained_tokens)

    def being_loaded_window(self, group: GroupSpec, tpc: int, w: int | None, boundary: int) -> int | None:
        return None if w is None else load_window(group, tpc, w, boundary, group.extra_retained_tokens)

    def reachable_chunks(
        self,
        layout: Layout,
        g: int,
        eagle: bool,
        start: int,
        end: int,
        storable: int,
        horizon: int | None,
        block_ids: Sequence[int] | None = None,
    ) -> list[bool] | None:
        # The mask of a sliding-window group spans W + e tokens; a chunk is
        # stored only if a block is reachable and no reachable block is null.
        blocks = _block_mask(layout, g, eagle, start, end, horizon, layout.groups[g].extra_retained_tokens)
        bpc = layout.blocks_per_chunk
        if block_ids is None or bpc == 1:
            # one block per chunk: the null check is the connector's last-block test
            if blocks is None:
                return None
            return _chunks_any(blocks, bpc)
        ids = block_ids[start * bpc : end * bpc]
        out = []
        for k in range(end - start):
            sub = range(k * bpc, (k + 1) * bpc)
            if blocks is None:
                out.append(all(ids[i] != 0 for i in sub))
            else:
                out.append(any(blocks[i] for i in sub) and not any(blocks[i] and ids[i] == 0 for i in sub))
        return out


OLD: WindowProfile = _Old()
NEW: WindowProfile = _New()
LATEST: WindowProfile = _Latest()

_PROFILES = {WindowLogic.OLD: OLD, WindowLogic.NEW: NEW, WindowLogic.LATEST: LATEST}


def profile(logic: WindowLogic | str) -> WindowProfile:
    """The profile object of ``logic`` ("old", "new" or "latest")."""
    return _PROFILES[WindowLogic(logic)]
