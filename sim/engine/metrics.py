"""Records of one run: row schemas, a batching recorder, and the run summary.

What it models
    Nothing of vLLM: this is the simulator's measurement layer. The engine
    appends immutable rows (plain tuples in the column order of
    :data:`TABLES`) to a :class:`Recorder`; the recorder hands them to a
    :class:`Sink` in column batches of at most ``batch_rows`` rows, so that a
    long run streams to disk and memory stays bounded by the batch size. The
    Parquet sink lives in :mod:`sim.io.results`; :class:`MemorySink` keeps
    everything in memory (tests, notebooks).

    Tables (one row per ...):

    * ``requests``: request, written when it leaves the system (finished,
      rejected, or still in flight when the run stops);
    * ``steps``: engine step, or run of fast-forwarded decode steps
      (``n_steps`` > 1);
    * ``transfers``: load (h2d) or store (d2h) job, and with secondary
      tiers each promotion or cascade job (``<tier>:read`` / ``<tier>:write``);
    * ``occupancy``: sample of CPU chunk states and GPU blocks, taken at the
      first step boundary at or after every ``occupancy_interval_s``;
    * ``events``: modelled crashes, hazards, rejections, deadlock breaks,
      integrity violations;
    * ``tiers`` (only with secondary tiers, :data:`OPTIONAL_TABLES`): per
      secondary tier, its chunk states at every occupancy sample.

    :class:`RunSummary` accumulates the figures of ``summary.json`` on the fly
    (counts, sums, and the TTFT / TPOT samples for percentiles).

Invariants
    * every row has exactly the columns of its table, in order (its type);
    * rows of one table are handed to the sink in the order they were added.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast

from sim.model.scheduler import SchedulerStats

__all__ = [
    "COLUMN_DOCS",
    "OPTIONAL_TABLES",
    "ROW_TYPES",
    "TABLES",
    "EventRow",
    "MemorySink",
    "OccupancyRow",
    "Recorder",
    "RequestRow",
    "Row",
    "RunSummary",
    "Sink",
    "StepRow",
    "TierOccupancyRow",
    "TransferRow",
    "percentile",
]

class RequestRow(NamedTuple):
    """One request, written when it leaves the system.

    Units and meanings: ``COLUMN_DOCS["requests"]``.
    """

    req_id: str
    session_id: str | None
    status: str
    arrival_s: float
    seen_s: float
    scheduled_s: float | None
    first_token_s: float | None
    finish_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    prompt_tokens: int
    output_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    cpu_reload_tokens: int
    computed_tokens: int
    recomputed_tokens: int
    loaded_bytes: int
    stored_bytes: int
    load_jobs: int
    store_jobs: int
    deferrals: int
    deferrals_in_flight_jobs: int
    deferrals_pending_or_retry: int
    deferrals_being_loaded: int
    deferred_s: float
    preemptions: int
    crash: str | None


class StepRow(NamedTuple):
    """One engine step, or a run of fast-forwarded decode steps.

    Units and meanings: ``COLUMN_DOCS["steps"]``.
    """

    step: int
    n_steps: int
    start_s: float
    duration_s: float
    prefill_tokens: int
    decode_seqs: int
    context_tokens: float
    running: int
    waiting: int
    loads: int
    stores: int
    preemptions: int
    gpu_blocks_used: int


class TransferRow(NamedTuple):
    """One load (h2d) or store (d2h) job.

    Units and meanings: ``COLUMN_DOCS["transfers"]``.
    """

    job_id: int
    req_id: str
    direction: str
    chunks: int
    blocks: int
    bytes: int
    submit_s: float
    start_s: float
    end_s: float
    flushed: bool


class OccupancyRow(NamedTuple):
    """One sample of CPU chunk states, GPU blocks, queues and links.

    Units and meanings: ``COLUMN_DOCS["occupancy"]``.
    """

    t_s: float
    cpu_present: int
    cpu_pending_store: int
    cpu_loading: int
    cpu_free: int
    gpu_blocks_used: int
    gpu_blocks_cached: int
    running: int
    waiting: int
    waiting_for_kv: int
    h2d_queue: int
    d2h_queue: int


class EventRow(NamedTuple):
    """One modelled crash, hazard, rejection, deadlock break or integrity violation.

    Units and meanings: ``COLUMN_DOCS["events"]``.
    """

    t_s: float
    kind: str
    detail: str
    req_id: str | None
    group: int
    chunk: int
    message: str


class TierOccupancyRow(NamedTuple):
    """One sample of one secondary tier's chunk states (runs with ``[[tiers]]`` only).

    Units and meanings: ``COLUMN_DOCS["tiers"]``.
    """

    t_s: float
    tier: str
    chunks_ready: int
    chunks_pending_write: int
    chunks_reading: int
    chunks_used: int
    capacity_chunks: int | None


Row = RequestRow | StepRow | TransferRow | OccupancyRow | EventRow | TierOccupancyRow

#: table -> row type, in the order tables are written
ROW_TYPES: dict[str, type[Row]] = {
    "requests": RequestRow,
    "steps": StepRow,
    "transfers": TransferRow,
    "occupancy": OccupancyRow,
    "events": EventRow,
    "tiers": TierOccupancyRow,
}

#: tables written only when a run has rows for them (no file, and no column anywhere,
#: otherwise): ``tiers`` exists only with secondary tiers, so a run without them writes
#: exactly the files it wrote before tiers existed
OPTIONAL_TABLES: frozenset[str] = frozenset({"tiers"})

#: annotation -> column type ("?": nullable)
_COLUMN_TYPES = {"str": "str", "str | None": "str?", "int": "int", "int | None": "int?", "float": "float",
                 "float | None": "float?", "bool": "bool"}


def _schema(row: type[Row]) -> tuple[tuple[str, str], ...]:
    """The columns of a row type: its fields, typed by their annotations (kept
    as text: ``typing.NamedTuple`` wraps them in ``ForwardRef``)."""
    hints: dict[str, Any] = row.__annotations__
    return tuple((name, _COLUMN_TYPES[getattr(hints[name], "__forward_arg__", hints[name])])
                 for name in row._fields)


#: table -> ((column, type), ...); types: "str", "str?" (nullable), "int", "int?", "float", "float?", "bool"
TABLES: dict[str, tuple[tuple[str, str], ...]] = {t: _schema(row) for t, row in ROW_TYPES.items()}
_TABLE_OF: dict[type, str] = {row: t for t, row in ROW_TYPES.items()}

#: table -> column -> (unit, meaning): the data dictionary of the run tables
#: (``docs/columns.md`` is generated from it: ``python -m sim.io.columns``). Units:
#: ``s`` simulated seconds, ``tokens``, ``bytes``, ``blocks`` (GPU blocks),
#: ``chunks`` (CPU chunk slots), ``requests``, ``jobs``, ``count``; ``-`` for ids and text.
COLUMN_DOCS: dict[str, dict[str, tuple[str, str]]] = {
    "requests": {
        "req_id": ("-", "the request's id (the trace's, or generated)"),
        "session_id": ("-", "its conversation or session, null when the workload has none"),
        "status": ("-", "finished | rejected (longer than the GPU pool's `max_model_len`) | unfinished "
                        "(still in flight when the run stopped)"),
        "arrival_s": ("s", "arrival time"),
        "seen_s": ("s", "when the scheduler first saw it: the arrival plus the server's tokenization of a "
                        "text prompt (costs.tokenize) and the engine core's prompt hashing, each queued "
                        "one request after another"),
        "scheduled_s": ("s", "first admission (load issued or first prefill step); null if never admitted"),
        "first_token_s": ("s", "time of the first output token; null if none"),
        "finish_s": ("s", "time the last output token was produced; null if not finished"),
        "ttft_s": ("s", "time to first token: first_token_s - arrival_s; null without a token"),
        "tpot_s": ("s", "time per output token after the first: (finish_s - first_token_s) / "
                        "(output_tokens - 1); null below 2 tokens"),
        "prompt_tokens": ("tokens", "prompt length"),
        "output_tokens": ("tokens", "tokens generated"),
        "gpu_hit_tokens": ("tokens", "prompt tokens found in the local GPU prefix cache at first admission"),
        "cpu_hit_tokens": ("tokens", "prompt tokens loaded from the CPU cache at first admission"),
        "cpu_reload_tokens": ("tokens", "tokens loaded from the CPU cache again after a preemption"),
        "computed_tokens": ("tokens", "prefill tokens computed on the GPU, all passes"),
        "recomputed_tokens": ("tokens", "of computed_tokens, those computed again (after a preemption or "
                                        "a dropped CPU hit)"),
        "loaded_bytes": ("bytes", "bytes loaded host to device (h2d) for this request"),
        "stored_bytes": ("bytes", "bytes stored device to host (d2h) for this request"),
        "load_jobs": ("jobs", "load jobs of this request"),
        "store_jobs": ("jobs", "store jobs of this request"),
        "deferrals": ("count", "lookups answered 'ask again next step' (all reasons)"),
        "deferrals_in_flight_jobs": ("count", "deferrals because the request's own jobs were in flight"),
        "deferrals_pending_or_retry": ("count", "deferrals because a hit chunk was pending a store or "
                                                "marked retry"),
        "deferrals_being_loaded": ("count", "deferrals because a hit chunk was being loaded for another "
                                            "request"),
        "deferred_s": ("s", "time from a deferred lookup to the next answered one, summed"),
        "preemptions": ("count", "times the request was preempted"),
        "crash": ("-", "kind of the modelled crash this request hit (missing_chunk, chunk_not_ready, "
                       "assertion), null if none"),
    },
    "steps": {
        "step": ("count", "index of the first engine step of the row"),
        "n_steps": ("count", "forward passes in the row: 1, more for a fast-forwarded run of pure decode "
                             "steps, 0 for a step without one (it only admitted loads, stored or polled "
                             "transfers)"),
        "start_s": ("s", "start of the (first) step"),
        "duration_s": ("s", "duration of the row's steps (a 0-step row that admitted loads: the "
                            "scheduler's time)"),
        "prefill_tokens": ("tokens", "prompt tokens computed in the step"),
        "decode_seqs": ("requests", "requests decoding one token, per step"),
        "context_tokens": ("tokens", "attended context, in full-attention token equivalents"),
        "running": ("requests", "running requests at the end of the step"),
        "waiting": ("requests", "waiting requests at the end of the step (waiting for KV included)"),
        "loads": ("jobs", "load jobs submitted in the step"),
        "stores": ("jobs", "store jobs submitted in the step"),
        "preemptions": ("count", "requests preempted in the step"),
        "gpu_blocks_used": ("blocks", "GPU KV blocks in use (referenced) at the end of the step"),
    },
    "transfers": {
        "job_id": ("-", "the job's id, unique in the run"),
        "req_id": ("-", "the request it belongs to (empty for a tier job)"),
        "direction": ("-", "h2d (a load from the CPU cache) | d2h (a store to the CPU cache) | "
                           "<tier label>:read (a promotion, tier -> CPU) | <tier label>:write (a cascade, "
                           "CPU -> tier), e.g. 1:nvme:read; tier jobs only with [[tiers]]"),
        "chunks": ("chunks", "CPU chunks moved"),
        "blocks": ("blocks", "GPU blocks moved"),
        "bytes": ("bytes", "bytes moved"),
        "submit_s": ("s", "time the job was submitted"),
        "start_s": ("s", "time it started on its link (after queueing behind other jobs)"),
        "end_s": ("s", "time it completed"),
        "flushed": ("-", "a store the engine had to wait for before going on (spec section 7.6)"),
    },
    "occupancy": {
        "t_s": ("s", "sample time: the first step boundary at or after each output.occupancy_interval_s"),
        "cpu_present": ("chunks", "CPU chunk slots holding a stored chunk, ready to load"),
        "cpu_pending_store": ("chunks", "CPU chunk slots whose store is in flight"),
        "cpu_loading": ("chunks", "CPU chunk slots being loaded to the GPU"),
        "cpu_free": ("chunks", "free CPU chunk slots"),
        "gpu_blocks_used": ("blocks", "GPU KV blocks in use (referenced by a request)"),
        "gpu_blocks_cached": ("blocks", "GPU KV blocks findable in the prefix cache (in use or free)"),
        "running": ("requests", "running requests"),
        "waiting": ("requests", "waiting requests, those waiting for their KV load excluded"),
        "waiting_for_kv": ("requests", "requests waiting for their load from the CPU cache"),
        "h2d_queue": ("jobs", "load jobs queued or in flight on the host-to-device link"),
        "d2h_queue": ("jobs", "store jobs queued or in flight on the device-to-host link"),
    },
    "events": {
        "t_s": ("s", "time of the event"),
        "kind": ("-", "crash | hazard | rejected | preempted (a deadlock break) | integrity"),
        "detail": ("-", "the crash kind, hazard kind (double_load, unsafe_read), rejection reason "
                        "(too_long), deadlock_break, or where an integrity violation was found"),
        "req_id": ("-", "the request concerned, null if none"),
        "group": ("-", "the KV cache group concerned, -1 when not applicable"),
        "chunk": ("-", "the chunk index concerned, -1 when not applicable"),
        "message": ("-", "one line for a human"),
    },
    "tiers": {
        "t_s": ("s", "sample time: the occupancy table's (one row per secondary tier and sample)"),
        "tier": ("-", "the tier's vLLM label, <index>:<kind> (1:nvme, 2:fs, ...); the CPU tier (0:primary) "
                      "is the occupancy table's cpu_* columns"),
        "chunks_ready": ("chunks", "chunks held and readable (a promotion may read them)"),
        "chunks_pending_write": ("chunks", "chunk slots whose cascade write is in flight"),
        "chunks_reading": ("chunks", "chunks being promoted to the CPU tier (pinned)"),
        "chunks_used": ("chunks", "chunk slots in use: ready + pending_write + reading"),
        "capacity_chunks": ("chunks", "the tier's capacity in CPU-sized chunk slots; null when unbounded"),
    },
}


class Sink(Protocol):
    """Receives column batches of one table at a time.

    A sink whose class sets ``takes_buffers = True`` gets the non-null number
    columns as the recorder's typed arrays (``array('q')`` for int, ``array('d')``
    for float) instead of lists: the same values, without a Python object per
    value (:class:`sim.io.results.ParquetSink` hands them to Arrow as they are).
    """

    def write(self, table: str, columns: dict[str, list[Any]]) -> None: ...


class MemorySink:
    """Keeps every batch in memory; :meth:`frames` builds DataFrames."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, list[Any]]] = {
            t: {c: [] for c, _ in cols} for t, cols in TABLES.items()}

    def write(self, table: str, columns: dict[str, list[Any]]) -> None:
        dst = self.tables[table]
        for c, values in columns.items():
            dst[c].extend(values)

    def frames(self) -> dict[str, Any]:
        """One pandas DataFrame per table."""
        import pandas as pd  # noqa: PLC0415 -- pandas loads only for in-memory frames (tests, notebooks)

        return {t: pd.DataFrame(cols, columns=[c for c, _ in TABLES[t]])
                for t, cols in self.tables.items()}


#: column type -> compact buffer typecode (None: a plain list); values round-trip exactly
_BUFFER_CODE = {"int": "q", "float": "d"}


class Recorder:
    """Batches rows per table and flushes them to a :class:`Sink`.

    Rows are buffered column by column, non-null numbers in typed arrays (8
    bytes a value instead of a Python object and a tuple slot), so a batch of
    ``batch_rows`` rows costs a few MB whatever the run's length; a flush hands
    the sink plain lists (the same values, so the same Parquet bytes), or the
    typed arrays to a sink that takes them (``takes_buffers``, see :class:`Sink`).

    Args:
        sink: where batches go.
        batch_rows: rows per table kept before a flush (one Parquet row group).
    """

    def __init__(self, sink: Sink, batch_rows: int = 8_192) -> None:
        self.sink = sink
        self.batch_rows = batch_rows
        self._types = {t: tuple(ty for _, ty in cols) for t, cols in TABLES.items()}
        self._names = {t: tuple(c for c, _ in cols) for t, cols in TABLES.items()}
        self._cols: dict[str, list[array[Any] | list[Any]]] = {t: self._empty(t) for t in TABLES}
        self._count: dict[str, int] = dict.fromkeys(TABLES, 0)
        self.rows_written: dict[str, int] = dict.fromkeys(TABLES, 0)
        #: the sink takes the typed arrays themselves (no list of Python numbers per flush)
        self._buffers = bool(getattr(sink, "takes_buffers", False))

    def _empty(self, table: str) -> list[array[Any] | list[Any]]:
        return [array(code) if (code := _BUFFER_CODE.get(ty)) else [] for ty in self._types[table]]

    def add(self, row: Row) -> None:
        """Buffer one row of the table its type names."""
        table = _TABLE_OF.get(type(row))
        if table is None:
            raise TypeError(f"not a row of any table: {row!r}")
        for col, value in zip(self._cols[table], row, strict=True):
            col.append(value)
        self._count[table] += 1
        if self._count[table] >= self.batch_rows:
            self._flush(table)

    def _flush(self, table: str) -> None:
        n = self._count[table]
        if not n:
            return
        cols: dict[str, list[Any]]
        if self._buffers:   # typed arrays stand in for lists of the same numbers (see Sink)
            cols = dict(zip(self._names[table], cast("list[list[Any]]", self._cols[table]), strict=True))
        else:
            cols = {name: col.tolist() if isinstance(col, array) else col
                    for name, col in zip(self._names[table], self._cols[table], strict=True)}
        self._cols[table] = self._empty(table)
        self._count[table] = 0
        self.sink.write(table, cols)
        self.rows_written[table] += n

    def flush(self) -> None:
        """Hand every buffered row to the sink."""
        for t in TABLES:
            self._flush(t)


#: Overload verdict thresholds (docs/metrics.md, "Steady state and overload").
#: The waiting queue's least-squares trend over the arrival window must gain at
#: least this many requests ...
GROWTH_MIN_REQUESTS = 10
#: ... and this share of the requests that arrived, to be called "growing";
GROWTH_MIN_SHARE = 0.05
#: or the drain after the last arrival lasts longer than this share of the
#: arrival window while the queue peaked at DRAIN_MIN_PEAK requests or more.
DRAIN_SHARE = 0.25
DRAIN_MIN_PEAK = 10


def _trend(ts: Sequence[float], ns: Sequence[int]) -> float | None:
    """Least-squares slope of ``ns`` over ``ts`` (None below 3 points or no spread)."""
    k = len(ts)
    if k < 3:
        return None
    mt = sum(ts) / k
    mn = sum(ns) / k
    var = sum((t - mt) ** 2 for t in ts)
    if var <= 0:
        return None
    return sum((t - mt) * (n - mn) for t, n in zip(ts, ns, strict=True)) / var


def load_verdict(s: RunSummary) -> dict[str, Any]:
    """Offered vs served load, the waiting queue's trend and drain, and whether
    the run is ``overloaded``: its queue trend over the arrival window grows
    (by >= max(GROWTH_MIN_REQUESTS, GROWTH_MIN_SHARE x arrivals) requests), or
    the backlog left at the last arrival takes longer than DRAIN_SHARE of the
    arrival window to drain with the queue having peaked at DRAIN_MIN_PEAK or
    more, or the run stopped because its queue reached ``output.stop_at_waiting``
    (then the arrival window is the part of the trace that arrived). On a
    finite trace a stable engine keeps its queue near flat and drains within
    about one request's latency."""
    first, last = s.first_arrival_s, s.last_arrival_s
    end = s.sim_time_s
    span = (last - first) if first is not None and last is not None else 0.0
    served_span = (end - first) if first is not None and end > first else 0.0
    pts = [(t, n) for t, n in zip(s.queue_t, s.queue_n, strict=True)
           if first is not None and last is not None and first <= t <= last]
    slope = _trend([t for t, _ in pts], [n for _, n in pts]) if span > 0 else None
    growth = slope * span if slope is not None else None
    grow_min = max(GROWTH_MIN_REQUESTS, GROWTH_MIN_SHARE * s.requests_arrived)
    trend = "n/a" if growth is None else ("growing" if growth >= grow_min else "stable")
    # a run stopped at its queue limit drained nothing
    drain = (end - last) if last is not None and s.stopped_waiting is None else None
    at_last = pts[-1][1] if pts else None
    reason = ""
    overloaded = False
    if s.stopped_waiting is not None:
        overloaded = True
        reason = (f"the waiting queue reached {s.stopped_waiting} requests at {end:.0f} s and the run "
                  f"stopped there (output.stop_at_waiting): {s.requests_arrived} requests had arrived")
    elif trend == "growing" and growth is not None:
        overloaded = True
        reason = (f"the waiting queue grew by about {growth:.0f} requests over the {span:.0f} s "
                  f"of arrivals (threshold {grow_min:.0f})")
    elif drain is not None and span > 0 and drain > DRAIN_SHARE * span and s.peak_waiting >= DRAIN_MIN_PEAK:
        overloaded = True
        reason = (f"draining the queue after the last arrival took {drain:.0f} s, "
                  f"{drain / span:.0%} of the {span:.0f} s of arrivals (peak queue {s.peak_waiting})")
    return {
        "overloaded": overloaded,
        "reason": reason,
        "arrival_span_s": span,
        "offered_requests_per_s": s.requests_arrived / span if span > 0 else None,
        "offered_prompt_tokens_per_s": s.prompt_tokens / span if span > 0 else None,
        "served_requests_per_s": s.requests_finished / served_span if served_span > 0 else None,
        "served_prompt_tokens_per_s": s.finished_prompt_tokens / served_span if served_span > 0 else None,
        "served_output_tokens_per_s": s.output_tokens / served_span if served_span > 0 else None,
        "queue_trend": trend,
        "queue_growth_requests": growth,
        "waiting_at_last_arrival": at_last,
        "peak_waiting": s.peak_waiting,
        "drain_s": drain,
        "rejected_share": s.requests_rejected / s.requests_arrived if s.requests_arrived else 0.0,
    }


def _quantile_with_missing(served: Sequence[float], missing: int, q: float) -> float | None:
    """:func:`percentile` (same definition) of the sorted ``served`` plus
    ``missing`` values at +inf; None where the result involves one of them."""
    n = len(served) + missing
    if not n:
        return None
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    if lo >= len(served) or (hi >= len(served) and pos > lo):
        return None
    if hi >= len(served):
        return served[lo]
    return served[lo] + (served[hi] - served[lo]) * (pos - lo)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RunSummary(SchedulerStats):
    """Figures of a run, accumulated while it runs (``summary.json``): the
    scheduler's counts (:class:`~sim.model.scheduler.SchedulerStats`, copied in at
    the end) plus what the engine counts itself."""

    requests_finished: int = 0
    requests_rejected: int = 0
    output_tokens: int = 0
    steps: int = 0
    step_rows: int = 0
    h2d_busy_s: float = 0.0
    d2h_busy_s: float = 0.0
    flushed_stores: int = 0
    store_rejections: int = 0
    integrity_violations: int = 0
    sim_time_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    #: first and last arrival time (None: nothing arrived)
    first_arrival_s: float | None = None
    last_arrival_s: float | None = None
    #: largest waiting queue seen at a step boundary
    peak_waiting: int = 0
    #: the waiting queue when the run stopped at ``output.stop_at_waiting`` (None: it did not)
    stopped_waiting: int | None = None
    #: waiting-queue samples (time, requests), one per occupancy sample
    queue_t: array[float] = field(default_factory=lambda: array("d"))
    queue_n: array[int] = field(default_factory=lambda: array("q"))
    #: prompt tokens of the finished requests
    finished_prompt_tokens: int = 0
    #: the secondary tiers' figures (``summary.json`` ``tiers``); None: no tier, no key
    tiers: dict[str, Any] | None = None

    def figures(self) -> dict[str, Any]:
        """The summary as a JSON-ready dict (derived rates included)."""
        prompt = max(1, self.prompt_tokens)
        loaded = self.cpu_hit_tokens + self.cpu_reload_tokens
        t = self.sim_time_s
        out: dict[str, Any] = {
            "requests": {"arrived": self.requests_arrived, "finished": self.requests_finished,
                         "rejected": self.requests_rejected},
            "tokens": {"prompt": self.prompt_tokens, "gpu_hit": self.gpu_hit_tokens,
                       "cpu_hit": self.cpu_hit_tokens, "cpu_reload": self.cpu_reload_tokens,
                       "computed": self.computed_tokens,
                       "recomputed": self.recomputed_tokens, "output": self.output_tokens},
            # of all prompt tokens, the share found at first admission
            "gpu_hit_rate": self.gpu_hit_tokens / prompt,
            "cpu_hit_rate": self.cpu_hit_tokens / prompt,
            # of all prefill work (loaded from CPU + computed, preemption reloads
            # and recomputes included), the share the CPU cache served
            "recompute_saved": loaded / (loaded + self.computed_tokens) if loaded else 0.0,
            "ttft_s": {f"p{q}": percentile(self.ttft_s, q) for q in (50, 90, 99)},
            "tpot_s": {"mean": (sum(self.tpot_s) / len(self.tpot_s)) if self.tpot_s else None,
                       **{f"p{q}": percentile(self.tpot_s, q) for q in (50, 90, 99)}},
            "throughput": {"requests_per_s": self.requests_finished / t if t > 0 else None,
                           "output_tokens_per_s": self.output_tokens / t if t > 0 else None},
            "transfers": {"load_jobs": self.load_jobs, "store_jobs": self.store_jobs,
                          "h2d_bytes": self.loaded_bytes, "d2h_bytes": self.stored_bytes,
                          "h2d_utilisation": self.h2d_busy_s / t if t > 0 else None,
                          "d2h_utilisation": self.d2h_busy_s / t if t > 0 else None,
                          "flushed_stores": self.flushed_stores,
                          "store_rejections": self.store_rejections},
            "engine": {"steps": self.steps, "step_rows": self.step_rows,
                       "preemptions": self.preemptions, "deferrals": self.deferrals,
                       "deferral_reasons": dict(sorted(self.deferral_reasons.items()))},
            "crashes": {"count": self.crashes, "kinds": dict(sorted(self.crash_kinds.items())),
                        "first_s": self.first_crash_s},
            "hazards": {"count": self.hazards, "kinds": dict(sorted(self.hazard_kinds.items()))},
            "integrity_violations": self.integrity_violations,
            "sim_time_s": t,
        }
        if self.tiers is not None:
            out["tiers"] = self.tiers
        out["load"] = self.load_figures()
        out["overloaded"] = out["load"]["overloaded"]
        rejected = self.requests_rejected
        out["requests"]["rejected_share"] = rejected / self.requests_arrived if self.requests_arrived else 0.0
        # TTFT with every rejected request counted as never served (+inf): None
        # where the quantile falls on a rejected one
        served = sorted(self.ttft_s)
        out["ttft_s_with_rejected"] = {
            f"p{q}": _quantile_with_missing(served, rejected, q) for q in (50, 90, 99)}
        return out

    def load_figures(self) -> dict[str, Any]:
        """Offered vs served load and the steady-state verdict (see :func:`load_verdict`)."""
        return load_verdict(self)
