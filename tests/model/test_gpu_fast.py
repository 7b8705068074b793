"""Differential test: :class:`sim.model.gpu_fast.GpuFastCache` against the
reference :class:`sim.model.gpu_cache.GpuKVCache`.

Hypothesis draws a layout (1-3 groups of every kind: full attention, sliding
window with and without ``extra_retained_tokens``, chunked local, Mamba,
EAGLE flags), a pool size from 2 blocks (every allocation fails) to hundreds
(nothing is evicted), prefix caching on or off, and a sequence of
operations on requests whose hash chains share prefixes (and, for some, repeat
hashes, to hit the duplicate-hash paths): find_hit + allocate_new with local
and external tokens, allocate_more over chunked-prefill and decode steps,
remove_skipped, commit, thresholds, free, seed_prefix, blocks_needed, and raw
pool operations (hand out, touch cached blocks, free in any order). Both
implementations get the same calls; after every call the test asserts the
same return values (block ids), the same exception type (the run stops
there), the same pool counters, the same whole free queue (``free_ids_head``),
the same ref count and hash of every block, the same prefix-cache map, the
same per-request block ids and thresholds (and the fast cache's kept
quiet thresholds equal to their definition), and that both pass
``check_invariants``. A seeded spec §6 run with chunked prefill and decode
does the same at a realistic scale.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.model import gpu_fast
from sim.model.gpu_cache import GpuInvariantError, GpuKVCache
from sim.model.gpu_fast import GpuFastCache
from sim.model.layout import GroupKind, GroupSpec, Layout
from tests.helpers import SPEC6, cla, fa, quiet_thresholds_from_scratch, swa

# -- both builds of the pool's per-block loops ------------------------------------------

COMPILED = gpu_fast.COMPILED_LOOPS


@pytest.fixture(autouse=True, scope="module", params=["compiled", "python"])
def pool_loops(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test of this file runs twice: with the pool's per-block loops compiled
    (``sim/model/_poolops.c``, what an install with a C compiler runs) and with
    the Python loops of ``gpu_fast.py`` (the fallback). Module-scoped, so that
    hypothesis' examples share it; pools read the choice when they are built."""
    if request.param == "compiled" and COMPILED is None:
        if os.environ.get("CI"):
            pytest.fail("sim.model._poolops is not built in CI (pip install -e . compiles it)")
        pytest.skip("sim.model._poolops not built here")
    with gpu_fast.pool_loops(request.param == "compiled"):
        yield request.param


def test_pools_run_the_chosen_loops(pool_loops: str) -> None:
    pool = GpuFastCache(Layout.of([fa(4)], tokens_per_hash=4), 8).pool
    assert pool._ops is (COMPILED if pool_loops == "compiled" else None)


def test_compiled_stale_test_reads_one_flag_per_block() -> None:
    """``_poolops.flagged``: whether a queue piece holds a block flagged stale; an id
    outside the pool is an error, not a read past the flags."""
    if COMPILED is None:
        if os.environ.get("CI"):
            pytest.fail("sim.model._poolops is not built in CI (pip install -e . compiles it)")
        pytest.skip("sim.model._poolops not built here")
    flags = bytearray(8)
    assert COMPILED.flagged([1, 2, 3], flags) is False
    flags[3] = 1
    assert COMPILED.flagged([1, 2, 3], flags) is True
    assert COMPILED.flagged([], flags) is False
    with pytest.raises(IndexError):
        COMPILED.flagged([1, 8], flags)


# -- the pair of caches ------------------------------------------------------------------


class Pair:
    """The reference and the fast cache, driven together and compared."""

    def __init__(self, layout: Layout, num_blocks: int, caching: bool) -> None:
        self.ref = GpuKVCache(layout, num_blocks, enable_caching=caching)
        self.fast = GpuFastCache(layout, num_blocks, enable_caching=caching)
        self.layout = layout
        self.raw: list[list[int]] = []  # block ids held outside any request

    # each call returns the comparable result of both sides

    def call(self, name: str, *args: object) -> tuple[object, object]:
        a = getattr(self.ref, name)(*args)
        b = getattr(self.fast, name)(*args)
        return a, b

    def find_hit(self, hashes: Sequence[int], max_tokens: int) -> tuple[int, tuple]:
        la, ra = self.ref.find_hit(hashes, max_tokens)
        lb, rb = self.fast.find_hit(hashes, max_tokens)
        assert la == lb
        assert [[x.block_id for x in lst] for lst in ra] == [list(lst) for lst in rb]
        return la, (ra, rb)

    def allocate_new(self, rid: str, local: tuple, lt: int, ext: int, slots: int) -> bool:
        ra, rb = local
        assert self.ref.blocks_needed(ra, lt, ext, slots) == self.fast.blocks_needed(rb, lt, ext, slots)
        a = self.ref.allocate_new(rid, ra, lt, ext, slots)
        b = self.fast.allocate_new(rid, rb, lt, ext, slots)
        assert (a is None) == (b is None)
        if a is None or b is None:
            return False
        assert a.new_block_ids == b.new_block_ids
        assert a.null_prefix == b.null_prefix
        assert [[x.block_id for x in lst] for lst in a.blocks] == list(b.block_ids)
        # the views the connector reads
        for g, (la, lb) in enumerate(zip(a.blocks, b.blocks, strict=True)):
            assert len(la) == len(lb)
            assert [(x.block_id, x.block_hash, x.is_null) for x in la] == \
                [(y.block_id, y.block_hash, y.is_null) for y in lb]
            stop = len(la)
            want = next((i for i in range(stop) if not la[i].is_null and la[i].block_hash is None), stop)
            assert self.fast.first_fresh(b.block_ids[g], 0, stop) == want
        return True

    def check(self) -> None:
        ref, fast = self.ref, self.fast
        pa, pb = ref.pool, fast.pool
        assert pa.num_free == pb.num_free
        assert pa.num_used == pb.num_used
        assert pa.num_cached == pb.num_cached
        assert pa.num_evicted == pb.num_evicted
        assert pa.free_ids_head(pa.num_blocks) == pb.free_ids_head(pb.num_blocks)
        assert pa.free_ids_head(3) == pb.free_ids_head(3)
        assert [(b.ref_cnt, b.block_hash) for b in pa.blocks] == \
            [(c, None if h is None else (h, g)) for c, h, g in zip(pb.ref, pb.bhash, pb.bgrp, strict=True)]
        assert {h: b.block_id for h, b in pa._cached.items()} == \
            {(h, g): b for g, cg in enumerate(pb._caches) for h, b in cg.items()}
        assert list(ref.req_blocks) == list(fast.req_blocks)
        for rid in ref.req_blocks:
            assert [[b.block_id for b in lst] for lst in ref.req_blocks[rid]] == fast.block_ids(rid)
            assert [len(lst) for lst in ref.req_blocks[rid]] == fast.table_lens(rid)
            assert [len(lst) for lst in fast.req_blocks[rid]] == fast.table_lens(rid)
            assert ref.thresholds(rid) == fast.thresholds(rid)
            assert fast.quiet_thresholds(rid) == quiet_thresholds_from_scratch(fast, rid)
        pa.check_invariants()
        pb.check_invariants()


def same_raise(fa_: object, fb: object) -> bool:
    """Run both thunks; True when both returned (equal results), False when both
    raised the same exception type."""
    ea = eb = None
    ra = rb = None
    try:
        ra = fa_()  # type: ignore[operator]
    except (GpuInvariantError, IndexError, KeyError) as e:
        ea = type(e)
    try:
        rb = fb()  # type: ignore[operator]
    except (GpuInvariantError, IndexError, KeyError) as e:
        eb = type(e)
    assert ea == eb
    if ea is None:
        assert ra == rb
    return ea is None


# -- strategies --------------------------------------------------------------------------------

TPH = 2


@st.composite
def group_specs(draw: st.DrawFn) -> GroupSpec:
    bs = TPH * draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(list(GroupKind)))
    eagle = draw(st.booleans())
    if kind is GroupKind.FULL:
        return fa(bs, eagle=eagle)
    if kind is GroupKind.SLIDING_WINDOW:
        return swa(bs, draw(st.integers(1, 20)), eagle=eagle, extra=draw(st.sampled_from([0, 0, 1, 3])))
    if kind is GroupKind.CHUNKED_LOCAL:
        return cla(bs, draw(st.sampled_from([2, 4, 6, 8, 16, 24])))
    return GroupSpec(GroupKind.MAMBA, bs, eagle=eagle)


layouts = st.builds(
    lambda gs, bpc: Layout.of(gs, tokens_per_hash=TPH, blocks_per_chunk=bpc),
    st.lists(group_specs(), min_size=1, max_size=3), st.sampled_from([1, 2, 4]))

pool_sizes = st.one_of(st.integers(2, 8), st.integers(9, 60), st.integers(9, 60), st.just(400))

MAX_HASHES = 48


def make_hashes(family: int, shared: int, total: int, rid: int, dup: bool) -> list[int]:
    """Hash chain of a request: ``shared`` hashes of its family, then its own."""
    own = [100_000 * (rid + 1) + (i % 3 if dup else i) for i in range(total - shared)]
    return [1_000 * (family + 1) + i for i in range(shared)] + own


class Driver:
    """Draws operations and applies them to a :class:`Pair`."""

    def __init__(self, data: st.DataObject, pair: Pair) -> None:
        self.data = data
        self.pair = pair
        self.reqs: dict[str, tuple[list[int], int]] = {}  # id -> (hashes, computed)
        self.next = 0
        self.hashes_seen: list[list[int]] = []

    def draw(self, strat: st.SearchStrategy) -> object:
        return self.data.draw(strat)

    def new_hashes(self) -> list[int]:
        """Mostly a whole family prefix (prefix hits), sometimes a part of it."""
        d = self.data.draw
        total = d(st.integers(1, MAX_HASHES))
        shared = d(st.one_of(st.just(total), st.integers(0, total)))
        return make_hashes(d(st.integers(0, 2)), shared, total, self.next, d(st.booleans()))

    def op_new(self) -> bool:
        d = self.data.draw
        hashes = self.new_hashes()
        ntok = len(hashes) * TPH + d(st.integers(0, TPH - 1))
        rid = f"r{self.next}"
        self.next += 1
        L, local = self.pair.find_hit(hashes, d(st.one_of(st.just(max(0, ntok - 1)),
                                                         st.integers(0, max(0, ntok - 1)))))
        ext = d(st.one_of(st.just(0), st.integers(0, ntok - L)))
        slots = L + ext + d(st.integers(0, max(0, ntok - L - ext))) + d(st.sampled_from([0, 0, 1, 3]))
        if self.pair.allocate_new(rid, local, L, ext, slots):
            self.reqs[rid] = (hashes, L + ext)
        return True

    def pick(self) -> str | None:
        if not self.reqs:
            return None
        return self.data.draw(st.sampled_from(sorted(self.reqs)))

    def op_more(self) -> bool:
        rid = self.pick()
        if rid is None:
            return True
        d = self.data.draw
        hashes, comp = self.reqs[rid]
        nc = comp + d(st.integers(0, 12))
        slots = nc + d(st.sampled_from([0, 1, 1, 2, 5, 16]))
        p = self.pair
        ok = same_raise(lambda: p.ref.allocate_more(rid, nc, slots),
                        lambda: p.fast.allocate_more(rid, nc, slots))
        self.reqs[rid] = (hashes, nc)
        if ok and d(st.integers(0, 3)):
            n = d(st.one_of(st.just(slots), st.integers(0, slots + 2)))
            p.ref.commit(rid, hashes, n)
            p.fast.commit(rid, hashes, n)
        return ok

    def op_finish(self) -> bool:
        """Run a request to the end of its hashes in one chunk, commit, free:
        what a finished request leaves in the prefix cache."""
        rid = self.pick()
        if rid is None:
            return True
        hashes, comp = self.reqs.pop(rid)
        end = max(comp, len(hashes) * TPH)
        p = self.pair
        ok = same_raise(lambda: p.ref.allocate_more(rid, comp, end),
                        lambda: p.fast.allocate_more(rid, comp, end))
        if ok:
            p.ref.commit(rid, hashes, end)
            p.fast.commit(rid, hashes, end)
            p.check()
            p.ref.free(rid)
            p.fast.free(rid)
        return ok

    def op_commit(self) -> bool:
        rid = self.pick()
        if rid is None:
            return True
        hashes, comp = self.reqs[rid]
        n = self.data.draw(st.integers(0, comp + 4))
        self.pair.ref.commit(rid, hashes, n)
        self.pair.fast.commit(rid, hashes, n)
        return True

    def op_skip(self) -> bool:
        rid = self.pick()
        if rid is None:
            return True
        nc = self.data.draw(st.integers(0, 60))
        p = self.pair
        return same_raise(lambda: p.ref.remove_skipped(rid, nc), lambda: p.fast.remove_skipped(rid, nc))

    def op_free(self) -> bool:
        rid = self.pick()
        if rid is None:
            return True
        del self.reqs[rid]
        self.pair.ref.free(rid)
        self.pair.fast.free(rid)
        return True

    def op_seed(self) -> bool:
        hashes = self.new_hashes()
        n = self.data.draw(st.integers(0, len(hashes) * TPH))
        p = self.pair
        return same_raise(lambda: p.ref.seed_prefix(hashes, n), lambda: p.fast.seed_prefix(hashes, n))

    def op_raw(self) -> bool:
        """Raw pool operations: hand out, touch a cached block, free in any order."""
        d = self.data.draw
        p = self.pair
        pa, pb = p.ref.pool, p.fast.pool
        what = d(st.sampled_from(["take", "touch", "free"]))
        if what == "take":
            n = d(st.integers(0, 6))
            if n > pa.num_free:
                return same_raise(lambda: pa.get_new_blocks(n), lambda: pb.get_new_blocks(n))
            a = [b.block_id for b in pa.get_new_blocks(n)]
            b = pb.get_new_blocks(n)
            assert a == b
            p.raw.append(b)
            return True
        if what == "touch" and pa._cached:
            key = d(st.sampled_from(sorted(pa._cached)))
            blk = pa._cached[key]
            pa.touch([blk])
            pb.touch([blk.block_id])
            p.raw.append([blk.block_id])
            return True
        if what == "free" and p.raw:
            ids = p.raw.pop(d(st.integers(0, len(p.raw) - 1)))
            order = d(st.permutations(ids))
            pa.free([pa.blocks[i] for i in order])
            pb.free(order)
        return True


OPS = ["op_new", "op_new", "op_new", "op_more", "op_more", "op_more", "op_more", "op_commit",
       "op_skip", "op_free", "op_finish", "op_finish", "op_seed", "op_raw"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), layout=layouts, num_blocks=pool_sizes,
       caching=st.sampled_from([True, True, True, False]), steps=st.integers(1, 60))
def test_fast_cache_matches_reference(data: st.DataObject, layout: Layout, num_blocks: int,
                                      caching: bool, steps: int) -> None:
    pair = Pair(layout, num_blocks, caching)
    drv = Driver(data, pair)
    for _ in range(steps):
        op = data.draw(st.sampled_from(OPS))
        ok = getattr(drv, op)()
        if not ok:
            return  # both raised the same error: states may be half-updated, stop here
        pair.check()
        for g in range(len(layout.groups)):
            for n in (0, 1, 7, 33):
                assert pair.ref.retained_range(g, n) == pair.fast.retained_range(g, n)
    for rid in list(drv.reqs):
        pair.ref.free(rid)
        pair.fast.free(rid)
        pair.check()


def test_raw_take_records_ids() -> None:
    """The raw hand-out keeps the ids so that a later free can return them."""
    pair = Pair(Layout.of([fa(2)], tokens_per_hash=2), 10, True)
    a = [b.block_id for b in pair.ref.pool.get_new_blocks(4)]
    b = pair.fast.pool.get_new_blocks(4)
    assert a == b == [1, 2, 3, 4]
    pair.ref.pool.free([pair.ref.pool.blocks[i] for i in (3, 1, 4, 2)])
    pair.fast.pool.free([3, 1, 4, 2])
    pair.check()


# -- a realistic stream -------------------------------------------------------------------------


@pytest.mark.parametrize(("num_blocks", "caching"), [(3000, True), (900, True), (3000, False)])
def test_spec6_chunked_prefill_and_decode(num_blocks: int, caching: bool) -> None:
    """Spec §6 layout, prompts of 0.5k-6k tokens sharing prefixes, chunked
    prefill of 1,024 tokens, decode steps, frees; checked after every call."""
    rng = random.Random(num_blocks + caching)
    layout = SPEC6
    tph = layout.tokens_per_hash
    pair = Pair(layout, num_blocks, caching)
    docs = [[7_000_000 * (d + 1) + i for i in range(800)] for d in range(4)]
    running: dict[str, list] = {}
    nid = 0
    for _step in range(300):
        if len(running) < 6 and rng.random() < 0.6:
            prompt = rng.randrange(500, 6000)
            shared = rng.randrange(0, prompt // tph)
            hashes = docs[rng.randrange(4)][:shared] + [nid * 10_000 + i for i in range(800 - shared)]
            hashes = hashes[: (prompt + 300) // tph]
            rid = f"q{nid}"
            nid += 1
            L, local = pair.find_hit(hashes, prompt - 1)
            num_new = min(prompt - L, 1024)
            if pair.allocate_new(rid, local, L, 0, L + num_new):
                running[rid] = [hashes, L + num_new, prompt, rng.randrange(20, 300)]
                pair.ref.commit(rid, hashes, L + num_new)
                pair.fast.commit(rid, hashes, L + num_new)
        for rid in list(running):
            hashes, comp, ntok, left = running[rid]
            num_new = min(ntok - comp, 1024) if comp < ntok else 1
            a = pair.ref.allocate_more(rid, comp, comp + num_new)
            b = pair.fast.allocate_more(rid, comp, comp + num_new)
            assert a == b
            if a is None:
                pair.ref.free(rid)
                pair.fast.free(rid)
                del running[rid]
                continue
            comp += num_new
            pair.ref.commit(rid, hashes, comp)
            pair.fast.commit(rid, hashes, comp)
            if comp >= ntok:
                left -= 1
            running[rid] = [hashes, comp, max(ntok, comp), left]
            if left <= 0:
                pair.ref.free(rid)
                pair.fast.free(rid)
                del running[rid]
        pair.check()


def test_pool_single_block_api_and_errors() -> None:
    """commit / cached / double free / request membership, one block at a time."""
    layout = Layout.of([fa(2), swa(2, 3)], tokens_per_hash=2)
    pair = Pair(layout, 8, True)
    pa, pb = pair.ref.pool, pair.fast.pool
    a = pa.get_new_blocks(2)
    b = pb.get_new_blocks(2)
    pa.commit(a[0], (11, 1))
    pb.commit(b[0], (11, 1))
    pa.commit(pa.null_block, (12, 0))
    pb.commit(0, (12, 0))
    assert pa.cached((11, 1)).block_id == pb.cached((11, 1)) == 1  # type: ignore[union-attr]
    assert pa.cached((11, 0)) is None and pb.cached((11, 0)) is None
    assert pb.blocks[1].block_hash == (11, 1) and pb.null_block.is_null
    pa.free(a)
    pb.free(b)
    pair.check()
    with pytest.raises(GpuInvariantError):
        pa.free([a[1]])
    with pytest.raises(GpuInvariantError):
        pb.free([b[1]])
    with pytest.raises(GpuInvariantError):
        pb.get_new_blocks(99)
    pair = Pair(layout, 8, False)
    assert pair.fast.pool.cached((11, 1)) is None
    pair.call("allocate_new", "x", ([], []), 0, 0, 4)
    assert "x" in pair.fast.req_blocks and "y" not in pair.fast.req_blocks
    with pytest.raises(GpuInvariantError):
        pair.fast.allocate_new("x", ([], []), 0, 0, 4)


def test_mamba_allocated_without_computed_tokens_keeps_its_last_state_block() -> None:
    """A Mamba group allocated at 0 computed tokens skips nothing; at 9 computed tokens
    the next remove_skipped frees the blocks before the last state (blocks 0-1 of 3) and
    keeps block 2, as vLLM does (its ``remove_skipped_blocks`` frees nothing for -1
    skipped tokens). Until 2026-12-06 both caches recorded -1 skipped blocks and then
    freed ``blocks[-1]`` too (docs/vllm.md, finding 13); an empty list now frees nothing."""
    layout = Layout.of([GroupSpec(GroupKind.MAMBA, 4)], tokens_per_hash=2)
    pair = Pair(layout, 20, True)
    pair.call("allocate_new", "r", ([],), 0, 0, 10)
    assert pair.fast.block_ids("r") == [[1, 2, 3]]
    pair.call("remove_skipped", "r", 9)
    pair.check()
    assert pair.fast.block_ids("r") == [[0, 0, 3]]
    pair.call("allocate_new", "e", ([],), 0, 0, 0)
    pair.call("remove_skipped", "e", 5)
    pair.check()
    assert pair.fast.block_ids("e") == [[]]


@given(bs=st.sampled_from([1, 2, 4, 8, 16, 32]), chunk=st.integers(1, 300), n=st.integers(0, 400))
def test_empty_boundary_closed_form_equals_the_scan(bs: int, chunk: int, n: int) -> None:
    """A chunked-local group's last boundary with no retained block: the fast
    cache's formula (a multiple of C / gcd(C, bs) blocks) against the reference's scan."""
    layout = Layout.of([fa(bs), cla(bs, chunk)], 1)
    assert GpuFastCache(layout, 8)._empty_boundary(1, n) == GpuKVCache(layout, 8)._empty_boundary(1, n)


def test_evicting_the_found_block_of_a_hash_leaves_its_duplicate_found() -> None:
    """The fast pool's side of the duplicate-hash corner of
    ``test_gpu_pool_stateful.py`` (block 1 found for a hash, freed and still cached;
    block 2 committed under it while in use): handing block 1 out again makes a
    lookup find block 2, as the reference pool and vLLM's map do."""
    def ident(b: object) -> object:   # the reference pool hands out Block objects, the fast one ids
        return getattr(b, "block_id", b)

    h = (2, 0)
    layout = Layout.of([fa(2)], tokens_per_hash=2)
    found = []
    for pool in (GpuKVCache(layout, 10).pool, GpuFastCache(layout, 10).pool):
        first = pool.get_new_blocks(2)
        pool.commit(first[0], h)
        pool.free(first)
        held = pool.get_new_blocks(4)
        pool.commit(held[0], h)
        taken = pool.get_new_blocks(5)
        pool.check_invariants()
        found.append(([ident(b) for b in taken], ident(pool.cached(h)), pool.num_cached))
    assert found[0] == found[1] == ([6, 7, 8, 9, 1], 2, 1)
