"""GPU block pool for running requests: window frees, commits, quiet thresholds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.model.gpu_cache import NULL_BLOCK_ID, GpuKVCache
from sim.model.gpu_fast import GpuFastCache
from sim.model.layout import GroupKind, GroupSpec, KVShape, Layout
from tests.helpers import fa, quiet_thresholds_from_scratch, swa


def _hashes(n: int, salt: int = 0) -> list[int]:
    return [salt * 1_000_000 + i for i in range(n)]


def test_window_blocks_are_freed_highest_index_first() -> None:
    layout = Layout.of([fa(16), swa(16, 32)], tokens_per_hash=16, blocks_per_chunk=1)
    gpu = GpuKVCache(layout, 64)
    empty: tuple[list, list] = ([], [])
    alloc = gpu.allocate_new("r", empty, 0, 0, 128)
    assert alloc is not None
    swa_ids = [b.block_id for b in gpu.req_blocks["r"][1]]
    free_before = gpu.pool.num_free
    # at 128 computed tokens the window (32) keeps tokens 97..127: blocks 6, 7
    ids = gpu.allocate_more("r", 128, 129)
    assert ids is not None and len(ids[0]) == 1 and len(ids[1]) == 1
    assert [b.block_id for b in gpu.req_blocks["r"][1][:6]] == [NULL_BLOCK_ID] * 6
    assert gpu.pool.num_free == free_before + 6 - 2   # 6 freed, one new block per group
    # the freed blocks carry no hash: they went to the head of the free queue, highest
    # index first (vLLM's free_blocks), so the step's two new blocks are two of them
    assert [list(x) for x in ids] == [[swa_ids[5]], [swa_ids[4]]]
    head = list(gpu.pool._free)[:4]
    assert head == list(reversed(swa_ids[:4]))
    gpu.free("r")
    gpu.pool.check_invariants()
    assert gpu.pool.num_used == 0


def test_allocate_more_fails_cleanly_when_short() -> None:
    layout = Layout.of([fa(16)], tokens_per_hash=16, blocks_per_chunk=1)
    gpu = GpuKVCache(layout, 4)
    assert gpu.allocate_new("r", ([],), 0, 0, 48) is not None
    assert gpu.allocate_more("r", 48, 49) is None
    assert len(gpu.req_blocks["r"][0]) == 3


KINDS = st.sampled_from(["full", "sliding_window", "chunked_local", "mamba"])


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    n = draw(st.integers(1, 3))
    groups = []
    for _ in range(n):
        kind = draw(KINDS)
        bs = draw(st.sampled_from([8, 16, 32]))
        if kind == "sliding_window":
            groups.append(GroupSpec(GroupKind.SLIDING_WINDOW, bs, window=draw(st.integers(1, 100)),
                                    extra_retained_tokens=draw(st.integers(0, 9))))
        elif kind == "chunked_local":
            chunk = bs * draw(st.integers(1, 4))
            groups.append(GroupSpec(GroupKind.CHUNKED_LOCAL, bs, attention_chunk=chunk))
        elif kind == "mamba":
            groups.append(GroupSpec(GroupKind.MAMBA, bs))
        else:
            groups.append(GroupSpec(GroupKind.FULL, bs))
    return Layout.of(groups, tokens_per_hash=8, blocks_per_chunk=1)


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(1, 300), st.lists(st.integers(1, 40), min_size=1, max_size=30),
       st.booleans())
def test_below_thresholds_nothing_changes(layout: Layout, prompt: int, steps: list[int],
                                          caching: bool) -> None:
    """Property: while the slot count stays below ``thresholds()[0]`` and the
    computed count below ``[1]``, ``allocate_more`` + ``commit`` change nothing
    (the engine skips those calls)."""
    gpu = GpuKVCache(layout, 10_000, enable_caching=caching)
    hashes = _hashes(2000)
    empty = tuple([] for _ in layout.groups)
    assert gpu.allocate_new("r", empty, 0, 0, prompt) is not None
    gpu.commit("r", hashes, prompt)
    nc = prompt
    for step in steps:
        slots_thr, comp_thr = gpu.thresholds("r")
        before = ([[b.block_id for b in bl] for bl in gpu.req_blocks["r"]],
                  gpu.pool.num_free, gpu.pool.num_cached)
        ids = gpu.allocate_more("r", nc, nc + step)
        assert ids is not None
        gpu.commit("r", hashes, nc + step)
        after = ([[b.block_id for b in bl] for bl in gpu.req_blocks["r"]],
                 gpu.pool.num_free, gpu.pool.num_cached)
        if nc + step < slots_thr and nc < comp_thr:
            assert after == before
        nc += step
    gpu.free("r")
    gpu.pool.check_invariants()


def _reference_window_hit(gpu: GpuKVCache, g: int, hashes: list[int], max_tokens: int) -> int:
    """The plain definition: the largest boundary whose hit blocks are all cached; a sliding
    window's hit ends on a cached block even where it needs none (a window of one token)."""
    bs = gpu.layout.groups[g].tokens_per_block
    window = gpu.layout.groups[g].kind is GroupKind.SLIDING_WINDOW
    for end in range(max_tokens // bs, 0, -1):
        first = gpu.hit_first(g, end * bs)
        if window:
            first = min(first, end - 1)
        if all(gpu.pool.cached((hashes[(i + 1) * (bs // 8) - 1], g)) is not None for i in range(first, end)):
            return end * bs
    return 0


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["sw", "cl"]), st.sampled_from([8, 16]), st.integers(1, 100), st.integers(0, 3),
       st.integers(1, 4), st.integers(1, 60), st.data())
def test_window_hit_scan_equals_the_definition(kind: str, bs: int, window: int, extra: int, chunks: int,
                                               n: int, data: st.DataObject) -> None:
    g1 = (GroupSpec(GroupKind.SLIDING_WINDOW, bs, window=window, extra_retained_tokens=extra)
          if kind == "sw" else GroupSpec(GroupKind.CHUNKED_LOCAL, bs, attention_chunk=bs * chunks))
    gpu = GpuKVCache(Layout.of([GroupSpec(GroupKind.FULL, bs), g1], tokens_per_hash=8, blocks_per_chunk=1),
                     4000)
    hashes = list(range(1, n * bs // 8 + 1))
    cached = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    for i, c in enumerate(cached):
        if c:
            b = gpu.pool.get_new_blocks(1)[0]
            gpu.pool.commit(b, (hashes[(i + 1) * (bs // 8) - 1], 1))
            gpu.pool.free([b])
    max_tokens = data.draw(st.integers(0, n * bs))
    assert gpu._group_hit(1, hashes, max_tokens) == _reference_window_hit(gpu, 1, hashes, max_tokens)


def _hashed(gpu: GpuKVCache | GpuFastCache, req: str) -> list[list[bool]]:
    """Per group, whether each block of ``req`` carries a hash."""
    if isinstance(gpu, GpuFastCache):
        return [[b != NULL_BLOCK_ID and gpu.pool.bhash[b] is not None for b in ids]
                for ids in gpu.block_ids(req)]
    return [[b.block_hash is not None for b in blocks] for blocks in gpu.req_blocks[req]]


def test_hybrid_layouts_hash_up_to_the_scheduler_block_size() -> None:
    """vLLM's hybrid coordinator caches a request's blocks only up to its computed tokens
    rounded down to the scheduler block size (the groups' least common multiple, 32 here;
    ``_align_cacheable``, 0.29 to 0.33), an EAGLE group one block further; one group
    caches every complete block. Found by the differential mode: kvsim hashed a decoding
    request's blocks past the boundary, so they went to the tail of the free queue when it
    finished where vLLM's (unhashed) went to the head, and later block ids, and a flush,
    differed."""
    other = GroupSpec(GroupKind.FULL, 8, shape=KVShape(layers=1, kv_heads=2, head_size=64))
    layout = Layout.of([fa(32), fa(8, eagle=True), other], tokens_per_hash=8, blocks_per_chunk=1)
    assert layout.gpu_cache_align == 32
    assert [layout.cacheable_tokens(g, 60) for g in range(3)] == [32, 40, 32]
    # a group of the EAGLE group's spec is looked up with it, and cached as EAGLE too
    same = Layout.of([fa(32), fa(8, eagle=True), fa(8)], tokens_per_hash=8, blocks_per_chunk=1)
    assert same.hit_groups == (((0,), False), ((1, 2), True))
    assert [same.cacheable_tokens(g, 60) for g in range(3)] == [32, 40, 40]
    assert [layout.cacheable_tokens(g, 20) for g in range(3)] == [0, 0, 0]
    hashes = _hashes(16)
    for cls in (GpuKVCache, GpuFastCache):
        gpu = cls(layout, 64)
        assert gpu.allocate_new("r", ([], [], []), 0, 0, 60) is not None
        gpu.commit("r", hashes, 60)
        assert _hashed(gpu, "r") == [[True, False], [True] * 5 + [False] * 3, [True] * 4 + [False] * 4], cls
        assert gpu.allocate_more("r", 60, 64) is not None
        gpu.commit("r", hashes, 64)   # the boundary at 64: every complete block
        assert _hashed(gpu, "r") == [[True, True], [True] * 8, [True] * 8], cls
    one = Layout.of([fa(8)], tokens_per_hash=8, blocks_per_chunk=1)
    assert one.gpu_cache_align is None and one.cacheable_tokens(0, 60) == 60
    for cls in (GpuKVCache, GpuFastCache):
        gpu = cls(one, 64)
        assert gpu.allocate_new("r", ([],), 0, 0, 60) is not None
        gpu.commit("r", hashes, 60)
        assert _hashed(gpu, "r") == [[True] * 7 + [False]], cls


def test_a_window_hit_needs_the_window_without_its_extra_retained_tokens() -> None:
    """vLLM's sliding-window prefix hit needs the last ``cdiv(W - 1, block size)`` blocks
    before the boundary cached (``_contiguous_blocks_for_hit``, 0.29 to 0.33), not the
    ``extra_retained_tokens`` the group keeps while running: with W = 32, 8-token blocks
    and 6 extra tokens a hit at 64 tokens needs blocks 4..7, not 3..7, and hands out those
    four. Found by the differential mode on the DeepSeek-V4-style MTP layout (vLLM hit 512
    tokens on the GPU where kvsim's model hit none)."""
    layout = Layout.of([swa(8, 32, extra=6)], tokens_per_hash=8, blocks_per_chunk=1)
    hashes = _hashes(8)
    for cls in (GpuKVCache, GpuFastCache):
        gpu = cls(layout, 64)
        assert gpu.allocate_new("a", ([],), 0, 0, 64) is not None
        gpu.commit("a", hashes, 64)
        gpu.free("a")
        hit, lists = gpu.find_hit(hashes, 64)
        assert hit == 64, cls
        ids = [b if isinstance(b, int) else b.block_id for b in lists[0]]
        assert [b != NULL_BLOCK_ID for b in ids] == [False] * 4 + [True] * 4, cls
        assert gpu.hit_first(0, 64) == 4 and gpu.retained_range(0, 64)[0] == 3, cls


def test_a_hash_stays_cached_while_another_block_carries_it() -> None:
    """vLLM's prefix cache keeps every block committed under a hash (``BlockHashToBlockMap``):
    when the entry is evicted, the earliest other block with that hash serves hits. Two
    requests compute the same 32 tokens in blocks 1-2 and 3-4; freed (tail first), the
    queue is 2, 1, 4, 3; taking two blocks evicts 2 and 1, and the prefix still hits, now
    in 3-4. Found by the differential mode (Mooncake, vLLM hit 25,088 tokens on the GPU
    where kvsim's model had lost them)."""
    layout = Layout.of([fa(16)], tokens_per_hash=16, blocks_per_chunk=1)
    hashes = _hashes(2)
    for cls in (GpuKVCache, GpuFastCache):
        gpu = cls(layout, 5)
        for req in ("a", "b"):
            assert gpu.allocate_new(req, ([],), 0, 0, 32) is not None
            gpu.commit(req, hashes, 32)
        assert gpu.block_ids("a") == [[1, 2]] and gpu.block_ids("b") == [[3, 4]]
        gpu.free("a")
        gpu.free("b")
        assert gpu.pool.num_cached == 2
        assert gpu.allocate_new("c", ([],), 0, 0, 32) is not None
        assert gpu.block_ids("c") == [[2, 1]], cls   # tail first: evicts the entries
        hit, lists = gpu.find_hit(hashes, 32)
        assert hit == 32 and [b if isinstance(b, int) else b.block_id for b in lists[0]] == [3, 4], cls
        assert gpu.pool.num_cached == 2, cls


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(1, 300), st.lists(st.integers(1, 40), min_size=1, max_size=40),
       st.booleans(), st.booleans(), st.data())
def test_quiet_thresholds_are_tight_and_safe(layout: Layout, prompt: int, steps: list[int],
                                             caching: bool, eagle: bool, data: st.DataObject) -> None:
    """Property: the fast cache's :meth:`GpuFastCache.quiet_thresholds` are never
    below :meth:`GpuFastCache.thresholds`, and while the slot count stays below
    ``[0]`` and the computed count below ``[1]``, ``allocate_more`` + ``commit``
    (with the hashes known so far, and only with prefix caching on, as the
    scheduler calls them) change nothing,
    not even the request's commit and skip marks; decode runs (1 token a step)
    and EAGLE window groups included."""
    if eagle:
        groups = [GroupSpec(g.kind, g.tokens_per_block, window=g.window, eagle=True)
                  if g.kind is GroupKind.SLIDING_WINDOW else g for g in layout.groups]
        layout = Layout.of(groups, tokens_per_hash=8, blocks_per_chunk=1)
    if data.draw(st.booleans()):
        steps = steps[:3] + [1] * 300
    gpu = GpuFastCache(layout, 10_000, enable_caching=caching)
    hashes = _hashes(2000)
    empty = tuple([] for _ in layout.groups)
    assert gpu.allocate_new("r", empty, 0, 0, prompt) is not None
    if caching:   # the scheduler commits only with prefix caching on
        gpu.commit("r", hashes[: prompt // 8], prompt)
    nc = prompt
    for step in steps:
        slots_thr, comp_thr = gpu.quiet_thresholds("r")
        assert (slots_thr, comp_thr) == quiet_thresholds_from_scratch(gpu, "r")
        plain = gpu.thresholds("r")
        assert slots_thr >= plain[0] and comp_thr >= plain[1]
        t = gpu._tables["r"]
        before = (gpu.block_ids("r"), gpu.pool.num_free, gpu.pool.num_cached, list(t.done), list(t.skipped))
        ids = gpu.allocate_more("r", nc, nc + step)
        assert ids is not None
        if caching:
            gpu.commit("r", hashes[: (nc + step) // 8], nc + step)
        after = (gpu.block_ids("r"), gpu.pool.num_free, gpu.pool.num_cached, list(t.done), list(t.skipped))
        if nc + step < slots_thr and nc < comp_thr:
            assert after == before
        nc += step
    gpu.free("r")
    gpu.pool.check_invariants()


def test_a_one_token_window_hit_ends_on_a_cached_block() -> None:
    """A sliding window of one token needs no block before a boundary (``cdiv(W - 1, bs)``
    is 0), yet vLLM's finder ends the hit on the rightmost cached block, and finds none when
    none is cached; kvsim took any boundary (the whole prompt) as a hit. Found in lockstep
    with vLLM 0.29.0 and 0.30.0 (the run fuzzer's seed 9 run 35, seeds 12 run 40, 13 run 56,
    14 run 48: kvsim hit 200 tokens where vLLM hit none; docs/vllm.md finding 27)."""
    layout = Layout.of([fa(16), swa(16, 1)], tokens_per_hash=16, blocks_per_chunk=1)
    hashes = _hashes(10)
    for cls in (GpuKVCache, GpuFastCache):
        gpu = cls(layout, 64)
        for i in range(10):   # full attention caches all ten blocks, the window none
            b = gpu.pool.get_new_blocks(1)[0]
            gpu.pool.commit(b, (hashes[i], 0))
            gpu.pool.free([b])
        assert gpu.find_hit(hashes, 159)[0] == 0, cls
        b = gpu.pool.get_new_blocks(1)[0]
        gpu.pool.commit(b, (hashes[3], 1))   # the window's block 3
        gpu.pool.free([b])
        assert gpu.find_hit(hashes, 159)[0] == 64, cls
