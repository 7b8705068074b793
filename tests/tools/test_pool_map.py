"""``sim.tools.run.pool_map``: ``pool.map``'s results, with a bounded number of tasks in
flight, and a pool ended at once (never waited for) when its consumer stops early."""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from sim.tools.run import pool_map, worker_init


def _square(x: int) -> int:
    return x * x


def _slow(x: int) -> int:
    time.sleep(0.05)
    return x


def _pool() -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=2, initializer=worker_init, initargs=(os.getpid(),))


def test_results_in_order_with_at_most_ahead_tasks_not_yet_consumed():
    pool = _pool()
    submitted = [0]
    real_submit = pool.submit

    def counting(fn, *args, **kwargs):
        submitted[0] += 1
        return real_submit(fn, *args, **kwargs)

    pool.submit = counting  # type: ignore[method-assign]   # this instance only
    out = []
    for consumed, r in enumerate(pool_map(pool, _square, range(100), ahead=5), start=1):
        # the one just consumed, then up to 5 ahead of it (one resubmitted before the yield)
        assert submitted[0] - consumed <= 5
        out.append(r)
    pool.shutdown()
    assert out == [x * x for x in range(100)] == list(map(_square, range(100)))
    assert submitted[0] == 100


def test_a_consumer_that_stops_early_ends_the_workers_at_once():
    pool = _pool()
    gen = pool_map(pool, _slow, range(10_000), ahead=8)
    assert next(gen) == 0
    workers = list(pool._processes.values())
    assert workers and all(p.is_alive() for p in workers)
    t0 = time.monotonic()
    gen.close()          # what an interrupt in the consumer's loop comes to
    assert time.monotonic() - t0 < 5
    # a process whose exit was seen (its sentinel) can take a moment more to be reaped
    while any(p.is_alive() for p in workers) and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert not any(p.is_alive() for p in workers)


def test_an_error_in_a_task_reaches_the_consumer_and_ends_the_pool():
    pool = _pool()
    workers = []
    with pytest.raises(TypeError):
        for _ in pool_map(pool, _square, [1, 2, "x", 4], ahead=2):   # type: ignore[list-item]
            workers = list(pool._processes.values())
    t0 = time.monotonic()
    while any(p.is_alive() for p in workers) and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert workers and not any(p.is_alive() for p in workers)

