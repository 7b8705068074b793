"""The decision kernel: one new request's lookup, GPU allocation and load plan.

What it computes
    For one new request on a stated CPU chunk-state table and a local GPU
    prefix hit, what the modelled vLLM scheduler decides under each window
    logic (OLD/NEW/LATEST), as the outcome dicts of :func:`sim.io.check.run_check`:
    the external hit (None when deferred), the chunks passed to
    ``prepare_load``, the per-group block counts and first block indices of
    the load, a modelled crash and the hazards. Clock-free and stateless:
    nothing is stored, nothing is kept between calls but per-layout constants.

How
    It is the same algorithm as :class:`sim.model.connector.OffloadingScheduler`
    (``get_num_new_matched_tokens`` then ``update_state_after_alloc``) and
    :meth:`sim.model.gpu_cache.GpuKVCache.allocate_new`, specialised to one
    request on a read-only state table, so that no per-key Python objects are
    built:

    * chunk ``j`` of group ``g`` is its index, not its offload key; the CPU
      cache is a per-group list of lookup answers (HIT for a ready or
      being-loaded chunk, HIT_PENDING for a pending store, RETRY for a chunk
      the tier answers RETRY for, else MISS) and ``prepare_load``'s two
      assertions read the same list (MISS and RETRY: ``missing_chunk``,
      HIT_PENDING: ``chunk_not_ready``, the first failing chunk in load order);
    * secondary tiers (vLLM 0.33's ``TieringOffloadingManager``,
      :mod:`sim.model.tiers`): a chunk the CPU cache lacks and a tier holds
      is promoted when a lookup reads it (by index, as the real lookup asks
      for one key at a time): its entry turns HIT_PENDING (a CPU slot is
      reserved, so the request defers) and ``[tier, group, chunk]`` joins the
      outcome's ``promotions``; a GPU load reads only the CPU tier, so the
      load plan reads the table by slices, which never promote. The CPU
      cache is taken to have room for every promotion (``check/1`` refuses
      a capacity that could make a promotion evict or fail);
    * the GPU allocation is closed-form (spec §5.1): per group
      ``skipped(N) // bs`` null blocks, the local-hit blocks the window still
      retains, then fresh blocks up to ``cdiv(N, bs)``; so the first block to
      load is ``min(nb, max(search start, skipped, L // bs))``;
    * every rule in which the versions differ is still asked of the
      :mod:`sim.model.windows` profile (window chunks and lookup order,
      window scan, first-run window, EAGLE widening, being-loaded window,
      load search start, local-boundary assertion); the kernel never
      branches on the version.

    The reference is the real-object path (:func:`sim.io.check.build_world`:
    the CPU chunk cache, the per-block GPU cache and the scheduler, built per
    case); ``tests/model/test_decision.py`` compares both on random scenarios
    of every group kind and on the crash library.

Per-layout constants (:class:`DecisionLayout`) are cached by ``(groups,
tokens_per_hash, blocks_per_chunk)``: a batch on a few layouts builds each once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, SupportsIndex

from sim.model.cpu_cache import LookupResult
from sim.model.layout import GroupSpec, Layout
from sim.model.windows import WindowLogic, WindowProfile, profile

__all__ = [
    "ALL",
    "BOTH",
    "MISSING",
    "DecisionLayout",
    "decide",
    "decide_codes",
    "decision_layout",
    "state_code",
]

_HIT = LookupResult.HIT
_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY
_MISS = LookupResult.MISS
#: the table entry of a chunk no state is given for (missing)
MISSING = _MISS

#: the lookup answer of each stated chunk state (``loading``: present and pinned by another load)
state_code: dict[str, LookupResult] = {"present": _HIT, "loading": _HIT, "pending": _PENDING, "retry": _RETRY}

BOTH: tuple[str, ...] = ("old", "new")
#: every logic the kernel can decide under
ALL: tuple[str, ...] = tuple(lg.value for lg in WindowLogic)

_NOT_FOUND = "not found in CPU cache"
_NOT_READY = "not ready to be read: its store is still pending"


class DecisionLayout:
    """Per-layout constants of the kernel (build with :func:`decision_layout`).

    Raises :class:`~sim.model.layout.LayoutError` for an invalid layout, as
    :class:`~sim.model.layout.Layout` and the scheduler do.
    """

    __slots__ = ("blocks_per_chunk", "bs", "eagle", "groups", "hpc", "layout", "limit_align",
                 "ng", "order", "profiles", "tpc", "w", "window_groups")

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.groups: tuple[GroupSpec, ...] = layout.groups
        self.ng = len(layout.groups)
        self.tpc: tuple[int, ...] = layout.tokens_per_chunk
        self.hpc: tuple[int, ...] = layout.hashes_per_chunk
        self.w: tuple[int | None, ...] = layout.window_chunks
        self.bs: tuple[int, ...] = tuple(g.tokens_per_block for g in layout.groups)
        self.blocks_per_chunk = layout.blocks_per_chunk
        self.order: tuple[int, ...] = layout.lookup_order
        self.window_groups: tuple[int, ...] = layout.window_groups
        #: the lookup limit: (drop the last token, Mamba alignment) or None with no window group
        self.limit_align: tuple[int] | tuple[()] | None = (
            ((layout.mamba_align,) if layout.mamba_align else ()) if self.window_groups else None)
        self.eagle: tuple[bool, ...] = tuple(g.eagle for g in layout.groups)
        #: per logic: the profile, and the lookup order and the window groups as
        #: :data:`_LookupGroup` tuples (the EAGLE widening is the profile's)
        #: and per group (group, tokens_per_block, tokens_per_chunk, window chunks, spec)
        #: for the load plan; the window chunks are the profile's
        self.profiles: dict[str, tuple[WindowProfile, _Groups, _Groups, _PlanGroups]] = {}
        for logic in ALL:
            prof = profile(logic)
            w = prof.window_chunks(layout)
            info = [(g, self.tpc[g], w[g], self.eagle[g], prof.eagle_widens(spec), spec)
                    for g, spec in enumerate(self.groups)]
            plan = tuple((g, self.bs[g], self.tpc[g], w[g], spec) for g, spec in enumerate(self.groups))
            self.profiles[logic] = (prof, tuple(info[g] for g in prof.lookup_order(layout)),
                                    tuple(info[g] for g in prof.window_groups(layout)), plan)


#: a group as the lookup reads it: (index, tokens per chunk, window chunks or None,
#: EAGLE, EAGLE widening under the logic, spec)
_LookupGroup = tuple[int, int, "int | None", bool, bool, GroupSpec]
_Groups = tuple[_LookupGroup, ...]
_PlanGroups = tuple[tuple[int, int, int, "int | None", GroupSpec], ...]


_CACHE: dict[tuple[Any, ...], DecisionLayout] = {}
_CACHE_LIMIT = 4096


def decision_layout(groups: Sequence[GroupSpec], tokens_per_hash: int, blocks_per_chunk: int = 1
                    ) -> DecisionLayout:
    """The (cached) :class:`DecisionLayout` of these groups."""
    key = (tuple(groups), tokens_per_hash, blocks_per_chunk)
    dl = _CACHE.get(key)
    if dl is None:
        dl = DecisionLayout(Layout.of(list(groups), tokens_per_hash, blocks_per_chunk))
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = dl
    return dl


def decide(dl: DecisionLayout, states: Iterable[tuple[int, int, str]], num_tokens: int,
           gpu_computed_tokens: int = 0, prefix_caching: bool = True,
           logics: Sequence[str] = BOTH, tiers: Mapping[tuple[int, int], int] | None = None
           ) -> dict[str, dict[str, Any]]:
    """The outcome of each logic for a request of ``num_tokens`` tokens with a
    local GPU hit of ``gpu_computed_tokens`` and the stated ``(group, chunk,
    state)`` chunks (every other chunk missing); see the module docstring.
    ``tiers``: see :func:`decide_codes`."""
    codes = [[_MISS] * (num_tokens // t) for t in dl.tpc]
    loading: set[tuple[int, int]] = set()
    for g, j, st in states:
        codes[g][j] = state_code[st]
        if st == "loading":
            loading.add((g, j))
    return decide_codes(dl, codes, loading, num_tokens, gpu_computed_tokens, prefix_caching, logics, tiers)


def decide_codes(dl: DecisionLayout, codes: list[list[LookupResult]], loading: set[tuple[int, int]],
                 num_tokens: int, gpu_computed_tokens: int = 0, prefix_caching: bool = True,
                 logics: Sequence[str] = BOTH, tiers: Mapping[tuple[int, int], int] | None = None
                 ) -> dict[str, dict[str, Any]]:
    """:func:`decide` on a prepared table: ``codes[g][j]`` the lookup answer of
    chunk ``j`` of group ``g`` (:data:`state_code` of its state, :data:`MISSING`
    when none is stated; one entry per complete chunk: ``num_tokens //
    tokens_per_chunk``), ``loading`` the stated ``loading`` chunks.

    ``tiers`` (None: no secondary tier): ``(group, chunk) -> tier`` for the
    chunks a secondary tier holds readable, the first such tier (1 is the
    first after the CPU); each outcome then has ``promotions``, the sorted
    ``[tier, group, chunk]`` of the chunks the lookup promoted."""
    if gpu_computed_tokens and not prefix_caching:
        raise ValueError(f"a local GPU hit ({gpu_computed_tokens} tokens) needs GPU prefix caching")
    being = loading if prefix_caching and loading else None
    out: dict[str, dict[str, Any]] = {}
    profiles = dl.profiles
    held: dict[int, dict[int, int]] = {}
    for (g, j), tier in (tiers or {}).items():
        held.setdefault(g, {})[j] = tier
    for logic in logics:
        prof, order, window_groups, plan_groups = profiles[logic]
        table = codes
        promoted: list[list[int]] = []
        if held:        # a fresh table per logic: its lookups promote
            table = [_TierCodes(cg, g, held[g], promoted) if g in held else cg for g, cg in enumerate(codes)]
        ext = _lookup(dl, prof, order, window_groups, table, num_tokens, gpu_computed_tokens, being)
        if ext:
            out[logic] = _plan(dl, prof, plan_groups, table, gpu_computed_tokens, ext, being)
        else:
            out[logic] = {"external_tokens": ext, "load_async": False, "load_keys": [], "group_sizes": [],
                          "block_indices": [], "crash": None, "hazards": []}
        if tiers is not None:
            out[logic]["promotions"] = sorted(promoted)
    return out


class _TierCodes(list[LookupResult]):
    """One group's lookup answers with secondary tiers behind the CPU cache:
    reading chunk ``j`` by index (a lookup) when the CPU cache lacks it and a
    tier holds it starts its promotion (HIT_PENDING from then on, as the CPU
    slot is reserved); a slice (the load plan: a GPU load reads only the CPU
    tier) reads without promoting."""

    __slots__ = ("group", "held", "promoted")

    def __init__(self, codes: list[LookupResult], group: int, held: dict[int, int],
                 promoted: list[list[int]]) -> None:
        super().__init__(codes)
        self.group = group
        #: chunk -> the first tier holding it readable
        self.held = held
        #: the outcome's promotions, shared by the groups of one decision
        self.promoted = promoted

    def __getitem__(self, j: SupportsIndex | slice) -> Any:
        if isinstance(j, slice):
            return list.__getitem__(self, j)     # a plain list
        code = list.__getitem__(self, j)
        if code is _MISS:
            k = j.__index__() % len(self)
            tier = self.held.get(k)
            if tier is not None:
                list.__setitem__(self, k, _PENDING)
                self.promoted.append([tier, self.group, k])
                return _PENDING
        return code


def _lookup(dl: DecisionLayout, prof: WindowProfile, order: tuple[_LookupGroup, ...],
            window_groups: tuple[_LookupGroup, ...], codes: list[list[LookupResult]], n: int, c: int,
            being: set[tuple[int, int]] | None) -> int | None:
    """The joint lookup (``OffloadingScheduler._lookup`` and ``_after_shrink``):
    the hit beyond ``c``, 0, or None to ask again later."""
    m = n if dl.limit_align is None else _lookup_limit(dl.limit_align, n)
    hit = 0
    deferred = False
    todo = order
    popped: set[int] = set()
    while todo:
        swept = False
        current, todo = todo, ()
        for grp in current:
            r = _ask_group(prof, grp, codes[grp[0]], c, m, popped)
            if r == 0:
                return 0
            if r < 0:
                deferred = True
                m = -r
            else:
                m = r
            new_hit = m - c
            if new_hit < hit:
                if not grp[3]:  # not an EAGLE group
                    popped.clear()
                if deferred:
                    todo, deferred = order, False
                elif swept and not todo:
                    todo = window_groups
            if grp[2] is not None:
                swept = True
            hit = new_hit
    if deferred:
        return None
    if being is not None and _hits_being_loaded(dl, prof, codes, c, hit, being):
        return None
    return hit


def _lookup_limit(align: tuple[int] | tuple[()], n: int) -> int:
    """With window groups: all tokens but the last (always recomputed),
    aligned down to the Mamba chunk when there is one."""
    m = n - 1
    return m - m % align[0] if align else m


def _ask_group(prof: WindowProfile, grp: _LookupGroup, cg: list[LookupResult], c: int, m: int,
               popped: set[int]) -> int:
    """Group ``grp``'s turn (``_lookup_group`` and ``_query_group``): the new
    boundary ``m``; ``-m`` when its answer is deferred (``m`` then capped by
    its keys only); 0 when less than a chunk beyond ``c`` remains."""
    # (conditional expressions rather than min(): this runs per group, per logic, per case)
    g, tpc, w, eagle, widens, spec = grp
    nk = len(cg)
    top = nk * tpc
    m = top if m > top else m
    if m - c < tpc:
        return 0
    fresh = eagle and g not in popped
    lo = c // tpc
    if fresh and widens:
        query = m + tpc if m + tpc < top else top
        end = -(-query // tpc)
    else:
        end = -(-m // tpc)
    end = nk if end > nk else end
    r: int | None
    if w is None:
        r = _prefix_lookup(cg, lo, end)
    else:
        cand = (end - fresh) * tpc
        init = prof.initial_window(spec, tpc, w, m if m < cand else cand)
        r = prof.window_scan(cg.__getitem__, range(lo, end), w + fresh,
                             None if init is None else init + fresh)
    if r is None:
        return -m
    if r == 0:
        return 0
    if fresh:
        r -= 1
        popped.add(g)
    cap = tpc * (lo + r)
    m = cap if m > cap else m
    return 0 if m - c < tpc else m


def _prefix_lookup(cg: list[LookupResult], lo: int, end: int) -> int | None:
    """Chunks ``lo..end`` of a full-attention group: the hits before the first
    miss, None to defer (a pending or RETRY chunk on the way). With tiers, one
    chunk at a time (each read may promote; none beyond the first miss)."""
    count = 0
    deferred = False
    for code in (cg[lo:end] if type(cg) is list else map(cg.__getitem__, range(lo, end))):
        if code is _HIT:
            count += 1
        elif code is _PENDING:
            count += 1
            deferred = True
        elif code is _RETRY:
            deferred = True
        else:
            break
    return None if deferred else count


def _hits_being_loaded(dl: DecisionLayout, prof: WindowProfile, codes: list[list[LookupResult]],
                       c: int, hit: int, being: set[tuple[int, int]]) -> bool:
    """Whether the hit range reaches a chunk another load job is loading (the
    window-group ranges cut to the profile's being-loaded window)."""
    boundary = c + hit
    for g, j in being:
        tpc = dl.tpc[g]
        hi = min(-(-boundary // tpc), len(codes[g]))
        lo = c // tpc
        win = prof.being_loaded_window(dl.groups[g], tpc, dl.w[g], boundary)
        if win and hi - win > lo:  # keys[lo:hi][-win:]
            lo = hi - win
        if lo <= j < hi:
            return True
    return False


class _AssertionHit(Exception):  # noqa: N818 -- a vLLM assertion, not an error of the kernel
    """A vLLM assertion of ``update_state_after_alloc`` (the modelled crash)."""

    def __init__(self, group: int, chunk: int, message: str) -> None:
        super().__init__(message)
        self.crash = {"kind": "assertion", "group": group, "chunk": chunk, "message": message}


def _plan(dl: DecisionLayout, prof: WindowProfile, plan_groups: _PlanGroups, codes: list[list[LookupResult]],
          c: int, ext: int, being: set[tuple[int, int]] | None) -> dict[str, Any]:
    """The outcome of a positive hit ``ext``: the allocation and load plan
    (``update_state_after_alloc`` on the closed-form allocation), a vLLM
    assertion, or ``prepare_load``'s (the attempted load kept)."""
    n_cached = c + ext
    bpc = dl.blocks_per_chunk
    load_keys: list[list[int]] = []
    sizes: list[int] = []
    firsts: list[int] = []
    failed: tuple[int, int, LookupResult] | None = None
    try:
        for grp in plan_groups:
            g = grp[0]
            cg = codes[g]
            first, nc = _draft_group(prof, grp, bpc, len(cg), c, n_cached)
            pending = -(-n_cached // grp[1]) - first
            if pending:
                start = first // bpc
                load_keys += [[g, j] for j in range(start, nc)]
                if failed is None:
                    window = cg[start:nc]       # a slice: the CPU tier's states, no promotion
                    if window.count(_HIT) != len(window):
                        failed = _not_ready(window, g, start)
            sizes.append(pending)
            firsts.append(first)
    except _AssertionHit as exc:
        return {"external_tokens": ext, "load_async": False, "load_keys": [], "group_sizes": [],
                "block_indices": [], "crash": exc.crash, "hazards": []}
    hazards = [] if being is None else [{"kind": "double_load", "group": g, "chunk": j}
                                        for g, j in load_keys if (g, j) in being]
    crash = None
    if failed is not None:
        g, j, code = failed
        if code is _PENDING:
            reason, what = "chunk_not_ready", _NOT_READY
        else:
            reason, what = "missing_chunk", _NOT_FOUND
        crash = {"kind": reason, "group": g, "chunk": j,
                 "message": f"chunk (h={(j + 1) * dl.hpc[g]}, group={g}) {what}"}
    return {"external_tokens": ext, "load_async": failed is None, "load_keys": load_keys,
            "group_sizes": sizes, "block_indices": firsts, "crash": crash, "hazards": hazards}


def _draft_group(prof: WindowProfile, grp: tuple[int, int, int, int | None, GroupSpec], bpc: int, nk: int,
                 c: int, n_cached: int) -> tuple[int, int]:
    """Group ``g``'s part of the load (``_draft_group_load`` and
    ``_first_block_to_load`` on the closed-form allocation: ``skip`` null
    blocks, local-hit blocks up to ``max(skip, c // bs)``, then fresh ones up
    to ``nb``): the first block to load and the chunk count ``nc``; raises
    :class:`_AssertionHit` where vLLM asserts."""
    g, bs, tpc, w, spec = grp
    nb = -(-n_cached // bs)
    skip = spec.skipped_tokens(n_cached) // bs
    first = prof.load_search_start(c, bs)
    first = skip if skip > first else first
    first = c // bs if c // bs > first else first
    first = nb if first > nb else first
    msg = prof.local_boundary_violation(c, first, bs)
    if msg is not None:
        raise _AssertionHit(g, first // bpc, f"group {g}: {msg}")
    pending = nb - first
    if w is not None and pending > w * bpc + 1:
        raise _AssertionHit(g, first // bpc, f"group {g}: {pending} blocks to load exceed the window "
                                             f"of {w} chunks x {bpc} blocks + 1")
    nc = -(-n_cached // tpc)
    if pending and nk < nc:
        raise _AssertionHit(g, nk, f"group {g} has {nk} keys, fewer than the {nc} chunks to load")
    return first, nc


def _not_ready(window: list[LookupResult], g: int, start: int) -> tuple[int, int, LookupResult] | None:
    """The first chunk of ``window`` (group ``g``'s chunks from ``start``) that
    ``prepare_load`` refuses (absent, RETRY or pending), as ``(group, chunk, answer)``."""
    for k, code in enumerate(window):
        if code is not _HIT:
            return g, start + k, code
    return None
