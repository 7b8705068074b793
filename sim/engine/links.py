"""Transfer links (serial in-order queues of load and store jobs, in simulated
time) and the copy path's hooks.

What it models
    One direction of the PCIe link between GPU and CPU memory (``h2d``
    loads, ``d2h`` stores). A link runs its jobs one at a time in submission
    order; a job alone on the link takes ``latency + pieces x piece_overhead
    + bytes / bandwidth`` (:meth:`TransferModel.time`; ``pieces`` are the
    separate copies vLLM makes, a page per layer per block) or, with the copy
    path's measured timing, the measured time of its copy.

    *Duplex.* While the other direction also has a job in progress, a job
    progresses at ``duplex_factor`` of its solo rate (measured bidirectional
    copies fall below twice the one-way peak, H2D more than D2H; sources in
    docs/costs.md): whenever the other link starts or finishes a job, the
    remaining solo time is rescaled and the completion moved. With both
    factors 1 (or measured timing) a job takes exactly its solo time.
    A job's completion is an ``URGENT`` event (see the priorities below) and
    is handed to the engine, which reports it at the end of the step.

    Priorities of same-time events (see :mod:`sim.engine.loop`): transfer
    completions ``URGENT``, arrivals ``NORMAL`` (SimPy's default), engine step
    boundaries ``LATE``.

    :class:`CopyHooks` is what the links and the scheduler call into the
    torch data path (:mod:`sim.engine.copypath`): a job's real copy, the KV
    fingerprints of computed tokens, and the verification of what a request
    reads after a load (each bad block reported once).

    :class:`TierLink` is the link of one secondary storage tier
    (:mod:`sim.model.tiers`): promotions read the tier, cascades write it.
    Up to ``concurrency`` jobs are in progress at once; each first waits the
    tier's per-job latency (overlapping with the others'), then moves its
    bytes over the tier's one wire, which reads and writes share: jobs take
    the wire one at a time in the order their latency ended, at the read or
    the write bandwidth.

Simplifications
    * The duplex slowdown applies to a job's whole solo time (its latency
      and piece overheads too), and only the busy/idle state of the other
      direction matters, not how much it moves; no per-chunk pipelining
      inside a job.
    * A tier's wire is FIFO at full bandwidth (no sharing between two jobs'
      bytes); tier traffic does not use the PCIe links (a promotion lands in
      CPU memory, a cascade reads it).

Invariants
    * at most one job of a :class:`Link` is in progress; jobs start in
      submission order;
    * a :class:`TierLink` has at most ``concurrency`` jobs in progress and one
      on its wire.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from sim.model.connector import LoadPlan, OffloadingScheduler, StorePlan
from sim.model.costs import TransferModel
from sim.model.gpu_cache import GpuKVCache
from sim.model.layout import Layout
from sim.model.request import LiveRequest

__all__ = ["LATE", "NORMAL", "URGENT", "At", "CopyHooks", "Link", "TierLink", "TierLinkModel", "Transfer"]

URGENT = 0  #: transfer completions
NORMAL = 1  #: arrivals (SimPy's default priority)
LATE = 2    #: engine step boundaries

Proc = Generator[simpy.Event, Any, Any]

_U64 = (1 << 64) - 1


class At(simpy.Event):
    """An event that fires after ``delay`` with a given priority (SimPy's
    ``Timeout`` always uses ``NORMAL``)."""

    def __init__(self, env: simpy.Environment, delay: float, priority: int) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, priority, delay)  # type: ignore[arg-type]


@dataclass(slots=True)
class Transfer:
    """One transfer job on a link (a row of the ``transfers`` table when done)."""

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
    #: separate copies of the job (see :meth:`TransferModel.time`)
    pieces: int = 0


class Link:
    """A serial, in-order transfer queue (one direction of the PCIe link).

    Args:
        env: the simulation.
        name: ``h2d`` or ``d2h``.
        model: the job time.
        on_done: called when a job completes (before its ``done`` event fires).
        copy: runs a job's real copy and returns its measured seconds: at the
            job's start with measured timing, else at its end.
        measured: the job time is the copy's measured time.
    """

    def __init__(self, env: simpy.Environment, name: str, model: TransferModel,
                 on_done: Callable[[Transfer], None], copy: Callable[[Transfer], float] | None = None,
                 measured: bool = False) -> None:
        self.env = env
        self.name = name
        self.model = model
        self.on_done = on_done
        self.copy = copy
        self.measured = measured
        self.queue: deque[Transfer] = deque()
        self.current: Transfer | None = None
        self.busy_s = 0.0
        self._wake: simpy.Event | None = None
        #: the opposite direction (set by the engine); its busy state slows this link's jobs
        self.other: Link | None = None
        #: fired when the other link starts or finishes a job while this one waits on a job
        self._changed: simpy.Event | None = None
        env.process(self._run())

    def submit(self, x: Transfer) -> None:
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

    def _run(self) -> Proc:
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
            self._poke_other()
            dur = self.model.time(x.nbytes, x.pieces)
            if self.copy is not None and self.measured:
                dur = self.copy(x)
                x.end_s = env.now + dur
                yield At(env, dur, URGENT)
            elif self.model.duplex_factor == 1.0 or self.other is None:
                x.end_s = env.now + dur
                yield At(env, dur, URGENT)
            else:
                yield from self._shared(x, dur)
                dur = env.now - x.start_s
            if self.copy is not None and not self.measured:
                self.copy(x)
            self.busy_s += dur
            self.current = None
            self._poke_other()
            self.on_done(x)
            assert x.done is not None
            x.done.succeed()

    def _shared(self, x: Transfer, solo_s: float) -> Proc:
        """Run ``x`` (``solo_s`` seconds alone) at the duplex rate while the other link is busy."""
        env = self.env
        other = self.other
        assert other is not None
        remaining = solo_s
        while True:
            rate = self.model.duplex_factor if other.current is not None else 1.0
            t0 = env.now
            wait = remaining / rate
            x.end_s = t0 + wait
            self._changed = changed = env.event()
            done = At(env, wait, URGENT)
            yield done | changed
            self._changed = None
            if done.processed:    # (an ``At`` counts as triggered from its creation)
                return
            remaining = max(0.0, remaining - (env.now - t0) * rate)

    def _poke_other(self) -> None:
        """This link started or finished a job: the other one's rate changes."""
        o = self.other
        if o is not None and o._changed is not None and not o._changed.triggered:
            o._changed.succeed()


@dataclass(frozen=True)
class TierLinkModel:
    """Timing of one secondary tier's link.

    Attributes:
        read: promotions (tier -> CPU): read bandwidth and per-job latency.
        write: cascades (CPU -> tier): write bandwidth and per-job latency.
        concurrency: jobs in progress at once (their latencies overlap).
    """

    read: TransferModel
    write: TransferModel
    concurrency: int = 1

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")


class TierLink:
    """One secondary tier's link (see the module docstring).

    Args:
        env: the simulation.
        name: the tier's label (``1:nvme``).
        model: its timing.
        on_done: called when a job completes (before its ``done`` event fires).
    """

    def __init__(self, env: simpy.Environment, name: str, model: TierLinkModel,
                 on_done: Callable[[Transfer], None]) -> None:
        self.env = env
        self.name = name
        self.model = model
        self.on_done = on_done
        self._slots = simpy.Resource(env, capacity=model.concurrency)
        self._wire = simpy.Resource(env, capacity=1)
        #: job id -> the earliest time it may complete (its latency's end, then its end)
        self._next: dict[int, float] = {}
        self.busy_s = 0.0
        self.read_s = 0.0
        self.write_s = 0.0

    def submit(self, x: Transfer, is_read: bool) -> None:
        x.submit_s = self.env.now
        x.done = self.env.event()
        self._next[x.job_id] = math.inf
        self.env.process(self._job(x, is_read))

    @property
    def next_completion_s(self) -> float:
        """No job of this link completes before this time (a lower bound)."""
        return min(self._next.values(), default=math.inf)

    def __len__(self) -> int:
        return len(self._next)

    def _job(self, x: Transfer, is_read: bool) -> Proc:
        env = self.env
        m = self.model.read if is_read else self.model.write
        with self._slots.request() as slot:
            yield slot
            x.start_s = env.now
            self._next[x.job_id] = env.now + m.latency_s
            if m.latency_s:
                yield At(env, m.latency_s, URGENT)
            with self._wire.request() as wire:
                yield wire
                dur = x.nbytes / m.bandwidth_bytes_per_s
                x.end_s = env.now + dur
                self._next[x.job_id] = x.end_s
                yield At(env, dur, URGENT)
                self.busy_s += dur
        if is_read:
            self.read_s += env.now - x.start_s
        else:
            self.write_s += env.now - x.start_s
        del self._next[x.job_id]
        self.on_done(x)
        assert x.done is not None
        x.done.succeed()


class CopyHooks:
    """The torch data path's calls (see the module docstring).

    Args:
        copy: the :class:`~sim.engine.copypath.CopyPath`.
        gpu: the scheduler's GPU cache (block ids of a request).
        conn: the connector (chunk keys, for the messages).
        layout: the KV layout.
        report: ``(req_id, when, group, chunk, message)`` of a bad block.
    """

    def __init__(self, copy: Any, gpu: GpuKVCache, conn: OffloadingScheduler | None, layout: Layout,
                 report: Callable[[str, str, int, int, str], None]) -> None:
        self.copy = copy
        self.gpu = gpu
        self.conn = conn
        self.layout = layout
        self.report = report
        self._reported: dict[str, set[tuple[int, int]]] = {}

    def run(self, x: Transfer) -> float:
        """Execute a transfer job on the tensors; its measured seconds."""
        p = x.plan
        assert p is not None
        if isinstance(p, LoadPlan):
            return float(self.copy.load(p.group_sizes, p.block_indices, p.dst_block_ids, p.slots))
        return float(self.copy.store(p.group_sizes, p.block_indices, p.src_block_ids, p.slots))

    def _ids(self, r: LiveRequest) -> list[list[int]]:
        return self.gpu.block_ids(r.req_id)

    def write(self, r: LiveRequest, start: int, end: int) -> None:
        """The step computed tokens [start, end) of ``r``: write their KV fingerprints."""
        if end > start:
            self.copy.compute(self._ids(r), r.full_hashes, r.salt, start, end)

    def _verify(self, r: LiveRequest, ranges: list[tuple[int, int]], when: str) -> None:
        """Check what ``r`` will read; report each bad block once."""
        seen = self._reported.setdefault(r.req_id, set())
        for v in self.copy.verify(r.req_id, self._ids(r), r.full_hashes, r.salt, ranges):
            if (v.group, v.block_index) in seen:
                continue
            seen.add((v.group, v.block_index))
            bpc = self.layout.blocks_per_chunk
            chunk = v.block_index // bpc
            keys = self.conn.keys_of(r.req_id, v.group) if self.conn is not None else []
            key = keys[chunk] if chunk < len(keys) else None
            self.report(r.req_id, when, v.group, chunk,
                        f"block {v.block_index} (GPU block {v.block_id}, chunk key {key}) token {v.token}: "
                        f"expected {v.expected & _U64:#018x}, found {v.found & _U64:#018x}")

    def verify_load(self, r: LiveRequest, plan: LoadPlan) -> None:
        """After a load completes: the blocks it filled."""
        n = r.num_computed
        ranges = []
        for g, spec in enumerate(self.layout.groups):
            bs = spec.tokens_per_block
            first = plan.block_indices[g] * bs if plan.group_sizes[g] else n
            ranges.append((min(first, n), n))
        self._verify(r, ranges, "load")

    def verify_read(self, r: LiveRequest) -> None:
        """Before the first step after a load: every block ``r`` will read."""
        n = r.num_computed
        ranges = []
        for g, spec in enumerate(self.layout.groups):
            first = self.gpu.retained_range(g, n)[0] * spec.tokens_per_block
            ranges.append((min(first, n), n))
        self._verify(r, ranges, "read")
