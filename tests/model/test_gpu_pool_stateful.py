"""Stateful property test of the GPU block pool (spec §5.1, vLLM's ``BlockPool``).

A hypothesis ``RuleBasedStateMachine`` drives random sequences of request
allocations (with prefix-cache hits), commits, frees, raw block hand-outs,
touches of cached blocks, null-block operations and illegal frees against a
deliberately naive reference model: a plain list for the free queue (head
first), plain lists for ref counts and hashes, a dict for the prefix cache.
After every step the pool must agree with the model block by block (ref
count, hash, free-queue order, cache map) and pass its own
``check_invariants``.

What the reference encodes, from the spec and vLLM's ``block_pool.py``:

* blocks 1..N-1 start in the free queue in id order; block 0 is the null
  block, pinned (ref 1) and never queued, touched, freed or hashed;
* a new request first touches its prefix-hit blocks (taking those at ref 0
  out of the queue), then pops its fresh blocks from the queue head; a
  popped block that still carries a hash loses it (an eviction), and the
  prefix cache forgets it if it was the cached block for that hash;
* a request's blocks are freed tail first; a block reaching ref 0 goes to
  the queue tail and keeps its hash, so it stays a prefix hit until reused;
  one without a hash (or any block without prefix caching) goes to the
  queue head, in the order freed, to be reused first;
* committing gives a hash to an unhashed block; the prefix cache finds the
  first block cached under a hash. A later block committed under the same hash
  (a duplicate) is kept behind it, as vLLM's ``BlockHashToBlockMap`` keeps
  every block of a hash: when the block a lookup finds is evicted, the oldest
  duplicate still hashed becomes the one found.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sim.model.gpu_cache import NULL_BLOCK_ID, Block, BlockPool, GpuInvariantError, GpuKVCache
from sim.model.layout import Layout
from tests.helpers import fa

BS = 2  #: tokens per block = tokens per hash: one hash per block
LAYOUT = Layout.of([fa(BS)], tokens_per_hash=BS)
MAX_BLOCKS = 6
#: hash chains of a few "prompts"; prompt 3 shares its first two blocks with prompt 0
SEQS = [
    [100 * b + i + 1 for i in range(MAX_BLOCKS)] for b in range(3)
] + [[1, 2] + [300 + i for i in range(MAX_BLOCKS - 2)]]
ALL_HASHES = sorted({(h, 0) for seq in SEQS for h in seq})


class GpuPoolMachine(RuleBasedStateMachine):
    """The pool of a one-group GPU cache against lists and dicts."""

    caching = True

    def __init__(self) -> None:
        super().__init__()
        self.gpu = GpuKVCache(LAYOUT, 2, enable_caching=self.caching)
        self.n = 2
        self.queue: list[int] = []  # free queue, head first
        self.ref: list[int] = []
        self.hash_of: list[tuple[int, int] | None] = []
        self.cached: dict[tuple[int, int], int] = {}
        #: blocks committed under a hash already cached, oldest first
        self.dups: dict[tuple[int, int], list[int]] = {}
        self.evicted = 0
        self.reqs: dict[str, tuple[list[int], list[int]]] = {}  # id -> (hashes, block ids)
        self.raw: list[list[int]] = []  # block ids held outside any request
        self.next_req = 0

    @initialize(num_blocks=st.integers(min_value=2, max_value=12))
    def start(self, num_blocks: int) -> None:
        self.n = num_blocks
        self.gpu = GpuKVCache(LAYOUT, num_blocks, enable_caching=self.caching)
        self.queue = list(range(1, num_blocks))
        self.ref = [1] + [0] * (num_blocks - 1)
        self.hash_of = [None] * num_blocks

    @property
    def pool(self) -> BlockPool:
        return self.gpu.pool

    def block(self, block_id: int) -> Block:
        return self.pool.blocks[block_id]

    # -- reference operations

    def ref_touch(self, ids: list[int]) -> None:
        for i in ids:
            if i == NULL_BLOCK_ID:
                continue
            if self.ref[i] == 0:
                self.queue.remove(i)
            self.ref[i] += 1

    def ref_pop(self, n: int) -> list[int]:
        out, self.queue = self.queue[:n], self.queue[n:]
        for i in out:
            self.ref[i] = 1
            h = self.hash_of[i]
            if h is not None:
                behind = self.dups.get(h, [])
                if self.cached.get(h) == i:
                    del self.cached[h]
                    if behind:
                        self.cached[h] = behind.pop(0)
                elif i in behind:
                    behind.remove(i)
                if not behind:
                    self.dups.pop(h, None)
                self.hash_of[i] = None
                self.evicted += 1
        return out

    def ref_free(self, ids: list[int]) -> None:
        first: list[int] = []
        for i in ids:
            if i == NULL_BLOCK_ID:
                continue
            self.ref[i] -= 1
            if self.ref[i] == 0:
                if self.caching and self.hash_of[i] is not None:
                    self.queue.append(i)
                else:
                    first.append(i)
        self.queue = first + self.queue

    def ref_commit(self, i: int, h: tuple[int, int]) -> None:
        if i == NULL_BLOCK_ID or self.hash_of[i] is not None:
            return
        self.hash_of[i] = h
        if self.caching:
            if h not in self.cached:
                self.cached[h] = i
            else:
                self.dups.setdefault(h, []).append(i)

    # -- rules: requests through GpuKVCache

    @rule(seq=st.integers(0, len(SEQS) - 1), nblocks=st.integers(1, MAX_BLOCKS),
          keep_last=st.booleans())
    def allocate(self, seq: int, nblocks: int, keep_last: bool) -> None:
        hashes = SEQS[seq][:nblocks]
        num_tokens = nblocks * BS
        max_hit = num_tokens - 1 if keep_last else num_tokens  # vLLM recomputes the last token
        hit_tokens, local = self.gpu.find_hit(hashes, max_hit)
        hit = 0
        if self.caching:
            while hit < max_hit // BS and (hashes[hit], 0) in self.cached:
                hit += 1
        hit_ids = [self.cached[(h, 0)] for h in hashes[:hit]]
        assert hit_tokens == hit * BS
        assert [b.block_id for b in local[0]] == hit_ids
        req_id = f"r{self.next_req}"
        self.next_req += 1
        need = (nblocks - hit) + sum(1 for i in hit_ids if self.ref[i] == 0)
        alloc = self.gpu.allocate_new(req_id, local, hit_tokens, 0, num_tokens)
        if need > len(self.queue):
            assert alloc is None
            return
        assert alloc is not None
        self.ref_touch(hit_ids)
        fresh = self.ref_pop(nblocks - hit)
        assert alloc.new_block_ids == (tuple(fresh),)
        assert [b.block_id for b in alloc.blocks[0]] == hit_ids + fresh
        self.reqs[req_id] = (hashes, hit_ids + fresh)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.reqs)))
        hashes, ids = self.reqs[req_id]
        upto = data.draw(st.integers(0, len(ids)))
        self.gpu.commit(req_id, hashes, upto * BS)
        for i in range(upto):
            self.ref_commit(ids[i], (hashes[i], 0))

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.reqs)))
        _, ids = self.reqs.pop(req_id)
        self.gpu.free(req_id)
        self.ref_free(ids[::-1])  # tail first

    # -- rules: the pool directly

    @rule(n=st.integers(0, 4))
    def get_new_blocks(self, n: int) -> None:
        if n > len(self.queue):
            try:
                self.pool.get_new_blocks(n)
            except GpuInvariantError:
                return
            raise AssertionError("get_new_blocks beyond the free queue should raise")
        blocks = self.pool.get_new_blocks(n)
        assert [b.block_id for b in blocks] == self.ref_pop(n)
        if blocks:
            self.raw.append([b.block_id for b in blocks])

    @precondition(lambda self: bool(self.raw))
    @rule(data=st.data())
    def commit_raw(self, data: st.DataObject) -> None:
        ids = data.draw(st.sampled_from(self.raw))
        i = data.draw(st.sampled_from(ids))
        h = data.draw(st.sampled_from(ALL_HASHES))
        self.pool.commit(self.block(i), h)
        self.ref_commit(i, h)

    @precondition(lambda self: bool(self.raw))
    @rule(data=st.data())
    def free_raw(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.raw) - 1))
        ids = data.draw(st.permutations(self.raw.pop(index)))
        self.pool.free([self.block(i) for i in ids])
        self.ref_free(list(ids))

    @precondition(lambda self: bool(self.cached))
    @rule(data=st.data())
    def touch_cached(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.cached)))
        b = self.pool.cached(h)
        assert b is not None and b.block_id == self.cached[h]
        self.pool.touch([b])
        self.ref_touch([b.block_id])
        self.raw.append([b.block_id])

    @rule(h=st.sampled_from(ALL_HASHES))
    def null_block_is_inert(self, h: tuple[int, int]) -> None:
        null = self.pool.null_block
        self.pool.touch([null])
        self.pool.free([null, null])
        self.pool.commit(null, h)
        assert null.ref_cnt == 1 and null.block_hash is None

    @precondition(lambda self: bool(self.queue))
    @rule(data=st.data())
    def double_free_raises(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.queue))
        try:
            self.pool.free([self.block(i)])
        except GpuInvariantError:
            return
        raise AssertionError(f"freeing unreferenced block {i} should raise")

    # -- checks after every step

    @invariant()
    def agrees_with_reference(self) -> None:
        pool = self.pool
        pool.check_invariants()
        assert pool.free_ids_head(self.n) == self.queue
        assert pool.num_free == len(self.queue)
        assert pool.num_used == self.n - 1 - len(self.queue)
        assert [b.ref_cnt for b in pool.blocks] == self.ref
        assert [b.block_hash for b in pool.blocks] == self.hash_of
        assert pool.num_cached == len(self.cached)
        for h in ALL_HASHES:
            b = pool.cached(h)
            assert (None if b is None else b.block_id) == self.cached.get(h)
        assert pool.num_evicted == self.evicted
        assert sum(self.ref[1:]) == sum(len(ids) for _, ids in self.reqs.values()) + sum(
            len(ids) for ids in self.raw
        )

    def teardown(self) -> None:
        # everything returned: every block but the null one is free again
        for req_id in sorted(self.reqs):
            self.gpu.free(req_id)
        for ids in self.raw:
            self.pool.free([self.block(i) for i in ids])
        assert self.pool.num_free == self.n - 1
        self.pool.check_invariants()


class GpuPoolNoCachingMachine(GpuPoolMachine):
    """Prefix caching off: committed blocks carry hashes but are never found."""

    caching = False


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=30, derandomize=True, deadline=None)
TestGpuPoolMachine = GpuPoolMachine.TestCase
TestGpuPoolMachine.settings = MACHINE_SETTINGS
TestGpuPoolNoCachingMachine = GpuPoolNoCachingMachine.TestCase
TestGpuPoolNoCachingMachine.settings = settings(MACHINE_SETTINGS, max_examples=50)


def test_evicting_the_found_block_of_a_hash_leaves_its_duplicate_found():
    """The corner the machine above reached at 25x its examples (seed 7): a hash is
    committed to a block that is then freed (still cached, in the queue), and again to
    a block in use (a duplicate); handing the first block out again evicts it, and the
    prefix cache then finds the duplicate (vLLM's map keeps both), not nothing."""
    gpu = GpuKVCache(LAYOUT, 10, enable_caching=True)
    pool = gpu.pool
    h = (2, 0)
    first = pool.get_new_blocks(2)
    pool.commit(first[0], h)
    pool.free(first)                        # block 1 keeps h at the queue's tail
    held = pool.get_new_blocks(4)           # blocks 2..5
    pool.commit(held[0], h)                 # block 2: a duplicate of h
    assert pool.cached(h) is first[0] and pool.num_cached == 1
    taken = pool.get_new_blocks(5)          # 6..9, then block 1: evicted
    assert [b.block_id for b in taken] == [6, 7, 8, 9, 1]
    assert first[0].block_hash is None
    assert pool.cached(h) is held[0] and pool.num_cached == 1
    pool.check_invariants()
