"""vLLM's scheduling policy, without a clock: what one engine step runs, and its outcome.

What it models
    The scheduler of one vLLM engine with the OffloadingConnector (vLLM v1
    ``Scheduler``): the waiting queue, the running batch, the token budget,
    chunked prefill, preemption, admission through the connector, and the
    rejection of requests longer than ``max_model_len``. It owns the GPU KV cache
    (:mod:`sim.model.gpu_cache`), the CPU chunk cache and the connector
    (:mod:`sim.model.connector`, :mod:`sim.model.cpu_cache`). It knows no
    clock: every call is given the simulated time, and the SimPy engine
    (:mod:`sim.engine.loop`) runs the transfers and the forward pass.

    One engine step is :meth:`Scheduler.schedule` (vLLM ``schedule``), the
    worker (the engine), then :meth:`Scheduler.update_from_output`:

    ``schedule(now)`` returns a :class:`StepPlan`:
        1. running requests, in order, get their slots (decode: 1 token,
           chunked prefill: up to the token budget); window groups free the
           blocks they no longer attend over; when the pool is short the last
           running request is preempted (recompute: blocks freed, back to the
           front of the waiting queue);
        2. if nothing was preempted, waiting requests are admitted while
           budget and ``max_num_seqs`` allow (blocked ones are skipped, as
           vLLM's skipped-waiting queue does): a request waiting for its load
           is promoted when the load was reported done (its blocks are
           committed, the last token is recomputed); a new request gets its
           GPU prefix hit ``L`` and asks the connector for ``E`` (``None``:
           retried next step); with ``reserve_full_isl`` (vLLM's
           ``scheduler_reserve_full_isl``, on by default in 0.29 to 0.33) it
           is admitted only if blocks for its whole input fit in the free
           pool, each window or chunked-local group capped at what it holds
           at most (:func:`admission_caps`); allocation of the first chunk;
           ``update_state_after_alloc`` builds the load, which makes the
           request wait for remote KV; a loaded request is checked the same
           way when it is promoted;
        3. the connector's metadata: block ids, stale-entry zeroing and flush
           fences (spec §7.6), store jobs of the scheduled requests and of the
           requests finished in the previous step (which are then released);
           the step load, the step model's input (prefill tokens, decode
           sequences, scheduled requests, KV bytes attended and, per group,
           the query-key pairs of the step: :class:`AttendedContext`).

    The engine then flushes, submits the plan's transfers and waits the step
    time (spec §8.3).

    ``update_from_output(now, plan, completed)``:
        4. computed tokens advance, a token is sampled when a request
           reaches its length, stop conditions finish requests (blocks freed
           at once), then the transfer completions (polled by the engine at
           the step's end, in completion order) update the CPU cache and mark
           loaded requests ready.

    Decode fast-forward (clock-free parts)
        When every running request is decoding, no request finishes, the
        waiting queue cannot change the batch and no store is due
        (:meth:`Scheduler.can_fast_forward`; the engine adds its own
        conditions), :meth:`Scheduler.plan_fast_forward` finds how many
        decode steps ``k`` start before a horizon (the engine's next
        arrival, transfer completion or occupancy sample) and fit in the
        free blocks; :meth:`Scheduler.fast_forward_step` applies step ``s``
        (only requests that cross a block boundary do work, in the exact
        order stepping would), :meth:`Scheduler.fast_forward_all` every step
        at once, and :meth:`Scheduler.finish_fast_forward` the end of the
        run. Results are identical to stepping (tested).

    Hooks (:class:`SchedulerHooks`) let the engine see, in order, the events
    rows, the releases of requests, and the points where the copy path
    writes and verifies KV.

Simplifications
    * One engine, one worker (no tensor/pipeline/data parallelism), no
      speculative decoding, no encoder inputs, no LoRA, no priorities.
    * The waiting queue is FCFS with a skipped queue in front (vLLM 0.30).
      The async-load admission reservation is vLLM's (0.29-0.33): a request
      whose load is asynchronous is admitted only if its slots fit in the free
      blocks less what the in-flight prefills (requests admitted with an
      asynchronous load, or still prefilling) need for their whole sequence.
      The allocator's watermark is vLLM's default, 0. Mamba groups have no
      admission cap here.
    * A request longer than :func:`max_model_len` (the longest request the
      pool holds, each group at its worst case) is rejected on arrival, as
      vLLM refuses a request longer than its ``max_model_len`` (which its
      start-up check bounds the same way; a deployment may set it lower).
      A request within the bound that still cannot fit even in an empty GPU
      is rejected (recorded) instead of waiting forever; waiting requests
      holding blocks while nothing runs are preempted (deadlock breaker, see
      :meth:`Scheduler._no_room`).
    * Store jobs are created in schedule order (running requests first, then
      newly admitted, then requests finished in the previous step).
    * A modelled crash with ``on_crash = "record"`` drops the request's
      external hit for good (it recomputes from its local hit). A layout
      vLLM asserts on at every local lookup (:func:`lookup_assertion`)
      records one crash per request, which then goes on without a local hit.

Invariants (checked at the end of a completed run: :meth:`Scheduler.invariant_problems`)
    * every request finished or was rejected;
    * no GPU block is referenced; the pool's bookkeeping is consistent;
    * no CPU chunk is pending a store or being loaded (every store completed
      or was cancelled, every load released); the cache is consistent;
    * the connector holds no job and no request state.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, NamedTuple, TypeAlias

import numpy as np
from mypy_extensions import mypyc_attr

from sim.model.connector import LoadPlan, ModelledCrash, ModelledCrashError, OffloadingScheduler, StorePlan
from sim.model.costs import (
    ZERO_STEP,
    StepLoad,
    StepTimeModel,
    TransferPiece,
    attended_tokens,
    attention_pairs,
    decode_timer,
    kv_terms,
    pieces_per_block,
    prompt_blocks,
)
from sim.model.cpu_cache import ChunkState, CpuChunkCache, EvictionPolicy
from sim.model.future import FutureUses
from sim.model.gpu_cache import NULL_BLOCK_ID, Allocation, Block, GpuKVCache
from sim.model.gpu_fast import GpuFastCache
from sim.model.layout import GroupKind, GroupSpec, Layout, cdiv
from sim.model.request import LiveRequest, Request, RequestStatus
from sim.model.tiers import TieredCache, TierSpec
from sim.model.windows import profile

__all__ = [
    "MAX_POSITIONS",
    "Admission",
    "AdmitOutcome",
    "AttendedContext",
    "ChunkRange",
    "FastForward",
    "InvariantViolation",
    "ModelEvent",
    "ReproducerSnapshot",
    "Scheduled",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerHooks",
    "SchedulerStats",
    "StepOutput",
    "StepPlan",
    "TransferJob",
    "lookup_assertion",
    "max_model_len",
    "reject_too_long",
]

#: new GPU block ids per group, or None when the step allocated nothing
BlockIds = tuple[tuple[int, ...], ...]

_WAITING = RequestStatus.WAITING
_WAITING_FOR_KV = RequestStatus.WAITING_FOR_KV
_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED
_REJECTED = RequestStatus.REJECTED


@mypyc_attr(native_class=False)   # compiled classes cannot extend RuntimeError
class InvariantViolation(RuntimeError):  # noqa: N818 -- the name says what happened
    """An end-of-run invariant failed: a simulator bug (exit 1)."""


@mypyc_attr(allow_interpreted_subclasses=True)   # sim.engine.loop.EngineConfig extends it
@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's share of the engine configuration (see :class:`sim.engine.loop.EngineConfig`)."""

    layout: Layout
    gpu_blocks: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    prefix_caching: bool = True
    offloading: bool = True
    offload_prompt_only: bool = True
    cpu_capacity_chunks: int = 0
    eviction: EvictionPolicy = EvictionPolicy.LRU
    window_logic: Literal["old", "new", "latest"] = "new"
    on_crash: Literal["record", "stop"] = "record"
    step_cost: StepTimeModel = ZERO_STEP
    #: how vLLM cuts a GPU block into copies (:data:`sim.model.costs.TRANSFER_PIECES`)
    transfer_piece: TransferPiece = "layer"
    fast_forward: bool = True
    #: False models vLLM run with ``python -O`` (see :class:`OffloadingScheduler`)
    assertions: bool = True
    #: the GPU block accounting: ``fast`` (:mod:`sim.model.gpu_fast`) or the per-block
    #: ``reference`` (:mod:`sim.model.gpu_cache`); the decisions are identical (tested)
    block_accounting: Literal["fast", "reference"] = "fast"
    #: admit a new (or resumed) request only if blocks for its whole input fit
    #: (vLLM's ``scheduler_reserve_full_isl``, on by default in 0.29 to 0.33)
    reserve_full_isl: bool = True
    #: secondary tiers behind the CPU tier (:mod:`sim.model.tiers`); empty: none
    tiers: tuple[TierSpec, ...] = ()

    @property
    def needs_future(self) -> bool:
        """Some tier (the CPU's or a secondary one) evicts with ``belady``."""
        return self.offloading and (self.eviction is EvictionPolicy.BELADY
                                    or any(t.policy is EvictionPolicy.BELADY for t in self.tiers))


#: block accounting -> GPU KV cache class (same interface, same decisions)
GPU_CACHES: dict[str, type[GpuKVCache] | type[GpuFastCache]] = {"fast": GpuFastCache, "reference": GpuKVCache}


class ModelEvent(NamedTuple):
    """A row of the ``events`` table, as the model reports it."""

    t_s: float
    kind: str
    detail: str
    req_id: str | None
    group: int
    chunk: int
    message: str


def _no_event(event: ModelEvent) -> None:
    """The default events hook: drop it."""


@dataclass
class SchedulerHooks:
    """What the engine wants to see happen, at the moment it happens.

    Attributes:
        event: a crash, hazard, rejection or deadlock break (an ``events`` row).
        release: the request is done with the engine (finished and its final
            stores built, or rejected); it is no longer in :attr:`Scheduler.requests`.
        computed: the step computed tokens ``[start, end)`` of the request
            (copy path: write their KV); None: not needed.
        promoted: a loaded request leaves WAITING_FOR_KV (copy path: verify
            what it will read); None: not needed.
        load_done: a request's load completed (copy path: verify the blocks it
            filled); None: not needed.
    """

    event: Callable[[ModelEvent], None] = _no_event
    release: Callable[[LiveRequest], None] | None = None
    computed: Callable[[LiveRequest, int, int], None] | None = None
    promoted: Callable[[LiveRequest], None] | None = None
    load_done: Callable[[LiveRequest, LoadPlan], None] | None = None


@mypyc_attr(allow_interpreted_subclasses=True)   # sim.engine.metrics.RunSummary extends it
@dataclass
class SchedulerStats:
    """The run figures the scheduler counts (merged into the run summary)."""

    requests_arrived: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    cpu_reload_tokens: int = 0
    computed_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    deferrals: int = 0
    deferral_reasons: dict[str, int] = field(default_factory=dict)
    load_jobs: int = 0
    store_jobs: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    crashes: int = 0
    crash_kinds: dict[str, int] = field(default_factory=dict)
    first_crash_s: float | None = None
    hazards: int = 0
    hazard_kinds: dict[str, int] = field(default_factory=dict)


class AdmitOutcome(Enum):
    """What admitting the request at the head of the waiting queue gave."""

    #: admitted: prefill scheduled, or its load issued
    ADMITTED = "admitted"
    #: lookup deferred, or no room while transfers are in flight: skip it, retry next step
    DEFER = "defer"
    #: no room (or the run stops): admit no more this step
    FULL = "full"
    #: it never fits: rejected
    REJECTED = "rejected"


class Admission:
    """The result of one admission attempt (tokens, blocks and load when admitted).

    Read-only by convention. This and the other records made at every step
    (:class:`TransferJob`, :class:`StepPlan`, :class:`StepOutput`) are plain classes
    with their own ``__init__``, not frozen dataclasses: compiled, such an
    ``__init__`` writes the fields directly, where a frozen dataclass's runs as Python
    code that sets each field through ``object.__setattr__`` (eight times the cost
    of a plain one's, before compiling)."""

    __slots__ = ("load", "new_block_ids", "num_new_tokens", "outcome")

    def __init__(self, outcome: AdmitOutcome, num_new_tokens: int = 0, new_block_ids: BlockIds | None = None,
                 load: LoadPlan | None = None) -> None:
        self.outcome = outcome
        self.num_new_tokens = num_new_tokens
        self.new_block_ids = new_block_ids
        self.load = load


_DEFER = Admission(AdmitOutcome.DEFER)
_FULL = Admission(AdmitOutcome.FULL)
_REJECT = Admission(AdmitOutcome.REJECTED)


Scheduled: TypeAlias = tuple[LiveRequest, int, BlockIds | None]
"""A request scheduled in a step: ``(request, new tokens, newly allocated block ids per
group or None when nothing was allocated)``. A plain tuple, not a ``NamedTuple``: one is
made per request and step, and a ``NamedTuple``'s constructor is Python code even in
the compiled module (about ten times a tuple's cost)."""


class TransferJob:
    """A load (``h2d``) or store (``d2h``) job to submit, with its size (read-only by
    convention, see :class:`Admission`).

    Attributes:
        pieces: separate copies vLLM makes for the job (a page per layer per block,
            or a packed block).
    """

    __slots__ = ("blocks", "chunks", "direction", "job_id", "nbytes", "pieces", "plan", "req_id")

    def __init__(self, job_id: int, req_id: str, direction: Literal["h2d", "d2h"], chunks: int, blocks: int,
                 nbytes: int, plan: LoadPlan | StorePlan, pieces: int = 0) -> None:
        self.job_id = job_id
        self.req_id = req_id
        self.direction = direction
        self.chunks = chunks
        self.blocks = blocks
        self.nbytes = nbytes
        self.plan = plan
        self.pieces = pieces


#: the load of a step that computes nothing
_NO_LOAD = StepLoad()


class StepPlan:
    """What one step runs (vLLM's ``SchedulerOutput`` plus the connector's metadata;
    read-only by convention, see :class:`Admission`).

    Attributes:
        scheduled: the requests of the forward pass, in batch order.
        admitted: requests admitted this step (prefill scheduled or load issued).
        preempted: running requests preempted this step.
        loads: load jobs to submit (after the flushes and the deferred stores).
        stores: store jobs built this step (submitted with the next step
            unless flushed now).
        flush: store jobs that must complete before the forward pass.
        released_finished: requests finished in the previous step were released.
        broke_deadlock: a request was rejected or holders were preempted to
            break a deadlock.
        load: the step cost model's input (:class:`~sim.model.costs.StepLoad`).
        stopped: a modelled crash stopped the run (``on_crash = "stop"``);
            nothing else of the plan is set.
    """

    __slots__ = (
        "admitted",
        "broke_deadlock",
        "flush",
        "load",
        "loads",
        "preempted",
        "released_finished",
        "scheduled",
        "stopped",
        "stores",
    )

    def __init__(self, scheduled: tuple[Scheduled, ...] = (), admitted: tuple[LiveRequest, ...] = (),
                 preempted: tuple[LiveRequest, ...] = (), loads: tuple[TransferJob, ...] = (),
                 stores: tuple[TransferJob, ...] = (), flush: frozenset[int] = frozenset(),
                 released_finished: bool = False, broke_deadlock: bool = False, load: StepLoad = _NO_LOAD,
                 stopped: bool = False) -> None:
        self.scheduled = scheduled
        self.admitted = admitted
        self.preempted = preempted
        self.loads = loads
        self.stores = stores
        self.flush = flush
        self.released_finished = released_finished
        self.broke_deadlock = broke_deadlock
        self.load = load
        self.stopped = stopped

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed in the step."""
        return self.load.prefill_tokens

    @property
    def decode_seqs(self) -> int:
        """Sequences that decode one token in the step."""
        return self.load.decode_seqs

    @property
    def context_tokens(self) -> float:
        """Attended KV, in full-attention token equivalents."""
        return self.load.context_tokens

    @property
    def busy(self) -> bool:
        """Whether the step does anything (the engine adds deferred stores and
        polled completions). Releasing the connector state of requests finished
        in the previous step is not enough: that step was busy, so this one
        comes at once anyway, and a next step at the same time would only
        repeat its lookups (kvsim's engine with vLLM deciding does not take it
        either: :mod:`sim.engine.vllm_engine`)."""
        return bool(self.scheduled or self.loads or self.stores or self.admitted or self.preempted
                    or self.flush or self.broke_deadlock)


class StepOutput:
    """What :meth:`Scheduler.update_from_output` did (read-only by convention, see
    :class:`Admission`): the requests that finished, and the transfer completions applied."""

    __slots__ = ("finished", "polled")

    def __init__(self, finished: tuple[LiveRequest, ...], polled: int) -> None:
        self.finished = finished
        self.polled = polled


class ChunkRange(NamedTuple):
    """Chunks ``first..last`` of a group, all in one state (check/1 vocabulary)."""

    first: int
    last: int
    state: str


@dataclass(frozen=True, slots=True)
class ReproducerSnapshot:
    """What a request met when it crashed or hit a hazard: a ``check/1`` case.

    The chunk states are those before the request's own load pinned them.
    """

    req_id: str
    t_s: float
    kind: str
    detail: str
    logic: str
    groups: tuple[GroupSpec, ...]
    blocks_per_chunk: int
    tokens_per_hash: int
    num_tokens: int
    local_hit_tokens: int
    prefix_caching: bool
    cpu_capacity_chunks: int
    #: (group, ranges) for every group with a stated chunk
    chunk_states: tuple[tuple[int, tuple[ChunkRange, ...]], ...]

    @property
    def stated_ranges(self) -> int:
        """How many ranges are stated, over all groups."""
        return sum(len(ranges) for _, ranges in self.chunk_states)


_STATE_NAMES = {ChunkState.READY: "present", ChunkState.PENDING: "pending", ChunkState.LOADING: "loading"}


def _ranges(names: Sequence[str | None]) -> tuple[ChunkRange, ...]:
    """Runs of equal names (None: not stated)."""
    out: list[ChunkRange] = []
    j = 0
    while j < len(names):
        name = names[j]
        k = j
        while k + 1 < len(names) and names[k + 1] == name:
            k += 1
        if name is not None:
            out.append(ChunkRange(j, k, name))
        j = k + 1
    return tuple(out)


# -- the cost model's inputs -----------------------------------------------------------------------


class AttendedContext:
    """KV bytes a request reads per step (:func:`sim.model.costs.attended_tokens`) and
    the query-key pairs it computes (:func:`sim.model.costs.attention_pairs`), per
    group; reads weighted by KV bytes per token (without byte figures every group
    weighs 1 byte per token)."""

    def __init__(self, layout: Layout) -> None:
        #: per group: (kind, span tokens, KV bytes per token)
        self.terms: list[tuple[GroupKind, int, int]] = kv_terms(layout)
        #: bytes per token over all groups (divides attended bytes into
        #: full-attention token equivalents)
        self.bytes_per_token = sum(bpt for _, _, bpt in self.terms)
        #: the distinct (kind, span) of the groups: bytes per token summed, the groups' indices
        distinct: dict[tuple[GroupKind, int], tuple[int, list[int]]] = {}
        for g, (kind, span, bpt) in enumerate(self.terms):
            total, groups = distinct.get((kind, span), (0, []))
            distinct[kind, span] = (total + bpt, [*groups, g])
        self._distinct = [(kind, span, bpt, tuple(groups))
                          for (kind, span), (bpt, groups) in distinct.items()]
        #: per group, tokens per GPU block
        self.block_tokens = tuple(g.tokens_per_block for g in layout.groups)
        #: the distinct block sizes and how many groups have each
        sizes: dict[int, int] = {}
        for b in self.block_tokens:
            sizes[b] = sizes.get(b, 0) + 1
        self._block_sizes = tuple(sizes.items())

    def attended(self, c: int) -> int:
        """KV bytes one request reads with ``c`` tokens of context."""
        total = 0
        for kind, p, bpt in self.terms:
            total += attended_tokens(kind, p, c) * bpt
        return total

    def load(self, work: Sequence[tuple[int, int, bool]], loaded_blocks: int = 0) -> StepLoad:
        """The step load of ``(tokens computed before, new tokens, decodes)`` per scheduled
        request and the blocks of the step's loads: :meth:`load_reference`'s exact integers,
        one pass over the batch per distinct (kind, span) of the layout (equal groups share
        their sums)."""
        decode = sum(1 for _, _, d in work if d)
        prefill = sum(c for _, c, d in work if not d)
        blocks = 0
        if prefill:
            for b, n in self._block_sizes:   # the blocks the prompt tokens begin (cdiv inline)
                blocks += n * sum((p + c + b - 1) // b - (p + b - 1) // b for p, c, d in work if not d)
        attended = 0
        pairs = [0] * len(self.terms)
        for kind, span, bpt, groups in self._distinct:
            if kind is _FULL_KIND:
                a = sum(p + c for p, c, _ in work)
                q = sum(c * p + c * (c + 1) // 2 for p, c, _ in work if c > 0)
            elif kind is _CHUNKED_KIND:
                a = sum(p + c - ((p + c - 1) // span) * span for p, c, _ in work if p + c > 0)
                q = sum(attention_pairs(kind, span, p, c) for p, c, _ in work if c > 0)
            elif kind is _MAMBA_KIND:
                a = sum(min(p + c, span) for p, c, _ in work)
                q = sum(c for _, c, _ in work if c > 0)
            else:                                       # sliding window (a decode past the
                a = sum(min(p + c, span) for p, c, _ in work)   # window: attention_pairs' span * c)
                q = sum(span * c if p + 1 >= span else attention_pairs(kind, span, p, c)
                        for p, c, _ in work if c > 0)
            attended += a * bpt
            for g in groups:
                pairs[g] = q
        return StepLoad(prefill, decode, attended / self.bytes_per_token, len(work), attended, tuple(pairs),
                        blocks, loaded_blocks)

    def load_reference(self, work: Sequence[tuple[int, int, bool]], loaded_blocks: int = 0) -> StepLoad:
        """:meth:`load`, one request and one group at a time (the reference)."""
        prefill = decode = attended = blocks = 0
        terms = self.terms
        pairs = [0] * len(terms)
        for p, c, is_decode in work:
            if is_decode:
                decode += 1
            else:
                prefill += c
                for b in self.block_tokens:
                    blocks += prompt_blocks(b, p, c)
            for g, (kind, span, bpt) in enumerate(terms):
                attended += attended_tokens(kind, span, p + c) * bpt
                pairs[g] += attention_pairs(kind, span, p, c)
        return StepLoad(prefill, decode, attended / self.bytes_per_token, len(work), attended, tuple(pairs),
                        blocks, loaded_blocks)

    def attended_runs(self, running: Sequence[LiveRequest], k: int) -> list[int]:
        """:meth:`attended` summed over ``running`` for decode steps 0..k-1
        (context ``num_computed + 1 + s``), vectorised; exact integers."""
        return self.decode_runs(running, k)[0]

    def decode_runs(self, running: Sequence[LiveRequest], k: int) -> tuple[list[int], list[tuple[int, ...]]]:
        """For decode steps 0..k-1 of ``running`` (context ``num_computed + 1 + s``): the
        attended bytes and the pairs per group of each step, vectorised; exact integers
        equal to :meth:`load`'s."""
        c = (np.fromiter((r.num_computed + 1 for r in running), dtype=np.int64, count=len(running))[:, None]
             + np.arange(k, dtype=np.int64)[None, :])
        tot = np.zeros(k, dtype=np.int64)
        per_group = []
        n = len(running)
        for kind, p, bpt in self.terms:
            if kind is _FULL_KIND:
                a = c
            elif kind is _CHUNKED_KIND:
                a = c - ((c - 1) // p) * p
            else:
                a = np.minimum(c, p)
            sums = a.sum(axis=0)
            tot += sums * bpt
            # one decode token attends to the tokens it reads; a mamba state takes one update
            per_group.append(np.full(k, n, dtype=np.int64) if kind is _MAMBA_KIND else sums)
        pairs = [tuple(int(g[s]) for g in per_group) for s in range(k)]
        return [int(x) for x in tot], pairs


_FULL_KIND = GroupKind.FULL
_CHUNKED_KIND = GroupKind.CHUNKED_LOCAL
_MAMBA_KIND = GroupKind.MAMBA


@dataclass
class FastForward:
    """A run of ``k`` pure decode steps being applied (see :meth:`Scheduler.plan_fast_forward`)."""

    #: the step durations (the cost model's, one per step)
    durations: tuple[float, ...]
    #: the attended context of the first step, in full-attention token equivalents
    context0: float
    running: list[LiveRequest]
    nc0: list[int]
    nt0: list[int]
    #: (step, running index) of each request's next allocation, free or commit
    heap: list[tuple[int, int]]
    new_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    #: copy path: tokens written so far, per request
    written: list[int] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.durations)


def admission_caps(layout: Layout, max_batched: int) -> tuple[int | None, ...]:
    """Per group, the most blocks one request holds at once (None: no bound, full attention):
    a sliding window keeps its window (and ``extra_retained_tokens``) plus one step's tokens
    and a partial block, a chunked-local group its chunk plus one step's tokens. vLLM sizes
    ``max_model_len`` and caps its full-input admission check with the same bounds."""
    caps: list[int | None] = []
    for g in layout.groups:
        bs = g.tokens_per_block
        if g.kind is GroupKind.SLIDING_WINDOW and g.window is not None:
            caps.append(cdiv(g.window - 1 + g.extra_retained_tokens + max_batched, bs) + 1)
        elif g.kind is GroupKind.CHUNKED_LOCAL and g.attention_chunk is not None:
            caps.append(cdiv(g.attention_chunk + max_batched, bs))
        else:
            caps.append(None)
    return tuple(caps)


def lookup_assertion(layout: Layout) -> str | None:
    """The assertion vLLM 0.29-0.33 raise at every local prefix-cache lookup of this
    layout (None: none): with more than one group and no Mamba group, their hybrid
    coordinator aligns a hit to the groups' least common block size and asks every group
    for its hit, and the chunked-local finder asserts that its block size is that
    alignment. And the chunked-local finder refuses to drop an EAGLE block, so a
    chunked-local group looked up as EAGLE (:attr:`~sim.model.layout.Layout.eagle_hit`)
    asserts in any layout. Only with prefix caching (without it nothing is looked up)."""
    for g, spec in enumerate(layout.groups):
        if spec.kind is GroupKind.CHUNKED_LOCAL and layout.eagle_hit[g]:
            return (f"group {g}: chunked local attention looked up as an EAGLE group (vLLM's hybrid "
                    "KV cache does not support EAGLE with chunked local attention)")
    align = layout.gpu_cache_align
    if align is None:
        return None
    for g, spec in enumerate(layout.groups):
        if spec.kind is GroupKind.CHUNKED_LOCAL and spec.tokens_per_block != align:
            return (f"group {g}: chunked local attention with {spec.tokens_per_block}-token blocks in a "
                    f"layout aligned to {align} tokens (KV cache groups with different block sizes are "
                    "not compatible with chunked local attention)")
    return None


def reject_too_long(r: LiveRequest, limit: int, now: float, hooks: SchedulerHooks) -> bool:
    """vLLM's refusal on arrival: when ``r``'s prompt and output tokens exceed ``limit``
    (:func:`max_model_len`), mark it rejected at ``now`` with a ``too_long`` event and
    return True (kvsim's model and its driver of vLLM both call this)."""
    req = r.req
    total = req.prompt_tokens + req.output_tokens
    if total <= limit:
        return False
    r.status = _REJECTED
    r.finish_s = now
    hooks.event(ModelEvent(now, "rejected", "too_long", r.req_id, -1, -1,
                           f"{req.prompt_tokens} prompt and {req.output_tokens} output tokens: {total} "
                           f"exceed max_model_len {limit} (the longest request the GPU block pool holds)"))
    return True


#: the longest request any layout admits (2**24 tokens: a layout without full attention
#: holds requests of any length; the model config kvsim gives vLLM allows as many positions)
MAX_POSITIONS = 1 << 24


def max_model_len(layout: Layout, gpu_blocks: int, max_batched: int, *, prefix_caching: bool) -> int:
    """The longest request (prompt and output tokens) one block pool holds: every group's
    worst case (its admission cap, :func:`admission_caps`; a Mamba group a state block per
    block with prefix caching, vLLM's ``mamba_cache_mode = "all"``, else one), as vLLM
    checks ``max_model_len`` against its KV cache at start-up, and at most
    :data:`MAX_POSITIONS`. Longer requests are rejected on arrival."""
    usable = gpu_blocks - 1  # the null block
    caps = admission_caps(layout, max_batched)
    groups = layout.groups

    def need(n: int) -> int:
        total = 0
        for g, cap in zip(groups, caps, strict=True):
            blocks = cdiv(n, g.tokens_per_block)
            if g.kind is GroupKind.MAMBA:
                total += blocks if prefix_caching else 1
            else:
                total += blocks if cap is None else min(blocks, cap)
        return total

    lo, hi = 0, MAX_POSITIONS
    while lo < hi:  # the largest n with need(n) <= usable
        mid = (lo + hi + 1) // 2
        if need(mid) <= usable:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Scheduler:
    """The clock-free scheduler of one engine (see the module docstring).

    Args:
        cfg: policy, caches and cost model.
        hooks: what the engine wants to see (default: nothing).
        future: the workload's chunk uses; required by the ``belady`` eviction
            policy (:mod:`sim.model.future`), whose uses the scheduler consumes
            at a request's first definite lookup answer and at its release.

    Raises:
        ValueError: the ``belady`` policy without ``future``.
    """

    def __init__(self, cfg: SchedulerConfig, hooks: SchedulerHooks | None = None,
                 future: FutureUses | None = None) -> None:
        self.cfg = cfg
        #: consumed uses of the belady oracle (None for every other policy)
        self.future = future if cfg.needs_future else None
        self.hooks = hooks or SchedulerHooks()
        layout = cfg.layout
        self.layout = layout
        self.tph = layout.tokens_per_hash
        #: one of two implementations of one interface (fast: ids, reference: Block objects),
        #: differentially tested in tests/model/test_gpu_fast.py; typed loosely for that reason
        self.gpu: Any = GPU_CACHES[cfg.block_accounting](layout, cfg.gpu_blocks,
                                                         enable_caching=cfg.prefix_caching)
        #: ``(slots, computed)`` below which a request's allocate/commit calls change
        #: nothing (the fast cache's bounds are tighter: fewer calls, same decisions)
        self._thresholds: Callable[[str], tuple[int, int]] = (
            self.gpu.quiet_thresholds if isinstance(self.gpu, GpuFastCache) else self.gpu.thresholds)
        self.cpu: CpuChunkCache | None = None
        self.conn: OffloadingScheduler | None = None
        if cfg.offloading:
            prof = profile(cfg.window_logic)
            scoped, last_resort = prof.request_scoped_recency, prof.arc_t1_last_resort
            if cfg.tiers:
                self.cpu = TieredCache(cfg.cpu_capacity_chunks, cfg.eviction, future=self.future,
                                       tiers=cfg.tiers, request_scoped=scoped, arc_t1_last_resort=last_resort)
            else:
                self.cpu = CpuChunkCache(cfg.cpu_capacity_chunks, cfg.eviction, future=self.future,
                                         request_scoped=scoped, arc_t1_last_resort=last_resort)
            self.conn = OffloadingScheduler(layout, self.cpu, profile(cfg.window_logic),
                                            prefix_caching=cfg.prefix_caching,
                                            offload_prompt_only=cfg.offload_prompt_only,
                                            assertions=cfg.assertions)
        self.block_bytes = tuple(layout.kv_bytes_per_block(g) or 0 for g in range(len(layout.groups)))
        #: copies per GPU block of each group (:func:`sim.model.costs.pieces_per_block`)
        self.block_pieces = tuple(pieces_per_block(g, cfg.transfer_piece) for g in layout.groups)
        self.context = AttendedContext(layout)
        self.stats = SchedulerStats()
        #: requests in the engine (not finished, or finished with final stores to build), by arrival
        self.requests: dict[str, LiveRequest] = {}
        self.running: list[LiveRequest] = []
        self.waiting: deque[LiveRequest] = deque()
        #: requests skipped (deferred, or waiting for their load): in front of ``waiting``;
        #: under vLLM 0.33 only those that hold KV blocks (the others go back to ``waiting``)
        self.skipped: deque[LiveRequest] = deque()
        self._requeue_without_kv = profile(cfg.window_logic).requeues_skipped_without_kv
        #: an EAGLE group's lookup may look past the hit limit, up to the hashed tokens (0.33)
        self._eagle_past_limit = profile(cfg.window_logic).eagle_margin_past_limit
        #: finished in the last update: their final stores come with the next step
        self.finished_pending: list[LiveRequest] = []
        #: jobs of the plans handed out and not yet reported complete
        self.in_flight: set[int] = set()
        #: a modelled crash stopped the run (``on_crash = "stop"``)
        self.stopped = False
        #: snapshots of modelled crashes and hazards (the first ``max_reproducers``)
        self.reproducers: list[ReproducerSnapshot] = []
        self.max_reproducers = 100
        self.now = 0.0
        self._broke_deadlock = False
        self._loads_this_step = 0
        #: (request, local hit tokens, external tokens (None: deferred), load async) of each
        #: connector lookup, appended while it is a list (the differential mode reads and
        #: clears it every step; None: not kept)
        self.lookup_log: list[tuple[str, int, int | None, bool]] | None = None
        #: (request, time): snapshot that request's lookup at that time as a reproducer
        #: (the differential mode's check/1 file of a diverging lookup; None: none)
        self.snapshot_lookup: tuple[str, float] | None = None
        #: per group, the most blocks one request is required to hold (vLLM's admission cap)
        self._reserve_caps = admission_caps(layout, cfg.max_num_batched_tokens)
        #: the longest request (prompt and output tokens) admitted: longer ones are rejected on arrival
        self.max_model_len = max_model_len(layout, cfg.gpu_blocks, cfg.max_num_batched_tokens,
                                           prefix_caching=cfg.prefix_caching)
        #: vLLM asserts at every local prefix-cache lookup of this layout (None: it does not)
        self._lookup_assert = lookup_assertion(layout) if cfg.prefix_caching else None
        #: a Mamba group (-1: none, or no prefix caching) and the hashes of the state blocks
        #: committed in this step: vLLM's Mamba manager does not let a new request build on
        #: one of those (``cached_blocks_this_step``; :meth:`_allocate_new`)
        mamba = [g for g, spec in enumerate(layout.groups) if spec.kind is GroupKind.MAMBA]
        self._mamba_group = mamba[0] if mamba and cfg.prefix_caching else -1
        self._mamba_bs = layout.groups[mamba[0]].tokens_per_block if mamba else 1
        self._mamba_hpb = self._mamba_bs // layout.tokens_per_hash
        self._mamba_now: set[int] = set()
        #: the same caps for the full-input admission check (None: off)
        self.admit_caps = self._reserve_caps if cfg.reserve_full_isl else None
        #: vLLM's in-flight prefills (``Scheduler._inflight_prefills``): requests admitted with an
        #: asynchronous load, or admitted and still prefilling after the step; what they still
        #: need for their whole sequence is held back from an admission with an async load
        self._inflight: dict[str, LiveRequest] = {}

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, req: Request, now: float | None = None) -> LiveRequest:
        """A request reaches the scheduler at ``now`` (default: the last step's time): it
        joins the waiting queue, or is rejected at once (status ``REJECTED``, an event) when
        its prompt and output tokens exceed :attr:`max_model_len`, as vLLM refuses a request
        longer than its ``max_model_len``; the caller writes its row."""
        r = LiveRequest(req, self.tph)
        self.stats.requests_arrived += 1
        self.stats.prompt_tokens += r.num_prompt_tokens
        if reject_too_long(r, self.max_model_len, self.now if now is None else now, self.hooks):
            self._consume_use(r)
            return r
        self.requests[r.req_id] = r
        self.waiting.append(r)
        if self.conn is not None:
            self.conn.on_new_request(r)
        return r

    @property
    def num_waiting(self) -> int:
        """Requests waiting (for admission or for their load)."""
        return len(self.waiting) + len(self.skipped)

    @property
    def num_waiting_for_kv(self) -> int:
        return sum(1 for r in self.skipped if r.status is _WAITING_FOR_KV)

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        """Decide one step (phases 1-3 of the module docstring)."""
        self.now = now
        budget = self.cfg.max_num_batched_tokens
        self._broke_deadlock = False
        self._loads_this_step = 0
        if self._mamba_now:
            self._mamba_now.clear()
        sched: list[Scheduled] = []
        preempted: list[LiveRequest] = []
        allocated: set[int] = set()
        budget = self._schedule_running(budget, sched, preempted, allocated)
        loads: list[LoadPlan] = []
        admitted: list[LiveRequest] = []
        if not preempted:
            self._schedule_waiting(budget, sched, loads, admitted, allocated)
        if self.stopped:
            return StepPlan(stopped=True)
        if self.conn is not None:
            # vLLM's connector counts every block of an admitted request as allocated this
            # step, its prefix-cache hits included (the whole block table of a newly
            # scheduled request; every block handed to update_state_after_alloc)
            gpu = self.gpu
            for r in admitted:
                if r.req_id in gpu.req_blocks:
                    for ids in gpu.block_ids(r.req_id):
                        allocated.update(ids)
            allocated.discard(NULL_BLOCK_ID)
        flush, stores = self._connector_metadata(sched, preempted, allocated)
        store_jobs = tuple(self._job(p, "d2h") for p in stores)
        released = bool(self.finished_pending)
        for r in self.finished_pending:
            self._release(r)
        self.finished_pending = []
        load_jobs = tuple(self._job(p, "h2d") for p in loads)
        inflight = self._inflight
        if inflight:   # vLLM drops a request from its in-flight prefills once a step completes its input
            for r, num_new, _ in sched:
                if r.num_computed + num_new >= r.num_tokens:
                    inflight.pop(r.req_id, None)
        load = self.context.load([(r.num_computed, num_new, r.num_computed >= r.num_prompt_tokens
                                   and r.num_computed == r.num_tokens - 1) for r, num_new, _ in sched],
                                 sum(j.blocks for j in load_jobs))
        return StepPlan(tuple(sched), tuple(admitted), tuple(preempted), load_jobs, store_jobs,
                        frozenset(flush), released, self._broke_deadlock, load)

    def _schedule_running(self, budget: int, sched: list[Scheduled], preempted: list[LiveRequest],
                          allocated: set[int]) -> int:
        """Phase 1: slots for the running requests, in order; the budget left."""
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            num_new = min(r.num_tokens - r.num_computed, budget)
            if r.num_computed + num_new < r.thr_slots and r.num_computed < r.thr_comp:
                sched.append((r, num_new, None))     # nothing to allocate, free or commit
                budget -= num_new
                i += 1
                continue
            ids = self._allocate_or_preempt(r, num_new, preempted)
            if ids is None:
                break
            self._commit(r, r.num_computed + num_new)
            r.thr_slots, r.thr_comp = self._thresholds(r.req_id)
            for new in ids:
                allocated.update(new)
            sched.append((r, num_new, ids))
            budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(self, r: LiveRequest, num_new: int,
                             preempted: list[LiveRequest]) -> BlockIds | None:
        """Slots for ``r``'s next tokens, preempting from the end of the batch
        while the pool is short; None when ``r`` itself went (preempted or
        rejected)."""
        gpu, running = self.gpu, self.running
        while True:
            ids: tuple[tuple[int, ...], ...] | None = gpu.allocate_more(r.req_id, r.num_computed,
                                                                        r.num_computed + num_new)
            if ids is not None:
                return ids
            victim = running.pop()
            if victim is r and not running and len(gpu.req_blocks) == 1 and not self.in_flight:
                # alone with the whole pool and still short: it never fits
                gpu.free(r.req_id)
                self._reject(r, f"its next prefill chunk does not fit in the GPU block pool "
                                f"({self.cfg.gpu_blocks} blocks) even alone")
                self._broke_deadlock = True
                return None
            self._preempt(victim)
            preempted.append(victim)
            if victim is r:
                return None

    def _schedule_waiting(self, budget: int, sched: list[Scheduled], loads: list[LoadPlan],
                          admitted: list[LiveRequest], allocated: set[int]) -> None:
        """Phase 2: admit waiting requests, FCFS, the skipped ones first."""
        step_skipped: deque[LiveRequest] = deque()
        running = self.running
        while (self.skipped or self.waiting) and budget > 0:
            if len(running) >= self.cfg.max_num_seqs:
                break
            q = self.skipped if self.skipped else self.waiting
            r = q[0]
            if r.status is _WAITING_FOR_KV:
                if not r.load_ready:
                    q.popleft()
                    step_skipped.appendleft(r)
                    continue
                self._promote(r)
            res = self._admit(r, budget, allocated)
            outcome = res.outcome
            if outcome is AdmitOutcome.DEFER:     # lookup deferred: skip, retry next step
                q.popleft()
                step_skipped.appendleft(r)
                continue
            if outcome is AdmitOutcome.REJECTED:
                q.popleft()
                continue
            if outcome is AdmitOutcome.FULL:      # no room (or stop): stop admitting
                break
            q.popleft()
            admitted.append(r)
            if r.scheduled_s is None:
                r.scheduled_s = self.now
            if res.load is not None:
                loads.append(res.load)
                self._loads_this_step += 1
                step_skipped.appendleft(r)
                continue
            r.status = _RUNNING
            running.append(r)
            sched.append((r, res.num_new_tokens, res.new_block_ids))
            budget -= res.num_new_tokens
        if self._requeue_without_kv:
            # vLLM 0.33: kv_holding_waiting keeps those that hold blocks; the others go back
            # to the front of waiting, in the order they were skipped
            holding: deque[LiveRequest] = deque()
            bare: deque[LiveRequest] = deque()
            for r in step_skipped:
                (holding if r.status is _WAITING_FOR_KV or r.num_computed > 0 else bare).append(r)
            self.skipped.extendleft(holding)
            self.waiting.extendleft(bare)
        else:
            self.skipped.extendleft(step_skipped)

    def _admit(self, r: LiveRequest, budget: int, allocated: set[int]) -> Admission:
        """Try to admit the waiting request at the head of the queue."""
        conn = self.conn
        if r.num_computed > 0:        # promoted after its load
            return self._admit_loaded(r, budget, allocated)
        hit = self._local_hit(r)
        if hit is None:
            return _FULL
        local_tokens, local = hit
        ext = 0
        load_async = False
        if conn is not None and not r.no_external:
            m = conn.get_num_new_matched_tokens(r, local_tokens)
            self._log_lookup(r, local_tokens, m.tokens, m.load_async)
            if m.tokens is None:
                self._count_deferral(r, m.defer_reason or "unknown")
                return _DEFER
            ext, load_async = m.tokens, m.load_async
            self._consume_use(r)
        self._end_deferral(r)
        comp = local_tokens + ext
        num_new = 0 if load_async else min(r.num_tokens - comp, budget)
        reserved = self._inflight_reserved() if load_async else 0
        alloc = self._allocate_new(r, local, local_tokens, ext, comp + num_new, reserved)
        if alloc is None:
            return self._no_room(r)
        load: LoadPlan | None = None
        if conn is not None:
            try:
                load = conn.update_state_after_alloc(r, alloc.blocks, ext, alloc.null_prefix)
            except ModelledCrashError as exc:
                retry = self._after_crash(r, exc, local, local_tokens, budget)
                if retry is None:
                    return _FULL
                alloc = retry
                ext, comp = 0, local_tokens
                num_new = min(r.num_tokens - comp, budget)
            if load is not None:
                self._record_hazards(r, load, local_tokens)
        for new in alloc.new_block_ids:
            allocated.update(new)
        if r.preemptions == 0 and r.scheduled_s is None:
            r.gpu_hit_tokens = local_tokens
            self.stats.gpu_hit_tokens += local_tokens
        r.synced = False
        r.num_computed = comp
        if load is not None:
            self._wait_for_load(r, load, ext)
            return Admission(AdmitOutcome.ADMITTED, 0, None, load)
        self._track_prefill(r, comp + num_new)
        self._commit(r, comp + num_new)
        r.thr_slots, r.thr_comp = self._thresholds(r.req_id)
        return Admission(AdmitOutcome.ADMITTED, num_new, None, None)

    def _end_deferral(self, r: LiveRequest) -> None:
        """The lookup answered: the time ``r`` spent deferred ends (if it was)."""
        if r.deferred_since is not None:
            r.deferred_s += self.now - r.deferred_since
            r.deferred_since = None

    def _local_hit(self, r: LiveRequest) -> tuple[int, Any] | None:
        """``r``'s local prefix-cache hit (tokens, per-group blocks). Where vLLM asserts at
        this layout's lookup (:func:`lookup_assertion`) that is a modelled crash, recorded at
        a request's first lookup: the run stops there (None, ``on_crash = "stop"``) or the
        request goes on without a local hit."""
        msg = self._lookup_assert
        hit: tuple[int, Any]
        if msg is None:
            limit = r.num_tokens - 1
            hit = self.gpu.find_hit(r.block_hashes, limit,
                                    len(r.block_hashes) * self.tph if self._eagle_past_limit else limit)
            return hit
        if r.crash is None:
            self._record_crash(r, ModelledCrashError(ModelledCrash(
                "assertion", None, None, msg, "vLLM kv_cache_coordinator: find_longest_cache_hit")))
            if self.cfg.on_crash == "stop":
                self.stopped = True
                return None
        hit = self.gpu.find_hit(r.block_hashes, 0)
        return hit

    def _log_lookup(self, r: LiveRequest, local_tokens: int, ext: int | None, load_async: bool) -> None:
        """The differential mode's record of a lookup (and its snapshot, when asked for)."""
        if self.lookup_log is None:
            return
        self.lookup_log.append((r.req_id, local_tokens, ext, load_async))
        if self.snapshot_lookup == (r.req_id, self.now):  # what the lookup met (not changed by it)
            self._reproduce(r, local_tokens, "divergence", "lookup", (), ())

    def _allocate_new(self, r: LiveRequest, local: Any, local_tokens: int, ext: int,
                      num_slots: int, reserved: int = 0) -> Allocation | None:
        """The first allocation of ``r``; None when the pool cannot take it now, including
        when blocks for its whole input would not fit (vLLM's full-input reservation), or
        when its slots do not fit beside ``reserved`` blocks held back for in-flight
        prefills (an admission with an asynchronous load)."""
        gpu = self.gpu
        if self._mamba_now and local_tokens >= self._mamba_bs and \
                r.block_hashes[local_tokens // self._mamba_bs * self._mamba_hpb - 1] in self._mamba_now:
            # the hit ends on a Mamba state block committed in this step: vLLM's Mamba manager
            # asks for more blocks than the pool has (``cached_blocks_this_step``), so not now
            return None
        caps = self.admit_caps
        if caps is not None and gpu.blocks_needed(local, local_tokens, ext, r.num_tokens,
                                                  caps) > gpu.pool.num_free:
            return None
        if reserved and gpu.blocks_needed(local, local_tokens, ext, num_slots) > gpu.pool.num_free - reserved:
            return None
        alloc: Allocation | None = gpu.allocate_new(r.req_id, local, local_tokens, ext, num_slots)
        return alloc

    def _inflight_reserved(self) -> int:
        """Blocks the in-flight prefills still need for their whole sequence, each
        sliding-window or chunked-local group at its admission cap (vLLM's
        ``_inflight_prefill_reserved_blocks``)."""
        gpu, caps = self.gpu, self._reserve_caps
        return sum(gpu.more_blocks_needed(q.req_id, q.num_tokens, caps) for q in self._inflight.values())

    def _admit_loaded(self, r: LiveRequest, budget: int, allocated: set[int]) -> Admission:
        """Admit a request whose load completed (its blocks are allocated)."""
        gpu = self.gpu
        num_new = min(r.num_tokens - r.num_computed, budget)
        if self.admit_caps is not None and \
                gpu.more_blocks_needed(r.req_id, r.num_tokens, self.admit_caps) > gpu.pool.num_free:
            return self._no_room(r)
        ids = gpu.allocate_more(r.req_id, r.num_computed, r.num_computed + num_new)
        if ids is None:
            return self._no_room(r)
        self._commit(r, r.num_computed + num_new)
        r.thr_slots, r.thr_comp = self._thresholds(r.req_id)
        for new in ids:
            allocated.update(new)
        return Admission(AdmitOutcome.ADMITTED, num_new, ids, None)

    def _count_deferral(self, r: LiveRequest, why: str) -> None:
        r.deferrals += 1
        reasons = r.deferral_reasons
        if reasons is None:
            reasons = r.deferral_reasons = {}
        reasons[why] = reasons.get(why, 0) + 1
        if r.deferred_since is None:
            r.deferred_since = self.now
        s = self.stats
        s.deferrals += 1
        s.deferral_reasons[why] = s.deferral_reasons.get(why, 0) + 1

    def _after_crash(self, r: LiveRequest, exc: ModelledCrashError, local: Sequence[Sequence[Block]],
                     local_tokens: int, budget: int) -> Allocation | None:
        """A modelled crash in ``update_state_after_alloc``: record it; stop the
        run, or drop the request's external hit for good and allocate again
        (None: stop admitting)."""
        conn = self.conn
        assert conn is not None
        self._record_crash(r, exc)
        self._reproduce(r, local_tokens, "crash", exc.crash.kind, (), ())
        self.gpu.free(r.req_id)
        if self.cfg.on_crash == "stop":
            self.stopped = True
            return None
        r.no_external = True
        num_new = min(r.num_tokens - local_tokens, budget)
        alloc: Allocation | None = self.gpu.allocate_new(r.req_id, local, local_tokens, 0,
                                                         local_tokens + num_new)
        if alloc is None:
            return None
        conn.update_state_after_alloc(r, alloc.blocks, 0, alloc.null_prefix)
        return alloc

    def _record_hazards(self, r: LiveRequest, load: LoadPlan, local_tokens: int) -> None:
        s = self.stats
        for h in load.hazards:
            what = ("is already being loaded" if h.kind == "double_load"
                    else "is read before its store completed (assertions stripped)")
            self._event("hazard", h.kind, r.req_id, h.group, h.chunk, f"chunk ({h.group}, {h.chunk}) {what}")
            s.hazards += 1
            s.hazard_kinds[h.kind] = s.hazard_kinds.get(h.kind, 0) + 1
        if load.hazards:
            self._reproduce(r, local_tokens, "hazard", load.hazards[0].kind, load.keys, load.unsafe)

    def _track_prefill(self, r: LiveRequest, tokens_after_step: int) -> None:
        """An admitted request that will still be prefilling after this step is an
        in-flight prefill (vLLM's ``_inflight_prefills``)."""
        if tokens_after_step < r.num_tokens:
            self._inflight[r.req_id] = r

    def _wait_for_load(self, r: LiveRequest, load: LoadPlan, ext: int) -> None:
        """``r`` waits for its load of ``ext`` tokens (vLLM WAITING_FOR_REMOTE_KVS); it is
        an in-flight prefill until a step completes its input."""
        self._inflight[r.req_id] = r
        r.status = _WAITING_FOR_KV
        r.load_job = load.job_id
        r.load_ready = False
        s = self.stats
        if r.preemptions == 0:
            r.cpu_hit_tokens += ext
            s.cpu_hit_tokens += ext
            if isinstance(self.cpu, TieredCache):
                self.cpu.attribute_hit(ext)     # resident or promoted (summary: tiers)
        else:
            r.cpu_reload_tokens += ext
            s.cpu_reload_tokens += ext

    def _no_room(self, r: LiveRequest) -> Admission:
        """The GPU pool cannot take ``r`` now. Admission stops (FCFS: vLLM's
        ``break`` when ``allocate_slots`` returns None) while anything runs or a
        transfer is in flight, whose end frees or promotes blocks; no request behind
        ``r`` is looked up this step. With nothing running and nothing in flight no
        room would ever come that way: reject ``r`` if it holds the pool alone;
        else other waiting requests (loaded, or partly prefilled) hold blocks
        that nothing frees: preempt them all and stop admitting this step, so
        that ``r`` has the pool to itself next step (deadlock breaker: vLLM
        avoids most of these states with its admission reservation for async
        loads, which kvsim models too, and has no such breaker)."""
        if self.running or self.in_flight or self._loads_this_step:
            return _FULL
        gpu = self.gpu
        if all(rid == r.req_id for rid in gpu.req_blocks):
            if r.req_id in gpu.req_blocks:
                gpu.free(r.req_id)
            self._reject(r, f"does not fit in the GPU block pool ({self.cfg.gpu_blocks} blocks)")
            return _REJECT
        for v in [q for q in self.requests.values() if q is not r and q.req_id in gpu.req_blocks
                  and (q.status is not _WAITING_FOR_KV or q.load_ready)]:
            gpu.free(v.req_id)
            self._inflight.pop(v.req_id, None)
            v.num_computed = 0
            v.status = _WAITING
            v.load_job = None
            v.load_ready = False
            v.preemptions += 1
            self.stats.preemptions += 1
            self._event("preempted", "deadlock_break", v.req_id, -1, -1,
                        f"a waiting request held GPU blocks while {r.req_id} could not get room "
                        "and nothing was running")
        self._broke_deadlock = True
        return _FULL

    def _promote(self, r: LiveRequest) -> None:
        """A loaded request leaves WAITING_FOR_KV (spec §9 1.b)."""
        self._commit(r, r.num_computed)
        if r.num_computed == r.num_tokens:
            r.num_computed -= 1
        r.status = _WAITING
        r.load_job = None
        r.load_ready = False
        r.high_water = max(r.high_water, r.num_computed)
        if self.hooks.promoted is not None:
            self.hooks.promoted(r)

    def _commit(self, r: LiveRequest, num_tokens: int) -> None:
        if self.cfg.prefix_caching:
            n = min(num_tokens, r.num_tokens)
            mg = self._mamba_group
            if mg >= 0:   # note the Mamba state blocks this commit hashes (vLLM: cached this step)
                gpu = self.gpu
                fresh = gpu.unhashed(r.req_id, mg, n)
                gpu.commit(r.req_id, r.block_hashes, n)
                if fresh:
                    left = set(gpu.unhashed(r.req_id, mg, n))
                    hpb, hs = self._mamba_hpb, r.block_hashes
                    self._mamba_now.update(hs[(i + 1) * hpb - 1] for i in fresh if i not in left)
                return
            # the fast cache takes the sequence's hashes uncut (no copy of the known prefix)
            gpu = self.gpu
            gpu.commit(r.req_id, r.full_hashes if isinstance(gpu, GpuFastCache) else r.block_hashes, n)

    def _preempt(self, r: LiveRequest) -> None:
        """Recompute preemption: blocks freed, back to the front of the waiting queue."""
        self.gpu.free(r.req_id)
        self._inflight.pop(r.req_id, None)
        r.num_computed = 0
        r.status = _WAITING
        r.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(r)

    def _connector_metadata(self, sched: list[Scheduled], preempted: list[LiveRequest],
                            allocated: set[int]) -> tuple[set[int], list[StorePlan]]:
        """Phase 3: block ids, zeroing, flush fences, store jobs (spec §7.6)."""
        flush: set[int] = set()
        stores: list[StorePlan] = []
        conn = self.conn
        if conn is None:
            return flush, stores
        conn.zero_reallocated(allocated)
        self._sync_block_ids(conn, sched)
        for r in preempted:
            flush |= conn.store_jobs_of(r.req_id)
        if allocated and conn.block_fences:
            flush |= conn.stores_reading(allocated)
        for r, num_new, _ in sched:
            plan = conn.build_store_job(r.req_id, r.num_computed + num_new)
            if plan is not None:
                stores.append(plan)
        for r in self.finished_pending:
            if conn.has_request(r.req_id):
                plan = conn.build_store_job(r.req_id, None, allocated)
                if plan is not None:
                    stores.append(plan)
                    if plan.flush_now:
                        flush.add(plan.job_id)
                conn.drop_if_idle(r.req_id)
        for r in self.finished_pending:     # after every store job of the step, as in vLLM 0.33
            conn.finish_recency(r.req_id)
        return flush, stores

    def _sync_block_ids(self, conn: OffloadingScheduler, sched: list[Scheduled]) -> None:
        for r, _, ids in sched:
            if not r.synced:
                conn.update_block_ids(r.req_id, self.gpu.block_ids(r.req_id))
                r.synced = True
            elif ids is not None:
                conn.update_block_ids(r.req_id, ids)

    def _job(self, p: LoadPlan | StorePlan, direction: Literal["h2d", "d2h"]) -> TransferJob:
        """A transfer job for a plan; its bytes count for the request and the run."""
        sizes = p.group_sizes
        blocks = sum(sizes)
        nbytes = sum(n * b for n, b in zip(sizes, self.block_bytes, strict=True))
        self.in_flight.add(p.job_id)
        r = self.requests[p.req_id]
        s = self.stats
        if direction == "h2d":
            r.loaded_bytes += nbytes
            r.load_jobs += 1
            s.load_jobs += 1
            s.loaded_bytes += nbytes
        else:
            r.stored_bytes += nbytes
            r.store_jobs += 1
            s.store_jobs += 1
            s.stored_bytes += nbytes
        pieces = sum(n * k for n, k in zip(sizes, self.block_pieces, strict=True))
        return TransferJob(p.job_id, p.req_id, direction, len(p.keys), blocks, nbytes, p, pieces)

    # -- output -----------------------------------------------------------------------------

    def update_from_output(self, now: float, plan: StepPlan,
                           completed: Sequence[LoadPlan | StorePlan]) -> StepOutput:
        """The forward pass of ``plan`` ran; ``completed``: the transfer jobs
        completed by now, in completion order (phase 4 of the module docstring)."""
        self.now = now
        computed = self.hooks.computed
        if computed is not None:
            for r, num_new, _ in plan.scheduled:
                computed(r, r.num_computed, r.num_computed + num_new)
        for r, num_new, _ in plan.scheduled:
            self._advance(r, num_new)
        finished: list[LiveRequest] = []
        for r, _, _ in plan.scheduled:
            if r.status is _RUNNING and r.generated >= r.req.output_tokens:
                self._finish(r)
                finished.append(r)
        return StepOutput(tuple(finished), self.apply_transfers(completed))

    def _advance(self, r: LiveRequest, num_new: int) -> None:
        """Tokens computed by the forward pass; sample when the sequence is complete."""
        a = r.num_computed
        b = a + num_new
        if a < r.num_prompt_tokens or b < r.num_tokens:   # prefill work
            redo = max(0, min(b, r.high_water) - a)
            r.recomputed_tokens += redo
            r.computed_tokens += num_new
            self.stats.computed_tokens += num_new
            self.stats.recomputed_tokens += redo
        r.high_water = max(r.high_water, b)
        r.num_computed = b
        if b >= r.num_tokens:
            r.generated += 1
            r.num_tokens += 1
            if r.generated == 1 and r.first_token_s is None:
                r.first_token_s = self.now

    def _finish(self, r: LiveRequest) -> None:
        """A stop condition: the request leaves the batch; its blocks are freed
        now, its final stores come with the next step (then it is released).
        With offloading, the window blocks it no longer attends over are freed
        first, on their own (vLLM's ``_connector_finished`` calls
        ``remove_skipped_blocks`` before the connector sees the request): they
        reach the head of the free queue before the rest of its blocks."""
        self.running.remove(r)
        self._inflight.pop(r.req_id, None)
        r.status = _FINISHED
        r.finish_s = self.now
        if self.conn is not None:
            self.gpu.remove_skipped(r.req_id, r.num_computed)
        if self.conn is not None and self.conn.has_request(r.req_id):
            self.conn.request_finished(r.req_id)
            self.finished_pending.append(r)
            self.gpu.free(r.req_id)
        else:
            self.gpu.free(r.req_id)
            self._release(r)

    def apply_transfers(self, completed: Sequence[LoadPlan | StorePlan]) -> int:
        """Transfer jobs completed, in completion order: the connector updates
        the CPU cache; a loaded request is marked ready. Returns how many."""
        if not completed:
            return 0
        conn = self.conn
        assert conn is not None
        load_done = self.hooks.load_done
        for p in completed:
            self.in_flight.discard(p.job_id)
            req_id, is_store = conn.complete_job(p.job_id)
            if not is_store:
                r = self.requests.get(req_id)
                if r is not None and r.load_job == p.job_id:
                    r.load_ready = True
                    if load_done is not None and isinstance(p, LoadPlan):
                        load_done(r, p)
        return len(completed)

    # -- leaving ----------------------------------------------------------------------------

    def _reject(self, r: LiveRequest, reason: str) -> None:
        self._inflight.pop(r.req_id, None)
        r.status = _REJECTED
        r.finish_s = self.now
        self._event("rejected", "too_long", r.req_id, -1, -1,
                    f"{r.num_prompt_tokens} prompt tokens: {reason}")
        if self.conn is not None and self.conn.has_request(r.req_id):
            self.conn.request_finished(r.req_id)
            self.conn.finish_recency(r.req_id)
            self.conn.drop_if_idle(r.req_id)
        self._release(r)

    def _consume_use(self, r: LiveRequest) -> None:
        """The belady oracle: ``r``'s use of its chunks is over (a definite
        lookup answer, or it left the engine)."""
        if self.future is not None:
            self.future.consume(r.req_id)

    def _release(self, r: LiveRequest) -> None:
        """The request is done with the engine."""
        del self.requests[r.req_id]
        self._consume_use(r)
        if self.hooks.release is not None:
            self.hooks.release(r)

    # -- events and reproducers -------------------------------------------------------------

    def _event(self, kind: str, detail: str, req_id: str | None, group: int, chunk: int,
               message: str) -> None:
        self.hooks.event(ModelEvent(self.now, kind, detail, req_id, group, chunk, message))

    def _record_crash(self, r: LiveRequest, exc: ModelledCrashError) -> None:
        c = exc.crash
        r.crash = c.kind
        s = self.stats
        s.crashes += 1
        s.crash_kinds[c.kind] = s.crash_kinds.get(c.kind, 0) + 1
        if s.first_crash_s is None:
            s.first_crash_s = self.now
        self._event("crash", c.kind, r.req_id, -1 if c.group is None else c.group,
                    -1 if c.chunk is None else c.chunk, f"{c.where}: {c.message}")

    def _reproduce(self, r: LiveRequest, local_tokens: int, kind: str, detail: str,
                   own_load: Sequence[object], unsafe: Sequence[object]) -> None:
        """Snapshot what the request met (a reproducer): the layout, its length,
        its local hit and the states of its chunks (before its own load pinned
        them)."""
        conn, cpu = self.conn, self.cpu
        if conn is None or cpu is None or len(self.reproducers) >= self.max_reproducers:
            return
        own = set(own_load) - set(unsafe)
        groups = range(len(self.layout.groups))
        states: list[tuple[int, tuple[ChunkRange, ...]]] = []
        for g in groups:
            names: list[str | None] = []
            for key in conn.keys_of(r.req_id, g):
                st = cpu.state(key)
                if key in own:   # pinned by this request's own load: as it was before
                    ref = cpu.ref_count(key) or 0
                    st = ChunkState.LOADING if ref > 1 else ChunkState.READY
                names.append(_STATE_NAMES.get(st))
            ranges = _ranges(names)
            if ranges:
                states.append((g, ranges))
        capacity = max(100, 4 * sum(len(conn.keys_of(r.req_id, g)) for g in groups))
        self.reproducers.append(ReproducerSnapshot(
            r.req_id, self.now, kind, detail, self.cfg.window_logic, tuple(self.layout.groups),
            self.layout.blocks_per_chunk, self.layout.tokens_per_hash, r.num_tokens, local_tokens,
            self.cfg.prefix_caching, capacity, tuple(states)))

    # -- decode fast-forward ----------------------------------------------------------------

    def can_fast_forward(self) -> bool:
        """Every running request decodes and has 3+ tokens to go, no store is
        due, nothing finished is pending, and the waiting queue cannot change
        the batch (the engine adds: no deferred store, no unpolled completion)."""
        cfg = self.cfg
        running = self.running
        if (not cfg.fast_forward or not running or self.finished_pending
                or len(running) > cfg.max_num_batched_tokens):
            return False
        if (self.waiting or self.skipped) and len(running) < cfg.max_num_seqs:
            if self.waiting:
                return False
            if any(r.status is not _WAITING_FOR_KV or r.load_ready for r in self.skipped):
                return False
        conn = self.conn
        for r in running:
            if r.num_computed != r.num_tokens - 1 or r.req.output_tokens - r.generated < 3:
                return False
            if conn is not None and not conn.store_idle(r.req_id, r.num_tokens):
                return False
        return True

    def plan_fast_forward(self, now: float, horizon: float) -> FastForward | None:
        """``k >= 2`` pure decode steps that start before ``horizon`` (the first
        at ``now``), end before any request's last step, and fit in the free
        blocks no pending store reads; None if fewer."""
        running = list(self.running)
        n = len(running)
        # steps before any request's last one
        kmax = min(r.req.output_tokens - r.generated for r in running) - 1
        # time: step s (s >= 1) is in the window only if it starts before the horizon
        cost = self.cfg.step_cost
        kmax = min(kmax, 4096)
        ctx, pairs = self.context.decode_runs(running, kmax)
        bpt_total = self.context.bytes_per_token
        ctx0 = ctx[0] / bpt_total
        timed = decode_timer(cost, n)   # cost.time of each step's StepLoad, its constant part once
        durs: list[float] = []
        t = now
        while len(durs) < kmax:
            if durs and not t < horizon:
                break
            s = len(durs)
            d = timed(ctx[s] / bpt_total, ctx[s], pairs[s])
            durs.append(d)
            t = t + d
        k = len(durs)
        if k < 2:
            return None
        k = self._fast_forward_room(running, k)
        if k < 2:
            return None
        nc0 = [r.num_computed for r in running]
        # a request already due (its thresholds lie behind it, as the reference's plain
        # thresholds may) is due at step 0: a step's due requests go in running order,
        # as vLLM's schedule() visits them, whatever their thresholds
        heap = [(max(s, 0), i) for i, r in enumerate(running)
                if (s := min(r.thr_slots - nc0[i] - 1, r.thr_comp - nc0[i])) < k]
        heapq.heapify(heap)
        return FastForward(tuple(durs[:k]), ctx0, running, nc0, [r.num_tokens for r in running], heap,
                           written=list(nc0))

    def _fast_forward_room(self, running: list[LiveRequest], k: int) -> int:
        """How many of ``k`` decode steps the free blocks allow (a new block when
        the slot count passes the list; only currently free blocks may be handed
        out, and none a pending store reads)."""
        gpu = self.gpu
        pool = gpu.pool
        steps_alloc = [0] * k
        for r in running:
            nc = r.num_computed
            for g, n_blocks in enumerate(gpu.table_lens(r.req_id)):
                bs = self.layout.groups[g].tokens_per_block
                for s in range(n_blocks * bs - nc, k, bs):
                    steps_alloc[s] += 1
        limit = pool.num_free
        fences = self.conn.block_fences if self.conn is not None else {}
        if fences:
            for pos, bid in enumerate(pool.free_ids_head(limit)):
                if bid in fences:
                    limit = pos
                    break
        total = 0
        for s in range(k):
            total += steps_alloc[s]
            if total > limit:
                return s
        return k

    def fast_forward_step(self, ff: FastForward, s: int) -> None:
        """Apply decode step ``s`` of ``ff`` (before its forward pass): the
        requests that cross a block boundary allocate, free and commit."""
        heap, running, nc0, nt0, new_ids = ff.heap, ff.running, ff.nc0, ff.nt0, ff.new_ids
        k = ff.k
        computed = self.hooks.computed
        ngroups = len(self.layout.groups)
        # the fast cache does a step's allocate/free/commit/thresholds in one call
        fused = self.gpu.decode_step if isinstance(self.gpu, GpuFastCache) else None
        caching = self.cfg.prefix_caching
        heappop, heappush = heapq.heappop, heapq.heappush
        while heap and heap[0][0] <= s:
            _, i = heappop(heap)
            r = running[i]
            nc = nc0[i] + s
            r.num_computed = nc
            r.num_tokens = nt0[i] + s
            if computed is not None:    # write what the steps so far computed, before any free
                computed(r, ff.written[i], nc)
                ff.written[i] = nc
            acc = new_ids.get(i)
            if acc is None:
                acc = new_ids[i] = [[] for _ in range(ngroups)]
            if fused is not None:
                thr = fused(r.req_id, nc, r.full_hashes if caching else None, acc)
            else:
                thr = self._decode_step(r, nc, acc)
            if thr is None:
                raise InvariantViolation("fast-forward allocation failed after the dry run")
            slots, comp = r.thr_slots, r.thr_comp = thr
            wait = min(slots - nc - 1, comp - nc)
            nxt = s + wait if wait > 1 else s + 1
            if nxt < k:
                heappush(heap, (nxt, i))

    def fast_forward_all(self, ff: FastForward) -> None:
        """Apply all ``k`` steps of ``ff``: what :meth:`fast_forward_step` does for
        ``s`` in ``range(ff.k)``, visiting only the steps where a request is due."""
        heap, k = ff.heap, ff.k
        while heap and heap[0][0] < k:
            self.fast_forward_step(ff, heap[0][0])

    def _decode_step(self, r: LiveRequest, nc: int, acc: list[list[int]]) -> tuple[int, int] | None:
        """A due request's decode step with ``nc`` computed tokens (the reference
        accounting; the fast one fuses this: :meth:`GpuFastCache.decode_step`):
        allocate, free and commit; new ids appended to ``acc``; its thresholds."""
        ids = self.gpu.allocate_more(r.req_id, nc, nc + 1)
        if ids is None:
            return None
        for g, new in enumerate(ids):
            acc[g].extend(new)
        self._commit(r, nc + 1)
        return self._thresholds(r.req_id)

    def finish_fast_forward(self, ff: FastForward) -> None:
        """The ``k`` steps ran: every request computed and sampled ``k`` tokens."""
        k = ff.k
        computed = self.hooks.computed
        for i, r in enumerate(ff.running):
            if computed is not None:
                computed(r, ff.written[i], ff.nc0[i] + k)
            r.num_computed = ff.nc0[i] + k
            r.num_tokens = ff.nt0[i] + k
            r.high_water = r.num_computed
            r.generated += k
        if self.conn is not None:
            for i, acc in ff.new_ids.items():
                self.conn.update_block_ids(ff.running[i].req_id, acc)

    # -- end of run -------------------------------------------------------------------------

    def invariant_problems(self) -> list[str]:
        """What is wrong at the end of a completed run (empty: nothing)."""
        problems: list[str] = []
        if self.requests:
            problems.append(f"{len(self.requests)} requests neither finished nor rejected")
        gpu = self.gpu
        try:
            gpu.pool.check_invariants()
        except Exception as exc:
            problems.append(f"GPU pool: {exc}")
        if gpu.pool.num_used or gpu.req_blocks:
            problems.append(f"{gpu.pool.num_used} GPU blocks still referenced "
                            f"by {sorted(gpu.req_blocks)[:5]}")
        if self.cpu is not None:
            if self.cpu.num_pending:
                problems.append(f"{self.cpu.num_pending} CPU chunks still pending a store")
            if self.cpu.num_loading:
                problems.append(f"{self.cpu.num_loading} CPU chunks still being loaded")
            try:
                self.cpu.check_invariants()
            except Exception as exc:
                problems.append(f"CPU cache: {exc}")
        if self.conn is not None and (self.conn.num_jobs or self.conn.num_requests):
            problems.append(f"connector holds {self.conn.num_jobs} jobs and "
                            f"{self.conn.num_requests} request states")
        return problems
