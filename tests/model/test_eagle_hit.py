"""The local prefix-cache hit of layouts with an EAGLE group: vLLM's coordinators drop the
last block an EAGLE group matches (a hybrid lookup first lets it match one block past the
candidate length) and look up groups of one spec as one (docs/vllm.md finding 22). The
figures below are worked by hand from vLLM 0.30.0's ``find_longest_cache_hit`` (unitary and
hybrid coordinators) and checked in lockstep with 0.29.0, 0.30.0 and 0.33.0 by
tests/tools/test_vllm_mode.py."""

from __future__ import annotations

import pytest

from sim.model.gpu_cache import GpuKVCache
from sim.model.gpu_fast import GpuFastCache
from sim.model.layout import GroupKind, GroupSpec, KVShape, Layout
from sim.model.scheduler import lookup_assertion
from tests.helpers import fa, swa

CACHES = (GpuKVCache, GpuFastCache)


def _cache_blocks(gpu: GpuKVCache | GpuFastCache, g: int, hashes: list[int], n: int) -> None:
    """Put blocks ``0 .. n-1`` of group ``g`` in the prefix cache, unreferenced."""
    layout = gpu.layout
    hpb = layout.groups[g].tokens_per_block // layout.tokens_per_hash
    for i in range(n):
        b = gpu.pool.get_new_blocks(1)[0]
        gpu.pool.commit(b, (hashes[(i + 1) * hpb - 1], g))
        gpu.pool.free([b])


@pytest.mark.parametrize("cls", CACHES)
def test_one_eagle_group_drops_its_last_matched_block(cls: type) -> None:
    """vLLM's unitary coordinator: the leading cached run, less one block."""
    layout = Layout.of([fa(16, eagle=True)], tokens_per_hash=16)
    hashes = list(range(1, 11))
    gpu = cls(layout, 64)
    _cache_blocks(gpu, 0, hashes, 10)
    assert gpu.find_hit(hashes, 159)[0] == 128      # 9 blocks within 159 tokens, less one
    assert gpu.find_hit(hashes, 100)[0] == 80       # 6 blocks, less one
    assert gpu.find_hit(hashes, 15)[0] == 0
    plain = cls(Layout.of([fa(16)], tokens_per_hash=16), 64)
    _cache_blocks(plain, 0, hashes, 10)
    assert plain.find_hit(hashes, 159)[0] == 144


@pytest.mark.parametrize("cls", CACHES)
def test_a_hybrid_eagle_group_looks_one_block_further_then_drops_it(cls: type) -> None:
    """Full attention of 16-token blocks and an EAGLE full-attention group of 32: the hit
    aligns to 32 tokens. Both groups cache 160 tokens; the hit limit is 159. The first
    group's run is 144 tokens, 128 aligned; the EAGLE group may match up to min(128 + 32,
    159) = 159 tokens, 4 blocks, 128, and drops one: 96 (one pass: a simple hybrid). Under
    0.33's cap (the request's 160 hashed tokens) it matches 5 blocks and lands on 128."""
    layout = Layout.of([fa(16), GroupSpec(GroupKind.FULL, 32, eagle=True)], tokens_per_hash=16)
    assert layout.hit_groups == (((0,), False), ((1,), True))
    hashes = list(range(1, 11))
    gpu = cls(layout, 64)
    _cache_blocks(gpu, 0, hashes, 10)
    _cache_blocks(gpu, 1, hashes, 5)
    hit, lists = gpu.find_hit(hashes, 159)
    assert hit == 96 and [len(x) for x in lists] == [6, 3]
    assert gpu.find_hit(hashes, 159, 160)[0] == 128


@pytest.mark.parametrize("cls", CACHES)
def test_an_eagle_sliding_window_needs_one_block_more(cls: type) -> None:
    """Full attention of 32-token blocks and an EAGLE window of 32 tokens in 16-token blocks
    (alignment 32): the window's match needs cdiv(31, 16) + 1 = 3 cached blocks whose run ends
    one block past an aligned boundary, then drops that block. With 128 tokens cached in both
    and a limit of 127: full attention 96; the window matches blocks 4..6 (limit 96 + 16 =
    112 tokens, 7 blocks) and drops block 6: 96."""
    layout = Layout.of([fa(32), swa(16, 32, eagle=True)], tokens_per_hash=16)
    hashes = list(range(1, 9))
    gpu = cls(layout, 64)
    _cache_blocks(gpu, 0, hashes, 4)
    _cache_blocks(gpu, 1, hashes, 8)
    hit, lists = gpu.find_hit(hashes, 127)
    assert hit == 96
    # the window's hit holds its last cdiv(31, 16) = 2 blocks before the boundary
    assert [i for i, b in enumerate(lists[1]) if (b if isinstance(b, int) else b.block_id)] == [4, 5]
    # without blocks 1 and 5: block 6 alone past 96 is too short a run; blocks 2..4 end
    # one block past 64, so the hit drops block 4: 64 (one pass: a simple hybrid)
    gpu2 = cls(layout, 64)
    _cache_blocks(gpu2, 0, hashes, 4)
    for i in (0, 2, 3, 4, 6, 7):
        _one(gpu2, 1, hashes, i)
    assert gpu2.find_hit(hashes, 127)[0] == 64
    # and with block 3 missing too only block 0's run from the start is left: 1 block, cut
    # to the alignment (0), nothing to drop
    gpu3 = cls(layout, 64)
    _cache_blocks(gpu3, 0, hashes, 4)
    for i in (0, 2, 4, 6, 7):
        _one(gpu3, 1, hashes, i)
    assert gpu3.find_hit(hashes, 127)[0] == 0


def _one(gpu: GpuKVCache | GpuFastCache, g: int, hashes: list[int], i: int) -> None:
    hpb = gpu.layout.groups[g].tokens_per_block // gpu.layout.tokens_per_hash
    b = gpu.pool.get_new_blocks(1)[0]
    gpu.pool.commit(b, (hashes[(i + 1) * hpb - 1], g))
    gpu.pool.free([b])


def test_groups_of_one_spec_are_looked_up_and_cached_as_one() -> None:
    """vLLM merges groups with equal specs into one lookup group, EAGLE when one member is;
    groups that differ in their per-layer shape stay apart."""
    same = Layout.of([fa(16), fa(16, eagle=True)], tokens_per_hash=16)
    assert same.hit_groups == (((0, 1), True),) and same.eagle_hit == (True, True)
    shaped = Layout.of([GroupSpec(GroupKind.FULL, 16, shape=KVShape(1, 1, 8)),
                        GroupSpec(GroupKind.FULL, 16, eagle=True, shape=KVShape(2, 1, 4))],
                       tokens_per_hash=16)
    assert shaped.hit_groups == (((0,), False), ((1,), True)) and shaped.eagle_hit == (False, True)
    # the layer count is not part of vLLM's per-layer spec
    layers = Layout.of([GroupSpec(GroupKind.FULL, 16, shape=KVShape(1, 1, 8)),
                        GroupSpec(GroupKind.FULL, 16, eagle=True, shape=KVShape(3, 1, 8))],
                       tokens_per_hash=16)
    assert layers.hit_groups == (((0, 1), True),)
    # full attention first, the others in group order
    mixed = Layout.of([swa(16, 32), fa(32), swa(16, 32, eagle=True)], tokens_per_hash=16)
    assert mixed.hit_groups == (((1,), False), ((0, 2), True))


def test_an_eagle_chunked_local_group_asserts_at_lookup() -> None:
    """vLLM's chunked-local finder asserts that it drops no EAGLE block, in any layout."""
    cl = GroupSpec(GroupKind.CHUNKED_LOCAL, 4, attention_chunk=12, eagle=True)
    for groups in ([cl], [cl, fa(4)]):
        msg = lookup_assertion(Layout.of(groups, tokens_per_hash=4))
        assert msg is not None and "EAGLE" in msg
    assert lookup_assertion(Layout.of([GroupSpec(GroupKind.CHUNKED_LOCAL, 4, attention_chunk=12), fa(4)],
                                      tokens_per_hash=4)) is None
