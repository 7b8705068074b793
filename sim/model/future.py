"""The workload's future chunk uses: the oracle behind the ``belady`` eviction policy.

What it models
    Belady's MIN rule evicts the page whose next reference lies farthest in
    the future. A trace of page references makes "next reference" exact; a
    closed-loop serving simulation has no such trace, because when a chunk is
    read depends on the scheduler, the links and the cache itself. kvsim
    therefore defines the future on the *workload*, which is fixed in advance:

    * the **uses** of a chunk key are the requests whose prompt contains that
      chunk (every complete chunk of the prompt, in every KV cache group;
      with ``offload_prompt_only = false`` the complete chunks of prompt +
      output), numbered by arrival order (position in the stream);
    * a request's use is **consumed** when the scheduler has its first
      definite lookup answer for it (the connector returned a hit count,
      not "ask again"), or when it leaves the engine without one (rejected,
      or finished with offloading bypassed);
    * the **next use** of a key is the smallest position among its requests
      not yet consumed, or :data:`~sim.model.cpu_cache.NEVER`. Requests that
      have arrived but not yet been looked up are therefore the nearest
      future, and requests that have not arrived yet follow in arrival order.

    When a use is consumed the oracle tells its subscribers (the policy)
    which keys' next use moved, so the policy can re-rank them eagerly.

Caveats (why this is a reference point, not a proven upper bound)
    * Belady is optimal for a single cache of equal-sized pages where every
      reference counts on its own. Here a hit counts only as part of a
      *prefix* (the first missing chunk ends the hit), chunks of several
      groups and sizes are looked up jointly, sliding-window groups read only
      the chunks near the hit boundary (the oracle counts every prompt chunk
      as a use), and the summary weights hits by tokens. Evicting a later
      chunk of a prefix can be worth less than its next-use distance says.
    * The loop is closed: evictions change hits, hits change step times and
      so the order in which later lookups happen; the oracle ranks by arrival
      order, not by the (unknowable) lookup order.
    * A request looked up again after a preemption or a modelled crash is
      not foreseen (its use was consumed at the first definite answer).
    * The whole workload is read into memory before the run (memory grows
      with the trace), and the ranking costs ``O(log n)`` per store.

    So the ``belady`` figures are what a clairvoyant chunk-level policy
    achieves in this model; on the Mooncake trace they sit above LRU and ARC
    (``docs/tiers.md``), which is what the comparison needs, but the code does
    not claim optimality.

Invariants
    * each key's pointer only moves forward, and never past an unconsumed use;
    * a consumed position is never un-consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from sim.model.cpu_cache import NEVER, OffloadKey, offload_key
from sim.model.layout import Layout
from sim.model.request import Request

__all__ = ["FutureUses"]


class FutureUses:
    """Per chunk key, the arrival positions of the requests that will use it.

    Args:
        requests: the whole workload, in arrival order.
        layout: the KV cache groups and chunking (which hashes name a chunk).
        prompt_only: count only chunks within the prompt (vLLM's default
            ``offload_prompt_only``); else prompt and output.
    """

    def __init__(self, requests: Iterable[Request], layout: Layout, *, prompt_only: bool = True) -> None:
        #: request id -> (arrival position, its keys)
        self._reqs: dict[str, tuple[int, tuple[OffloadKey, ...]]] = {}
        #: key -> positions of the requests using it, ascending
        self._uses: dict[OffloadKey, list[int]] = {}
        #: key -> index into ``_uses[key]`` of the first use not known to be consumed
        self._next: dict[OffloadKey, int] = {}
        self._consumed: set[int] = set()
        self._listeners: list[Callable[[Sequence[OffloadKey]], None]] = []
        tpcs = layout.tokens_per_chunk
        hpcs = layout.hashes_per_chunk
        for pos, req in enumerate(requests):
            tokens = req.prompt_tokens if prompt_only else req.prompt_tokens + req.output_tokens
            keys: list[OffloadKey] = []
            for g, (tpc, hpc) in enumerate(zip(tpcs, hpcs, strict=True)):
                n = tokens // tpc
                keys.extend(offload_key(h, g) for h in req.block_hashes[hpc - 1 : n * hpc : hpc])
            keys = list(dict.fromkeys(keys))
            if req.req_id in self._reqs:
                raise ValueError(f"request id {req.req_id} appears twice in the workload")
            self._reqs[req.req_id] = (pos, tuple(keys))
            for key in keys:
                self._uses.setdefault(key, []).append(pos)

    def subscribe(self, listener: Callable[[Sequence[OffloadKey]], None]) -> None:
        """Call ``listener`` with the keys of every consumed use (their next use moved)."""
        self._listeners.append(listener)

    def next_use(self, key: OffloadKey) -> int:
        """Arrival position of the first request still to use ``key``, or ``NEVER``."""
        uses = self._uses.get(key)
        if uses is None:
            return NEVER
        i = self._next.get(key, 0)
        consumed = self._consumed
        while i < len(uses) and uses[i] in consumed:
            i += 1
        self._next[key] = i
        return uses[i] if i < len(uses) else NEVER

    def consume(self, req_id: str) -> None:
        """The request's use of its chunks is over (idempotent; unknown ids ignored)."""
        entry = self._reqs.get(req_id)
        if entry is None:
            return
        pos, keys = entry
        if pos in self._consumed:
            return
        self._consumed.add(pos)
        for listener in self._listeners:
            listener(keys)

    def keys_of(self, req_id: str) -> tuple[OffloadKey, ...]:
        """The chunk keys the request will use (empty for an unknown id)."""
        entry = self._reqs.get(req_id)
        return entry[1] if entry is not None else ()

    @property
    def num_requests(self) -> int:
        return len(self._reqs)
