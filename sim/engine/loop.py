"""The SimPy engine: arrivals, request lifecycles, the engine step loop, transfer links.

What it models
    One vLLM engine with the OffloadingConnector, replaying a request stream
    in simulated time (spec §7, §8.3, §9). This is the only module with a
    clock; the scheduling policy (FCFS waiting queue, token budget, chunked
    prefill, preemption, admission, the deadlock breaker) is the clock-free
    :class:`~sim.model.scheduler.Scheduler`, which owns the caches and the
    connector (:mod:`sim.model.gpu_cache`, :mod:`sim.model.connector`,
    :mod:`sim.model.cpu_cache`).

    Processes
        * *arrivals*: reads the workload lazily and starts one *lifecycle*
          process per request once vLLM's engine core would have it: at its
          arrival time plus, for a text prompt (``costs.tokenize``), its
          tokenization by the OpenAI server (``prompt_tokenize_s_per_token``),
          plus the hashing of its prompt (``prompt_hash_s_per_block`` per hash
          block, the roofline's host figure); each stage takes the requests
          one after another, as vLLM's tokenizer worker and input thread do,
          so a burst queues (:class:`ArrivalPath`); the TTFT counts from the
          arrival;
        * *lifecycle* (one per request): hands the request to the scheduler
          (it joins the waiting queue), wakes the engine, and waits for its
          end (finished, rejected, or the run stopped), then writes the
          request's row;
        * *engine*: the step loop below;
        * *links* (:mod:`sim.engine.links`): one per direction (``h2d``
          loads, ``d2h`` stores), each a serial in-order queue; a job takes
          ``latency + pieces x piece overhead + bytes / bandwidth``, slowed
          by the duplex factor while the other direction is busy.
        * with secondary tiers (:mod:`sim.model.tiers`), one *tier link* per
          tier: the promotions a step's lookups started are submitted right
          after ``schedule`` (vLLM flushes them at the end of its schedule
          call), the cascades of the stores completed in a step at the step's
          end; a completed tier job is applied at the start of the next step
          (before ``schedule``, as vLLM polls its tiers before a lookup), so a
          request deferred for a promotion is admitted in the first step
          after the promotion ended.

    One engine step (vLLM ``schedule`` -> workers -> ``update_from_output``)
        1. ``Scheduler.schedule``: the step's batch, admissions, preemptions,
           loads, stores and flush fences (see :mod:`sim.model.scheduler`);
        2. the worker: flushed stores are submitted and waited for, then the
           stores deferred from the previous step are submitted; the
           scheduler's per-block time passes (``before_loads_s``: part of the
           step's time, or the whole time of a step that only admits loads),
           then this step's loads are submitted; the forward pass takes the
           rest of the cost model's step time; this step's stores are deferred
           to the next step (spec §8.3);
        3. ``Scheduler.update_from_output``: computed tokens advance, tokens
           are sampled, stop conditions finish requests, then the transfer
           completions polled at the step's end (in completion order, h2d
           before d2h on ties) update the CPU cache and mark loaded requests
           ready;
        4. the step's row, an occupancy sample when one is due; the CPU
           cache's event log is drained (not recorded).

    Order of same-time events (defined here, once)
        At one simulated instant: (1) transfer completions (``URGENT``), in
        completion order per link, h2d before d2h on ties; (2) arrivals
        (SimPy's ``NORMAL``), in trace order; (3) the engine's step boundary
        (``LATE``). So a step that starts at ``t`` sees every arrival and
        completion at ``t``; a completion during a step is reported at its end.

    Decode fast-forward
        When every running request is decoding, no request finishes, the
        waiting queue cannot change the batch, no store is due
        (``Scheduler.can_fast_forward``), no deferred store or unreported
        completion is left, and no arrival, transfer completion or occupancy
        sample falls before a step start, ``k`` decode steps are executed in
        one go: only requests that cross a block boundary do work, in the
        exact order stepping would, and the simulated clock advances step by
        step with the same floating point operations. Results are identical
        to stepping (tested).

Simplifications
    * See :mod:`sim.model.scheduler` for the policy's.
    * With the ``belady`` eviction policy the whole workload is read before
      the run starts (:mod:`sim.model.future` needs its future uses), so
      memory grows with the trace for that policy only.
    * An idle engine does not spin: it sleeps until an arrival or a transfer
      completion (vLLM polls with empty steps; no state changes in between).
    * vLLM's input thread hashes prompts while the main thread steps; the
      model lets it run beside the steps at full speed (no contention for the
      interpreter lock) and leaves out the hashing of output tokens.

Invariants (checked at the end of a completed run; :class:`InvariantViolation`)
    * the scheduler's (:meth:`~sim.model.scheduler.Scheduler.invariant_problems`):
      every request finished or was rejected, no GPU block referenced, no CPU
      chunk pending or loading (so no promotion or cascade holds one), the
      connector empty, the tiers' own invariants;
    * every transfer and every tier job completed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import simpy

from sim.engine.gcpolicy import rare_collections
from sim.engine.links import LATE, At, CopyHooks, Link, Proc, TierLink, TierLinkModel, Transfer
from sim.engine.metrics import (
    EventRow,
    OccupancyRow,
    Recorder,
    RequestRow,
    RunSummary,
    StepRow,
    TierOccupancyRow,
    TransferRow,
)
from sim.errors import THE_SCENARIO, InputError
from sim.model.connector import LoadPlan, StorePlan
from sim.model.costs import ZERO_TRANSFER, TransferModel, before_loads_s
from sim.model.future import FutureUses
from sim.model.request import LiveRequest, Request, RequestStatus
from sim.model.scheduler import (
    InvariantViolation,
    ModelEvent,
    ReproducerSnapshot,
    Scheduler,
    SchedulerConfig,
    SchedulerHooks,
    SchedulerStats,
    TransferJob,
)
from sim.model.tiers import PRIMARY_LABEL, TieredCache, TierJob

__all__ = ["CopyPathConfig", "Engine", "EngineConfig", "InvariantViolation", "SimulationResult",
           "simulate"]

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


def one_event_delay(start: float, durations: Sequence[float]) -> float | None:
    """The delay of one event that ends at the time where events of ``durations``, one
    after the other from ``start``, end (the clock adds each delay to its time, in
    floating point), or None when no delay added to ``start`` gives that time."""
    end = start
    for d in durations:
        end += d
    delay = end - start
    return delay if start + delay == end else None


@dataclass(frozen=True)
class EngineConfig(SchedulerConfig):
    """Everything the engine needs, already validated (see :mod:`sim.io.scenario`): the
    scheduler's share (:class:`~sim.model.scheduler.SchedulerConfig`, which the engine
    hands to the scheduler as it is) plus the links, sampling, time limit and copy path."""

    h2d: TransferModel = ZERO_TRANSFER
    d2h: TransferModel = ZERO_TRANSFER
    occupancy_interval_s: float = 1.0
    max_sim_time_s: float | None = None
    #: stop the run once this many requests wait at a step boundary (None: never)
    stop_at_waiting: int | None = None
    copy_path: CopyPathConfig | None = None
    #: who decides: kvsim's model, or the installed vLLM (:mod:`sim.engine.vllm_engine`)
    decisions: Literal["model", "vllm", "differential"] = "model"
    #: one link per secondary tier (``tiers``), same order
    tier_links: tuple[TierLinkModel, ...] = ()
    #: bytes a tier job moves per chunk: the CPU slot (vLLM: the primary tier's row)
    tier_chunk_bytes: int = 0
    #: seconds vLLM's engine core spends hashing a new request's prompt, per hash block,
    #: before the scheduler sees the request (the roofline's ``host.per_hashed_block_s``; 0: none)
    prompt_hash_s_per_block: float = 0.0
    #: seconds vLLM's OpenAI server spends tokenizing a text prompt, per prompt token, before
    #: the engine core gets the request (``costs.tokenize``: ``host.tokenize_token_s``; 0: token ids)
    prompt_tokenize_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.gpu_blocks < 2:
            raise ValueError("gpu_blocks must be >= 2 (one is the null block)")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.occupancy_interval_s <= 0:
            raise ValueError("occupancy_interval_s must be > 0")
        if self.stop_at_waiting is not None and self.stop_at_waiting < 1:
            raise ValueError("stop_at_waiting must be >= 1")
        if len(self.tier_links) != len(self.tiers):
            raise ValueError(f"{len(self.tiers)} tiers but {len(self.tier_links)} tier links")


#: the occupancy rows one idle gap may take (an emptied engine waiting for its next request):
#: beyond, the run is refused (:meth:`Engine._check_idle_gap`); about 11.6 days at 1 s
MAX_IDLE_SAMPLES = 1_000_000

#: why a run stopped before its end (``diverged``: the differential mode's first divergence;
#: ``queue_limit``: the waiting queue reached ``stop_at_waiting``)
StopReason = Literal["stopped_on_crash", "time_limit", "diverged", "queue_limit"]


@dataclass
class SimulationResult:
    """What one simulation produced: how it ended, its summary figures and its reproducer
    snapshots (:class:`~sim.tools.run.RunOutcome` is the run folder written from it,
    :class:`~sim.io.results.RunResults` a run folder read back)."""

    status: Literal["ok"] | StopReason
    summary: RunSummary
    #: what the first modelled crashes and hazards met (written as check/1 files by sim.io.check)
    reproducers: list[ReproducerSnapshot] = field(default_factory=list)


class ArrivalPath:
    """When the scheduler sees each request, in arrival order: vLLM's OpenAI server tokenizes
    a text prompt (``prompt_tokenize_s_per_token`` per prompt token; its one tokenizer worker,
    vLLM's default ``renderer_num_workers = 1``, takes the prompts one after another), then the
    engine core's input thread hashes it (``prompt_hash_s_per_block`` per hash block, one
    request after another). Each stage starts when the request reaches it or when the stage
    is done with the previous request, whichever is later; the TTFT counts from the arrival."""

    __slots__ = ("hash_s", "hashed_until", "tokenize_s", "tokenized_until")

    def __init__(self, tokenize_s_per_token: float, hash_s_per_block: float) -> None:
        self.tokenize_s = tokenize_s_per_token
        self.hash_s = hash_s_per_block
        self.tokenized_until = 0.0
        self.hashed_until = 0.0

    def seen_at(self, req: Request) -> float:
        """When the scheduler sees ``req`` (call once per request, in arrival order)."""
        t = req.arrival_s
        if self.tokenize_s:
            t = self.tokenized_until = max(t, self.tokenized_until) + self.tokenize_s * req.prompt_tokens
        if self.hash_s:
            t = self.hashed_until = (max(t, self.hashed_until)
                                     + self.hash_s * (req.prompt_tokens // req.tokens_per_hash))
        return t


class Engine:
    """State and processes of one simulated engine.

    Args:
        cfg: the engine.
        requests: the workload, in arrival order (read lazily).
        rec: receives the rows.
        progress: called with (requests finished, simulated seconds) now and then.
    """

    def __init__(self, cfg: EngineConfig, requests: Iterable[Request], rec: Recorder,
                 progress: Callable[[int, float], None] | None = None) -> None:
        self.cfg = cfg
        self.rec = rec
        self.progress = progress
        self.env = simpy.Environment()
        self.layout = cfg.layout
        hooks = SchedulerHooks(event=self._model_event, release=self._release)
        future: FutureUses | None = None
        if cfg.needs_future:
            # the clairvoyant policy reads the whole workload first (sim.model.future)
            requests = list(requests)
            future = FutureUses(requests, cfg.layout, prompt_only=cfg.offload_prompt_only)
        self.sched = Scheduler(cfg, hooks, future)
        self.gpu, self.cpu, self.conn = self.sched.gpu, self.sched.cpu, self.sched.conn
        self.summary = RunSummary()
        self.completed: list[Transfer] = []
        self.copy: Any = None
        copy_fn: Callable[[Transfer], float] | None = None
        measured = False
        if cfg.copy_path is not None and cfg.offloading:
            from sim.engine.copypath import CopyPath  # noqa: PLC0415 -- torch is an optional extra

            cp = cfg.copy_path
            self.copy = CopyPath(cfg.layout, cfg.gpu_blocks, max(1, cfg.cpu_capacity_chunks), mode=cp.mode,
                                 device=cp.device, memory_limit_bytes=cp.memory_limit_bytes)
            data = CopyHooks(self.copy, self.gpu, self.conn, self.layout, self._integrity)
            copy_fn = data.run
            measured = cp.timing == "measured"
            hooks.computed, hooks.promoted, hooks.load_done = data.write, data.verify_read, data.verify_load
        self.h2d = Link(self.env, "h2d", cfg.h2d, self._completed, copy_fn, measured)
        self.d2h = Link(self.env, "d2h", cfg.d2h, self._completed, copy_fn, measured)
        self.h2d.other, self.d2h.other = self.d2h, self.h2d
        self.xfers: dict[int, Transfer] = {}
        self.deferred_stores: list[Transfer] = []
        #: the CPU manager with its secondary tiers, their links and jobs (None / empty: no tier)
        self.tiered: TieredCache | None = self.cpu if isinstance(self.cpu, TieredCache) else None
        self.tier_links: list[TierLink] = []
        if self.tiered is not None:
            self.tier_links = [TierLink(self.env, c.label, m, self._tier_done)
                               for c, m in zip(self.tiered.counters, cfg.tier_links, strict=True)]
        self.tier_xfers: dict[int, tuple[Transfer, TierJob]] = {}
        self.tier_completed: list[Transfer] = []
        #: per tier, (time, chunks held) at every occupancy sample
        self.tier_occupancy: list[list[tuple[float, int]]] = [[] for _ in self.tier_links]
        self._done: dict[str, simpy.Event] = {}
        self.step_no = 0
        self.next_tick = 0.0
        self.stop_reason: StopReason | None = None
        #: called with each step's plan right after ``schedule`` (the seam of the
        #: differential mode, :mod:`sim.tools.differential`); None: nothing watches
        self.on_schedule: Callable[[Any], None] | None = None
        self._requests: Iterator[Request] = iter(requests)
        self.next_arrival_s = math.inf
        self.arrivals_done = False
        self._idle: simpy.Event | None = None
        self._finished_count = 0
        self._stop = self.env.event()
        self.end_s = 0.0
        #: (H2D, D2H) busy seconds up to ``end_s``
        self.busy_at_end = (0.0, 0.0)

    # -- processes ------------------------------------------------------------------

    def _arrivals(self) -> Proc:
        """Requests reach the scheduler in arrival order, each once vLLM has tokenized
        (text prompts) and hashed its prompt (:class:`ArrivalPath`)."""
        env = self.env
        last = 0.0
        path = ArrivalPath(self.cfg.prompt_tokenize_s_per_token, self.cfg.prompt_hash_s_per_block)
        for req in self._requests:
            if req.arrival_s < last:
                raise ValueError(f"request {req.req_id} arrives at {req.arrival_s} s, before "
                                 f"the previous one ({last} s): the stream must be sorted")
            last = req.arrival_s
            ready = path.seen_at(req)
            self.next_arrival_s = ready
            if ready > env.now:
                yield env.timeout(ready - env.now)
            if self.stop_reason is not None:
                break
            if self.summary.first_arrival_s is None:   # the arrival window: requests that did arrive
                self.summary.first_arrival_s = last
            self.summary.last_arrival_s = last
            env.process(self._lifecycle(req))
        self.next_arrival_s = math.inf
        self.arrivals_done = True
        self.kick()

    def _lifecycle(self, req: Request) -> Proc:
        seen = self.env.now   # the scheduler sees it now: after its tokenization and hashing
        r = self.sched.add_request(req, seen)
        # on arrival: longer than max_model_len (by value: mypy would narrow r.status for good)
        if r.status.value == RequestStatus.REJECTED.value:
            self._write_request(r, seen)
            return
        done = self._done[r.req_id] = self.env.event()
        self.kick()
        yield done | self._stop
        if r.status is not RequestStatus.FINISHED and r.status is not RequestStatus.REJECTED:
            r.status = RequestStatus.UNFINISHED
        self._write_request(r, seen)

    def _release(self, r: LiveRequest) -> None:
        """The scheduler is done with ``r``: its lifecycle writes its row."""
        self._done.pop(r.req_id).succeed()

    def _completed(self, x: Transfer) -> None:
        self.completed.append(x)
        self.kick()

    def kick(self) -> None:
        """Wake the idle engine (something happened that a step may act on)."""
        if self._idle is not None and not self._idle.triggered:
            self._idle.succeed()

    def _engine(self) -> Proc:
        env = self.env
        yield At(env, 0, LATE)   # arrivals at time 0 come first
        while True:
            if self.cfg.max_sim_time_s is not None and env.now >= self.cfg.max_sim_time_s:
                self.stop_reason = "time_limit"
            if self.stop_reason is not None:
                break
            busy = yield from self._step()
            if self.stop_reason is None:
                self._check_queue_limit()
            if self.stop_reason is not None:
                break
            if busy:
                continue
            if self.arrivals_done and self._drained():
                break
            yield from self._wait_idle()
        self._sample(force=True)
        self.end_s = env.now
        # the links' busy time of the jobs completed by the end, the transfers table's: a job
        # still in flight when a run stops early (time or queue limit, a stop on crash)
        # completes afterwards, while the lifecycles finish, and counts in neither
        self.busy_at_end = (self.h2d.busy_s, self.d2h.busy_s)
        if not self._stop.triggered:
            self._stop.succeed()

    def _check_queue_limit(self) -> None:
        """Stop once ``stop_at_waiting`` requests wait (an engine that far behind
        the trace is overloaded: what comes after measures the trace's length)."""
        limit = self.cfg.stop_at_waiting
        if limit is None:
            return
        waiting = self.sched.num_waiting
        if waiting >= limit:
            self.stop_reason = "queue_limit"
            self.summary.stopped_waiting = waiting

    def _drained(self) -> bool:
        """Nothing left to do once arrivals are over: no request, no transfer in flight or due."""
        return not self.sched.requests and not self.xfers and not self.deferred_stores and not self.tier_xfers

    def _check_idle_gap(self) -> None:
        """Refuse an idle gap that would take more than :data:`MAX_IDLE_SAMPLES` occupancy
        rows (one per ``occupancy_interval_s`` until the next arrival, or the time limit):
        a trace or rate whose next request comes that long after the engine emptied would
        keep the run writing identical rows for hours. Bad input, said before the rows."""
        if not self._drained():
            return
        limit = self.cfg.max_sim_time_s
        end = min(self.next_arrival_s, math.inf if limit is None else limit)
        iv = self.cfg.occupancy_interval_s
        rows = (end - self.env.now) / iv
        if math.isfinite(rows) and rows > MAX_IDLE_SAMPLES:
            raise InputError(
                THE_SCENARIO, "output.occupancy_interval_s",
                f"the next request arrives {end - self.env.now:.3g} s after the engine went idle at "
                f"{self.env.now:.3g} s: {rows:.3g} occupancy rows of {iv:g} s while nothing happens",
                f"idle gaps of at most {MAX_IDLE_SAMPLES:,} intervals: a larger output.occupancy_interval_s "
                f"(at least {(end - self.env.now) / MAX_IDLE_SAMPLES:.3g} s), a denser workload "
                "(rate, time_scale), or output.max_sim_time_s")

    def _wait_idle(self) -> Proc:
        """Sleep until kicked (or the time limit), still taking the occupancy
        samples that fall due meanwhile (an idle gap is drawn as it is, not as
        a ramp between two distant samples); a sample wakes no step."""
        env = self.env
        limit = self.cfg.max_sim_time_s
        self._check_idle_gap()
        self._idle = idle = env.event()
        while True:
            due = self.next_tick
            waits: list[simpy.Event] = [idle, env.timeout(max(0.0, due - env.now))]
            if limit is not None:
                waits.append(env.timeout(max(0.0, limit - env.now)))
            yield simpy.AnyOf(env, waits)
            # let every other event of this instant happen first
            yield At(env, 0, LATE)
            if idle.triggered or (limit is not None and env.now >= limit):
                break
            # the tick fell due (``now`` may be an ulp short of it: sample anyway)
            self._sample(force=True)
            if self.next_tick <= due:
                self.next_tick = due + self.cfg.occupancy_interval_s
        self._idle = None

    # -- one step ---------------------------------------------------------------------

    def _step(self) -> Generator[simpy.Event, Any, bool]:
        """One engine step; returns whether it did anything."""
        env, sched = self.env, self.sched
        tier_done = self._apply_tier_done() if self.tiered is not None else 0
        if not self.deferred_stores and not self.completed and sched.can_fast_forward():
            k = yield from self._fast_forward()
            if k:
                return True
        plan = sched.schedule(env.now)
        if self.on_schedule is not None:
            self.on_schedule(plan)
        if self.tiered is not None:
            self._start_tier_jobs()     # this step's promotions (vLLM: at the end of schedule)
        if plan.stopped:
            self.stop_reason = "stopped_on_crash"
            return False
        new_stores = [self._transfer(j) for j in plan.stores]
        start = env.now
        yield from self._submit_stores(plan.flush, new_stores)
        # the scheduler's per-block time comes before the step's loads are submitted
        cost = self.cfg.step_cost
        pre = before_loads_s(cost, plan.load, bool(plan.scheduled))
        if pre:
            yield At(env, pre, LATE)
        for j in plan.loads:
            self.h2d.submit(self._transfer(j))
        if plan.scheduled:
            dur = cost.time(plan.load)
            yield At(env, max(0.0, dur - pre) if pre else dur, LATE)
        self.deferred_stores.extend(x for x in new_stores if x.job_id not in plan.flush)
        out = sched.update_from_output(env.now, plan, self._poll())
        self._count_finished(len(out.finished))
        nsteps = 1 if plan.scheduled else 0
        self.summary.steps += nsteps
        self.summary.peak_waiting = max(self.summary.peak_waiting, sched.num_waiting)
        did = plan.busy or bool(self.deferred_stores) or out.polled > 0 or tier_done > 0
        if did:
            self.step_no += 1
            self.summary.step_rows += 1
            self.rec.add(StepRow(self.step_no - 1, nsteps, start, env.now - start, plan.prefill_tokens,
                                 plan.decode_seqs, plan.context_tokens, len(sched.running), sched.num_waiting,
                                 len(plan.loads), len(plan.stores), len(plan.preempted),
                                 self.gpu.pool.num_used))
        self._end_step()
        return did

    def _submit_stores(self, flush: frozenset[int], new_stores: list[Transfer]) -> Proc:
        """Submit the deferred stores (and the new ones flushed now); wait for the flushed."""
        env = self.env
        if flush:
            for x in new_stores:
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
                yield At(env, 0, LATE)
        else:
            for x in self.deferred_stores:
                self.d2h.submit(x)
            self.deferred_stores = []

    def _fast_forward(self) -> Generator[simpy.Event, Any, int]:
        """Run ``k >= 2`` pure decode steps at once; returns k (0: not possible)."""
        env, cfg, sched = self.env, self.cfg, self.sched
        horizon = min(self.next_arrival_s, self.h2d.next_completion_s, self.d2h.next_completion_s,
                      max(self.next_tick, env.now), *(t.next_completion_s for t in self.tier_links))
        if cfg.max_sim_time_s is not None:
            horizon = min(horizon, cfg.max_sim_time_s)
        ff = sched.plan_fast_forward(env.now, horizon)
        if ff is None:
            return 0
        start = env.now
        delay = one_event_delay(start, ff.durations)
        if delay is not None:
            # One event for the k steps. Stepping would make one per step, but nothing
            # else happens until the last one: every other event falls at or after the
            # horizon, and each step starts before it, so every step is applied before
            # any other event in both ways; their order at the end is the same too
            # (what else falls there was scheduled before the run or after the last
            # step started).
            sched.fast_forward_all(ff)
            yield At(env, delay, LATE)
        else:   # no one delay lands on the float that stepping reaches
            for s, dur in enumerate(ff.durations):
                sched.fast_forward_step(ff, s)
                yield At(env, dur, LATE)
        sched.finish_fast_forward(ff)
        k, n = ff.k, len(ff.running)
        self.step_no += k
        self.summary.steps += k
        self.summary.step_rows += 1
        self.rec.add(StepRow(self.step_no - k, k, start, env.now - start, 0, n, ff.context0, n,
                             sched.num_waiting, 0, 0, 0, self.gpu.pool.num_used))
        sched.apply_transfers(self._poll())
        self._end_step()
        return k

    def _end_step(self) -> None:
        if self.tiered is not None:
            self._start_tier_jobs()     # cascades of the stores completed this step
        self._sample()
        if self.cpu is not None:
            self.cpu.take_events()    # not recorded: drained so that memory stays bounded

    def _count_finished(self, n: int) -> None:
        for _ in range(n):
            self._finished_count += 1
            if self.progress is not None and self._finished_count % 100 == 0:
                self.progress(self._finished_count, self.env.now)

    # -- transfers ---------------------------------------------------------------------

    def _transfer(self, j: TransferJob) -> Transfer:
        x = Transfer(j.job_id, j.req_id, j.direction, j.chunks, j.blocks, j.nbytes, plan=j.plan,
                     pieces=j.pieces)
        self.xfers[j.job_id] = x
        return x

    def _poll(self) -> list[LoadPlan | StorePlan]:
        """The transfers completed by now (end of a step), in completion order
        (h2d first on ties): their rows; their plans for the scheduler."""
        if not self.completed:
            return []
        done = sorted(self.completed, key=lambda x: (x.end_s, x.direction != "h2d"))
        self.completed.clear()
        plans: list[LoadPlan | StorePlan] = []
        for x in done:
            del self.xfers[x.job_id]
            self.rec.add(TransferRow(x.job_id, x.req_id, x.direction, x.chunks, x.blocks, x.nbytes,
                                     x.submit_s, x.start_s, x.end_s, x.flushed))
            assert x.plan is not None
            plans.append(x.plan)
            x.plan = None
        return plans

    # -- secondary tiers ------------------------------------------------------------------

    def _start_tier_jobs(self) -> None:
        """Submit the tier jobs the model created (cascades, then promotions)."""
        assert self.tiered is not None
        bpc = self.layout.blocks_per_chunk
        for job in self.tiered.take_jobs():
            link = self.tier_links[job.tier]
            what = "read" if job.is_promotion else "write"
            n = len(job.keys)
            x = Transfer(job.job_id, "", f"{link.name}:{what}", n, n * bpc, n * self.cfg.tier_chunk_bytes)
            self.tier_xfers[job.job_id] = (x, job)
            link.submit(x, job.is_promotion)

    def _tier_done(self, x: Transfer) -> None:
        self.tier_completed.append(x)
        self.kick()

    def _apply_tier_done(self) -> int:
        """Apply the tier jobs completed by now, in completion order (their rows too)."""
        if not self.tier_completed:
            return 0
        assert self.tiered is not None
        done, self.tier_completed = self.tier_completed, []
        for x in done:
            _, job = self.tier_xfers.pop(x.job_id)
            self.tiered.complete_job(job.job_id)
            self.rec.add(TransferRow(x.job_id, x.req_id, x.direction, x.chunks, x.blocks, x.nbytes,
                                     x.submit_s, x.start_s, x.end_s, x.flushed))
        return len(done)

    def _tier_sample(self, now: float) -> None:
        """Per-tier occupancy (chunks held): a row of the ``tiers`` table, and the
        samples of the summary's time-weighted figures."""
        t = self.tiered
        assert t is not None
        for i, occ in enumerate(self.tier_occupancy):
            ready, pending, loading, _ = t.tier_state(i)
            used = ready + pending + loading
            occ.append((now, used))
            self.rec.add(TierOccupancyRow(now, t.counters[i].label, ready, pending, loading, used,
                                          t.specs[i].capacity_chunks))

    def _tier_figures(self) -> dict[str, Any]:
        """The summary's ``tiers`` section (vLLM's tiering metric names, per tier label)."""
        t = self.tiered
        assert t is not None
        size = self.cfg.tier_chunk_bytes
        secondary: list[dict[str, Any]] = []
        prompt = max(1, self.sched.stats.prompt_tokens)
        out: dict[str, Any] = {
            "primary": {"label": PRIMARY_LABEL, "chunk_queries": t.primary_queries,
                        "chunk_hits": t.primary_hits, "resident_hit_tokens": t.resident_hit_tokens,
                        "resident_hit_rate": t.resident_hit_tokens / prompt},
            "promotion_allocation_failures": t.promotion_allocation_failures,
            "secondary": secondary,
        }
        for i, (c, spec, link) in enumerate(zip(t.counters, t.specs, self.tier_links, strict=True)):
            occ = self.tier_occupancy[i]
            area = sum(n0 * (t1 - t0) for (t0, n0), (t1, _) in itertools.pairwise(occ))
            span = occ[-1][0] - occ[0][0] if occ else 0.0
            secondary.append({
                "label": c.label, "kind": spec.kind, "capacity_chunks": spec.capacity_chunks,
                "policy": str(spec.policy),
                "chunk_queries": c.chunk_queries, "chunk_hits": c.chunk_hits,
                "promotion_jobs": c.promotion_jobs, "cascade_jobs": c.cascade_jobs,
                "read_bytes": c.read_chunks * size, "read_time": link.read_s,
                "write_bytes": c.write_chunks * size, "write_time": link.write_s,
                "promoted_chunks_loaded": c.promoted_chunks_loaded,
                "promoted_hit_tokens": c.promoted_hit_tokens,
                "promoted_hit_rate": c.promoted_hit_tokens / prompt,
                "evictions": c.evictions, "store_rejections": c.store_rejections,
                "occupancy_chunks": {"mean": area / span if span > 0 else (occ[-1][1] if occ else 0),
                                     "peak": max((n for _, n in occ), default=0),
                                     "end": occ[-1][1] if occ else 0},
                "utilisation": link.busy_s / self.end_s if self.end_s > 0 else None,
            })
        return out

    # -- sampling and rows --------------------------------------------------------------

    def _model_event(self, ev: ModelEvent) -> None:
        self.rec.add(EventRow(*ev))

    def _integrity(self, req_id: str, when: str, group: int, chunk: int, message: str) -> None:
        self.summary.integrity_violations += 1
        self.rec.add(EventRow(self.env.now, "integrity", when, req_id, group, chunk, message))

    def _sample(self, force: bool = False) -> None:
        now = self.env.now
        if not force and now < self.next_tick:
            return
        cpu, gpu, sched = self.cpu, self.gpu, self.sched
        present = pending = loading = free = 0
        if cpu is not None:
            pending = cpu.num_pending
            loading = cpu.num_loading
            present = cpu.num_used - pending
            free = cpu.capacity - cpu.num_used
        wfk = sched.num_waiting_for_kv
        self.summary.queue_t.append(now)
        self.summary.queue_n.append(sched.num_waiting)
        if self.tiered is not None:
            self._tier_sample(now)
        self.rec.add(OccupancyRow(now, present, pending, loading, free, gpu.pool.num_used,
                                  gpu.pool.num_cached, len(sched.running), sched.num_waiting - wfk, wfk,
                                  len(self.h2d), len(self.d2h)))
        iv = self.cfg.occupancy_interval_s
        self.next_tick = (math.floor(now / iv) + 1) * iv

    def _write_request(self, r: LiveRequest, seen_s: float) -> None:
        s = self.summary
        ttft = tpot = None
        if r.first_token_s is not None:
            ttft = r.first_token_s - r.req.arrival_s
            if r.generated > 1 and r.finish_s is not None:
                tpot = (r.finish_s - r.first_token_s) / (r.generated - 1)
        if r.status is RequestStatus.FINISHED:
            s.requests_finished += 1
            s.output_tokens += r.generated
            s.finished_prompt_tokens += r.num_prompt_tokens
            if ttft is not None:
                s.ttft_s.append(ttft)
                if tpot is not None:
                    s.tpot_s.append(tpot)
        elif r.status is RequestStatus.REJECTED:
            s.requests_rejected += 1
        why = r.deferral_reasons or {}
        self.rec.add(RequestRow(
            r.req_id, r.req.session_id, r.status.value, r.req.arrival_s, seen_s, r.scheduled_s,
            r.first_token_s, r.finish_s, ttft, tpot, r.num_prompt_tokens, r.generated, r.gpu_hit_tokens,
            r.cpu_hit_tokens, r.cpu_reload_tokens, r.computed_tokens, r.recomputed_tokens, r.loaded_bytes,
            r.stored_bytes, r.load_jobs, r.store_jobs, r.deferrals, why.get("in_flight_jobs", 0),
            why.get("pending_or_retry", 0), why.get("being_loaded", 0), r.deferred_s, r.preemptions,
            r.crash))

    # -- run ----------------------------------------------------------------------------

    def start(self) -> simpy.Process:
        """Start the arrivals and the step loop; returns the step loop's process."""
        self.env.process(self._arrivals())
        return self.env.process(self._engine())

    def run(self) -> SimulationResult:
        with rare_collections():    # the heap is large and long-lived (sim/engine/gcpolicy.py)
            engine = self.start()
            self.env.run(until=engine)
            self.env.run()   # let lifecycles write their rows
            return self.finish()

    def finish(self) -> SimulationResult:
        """The summary, the rows flushed, the end-of-run invariants (after :meth:`run`'s loop)."""
        env = self.env
        s = self.summary
        stats = self.sched.stats
        for f in fields(SchedulerStats):
            setattr(s, f.name, getattr(stats, f.name))
        s.sim_time_s = self.end_s
        s.h2d_busy_s, s.d2h_busy_s = self.busy_at_end
        if self.conn is not None:
            s.store_rejections = self.conn.store_rejections
        if self.tiered is not None:
            s.tiers = self._tier_figures()
        if self.progress is not None:
            self.progress(self._finished_count, env.now)
        self.rec.flush()
        status: Literal["ok"] | StopReason = self.stop_reason or "ok"
        if status == "ok":
            problems = self.sched.invariant_problems()
            if self.xfers or self.deferred_stores:
                problems.append(f"{len(self.xfers)} transfers never completed")
            if self.tier_xfers or (self.tiered is not None and self.tiered.num_tier_jobs):
                problems.append(f"{len(self.tier_xfers)} tier jobs never completed")
            if problems:
                raise InvariantViolation("; ".join(problems))
        return SimulationResult(status, s, list(self.sched.reproducers))


def simulate(config: EngineConfig, requests: Iterable[Request], recorder: Recorder, *,
             progress: Callable[[int, float], None] | None = None) -> SimulationResult:
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
    return Engine(config, requests, recorder, progress).run()

