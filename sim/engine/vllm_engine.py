"""The SimPy engine with real vLLM deciding (``decisions = "vllm"``).

What it models
    kvsim's clock, arrivals, request lifecycles, step-time model and links
    (:mod:`sim.engine.loop`, :mod:`sim.engine.links`), with every scheduling
    and KV decision taken by the installed vLLM
    (:class:`sim.model.real_vllm.RealVllmScheduler`). One engine step follows
    vLLM's engine core and GPU worker:

    1. ``schedule()`` (vLLM): the batch, admissions, preemptions, the
       connector's load and store jobs and the stores to flush;
    2. the worker connector's ``handle_preemptions``: it submits its deferred
       stores and the flushed ones, then waits for the flushed (the step waits
       for those transfers on kvsim's d2h link);
    3. ``start_load_kv``: the deferred stores are submitted, then, after the
       scheduler's per-block time (kvsim's step model, ``before_loads_s``, as
       kvsim's engine does), this step's loads (0.33's synchronous loads are
       waited for, as vLLM does);
    4. the forward pass: the rest of kvsim's step time for the scheduled tokens;
    5. ``wait_for_save`` (this step's stores deferred to the next step, by
       vLLM's code), ``get_finished`` with the transfers completed by now, and
       ``update_from_output`` with one sampled token per request whose prefill
       is complete.

    The rows are kvsim's tables, filled from what vLLM did: requests (hits as
    the connector's lookup answered them, TTFT and TPOT from the sampled
    tokens), steps, transfers (vLLM's job ids), occupancy (vLLM's block pool
    and CPU manager), events (rejections, a vLLM assertion).

Simplifications
    * No decode fast-forward: every step calls vLLM.
    * See :mod:`sim.model.real_vllm` for how requests are fed to vLLM
      (too-long requests, token ids, a crash stopping the run).
    * The copy path is not available in this mode.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from dataclasses import fields, replace
from typing import Any, Literal

import simpy

from sim.engine.links import LATE, At, Link, Proc, Transfer
from sim.engine.loop import Engine, EngineConfig, InvariantViolation, SimulationResult, StopReason
from sim.engine.metrics import OccupancyRow, Recorder, RunSummary, StepRow, TransferRow
from sim.model.costs import before_loads_s
from sim.model.real_vllm import RealJob, RealVllmScheduler
from sim.model.request import Request
from sim.model.scheduler import SchedulerHooks, SchedulerStats

__all__ = ["VllmEngine", "simulate_vllm"]


class VllmEngine(Engine):
    """kvsim's engine around :class:`~sim.model.real_vllm.RealVllmScheduler`."""

    def __init__(self, cfg: EngineConfig, requests: Iterable[Request], rec: Recorder,
                 progress: Callable[[int, float], None] | None = None) -> None:
        self.cfg = cfg
        self.rec = rec
        self.progress = progress
        self.env = simpy.Environment()
        self.layout = cfg.layout
        self.real = RealVllmScheduler(cfg, SchedulerHooks(event=self._model_event, release=self._release))
        self.sched = self.real  # type: ignore[assignment]
        self.gpu = self.cpu = self.conn = None
        self.summary = RunSummary()
        self.completed: list[Transfer] = []
        self.copy = None
        self.h2d = Link(self.env, "h2d", cfg.h2d, self._completed, None, False)
        self.d2h = Link(self.env, "d2h", cfg.d2h, self._completed, None, False)
        self.h2d.other, self.d2h.other = self.d2h, self.h2d
        self.xfers: dict[int, Transfer] = {}
        self.deferred_stores: list[Transfer] = []
        self._done: dict[str, simpy.Event] = {}
        self.step_no = 0
        self.next_tick = 0.0
        self.stop_reason: StopReason | None = None
        self.on_schedule: Callable[[Any], None] | None = None
        self._requests = iter(requests)
        self.next_arrival_s = float("inf")
        self.arrivals_done = False
        self._idle: simpy.Event | None = None
        self._finished_count = 0
        self._stop = self.env.event()
        self.end_s = 0.0
        self.busy_at_end = (0.0, 0.0)

    @property
    def vllm_version(self) -> str:
        return self.real.version

    # -- processes ------------------------------------------------------------------

    def _drained(self) -> bool:
        return not self.real.has_work() and not self.xfers and not self._unsubmitted()

    def _unsubmitted(self) -> bool:
        """vLLM's worker holds stores deferred to the next step."""
        w = self.real.wconn
        return bool(w is not None and getattr(w.connector_worker, "_unsubmitted_store_jobs", None))

    # -- one step ---------------------------------------------------------------------

    def _step(self) -> Generator[simpy.Event, Any, bool]:
        env, real = self.env, self.real
        step = real.schedule(env.now)
        if self.on_schedule is not None:
            self.on_schedule(step)
        if step.stopped:
            self.stop_reason = "stopped_on_crash"
            return False
        start = env.now
        jobs, waited = real.flush(step)
        flushed = len(waited)
        self._submit(jobs, waited)
        yield from self._wait_for(waited)
        jobs, waited = real.start_transfers(step)
        flushed += len(waited)
        loads = [j for j in jobs if j.direction == "h2d"]
        # kvsim's engine: the scheduler's per-block time before the step's loads are submitted
        cost = self.cfg.step_cost
        if loads:
            step.load = replace(step.load, loaded_blocks=sum(j.blocks for j in loads))
        pre = before_loads_s(cost, step.load, bool(step.scheduled))
        if pre:
            self._submit([j for j in jobs if j.direction != "h2d"], waited)
            yield At(env, pre, LATE)
            self._submit(loads, waited)
        else:
            self._submit(jobs, waited)
        yield from self._wait_for(waited)
        if step.scheduled:
            dur = cost.time(step.load)
            yield At(env, max(0.0, dur - pre) if pre else dur, LATE)
        completed = self._poll_ids()
        finished = real.update_from_output(env.now, step, completed)
        if finished is None:
            self.stop_reason = "stopped_on_crash"
            return False
        self._count_finished(len(finished))
        nsteps = 1 if step.scheduled else 0
        self.summary.steps += nsteps
        self.summary.peak_waiting = max(self.summary.peak_waiting, real.num_waiting)
        # the worker's submission of the stores the last step built is not work of this step
        # (that step counted them, as kvsim's engine does; a flush is): else, with nothing
        # else done, vLLM's side took one more step at once than kvsim's model
        did = bool(step.scheduled or flushed or loads or completed or finished or step.preempted
                   or step.loads or step.stores or self._unsubmitted())
        if did:
            self.step_no += 1
            self.summary.step_rows += 1
            load = step.load
            self.rec.add(StepRow(self.step_no - 1, nsteps, start, env.now - start, load.prefill_tokens,
                                 load.decode_seqs, load.context_tokens, len(real.sched.running),
                                 real.num_waiting, step.loads, step.stores, step.preempted, real.gpu_used))
        self._sample()
        return did

    def _submit(self, jobs: list[RealJob], waited: set[int]) -> None:
        for j in jobs:
            x = Transfer(j.job_id, j.req_id, j.direction, j.chunks, j.blocks, j.nbytes, pieces=j.pieces)
            x.flushed = j.job_id in waited and j.direction == "d2h"
            self.xfers[j.job_id] = x
            (self.h2d if j.direction == "h2d" else self.d2h).submit(x)

    def _wait_for(self, waited: set[int]) -> Proc:
        xs = [x for j in sorted(waited) if (x := self.xfers.get(j)) is not None]
        events = [x.done for x in xs if x.done is not None and not x.done.triggered]
        if waited:
            self.summary.flushed_stores += sum(1 for j in waited if (x := self.xfers.get(j)) is not None
                                               and x.direction == "d2h")
        if events:
            yield simpy.AllOf(self.env, events)
            yield At(self.env, 0, LATE)

    def _poll_ids(self) -> list[int]:
        """Job ids of the transfers completed by now, in completion order (h2d first on ties)."""
        if not self.completed:
            return []
        done = sorted(self.completed, key=lambda x: (x.end_s, x.direction != "h2d"))
        self.completed.clear()
        for x in done:
            del self.xfers[x.job_id]
            self.rec.add(TransferRow(x.job_id, x.req_id, x.direction, x.chunks, x.blocks, x.nbytes,
                                     x.submit_s, x.start_s, x.end_s, x.flushed))
        return [x.job_id for x in done]

    # -- sampling -----------------------------------------------------------------------

    def _sample(self, force: bool = False) -> None:
        import math  # noqa: PLC0415

        now = self.env.now
        if not force and now < self.next_tick:
            return
        real = self.real
        present, pending, loading, free = real.cpu_counts()
        wfk = real.num_waiting_for_kv
        self.summary.queue_t.append(now)
        self.summary.queue_n.append(real.num_waiting)
        self.rec.add(OccupancyRow(now, present, pending, loading, free, real.gpu_used, real.gpu_cached,
                                  len(real.sched.running), real.num_waiting - wfk, wfk, len(self.h2d),
                                  len(self.d2h)))
        iv = self.cfg.occupancy_interval_s
        self.next_tick = (math.floor(now / iv) + 1) * iv

    # -- run ----------------------------------------------------------------------------

    def finish(self) -> SimulationResult:
        env = self.env
        s = self.summary
        stats = self.real.stats
        for f in fields(SchedulerStats):
            setattr(s, f.name, getattr(stats, f.name))
        s.sim_time_s = self.end_s
        s.h2d_busy_s, s.d2h_busy_s = self.busy_at_end
        if self.progress is not None:
            self.progress(self._finished_count, env.now)
        self.rec.flush()
        status: Literal["ok"] | StopReason = self.stop_reason or "ok"
        if status == "ok":
            problems = self.real.invariant_problems()
            if self.xfers:
                problems.append(f"{len(self.xfers)} transfers never completed")
            if problems:
                raise InvariantViolation("; ".join(problems))
        return SimulationResult(status, s, [])


def simulate_vllm(config: EngineConfig, requests: Iterable[Request], recorder: Recorder, *,
                  progress: Callable[[int, float], None] | None = None) -> SimulationResult:
    """:func:`sim.engine.loop.simulate` with real vLLM deciding (see the module docstring)."""
    return VllmEngine(config, requests, recorder, progress).run()
