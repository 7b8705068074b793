"""The belady oracle (:mod:`sim.model.future`): uses, consumption, next uses;
and the scheduler consuming a request's use at its first definite lookup."""

from __future__ import annotations

from array import array

import pytest

from sim.model.cpu_cache import NEVER, EvictionPolicy
from sim.model.cpu_cache import offload_key as k
from sim.model.future import FutureUses
from sim.model.layout import GroupKind, GroupSpec, Layout
from sim.model.request import Request
from sim.model.scheduler import Scheduler, SchedulerConfig

# two groups: 16-token chunks (hash every 16) and 32-token chunks (every 2nd hash)
LAYOUT = Layout.of([GroupSpec(GroupKind.FULL, 16), GroupSpec(GroupKind.FULL, 32)], tokens_per_hash=16)


def req(rid: str, hashes: list[int], prompt: int, output: int = 16, t: float = 0.0) -> Request:
    n = (prompt + output) // 16
    full = (hashes + [1000 + i for i in range(n)])[:n]
    return Request(rid, t, prompt, output, array("q", full), tokens_per_hash=16)


def test_uses_are_the_complete_prompt_chunks_of_every_group() -> None:
    fut = FutureUses([req("a", [1, 2, 3], 50)], LAYOUT)
    # 50 prompt tokens: three 16-token chunks (hashes 1, 2, 3), one 32-token chunk (hash 2)
    assert fut.keys_of("a") == (k(1, 0), k(2, 0), k(3, 0), k(2, 1))
    with_output = FutureUses([req("a", [1, 2, 3, 4], 50, output=30)], LAYOUT, prompt_only=False)
    assert fut.keys_of("zz") == ()
    # 80 tokens of prompt + output: five 16-token chunks, two 32-token chunks
    assert with_output.keys_of("a") == (k(1, 0), k(2, 0), k(3, 0), k(4, 0), k(1000, 0), k(2, 1), k(4, 1))


def test_next_use_is_the_first_request_not_yet_consumed() -> None:
    reqs = [req("a", [1, 2], 32), req("b", [1, 5], 32), req("c", [1, 2], 32)]
    fut = FutureUses(reqs, LAYOUT)
    moved: list[tuple] = []
    fut.subscribe(lambda keys: moved.append(tuple(keys)))
    assert fut.next_use(k(1, 0)) == 0 and fut.next_use(k(2, 0)) == 0 and fut.next_use(k(5, 0)) == 1
    assert fut.next_use(k(9, 0)) == NEVER
    fut.consume("b")                      # out of order: b looked up before a
    assert moved == [(k(1, 0), k(5, 0), k(5, 1))]   # b's 32-token chunk ends at its 2nd hash
    assert fut.next_use(k(1, 0)) == 0
    assert fut.next_use(k(5, 0)) == NEVER
    fut.consume("a")
    assert fut.next_use(k(1, 0)) == 2 and fut.next_use(k(2, 0)) == 2
    fut.consume("a")                      # idempotent: nobody told again
    fut.consume("unknown")
    assert len(moved) == 2
    fut.consume("c")
    assert fut.next_use(k(1, 0)) == NEVER


def test_a_request_id_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        FutureUses([req("a", [1], 16), req("a", [1], 16)], LAYOUT)


def test_the_scheduler_requires_the_oracle_for_belady_and_consumes_at_a_definite_lookup() -> None:
    layout = Layout.of([GroupSpec(GroupKind.FULL, 16)], tokens_per_hash=16)
    cfg = SchedulerConfig(layout=layout, gpu_blocks=64, cpu_capacity_chunks=4, eviction=EvictionPolicy.BELADY,
                          prefix_caching=False)
    with pytest.raises(ValueError, match="belady"):
        Scheduler(cfg)
    a, b = req("a", [1, 2], 40), req("b", [1, 2], 40, t=1.0)
    fut = FutureUses([a, b], layout)
    sched = Scheduler(cfg, future=fut)
    assert sched.future is fut
    sched.add_request(a)
    assert fut.next_use(k(1, 0)) == 0
    sched.schedule(0.0)                   # a is looked up (a miss: a definite answer)
    assert fut.next_use(k(1, 0)) == 1 and fut.next_use(k(2, 0)) == 1
    lru = Scheduler(SchedulerConfig(layout=layout, gpu_blocks=64, cpu_capacity_chunks=4), future=fut)
    assert lru.future is None             # only belady consults the future
