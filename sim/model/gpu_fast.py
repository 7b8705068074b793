"""GPU KV block pool and per-kind allocation, by block id (no ``Block`` objects).

A drop-in alternative to :class:`sim.model.gpu_cache.GpuKVCache` (same methods,
arguments, decisions, block ids and counters) for long runs.

What it represents differently from the reference (:mod:`sim.model.gpu_cache`)
    * No ``Block`` objects: a block's reference count, hash, hash group and
      prefix-cache membership live in flat per-id arrays (lists and a
      bytearray) indexed by block id, updated in tight loops over ints (the
      reference sets attributes of one object per block and goes through an
      ``OrderedDict`` per block). ``0`` stands for the null block wherever the
      reference hands out ``Block`` objects: :meth:`GpuFastCache.find_hit`
      returns id lists and :meth:`GpuFastCache.allocate_new` takes them;
      :class:`BlockView` / :class:`BlockSeq` give read-only ``Block``-like views
      where a caller still wants objects (``req_blocks``, ``Allocation.blocks``).
    * A request's block table per group is a list of ids (0: null), the
      reference's list of ``Block`` with the objects replaced by their ids.
    * The prefix cache is one ``dict`` per group, ``hash -> block id`` (the
      reference keys one dict by ``(hash, group)``, a tuple built per block);
      so are the other blocks committed under a cached hash (duplicates, in
      commit order), with a per-block flag saying a block is one.
    * The free queue is a deque of *chunks* (lists of ids, head first) instead
      of an ``OrderedDict`` of blocks: the blocks a free call queues are
      appended as one piece (extending the tail chunk), allocation slices ids
      off the head chunk (a read offset, no copy). Taking a cached block out
      of the middle of the queue (a prefix hit touching a free block) does not
      search for it: it counts one *stale* entry for that id, and the next
      occurrence of the id met at the head is dropped. A block's stale entries
      all precede its valid one (it is queued again only after it left), so
      the occurrence met first is always a stale one.
    * Decode steps (one block in, one block out, one block committed) take
      dedicated one-block paths; whole requests and prefill chunks take the
      loops. A fast-forward decode step that is due does its window frees,
      new blocks, commit and next thresholds in one call
      (:meth:`GpuFastCache.decode_step`), the calls it stands for in their
      order, the commit skipped when no group's cacheable tokens reach a new
      block (it would change nothing). Runs of consecutive ids (``range`` slices) were tried and dropped:
      after a few hundred requests the free queue is fragmented (20 % of the
      handed-out blocks are in runs of length 1, most runs are shorter than
      32), and per-run bookkeeping cost more than it saved.

Compiled loops (optional)
    The loops that visit one block at a time (:meth:`FastBlockPool.get_new_blocks`
    handing blocks out, :meth:`FastBlockPool.free`, :meth:`FastBlockPool.commit_ids`,
    and the test of a free-queue piece for stale entries, a flag byte per block where
    Python probes the stale dict) also exist in C (``sim/model/_poolops.c``, built by
    ``pip install`` where a C compiler is at hand; ``setup.py`` marks it optional).
    They read and write the same lists, bytearrays and dicts as the Python loops,
    block by block in the same order, and call back into this module for the rare
    duplicate-hash case.
    Without the build, or with ``KVSIM_PURE_POOL=1``, the Python loops run;
    :func:`pool_loops` picks either for the pools built inside it.
    ``tests/model/test_gpu_fast.py`` runs its whole differential test once with
    each (it fails in CI if the build is missing); ``benchmarks/bench_gpu_pool.py``
    times them side by side.

Why the decisions are the same
    Every operation visits the blocks in the order the reference visits them
    and applies the same per-block rule (ref count up or down, queue at 0,
    hash kept while queued and dropped when handed out again, first block
    committed under a hash is the cache entry, an evicted block deletes the
    entry only if the entry is itself: the ``incache`` flag is set when the
    entry is created and cleared when it is deleted, and nothing else deletes
    it). A stale queue entry is exactly one the reference deleted from its
    ``OrderedDict``, so skipping stale entries yields the reference's queue.
    The hit rules, retention ranges, thresholds and allocation phases are the
    reference's code, unchanged but for the lookup (``hash in dict``), the id
    lists and closed forms of ``retained_range(g, n)[0]`` / ``next_skip``
    evaluated inline. The scheduler asks :meth:`GpuFastCache.quiet_thresholds`
    (not the reference's ``thresholds``, kept here too) when a request's next
    allocation, free or commit is due: it is tighter (it knows that commits
    wait for the groups' common block size) and only ever skips calls that
    change nothing, so no decision moves (tests/model/test_gpu_running.py);
    its commit and skip bounds are kept on the request's table and recomputed
    only when :meth:`GpuFastCache.commit` or :meth:`GpuFastCache.remove_skipped`
    moves a mark (the differential test checks them against their definition
    after every call).
    ``tests/model/test_gpu_fast.py`` runs both side by side
    and compares results, counters, the whole free queue, every block's ref
    count and hash and the prefix-cache map after every call.

Simplifications
    None beyond the reference's (its docstring lists them).

Invariants (:meth:`FastBlockPool.check_invariants`)
    * a block is a valid free-queue entry exactly when its ref count is 0;
    * the null block is never queued, freed or hashed (ref count pinned at 1);
    * ``incache[b]`` exactly when the prefix cache of ``bgrp[b]`` maps
      ``bhash[b]`` to ``b``;
    * ``isdup[b]`` exactly when ``b`` is in the duplicate list of
      ``bhash[b]`` in group ``bgrp[b]`` (a block that took a hash whose cache
      entry is another block), so an evicted block that is neither entry nor
      duplicate needs no lookup.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import compress, takewhile
from operator import not_
from types import ModuleType
from typing import overload

from sim.model.gpu_cache import NULL_BLOCK_ID, GpuInvariantError, eagle_hit
from sim.model.layout import GroupKind, Layout, cdiv

__all__ = ["COMPILED_LOOPS", "BlockView", "FastAllocation", "FastBlockPool", "GpuFastCache", "pool_loops"]

#: the per-block loops compiled (sim/model/_poolops.c), where the install built them
COMPILED_LOOPS: ModuleType | None
try:
    from sim.model import _poolops as COMPILED_LOOPS  # noqa: N812 -- a module kept as a constant
except ImportError:  # pragma: no cover - an install without a C compiler
    COMPILED_LOOPS = None
#: the loops pools take when built: the compiled ones, unless KVSIM_PURE_POOL asks for Python's
_poolops: ModuleType | None = None if os.environ.get("KVSIM_PURE_POOL") else COMPILED_LOOPS


@contextmanager
def pool_loops(compiled: bool) -> Iterator[None]:
    """Pools built inside this block run the compiled per-block loops (``compiled``;
    they must be built) or the Python ones (tests and benchmarks that compare them)."""
    global _poolops  # noqa: PLW0603 -- the build-time choice, restored on exit
    if compiled and COMPILED_LOOPS is None:
        raise RuntimeError("sim.model._poolops is not built")
    saved = _poolops
    _poolops = COMPILED_LOOPS if compiled else None
    try:
        yield
    finally:
        _poolops = saved


class BlockView:
    """Read-only ``Block``-like view of one block of a :class:`FastBlockPool`."""

    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: FastBlockPool, block_id: int) -> None:
        self._pool = pool
        self.block_id = block_id

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    @property
    def ref_cnt(self) -> int:
        return self._pool.ref[self.block_id]

    @property
    def block_hash(self) -> tuple[int, int] | None:
        h = self._pool.bhash[self.block_id]
        return None if h is None else (h, self._pool.bgrp[self.block_id])

    def __repr__(self) -> str:
        return f"BlockView({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockSeq(Sequence[BlockView]):
    """A block-id list seen as :class:`BlockView` items."""

    __slots__ = ("_pool", "ids")

    def __init__(self, pool: FastBlockPool, ids: Sequence[int]) -> None:
        self._pool = pool
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> BlockView: ...

    @overload
    def __getitem__(self, i: slice) -> list[BlockView]: ...

    def __getitem__(self, i: int | slice) -> BlockView | list[BlockView]:
        if isinstance(i, slice):
            return [BlockView(self._pool, b) for b in self.ids[i]]
        return BlockView(self._pool, self.ids[i])

    def __iter__(self) -> Iterator[BlockView]:
        pool = self._pool
        return (BlockView(pool, b) for b in self.ids)


class FastBlockPool:
    """Free queue, prefix cache and reference counts of all GPU blocks, by
    block id; decisions identical to :class:`sim.model.gpu_cache.BlockPool`."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError("a GPU block pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        self.ref[NULL_BLOCK_ID] = 1  # pinned forever
        #: hash and group of each block (the group is meaningful while hashed)
        self.bhash: list[int | None] = [None] * num_blocks
        self.bgrp = [0] * num_blocks
        #: 1 where the prefix cache of bgrp[b] maps bhash[b] to b
        self.incache = bytearray(num_blocks)
        self._caches: list[dict[int, int]] = [{} for _ in range(max(1, num_groups))]
        #: per group, hash -> the other blocks carrying that cached hash, in commit order
        #: (vLLM keeps every block of a hash findable; the entry is the earliest still there)
        self._dups: list[dict[int, list[int]]] = [{} for _ in range(max(1, num_groups))]
        #: 1 where block b is one of those other blocks (in ``_dups[bgrp[b]][bhash[b]]``)
        self.isdup = bytearray(num_blocks)
        #: chunks of queued ids, head first
        self._queue: deque[list[int]] = deque([list(range(1, num_blocks))])
        #: ids of the head chunk below this index are gone
        self._head = 0
        #: block id -> how many of its queue entries are stale (it was touched out of
        #: the queue); a block's stale entries all precede its valid one
        self._stale: dict[int, int] = {}
        #: 1 where a block has stale entries (``b in _stale``): a piece of the queue is
        #: tested for them a byte per block (compiled) rather than a dict probe
        self._isstale = bytearray(num_blocks)
        self._nfree = num_blocks - 1
        #: blocks whose hash was dropped because they were reused
        self.num_evicted = 0
        #: the compiled per-block loops, or None (the Python loops below)
        self._ops = _poolops

    # -- counters ---------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._nfree

    @property
    def num_used(self) -> int:
        """Blocks referenced by some request (the null block excluded)."""
        return self.num_blocks - 1 - self._nfree

    @property
    def num_cached(self) -> int:
        """Blocks findable in the prefix cache."""
        return sum(map(len, self._caches))

    @property
    def blocks(self) -> BlockSeq:
        """A :class:`BlockView` per block id (tests, debugging)."""
        return BlockSeq(self, range(self.num_blocks))

    @property
    def null_block(self) -> BlockView:
        return BlockView(self, NULL_BLOCK_ID)

    def _group_cache(self, g: int) -> dict[int, int]:
        while g >= len(self._caches):
            self._caches.append({})
            self._dups.append({})
        return self._caches[g]

    def _add_dup(self, g: int, h: int, b: int) -> None:
        """``b`` got hash ``h`` of group ``g`` while another block is its cache entry."""
        dg = self._dups[g]
        lst = dg.get(h)
        if lst is None:
            dg[h] = [b]
        else:
            lst.append(b)
        self.isdup[b] = 1

    # -- free queue ---------------------------------------------------------------------

    #: chunks grow at the tail up to this many ids (a consumed chunk is released)
    CHUNK = 4096

    def free_ids_head(self, n: int) -> list[int]:
        """Ids of the next ``n`` blocks :meth:`get_new_blocks` would hand out."""
        out: list[int] = []
        skip = dict(self._stale)
        off = self._head
        for chunk in self._queue:
            if len(out) >= n:
                break
            part = chunk[off:] if off else chunk
            off = 0
            if not skip or skip.keys().isdisjoint(part):
                out.extend(part[: n - len(out)])
                continue
            for b in part:
                c = skip.get(b)
                if c:
                    skip[b] = c - 1
                else:
                    out.append(b)
                    if len(out) >= n:
                        break
        return out

    def _pop_head(self, n: int) -> list[int]:
        """The ids of the next ``n`` valid queue entries, removed from the queue."""
        q, stale = self._queue, self._stale
        out: list[int] = []
        left = n
        while left:
            chunk = q[0]
            off = self._head
            if len(chunk) - off <= left:
                piece = chunk[off:] if off else chunk
                q.popleft()
                self._head = 0
            else:
                piece = chunk[off : off + left]
                self._head = off + left
            if stale and (self._ops.flagged(piece, self._isstale) if self._ops is not None
                          else not stale.keys().isdisjoint(piece)):
                piece = self._drop_stale(piece)
            out += piece
            left -= len(piece)
        return out

    def _drop_stale(self, piece: list[int]) -> list[int]:
        """``piece`` (the next queue entries) without its stale entries."""
        stale = self._stale
        good: list[int] = []
        for b in piece:
            c = stale.get(b)
            if c:
                if c == 1:
                    del stale[b]
                    self._isstale[b] = 0
                else:
                    stale[b] = c - 1
            else:
                good.append(b)
        return good

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue (ref count 1, no hash)."""
        if n > self._nfree:
            raise GpuInvariantError(f"asked for {n} blocks with {self._nfree} free")
        if n <= 0:
            return []
        if n == 1 and not self._stale:
            return [self._pop_one()]
        ids = self._pop_head(n)
        self._nfree -= n
        if self._ops is not None:
            self.num_evicted += self._ops.take(ids, self.ref, self.bhash, self.incache, self.bgrp,
                                               self.isdup, self._caches, self._dups, self._uncache)
            return ids
        ref, bhash, incache, bgrp, isdup = self.ref, self.bhash, self.incache, self.bgrp, self.isdup
        caches, dups = self._caches, self._dups
        evicted = 0
        for b in ids:
            ref[b] = 1
            h = bhash[b]
            if h is not None:  # evicted: its hash goes, and its cache entry if it is one
                evicted += 1
                if incache[b]:
                    g = bgrp[b]
                    if h in dups[g]:
                        self._uncache(b, h)
                    else:   # :meth:`_uncache` without duplicates, inline
                        incache[b] = 0
                        del caches[g][h]
                elif isdup[b]:
                    self._uncache(b, h)
                bhash[b] = None
        self.num_evicted += evicted
        return ids

    def _pop_one(self) -> int:
        """:meth:`get_new_blocks` of one block, no stale entries queued."""
        q = self._queue
        chunk = q[0]
        off = self._head
        b = chunk[off]
        if off + 1 == len(chunk):
            q.popleft()
            self._head = 0
        else:
            self._head = off + 1
        self._nfree -= 1
        self.ref[b] = 1
        h = self.bhash[b]
        if h is not None:
            self.num_evicted += 1
            if self.incache[b] or self.isdup[b]:
                self._uncache(b, h)
            self.bhash[b] = None
        return b

    def _uncache(self, b: int, h: int) -> None:
        """``b`` loses hash ``h``: if it was the entry, the earliest other block with
        that hash becomes the entry, else it leaves the duplicates."""
        g = self.bgrp[b]
        dg = self._dups[g]
        dups = dg.get(h)
        if self.incache[b]:
            self.incache[b] = 0
            if dups:
                nb = dups.pop(0)
                self.isdup[nb] = 0
                self._caches[g][h] = nb
                self.incache[nb] = 1
                if not dups:
                    del dg[h]
            else:
                del self._caches[g][h]
        elif dups is not None and self.isdup[b]:
            dups.remove(b)
            self.isdup[b] = 0
            if not dups:
                del dg[h]

    def touch(self, ids: Iterable[int]) -> None:
        """Take a reference on prefix-hit blocks (out of the free queue at 0 -> 1)."""
        ref, stale = self.ref, self._stale
        for b in ids:
            if b == NULL_BLOCK_ID:
                continue
            c = ref[b]
            if c == 0:
                stale[b] = stale.get(b, 0) + 1
                self._isstale[b] = 1
                self._nfree -= 1
            ref[b] = c + 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference of each block, in the given order; blocks reaching
        0 go to the tail of the free queue, keeping their hash for reuse, or, with
        no hash (or no prefix caching), to its head, to be reused first (vLLM's
        ``free_blocks``)."""
        if self._ops is not None:
            self._free_compiled(self._ops, ids)
            return
        ref, bhash = self.ref, self.bhash
        queued: list[int] = []
        first: list[int] = []
        # the null block (id 0) has ref count 1 for good: ``c == 1 and b`` skips it;
        # without prefix caching every block goes to the head
        to_head = first.append
        to_tail = queued.append if self.enable_caching else to_head
        try:
            for b in ids:
                c = ref[b]
                if c == 1 and b:
                    ref[b] = 0
                    if bhash[b] is None:
                        to_head(b)
                    else:
                        to_tail(b)
                elif c > 1:
                    ref[b] = c - 1
                elif c != 1:
                    raise GpuInvariantError(f"double free of block {b}")
        finally:
            if first:
                self._prepend(first)
            if queued:
                self._enqueue(queued)

    def free_one(self, b: int) -> None:
        """:meth:`free` of the one block ``b`` (a decode step's window free)."""
        ref = self.ref
        c = ref[b]
        if c == 1 and b:
            ref[b] = 0
            if self.bhash[b] is None or not self.enable_caching:
                self._prepend([b])
            else:
                self._enqueue([b])
        elif c > 1:
            ref[b] = c - 1
        elif c != 1:
            raise GpuInvariantError(f"double free of block {b}")

    def _free_compiled(self, ops: ModuleType, ids: Iterable[int]) -> None:
        """:meth:`free` by the compiled loop: the same blocks to the same ends, in order."""
        queued: list[int] = []
        first: list[int] = []
        try:
            bad = ops.release(ids, self.ref, self.bhash, first, queued if self.enable_caching else first)
        finally:
            if first:
                self._prepend(first)
            if queued:
                self._enqueue(queued)
        if bad >= 0:
            raise GpuInvariantError(f"double free of block {bad}")

    def _prepend(self, blocks: list[int]) -> None:
        """Put ``blocks`` at the head of the free queue, in order (the first is handed out first)."""
        q = self._queue
        n = len(blocks)
        head = self._head
        if head >= n:   # into the head chunk's consumed slots: no copy of the rest of it
            q[0][head - n : head] = blocks
            self._head = head - n
        else:
            if head:
                q[0] = q[0][head:]
                self._head = 0
            q.appendleft(blocks)
        self._nfree += n

    def _enqueue(self, queued: list[int]) -> None:
        q = self._queue
        if q and len(q[-1]) + len(queued) <= self.CHUNK:
            q[-1].extend(queued)
        else:
            q.append(queued)
        self._nfree += len(queued)

    # -- prefix cache -----------------------------------------------------------------------

    def commit_ids(self, ids: Sequence[int], hashes: Sequence[int], g: int) -> None:
        """Give the blocks ``ids`` (position order) the hashes ``hashes`` of
        group ``g``, skipping null and already hashed blocks; the first block
        committed under a hash becomes its prefix-cache entry."""
        bhash, bgrp, incache = self.bhash, self.bgrp, self.incache
        if self._ops is not None:
            self._ops.commit(ids, hashes, bhash, bgrp, incache,
                             self._group_cache(g) if self.enable_caching else None, g, self._add_dup)
            return
        if self.enable_caching:
            # one probe of the (large) cache dict per block: ``b`` has no hash, so it is
            # no entry, and ``setdefault`` returns ``b`` exactly when it became one
            enter = self._group_cache(g).setdefault
            for h, b in zip(hashes, ids, strict=True):
                if bhash[b] is None and b:
                    bhash[b] = h
                    bgrp[b] = g
                    if enter(h, b) == b:
                        incache[b] = 1
                    else:   # a second block with this hash: findable once the entry goes
                        self._add_dup(g, h, b)
        else:
            for h, b in zip(hashes, ids, strict=True):
                if bhash[b] is None and b:
                    bhash[b] = h
                    bgrp[b] = g

    def commit_one(self, b: int, h: int, g: int) -> None:
        """:meth:`commit_ids` of one real block ``b`` without a hash (a decode step's)."""
        self.bhash[b] = h
        self.bgrp[b] = g
        if self.enable_caching:
            cg = self._caches[g]
            if h not in cg:
                cg[h] = b
                self.incache[b] = 1
            else:
                self._add_dup(g, h, b)

    def commit(self, block_id: int, block_hash: tuple[int, int]) -> None:
        """Give a computed block its hash (it becomes a prefix-cache entry)."""
        h, g = block_hash
        self.commit_ids([block_id], [h], g)

    def cached(self, block_hash: tuple[int, int]) -> int | None:
        """Id of the cached block with this hash, if any."""
        if not self.enable_caching:
            return None
        h, g = block_hash
        return self._caches[g].get(h) if g < len(self._caches) else None

    def check_invariants(self) -> None:
        """Raise :class:`GpuInvariantError` on inconsistent bookkeeping."""
        self._check_queue()
        self._check_cache()

    def _check_queue(self) -> None:
        ref = self.ref
        if ref[NULL_BLOCK_ID] != 1 or self.bhash[NULL_BLOCK_ID] is not None:
            raise GpuInvariantError("the null block lost its pin or got a hash")
        entries = self.free_ids_head(self.num_blocks + sum(self._stale.values()))
        free = set(entries)
        if len(free) != len(entries) or len(entries) != self._nfree:
            raise GpuInvariantError(f"free queue: {len(entries)} entries, {len(free)} blocks, "
                                    f"{self._nfree} counted")
        for b in range(1, self.num_blocks):
            if ref[b] < 0:
                raise GpuInvariantError(f"block {b} has a negative ref count")
            if (ref[b] == 0) != (b in free):
                raise GpuInvariantError(f"block {b} free-queue membership disagrees with its ref count")
        raw: dict[int, int] = {}
        for i, chunk in enumerate(self._queue):
            for b in chunk[self._head:] if i == 0 else chunk:
                raw[b] = raw.get(b, 0) + 1
        for b, c in self._stale.items():
            if c <= 0 or raw.get(b, 0) != c + (ref[b] == 0):
                raise GpuInvariantError(f"block {b}: {c} stale entries, {raw.get(b, 0)} in the queue")
        if sum(self._isstale) != len(self._stale) or any(not self._isstale[b] for b in self._stale):
            raise GpuInvariantError("the stale flags disagree with the stale entries")

    def _check_cache(self) -> None:
        n = 0
        for g, cg in enumerate(self._caches):
            for h, b in cg.items():
                if self.bhash[b] != h or self.bgrp[b] != g or not self.incache[b]:
                    raise GpuInvariantError(f"prefix cache of group {g} maps {h} to block {b}")
            n += len(cg)
        if self.incache.count(1) != n:
            raise GpuInvariantError("prefix-cache flags disagree with the cache")
        n = 0
        for g, dg in enumerate(self._dups):
            for h, lst in dg.items():
                for b in lst:
                    if not self.isdup[b] or self.bhash[b] != h or self.bgrp[b] != g or self.incache[b]:
                        raise GpuInvariantError(f"duplicate {b} of hash {h} in group {g} is not flagged")
                n += len(lst)
        if self.isdup.count(1) != n:
            raise GpuInvariantError("duplicate flags disagree with the duplicate lists")


class _Table:
    """One request's block tables."""

    __slots__ = ("cbound", "done", "lists", "sbound", "skipped")

    def __init__(self, lists: tuple[list[int], ...], skipped: list[int]) -> None:
        self.lists = lists
        #: per group: blocks below this index are committed or null
        self.done = [0] * len(lists)
        #: per group: blocks below this index were replaced by null (may be -1, as in the reference)
        self.skipped = skipped
        #: the parts of :meth:`GpuFastCache.quiet_thresholds` that depend on ``done``
        #: (commit bound) and ``skipped`` (skip bound) alone, kept up to date by the
        #: only methods that change those (0 until the owner sets them: always due)
        self.cbound = 0
        self.sbound = 0


class FastAllocation:
    """Per-group block lists of one request after an allocation (the fields of
    :class:`sim.model.gpu_cache.Allocation`, ``blocks`` as :class:`BlockSeq`)."""

    __slots__ = ("_pool", "block_ids", "new_block_ids", "null_prefix")

    def __init__(self, pool: FastBlockPool, lists: tuple[list[int], ...],
                 new_block_ids: tuple[tuple[int, ...], ...], null_prefix: tuple[int, ...]) -> None:
        self._pool = pool
        #: the request's live per-group id lists (0: null); do not modify
        self.block_ids = lists
        self.new_block_ids = new_block_ids
        #: per group, how many leading entries are the null block
        self.null_prefix = null_prefix

    @property
    def blocks(self) -> tuple[BlockSeq, ...]:
        """The request's block lists as views (what the connector reads)."""
        return tuple(BlockSeq(self._pool, ids) for ids in self.block_ids)


class _ReqBlocks(Mapping[str, tuple[BlockSeq, ...]]):
    """``req_blocks``: request id -> per-group :class:`BlockSeq` (membership,
    count and iteration as cheap as a dict's)."""

    __slots__ = ("_cache",)

    def __init__(self, cache: GpuFastCache) -> None:
        self._cache = cache

    def __getitem__(self, req_id: str) -> tuple[BlockSeq, ...]:
        pool = self._cache.pool
        return tuple(BlockSeq(pool, ids) for ids in self._cache._tables[req_id].lists)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._cache._tables

    def __iter__(self) -> Iterator[str]:
        return iter(self._cache._tables)

    def __len__(self) -> int:
        return len(self._cache._tables)


class GpuFastCache:
    """Per-group block tables over one shared :class:`FastBlockPool`; the
    decisions of :class:`sim.model.gpu_cache.GpuKVCache`, blocks as ids.

    Args:
        layout: the KV cache groups.
        num_blocks: size of the shared pool, the null block included.
        enable_caching: GPU prefix caching on or off.
    """

    def __init__(self, layout: Layout, num_blocks: int, enable_caching: bool = True) -> None:
        self.layout = layout
        ngroups = len(layout.groups)
        self.pool = FastBlockPool(num_blocks, enable_caching, ngroups)
        self._tables: dict[str, _Table] = {}
        self.req_blocks = _ReqBlocks(self)
        self._bs = tuple(g.tokens_per_block for g in layout.groups)
        self._tph = layout.tokens_per_hash
        self._hpb = tuple(bs // layout.tokens_per_hash for bs in self._bs)
        #: a group is looked up as EAGLE: vLLM's own search (:func:`eagle_hit`)
        self._eagle = any(layout.eagle_hit)
        #: per window-type group: (group, rule, parameter, block size) of its first retained block
        self._skip_rules = tuple(self._skip_rule(g) for g in range(ngroups)
                                 if layout.groups[g].kind is not GroupKind.FULL)
        self._no_new: tuple[tuple[int, ...], ...] = tuple(() for _ in range(ngroups))
        #: per group: (block size, EAGLE rounding, the layout's ``gpu_cache_align``
        #: (1: none)) of its commit bound: see :meth:`quiet_thresholds`
        align = layout.gpu_cache_align
        self._commit_rules = tuple(
            (self._bs[g], align is not None and layout.eagle_hit[g], align or 1)
            for g in range(ngroups))
        #: per group, which complete blocks a commit hashes (:attr:`~sim.model.layout.Layout.gpu_cache_masks`)
        self._masks = layout.gpu_cache_masks

    def _skip_rule(self, g: int) -> tuple[int, int, int, int]:
        """``retained_range(g, n)[0]`` as (rule, p): 0: ``max(0, n - p) // bs``
        (sliding window, p = W - 1 + e); 1: ``n // p * p // bs`` (chunked local,
        p = C); 2: ``max(0, (n - 1) // bs)`` (Mamba)."""
        spec = self.layout.groups[g]
        bs = self._bs[g]
        if spec.kind is GroupKind.SLIDING_WINDOW:
            assert spec.window is not None
            return (g, 0, spec.window - 1 + spec.extra_retained_tokens, bs)
        if spec.kind is GroupKind.CHUNKED_LOCAL:
            assert spec.attention_chunk is not None
            return (g, 1, spec.attention_chunk, bs)
        return (g, 2, 0, bs)

    # -- views ------------------------------------------------------------------------------

    def unhashed(self, req_id: str, g: int, num_tokens: int) -> list[int]:
        """Positions of ``req_id``'s real blocks of group ``g`` below ``num_tokens`` that
        carry no hash yet (what a commit up to ``num_tokens`` may hash)."""
        t = self._tables[req_id]
        ids = t.lists[g]
        bhash = self.pool.bhash
        n = min(num_tokens // self._bs[g], len(ids))
        return [i for i in range(t.done[g], n) if ids[i] != 0 and bhash[ids[i]] is None]

    def block_ids(self, req_id: str) -> list[list[int]]:
        """Per-group block ids of a request (0: null), fresh lists: the
        reference's ``[[b.block_id for b in blocks] for blocks in req_blocks[req_id]]``."""
        return [list(ids) for ids in self._tables[req_id].lists]

    def table_lens(self, req_id: str) -> list[int]:
        """Per-group block-list lengths of a request (null entries included)."""
        return [len(ids) for ids in self._tables[req_id].lists]

    def first_fresh(self, ids: Sequence[int], start: int, stop: int) -> int:
        """Index of the first real, unhashed block of ``ids`` in ``[start,
        stop)`` (``stop`` when none): the connector's search for the first
        block to load."""
        bhash = self.pool.bhash
        for i in range(max(0, start), stop):
            b = ids[i]
            if b != NULL_BLOCK_ID and bhash[b] is None:
                return i
        return stop

    # -- retention --------------------------------------------------------------------------

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

    def next_skip(self, g: int, skipped: int) -> int:
        """Smallest computed-token count at which group ``g`` drops more than
        ``skipped`` leading blocks; a large number for full attention."""
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

    # -- prefix cache hits --------------------------------------------------------------------

    def find_hit(self, block_hashes: Sequence[int], max_tokens: int,
                 margin_cap: int | None = None) -> tuple[int, tuple[list[int], ...]]:
        """Longest local prefix-cache hit usable by every group, at most ``max_tokens``
        (``margin_cap``: how far an EAGLE group may look past it, :func:`eagle_hit`;
        default ``max_tokens``).

        Returns:
            ``(L, ids)`` with per-group hit id lists of ``L // bs_g`` entries
            (0 where the kind does not need the block).
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
        n = max_tokens // self._bs[g]
        kind = self.layout.groups[g].kind
        if kind is GroupKind.FULL:
            return self._prefix_hit(g, block_hashes, n)
        if kind is GroupKind.MAMBA:
            return self._last_block_hit(g, block_hashes, n)
        return self._window_hit(g, block_hashes, n)

    def _is_cached(self, g: int, block_hashes: Sequence[int], i: int) -> bool:
        return block_hashes[(i + 1) * self._hpb[g] - 1] in self.pool._caches[g]

    def _prefix_hit(self, g: int, block_hashes: Sequence[int], n: int) -> int:
        hpb = self._hpb[g]
        # the leading cached blocks, counted at C speed
        run = takewhile(self.pool._caches[g].__contains__, block_hashes[hpb - 1 : n * hpb : hpb])
        return len(list(run)) * self._bs[g]

    def _last_block_hit(self, g: int, block_hashes: Sequence[int], n: int) -> int:
        for i in range(n - 1, -1, -1):
            if self._is_cached(g, block_hashes, i):
                return (i + 1) * self._bs[g]
        return 0

    def _empty_boundary(self, g: int, n: int) -> int:
        """The largest ``end <= n`` at which chunked-local group ``g`` retains no
        block (``retained_range(g, end * bs)[0] >= end``), 0 if none or for a
        sliding window: a hit may end there with nothing cached. The reference's
        :meth:`~sim.model.gpu_cache.GpuKVCache._empty_boundary` scans for it one
        boundary at a time; tests/model/test_gpu_fast.py checks the two agree."""
        spec = self.layout.groups[g]
        if spec.kind is GroupKind.CHUNKED_LOCAL:
            # retained_range's first block is (t // C * C) // bs at boundary t = end * bs, which
            # reaches end exactly when t starts an attention chunk: end a multiple of C / gcd(C, bs)
            chunk = spec.attention_chunk
            assert chunk is not None
            step = chunk // math.gcd(chunk, self._bs[g])
            return n // step * step
        # a sliding window of one token needs no block before a boundary, yet vLLM's finder
        # still ends a hit on a cached block (its rightmost one): no boundary is empty
        return 0

    def _window_hit(self, g: int, block_hashes: Sequence[int], n: int) -> int:
        bs = self._bs[g]
        empty = self._empty_boundary(g, n)
        hpb = self._hpb[g]
        cached = self.pool._caches[g].__contains__
        hashes = block_hashes[hpb - 1 : n * hpb : hpb]   # block i's hash is hashes[i]
        at = hashes.__getitem__
        i = n - 1
        while i >= empty:
            # the last cached block at or below i (absent blocks skipped at C speed)
            down = range(i, empty - 1, -1)
            i = next(compress(down, map(cached, map(at, down))), empty - 1)
            if i < empty:
                break
            # the first block of its run of cached blocks
            below = range(i - 1, -1, -1)
            j = next(compress(below, map(not_, map(cached, map(at, below)))), -1) + 1
            if self.hit_first(g, (i + 1) * bs) >= j:
                return (i + 1) * bs
            i = j - 2
        return empty * bs

    def hit_blocks(self, block_hashes: Sequence[int], hit: int) -> tuple[list[int], ...]:
        """The per-group blocks of a local hit of exactly ``hit`` tokens, taken as given
        (not searched for: no EAGLE drop), as :meth:`find_hit` returns them."""
        return tuple(self._hit_blocks(g, block_hashes, hit) for g in range(len(self.layout.groups)))

    def _hit_blocks(self, g: int, block_hashes: Sequence[int], hit: int) -> list[int]:
        n = hit // self._bs[g]
        first = self.hit_first(g, hit)
        if self.layout.groups[g].kind is GroupKind.FULL:
            first = 0
        out = [NULL_BLOCK_ID] * n
        if first < n:
            hpb = self._hpb[g]
            cg = self.pool._caches[g]
            ids = list(map(cg.get, block_hashes[(first + 1) * hpb - 1 : n * hpb : hpb]))
            if None in ids:
                raise GpuInvariantError(f"hit block {first + ids.index(None)} of group {g} vanished")
            out[first:n] = ids  # type: ignore[assignment]
        return out

    # -- allocation ------------------------------------------------------------------------------

    def blocks_needed(self, local: Sequence[Sequence[int]], local_tokens: int,
                      external_tokens: int, num_slots: int,
                      caps: Sequence[int | None] | None = None) -> int:
        """Fresh blocks a new request's allocation takes (plus cached hit blocks
        it pulls out of the free queue); ``caps``: per group, at most this many
        blocks are required (vLLM's admission cap of a recycling group)."""
        total = 0
        n_comp = local_tokens + external_tokens
        ref = self.pool.ref
        for g in range(len(self.layout.groups)):
            first, _ = self.retained_range(g, n_comp)
            have = max(first, len(local[g]))
            required = cdiv(max(num_slots, n_comp), self._bs[g])
            cap = caps[g] if caps is not None else None
            if cap is not None:
                required = min(required, cap)
            total += max(0, required - have)
            total += sum(1 for b in local[g][first:] if ref[b] == 0 and b != NULL_BLOCK_ID)
        return total

    def more_blocks_needed(self, req_id: str, num_tokens: int, caps: Sequence[int | None]) -> int:
        """Blocks a request that holds blocks still needs for ``num_tokens`` tokens, each
        group's requirement capped by ``caps`` (vLLM's full-input admission check)."""
        total = 0
        for g, ids in enumerate(self._tables[req_id].lists):
            required = cdiv(num_tokens, self._bs[g])
            cap = caps[g]
            if cap is not None:
                required = min(required, cap)
            total += max(0, required - len(ids))
        return total

    def allocate_new(
        self,
        req_id: str,
        local: Sequence[Sequence[int]],
        local_tokens: int,
        external_tokens: int,
        num_slots: int,
    ) -> FastAllocation | None:
        """First allocation of a request (vLLM ``allocate_slots`` for a new request).

        Args:
            req_id: request id.
            local: per-group local-hit block id lists (from :meth:`find_hit`).
            local_tokens: L, locally computed tokens.
            external_tokens: E, tokens to come from the connector.
            num_slots: token slots needed after this step (>= L + E).

        Returns:
            The allocation, or None when the pool has too few free blocks.
        """
        if req_id in self._tables:
            raise GpuInvariantError(f"request {req_id} already has blocks")
        pool = self.pool
        if self.blocks_needed(local, local_tokens, external_tokens, num_slots) > pool.num_free:
            return None
        n_comp = local_tokens + external_tokens
        groups = self.layout.groups
        ngroups = len(groups)
        lists: tuple[list[int], ...] = tuple([] for _ in range(ngroups))
        new_ids: list[list[int]] = [[] for _ in range(ngroups)]
        nulls = [0] * ngroups
        # phase 1: local hits after the null padding, every group first
        for g in range(ngroups):
            skip = max(0, groups[g].skipped_tokens(n_comp) // self._bs[g])   # Mamba at 0: -1 tokens
            kept = list(local[g][skip:])
            pool.touch(kept)
            lst = lists[g]
            if skip > 0:
                lst.extend([NULL_BLOCK_ID] * skip)
            lst.extend(kept)
            nulls[g] = skip
        # phase 2: fresh blocks for the retained external tokens
        if external_tokens:
            for g in range(ngroups):
                if min(n_comp - groups[g].skipped_tokens(n_comp), external_tokens) <= 0:
                    continue
                fresh = pool.get_new_blocks(max(0, cdiv(n_comp, self._bs[g]) - len(lists[g])))
                lists[g].extend(fresh)
                new_ids[g].extend(fresh)
        # phase 3: slots for the tokens this step computes
        for g in range(ngroups):
            want = cdiv(num_slots, self._bs[g]) - len(lists[g])
            if want > 0:
                fresh = pool.get_new_blocks(want)
                lists[g].extend(fresh)
                new_ids[g].extend(fresh)
        t = self._tables[req_id] = _Table(lists, list(nulls))
        t.cbound = self._commit_bound(t.done)
        t.sbound = self._skip_bound(t.skipped)
        return FastAllocation(pool, lists, tuple(tuple(x) for x in new_ids), tuple(nulls))

    def remove_skipped(self, req_id: str, num_computed: int) -> None:
        """Free the blocks a window-type group no longer attends over once
        ``num_computed`` tokens are computed: they become null in the request's
        list and go to the free queue, highest index first."""
        t = self._tables[req_id]
        lists, skipped = t.lists, t.skipped
        nc = num_computed
        changed = False
        for g, rule, p, bs in self._skip_rules:
            if rule == 0:
                x = nc - p
                first = x // bs if x > 0 else 0
            elif rule == 1:
                first = nc // p * p // bs
            else:
                first = (nc - 1) // bs if nc > 0 else 0
            done = skipped[g]
            if first <= done:
                continue
            blocks = lists[g]
            if first > len(blocks):
                first = len(blocks)
                if first <= done:
                    continue
            lo = done if done > 0 else 0
            skipped[g] = first
            changed = True
            if first - lo == 1 and done >= 0:   # a decode step's one block, without lists
                b = blocks[lo]
                blocks[lo] = NULL_BLOCK_ID
                self.pool.free_one(b)
                continue
            removed = blocks[lo:first]
            removed.reverse()
            blocks[lo:first] = [NULL_BLOCK_ID] * (first - lo)
            if done < 0:
                # the reference's loop runs down to index -1: the last block too
                removed.append(blocks[-1])
                blocks[-1] = NULL_BLOCK_ID
            self.pool.free(removed)
        if changed:
            t.sbound = self._skip_bound(skipped)

    def allocate_more(self, req_id: str, num_computed: int,
                      num_slots: int) -> tuple[tuple[int, ...], ...] | None:
        """Slots for a request that already holds blocks: first free what the
        windows skip at ``num_computed``, then append fresh blocks up to
        ``num_slots`` tokens.

        Returns:
            The new block ids per group, or None when the pool has too few free
            blocks (the skipped blocks are freed all the same, as in vLLM).
        """
        self.remove_skipped(req_id, num_computed)
        lists = self._tables[req_id].lists
        want: list[int] = []
        total = 0
        for blocks, bs in zip(lists, self._bs, strict=True):
            w = -(-num_slots // bs) - len(blocks)
            want.append(w)
            if w > 0:
                total += w
        if not total:
            return self._no_new
        pool = self.pool
        if total > pool.num_free:
            return None
        out: list[tuple[int, ...]] = []
        for blocks, w in zip(lists, want, strict=True):
            if w > 0:
                fresh = pool.get_new_blocks(w)
                blocks.extend(fresh)
                out.append(tuple(fresh))
            else:
                out.append(())
        return tuple(out)

    def thresholds(self, req_id: str) -> tuple[int, int]:
        """``(slots, computed)``: :meth:`allocate_more` and :meth:`commit` change
        nothing while the slot count stays below ``slots`` and the computed count
        below ``computed``."""
        t = self._tables[req_id]
        slots = 1 << 62
        if self.pool.enable_caching:
            for blocks, d, bs in zip(t.lists, t.done, self._bs, strict=True):
                slots = min(slots, len(blocks) * bs + 1, (d + 1) * bs)
        else:
            for blocks, bs in zip(t.lists, self._bs, strict=True):
                slots = min(slots, len(blocks) * bs + 1)
        return slots, self._skip_bound(t.skipped)

    def decode_step(self, req_id: str, num_computed: int, block_hashes: Sequence[int] | None,
                    new_ids: list[list[int]]) -> tuple[int, int] | None:
        """One decode step of a request that is due (the fast-forward's event), in one
        call: :meth:`allocate_more` ``(req_id, nc, nc + 1)`` with the new ids appended
        to ``new_ids[g]``; then, given the sequence's hashes ``block_hashes`` (prefix
        caching on), :meth:`commit` ``(req_id, block_hashes[: (nc + 1) //
        tokens_per_hash], nc + 1)``; then :meth:`quiet_thresholds`.

        The pool sees the same operations in the same order as those three calls
        (the window frees, then the new blocks group by group, then the hashes);
        :meth:`remove_skipped` is called only from the request's skip bound on and
        :meth:`commit` only from its commit bound on, since below them they change
        nothing. None when the pool is short (the skipped blocks are freed
        all the same and nothing is allocated, as :meth:`allocate_more`)."""
        slots = num_computed + 1
        t = self._tables[req_id]
        if num_computed >= t.sbound:   # below its skip bound remove_skipped frees nothing
            self.remove_skipped(req_id, num_computed)
        lists = t.lists
        bsz = self._bs
        ng = len(lists)
        want = 0
        for g in range(ng):
            w = -(-slots // bsz[g]) - len(lists[g])
            if w > 0:
                want += w
        if want:
            pool = self.pool
            if want > pool._nfree:
                return None
            for g in range(ng):
                blocks = lists[g]
                w = -(-slots // bsz[g]) - len(blocks)
                if w > 0:
                    fresh = pool.get_new_blocks(w)
                    blocks.extend(fresh)
                    new_ids[g].extend(fresh)
        if block_hashes is not None and slots >= t.cbound:
            # :meth:`commit` of ``block_hashes[: slots // tokens_per_hash]`` without the copy: its
            # own bound (``slots`` tokens) takes no hash past that prefix
            self.commit(req_id, block_hashes, slots)
        bound = t.cbound
        for g in range(ng):
            bound = min(bound, len(lists[g]) * bsz[g] + 1)
        return bound, t.sbound

    def quiet_thresholds(self, req_id: str) -> tuple[int, int]:
        """:meth:`thresholds` as tight as the commit rounding allows: the same
        ``(slots, computed)`` meaning, but a group's commit bound is the first
        token count whose :meth:`~sim.model.layout.Layout.cacheable_tokens`
        reaches its next block, not the next block's end itself.

        With more than one group vLLM hashes only up to the groups' least
        common block size ``A`` (``gpu_cache_align``), so between two multiples
        of ``A`` a decode step's :meth:`commit` moves nothing: with the plain
        bound a request whose small-block group committed up to a multiple of
        ``A`` would be "due" at every step until the next one. Here, with
        ``X = (done + 1) * bs``: the first multiple of ``A`` at or above ``X``
        (``X`` itself with no alignment: ``A = 1``); an EAGLE group (cacheable ``min(t, aligned(t) +
        bs)``, 0 below ``A``), ``max(X, A, ceil((X - bs) / A) * A)``. Each is the
        smallest ``t`` with ``cacheable_tokens(g, t) >= X``, so below it
        :meth:`commit` changes nothing (tests/model/test_gpu_running.py); the
        slot bound (a new block) and the computed bound (a window frees) are
        :meth:`thresholds`' own. Skipping calls that change nothing changes no
        decision.

        The commit and skip bounds depend on the request's commit and skip marks
        alone: they are kept on its table (:meth:`_commit_bound`, :meth:`_skip_bound`),
        recomputed by :meth:`commit` and :meth:`remove_skipped` when they move a
        mark; only the slot bound (the table lengths) is computed here."""
        t = self._tables[req_id]
        slots = t.cbound
        for blocks, bs in zip(t.lists, self._bs, strict=True):
            slots = min(slots, len(blocks) * bs + 1)
        return slots, t.sbound

    def _commit_bound(self, done: Sequence[int]) -> int:
        """The smallest token count at which :meth:`commit` moves a commit mark
        (see :meth:`quiet_thresholds`); a large number without prefix caching."""
        bound = 1 << 62
        if self.pool.enable_caching:
            for d, (bs, eagle, a) in zip(done, self._commit_rules, strict=True):
                x = (d + 1) * bs
                bound = min(bound, max(x, -(-(x - bs) // a) * a, a) if eagle else -(-x // a) * a)
        return bound

    def _skip_bound(self, skipped: Sequence[int]) -> int:
        """The smallest computed-token count at which :meth:`remove_skipped` frees
        (a large number with no window-type group)."""
        bound = 1 << 62
        for g, rule, p, b in self._skip_rules:
            k = skipped[g] + 1
            if rule == 0:
                x = k * b + p
            elif rule == 1:
                x = -(-(k * b) // p) * p
            else:
                x = k * b + 1
            bound = min(bound, x)
        return bound

    def commit(self, req_id: str, block_hashes: Sequence[int], num_tokens: int) -> None:
        """Give every complete, real block below ``num_tokens`` (rounded as vLLM's
        coordinator does: :meth:`~sim.model.layout.Layout.cacheable_tokens`) its hash
        (vLLM ``cache_blocks``); blocks committed earlier are not revisited.
        ``block_hashes`` may run past ``num_tokens`` (the sequence's hashes to its end,
        no copy of the prefix): no hash past ``num_tokens`` is taken."""
        t = self._tables[req_id]
        pool = self.pool
        if num_tokens < t.cbound and pool.enable_caching:
            return   # below the commit bound no group's mark moves (:meth:`quiet_thresholds`)
        done = t.done
        nh = len(block_hashes)
        bhash = pool.bhash
        lists = t.lists
        changed = False
        for g in range(len(lists)):
            blocks = lists[g]
            bs, eagle, a = self._commit_rules[g]
            hpb = self._hpb[g]
            d = done[g]
            upto = num_tokens - num_tokens % a    # Layout.cacheable_tokens, inline
            if eagle and upto:
                upto = min(num_tokens, upto + bs)
            n = min(upto // bs, len(blocks), nh // hpb)
            if n <= d:
                continue
            done[g] = n
            changed = True
            mask = self._masks[g]
            if mask is not None:   # a sliding window hashes only the blocks a hit needs
                # the kept indices (``i >= shift`` and ``(i - shift) % per >= per - need``)
                # are the last ``need`` of every ``per``-block segment from ``shift``:
                # one slice per segment, in index order
                per, need, shift = mask
                seg = shift + (max(d, shift) - shift) // per * per
                ids: list[int] = []
                hs: list[int] = []
                while seg < n:
                    lo = max(d, seg + per - need)
                    hi = min(n, seg + per)
                    if lo < hi:
                        ids += blocks[lo:hi]
                        hs += block_hashes[(lo + 1) * hpb - 1 : hi * hpb : hpb]
                    seg += per
                if ids:
                    pool.commit_ids(ids, hs, g)
                continue
            if n - d > 1:
                pool.commit_ids(blocks[d:n], block_hashes[(d + 1) * hpb - 1 : n * hpb : hpb], g)
                continue
            b = blocks[d]  # a decode step's block
            if b and bhash[b] is None:
                pool.commit_one(b, block_hashes[n * hpb - 1], g)
        if changed:
            t.cbound = self._commit_bound(done)

    def free(self, req_id: str) -> None:
        """Release every block of a request, tail first."""
        t = self._tables.pop(req_id)
        pool = self.pool
        for blocks, skipped in zip(t.lists, t.skipped, strict=True):
            # entries below ``skipped`` are null: the reference skips them one by one
            pool.free(reversed(blocks[skipped:]) if skipped > 0 else reversed(blocks))

    def seed_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> None:
        """Make the first ``num_tokens`` of a sequence a cached GPU prefix, as a
        finished earlier request would leave it."""
        tmp = "__seed__"
        empty: tuple[list[int], ...] = tuple([] for _ in self.layout.groups)
        if self.allocate_new(tmp, empty, 0, 0, num_tokens) is None:
            raise GpuInvariantError("GPU pool too small to seed a prefix")
        t = self._tables[tmp]
        for g, blocks in enumerate(t.lists):
            first, _ = self.retained_range(g, num_tokens)
            if self.layout.groups[g].kind is GroupKind.FULL:
                first = 0
            n = num_tokens // self._bs[g]
            hpb = self._hpb[g]
            if first < n:
                if n * hpb > len(block_hashes):
                    raise IndexError("block_hashes shorter than the prefix to seed")
                self.pool.commit_ids(blocks[first:n], block_hashes[(first + 1) * hpb - 1 : n * hpb : hpb], g)
        self.free(tmp)
