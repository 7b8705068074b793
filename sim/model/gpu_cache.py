"""GPU KV block pool with prefix caching, and per-kind block allocation.

What it models
    vLLM's ``BlockPool`` (one pool shared by every KV cache group of a hybrid
    model): block 0 is the shared *null* block that stands for positions a
    window-type group does not retain; the other blocks sit in a free queue
    in id order; ``get_new_blocks`` pops from the head of the queue (evicting
    the prefix-cache entry of a block that still carried a hash); freed
    blocks are appended at the tail, a request's blocks in reverse order so
    that its tail is reused first; a cached block found by a prefix hit is
    *touched* (taken out of the free queue while referenced).

    Allocation for a new request with L locally computed tokens and E
    external tokens (N = L + E) follows vLLM's three phases, each over all
    groups in order (spec §5.1): (1) pad the block list with
    ``skipped(N) // bs`` null blocks and keep the local-hit blocks after them;
    (2) append fresh blocks up to ``cdiv(N, bs)`` for the external tokens when
    the group retains any of them; (3) append fresh blocks up to the slots
    the step needs (``cdiv(N + new tokens + lookahead, bs)``). Fresh blocks
    carry no hash until they are committed.

    Mamba groups are modelled as vLLM's ``mamba_cache_mode = "all"`` (a state
    block per block, all but the last freed at the next step; checked against
    vLLM 0.29 and 0.30 in that mode, docs/vllm.md finding 13); vLLM's default
    with prefix caching, ``"align"`` (the only mode of 0.33), is not modelled.

Simplifications
    * The admission check counts the blocks the request still needs, without
      vLLM's watermark or the cost of evicting cached blocks.
    * A prefix hit is found per group with the kind's rule and the groups
      are brought to a common boundary by a fixed point (vLLM's hybrid
      coordinator does the same with attention-type specific steps). A layout
      with an EAGLE group is searched as vLLM does (:func:`eagle_hit`: the
      dropped last block, groups of one spec looked up as one). Partial-block
      hits, and the partial hash vLLM gives a block the prompt ends in when
      its block is larger than vLLM's hash block (docs/vllm.md finding 23),
      are not modelled.

Invariants
    * a block is in the free queue exactly when its ref count is 0;
    * the null block is never in the free queue and never freed;
    * a hashed block is findable in the prefix cache until it is reused.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sim.model.layout import GroupKind, Layout, cdiv

__all__ = ["NULL_BLOCK_ID", "Block", "BlockPool", "GpuInvariantError", "GpuKVCache", "eagle_hit"]

NULL_BLOCK_ID = 0


class GpuInvariantError(RuntimeError):
    """A simulator bug: the GPU pool's bookkeeping is inconsistent."""


class Block:
    """One GPU KV block. ``block_hash`` is ``(hash, group)`` once committed."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: tuple[int, int] | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Free queue, prefix-cache map and reference counts of all GPU blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("a GPU block pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # pinned forever
        #: head = next block handed out; ordered by id initially, then by free time
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[tuple[int, int], Block] = {}
        #: the other blocks carrying a cached hash, in commit order (vLLM keeps every block
        #: of a hash findable; the entry is the earliest still there)
        self._dups: dict[tuple[int, int], list[Block]] = {}
        #: blocks whose cached hash was dropped because they were reused
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by some request (the null block excluded)."""
        return self.num_blocks - 1 - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks findable in the prefix cache."""
        return len(self._cached)

    def free_ids_head(self, n: int) -> list[int]:
        """Ids of the next ``n`` blocks :meth:`get_new_blocks` would hand out."""
        return list(itertools.islice(self._free, n))

    def get_new_blocks(self, n: int) -> list[Block]:
        """Pop ``n`` blocks from the head of the free queue (ref count 1, no hash)."""
        free = self._free
        if n > len(free):
            raise GpuInvariantError(f"asked for {n} blocks with {len(free)} free")
        pop = free.popitem
        out = [pop(last=False)[1] for _ in range(n)]
        for b in out:
            b.ref_cnt = 1
            h = b.block_hash
            if h is not None:
                self._uncache(h, b)
                b.block_hash = None
                self.num_evicted += 1
        return out

    def _uncache(self, h: tuple[int, int], b: Block) -> None:
        """``b`` loses hash ``h``: if it was the entry, the earliest other block with
        that hash becomes the entry (vLLM's ``BlockHashToBlockMap`` keeps every
        block of a hash), else it leaves the duplicates."""
        cached = self._cached
        dups = self._dups.get(h)
        if cached.get(h) is b:
            if dups:
                cached[h] = dups.pop(0)
                if not dups:
                    del self._dups[h]
            else:
                del cached[h]
        elif dups is not None and b in dups:
            dups.remove(b)
            if not dups:
                del self._dups[h]

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-hit blocks (out of the free queue at 0 -> 1)."""
        for b in blocks:
            if b.block_id == NULL_BLOCK_ID:
                continue
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference of each block, in the given order; blocks reaching
        0 go to the tail of the free queue, keeping their hash for reuse, or, with
        no hash (or no prefix caching), to its head, to be reused first (vLLM's
        ``free_blocks``)."""
        first: list[Block] = []
        for b in blocks:
            if b.block_id == NULL_BLOCK_ID:
                continue
            if b.ref_cnt <= 0:
                raise GpuInvariantError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if self.enable_caching and b.block_hash is not None:
                    self._free[b.block_id] = b
                else:
                    first.append(b)
        for b in reversed(first):
            self._free[b.block_id] = b
            self._free.move_to_end(b.block_id, last=False)

    def commit(self, block: Block, block_hash: tuple[int, int]) -> None:
        """Give a computed block its hash (it becomes a prefix-cache entry)."""
        if block.block_id == NULL_BLOCK_ID or block.block_hash is not None:
            return
        block.block_hash = block_hash
        if self.enable_caching:
            if block_hash not in self._cached:
                self._cached[block_hash] = block
            else:   # a second block with this hash: findable once the entry goes
                self._dups.setdefault(block_hash, []).append(block)

    def cached(self, block_hash: tuple[int, int]) -> Block | None:
        """The cached block with this hash, if any."""
        return self._cached.get(block_hash) if self.enable_caching else None

    def check_invariants(self) -> None:
        """Raise :class:`GpuInvariantError` on inconsistent bookkeeping."""
        for b in self.blocks[1:]:
            if (b.ref_cnt == 0) != (b.block_id in self._free):
                raise GpuInvariantError(f"{b} free-queue membership disagrees with its ref count")
            if b.ref_cnt < 0:
                raise GpuInvariantError(f"{b} has a negative ref count")
        for h, b in self._cached.items():
            if b.block_hash != h:
                raise GpuInvariantError(f"prefix cache maps {h} to {b}")


def eagle_hit(layout: Layout, cached: Callable[[int, int], bool], group_hit: Callable[[int, int], int],
              max_tokens: int, margin_cap: int) -> int:
    """The local hit of a layout with an EAGLE group, as vLLM's coordinators find it.

    vLLM drops the last block an EAGLE group matches (its KV at the chunk's last
    token was written with the next, speculative, token); a hybrid lookup lets such a
    group match one block past the candidate length first (capped at ``margin_cap``:
    ``max_tokens`` in 0.29 and 0.30, the request's hashed tokens in 0.33, see
    :attr:`~sim.model.windows.WindowProfile.eagle_margin_past_limit`), so that the drop
    lands back on it. The groups are looked up by vLLM's spec classes
    (:attr:`~sim.model.layout.Layout.hit_groups`): full attention first, each class once
    per candidate length, until no class shortens it (one pass when the layout is one
    full-attention class and one other). Each class's finder is vLLM's: full attention
    its leading cached run, a sliding window the rightmost run of ``cdiv(W - 1, bs)``
    cached blocks (one more with the drop) ending on the alignment (the layout's least
    common block size), the drop taking the last block and rounding to the alignment
    again; chunked-local and Mamba groups keep kvsim's finders (``group_hit``: vLLM
    asserts on an EAGLE chunked-local group, :func:`sim.model.scheduler.lookup_assertion`,
    and its Mamba finder does not drop).

    Args:
        cached: ``cached(g, i)``: block ``i`` of group ``g`` is in the prefix cache.
        group_hit: kvsim's finder of one group, ``group_hit(g, max_tokens)``.
    """
    groups = layout.groups
    if len(groups) == 1:   # vLLM's unitary coordinator: one lookup, aligned to the block size
        return _class_hit(layout, cached, group_hit, (0,), max_tokens, groups[0].eagle,
                          groups[0].tokens_per_block)
    align = layout.scheduler_block_size
    classes = layout.hit_groups
    simple = len(classes) == 2 and groups[classes[0][0][0]].kind is GroupKind.FULL
    hit = max_tokens
    full: dict[int, int] = {}
    verified: set[int] = set()
    while True:
        curr = hit
        for idx, (members, eagle) in enumerate(classes):
            spec = groups[members[0]]
            if idx in full:     # full attention is looked up once, then only trimmed
                curr = min(curr, full[idx])
                continue
            drop = eagle and idx not in verified
            limit = curr
            if drop and spec.kind is not GroupKind.MAMBA:
                limit = min(curr + spec.tokens_per_block, margin_cap)
            new = _class_hit(layout, cached, group_hit, members, limit, drop, align)
            if spec.kind is GroupKind.FULL:
                full[idx] = new
            if drop:
                verified.add(idx)
            elif new < curr:
                verified.clear()
            curr = new
        if curr >= hit:
            return hit
        hit = curr
        if simple:
            return hit


def _class_hit(layout: Layout, cached: Callable[[int, int], bool], group_hit: Callable[[int, int], int],
               members: tuple[int, ...], max_tokens: int, drop: bool, align: int) -> int:
    """One spec class's hit at most ``max_tokens`` (see :func:`eagle_hit`)."""
    spec = layout.groups[members[0]]
    bs = spec.tokens_per_block
    n = max_tokens // bs

    def all_cached(i: int) -> bool:
        return all(cached(g, i) for g in members)

    if spec.kind is GroupKind.FULL:
        run = 0
        while run < n and all_cached(run):
            run += 1
        hit = run * bs
        if drop and hit:
            hit -= min(align, bs)
        return hit - hit % align
    if spec.kind is not GroupKind.SLIDING_WINDOW:
        return min(group_hit(g, max_tokens) for g in members)
    assert spec.window is not None
    need = cdiv(spec.window - 1, bs) + int(drop)
    kept = -1      # blocks [0, kept) of the match, -1 while none
    run = 0
    for i in range(n - 1, -1, -1):
        if not all_cached(i):
            run = 0
            continue
        if run == 0 and bs != align and ((i if drop else i + 1) * bs) % align:
            continue      # a run must end on the alignment (after the drop)
        run += 1
        if run >= need:
            kept = i + run
            break
    per = align // bs     # blocks per alignment step (the alignment is a multiple of bs)
    if kept < 0:          # no match: a run from block 0 counts, cut to the alignment
        kept = run - run % per
    if drop and kept > 0:
        kept -= 1
        kept -= kept % per
    return kept * bs


@dataclass(frozen=True, slots=True)
class Allocation:
    """Per-group block lists of one request after an allocation."""

    blocks: tuple[list[Block], ...]
    new_block_ids: tuple[tuple[int, ...], ...]
    #: per group, how many leading entries are the null block
    null_prefix: tuple[int, ...]


class GpuKVCache:
    """Per-group block tables over one shared :class:`BlockPool`.

    Args:
        layout: the KV cache groups.
        num_blocks: size of the shared pool, the null block included.
        enable_caching: GPU prefix caching on or off.
    """

    def __init__(self, layout: Layout, num_blocks: int, enable_caching: bool = True) -> None:
        self.layout = layout
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, tuple[list[Block], ...]] = {}
        #: per request and group: blocks below this index are committed or null
        self._committed: dict[str, list[int]] = {}
        #: per request and group: blocks below this index were replaced by null
        self._skipped: dict[str, list[int]] = {}
        self._bs = tuple(g.tokens_per_block for g in layout.groups)
        self._hpb = tuple(bs // layout.tokens_per_hash for bs in self._bs)
        #: a group is looked up as EAGLE: vLLM's own search (:func:`eagle_hit`)
        self._eagle = any(layout.eagle_hit)

    # -- retention ------------------------------------------------------------------

    def retained_range(self, g: int, num_tokens: int) -> tuple[int, int]:
        """Block index range ``[first, end)`` group ``g`` keeps real at boundary
        ``num_tokens`` (spec §5.1 table)."""
        spec = self.layout.groups[g]
        bs = self._bs[g]
        end = cdiv(num_tokens, bs)
        if spec.kind is GroupKind.MAMBA:
            return (max(0, (num_tokens - 1) // bs), end)
        return (spec.skipped_tokens(num_tokens) // bs, end)

    def hit_first(self, g: int, num_tokens: int) -> int:
        """:meth:`~sim.model.layout.Layout.hit_first_block` of this cache's layout."""
        return self.layout.hit_first_block(g, num_tokens)

    def _block_hash(self, g: int, block_hashes: Sequence[int], i: int) -> tuple[int, int]:
        return (block_hashes[(i + 1) * self._hpb[g] - 1], g)

    # -- prefix cache hits -------------------------------------------------------------

    def find_hit(self, block_hashes: Sequence[int], max_tokens: int,
                 margin_cap: int | None = None) -> tuple[int, tuple[list[Block], ...]]:
        """Longest local prefix-cache hit usable by every group, at most ``max_tokens``
        (``margin_cap``: how far an EAGLE group may look past it, :func:`eagle_hit`;
        default ``max_tokens``).

        Returns:
            ``(L, blocks)`` with per-group hit lists of ``L // bs_g`` entries
            (null where the kind does not need the block).
        """
        layout = self.layout
        if not self.pool.enable_caching:
            return 0, tuple([] for _ in layout.groups)
        if self._eagle:   # vLLM's own search, with the EAGLE drop (see eagle_hit)
            hit = eagle_hit(layout, lambda g, i: self._is_cached(g, block_hashes, i),
                            lambda g, m: self._group_hit(g, block_hashes, m), max_tokens,
                            max_tokens if margin_cap is None else margin_cap)
            return hit, self.hit_blocks(block_hashes, hit)
        hit = max_tokens
        changed = True
        while changed and hit > 0:
            changed = False
            for g in layout.lookup_order:
                h = self._group_hit(g, block_hashes, hit)
                if h < hit:
                    hit, changed = h, True
        lists = tuple(self._hit_blocks(g, block_hashes, hit) for g in range(len(layout.groups)))
        return hit, lists

    def _group_hit(self, g: int, block_hashes: Sequence[int], max_tokens: int) -> int:
        """Longest hit of group ``g`` alone, at most ``max_tokens``, by its kind's rule."""
        n = max_tokens // self._bs[g]
        kind = self.layout.groups[g].kind
        if kind is GroupKind.FULL:
            return self._prefix_hit(g, block_hashes, n)
        if kind is GroupKind.MAMBA:
            return self._last_block_hit(g, block_hashes, n)
        return self._window_hit(g, block_hashes, n)

    def _is_cached(self, g: int, block_hashes: Sequence[int], i: int) -> bool:
        return self.pool.cached(self._block_hash(g, block_hashes, i)) is not None

    def _prefix_hit(self, g: int, block_hashes: Sequence[int], n: int) -> int:
        """Full attention: the leading run of cached blocks among the first ``n``."""
        i = 0
        while i < n and self._is_cached(g, block_hashes, i):
            i += 1
        return i * self._bs[g]

    def _last_block_hit(self, g: int, block_hashes: Sequence[int], n: int) -> int:
        """Mamba: the boundary after the rightmost cached block among the first ``n``."""
        for i in range(n - 1, -1, -1):
            if self._is_cached(g, block_hashes, i):
                return (i + 1) * self._bs[g]
        return 0

    def _empty_boundary(self, g: int, n: int) -> int:
        """The largest boundary (in blocks, at most ``n``) at which window-type
        group ``g`` retains nothing, 0 when there is none: a chunked-local
        boundary on its attention chunk. A sliding window has none, even of one
        token (which retains nothing at a block boundary): vLLM's finder ends its
        hit on the rightmost cached block (docs/vllm.md finding 27)."""
        spec = self.layout.groups[g]
        if spec.kind is GroupKind.CHUNKED_LOCAL:
            bs = self._bs[g]
            for end in range(n, 0, -1):
                if self.retained_range(g, end * bs)[0] >= end:
                    return end
            return 0
        # a sliding window of one token needs no block before a boundary, yet vLLM's finder
        # still ends a hit on a cached block (its rightmost one): no boundary is empty
        return 0

    def _window_hit(self, g: int, block_hashes: Sequence[int], n: int) -> int:
        """Sliding window / chunked local: the largest boundary ``end`` (at most
        ``n`` blocks) whose retained blocks [first(end), end) are all cached.

        Scans runs of cached blocks from the right; first(end) never decreases
        with end, so within a run [j, i] only end = i + 1 can qualify. Each
        block is looked at once. A boundary that retains nothing qualifies as
        it is (:meth:`_empty_boundary`)."""
        bs = self._bs[g]
        empty = self._empty_boundary(g, n)
        i = n - 1
        while i >= empty:
            if not self._is_cached(g, block_hashes, i):
                i -= 1
                continue
            j = i
            while j > 0 and self._is_cached(g, block_hashes, j - 1):
                j -= 1
            if self.hit_first(g, (i + 1) * bs) >= j:
                return (i + 1) * bs
            i = j - 2
        return empty * bs

    def hit_blocks(self, block_hashes: Sequence[int], hit: int) -> tuple[list[Block], ...]:
        """The per-group blocks of a local hit of exactly ``hit`` tokens, taken as given
        (not searched for: no EAGLE drop), as :meth:`find_hit` returns them."""
        return tuple(self._hit_blocks(g, block_hashes, hit) for g in range(len(self.layout.groups)))

    def _hit_blocks(self, g: int, block_hashes: Sequence[int], hit: int) -> list[Block]:
        n = hit // self._bs[g]
        first = self.hit_first(g, hit)
        if self.layout.groups[g].kind is GroupKind.FULL:
            first = 0
        out = [self.pool.null_block] * n
        for i in range(first, n):
            b = self.pool.cached(self._block_hash(g, block_hashes, i))
            if b is None:
                raise GpuInvariantError(f"hit block {i} of group {g} vanished")
            out[i] = b
        return out

    # -- allocation ---------------------------------------------------------------------

    def blocks_needed(self, local: Sequence[Sequence[Block]], local_tokens: int,
                      external_tokens: int, num_slots: int,
                      caps: Sequence[int | None] | None = None) -> int:
        """Fresh blocks a new request's allocation takes (plus cached hit blocks
        it pulls out of the free queue); ``caps``: per group, at most this many
        blocks are required (vLLM's admission cap of a recycling group)."""
        total = 0
        n_comp = local_tokens + external_tokens
        for g in range(len(self.layout.groups)):
            first, _ = self.retained_range(g, n_comp)
            have = max(first, len(local[g]))
            required = cdiv(max(num_slots, n_comp), self._bs[g])
            cap = caps[g] if caps is not None else None
            if cap is not None:
                required = min(required, cap)
            total += max(0, required - have)
            total += sum(1 for b in local[g][first:] if b.ref_cnt == 0 and not b.is_null)
        return total

    def more_blocks_needed(self, req_id: str, num_tokens: int, caps: Sequence[int | None]) -> int:
        """Blocks a request that holds blocks still needs for ``num_tokens`` tokens, each
        group's requirement capped by ``caps`` (vLLM's full-input admission check)."""
        total = 0
        for g, blocks in enumerate(self.req_blocks[req_id]):
            required = cdiv(num_tokens, self._bs[g])
            cap = caps[g]
            if cap is not None:
                required = min(required, cap)
            total += max(0, required - len(blocks))
        return total

    def allocate_new(
        self,
        req_id: str,
        local: Sequence[Sequence[Block]],
        local_tokens: int,
        external_tokens: int,
        num_slots: int,
    ) -> Allocation | None:
        """First allocation of a request (vLLM ``allocate_slots`` for a new request).

        Args:
            req_id: request id.
            local: per-group local-hit block lists (from :meth:`find_hit`).
            local_tokens: L, locally computed tokens.
            external_tokens: E, tokens to come from the connector.
            num_slots: token slots needed after this step (>= L + E).

        Returns:
            The allocation, or None when the pool has too few free blocks.
        """
        if req_id in self.req_blocks:
            raise GpuInvariantError(f"request {req_id} already has blocks")
        if self.blocks_needed(local, local_tokens, external_tokens, num_slots) > self.pool.num_free:
            return None
        pool = self.pool
        n_comp = local_tokens + external_tokens
        ngroups = len(self.layout.groups)
        lists: tuple[list[Block], ...] = tuple([] for _ in range(ngroups))
        new_ids: list[list[int]] = [[] for _ in range(ngroups)]
        nulls = [0] * ngroups
        # phase 1: local hits after the null padding, every group first
        for g in range(ngroups):
            # a Mamba group at 0 computed tokens skips -1 tokens: nothing (vLLM frees nothing then)
            skip = max(0, self.layout.groups[g].skipped_tokens(n_comp) // self._bs[g])
            kept = list(local[g][skip:])
            pool.touch(kept)
            lists[g].extend([pool.null_block] * skip)
            lists[g].extend(kept)
            nulls[g] = skip
        # phase 2: fresh blocks for the retained external tokens
        if external_tokens:
            for g in range(ngroups):
                spec = self.layout.groups[g]
                skipped = spec.skipped_tokens(n_comp)
                if min(n_comp - skipped, external_tokens) <= 0:
                    continue
                fresh = pool.get_new_blocks(max(0, cdiv(n_comp, self._bs[g]) - len(lists[g])))
                lists[g].extend(fresh)
                new_ids[g].extend(b.block_id for b in fresh)
        # phase 3: slots for the tokens this step computes
        for g in range(ngroups):
            want = cdiv(num_slots, self._bs[g]) - len(lists[g])
            if want > 0:
                fresh = pool.get_new_blocks(want)
                lists[g].extend(fresh)
                new_ids[g].extend(b.block_id for b in fresh)
        self.req_blocks[req_id] = lists
        self._committed[req_id] = [0] * ngroups
        self._skipped[req_id] = list(nulls)
        return Allocation(lists, tuple(tuple(x) for x in new_ids), tuple(nulls))

    def remove_skipped(self, req_id: str, num_computed: int) -> None:
        """Free the blocks a window-type group no longer attends over once
        ``num_computed`` tokens are computed (vLLM ``remove_skipped_blocks``):
        they become null in the request's list and go to the free queue,
        highest index first."""
        lists = self.req_blocks[req_id]
        skipped = self._skipped[req_id]
        groups = self.layout.groups
        pool = self.pool
        null = pool.null_block
        for g, blocks in enumerate(lists):
            spec = groups[g]
            if spec.kind is GroupKind.FULL:
                continue
            first = self.retained_range(g, num_computed)[0]
            first = min(first, len(blocks))
            done = skipped[g]
            if first <= done:
                continue
            removed = []
            for i in range(first - 1, done - 1, -1):
                b = blocks[i]
                if b.block_id != NULL_BLOCK_ID:
                    removed.append(b)
                    blocks[i] = null
            skipped[g] = first
            pool.free(removed)

    def allocate_more(self, req_id: str, num_computed: int,
                      num_slots: int) -> tuple[tuple[int, ...], ...] | None:
        """Slots for a request that already holds blocks (vLLM ``allocate_slots``
        for a running or promoted request): first free what the windows skip at
        ``num_computed``, then append fresh blocks up to ``num_slots`` tokens.

        Returns:
            The new block ids per group, or None when the pool has too few free
            blocks (the skipped blocks are freed all the same, as in vLLM).
        """
        self.remove_skipped(req_id, num_computed)
        lists = self.req_blocks[req_id]
        bs = self._bs
        want = [cdiv(num_slots, bs[g]) - len(blocks) for g, blocks in enumerate(lists)]
        if sum(w for w in want if w > 0) > self.pool.num_free:
            return None
        out: list[tuple[int, ...]] = []
        for g, blocks in enumerate(lists):
            w = want[g]
            if w > 0:
                fresh = self.pool.get_new_blocks(w)
                blocks.extend(fresh)
                out.append(tuple(b.block_id for b in fresh))
            else:
                out.append(())
        return tuple(out)

    def next_skip(self, g: int, skipped: int) -> int:
        """Smallest computed-token count at which group ``g`` drops more than
        ``skipped`` leading blocks (``retained_range`` inverted); a large number
        for full attention."""
        spec = self.layout.groups[g]
        bs = self._bs[g]
        kind = spec.kind
        if kind is GroupKind.SLIDING_WINDOW:
            assert spec.window is not None
            return (skipped + 1) * bs + spec.window - 1 + spec.extra_retained_tokens
        if kind is GroupKind.CHUNKED_LOCAL:
            assert spec.attention_chunk is not None
            return cdiv((skipped + 1) * bs, spec.attention_chunk) * spec.attention_chunk
        if kind is GroupKind.MAMBA:
            return (skipped + 1) * bs + 1
        return 1 << 62

    def thresholds(self, req_id: str) -> tuple[int, int]:
        """``(slots, computed)``: :meth:`allocate_more` and :meth:`commit` change
        nothing while the slot count stays below ``slots`` and the computed count
        below ``computed`` (lets a caller skip quiet decode steps)."""
        lists = self.req_blocks[req_id]
        done = self._committed[req_id]
        skipped = self._skipped[req_id]
        caching = self.pool.enable_caching
        slots = comp = 1 << 62
        for g, blocks in enumerate(lists):
            bs = self._bs[g]
            t = len(blocks) * bs + 1
            if caching:
                t = min(t, (done[g] + 1) * bs)
            slots = min(slots, t)
            if self.layout.groups[g].kind is not GroupKind.FULL:
                comp = min(comp, self.next_skip(g, skipped[g]))
        return slots, comp

    def commit(self, req_id: str, block_hashes: Sequence[int], num_tokens: int) -> None:
        """Give every complete, real block below ``num_tokens`` (rounded as vLLM's
        coordinator does: :meth:`~sim.model.layout.Layout.cacheable_tokens`) its hash
        (vLLM ``cache_blocks``); blocks committed earlier are not revisited."""
        lists = self.req_blocks[req_id]
        done = self._committed[req_id]
        nh = len(block_hashes)
        masks = self.layout.gpu_cache_masks
        for g, blocks in enumerate(lists):
            hpb = self._hpb[g]
            n = min(self.layout.cacheable_tokens(g, num_tokens) // self._bs[g], len(blocks), nh // hpb)
            mask = masks[g]
            for i in range(done[g], n):
                if mask is not None and not (i >= mask[2] and (i - mask[2]) % mask[0] >= mask[0] - mask[1]):
                    continue   # a sliding window hashes only the blocks a hit needs
                b = blocks[i]
                if b.block_hash is None and b.block_id != NULL_BLOCK_ID:
                    self.pool.commit(b, (block_hashes[(i + 1) * hpb - 1], g))
            done[g] = max(done[g], n)

    def unhashed(self, req_id: str, g: int, num_tokens: int) -> list[int]:
        """Positions of ``req_id``'s real blocks of group ``g`` below ``num_tokens`` that
        carry no hash yet (what a commit up to ``num_tokens`` may hash)."""
        blocks = self.req_blocks[req_id][g]
        n = min(num_tokens // self._bs[g], len(blocks))
        return [i for i in range(self._committed[req_id][g], n)
                if blocks[i].block_id != NULL_BLOCK_ID and blocks[i].block_hash is None]

    def block_ids(self, req_id: str) -> list[list[int]]:
        """Per-group block ids of a request (0: null), fresh lists."""
        return [[b.block_id for b in blocks] for blocks in self.req_blocks[req_id]]

    def table_lens(self, req_id: str) -> list[int]:
        """Per-group block-list lengths of a request (null entries included)."""
        return [len(blocks) for blocks in self.req_blocks[req_id]]

    def free(self, req_id: str) -> None:
        """Release every block of a request, tail first."""
        lists = self.req_blocks.pop(req_id)
        del self._committed[req_id]
        del self._skipped[req_id]
        for blocks in lists:
            self.pool.free(reversed(blocks))

    def seed_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> None:
        """Make the first ``num_tokens`` of a sequence a cached GPU prefix, as a
        finished earlier request would leave it: the blocks each kind retains at
        ``num_tokens`` are hashed, unreferenced and in the free queue."""
        tmp = "__seed__"
        empty: tuple[list[Block], ...] = tuple([] for _ in self.layout.groups)
        alloc = self.allocate_new(tmp, empty, 0, 0, num_tokens)
        if alloc is None:
            raise GpuInvariantError("GPU pool too small to seed a prefix")
        lists = self.req_blocks[tmp]
        for g, blocks in enumerate(lists):
            first, _ = self.retained_range(g, num_tokens)
            if self.layout.groups[g].kind is GroupKind.FULL:
                first = 0
            for i in range(first, num_tokens // self._bs[g]):
                self.pool.commit(blocks[i], self._block_hash(g, block_hashes, i))
        self.free(tmp)
