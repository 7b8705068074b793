"""The connector's flush fences (spec §7.6) counted per block against a naive model.

The connector counts, per GPU block, the pending store jobs reading it, and
finds the jobs themselves only when a step re-allocates a fenced block
(:meth:`~sim.model.connector.OffloadingScheduler.stores_reading`). The
reference keeps the set of jobs per block, as the connector once did. Jobs
here are made directly (window-group blocks fenced at once, full-attention
blocks once their request finishes), several jobs may read one block, and
they complete in any order.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.model.connector import OffloadingScheduler, _Job
from sim.model.cpu_cache import CpuChunkCache
from sim.model.layout import Layout
from sim.model.windows import profile
from tests.helpers import fa

#: a job's window-group and full-attention blocks: distinct ids (slots of different tables)
JOB = st.tuples(st.lists(st.integers(1, 40), unique=True, max_size=16), st.integers(0, 16),
                st.booleans()).map(lambda t: (tuple(t[0][: t[1]]), tuple(t[0][t[1]:]), t[2]))


@settings(max_examples=300, deadline=None)
@given(st.lists(JOB, min_size=1, max_size=8), st.data())
def test_fence_counts_match_the_jobs_reading_each_block(
        jobs: list[tuple[tuple[int, ...], tuple[int, ...], bool]], data: st.DataObject) -> None:
    sched = OffloadingScheduler(Layout.of([fa(2)], tokens_per_hash=2, blocks_per_chunk=2),
                                CpuChunkCache(64), profile("new"))
    naive: dict[int, set[int]] = {}

    def reference_reading(ids: set[int]) -> set[int]:
        return set().union(*(naive[b] for b in ids if b in naive))

    for j, (fenced, deferred, finished) in enumerate(jobs):
        job = sched._jobs[j] = _Job(f"r{j}", (), True, fenced, deferred)
        sched._fence(fenced)
        for b in fenced:
            naive.setdefault(b, set()).add(j)
        if finished:                                 # the request has finished: all its blocks fenced
            sched._fence_deferred(job)
            for b in deferred:
                naive.setdefault(b, set()).add(j)
    order = data.draw(st.permutations(range(len(jobs))))
    for j in order:
        probe = data.draw(st.sets(st.integers(1, 40), max_size=10))
        assert sched.stores_reading(probe) == reference_reading(probe)
        assert sched.block_fences == {b: len(js) for b, js in naive.items()}
        job = sched._jobs.pop(j)
        sched._unfence(job.fenced)
        if job.deferred_fenced:
            sched._unfence(job.deferred)
        for b in list(naive):
            naive[b].discard(j)
            if not naive[b]:
                del naive[b]
    assert not sched.block_fences
