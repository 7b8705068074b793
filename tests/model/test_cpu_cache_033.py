"""Narratives of vLLM 0.33's request-scoped CPU policies (LATEST logic).

What vLLM 0.33.0 does (``vllm/v1/kv_offload/cpu/manager.py`` and
``cpu/policies/{base,lru,arc}.py``), as these tests assume it:

* The connector no longer touches chunks at lookup or after a store. The CPU
  manager records, per request, the first offer (of a chunk to be stored or
  already READY; a pending one is not a use) and the first load of each chunk.
* LRU ranks every present chunk ``(major, minor)``; the victim is the idle
  chunk of lowest rank, equal ranks by key (lower group first for one hash).
  A request draws one major from a shared counter at its first recorded use;
  a chunk it stores or first uses gets ``(major, -end token)`` if that is
  higher than its rank. When the request finishes, its chunks, ordered by end
  token then group, get fresh majors walking from the tail: the head is newest.
  A completed store or load does not move a chunk.
* ARC keeps its lists and victim scan; nothing moves while a request runs.
  A store miss of a ghost adapts ``p``. At finish, chunks the request only
  stored move to the newest end of their list; chunks it read while READY
  (and did not store itself) go to the newest end of T2.
"""

from __future__ import annotations

import copy

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sim.model.cpu_cache import (
    CpuChunkCache,
    EvictionPolicy,
    OffloadKey,
    RankedLruPolicy,
    RequestArcPolicy,
    key_parts,
    offload_key,
)


def k(h: int, g: int = 0) -> OffloadKey:
    return offload_key(h, g)


A, B, C, X, Y, Z = (k(h) for h in (1, 2, 3, 24, 25, 26))
#: end token of each key in every request here (16-token chunks)
ENDS = {A: 16, B: 32, C: 48, X: 16, Y: 48, Z: 16, k(9, 0): 16, k(9, 1): 16}


def cache(capacity: int, policy: EvictionPolicy = EvictionPolicy.LRU) -> CpuChunkCache:
    return CpuChunkCache(capacity, policy, request_scoped=True)


def store(c: CpuChunkCache, req: str, *keys: OffloadKey) -> None:
    plan = c.prepare_store(keys, req, ENDS)
    assert plan is not None
    c.complete_store(plan.keys)
    c.check_invariants()


def load(c: CpuChunkCache, req: str, *keys: OffloadKey, ends: dict[OffloadKey, int] | None = None) -> None:
    c.prepare_load(keys)
    c.observe_load(req, keys, ENDS if ends is None else ends)
    c.complete_load(keys)
    c.check_invariants()


def order(c: CpuChunkCache) -> list[OffloadKey]:
    """Idle keys, next victim first, probed by overflowing a copy."""
    probe = copy.deepcopy(c)
    fresh = [k(-1 - i, 99) for i in range(probe.num_free_slots + probe.num_evictable)]
    plan = probe.prepare_store(fresh)
    assert plan is not None
    return list(plan.evicted)


def test_lru_a_running_request_puts_its_tail_before_its_head() -> None:
    c = cache(4)
    store(c, "a", A, B)
    assert isinstance(c._policy, RankedLruPolicy)
    assert order(c) == [B, A]


def test_lru_finishing_makes_the_request_newest_head_last() -> None:
    c = cache(4)
    store(c, "a", A, B)        # major 1
    store(c, "b", C, X)        # major 2
    assert order(c) == [B, A, C, X]
    c.finish_request("a")      # B, A get fresh majors 3, 4
    assert order(c) == [C, X, B, A]


def test_lru_a_use_raises_a_chunk_to_the_request_rank_and_never_lowers_it() -> None:
    c = cache(6)
    store(c, "a", A, B)
    c.finish_request("a")      # B = 2, A = 3
    store(c, "z", Z)           # z: major 4, Z = (4, -16)
    store(c, "b", A, B, C)     # b: major 5; A, B raised to (5, -16), (5, -32); C = (5, -48)
    assert order(c) == [Z, C, B, A]
    c.finish_request("b")      # C, B, A = 6, 7, 8
    store(c, "z", A)           # (4, -16) is below A's rank: unchanged
    assert order(c) == [Z, C, B, A]


def test_lru_a_completed_load_keeps_the_rank_its_request_gave() -> None:
    c = cache(6)
    store(c, "a", A, B)
    c.finish_request("a")      # B = 2, A = 3
    store(c, "y", Y)           # y: major 4, Y = (4, -48)
    store(c, "x", X)           # x: major 5
    load(c, "y", A)            # A raised to (4, -16), not made newest
    assert order(c) == [B, Y, A, X]


def test_lru_one_boundary_in_two_groups_lower_group_first_then_reversed_by_commit() -> None:
    c = cache(4)
    g0, g1 = k(9, 0), k(9, 1)
    store(c, "a", g0, g1)      # equal ranks: the lower group goes first
    assert order(c) == [g0, g1]
    c.finish_request("a")      # walked from (end, group) = (16, 1): g1 gets the older major
    assert order(c) == [g1, g0]


def test_lru_a_pending_chunk_offered_again_is_not_a_use() -> None:
    c = cache(4)
    plan = c.prepare_store([A], "a", ENDS)          # a: major 1, A pending
    assert plan is not None
    store(c, "x", X)                                # x: major 2
    assert c.prepare_store([A], "b", ENDS) is not None   # b offers pending A: not recorded
    c.complete_store([A])
    assert order(c) == [A, X]
    c.finish_request("b")                           # b used nothing
    assert order(c) == [A, X]


def test_arc_a_store_is_not_a_second_use() -> None:
    c = cache(4, EvictionPolicy.ARC)
    store(c, "a", A, B)
    pol = c._policy
    assert isinstance(pol, RequestArcPolicy)
    c.finish_request("a")      # B then A moved to T1's newest end
    assert (list(pol.t1), list(pol.t2)) == ([B, A], [])


def test_arc_a_reuse_promotes_at_finish_not_before() -> None:
    c = cache(4, EvictionPolicy.ARC)
    store(c, "a", A, B)
    c.finish_request("a")
    pol = c._policy
    assert isinstance(pol, RequestArcPolicy)
    load(c, "b", A)
    store(c, "b", A, B)        # both READY: A already seen, B a first use
    assert (list(pol.t1), list(pol.t2)) == ([B, A], [])
    c.finish_request("b")      # walked from the tail: B, then A into T2
    assert (list(pol.t1), list(pol.t2)) == ([], [B, A])


def test_arc_rereading_its_own_store_is_not_a_reuse() -> None:
    c = cache(4, EvictionPolicy.ARC)
    store(c, "a", A)
    load(c, "a", A)
    c.finish_request("a")
    pol = c._policy
    assert isinstance(pol, RequestArcPolicy)
    assert (list(pol.t1), list(pol.t2)) == ([A], [])


def test_arc_a_ghost_store_miss_adapts_p_before_the_store() -> None:
    c = cache(1, EvictionPolicy.ARC)
    store(c, "a", A)
    c.finish_request("a")
    store(c, "x", X)           # evicts A into B1
    pol = c._policy
    assert isinstance(pol, RequestArcPolicy)
    assert (list(pol.b1), pol.p) == ([A], 0.0)
    store(c, "b", A)           # miss on a B1 ghost: p + max(1, 0/1); then X goes to B1
    assert pol.p == 1.0
    assert (list(pol.t1), list(pol.b1)) == ([A], [X])


def test_old_and_new_caches_ignore_the_request_arguments() -> None:
    c = CpuChunkCache(4)
    plan = c.prepare_store([A, B], "a", ENDS)
    assert plan is not None
    c.complete_store([A, B])
    c.finish_request("a")
    assert order(c) == [A, B]


# ------------------------------------------------------- stateful: heap vs ranks

KEYS = [k(h, g) for h in range(1, 6) for g in (0, 1)]
MACHINE_ENDS = {key: 16 * key_parts(key)[0] for key in KEYS}


class RankedLruMachine(RuleBasedStateMachine):
    """Random offers, loads and finishes of a few requests against a 6-slot ranked LRU.

    After every step the victim order (probed by overflowing a copy) must be
    the idle keys sorted by (rank, key), the naive reading of vLLM 0.33's
    lazily invalidated heap (a request finished here may offer again: it
    then starts afresh with a new major)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = cache(6)
        self.pending: list[OffloadKey] = []

    @rule(req=st.sampled_from("abc"),
          keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def offer(self, req: str, keys: list[OffloadKey]) -> None:
        plan = self.c.prepare_store(keys, req, MACHINE_ENDS)
        if plan is not None:
            self.pending.extend(plan.keys)

    @rule()
    def complete_stores(self) -> None:
        self.c.complete_store(self.pending)
        self.pending = []

    @rule(req=st.sampled_from("abc"), key=st.sampled_from(KEYS))
    def load_one(self, req: str, key: OffloadKey) -> None:
        ref = self.c.ref_count(key)
        if ref is not None and ref >= 0:
            load(self.c, req, key, ends=MACHINE_ENDS)

    @rule(req=st.sampled_from("abc"))
    def finish(self, req: str) -> None:
        self.c.finish_request(req)

    @invariant()
    def victims_follow_the_ranks(self) -> None:
        self.c.check_invariants()
        pol = self.c._policy
        assert isinstance(pol, RankedLruPolicy)
        assert order(self.c) == pol.order()


TestRankedLruMachine = RankedLruMachine.TestCase
TestRankedLruMachine.settings = settings(max_examples=40, stateful_step_count=25,
                                         derandomize=True, deadline=None)
