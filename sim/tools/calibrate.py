"""``kvsim calibrate --from-run``: fit the step and link coefficients to a real vLLM run.

What it does
    A real run is the per-request output of vLLM's serving benchmark
    (``vllm bench serve --save-result --save-detailed``: :func:`read_bench_run`)
    plus the scenario that describes what was served (model, hardware profile,
    scheduler limits, tensor parallelism) and the trace the benchmark replayed
    (the scenario's workload, or ``--trace``). :func:`calibrate_from_run`
    checks that the run is the trace's (:func:`match_run`), replays it
    through kvsim's own engine, and fits the coefficients of the roofline
    step model (:class:`~sim.model.costs.RooflineStepModel`) a run can
    identify:

    * ``mfu`` and ``mbu``: the fractions of the GPU's dense BF16 peak and of
      its HBM bandwidth the step reaches (``1 / (peak x mfu)`` seconds per
      FLOP, ``1 / (bandwidth x mbu)`` per byte);
    * ``host_step_s`` and ``host_per_request_s``: the engine's own time per
      step and per scheduled request.

    Optionally, vLLM's Prometheus text (``--metrics``: :func:`read_metrics`)
    gives the offloading connector's totals per direction (bytes, seconds,
    jobs), from which :func:`fit_link` solves each direction's bandwidth.

The fit (a fixed point of replay and least squares)
    With the coefficients ``x`` of the previous round, the run is replayed
    (decode fast-forward off, so every step is seen) and each step ``k``
    leaves its load: scheduled requests ``n_k``, FLOPs ``F_k``, bytes
    ``M_k``. Its time is ``T_k = h_step + h_req n_k + max(F_k / flops,
    M_k / bytes)``, linear in ``(h_step, h_req, 1 / flops, 1 / bytes)`` once
    the roof of each step is fixed. A request's TTFT is the fixed time vLLM
    takes to tokenize a text prompt (``costs.tokenize``) and to hash it (no
    coefficient moves them: ``EngineConfig.prompt_tokenize_s_per_token`` and
    ``prompt_hash_s_per_block``, held at the profile's), then
    the time of the steps (or the parts of the steps) between the scheduler
    seeing it and its first token plus the time the engine was not
    computing then (waiting for a flushed store, idle); its decode time,
    from first to last token, the same without the hashing. Holding each
    step's share of each window and those gaps, every
    request gives two rows of a linear least-squares problem, in relative
    error: ``(predicted - measured) / measured`` of TTFT and of decode time.
    The bounded problem (``x >= 0``, ``mfu`` and ``mbu`` at most 1) is
    solved exactly (:func:`_bounded_lstsq`), the roofs are updated, and the
    run is replayed with the new coefficients. The replay's own error (the
    same weighted terms) decides: a step towards the optimum is halved until
    the error drops; where no step does (the error jumps wherever the
    schedule changes), a few more linearised optima are followed before the
    fit stops. Rounds stop when a round moves no coefficient, or lowers the
    error, by more than 0.1 % (at most :data:`MAX_ROUNDS`). At the true
    coefficients the replayed schedule is the run's, so they are a fixed point.
    A decode time of ``m`` inter-token latencies weighs ``sqrt(m)`` against
    a TTFT (inverse-variance weighting of independent per-token jitter).

What a run can identify (and what it cannot)
    Each coefficient needs steps in which its term varies independently of
    the others: ``mfu`` long prefills (compute-bound), ``mbu`` decode steps
    with varied KV reads (memory-bound), ``host_per_request_s`` varied batch
    sizes, and ``host_step_s`` whatever is left constant per step. With one
    prompt length, one concurrency, or only decode steps, terms trade off:
    :attr:`StepFit.stderr` gives each coefficient's standard error from the
    last round's linearisation, and ``--fit`` fixes the others at the
    profile's values. An eager run (``costs.enforce_eager``) adds the launch
    time per layer, ``host_eager_layer_s``: a launch-bound pass costs
    ``host_step_s + layers x host_eager_layer_s`` whatever its batch, so those
    two trade off exactly and neither moves with ``mbu``; its default fit is
    ``mfu`` and ``host_eager_layer_s`` (:data:`DEFAULT_EAGER_FIT`), the launches
    starting from the run's median inter-token latency (the profile's figure
    may sit where the linearised fit drops the launches to 0, from where their
    column is empty). The link: the totals give one equation per direction,
    so the per-job latency and the per-copy overhead stay the profile's and
    only the bandwidth is solved; the seconds vLLM measures include any
    slowdown from the other direction copying at the same time, so the
    bandwidth is the run's effective one.

Simplifications
    * The benchmark's clock: requests arrive at their ``start_times``
      (relative to the first), else at the trace's times; TTFT includes the
      client's and the server's work outside the engine step, which the fit
      charges to the host terms.
    * Failed requests (an error, or no output) are left out of the replay
      and the fit (counted in :attr:`RunFit.failed`).
    * A request generates the run's output length (at most the trace's; the
      benchmark's ``max_tokens``), its prompt is the trace's.

Tolerance (stated by the command, tested)
    On runs generated by kvsim itself from known coefficients
    (:func:`synthetic_run`) with 3 % multiplicative noise on every TTFT and
    inter-token latency, each coefficient of the default fit is within
    :data:`TOLERANCE` (relative) of the truth and each link bandwidth within
    :data:`LINK_TOLERANCE` (``tests/tools/test_calibrate_run.py``); for an eager
    run whose decode passes are launch-bound, :data:`EAGER_TOLERANCE`;
    :func:`tolerance_line` says so in one line.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.engine.loop import ArrivalPath, EngineConfig, simulate
from sim.engine.metrics import MemorySink, Recorder
from sim.errors import InputError
from sim.io.scenario import HOST_KEYS, RunSpec, group_spec
from sim.model.costs import (
    GPU_PROFILES,
    RooflineStepModel,
    StepLoad,
    TransferModel,
    decoder_layers,
    pieces_per_block,
    roofline_step_model,
)
from sim.model.request import Request

__all__ = [
    "DEFAULT_EAGER_FIT",
    "DEFAULT_FIT",
    "EAGER_FIT",
    "EAGER_TOLERANCE",
    "FIT_KEYS",
    "LINK_TOLERANCE",
    "MAX_ROUNDS",
    "TOLERANCE",
    "BenchRun",
    "LinkFit",
    "OffloadTotals",
    "RunFit",
    "StepFit",
    "calibrate_from_run",
    "default_fit",
    "fit_link",
    "hardware_profile",
    "match_run",
    "read_bench_run",
    "read_metrics",
    "report_table",
    "synthetic_run",
    "tolerance_line",
]

#: The step coefficients a run can fit, in the order of the least-squares unknowns.
FIT_KEYS = ("host_step_s", "host_per_request_s", "mfu", "mbu", "host_eager_layer_s")
#: Fitted unless ``--fit`` says otherwise: the host time per request is the weakest identified
#: and keeps its measured figure (docs/costs.md, "The engine's own time").
DEFAULT_FIT = ("mfu", "mbu", "host_step_s")
#: The launch time per layer of an eager run (``costs.enforce_eager``): its launch-bound passes
#: identify it; in a run with CUDA graphs it moves nothing and cannot be fitted.
EAGER_FIT = "host_eager_layer_s"
#: Fitted unless ``--fit`` says otherwise in an eager run: a launch-bound pass costs
#: ``host_step_s + layers x host_eager_layer_s``, the two cannot be told apart (the host's step
#: time is held), and such passes do not depend on ``mbu`` (held).
DEFAULT_EAGER_FIT = ("mfu", EAGER_FIT)

#: Relative error within which the default fit recovers each coefficient of a generated run
#: (``tests/tools/test_calibrate_run.py``: 64 requests, 3 % noise on every TTFT and ITL; over
#: seven seeds of the trace and the noise the worst were 0.6 %, 7.4 % and 22 %: mbu and
#: host_step_s trade off, both being paid on every decode step). ``host_per_request_s`` has
#: none: at the concurrency of such a run it is not identified (errors of 16-80 %), hence held
#: by default.
TOLERANCE = {"mfu": 0.02, "mbu": 0.10, "host_step_s": 0.30}
#: The same for the default fit of an eager run whose decode passes are launch-bound: ``mfu``, and
#: the launch-bound pass ``host_step_s + layers x host_eager_layer_s`` (host_eager_layer_s alone is
#: off by host_step_s's own error over the layers; tests/tools/test_calibrate_run.py, seven traces
#: and launch times of 0.3-1.0 ms per layer: at most 2.1 % and 0.3 %). Where the passes are
#: memory-bound instead (0.2 ms per layer there) the launches are not identified.
EAGER_TOLERANCE = {"mfu": 0.03, "eager_pass_s": 0.01}
#: Relative error within which each link bandwidth is recovered (the counters' totals are exact).
LINK_TOLERANCE = 0.01
#: Replay-and-fit rounds at most.
MAX_ROUNDS = 12
#: Prompt lengths of the run and the trace may differ by this fraction (or 4 tokens): a
#: replay through a tokenizer can merge or split a few tokens at the edges.
INPUT_LEN_TOLERANCE = 0.01
INPUT_LEN_SLACK = 4

_BENCH_HELP = "the JSON of vllm bench serve --save-result --save-detailed"


def default_fit(spec: RunSpec) -> tuple[str, ...]:
    """The keys fitted when ``--fit`` is not given: :data:`DEFAULT_EAGER_FIT` for a scenario
    that runs eager, else :data:`DEFAULT_FIT`."""
    return DEFAULT_EAGER_FIT if spec.scenario.costs.enforce_eager else DEFAULT_FIT


# -- the run ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRun:
    """The per-request results of one ``vllm bench serve`` run (seconds and tokens).

    Attributes:
        source: the file.
        duration_s: the benchmark's duration.
        input_lens: prompt tokens per request, in the order the requests were sent.
        output_lens: output tokens per request (0: failed).
        ttfts: time to first token per request.
        itls: inter-token latencies per request.
        latencies: end-to-end latency per request (None: the file has none; TTFT plus
            the ITLs is used).
        start_times: when each request was sent, in the benchmark's clock (None: the
            trace's arrival times are used).
        errors: the error text per request ("" when it succeeded).
        output_throughput: output tokens per second as the benchmark reports it.
    """

    source: str
    duration_s: float
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    ttfts: tuple[float, ...]
    itls: tuple[tuple[float, ...], ...]
    latencies: tuple[float, ...] | None
    start_times: tuple[float, ...] | None
    errors: tuple[str, ...]
    output_throughput: float

    @property
    def ok(self) -> list[bool]:
        """Whether each request succeeded (no error and some output)."""
        return [not e and n > 0 for e, n in zip(self.errors, self.output_lens, strict=True)]

    def decode_s(self, i: int) -> float:
        """Seconds from request ``i``'s first token to its last."""
        if self.latencies is not None:
            return self.latencies[i] - self.ttfts[i]
        return math.fsum(self.itls[i])


def _number(source: str, key: str, v: Any, *, integer: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0 or (
            integer and v != int(v)):
        what = "a whole number >= 0" if integer else "a finite number >= 0"
        raise InputError(source, key, f"{v!r}", what)
    return v


def read_bench_run(path: Path) -> BenchRun:
    """Read and check a benchmark result file.

    Required keys: ``duration``, and the per-request lists ``input_lens``,
    ``output_lens``, ``ttfts``, ``itls`` (a list per request) and ``errors``, all of
    one length; optional: ``latencies``, ``start_times``, ``output_throughput``.

    Raises:
        InputError: unreadable file, not JSON, a missing key, a value of the wrong kind,
            lists of different lengths.
    """
    source = str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(source, "", f"cannot read it ({exc.strerror or exc})", _BENCH_HELP) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(source, "", f"not JSON ({exc})", _BENCH_HELP) from None
    if not isinstance(data, dict):
        raise InputError(source, "", "not a JSON object", _BENCH_HELP)
    for key in ("duration", "input_lens", "output_lens", "ttfts", "itls", "errors"):
        if key not in data:
            raise InputError(source, key, "missing", f"{_BENCH_HELP} (--save-detailed keeps the "
                             "per-request lists)")
    duration = _number(source, "duration", data["duration"])
    n = None
    lists: dict[str, list[Any]] = {}
    for key in ("input_lens", "output_lens", "ttfts", "itls", "errors", "latencies", "start_times"):
        if key not in data or data[key] is None:
            continue
        v = data[key]
        if not isinstance(v, list):
            raise InputError(source, key, f"a {type(v).__name__}", "a list with one entry per request")
        if n is None:
            n = len(v)
        elif len(v) != n:
            raise InputError(source, key, f"{len(v)} entries, input_lens has {n}",
                             "one entry per request in every per-request list")
        lists[key] = v
    if not n:
        raise InputError(source, "input_lens", "no request", "a run of at least one request")
    ins = tuple(int(_number(source, f"input_lens[{i}]", v, integer=True))
                for i, v in enumerate(lists["input_lens"]))
    outs = tuple(int(_number(source, f"output_lens[{i}]", v, integer=True))
                 for i, v in enumerate(lists["output_lens"]))
    ttfts = tuple(float(_number(source, f"ttfts[{i}]", v)) for i, v in enumerate(lists["ttfts"]))
    itls = []
    for i, v in enumerate(lists["itls"]):
        if not isinstance(v, list):
            raise InputError(source, f"itls[{i}]", f"a {type(v).__name__}", "a list of seconds per request")
        itls.append(tuple(float(_number(source, f"itls[{i}][{j}]", x)) for j, x in enumerate(v)))
    errors = []
    for i, v in enumerate(lists["errors"]):
        if v is not None and not isinstance(v, str):
            raise InputError(source, f"errors[{i}]", f"{v!r}", "a string (empty: no error)")
        errors.append(v or "")
    lat = (tuple(float(_number(source, f"latencies[{i}]", v)) for i, v in enumerate(lists["latencies"]))
           if "latencies" in lists else None)
    starts = (tuple(float(_number(source, f"start_times[{i}]", v))
                    for i, v in enumerate(lists["start_times"])) if "start_times" in lists else None)
    if "output_throughput" in data:
        thr = float(_number(source, "output_throughput", data["output_throughput"]))
    else:
        thr = sum(o for o, e in zip(outs, errors, strict=True) if not e) / duration if duration else 0.0
    run = BenchRun(source, float(duration), ins, outs, ttfts, tuple(itls), lat, starts, tuple(errors), thr)
    if not any(run.ok):
        raise InputError(source, "errors", f"every one of the {n} requests failed",
                         "a run with successful requests")
    return run


def match_run(run: BenchRun, trace: Sequence[Request], trace_name: str) -> tuple[list[Request], list[int]]:
    """The requests to replay: the trace's, at the run's arrival times and output lengths,
    failed requests left out, in arrival order; and each one's position in the run.

    Raises:
        InputError: the run is not the trace's: another number of requests, a prompt
            length beyond :data:`INPUT_LEN_TOLERANCE`, an output longer than the trace's.
    """
    n = len(run.input_lens)
    if len(trace) != n:
        raise InputError(run.source, "input_lens", f"{n} requests, but the trace {trace_name} has "
                         f"{len(trace)}", "the benchmark run of that trace (workload.limit to match "
                         "--num-prompts)")
    t0 = min(run.start_times) if run.start_times is not None else 0.0
    out: list[tuple[float, int, Request]] = []
    ok = run.ok
    for i, (req, inp, outp) in enumerate(zip(trace, run.input_lens, run.output_lens, strict=True)):
        if abs(inp - req.prompt_tokens) > max(INPUT_LEN_SLACK, INPUT_LEN_TOLERANCE * req.prompt_tokens):
            raise InputError(run.source, f"input_lens[{i}]", f"{inp} tokens, but request {i} of the trace "
                             f"{trace_name} has {req.prompt_tokens}",
                             f"the trace's prompt lengths within {INPUT_LEN_TOLERANCE:.0%} or "
                             f"{INPUT_LEN_SLACK} tokens, in the trace's order")
        if outp > req.output_tokens:
            raise InputError(run.source, f"output_lens[{i}]", f"{outp} tokens, but request {i} of the trace "
                             f"{trace_name} asks for at most {req.output_tokens}",
                             "at most the trace's output length (the benchmark's max_tokens)")
        if not ok[i]:
            continue
        arrival = run.start_times[i] - t0 if run.start_times is not None else req.arrival_s
        keep = (req.prompt_tokens + outp) // req.tokens_per_hash
        out.append((arrival, i, Request(req.req_id, arrival, req.prompt_tokens, outp, req.block_hashes[:keep],
                                        req.session_id, req.tokens_per_hash)))
    out.sort(key=lambda t: (t[0], t[1]))  # the trace's order on ties
    return [r for _, _, r in out], [i for _, i, _ in out]


# -- Prometheus metrics --------------------------------------------------------------------------------

#: vLLM 0.30-0.33 OffloadingConnector counters, per direction: (bytes, seconds, jobs); the
#: flat names first, then the deprecated ones with a transfer_type label.
_FLAT = {"h2d": ("vllm:kv_offload_load_bytes_total", "vllm:kv_offload_load_time_total",
                 "vllm:kv_offload_load_size_count"),
         "d2h": ("vllm:kv_offload_store_bytes_total", "vllm:kv_offload_store_time_total",
                 "vllm:kv_offload_store_size_count")}
_DEPRECATED = ("vllm:kv_offload_total_bytes_total", "vllm:kv_offload_total_time_total",
               "vllm:kv_offload_size_count")
_TRANSFER_TYPE = {"h2d": "CPU_to_GPU", "d2h": "GPU_to_CPU"}
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$')
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_METRICS_HELP = "Prometheus text exposition (curl http://HOST:PORT/metrics after the run)"


@dataclass(frozen=True)
class OffloadTotals:
    """One direction's totals over the run: bytes moved, seconds of transfer, jobs."""

    bytes: float
    seconds: float
    jobs: float


def _labels(source: str, n: int, text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            raise InputError(source, f"line {n}", f"bad labels {{{text}}}", _METRICS_HELP)
        out[m.group(1)] = m.group(2)
        pos = m.end()
    return out


def read_metrics(path: Path) -> dict[str, OffloadTotals]:
    """The offloading connector's totals per direction (``h2d``, ``d2h``) in a
    Prometheus text file, summed over every series (engines, models); a direction
    without counters is left out.

    Raises:
        InputError: unreadable file, a line that is not a sample, comment or blank, a
            value that is not a number >= 0, or no offloading counter at all.
    """
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(source, "", f"cannot read it ({exc.strerror or exc})", _METRICS_HELP) from None
    except UnicodeDecodeError as exc:
        raise InputError(source, "", f"not text ({exc})", _METRICS_HELP) from None
    sums: dict[tuple[str, str], float] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None:
            raise InputError(source, f"line {n}", f"{line[:80]!r} is not a sample", _METRICS_HELP)
        name, labels, value = m.group(1), _labels(source, n, m.group(2) or ""), m.group(3)
        try:
            v = float(value)
        except ValueError:
            raise InputError(source, f"line {n}", f"value {value!r}", "a number") from None
        if name.startswith("vllm:kv_offload") and not (math.isfinite(v) and v >= 0):
            raise InputError(source, f"line {n}", f"{name} = {value}", "a finite number >= 0")
        for d, names in _FLAT.items():
            if name in names:
                sums[(d, name)] = sums.get((d, name), 0.0) + v
        if name in _DEPRECATED:
            for d, tt in _TRANSFER_TYPE.items():
                if labels.get("transfer_type") == tt:
                    sums[(d, name)] = sums.get((d, name), 0.0) + v
    out: dict[str, OffloadTotals] = {}
    for d in ("h2d", "d2h"):
        for names in (_FLAT[d], _DEPRECATED):
            if all((d, k) in sums for k in names):
                out[d] = OffloadTotals(*(sums[(d, k)] for k in names))
                break
    if not out:
        raise InputError(source, "", "no vLLM offloading counters (vllm:kv_offload_load_bytes_total, "
                         "_time_total, _size_count and the store ones)",
                         "the /metrics text of a vLLM 0.30-0.33 server with the OffloadingConnector")
    return out


@dataclass(frozen=True)
class LinkFit:
    """One direction's fitted bandwidth.

    Attributes:
        direction: ``h2d`` or ``d2h``.
        totals: what the metrics gave.
        pieces: the copies those bytes make (from the model's layout).
        bandwidth_bytes_per_s: the fitted bandwidth; None when the fixed costs alone
            reach the measured seconds (nothing left to fit: the profile's is kept).
        profile_bytes_per_s: the profile's bandwidth.
    """

    direction: str
    totals: OffloadTotals
    pieces: float
    bandwidth_bytes_per_s: float | None
    profile_bytes_per_s: float


def fit_link(direction: str, totals: OffloadTotals, link: TransferModel, pieces_per_byte: float) -> LinkFit:
    """``bandwidth = bytes / (seconds - jobs x latency - pieces x piece_overhead)``: the
    one unknown the totals of a direction determine (the fixed costs the profile's)."""
    pieces = totals.bytes * pieces_per_byte
    left = totals.seconds - totals.jobs * link.latency_s - pieces * link.piece_overhead_s
    bw = totals.bytes / left if totals.bytes > 0 and left > 0 else None
    return LinkFit(direction, totals, pieces, bw, link.bandwidth_bytes_per_s)


def pieces_per_byte(spec: RunSpec) -> float:
    """Copies per byte of a transfer: the groups' pieces per block over their bytes per block
    (exact for one group, and for groups moved in equal block counts)."""
    lay = spec.layout
    piece = spec.model.kv_transfer_piece
    pieces = sum(pieces_per_block(g, piece) for g in lay.groups)
    nbytes = sum(lay.kv_bytes_per_block(i) or 0 for i in range(len(lay.groups)))
    return pieces / nbytes if nbytes else 0.0


# -- the step fit --------------------------------------------------------------------------------------


class _Recording:
    """A step model that remembers every load and time it was asked for, in order."""

    def __init__(self, inner: RooflineStepModel) -> None:
        self.inner = inner
        self.loads: list[StepLoad] = []
        self.times: list[float] = []

    def time(self, load: StepLoad) -> float:
        t = self.inner.time(load)
        self.loads.append(load)
        self.times.append(t)
        return t

    def scheduler_s(self, load: StepLoad) -> float:
        return self.inner.scheduler_s(load)

    def no_forward_s(self, load: StepLoad) -> float:
        return self.inner.no_forward_s(load)


@dataclass(frozen=True)
class Replay:
    """One replay: per request (in the replayed order) arrival, when the scheduler saw it
    (after the engine core hashed its prompt), first token and finish; per computed step
    its end, time, scheduled requests, FLOPs, bytes and the scheduler's per-block time
    (held, not fitted); the decoder layers whose launches bound an eager pass (0: the run
    replays CUDA graphs)."""

    arrival: np.ndarray
    seen: np.ndarray
    first: np.ndarray
    finish: np.ndarray
    end: np.ndarray
    time: np.ndarray
    n: np.ndarray
    flops: np.ndarray
    nbytes: np.ndarray
    sched: np.ndarray
    layers: float = 0.0


def _replay(cfg: EngineConfig, model: RooflineStepModel, requests: Sequence[Request],
            layers: float = 0.0) -> Replay:
    rec_model = _Recording(model)
    c = dataclasses.replace(cfg, step_cost=rec_model, fast_forward=False)
    sink = MemorySink()
    recorder = Recorder(sink)
    simulate(c, requests, recorder)
    rq = sink.tables["requests"]
    by_id = {rid: i for i, rid in enumerate(rq["req_id"])}
    idx = [by_id[r.req_id] for r in requests]

    def col(name: str) -> np.ndarray:
        return np.array([rq[name][i] if rq[name][i] is not None else math.nan for i in idx], dtype=float)

    st = sink.tables["steps"]
    ends = [s + d for s, d, k in zip(st["start_s"], st["duration_s"], st["n_steps"], strict=True) if k == 1]
    assert len(ends) == len(rec_model.times), "one recorded load per computed step"
    loads = rec_model.loads
    flops = np.array([model.compute_s(x) * model.flops_per_s for x in loads], dtype=float)
    nbytes = np.array([model.step_bytes(x) for x in loads], dtype=float)
    path = ArrivalPath(cfg.prompt_tokenize_s_per_token, cfg.prompt_hash_s_per_block)
    seen = [path.seen_at(r) for r in requests]   # in arrival order, as the engine sees them
    return Replay(col("arrival_s"), np.array(seen, dtype=float), col("first_token_s"), col("finish_s"),
                  np.array(ends, dtype=float),
                  np.array(rec_model.times, dtype=float), np.array([x.requests for x in loads], dtype=float),
                  flops, nbytes, np.array([model.scheduler_s(x) for x in loads], dtype=float), layers)


def _window_rows(rp: Replay, phi: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per window ``(lo, hi]``: the sum of the feature rows ``phi`` of the steps in it,
    each weighted by the share of its computing time inside the window."""
    start = rp.end - rp.time
    cum = np.vstack([np.zeros((1, phi.shape[1])), np.cumsum(phi, axis=0)])
    i0 = np.searchsorted(rp.end, lo, side="right")
    i1 = np.searchsorted(rp.end, hi, side="right")
    rows: np.ndarray = cum[i1] - cum[i0]
    k = len(rp.end)
    for r in range(len(lo)):
        a, b = i0[r], i1[r]
        if a < b and start[a] < lo[r] and rp.time[a] > 0:      # the step running at the window's start
            rows[r] -= (lo[r] - start[a]) / rp.time[a] * phi[a]
        if b < k and start[b] < hi[r] and rp.time[b] > 0:      # the step running at its end
            rows[r] += (hi[r] - max(start[b], lo[r])) / rp.time[b] * phi[b]
    return rows


def _bounded_lstsq(a: np.ndarray, y: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """``min |a x - y|`` with ``x >= lower``: every set of unknowns held at their bound is
    tried, the free ones solved; the best feasible solution wins (exact for a few unknowns)."""
    m = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    best: tuple[float, np.ndarray] | None = None
    for held in itertools.product((False, True), repeat=m):
        x = lower.copy()
        free = [j for j in range(m) if not held[j]]
        at = [j for j in range(m) if held[j]]
        if free:
            rhs = y - a[:, at] @ lower[at]
            sol, *_ = np.linalg.lstsq(a[:, free] / scale[free], rhs, rcond=None)
            x[free] = sol / scale[free]
            if np.any(x[free] < lower[free]):
                continue
        cost = float(np.sum((a @ x - y) ** 2))
        if best is None or cost < best[0]:
            best = (cost, x)
    assert best is not None  # every unknown at its bound is always feasible
    return best[1]


@dataclass(frozen=True)
class StepFit:
    """The fitted step coefficients.

    Attributes:
        values: per key of :data:`FIT_KEYS`, the fitted (or held) value.
        start: the profile's values the fit started from.
        fitted: the keys that were fitted (the others held).
        stderr: per fitted key, its standard error (relative residuals' scatter
            through the last round's linearisation; ``inf``: not identified).
        rounds: replay-and-fit rounds.
        converged: the last round moved no coefficient by more than 1e-4 of it.
        at_bound: fitted keys that ended at a bound (0, or mfu / mbu = 1).
        eager: the scenario runs eager (``costs.enforce_eager``): ``host_eager_layer_s``
            prices its passes; otherwise it is unused (held).
    """

    values: dict[str, float]
    start: dict[str, float]
    fitted: tuple[str, ...]
    stderr: dict[str, float]
    rounds: int
    converged: bool
    at_bound: tuple[str, ...]
    eager: bool = False


def _model(spec: RunSpec, v: dict[str, float]) -> RooflineStepModel:
    cost_shape = spec.model.cost_shape
    assert cost_shape is not None
    return roofline_step_model(
        spec.hardware.gpu_profile, cost_shape, spec.layout.groups,
        param_groups=[group_spec(g, 1) for g in spec.model.cost_groups],
        tensor_parallel=spec.scenario.costs.tensor_parallel, mfu=min(1.0, v["mfu"]), mbu=min(1.0, v["mbu"]),
        host=dataclasses.replace(spec.hardware.host(), step_s=v["host_step_s"],
                                 per_request_s=v["host_per_request_s"],
                                 eager_layer_s=v["host_eager_layer_s"]),
        enforce_eager=spec.scenario.costs.enforce_eager)


def _eager_layers(spec: RunSpec) -> float:
    """The decoder layers an eager pass launches (the step model's count), 0 with CUDA graphs."""
    if not spec.scenario.costs.enforce_eager:
        return 0.0
    return float(decoder_layers([group_spec(g, 1) for g in spec.model.cost_groups]))


def _to_unknowns(spec: RunSpec, v: dict[str, float]) -> np.ndarray:
    g = spec.hardware.gpu_profile
    return np.array([v["host_step_s"], v["host_per_request_s"], 1.0 / (g.dense_bf16_flops * v["mfu"]),
                     1.0 / (g.hbm_bandwidth_bytes_per_s * v["mbu"]), v["host_eager_layer_s"]])


def _from_unknowns(spec: RunSpec, x: np.ndarray) -> dict[str, float]:
    g = spec.hardware.gpu_profile
    return {"host_step_s": float(x[0]), "host_per_request_s": float(x[1]),
            "mfu": float(1.0 / (g.dense_bf16_flops * x[2])),
            "mbu": float(1.0 / (g.hbm_bandwidth_bytes_per_s * x[3])),
            "host_eager_layer_s": float(x[4])}


def _regime(x: np.ndarray, rp: Replay) -> np.ndarray:
    """Per step which roof bounds its forward pass under the unknowns ``x``: 0 compute,
    1 memory, 2 the eager launches (ties go to compute, then memory, as ``max`` keeps
    the first)."""
    compute, memory, launch = x[2] * rp.flops, x[3] * rp.nbytes, x[4] * rp.layers
    regime: np.ndarray = np.where((compute >= memory) & (compute >= launch), 0,
                                  np.where(memory >= launch, 1, 2))
    return regime


#: Step halvings tried per round before the fit stops (a step of 2**-7 of the way).
_HALVINGS = 8
#: A round that moves no coefficient, or lowers the error, by more than this fraction ends the fit.
_SETTLED = 1e-3
#: Linearised optima followed on from a rejected target before the fit stops.
_ESCAPES = 3


@dataclass(frozen=True)
class _Windows:
    """What the fit compares, per row: a window ``(lo, hi]`` of the replay plus a fixed
    time before it that no coefficient moves (a TTFT's prompt hashing), the measured
    seconds they stand for (a TTFT or a decode time) and the row's weight."""

    lo: np.ndarray
    hi: np.ndarray
    fixed: np.ndarray
    measured: np.ndarray
    weight: np.ndarray


def _windows(rp: Replay, run: BenchRun, index: Sequence[int]) -> _Windows:
    """Per request its TTFT window (seen by the scheduler, first token], after the fixed
    time its prompt's hashing took, and its decode window (first token, last token]. In
    relative error, a decode time of ``m`` inter-token latencies
    with independent jitter is ``sqrt(m)`` times steadier than one latency: its row
    weighs ``sqrt(m)`` (inverse-variance weighting; the TTFT row weighs 1)."""
    lo: list[float] = []
    hi: list[float] = []
    fixed: list[float] = []
    meas: list[float] = []
    weight: list[float] = []
    for r, i in enumerate(index):
        lo.append(float(rp.seen[r]))
        hi.append(float(rp.first[r]))
        fixed.append(float(rp.seen[r] - rp.arrival[r]))
        meas.append(run.ttfts[i])
        weight.append(1.0)
        if run.output_lens[i] > 1 and run.decode_s(i) > 0:
            lo.append(float(rp.first[r]))
            hi.append(float(rp.finish[r]))
            fixed.append(0.0)
            meas.append(run.decode_s(i))
            weight.append(math.sqrt(max(1, len(run.itls[i]))))
    return _Windows(np.array(lo), np.array(hi), np.array(fixed), np.array(meas), np.array(weight))


def _cost(rp: Replay, run: BenchRun, index: Sequence[int]) -> float:
    """The replay's weighted squared relative errors over its windows, summed."""
    w = _windows(rp, run, index)
    return float(np.sum((w.weight * ((w.hi - w.lo) + w.fixed - w.measured) / w.measured) ** 2))


def _least_squares(rp: Replay, x: np.ndarray, free: np.ndarray, lower: np.ndarray, run: BenchRun,
                   index: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bounded least-squares optimum of the replay ``rp`` (made with ``x``) linearised:
    each window holds its steps' shares and its gap (time not computing); the roofs of the
    steps are updated until they settle. Returns (optimum, weighted design matrix and
    right-hand side)."""
    w = _windows(rp, run, index)
    gap = (w.hi - w.lo) - _window_rows(rp, rp.time[:, None], w.lo, w.hi)[:, 0]
    held_sched = _window_rows(rp, rp.sched[:, None], w.lo, w.hi)[:, 0]
    scale = w.weight / w.measured
    y = (w.measured - w.fixed - gap - held_sched) * scale
    roof = x
    cand, a_mat = x, np.zeros((len(y), len(x)))
    for _ in range(20):
        regime = _regime(roof, rp)
        phi = np.column_stack([np.ones_like(rp.n), rp.n, np.where(regime == 0, rp.flops, 0.0),
                               np.where(regime == 1, rp.nbytes, 0.0),
                               np.where(regime == 2, rp.layers, 0.0)])
        a_mat = _window_rows(rp, phi, w.lo, w.hi) * scale[:, None]
        held = ~free
        cand = x.copy()
        cand[free] = _bounded_lstsq(a_mat[:, free], y - a_mat[:, held] @ x[held], lower[free])
        if np.array_equal(_regime(cand, rp), regime):
            break
        roof = cand
    return cand, a_mat, y


def fit_steps(spec: RunSpec, cfg: EngineConfig, run: BenchRun, requests: Sequence[Request],
              index: Sequence[int], fit: Sequence[str] | None = None) -> tuple[StepFit, Replay]:
    """Fit the step coefficients ``fit`` (the others held at the profile's) to the run.

    Args:
        spec: the scenario (its hardware gives the starting values and the GPU's peaks).
        cfg: the engine to replay (links possibly fitted already).
        run: the measured run.
        requests: the requests to replay (:func:`match_run`), in arrival order.
        index: each request's position in the run.
        fit: the keys of :data:`FIT_KEYS` to fit (default: :func:`default_fit`).

    Returns:
        The fit and the replay with the fitted coefficients.

    Raises:
        InputError: a successful request with a TTFT of 0.
    """
    if fit is None:
        fit = default_fit(spec)
    hw = spec.hardware
    g = hw.gpu_profile
    # the fit models the matmuls with one constant efficiency: the scenario's, else the
    # profile's large-step figure (the last point of its measured curve), else the default
    mfu = hw.mfu if hw.mfu is not None else g.large_step_mfu
    start = {"host_step_s": hw.host_step_s, "host_per_request_s": hw.host_per_request_s,
             "mfu": mfu, "mbu": hw.mbu, "host_eager_layer_s": hw.host_eager_layer_s}
    layers = _eager_layers(spec)
    if EAGER_FIT in fit and not layers:
        raise InputError("argument", "--fit", f"{EAGER_FIT}: the scenario's passes replay CUDA graphs, so no "
                         "time of the run depends on it", "a scenario with costs.enforce_eager = true, or "
                         f"--fit without {EAGER_FIT}")
    v = dict(start)
    if EAGER_FIT in fit:
        # start from what the run's own decode says (most of its passes are launch-bound): the
        # median inter-token latency less the host's step time, per layer. From the profile's
        # figure the linearised fit can drop the launches to 0, where their column vanishes.
        itls = [t for i in index for t in run.itls[i]]
        per_layer = ((float(np.median(itls)) - hw.host_step_s - hw.host_per_request_s) / layers
                     if itls else 0.0)
        if per_layer > 0:
            v[EAGER_FIT] = per_layer
    for i in index:
        if run.ttfts[i] <= 0:
            raise InputError(run.source, f"ttfts[{i}]", "0 s for a successful request", "a TTFT > 0")
    lower = np.array([0.0, 0.0, 1.0 / g.dense_bf16_flops, 1.0 / g.hbm_bandwidth_bytes_per_s, 0.0])
    free = np.array([k in fit for k in FIT_KEYS])
    x = _to_unknowns(spec, v)
    rp = _replay(cfg, _model(spec, v), requests, layers)
    cost = _cost(rp, run, index)
    converged = False
    rounds = 0
    while rounds < MAX_ROUNDS:
        rounds += 1
        target = _least_squares(rp, x, free, lower, run, index)[0]
        # a step towards the linearised optimum, halved until the replay's own error drops
        t, accepted = 1.0, False
        for _ in range(_HALVINGS):
            x_try = x + t * (target - x)
            v_try = _from_unknowns(spec, x_try)
            rp_try = _replay(cfg, _model(spec, v_try), requests, layers)
            cost_try = _cost(rp_try, run, index)
            if cost_try < cost:
                accepted = True
                break
            t /= 2
        if not accepted:
            # the error is rough where the schedule changes: follow the linearised optima
            # from the target a few replays on before calling this an optimum
            x_try = target
            for _ in range(_ESCAPES):
                v_try = _from_unknowns(spec, x_try)
                rp_try = _replay(cfg, _model(spec, v_try), requests, layers)
                cost_try = _cost(rp_try, run, index)
                if cost_try < cost:
                    accepted = True
                    break
                x_try = _least_squares(rp_try, x_try, free, lower, run, index)[0]
        if not accepted:        # nothing lowers the error: a (local) optimum
            converged = True
            break
        moved = float(np.max(np.abs(x_try - x) / np.maximum(np.abs(x), 1e-300)))
        gain = (cost - cost_try) / cost if cost > 0 else 0.0
        x, v, rp, cost = x_try, v_try, rp_try, cost_try
        if moved <= _SETTLED or gain <= _SETTLED:
            converged = True
            break
    _, a_mat, y = _least_squares(rp, x, free, lower, run, index)
    resid = a_mat @ x - y
    # standard errors of the fitted unknowns, through the chain rule for mfu and mbu
    af = a_mat[:, free]
    dof = max(1, af.shape[0] - af.shape[1])
    sigma2 = float(np.sum(resid ** 2)) / dof
    stderr: dict[str, float] = {}
    try:
        cov = np.linalg.inv(af.T @ af) * sigma2
        se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    except np.linalg.LinAlgError:
        se = np.full(int(free.sum()), math.inf)
    for j, key in zip(range(len(se)), [k for k in FIT_KEYS if k in fit], strict=True):
        col = FIT_KEYS.index(key)
        if key in ("mfu", "mbu"):   # value = 1 / (peak x u): |d value / d u| = value / u
            stderr[key] = float(v[key] * se[j] / x[col]) if x[col] else math.inf
        else:
            stderr[key] = float(se[j])
    at_bound = tuple(k for k in fit if (k in ("mfu", "mbu") and v[k] >= 1.0 - 1e-9) or
                     (k.startswith("host") and v[k] <= 0.0))
    return StepFit(v, start, tuple(k for k in FIT_KEYS if k in fit), stderr, rounds, converged, at_bound,
                   bool(layers)), rp


# -- the whole command ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFit:
    """What ``calibrate --from-run`` found.

    Attributes:
        steps: the step fit.
        links: per direction the link fit (empty without metrics).
        metrics: per metric (``ttft_p50_s``, ``ttft_mean_s``, ``tpot_mean_s``,
            ``output_tok_per_s``), (measured, fitted model's).
        requests: requests replayed (successful ones).
        failed: failed requests left out.
    """

    steps: StepFit
    links: dict[str, LinkFit]
    metrics: dict[str, tuple[float, float]]
    requests: int
    failed: int


def _tpots(first: np.ndarray, finish: np.ndarray, outs: np.ndarray) -> list[float]:
    return [float((b - a) / (o - 1)) for a, b, o in zip(first, finish, outs, strict=True) if o > 1]


def calibrate_from_run(spec: RunSpec, run: BenchRun, metrics: dict[str, OffloadTotals] | None = None,
                       fit: Sequence[str] | None = None) -> RunFit:
    """Fit the spec's step (and, with metrics, link) coefficients to the run.

    Raises:
        InputError: the scenario's step model is not the roofline (``costs.step =
            "auto"``), its decisions are not kvsim's model's, or the run is not its trace's.
    """
    if not isinstance(spec.step_cost, RooflineStepModel):
        raise InputError(str(spec.source), "costs.step", "the fit needs the roofline step model",
                         '"auto" (with the model\'s [shape])')
    if spec.scenario.decisions != "model":
        raise InputError(str(spec.source), "decisions", f"{spec.scenario.decisions!r}: the fit replays the "
                         "run some ten times with kvsim's own scheduler", '"model"')
    trace_name = str(spec.workload_path) if spec.workload_path is not None else spec.scenario.workload.kind
    requests, index = match_run(run, list(spec.requests()), trace_name)
    cfg = spec.engine_config()
    links: dict[str, LinkFit] = {}
    if metrics:
        ppb = pieces_per_byte(spec)
        for d, totals in metrics.items():
            link = cfg.h2d if d == "h2d" else cfg.d2h
            links[d] = lf = fit_link(d, totals, link, ppb)
            if lf.bandwidth_bytes_per_s is not None:
                fitted = dataclasses.replace(link, bandwidth_bytes_per_s=lf.bandwidth_bytes_per_s)
                cfg = (dataclasses.replace(cfg, h2d=fitted) if d == "h2d"
                       else dataclasses.replace(cfg, d2h=fitted))
    steps, rp = fit_steps(spec, cfg, run, requests, index, fit)
    ttft_m = np.array([run.ttfts[i] for i in index], dtype=float)
    outs = np.array([r.output_tokens for r in requests], dtype=float)
    tpot_m = [run.decode_s(i) / (run.output_lens[i] - 1) for i in index if run.output_lens[i] > 1]
    ttft_f = list(rp.first - rp.arrival)
    span = float(np.max(rp.finish) - np.min(rp.arrival))
    m: dict[str, tuple[float, float]] = {
        "ttft_p50_s": (float(np.median(ttft_m)), float(np.median(ttft_f))),
        "ttft_mean_s": (float(np.mean(ttft_m)), float(np.mean(ttft_f))),
        "tpot_mean_s": (float(np.mean(tpot_m)) if tpot_m else math.nan,
                        float(np.mean(_tpots(rp.first, rp.finish, outs))) if tpot_m else math.nan),
        "output_tok_per_s": (run.output_throughput, float(outs.sum()) / span if span > 0 else math.nan),
    }
    return RunFit(steps, links, m, len(requests), len(run.ok) - len(requests))


def tolerance_line(eager: bool = False) -> str:
    """The tested tolerance, in words (the command prints it); ``eager``: an eager run's."""
    if eager:
        return (f"mfu {EAGER_TOLERANCE['mfu']:.0%}, the launch-bound pass (host_step_s + layers x "
                f"host_eager_layer_s) {EAGER_TOLERANCE['eager_pass_s']:.0%}; link bandwidths "
                f"{LINK_TOLERANCE:.0%}; docs/costs.md")
    keys = ", ".join(f"{k} {t:.0%}" for k, t in TOLERANCE.items())
    return f"{keys}; link bandwidths {LINK_TOLERANCE:.0%}; docs/costs.md"


def _fmt_value(key: str, v: float) -> str:
    if key.endswith("_s"):
        return f"{v * 1e6:,.2f} us" if v < 1e-3 else f"{v * 1e3:,.3f} ms"
    return f"{v:.4f}"


def report_table(fit: RunFit) -> str:
    """The coefficients (profile's, fitted, standard error) and the fit's error per metric."""
    s = fit.steps
    lines = [f"{'coefficient':22s} {'profile':>12s} {'fitted':>12s} {'std. error':>12s}"]
    for k in FIT_KEYS:
        held = ("" if k in s.fitted else
                "  (held; unused with CUDA graphs)" if k == EAGER_FIT and not s.eager else "  (held)")
        se = s.stderr.get(k)
        se_txt = "" if se is None else ("n/a" if not math.isfinite(se) else _fmt_value(k, se))
        bound = "  (at its bound)" if k in s.at_bound else ""
        lines.append(f"{k:22s} {_fmt_value(k, s.start[k]):>12s} {_fmt_value(k, s.values[k]):>12s} "
                     f"{se_txt:>12s}{held}{bound}")
    for d, lf in fit.links.items():
        bw = "n/a" if lf.bandwidth_bytes_per_s is None else f"{lf.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
        t = lf.totals
        lines.append(f"{d + '_bandwidth':22s} {lf.profile_bytes_per_s / 1e9:>7.2f} GB/s {bw:>12s}"
                     f"  ({t.jobs:,.0f} jobs, {t.bytes / 1e9:,.3f} GB, {t.seconds:,.3f} s)")
    lines.append("")
    lines.append(f"{'metric':22s} {'measured':>12s} {'model':>12s} {'rel. error':>11s}")
    names = {"ttft_p50_s": "TTFT p50", "ttft_mean_s": "TTFT mean", "tpot_mean_s": "TPOT mean",
             "output_tok_per_s": "throughput (tok/s)"}
    for k, (meas, model) in fit.metrics.items():
        err = (model - meas) / meas if meas and math.isfinite(meas) and math.isfinite(model) else math.nan
        if k != "output_tok_per_s":
            a, b = f"{meas * 1e3:,.2f} ms", f"{model * 1e3:,.2f} ms"
        else:
            a, b = f"{meas:,.1f}", f"{model:,.1f}"
        lines.append(f"{names[k]:22s} {a:>12s} {b:>12s} {err:>+10.1%}")
    note = (f"{fit.requests:,} requests replayed" + (f", {fit.failed} failed left out" if fit.failed else "")
            + f"; {s.rounds} round(s), {'converged' if s.converged else 'NOT converged'}")
    lines.append("")
    lines.append(note)
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    return json.dumps(str(v))


def hardware_profile(spec: RunSpec, fit: RunFit, name: str, results: str, command: str) -> str:
    """A ``hardware/1`` file: the scenario's profile with the fitted coefficients."""
    hw = spec.hardware
    s = fit.steps
    lines = [
        'schema = "hardware/1"',
        f"# Fitted by: {command}",
        f"# from {results} ({fit.requests:,} requests) on the {hw.name!r} profile; "
        f"{s.rounds} round(s){'' if s.converged else ', NOT converged'}.",
        "# Fit error per metric (model vs measured): " + ", ".join(
            f"{k} {((b - a) / a if a else math.nan):+.1%}" for k, (a, b) in fit.metrics.items()),
        f"name = {_toml_value(name)}",
        f"description = {_toml_value(f'{hw.name} fitted to a vLLM run ({Path(results).name})')}",
        f"gpu = {_toml_value(hw.gpu)}",
        f"hbm_bytes = {hw.hbm_bytes}",
        f"gpu_memory_utilization = {hw.gpu_memory_utilization!r}",
    ]
    g, shipped = hw.gpu_profile, GPU_PROFILES.get(hw.gpu)
    # a GPU not shipped, or one whose figures the profile replaced: its figures travel with the file
    if shipped is None or g.dense_bf16_flops != shipped.dense_bf16_flops:
        lines.append(f"dense_bf16_flops = {g.dense_bf16_flops!r}")
    if shipped is None or g.hbm_bandwidth_bytes_per_s != shipped.hbm_bandwidth_bytes_per_s:
        lines.append(f"hbm_bandwidth = {round(g.hbm_bandwidth_bytes_per_s)}")
    if g.attention_efficiency is not None and (shipped is None
                                               or g.attention_efficiency != shipped.attention_efficiency):
        lines.append(f"attention_efficiency = {g.attention_efficiency!r}")
    if hw.cpu_ram_bytes is not None:
        lines.append(f"cpu_ram_bytes = {hw.cpu_ram_bytes}")
    if hw.gpus_per_node is not None:
        lines.append(f"gpus_per_node = {hw.gpus_per_node}")
    for d in ("h2d", "d2h"):
        lf = fit.links.get(d)
        bw = hw.h2d_bandwidth if d == "h2d" else hw.d2h_bandwidth
        if lf is not None and lf.bandwidth_bytes_per_s is not None:
            lines.append(f"# fitted from the run's offloading counters ({lf.totals.jobs:,.0f} jobs)")
            bw = round(lf.bandwidth_bytes_per_s)
        lines.append(f"{d}_bandwidth = {int(bw)}")
    for key in ("h2d_latency_s", "d2h_latency_s", "h2d_piece_overhead_s", "d2h_piece_overhead_s",
                "h2d_duplex_factor", "d2h_duplex_factor", *(k for k in HOST_KEYS if k not in FIT_KEYS)):
        lines.append(f"{key} = {getattr(hw, key)!r}")
    for k in FIT_KEYS:
        se = s.stderr.get(k)
        how = ("held at the profile's" if k not in s.fitted else
               f"fitted, std. error {se:.3g}" if se is not None and math.isfinite(se) else "fitted")
        lines.append(f"{k} = {s.values[k]!r}   # {how}")
    return "\n".join(lines) + "\n"


# -- synthetic runs (tests, the example file) -----------------------------------------------------------


def synthetic_run(spec: RunSpec, *, noise: float = 0.0, seed: int = 0, clock0_s: float = 1000.0
                  ) -> tuple[dict[str, Any], str]:
    """The benchmark JSON and the Prometheus text a run of ``spec`` would give if kvsim's
    model were the truth: every TTFT and inter-token latency times ``1 + noise x N(0, 1)``
    (seeded), each transfer job's seconds as the engine's links took them.

    The ITLs of a request are the gaps between the ends of the steps from its first
    token to its last (one token per step; a preempted request's gaps include the
    wait). Requests go out at their trace times plus ``clock0_s`` (``start_times``).
    """
    cfg = dataclasses.replace(spec.engine_config(), fast_forward=False)
    requests = list(spec.requests())
    sink = MemorySink()
    simulate(cfg, requests, Recorder(sink))
    rq, st, tr = sink.tables["requests"], sink.tables["steps"], sink.tables["transfers"]
    ends = np.array(sorted(s + d for s, d in zip(st["start_s"], st["duration_s"], strict=True)))
    row = {rid: i for i, rid in enumerate(rq["req_id"])}
    rng = np.random.default_rng(seed)

    def noisy(v: float) -> float:
        return max(v * (1.0 + noise * float(rng.standard_normal())), 1e-9)

    out: dict[str, list[Any]] = {k: [] for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies",
                                                  "start_times", "generated_texts", "errors")}
    for r in requests:
        i = row[r.req_id]
        first, finish = rq["first_token_s"][i], rq["finish_s"][i]
        marks = ends[(ends > first) & (ends <= finish)]
        gaps = np.diff(np.concatenate([[first], marks]))
        ttft = noisy(rq["ttft_s"][i])
        itls = [noisy(float(g)) for g in gaps]
        out["input_lens"].append(r.prompt_tokens)
        out["output_lens"].append(r.output_tokens)
        out["ttfts"].append(ttft)
        out["itls"].append(itls)
        out["latencies"].append(ttft + math.fsum(itls))
        out["start_times"].append(clock0_s + r.arrival_s)
        out["generated_texts"].append("")
        out["errors"].append("")
    duration = max(s + lat for s, lat in zip(out["start_times"], out["latencies"], strict=True)) - clock0_s
    total_out = sum(out["output_lens"])
    result: dict[str, Any] = {
        "duration": duration, "completed": len(requests), "failed": 0,
        "total_input_tokens": sum(out["input_lens"]), "total_output_tokens": total_out,
        "request_throughput": len(requests) / duration, "output_throughput": total_out / duration,
        **out}
    lines = []
    for d, (b, t, c) in _FLAT.items():
        sel = [k for k, x in enumerate(tr["direction"]) if x == d]
        nbytes = sum(tr["bytes"][k] for k in sel)
        secs = math.fsum(tr["end_s"][k] - tr["start_s"][k] for k in sel)
        base = b.removesuffix("_total")
        lines += [f"# TYPE {base} counter", f'{b}{{engine="0",model_name="m"}} {float(nbytes)!r}',
                  f"# TYPE {t.removesuffix('_total')} counter", f'{t}{{engine="0",model_name="m"}} {secs!r}',
                  f'{c}{{engine="0",model_name="m"}} {float(len(sel))!r}']
    return result, "\n".join(lines) + "\n"
