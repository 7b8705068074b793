"""How kvsim runs Python's cyclic garbage collector during long loops.

A replay allocates millions of small containers that live long (the CPU
cache's keys, request state) and almost no reference cycles. With the
default thresholds (700, 10, 10) the collector rescans that growing heap
again and again: on the whole Mooncake trace on the spec §6 layout its 27
full passes took 3.7 s of a 33 s run (11 %), and they collected almost
nothing. :func:`rare_collections` raises the thresholds for the duration
of a loop and gives the caller's back afterwards; cycles are still
collected, only later (no run's peak RSS changed measurably). Nothing of a
run's results depends on it.

Used by :meth:`sim.engine.loop.Engine.run` and ``kvsim check``'s batch.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["rare_collections"]

#: a young-generation pass every 100,000 net container allocations (default
#: 700); an older pass after 1,000 of those, the full pass as rarely
RARE_THRESHOLDS = (100_000, 1_000, 1_000)


@contextmanager
def rare_collections() -> Iterator[None]:
    """Run the enclosed block with :data:`RARE_THRESHOLDS`; the previous
    thresholds come back on exit (also on an exception), so nested uses and
    a notebook's own settings are left as they were."""
    before = gc.get_threshold()
    gc.set_threshold(*RARE_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)
