"""The differential mode (``decisions = "differential"``): kvsim's model and real vLLM in lockstep.

What it does
    Two engines replay the same request stream on the same timing models:
    kvsim's own (:class:`sim.engine.loop.Engine`, its model under the window
    logic of the installed vLLM: 0.29.0 old, 0.30.0 new, 0.33.0 latest) and
    real vLLM's (:class:`sim.engine.vllm_engine.VllmEngine`). Each has its own
    SimPy environment; :class:`Lockstep` advances one until its scheduler has
    decided a step, then the other, and compares the two steps' decisions
    before either goes on. A run is deterministic, so until the first
    decision that differs the two are the same event for event, and the
    first difference is the first divergence.

    The decisions of one step (:class:`StepDecisions`), per request:

    * ``lookup``: the connector's answer, (local GPU hit tokens, external
      tokens or None when deferred, whether the load is asynchronous);
    * ``scheduled``: tokens scheduled in the forward pass;
    * ``blocks``: per group, (entries, real blocks, a digest of the ids) of
      the block ids the step gave the request: its whole table when it was
      admitted (or resumed, or admitted with a load), else the new ones;
    * ``load_keys`` / ``store_keys``: the CPU chunks of the request's load and
      store jobs, as ``(hash, group)``;
    * ``preempted``;

    and per step: the CPU chunks evicted by the step's stores, the number of
    stores flushed (waited for before the forward pass), the crashes (kind,
    request) and the step's start time.

    A step in which neither side decides anything is not compared (kvsim's
    engine sleeps when idle; vLLM's engine polls with empty steps).

Known divergences
    Differences that come from a simplification of kvsim's engine listed in
    docs/vllm.md before the run are not divergences; they are counted apart,
    by kind:

    * ``too_long``: a request longer than the pool holds is rejected by vLLM
      on arrival (``max_model_len``); the model's decisions about it are left
      out. kvsim's model rejects it on arrival too (docs/vllm.md, finding 17),
      so none is expected.

The report
    :class:`DifferentialReport`: the decisions compared, the first divergence
    (step, time, request, what, both values) or "0 divergences in N
    decisions", the known ones by kind. When the divergence is one request's
    lookup, kvsim's model is run again alone up to that lookup and what it
    met is written as a check/1 case whose expectation is vLLM's answer
    (:func:`lookup_reproducer`): ``kvsim check`` on it fails until the model
    gives vLLM's answer. Other divergences depend on the whole pool, queue or
    CPU cache, which check/1 does not state; the report says so.

Simplifications
    * kvsim's decode fast-forward is off on the model's side (it merges
      decode steps; its results are identical to stepping, tested).
    * Crashes raised by vLLM in ``update_from_output`` are compared with the
      next step's (or at the end). When vLLM stops on a crash kvsim's model
      makes too (same step, request and kind), the comparison ends there and
      kvsim's run stops as well (vLLM's state is undefined after it). vLLM
      raises at the first crash of a step; kvsim's model records every crash
      of the step, so its crashes after vLLM's are not compared.
    * A run folder holds kvsim's model's rows; vLLM's side keeps none.
    * kvsim's deadlock breaker (``sim.model.scheduler``: nothing runs or is in
      flight and the waiting request at the head cannot get room) has no
      counterpart in vLLM, which waits there for ever (or for something new to
      arrive). The step in which kvsim breaks one ends the comparison with a
      divergence of its own kind, ``deadlock_break``, as the place where vLLM
      would hang (docs/vllm.md finding 28).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from sim.engine.loop import Engine, EngineConfig, SimulationResult
from sim.engine.metrics import EventRow, Recorder, Sink
from sim.io.results import clean_floats, write_json_atomic
from sim.model.cpu_cache import key_parts
from sim.model.request import Request
from sim.model.scheduler import ReproducerSnapshot, StepPlan

__all__ = ["FIELDS", "DifferentialReport", "Lockstep", "NullSink", "StepDecisions", "StepDivergence",
           "WatchingRecorder", "compare_steps", "describe", "key_of_vllm", "simulate_differential"]

#: the per-request decisions compared, in the order they are compared
FIELDS = ("lookup", "scheduled", "blocks", "load_keys", "store_keys", "preempted")
#: the per-step decisions compared after the requests' (crashes are compared first)
STEP_FIELDS = ("evicted", "flushed")
#: kvsim's side of a ``deadlock_break`` divergence
DEADLOCK_BREAK = ("broke a deadlock: preempted the waiting requests that hold GPU blocks, or rejected "
                  "one that never fits (a listed simplification: vLLM has no such breaker)")

#: a chunk as ``(hash, group)``, as both sides' decisions are compared and reported
#: (kvsim's keys through :func:`sim.model.cpu_cache.key_parts`)
Key = tuple[int, int]
Logic = Literal["old", "new", "latest"]


def key_of_vllm(key: bytes) -> Key:
    """vLLM's offload key (a block hash, then the group in 4 bytes) as kvsim's ``(hash, group)``
    (the hash is kvsim's, 8 bytes little-endian: :class:`sim.model.real_vllm.RealVllmScheduler`)."""
    return int.from_bytes(key[:-4], "little", signed=True), int.from_bytes(key[-4:], "big")


@dataclass(frozen=True)
class StepDecisions:
    """What one scheduler step decided (see the module docstring)."""

    t_s: float
    #: request -> field -> value (only the fields decided for it this step)
    requests: dict[str, dict[str, Any]]
    evicted: tuple[Key, ...] = ()
    flushed: int = 0
    crashes: tuple[tuple[str, str], ...] = ()
    #: kvsim's side only: its deadlock breaker preempted or rejected a request in this step
    deadlock_break: bool = False

    @property
    def empty(self) -> bool:
        return not (self.requests or self.evicted or self.flushed or self.crashes or self.deadlock_break)


@dataclass(frozen=True)
class StepDivergence:
    """The first decision on which the two sides differ."""

    #: the compared step's index (steps in which something was decided, from 0)
    step: int
    t_s: float
    #: "" for a step-level decision
    req_id: str
    what: str
    kvsim: Any
    vllm: Any

    @property
    def single(self) -> bool:
        """One request's lookup with the same local hit: a check/1 case can state what it met."""
        return (self.what == "lookup" and isinstance(self.kvsim, tuple) and isinstance(self.vllm, tuple)
                and self.kvsim[0] == self.vllm[0])


@dataclass
class DifferentialReport:
    """The outcome of one lockstep run."""

    vllm_version: str
    logic: str
    decisions: int = 0
    steps: int = 0
    divergence: StepDivergence | None = None
    #: differences from listed simplifications, by kind
    known: dict[str, int] = field(default_factory=dict)
    #: the check/1 file written for a single-decision divergence, or why there is none
    reproducer: str | None = None
    #: how each side's run ended
    status: dict[str, str] = field(default_factory=dict)

    def describe(self) -> list[str]:
        """The report as printed (:func:`describe`)."""
        return describe(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        div = dataclasses.asdict(self.divergence) if self.divergence is not None else None
        if div is not None:
            div["kvsim"], div["vllm"] = _plain(div["kvsim"]), _plain(div["vllm"])
        return {"vllm_version": self.vllm_version, "logic": self.logic, "decisions": self.decisions,
                "steps": self.steps, "divergences": int(div is not None), "known": dict(self.known),
                "first": div, "reproducer": self.reproducer, "status": dict(self.status)}


def describe(rep: dict[str, Any]) -> list[str]:
    """A report (:meth:`DifferentialReport.to_dict`, as in ``summary.json``) as printed: the
    figure, then the first divergence and its reproducer if any."""
    known = ", ".join(f"{k} {n}" for k, n in sorted(rep["known"].items())) or "none"
    lines = [f"differential: kvsim (logic {rep['logic']}) vs vLLM {rep['vllm_version']}: "
             f"{rep['divergences']} divergence{'' if rep['divergences'] == 1 else 's'} in {rep['decisions']} "
             f"decisions ({rep['steps']} steps; known, from listed simplifications: {known})"]
    d = rep["first"]
    if d is not None:
        who = f"request {d['req_id']}" if d["req_id"] else "the step"
        lines.append(f"first divergence: step {d['step']}, t={d['t_s']:.6f} s, {who}, {d['what']}: "
                     f"kvsim {_short(d['kvsim'])}, vLLM {_short(d['vllm'])}")
        lines.append(f"reproducer: {rep['reproducer']}")
    return lines


def _plain(v: Any) -> Any:
    """A JSON-ready value (tuples as lists; None stays None)."""
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _short(v: Any, limit: int = 12) -> str:
    if isinstance(v, tuple | list) and len(v) > limit:
        return f"{v[:limit]!r}... ({len(v)} in all)"
    return repr(v)


class WatchingRecorder(Recorder):
    """A recorder that also notes the crash and too-long rejection rows as they pass
    (the lockstep compares a step's crashes; a run writes kvsim's side through it)."""

    def __init__(self, sink: Sink) -> None:
        super().__init__(sink)
        self.crashes: list[tuple[str, str]] = []
        self.too_long: set[str] = set()

    def add(self, row: Any) -> None:
        if isinstance(row, EventRow):
            if row.kind == "crash":
                self.crashes.append((row.req_id or "", row.detail))
            elif row.kind == "rejected" and row.detail == "too_long" and row.req_id:
                self.too_long.add(row.req_id)
        super().add(row)

    def take_crashes(self) -> tuple[tuple[str, str], ...]:
        out, self.crashes = tuple(self.crashes), []
        return out


def _blocks(ids: Iterable[Sequence[int]]) -> tuple[tuple[int, int, int], ...]:
    """Per group: (entries, real blocks, a digest of the ids) of the block ids a step gave a
    request (its whole table when it was admitted or resumed, else the new ones; 0 is the
    null block on both sides). kvsim's pool hands out the ids vLLM's does, so a block taken
    from another place in the free queue shows at once."""
    out = []
    for g in ids:
        t = tuple(g)
        out.append((len(t), len(t) - t.count(0), hash(t)))
    return tuple(out)


def _lookups(log: list[tuple[str, int, int | None, bool]] | None) -> defaultdict[str, dict[str, Any]]:
    """A step's decisions per request, started from a side's lookup log (each
    ``(req_id, local, external, load_async)``), which is emptied for the next step."""
    reqs: defaultdict[str, dict[str, Any]] = defaultdict(dict)
    if log:
        for rid, local, ext, load_async in log:
            reqs[rid]["lookup"] = (local, ext, load_async)
        log.clear()
    return reqs


def model_decisions(engine: Engine, plan: StepPlan, crashes: tuple[tuple[str, str], ...]) -> StepDecisions:
    """The decisions of kvsim's model in one step (from its plan and its lookup log)."""
    sched = engine.sched
    reqs = _lookups(sched.lookup_log)
    for r, n, _ in plan.scheduled:
        reqs[r.req_id]["scheduled"] = n
    for r in plan.preempted:
        reqs[r.req_id]["preempted"] = True
    evicted: list[Key] = []
    for j in plan.loads:
        reqs[j.req_id]["load_keys"] = tuple(sorted(map(key_parts, j.plan.keys)))
    for j in plan.stores:
        d = reqs[j.req_id]
        d["store_keys"] = tuple(sorted((*d.get("store_keys", ()), *map(key_parts, j.plan.keys))))
        evicted.extend(map(key_parts, getattr(j.plan, "evicted", ())))
    gpu = sched.gpu
    whole = {r.req_id for r in plan.admitted}
    for r, _, new in plan.scheduled:
        if r.req_id not in whole and new is not None and any(new):
            reqs[r.req_id]["blocks"] = _blocks(new)
    for rid in whole:
        if rid in gpu.req_blocks:
            reqs[rid]["blocks"] = _blocks(gpu.block_ids(rid))
    return StepDecisions(engine.env.now, dict(reqs), tuple(sorted(evicted)), len(plan.flush), crashes,
                         plan.broke_deadlock)


def vllm_decisions(engine: Any, step: Any, crashes: tuple[tuple[str, str], ...]) -> StepDecisions:
    """The decisions of real vLLM in one step (its ``SchedulerOutput``, the connector's jobs and
    metadata, the logged lookups and evictions)."""
    real = engine.real
    reqs = _lookups(real.lookup_log)
    elog = real.evicted_log or []
    evicted = tuple(sorted(key_of_vllm(k) for k in elog))
    elog.clear()
    out = step.output
    if out is None:   # a crash in schedule()
        return StepDecisions(engine.env.now, dict(reqs), evicted, 0, crashes)
    for rid, n in out.num_scheduled_tokens.items():
        reqs[rid]["scheduled"] = n
    for rid in getattr(out, "preempted_req_ids", None) or ():
        reqs[rid]["preempted"] = True
    meta = out.kv_connector_metadata
    flushed = 0
    if meta is not None:
        jobs = real.conn_sched._jobs
        for jid, entry in meta.load_jobs.items():
            reqs[str(entry.req_id)]["load_keys"] = tuple(sorted(key_of_vllm(k) for k in jobs[jid].keys))
        for jid, entry in meta.store_jobs.items():
            d = reqs[str(entry.req_id)]
            keys = (key_of_vllm(k) for k in jobs[jid].keys)
            d["store_keys"] = tuple(sorted((*d.get("store_keys", ()), *keys)))
        flushed = len(getattr(meta, "jobs_to_flush", None) or ())
    for q in out.scheduled_new_reqs:
        reqs[q.req_id]["blocks"] = _blocks(q.block_ids)
    cached = out.scheduled_cached_reqs
    for rid, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
        if new is not None and any(new):
            reqs[rid]["blocks"] = _blocks(new)
    mgr = real.sched.kv_cache_manager
    for rid, d in reqs.items():   # admitted with a load: not scheduled, its whole table
        if "load_keys" in d and "blocks" not in d and rid in real.sched.requests:
            d["blocks"] = _blocks(mgr.get_block_ids(rid))
    return StepDecisions(engine.env.now, dict(reqs), evicted, flushed, crashes)


class Lockstep:
    """kvsim's model and real vLLM, advanced step by step and compared (module docstring).

    Args:
        cfg: the engine configuration (``decisions`` and ``window_logic`` are set per side).
        requests: makes the request stream (called once per side).
        model_rec: receives kvsim's model's rows.
        vllm_rec: receives vLLM's rows.
        stop_at_first: stop both runs at the first divergence (else compare up to it and
            let both runs finish).
        progress: called with (requests finished, simulated seconds) of kvsim's side.
        stand_in: tests without vLLM: a second run of kvsim's model with this configuration
            plays vLLM's part (None: the installed vLLM).
    """

    def __init__(self, cfg: EngineConfig, requests: Callable[[], Iterable[Request]],
                 model_rec: WatchingRecorder, vllm_rec: WatchingRecorder, *, stop_at_first: bool = True,
                 progress: Callable[[int, float], None] | None = None,
                 stand_in: EngineConfig | None = None) -> None:
        self.cfg = cfg
        self.requests = requests
        self.model_rec, self.vllm_rec = model_rec, vllm_rec
        self.real: Engine
        if stand_in is None:
            from sim.engine.vllm_engine import VllmEngine  # noqa: PLC0415 -- imports vLLM
            from sim.model.real_vllm import SUPPORTED_VERSIONS, installed_version  # noqa: PLC0415

            version = installed_version()
            logic = cast("Logic", SUPPORTED_VERSIONS.get(version, "latest"))
        else:
            version, logic = "stand-in", cfg.window_logic
        # kvsim's side first: it reads the first stream (a run's, guarded for bad input)
        self.model_cfg = dataclasses.replace(cfg, decisions="model", window_logic=logic, fast_forward=False)
        self.model = Engine(self.model_cfg, requests(), self.model_rec, progress)
        self.model.sched.lookup_log = []
        if stand_in is None:
            vllm = VllmEngine(dataclasses.replace(cfg, decisions="vllm"), requests(), vllm_rec)
            vllm.real.lookup_log = []
            vllm.real.evicted_log = []
            self._decided: Callable[[Any, Any, tuple[tuple[str, str], ...]], StepDecisions] = vllm_decisions
            self.real = vllm
        else:
            self.real = Engine(dataclasses.replace(stand_in, decisions="model", fast_forward=False),
                               requests(), vllm_rec)
            self.real.sched.lookup_log = []
            self._decided = model_decisions
        self.report = DifferentialReport(version, logic)
        self.stop_at_first = stop_at_first
        self._mq: deque[StepDecisions] = deque()
        self._vq: deque[StepDecisions] = deque()
        self.model.on_schedule = self._on_model
        self.real.on_schedule = self._on_vllm
        self.comparing = True

    def _on_model(self, plan: StepPlan) -> None:
        if not self.comparing:
            return
        d = model_decisions(self.model, plan, self.model_rec.take_crashes())
        if not d.empty:
            self._mq.append(d)

    def _on_vllm(self, step: Any) -> None:
        if not self.comparing:
            return
        d = self._decided(self.real, step, self.vllm_rec.take_crashes())
        if not d.empty:
            self._vq.append(d)

    @staticmethod
    def _next(env: Any, q: deque[StepDecisions]) -> StepDecisions | None:
        """Advance ``env`` until its scheduler decided a step (None: the run is over)."""
        while not q:
            if env.peek() == math.inf:
                return None
            env.step()
        return q.popleft()

    def run(self) -> tuple[SimulationResult, SimulationResult, DifferentialReport]:
        """Run both sides in lockstep; returns kvsim's result, vLLM's, and the report."""
        model, real, rep = self.model, self.real, self.report
        model.start()
        real.start()
        while self.comparing:
            a = self._next(model.env, self._mq)
            b = self._next(real.env, self._vq)
            if a is None and b is None:
                break
            if a is None or b is None:   # one side decides no more
                a = a or StepDecisions(model.env.now, {})
                b = b or StepDecisions(real.env.now, {})
                a = dataclasses.replace(a, crashes=a.crashes + self.model_rec.take_crashes())
                b = dataclasses.replace(b, crashes=b.crashes + self.vllm_rec.take_crashes())
            div = self.compare(a, b)
            rep.steps += 1
            if div is not None:
                rep.divergence = div
                self.comparing = False
            elif b.crashes:   # the same crash: vLLM stops there (its state is undefined), so does kvsim
                if model.stop_reason is None:
                    model.stop_reason = "stopped_on_crash"
                model.kick()
                break
        if rep.divergence is None:   # a crash vLLM raised in its last update_from_output
            a = StepDecisions(model.env.now, {}, crashes=self.model_rec.take_crashes())
            b = StepDecisions(real.env.now, {}, crashes=self.vllm_rec.take_crashes())
            if not (a.empty and b.empty):
                rep.divergence = self.compare(a, b)
        if rep.divergence is not None and self.stop_at_first:
            for eng in (model, real):
                if eng.stop_reason is None:
                    eng.stop_reason = "diverged"
                eng.kick()
        self.comparing = False
        model.env.run()
        real.env.run()
        res_m, res_v = model.finish(), real.finish()
        rep.status = {"kvsim": res_m.status, "vllm": res_v.status}
        return res_m, res_v, rep

    def compare(self, a: StepDecisions, b: StepDecisions) -> StepDivergence | None:
        """Compare one step's decisions (kvsim's ``a``, vLLM's ``b``); count them."""
        return compare_steps(a, b, self.report, self.vllm_rec.too_long)


def compare_steps(a: StepDecisions, b: StepDecisions, rep: DifferentialReport,
                  too_long: set[str] | frozenset[str] = frozenset()) -> StepDivergence | None:
    """Compare one step's decisions (kvsim's ``a``, vLLM's ``b``), counting them in ``rep``;
    the first that differs (None: they agree). ``too_long``: requests vLLM rejected on
    arrival, whose decisions on kvsim's side are counted as known."""
    step = rep.steps
    t = min(a.t_s, b.t_s)
    rep.decisions += 1
    if a.deadlock_break:   # vLLM, in the same state, has no way out: it waits
        later = f"; its next decision at t={b.t_s:.6f} s" if b.t_s > a.t_s else ""
        return StepDivergence(step, a.t_s, "", "deadlock_break", DEADLOCK_BREAK, f"waits (no breaker{later})")
    if a.t_s != b.t_s:
        return StepDivergence(step, t, "", "step start", a.t_s, b.t_s)
    if a.crashes or b.crashes:   # first: after vLLM's assertion the rest of its step never happened
        rep.decisions += 1
        ca = tuple(c for c in a.crashes if c[0] not in too_long)
        # vLLM raises at its first crash, so a later crash of kvsim's in the same step (its
        # model records it and goes on) has nothing to be compared with
        agree = ca[: len(b.crashes)] == b.crashes if b.crashes else not ca
        return None if agree else StepDivergence(step, t, "", "crashes", ca, b.crashes)
    for rid in dict.fromkeys([*a.requests, *b.requests]):
        if rid in too_long:   # rejected by vLLM on arrival (known: too_long)
            rep.known["too_long"] = rep.known.get("too_long", 0) + len(a.requests.get(rid, {}))
            continue
        da, db = a.requests.get(rid, {}), b.requests.get(rid, {})
        for f in FIELDS:
            va, vb = da.get(f), db.get(f)
            if va is None and vb is None:
                continue
            rep.decisions += 1
            if va != vb:
                return StepDivergence(step, t, rid, f, va, vb)
    for f in STEP_FIELDS:
        va, vb = getattr(a, f), getattr(b, f)
        if not va and not vb:
            continue
        rep.decisions += 1
        if va != vb:
            return StepDivergence(step, t, "", f, va, vb)
    return None


def lookup_reproducer(cfg: EngineConfig, requests: Iterable[Request], div: StepDivergence,
                      sink: Sink) -> ReproducerSnapshot | None:
    """Run kvsim's model alone up to the diverging lookup and snapshot what it met.

    The run is deterministic, so the model meets the same state it met in the lockstep.
    Returns None when the lookup is not met again (which would be a bug).
    """
    eng = Engine(cfg, requests, Recorder(sink))
    sched = eng.sched
    sched.lookup_log = []
    sched.snapshot_lookup = (div.req_id, div.t_s)
    eng.on_schedule = lambda _plan: sched.lookup_log.clear() if sched.lookup_log else None
    eng.start()
    env = eng.env
    sched.max_reproducers = len(sched.reproducers) + 10**6

    def found() -> ReproducerSnapshot | None:
        return next((s for s in sched.reproducers if s.kind == "divergence"), None)

    while found() is None and env.peek() != math.inf and env.now <= div.t_s:
        env.step()
    return found()


class NullSink:
    """A sink that keeps nothing (vLLM's side of a differential run)."""

    def write(self, table: str, columns: dict[str, list[Any]]) -> None:
        pass


def simulate_differential(config: EngineConfig, requests: Callable[[], Iterable[Request]],
                          recorder: WatchingRecorder, *, folder: Path | None = None,
                          progress: Callable[[int, float], None] | None = None,
                          stand_in: EngineConfig | None = None,
                          ) -> tuple[SimulationResult, DifferentialReport]:
    """kvsim's model and real vLLM in lockstep; kvsim's rows go to ``recorder``.

    At the first divergence both runs stop (status ``diverged``); ``folder``, when
    given, gets ``divergence.json`` and, for a diverging lookup, its check/1 case.
    ``stand_in``: see :class:`Lockstep` (tests without vLLM).

    Returns:
        kvsim's result and the report.
    """
    lock = Lockstep(config, requests, recorder, WatchingRecorder(NullSink()), progress=progress,
                    stand_in=stand_in)
    result, _, rep = lock.run()
    div = rep.divergence
    if div is not None:
        if not div.single:
            rep.reproducer = (f"none: check/1 states one request's lookup from its local hit; a "
                              f"divergence in {div.what}{' (the local hit)' if div.what == 'lookup' else ''} "
                              "depends on the whole pool, queue or CPU cache")
        else:
            snap = lookup_reproducer(lock.model_cfg, requests(), div, NullSink())
            if snap is None:
                rep.reproducer = "none: kvsim's model did not meet the lookup again (a kvsim bug)"
            elif folder is not None:
                rep.reproducer = write_lookup_case(folder, snap, div)
        if folder is not None:
            write_json_atomic(folder / "divergence.json", clean_floats(rep.to_dict()))
    return result, rep


def write_lookup_case(folder: Path, snap: ReproducerSnapshot, div: StepDivergence) -> str:
    """The check/1 case of a diverging lookup, expecting vLLM's answer; returns its file name."""
    from sim.io.check import CheckCase, case_toml, parse_check  # noqa: PLC0415

    _, ext, load_async = div.vllm
    expect: dict[str, Any] = {"deferred": True} if ext is None else {"external_tokens": ext,
                                                                      "load_async": load_async}
    name = f"divergence-{snap.req_id}.toml"
    head = (f"reproducer: the lookup of request {snap.req_id} at t = {snap.t_s:.6f} s (step {div.step}) "
            f"in a differential run ({snap.logic.upper()} logic)",
            f"kvsim's model answered {div.kvsim!r}, real vLLM {div.vllm!r} "
            "(local hit tokens, external tokens, load async)",
            f"the expectation is vLLM's answer: kvsim check {name} fails until the model agrees")
    text = case_toml(CheckCase.from_snapshot(snap), name=f"{snap.req_id}-divergence",
                     window_logic=snap.logic, expect={snap.logic: expect}, head=head)
    parse_check(tomllib.loads(text), name)
    (folder / name).write_text(text)
    return name
