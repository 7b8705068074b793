"""The SimPy engine: arrivals, request lifecycles, the engine step loop, transfer links.

What it models
    One vLLM engine with the OffloadingConnector, replaying a request stream
    in simulated time (spec §7, §8.3, §9). This is the only module that knows
    SimPy; every decision is asked of the clock-free core
    (:mod:`sim.model.gpu_cache`, :mod:`sim.model.connector`, :mod:`sim.model.cpu_cache`).

    Processes
        * *arrivals*: reads the workload lazily and starts one *lifecycle*
          process per request at its arrival time;
        * *lifecycle* (one per request): joins the waiting queue, wakes the
          engine, and waits for its end (finished, rejected, or the run
          stopped), then writes the request's row;
        * *engine*: the step loop below;
        * *links*: one per direction (``h2d`` loads, ``d2h`` stores), each a
          serial in-order queue; a job takes ``latency + bytes / bandwidth``.

    One engine step (vLLM ``schedule`` -> workers -> ``update_from_output``)
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
           retried next step); allocation; ``update_state_after_alloc``
           builds the load, which makes the request wait for remote KV;
        3. the connector's metadata: block ids, stale-entry zeroing and flush
           fences (spec §7.6), store jobs of the scheduled requests and of the
           requests finished in the previous step;
        4. the worker: flushed stores are submitted and waited for, then the
           stores deferred from the previous step and this step's loads are
           submitted; the forward pass takes the cost model's step time; this
           step's stores are deferred to the next step (spec §8.3);
        5. output: computed tokens advance, a token is sampled when a request
           reaches its length, stop conditions finish requests (blocks freed
           at once), then transfer completions polled at the step's end update
           the CPU cache and mark loaded requests ready.

    Order of same-time events (defined here, once)
        At one simulated instant: (1) transfer completions (``URGENT``), in
        completion order per link, h2d before d2h on ties; (2) arrivals
        (SimPy's ``NORMAL``), in trace order; (3) the engine's step boundary
        (``LATE``). So a step that starts at ``t`` sees every arrival and
        completion at ``t``; a completion during a step is reported at its end.

    Decode fast-forward
        When every running request is decoding, no request finishes, the
        waiting queue cannot change the batch, no store is due, and no
        arrival, transfer completion or occupancy sample falls before a step
        start, ``k`` decode steps are executed in one go: only requests that
        cross a block boundary do work, in the exact order stepping would,
        and the simulated clock advances step by step with the same floating
        point operations. Results are identical to stepping (tested).

Simplifications
    * One engine, one worker (no tensor/pipeline/data parallelism), no
      speculative decoding, no encoder inputs, no LoRA, no priorities.
    * The waiting queue is FCFS with a skipped queue in front (vLLM 0.30);
      the async-load admission reservation (``reserved_blocks``) and the
      allocator's watermark are not modelled.
    * A new request that cannot fit even in an empty GPU is rejected
      (recorded) instead of waiting forever.
    * An idle engine does not spin: it sleeps until an arrival or a transfer
      completion (vLLM polls with empty steps; no state changes in between).
    * Store jobs are created in schedule order (running requests first, then
      newly admitted, then requests finished in the previous step).
    * A modelled crash with ``on_crash = "record"`` drops the request's
      external hit for good (it recomputes from its local hit).

Invariants (checked at the end of a completed run; :class:`InvariantViolation`)
    * every request finished or was rejected;
    * no GPU block is referenced; the pool's bookkeeping is consistent;
    * no CPU chunk is pending a store or being loaded (every store completed
      or was cancelled, every load released); the cache is consistent;
    * the connector holds no job and no request state.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import simpy

from sim.engine.metrics import Recorder, RunSummary
from sim.io.workload import Request
from sim.model.connector import LoadPlan, ModelledCrashError, OffloadingScheduler, StorePlan
from sim.model.costs import ZERO_STEP, ZERO_TRANSFER, StepCostModel, TransferModel
from sim.model.cpu_cache import CpuChunkCache, EvictionPolicy
from sim.model.gpu_cache import GpuKVCache
from sim.model.layout import Layout
from sim.model.windows import profile

__all__ = ["CopyPathConfig", "EngineConfig", "InvariantViolation", "RunResult", "simulate"]

URGENT = 0  #: transfer completions
NORMAL = 1  #: arrivals (SimPy's default priority)
LATE = 2    #: engine step boundaries

_Proc = Generator[simpy.Event, Any, Any]


@dataclass(frozen=True)
class CopyPathConfig:
    """The torch data path (:mod:`sim.engine.copypath`, imported only when set).

    Attributes:
        mode: ``fingerprint`` (a word per token, for identity) or ``realistic``
            (the layout's real bytes per block).
        device: ``auto``, ``cpu`` or ``cuda``.
        timing: ``model`` (transfer time from the cost model; copies run when
            a job completes) or ``measured`` (copies run when a job starts and
            their measured time is the job's duration).
        memory_limit_bytes: refuse tensors larger than this (None: available memory).
    """

    mode: Literal["fingerprint", "realistic"] = "fingerprint"
    device: str = "auto"
    timing: Literal["model", "measured"] = "model"
    memory_limit_bytes: int | None = None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, already validated (see :mod:`sim.io.scenario`)."""

    layout: Layout
    gpu_blocks: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    prefix_caching: bool = True
    offloading: bool = True
    offload_prompt_only: bool = True
    cpu_capacity_chunks: int = 0
    eviction: EvictionPolicy = EvictionPolicy.LRU
    window_logic: Literal["old", "new"] = "new"
    on_crash: Literal["record", "stop"] = "record"
    step_cost: StepCostModel = ZERO_STEP
    h2d: TransferModel = ZERO_TRANSFER
    d2h: TransferModel = ZERO_TRANSFER
    fast_forward: bool = True
    occupancy_interval_s: float = 1.0
    max_sim_time_s: float | None = None
    #: False models vLLM run with ``python -O`` (see :class:`OffloadingScheduler`)
    assertions: bool = True
    copy_path: CopyPathConfig | None = None

    def __post_init__(self) -> None:
        if self.gpu_blocks < 2:
            raise ValueError("gpu_blocks must be >= 2 (one is the null block)")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.occupancy_interval_s <= 0:
            raise ValueError("occupancy_interval_s must be > 0")


class InvariantViolation(RuntimeError):  # noqa: N818 -- the name says what happened
    """An end-of-run invariant failed: a simulator bug (exit 1)."""


@dataclass
class RunResult:
    """How a run ended, and its summary figures."""

    status: Literal["ok", "stopped_on_crash", "time_limit"]
    summary: RunSummary
    #: check/1 snapshots of the first modelled crashes and hazards
    reproducers: list[dict[str, Any]] = field(default_factory=list)


class _At(simpy.Event):
    """An event that fires after ``delay`` with a given priority (SimPy's
    ``Timeout`` always uses ``NORMAL``)."""

    def __init__(self, env: simpy.Environment, delay: float, priority: int) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, priority, delay)  # type: ignore[arg-type]


_DEFER, _FULL, _REJECTED = "defer", "full", "rejected"
_U64 = (1 << 64) - 1

# request states
WAITING, WAITING_FOR_KV, RUNNING, FINISHED, REJECTED, UNFINISHED = range(6)
_STATUS = {FINISHED: "finished", REJECTED: "rejected", UNFINISHED: "unfinished"}


class _Live:
    """A request inside the engine (what vLLM's ``Request`` holds), and its counters."""

    __slots__ = (
        "_all",
        "_tph",
        "computed_tokens",
        "cpu_hit_tokens", "cpu_reload_tokens",
        "crash",
        "deferrals",
        "done",
        "finish_s",
        "first_token_s",
        "generated",
        "gpu_hit_tokens",
        "high_water",
        "load_job",
        "load_jobs",
        "load_ready",
        "loaded_bytes",
        "no_external",
        "num_computed",
        "num_prompt_tokens",
        "num_tokens",
        "preemptions",
        "recomputed_tokens",
        "req",
        "req_id",
        "salt",
        "scheduled_s",
        "status",
        "store_jobs",
        "stored_bytes",
        "synced",
        "thr_comp",
        "thr_slots",
    )

    def __init__(self, req: Request, env: simpy.Environment, tph: int) -> None:
        self.req = req
        self.req_id = req.req_id
        self.num_prompt_tokens = req.prompt_tokens
        self.num_tokens = req.prompt_tokens
        self.num_computed = 0
        self.generated = 0
        self._tph = tph
        hashes = req.block_hashes
        # a zero-copy view when the workload hands out arrays (bounded memory
        # for long queues); any other sequence is sliced on demand
        self._all: Sequence[int] = memoryview(hashes) if isinstance(hashes, array) else hashes
        #: KV content identity of the request's own tail (copy path fingerprints)
        self.salt = _salt(req.req_id)
        self.status = WAITING
        self.load_job: int | None = None
        self.load_ready = False
        self.no_external = False
        self.synced = False
        #: GPU allocation/commit is a no-op below these (see GpuKVCache.thresholds)
        self.thr_slots = 0
        self.thr_comp = 0
        self.done = env.event()
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.gpu_hit_tokens = 0
        self.cpu_hit_tokens = 0
        self.cpu_reload_tokens = 0
        self.computed_tokens = 0
        self.recomputed_tokens = 0
        self.high_water = 0
        self.loaded_bytes = 0
        self.stored_bytes = 0
        self.load_jobs = 0
        self.store_jobs = 0
        self.deferrals = 0
        self.preemptions = 0
        self.crash: str | None = None

    @property
    def full_hashes(self) -> Sequence[int]:
        """Hashes of every complete hash block the sequence will have (fingerprints
        do not depend on when a token was computed)."""
        return self._all

    @property
    def block_hashes(self) -> Sequence[int]:
        """Hashes of the complete hash blocks of the tokens known so far."""
        return self._all[: self.num_tokens // self._tph]


@dataclass(slots=True)
class _Xfer:
    """One transfer job on a link."""

    job_id: int
    req_id: str
    direction: str
    chunks: int
    blocks: int
    nbytes: int
    submit_s: float = 0.0
    start_s: float = 0.0
    end_s: float = math.inf
    flushed: bool = False
    done: simpy.Event | None = None
    plan: LoadPlan | StorePlan | None = None


class _Link:
    """A serial, in-order transfer queue (one direction of the PCIe link)."""

    def __init__(self, env: simpy.Environment, name: str, model: TransferModel,
                 on_done: Callable[[_Xfer], None], copy: Callable[[_Xfer], float] | None = None,
                 measured: bool = False) -> None:
        self.env = env
        self.name = name
        self.model = model
        self.on_done = on_done
        #: runs a job's real copy: at its start with measured timing, else at its end
        self.copy = copy
        self.measured = measured
        self.queue: deque[_Xfer] = deque()
        self.current: _Xfer | None = None
        self.busy_s = 0.0
        self._wake: simpy.Event | None = None
        env.process(self._run())

    def submit(self, x: _Xfer) -> None:
        x.submit_s = self.env.now
        x.done = self.env.event()
        self.queue.append(x)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    @property
    def next_completion_s(self) -> float:
        return self.current.end_s if self.current is not None else math.inf

    def __len__(self) -> int:
        return len(self.queue) + (self.current is not None)

    def _run(self) -> _Proc:
        env = self.env
        while True:
            if not self.queue:
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            x = self.queue.popleft()
            self.current = x
            x.start_s = env.now
            dur = self.model.time(x.nbytes)
            if self.copy is not None and self.measured:
                dur = self.copy(x)
            x.end_s = env.now + dur
            yield _At(env, dur, URGENT)
            if self.copy is not None and not self.measured:
                self.copy(x)
            self.busy_s += dur
            self.current = None
            self.on_done(x)
            assert x.done is not None
            x.done.succeed()


class _Engine:
    """State and processes of one simulated engine."""

    def __init__(self, cfg: EngineConfig, requests: Iterable[Request], rec: Recorder,
                 progress: Callable[[int, float], None] | None) -> None:
        self.cfg = cfg
        self.rec = rec
        self.progress = progress
        self.env = simpy.Environment()
        layout = cfg.layout
        self.layout = layout
        self.tph = layout.tokens_per_hash
        self.gpu = GpuKVCache(layout, cfg.gpu_blocks, enable_caching=cfg.prefix_caching)
        self.cpu: CpuChunkCache | None = None
        self.conn: OffloadingScheduler | None = None
        if cfg.offloading:
            self.cpu = CpuChunkCache(cfg.cpu_capacity_chunks, cfg.eviction)
            self.conn = OffloadingScheduler(layout, self.cpu, profile(cfg.window_logic),
                                            prefix_caching=cfg.prefix_caching,
                                            offload_prompt_only=cfg.offload_prompt_only,
                                            assertions=cfg.assertions)
        self.block_bytes = tuple(layout.kv_bytes_per_block(g) or 0 for g in range(len(layout.groups)))
        self._att = _attention_terms(layout)
        self._bpt_total = sum(bpt for _, _, bpt in self._att)
        self.summary = RunSummary()
        self.completed: list[_Xfer] = []
        self.copy: Any = None
        copy_fn: Callable[[_Xfer], float] | None = None
        measured = False
        if cfg.copy_path is not None and cfg.offloading:
            from sim.engine.copypath import CopyPath

            cp = cfg.copy_path
            self.copy = CopyPath(layout, cfg.gpu_blocks, max(1, cfg.cpu_capacity_chunks), mode=cp.mode,
                                 device=cp.device, memory_limit_bytes=cp.memory_limit_bytes)
            copy_fn = self._run_copy
            measured = cp.timing == "measured"
        self._reported: dict[str, set[tuple[int, int]]] = {}
        self.h2d = _Link(self.env, "h2d", cfg.h2d, self._completed, copy_fn, measured)
        self.d2h = _Link(self.env, "d2h", cfg.d2h, self._completed, copy_fn, measured)
        self.xfers: dict[int, _Xfer] = {}
        self.running: list[_Live] = []
        self.waiting: deque[_Live] = deque()
        self.skipped: deque[_Live] = deque()
        self.live: dict[str, _Live] = {}
        self.finished_pending: list[_Live] = []
        self.deferred_stores: list[_Xfer] = []
        self.step_no = 0
        self.next_tick = 0.0
        self.stop_reason: Literal["stopped_on_crash", "time_limit"] | None = None
        self._requests: Iterator[Request] = iter(requests)
        self.next_arrival_s = math.inf
        self.arrivals_done = False
        self._idle: simpy.Event | None = None
        self._finished_count = 0
        self._stop = self.env.event()
        self.end_s = 0.0
        self._broke_deadlock = False
        self._loads_this_step = 0
        #: check/1 snapshots of modelled crashes and hazards (see _reproduce)
        self.reproducers: list[dict[str, Any]] = []
        self.max_reproducers = 100

    # -- processes ------------------------------------------------------------------

    def _arrivals(self) -> _Proc:
        env = self.env
        last = 0.0
        for req in self._requests:
            if req.arrival_s < last:
                raise ValueError(f"request {req.req_id} arrives at {req.arrival_s} s, before "
                                 f"the previous one ({last} s): the stream must be sorted")
            last = req.arrival_s
            self.next_arrival_s = req.arrival_s
            if req.arrival_s > env.now:
                yield env.timeout(req.arrival_s - env.now)
            if self.stop_reason is not None:
                break
            env.process(self._lifecycle(req))
        self.next_arrival_s = math.inf
        self.arrivals_done = True
        self._kick()

    def _lifecycle(self, req: Request) -> _Proc:
        r = _Live(req, self.env, self.tph)
        self.live[r.req_id] = r
        self.summary.requests_arrived += 1
        self.summary.prompt_tokens += r.num_prompt_tokens
        self.waiting.append(r)
        if self.conn is not None:
            self.conn.on_new_request(r)
        self._kick()
        yield r.done | self._stop
        if r.status not in (FINISHED, REJECTED):
            r.status = UNFINISHED
        self._write_request(r)

    def _completed(self, x: _Xfer) -> None:
        self.completed.append(x)
        self._kick()

    def _kick(self) -> None:
        if self._idle is not None and not self._idle.triggered:
            self._idle.succeed()

    def _engine(self) -> _Proc:
        env = self.env
        yield _At(env, 0, LATE)   # arrivals at time 0 come first
        while True:
            if self.cfg.max_sim_time_s is not None and env.now >= self.cfg.max_sim_time_s:
                self.stop_reason = "time_limit"
            if self.stop_reason is not None:
                break
            busy = yield from self._step()
            if self.stop_reason is not None:
                break
            if busy:
                continue
            if self.arrivals_done and not self.live and not self.xfers and not self.deferred_stores:
                break
            self._idle = env.event()
            wake: simpy.Event = self._idle
            if self.cfg.max_sim_time_s is not None:
                wake = wake | env.timeout(max(0.0, self.cfg.max_sim_time_s - env.now))
            yield wake
            self._idle = None
            # let every other event of this instant happen first
            yield _At(env, 0, LATE)
        self._sample(force=True)
        self.end_s = env.now
        if not self._stop.triggered:
            self._stop.succeed()

    # -- one step ---------------------------------------------------------------------

    def _step(self) -> Generator[simpy.Event, Any, bool]:
        """One engine step; returns whether it did anything."""
        env = self.env
        cfg = self.cfg
        gpu = self.gpu
        conn = self.conn
        if self._can_fast_forward():
            k = yield from self._fast_forward()
            if k:
                return True
        budget = cfg.max_num_batched_tokens
        self._broke_deadlock = False
        self._loads_this_step = 0
        sched: list[tuple[_Live, int, tuple[tuple[int, ...], ...] | None]] = []
        preempted: list[_Live] = []
        allocated: set[int] = set()
        running = self.running
        # 1. running requests
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            num_new = min(r.num_tokens - r.num_computed, budget)
            if r.num_computed + num_new < r.thr_slots and r.num_computed < r.thr_comp:
                sched.append((r, num_new, None))     # nothing to allocate, free or commit
                budget -= num_new
                i += 1
                continue
            ids = None
            while True:
                ids = gpu.allocate_more(r.req_id, r.num_computed, r.num_computed + num_new)
                if ids is not None:
                    break
                victim = running.pop()
                if victim is r and not running and len(gpu.req_blocks) == 1 and not self.xfers:
                    # alone with the whole pool and still short: it never fits
                    gpu.free(r.req_id)
                    self._reject(r, f"its next prefill chunk does not fit in the GPU block pool "
                                    f"({self.cfg.gpu_blocks} blocks) even alone")
                    self._broke_deadlock = True
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is r:
                    break
            if ids is None:
                break
            self._commit(r, r.num_computed + num_new)
            r.thr_slots, r.thr_comp = gpu.thresholds(r.req_id)
            for new in ids:
                allocated.update(new)
            sched.append((r, num_new, ids))
            budget -= num_new
            i += 1
        # 2. waiting requests
        loads: list[LoadPlan] = []
        admitted = 0
        if not preempted:
            step_skipped: deque[_Live] = deque()
            while (self.skipped or self.waiting) and budget > 0:
                if len(running) >= cfg.max_num_seqs:
                    break
                q = self.skipped if self.skipped else self.waiting
                r = q[0]
                if r.status == WAITING_FOR_KV:
                    if not r.load_ready:
                        q.popleft()
                        step_skipped.appendleft(r)
                        continue
                    self._promote(r)
                res = self._admit(r, budget, allocated)
                if res == _DEFER:    # lookup deferred: skip, retry next step
                    q.popleft()
                    step_skipped.appendleft(r)
                    continue
                if res == _REJECTED:
                    q.popleft()
                    continue
                if res == _FULL:     # no room (or stop): stop admitting
                    break
                assert isinstance(res, tuple)
                num_new, ids, load = res
                q.popleft()
                admitted += 1
                if r.scheduled_s is None:
                    r.scheduled_s = env.now
                if load is not None:
                    loads.append(load)
                    self._loads_this_step += 1
                    step_skipped.appendleft(r)
                    continue
                r.status = RUNNING
                running.append(r)
                sched.append((r, num_new, ids))
                budget -= num_new
            self.skipped.extendleft(step_skipped)
        if self.stop_reason is not None:
            return False
        # 3. connector metadata
        flush: set[int] = set()
        stores: list[StorePlan] = []
        if conn is not None:
            conn.zero_reallocated(allocated)
            for r, _, ids in sched:
                if not r.synced:
                    conn.update_block_ids(r.req_id, [[b.block_id for b in bl]
                                                     for bl in gpu.req_blocks[r.req_id]])
                    r.synced = True
                elif ids is not None:
                    conn.update_block_ids(r.req_id, ids)
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
        new_store_x = [self._store_xfer(p) for p in stores]
        finished_before = bool(self.finished_pending)
        for r in self.finished_pending:
            self._release(r)
        self.finished_pending = []
        # 4. worker: flush, submit, forward, defer this step's stores
        start = env.now
        if flush:
            for x in new_store_x:
                if x.job_id in flush:
                    self.deferred_stores.append(x)
            for x in self.deferred_stores:
                x.flushed = x.job_id in flush
                self.d2h.submit(x)
            self.deferred_stores = []
            waits = [self.xfers[j].done for j in sorted(flush) if j in self.xfers]
            self.summary.flushed_stores += len(waits)
            if waits:
                yield simpy.AllOf(env, [w for w in waits if w is not None])
                yield _At(env, 0, LATE)
        else:
            for x in self.deferred_stores:
                self.d2h.submit(x)
            self.deferred_stores = []
        for p in loads:
            self.h2d.submit(self._load_xfer(p))
        prefill = decode = attended = 0
        att = self._attended
        for r, num_new, _ in sched:
            if r.num_computed >= r.num_prompt_tokens and r.num_computed == r.num_tokens - 1:
                decode += 1
            else:
                prefill += num_new
            attended += att(r.num_computed + num_new)
        context = attended / self._bpt_total
        if sched:
            dur = cfg.step_cost.step_time(prefill, decode, context)
            yield _At(env, dur, LATE)
        self.deferred_stores.extend(x for x in new_store_x if x.job_id not in flush)
        # 5. output
        if self.copy is not None:
            for r, num_new, _ in sched:
                self._write(r, r.num_computed, r.num_computed + num_new)
        for r, num_new, _ in sched:
            self._advance(r, num_new)
        for r, _, _ in sched:
            if r.status == RUNNING and r.generated >= r.req.output_tokens:
                self._finish(r)
        polled = self._poll()
        nsteps = 1 if sched else 0
        self.summary.steps += nsteps
        did = bool(sched or loads or stores or admitted or preempted or finished_before
                   or self.deferred_stores or flush or polled or self._broke_deadlock)
        if did:
            self.step_no += 1
            self.summary.step_rows += 1
            self.rec.add("steps", (self.step_no - 1, nsteps, start, env.now - start, prefill, decode,
                                   context, len(running), len(self.waiting) + len(self.skipped),
                                   len(loads), len(stores), len(preempted), gpu.pool.num_used))
        self._sample()
        return did

    def _admit(self, r: _Live, budget: int, allocated: set[int]
               ) -> tuple[int, tuple[tuple[int, ...], ...] | None, LoadPlan | None] | str:
        """Try to admit the waiting request at the head of the queue.

        Returns ``_DEFER`` (lookup deferred), ``_FULL`` (no room, or the run
        stops: admit no more), ``_REJECTED``, or ``(tokens scheduled, new
        block ids, load plan)``.
        """
        gpu, conn = self.gpu, self.conn
        if r.num_computed > 0:        # promoted after its load
            num_new = min(r.num_tokens - r.num_computed, budget)
            ids = gpu.allocate_more(r.req_id, r.num_computed, r.num_computed + num_new)
            if ids is None:
                return self._no_room(r)
            self._commit(r, r.num_computed + num_new)
            r.thr_slots, r.thr_comp = gpu.thresholds(r.req_id)
            for new in ids:
                allocated.update(new)
            return num_new, ids, None
        local_tokens, local = gpu.find_hit(r.block_hashes, r.num_tokens - 1)
        ext = 0
        load_async = False
        if conn is not None and not r.no_external:
            m = conn.get_num_new_matched_tokens(r, local_tokens)
            if m.tokens is None:
                r.deferrals += 1
                self.summary.deferrals += 1
                why = m.defer_reason or "unknown"
                self.summary.deferral_reasons[why] = self.summary.deferral_reasons.get(why, 0) + 1
                return _DEFER
            ext, load_async = m.tokens, m.load_async
        comp = local_tokens + ext
        num_new = 0 if load_async else min(r.num_tokens - comp, budget)
        alloc = gpu.allocate_new(r.req_id, local, local_tokens, ext, comp + num_new)
        if alloc is None:
            return self._no_room(r)
        load: LoadPlan | None = None
        if conn is not None:
            try:
                load = conn.update_state_after_alloc(r, alloc.blocks, ext, alloc.null_prefix)
            except ModelledCrashError as exc:
                self._record_crash(r, exc)
                self._reproduce(r, local_tokens, "crash", exc.crash.kind, (), ())
                gpu.free(r.req_id)
                if self.cfg.on_crash == "stop":
                    self.stop_reason = "stopped_on_crash"
                    return _FULL
                r.no_external = True
                ext, load_async = 0, False
                comp = local_tokens
                num_new = min(r.num_tokens - comp, budget)
                alloc = gpu.allocate_new(r.req_id, local, local_tokens, 0, comp + num_new)
                if alloc is None:
                    return _FULL
                conn.update_state_after_alloc(r, alloc.blocks, 0, alloc.null_prefix)
            if load is not None:
                for h in load.hazards:
                    what = ("is already being loaded" if h.kind == "double_load"
                            else "is read before its store completed (assertions stripped)")
                    self._event("hazard", h.kind, r.req_id, h.group, h.chunk,
                                f"chunk ({h.group}, {h.chunk}) {what}")
                    self.summary.hazards += 1
                    self.summary.hazard_kinds[h.kind] = self.summary.hazard_kinds.get(h.kind, 0) + 1
                if load.hazards:
                    self._reproduce(r, local_tokens, "hazard", load.hazards[0].kind, load.keys, load.unsafe)
        for new in alloc.new_block_ids:
            allocated.update(new)
        if r.preemptions == 0 and r.scheduled_s is None:
            r.gpu_hit_tokens = local_tokens
            self.summary.gpu_hit_tokens += local_tokens
        r.synced = False
        r.num_computed = comp
        if load is not None:
            r.status = WAITING_FOR_KV
            r.load_job = load.job_id
            r.load_ready = False
            if r.preemptions == 0:
                r.cpu_hit_tokens += ext
                self.summary.cpu_hit_tokens += ext
            else:
                r.cpu_reload_tokens += ext
                self.summary.cpu_reload_tokens += ext
            return 0, None, load
        self._commit(r, comp + num_new)
        r.thr_slots, r.thr_comp = gpu.thresholds(r.req_id)
        return num_new, None, None

    def _no_room(self, r: _Live) -> str:
        """The GPU pool cannot take ``r`` now. Normally admission stops (FCFS).
        With nothing running no room would ever come that way: wait while
        transfers are in flight; reject ``r`` if it holds the pool alone;
        else other waiting requests (loaded, or partly prefilled) hold blocks
        that nothing frees: preempt them all and stop admitting this step, so
        that ``r`` has the pool to itself next step (deadlock breaker: vLLM
        avoids most of these states with an admission reservation for async
        loads, which is not modelled)."""
        if self.running:
            return _FULL
        if self.xfers or self._loads_this_step:
            return _DEFER
        gpu = self.gpu
        if all(rid == r.req_id for rid in gpu.req_blocks):
            if r.req_id in gpu.req_blocks:
                gpu.free(r.req_id)
            self._reject(r, f"does not fit in the GPU block pool ({self.cfg.gpu_blocks} blocks)")
            return _REJECTED
        for v in [q for q in self.live.values() if q is not r and q.req_id in gpu.req_blocks
                  and (q.status != WAITING_FOR_KV or q.load_ready)]:
            gpu.free(v.req_id)
            v.num_computed = 0
            v.status = WAITING
            v.load_job = None
            v.load_ready = False
            v.preemptions += 1
            self.summary.preemptions += 1
            self._event("preempted", "deadlock_break", v.req_id, -1, -1,
                        f"a waiting request held GPU blocks while {r.req_id} could not get room "
                        "and nothing was running")
        self._broke_deadlock = True
        return _FULL

    def _promote(self, r: _Live) -> None:
        """A loaded request leaves WAITING_FOR_KV (spec §9 1.b)."""
        self._commit(r, r.num_computed)
        if r.num_computed == r.num_tokens:
            r.num_computed -= 1
        r.status = WAITING
        r.load_job = None
        r.load_ready = False
        r.high_water = max(r.high_water, r.num_computed)
        if self.copy is not None:
            self._verify_read(r)

    def _commit(self, r: _Live, num_tokens: int) -> None:
        if self.cfg.prefix_caching:
            self.gpu.commit(r.req_id, r.block_hashes, min(num_tokens, r.num_tokens))

    def _preempt(self, r: _Live) -> None:
        self.gpu.free(r.req_id)
        r.num_computed = 0
        r.status = WAITING
        r.preemptions += 1
        self.summary.preemptions += 1
        self.waiting.appendleft(r)

    def _advance(self, r: _Live, num_new: int) -> None:
        """Tokens computed by the forward pass; sample when the sequence is complete."""
        a = r.num_computed
        b = a + num_new
        if a < r.num_prompt_tokens or b < r.num_tokens:   # prefill work
            redo = max(0, min(b, r.high_water) - a)
            r.recomputed_tokens += redo
            r.computed_tokens += num_new
            self.summary.computed_tokens += num_new
            self.summary.recomputed_tokens += redo
        r.high_water = max(r.high_water, b)
        r.num_computed = b
        if b >= r.num_tokens:
            r.generated += 1
            r.num_tokens += 1
            if r.generated == 1 and r.first_token_s is None:
                r.first_token_s = self.env.now

    def _finish(self, r: _Live) -> None:
        """A stop condition: the request leaves the batch; its blocks are freed
        now, its final stores come with the next step (then it is released)."""
        self.running.remove(r)
        r.status = FINISHED
        r.finish_s = self.env.now
        self._finished_count += 1
        if self.progress is not None and self._finished_count % 100 == 0:
            self.progress(self._finished_count, self.env.now)
        if self.conn is not None and self.conn.has_request(r.req_id):
            self.conn.request_finished(r.req_id)
            self.finished_pending.append(r)
            self.gpu.free(r.req_id)
        else:
            self.gpu.free(r.req_id)
            self._release(r)

    def _reject(self, r: _Live, reason: str) -> None:
        r.status = REJECTED
        r.finish_s = self.env.now
        self._event("rejected", "too_long", r.req_id, -1, -1,
                    f"{r.num_prompt_tokens} prompt tokens: {reason}")
        if self.conn is not None and self.conn.has_request(r.req_id):
            self.conn.request_finished(r.req_id)
            self.conn.drop_if_idle(r.req_id)
        self._release(r)

    def _release(self, r: _Live) -> None:
        """The request is done with the engine; its lifecycle writes its row."""
        del self.live[r.req_id]
        r.done.succeed()

    def _record_crash(self, r: _Live, exc: ModelledCrashError) -> None:
        c = exc.crash
        r.crash = c.kind
        s = self.summary
        s.crashes += 1
        s.crash_kinds[c.kind] = s.crash_kinds.get(c.kind, 0) + 1
        if s.first_crash_s is None:
            s.first_crash_s = self.env.now
        self._event("crash", c.kind, r.req_id, -1 if c.group is None else c.group,
                    -1 if c.chunk is None else c.chunk, f"{c.where}: {c.message}")

    def _reproduce(self, r: _Live, local_tokens: int, kind: str, detail: str,
                   own_load: Sequence[Any], unsafe: Sequence[Any]) -> None:
        """Snapshot what the request met as a ``check/1`` case (a reproducer):
        the layout, its length, its local hit and the states of its chunks
        (before its own load pinned them); expectations as the model gives them
        in isolation, and whether that matches what happened here."""
        conn, cpu = self.conn, self.cpu
        if conn is None or cpu is None or len(self.reproducers) >= self.max_reproducers:
            return
        from sim.model.cpu_cache import ChunkState

        own = set(own_load) - set(unsafe)
        states: dict[str, dict[str, str]] = {}
        for g in range(len(self.layout.groups)):
            names: list[str | None] = []
            for key in conn.keys_of(r.req_id, g):
                st = cpu.state(key)
                if key in own:   # pinned by this request's own load: as it was before
                    ref = cpu.ref_count(key) or 0
                    st = ChunkState.LOADING if ref > 1 else ChunkState.READY
                names.append({ChunkState.READY: "present", ChunkState.PENDING: "pending",
                              ChunkState.LOADING: "loading"}.get(st))
            ranges: dict[str, str] = {}
            j = 0
            while j < len(names):
                name = names[j]
                k = j
                while k + 1 < len(names) and names[k + 1] == name:
                    k += 1
                if name is not None:
                    ranges[str(j) if k == j else f"{j}..{k}"] = name
                j = k + 1
            if ranges:
                states[str(g)] = ranges
        groups = [spec.to_dict() for spec in self.layout.groups]
        count = sum(len(v) for v in states.values())
        case: dict[str, Any] = {
            "schema": "check/1",
            "name": f"{r.req_id}-{detail}",
            "window_logic": "both",
            "blocks_per_chunk": self.layout.blocks_per_chunk,
            "tokens_per_hash": self.layout.tokens_per_hash,
            "num_tokens": r.num_tokens,
            "gpu_computed_tokens": local_tokens,
            "prefix_caching": self.cfg.prefix_caching,
            "cpu_capacity_chunks": max(100, 4 * sum(len(conn.keys_of(r.req_id, g))
                                                    for g in range(len(self.layout.groups)))),
            "groups": groups,
            "chunk_states": states,
        }
        self.reproducers.append({"case": case, "req_id": r.req_id, "t_s": self.env.now, "kind": kind,
                                 "detail": detail, "logic": self.cfg.window_logic, "stated_chunks": count})

    def _event(self, kind: str, detail: str, req_id: str | None, group: int, chunk: int,
               message: str) -> None:
        self.rec.add("events", (self.env.now, kind, detail, req_id, group, chunk, message))

    # -- transfers ---------------------------------------------------------------------

    def _bytes(self, sizes: Sequence[int]) -> tuple[int, int]:
        bb = self.block_bytes
        return sum(sizes), sum(n * b for n, b in zip(sizes, bb, strict=True))

    def _load_xfer(self, p: LoadPlan) -> _Xfer:
        return self._xfer(p, "h2d")

    def _store_xfer(self, p: StorePlan) -> _Xfer:
        return self._xfer(p, "d2h")

    def _xfer(self, p: LoadPlan | StorePlan, direction: str) -> _Xfer:
        """A transfer job for a plan; its bytes count for the request and the run."""
        blocks, nbytes = self._bytes(p.group_sizes)
        x = _Xfer(p.job_id, p.req_id, direction, len(p.keys), blocks, nbytes, plan=p)
        self.xfers[p.job_id] = x
        r = self.live[p.req_id]
        s = self.summary
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
        return x

    def _poll(self) -> int:
        """Report the transfers completed by now (end of a step); how many."""
        if not self.completed:
            return 0
        done = sorted(self.completed, key=lambda x: (x.end_s, x.direction != "h2d"))
        self.completed.clear()
        conn = self.conn
        assert conn is not None
        for x in done:
            del self.xfers[x.job_id]
            self.rec.add("transfers", (x.job_id, x.req_id, x.direction, x.chunks, x.blocks, x.nbytes,
                                       x.submit_s, x.start_s, x.end_s, x.flushed))
            req_id, is_store = conn.complete_job(x.job_id)
            if not is_store:
                r = self.live.get(req_id)
                if r is not None and r.load_job == x.job_id:
                    r.load_ready = True
                    if self.copy is not None and isinstance(x.plan, LoadPlan):
                        self._verify_load(r, x.plan)
            x.plan = None
        return len(done)

    # -- the torch data path ---------------------------------------------------------------

    def _run_copy(self, x: _Xfer) -> float:
        """Execute a transfer job on the tensors; its measured seconds."""
        p = x.plan
        assert p is not None
        if isinstance(p, LoadPlan):
            return float(self.copy.load(p.group_sizes, p.block_indices, p.dst_block_ids, p.slots))
        return float(self.copy.store(p.group_sizes, p.block_indices, p.src_block_ids, p.slots))

    def _ids(self, r: _Live) -> list[list[int]]:
        return [[b.block_id for b in blocks] for blocks in self.gpu.req_blocks[r.req_id]]

    def _write(self, r: _Live, start: int, end: int) -> None:
        """The step computed tokens [start, end) of ``r``: write their KV fingerprints."""
        if end > start:
            self.copy.compute(self._ids(r), r.full_hashes, r.salt, start, end)

    def _verify(self, r: _Live, ranges: list[tuple[int, int]], when: str) -> None:
        """Check what ``r`` will read; record each bad block once."""
        seen = self._reported.setdefault(r.req_id, set())
        for v in self.copy.verify(r.req_id, self._ids(r), r.full_hashes, r.salt, ranges):
            if (v.group, v.block_index) in seen:
                continue
            seen.add((v.group, v.block_index))
            bpc = self.layout.blocks_per_chunk
            chunk = v.block_index // bpc
            keys = self.conn.keys_of(r.req_id, v.group) if self.conn is not None else []
            key = keys[chunk] if chunk < len(keys) else None
            self.summary.integrity_violations += 1
            self._event("integrity", when, r.req_id, v.group, chunk,
                        f"block {v.block_index} (GPU block {v.block_id}, chunk key {key}) token {v.token}: "
                        f"expected {v.expected & _U64:#018x}, found {v.found & _U64:#018x}")

    def _verify_load(self, r: _Live, plan: LoadPlan) -> None:
        """After a load completes: the blocks it filled."""
        n = r.num_computed
        ranges = []
        for g, spec in enumerate(self.layout.groups):
            bs = spec.tokens_per_block
            first = plan.block_indices[g] * bs if plan.group_sizes[g] else n
            ranges.append((min(first, n), n))
        self._verify(r, ranges, "load")

    def _verify_read(self, r: _Live) -> None:
        """Before the first step after a load: every block ``r`` will read."""
        n = r.num_computed
        ranges = []
        for g, spec in enumerate(self.layout.groups):
            first = self.gpu.retained_range(g, n)[0] * spec.tokens_per_block
            ranges.append((min(first, n), n))
        self._verify(r, ranges, "read")

    # -- decode fast-forward ----------------------------------------------------------------

    def _can_fast_forward(self) -> bool:
        cfg = self.cfg
        running = self.running
        if (not cfg.fast_forward or len(running) < 1 or self.deferred_stores or self.finished_pending
                or self.completed or len(running) > cfg.max_num_batched_tokens):
            return False
        if (self.waiting or self.skipped) and len(running) < cfg.max_num_seqs:
            if self.waiting:
                return False
            if any(r.status != WAITING_FOR_KV or r.load_ready for r in self.skipped):
                return False
        conn = self.conn
        for r in running:
            if r.num_computed != r.num_tokens - 1 or r.req.output_tokens - r.generated < 3:
                return False
            if conn is not None and not conn.store_idle(r.req_id, r.num_tokens):
                return False
        return True

    def _fast_forward(self) -> Generator[simpy.Event, Any, int]:
        """Run ``k >= 2`` pure decode steps at once; returns k (0: not possible)."""
        env, cfg, gpu = self.env, self.cfg, self.gpu
        running = list(self.running)
        n = len(running)
        horizon = min(self.next_arrival_s, self.h2d.next_completion_s, self.d2h.next_completion_s,
                      max(self.next_tick, env.now))
        if cfg.max_sim_time_s is not None:
            horizon = min(horizon, cfg.max_sim_time_s)
        # steps before any request's last one
        kmax = min(r.req.output_tokens - r.generated for r in running) - 1
        # time: step s (s >= 1) is in the window only if it starts before the horizon
        cost = cfg.step_cost
        kmax = min(kmax, 4096)
        ctx = self._attended_runs(running, kmax)
        bpt_total = self._bpt_total
        ctx0 = ctx[0] / bpt_total
        durs: list[float] = []
        t = env.now
        while len(durs) < kmax:
            if durs and not t < horizon:
                break
            d = cost.step_time(0, n, ctx[len(durs)] / bpt_total)
            durs.append(d)
            t = t + d
        k = len(durs)
        if k < 2:
            return 0
        # allocations per step (a new block when the slot count passes the list)
        pool = gpu.pool
        steps_alloc = [0] * k
        for r in running:
            nc = r.num_computed
            for g, blocks in enumerate(gpu.req_blocks[r.req_id]):
                bs = self.layout.groups[g].tokens_per_block
                for s in range(len(blocks) * bs - nc, k, bs):
                    steps_alloc[s] += 1
        # only currently free blocks may be handed out, and none a pending store reads
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
                k = s
                break
        if k < 2:
            return 0
        start = env.now
        nc0 = [r.num_computed for r in running]
        nt0 = [r.num_tokens for r in running]
        # (step, running index) of each request's next allocation, free or commit
        heap = [(s, i) for i, r in enumerate(running)
                if (s := min(r.thr_slots - nc0[i] - 1, r.thr_comp - nc0[i])) < k]
        heapq.heapify(heap)
        new_ids: dict[int, list[list[int]]] = {}
        copy = self.copy
        written = list(nc0)     # copy path: tokens written so far, per request
        for s in range(k):
            while heap and heap[0][0] <= s:
                _, i = heapq.heappop(heap)
                r = running[i]
                nc = nc0[i] + s
                r.num_computed = nc
                r.num_tokens = nt0[i] + s
                if copy is not None:    # write what the steps so far computed, before any free
                    self._write(r, written[i], nc)
                    written[i] = nc
                ids = gpu.allocate_more(r.req_id, nc, nc + 1)
                if ids is None:
                    raise InvariantViolation("fast-forward allocation failed after the dry run")
                acc = new_ids.setdefault(i, [[] for _ in ids])
                for g, new in enumerate(ids):
                    acc[g].extend(new)
                self._commit(r, nc + 1)
                r.thr_slots, r.thr_comp = gpu.thresholds(r.req_id)
                nxt = s + max(1, min(r.thr_slots - nc - 1, r.thr_comp - nc))
                if nxt < k:
                    heapq.heappush(heap, (nxt, i))
            yield _At(env, durs[s], LATE)
        for i, r in enumerate(running):
            if copy is not None:
                self._write(r, written[i], nc0[i] + k)
            r.num_computed = nc0[i] + k
            r.num_tokens = nt0[i] + k
            r.high_water = r.num_computed
            r.generated += k
        if self.conn is not None:
            for i, acc in new_ids.items():
                self.conn.update_block_ids(running[i].req_id, acc)
        self.step_no += k
        self.summary.steps += k
        self.summary.step_rows += 1
        self.rec.add("steps", (self.step_no - k, k, start, env.now - start, 0, n, ctx0, n,
                               len(self.waiting) + len(self.skipped), 0, 0, 0, pool.num_used))
        self._poll()
        self._sample()
        return k

    def _attended(self, c: int) -> int:
        """KV bytes one request reads with ``c`` tokens of context: full
        attention all of it, a sliding window its last ``W`` tokens, chunked
        local the tokens of its current chunk, mamba one state block."""
        total = 0
        for kind, p, bpt in self._att:
            if kind == 0:
                a = c
            elif kind == 2:
                a = c - ((c - 1) // p) * p if c > 0 else 0
            else:
                a = c if c < p else p
            total += a * bpt
        return total

    def _attended_runs(self, running: list[_Live], k: int) -> list[int]:
        """:meth:`_attended` summed over ``running`` for decode steps 0..k-1
        (context ``num_computed + 1 + s``), vectorised; exact integers."""
        import numpy as np

        c = (np.fromiter((r.num_computed + 1 for r in running), dtype=np.int64, count=len(running))[:, None]
             + np.arange(k, dtype=np.int64)[None, :])
        tot = np.zeros(k, dtype=np.int64)
        for kind, p, bpt in self._att:
            if kind == 0:
                a = c
            elif kind == 2:
                a = c - ((c - 1) // p) * p
            else:
                a = np.minimum(c, p)
            tot += (a * bpt).sum(axis=0)
        return [int(x) for x in tot]

    # -- sampling and rows --------------------------------------------------------------

    def _sample(self, force: bool = False) -> None:
        now = self.env.now
        if not force and now < self.next_tick:
            return
        cpu = self.cpu
        gpu = self.gpu
        present = pending = loading = free = 0
        if cpu is not None:
            pending = cpu.num_pending
            loading = cpu.num_loading
            present = cpu.num_used - pending
            free = cpu.capacity - cpu.num_used
        wfk = sum(1 for r in self.skipped if r.status == WAITING_FOR_KV)
        self.rec.add("occupancy", (now, present, pending, loading, free, gpu.pool.num_used,
                                   gpu.pool.num_cached, len(self.running),
                                   len(self.waiting) + len(self.skipped) - wfk, wfk,
                                   len(self.h2d), len(self.d2h)))
        iv = self.cfg.occupancy_interval_s
        self.next_tick = (math.floor(now / iv) + 1) * iv

    def _write_request(self, r: _Live) -> None:
        s = self.summary
        status = _STATUS[r.status]
        if r.status == FINISHED:
            s.requests_finished += 1
            s.output_tokens += r.generated
            if r.first_token_s is not None:
                s.ttft_s.append(r.first_token_s - r.req.arrival_s)
                if r.generated > 1 and r.finish_s is not None:
                    s.tpot_s.append((r.finish_s - r.first_token_s) / (r.generated - 1))
        elif r.status == REJECTED:
            s.requests_rejected += 1
        self.rec.add("requests", (
            r.req_id, r.req.session_id, status, r.req.arrival_s, r.scheduled_s, r.first_token_s,
            r.finish_s,
            r.num_prompt_tokens, r.generated, r.gpu_hit_tokens, r.cpu_hit_tokens, r.cpu_reload_tokens,
            r.computed_tokens,
            r.recomputed_tokens, r.loaded_bytes, r.stored_bytes, r.load_jobs, r.store_jobs,
            r.deferrals, r.preemptions, r.crash))

    # -- run ----------------------------------------------------------------------------

    def run(self) -> RunResult:
        env = self.env
        env.process(self._arrivals())
        engine = env.process(self._engine())
        env.run(until=engine)
        env.run()   # let lifecycles write their rows
        s = self.summary
        s.sim_time_s = self.end_s
        s.h2d_busy_s = self.h2d.busy_s
        s.d2h_busy_s = self.d2h.busy_s
        if self.conn is not None:
            s.store_rejections = self.conn.store_rejections
        if self.progress is not None:
            self.progress(self._finished_count, env.now)
        self.rec.flush()
        status: Literal["ok", "stopped_on_crash", "time_limit"] = self.stop_reason or "ok"
        if status == "ok":
            self._check_invariants()
        return RunResult(status, s, self.reproducers)

    def _check_invariants(self) -> None:
        problems: list[str] = []
        if self.live:
            problems.append(f"{len(self.live)} requests neither finished nor rejected")
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
        if self.xfers or self.deferred_stores:
            problems.append(f"{len(self.xfers)} transfers never completed")
        if problems:
            raise InvariantViolation("; ".join(problems))


def _salt(req_id: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little") >> 1


def _attention_terms(layout: Layout) -> list[tuple[int, int, int]]:
    """Per group: (kind code, window / chunk / state tokens, KV bytes per token).
    Kind codes: 0 full, 1 sliding window, 2 chunked local, 3 mamba. Without
    byte figures every group weighs 1 byte per token."""
    from sim.model.layout import GroupKind

    out = []
    sized = all(layout.kv_bytes_per_block(g) for g in range(len(layout.groups)))
    for g, spec in enumerate(layout.groups):
        bpt = max(1, (layout.kv_bytes_per_block(g) or 0) // spec.tokens_per_block) if sized else 1
        if spec.kind is GroupKind.FULL:
            out.append((0, 0, bpt))
        elif spec.kind is GroupKind.SLIDING_WINDOW:
            assert spec.window is not None
            out.append((1, spec.window, bpt))
        elif spec.kind is GroupKind.CHUNKED_LOCAL:
            assert spec.attention_chunk is not None
            out.append((2, spec.attention_chunk, bpt))
        else:
            out.append((3, spec.tokens_per_block, bpt))
    return out


def simulate(config: EngineConfig, requests: Iterable[Request], recorder: Recorder, *,
             progress: Callable[[int, float], None] | None = None) -> RunResult:
    """Replay ``requests`` through the engine; rows go to ``recorder``.

    Args:
        config: the engine, caches, costs and links.
        requests: the workload, in arrival order (read lazily).
        recorder: receives the rows of every table; flushed before returning.
        progress: called with (requests finished, simulated seconds) now and then.

    Returns:
        The run's status and summary.

    Raises:
        InvariantViolation: an end-of-run invariant failed (a simulator bug).
    """
    return _Engine(config, requests, recorder, progress).run()

