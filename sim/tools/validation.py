"""Replays of published measurements of vLLM with CPU KV offloading (``benchmarks/validate_published.py``).

What it models
    A ``validation/1`` file (``benchmarks/validation/published.toml``) lists
    published figures, one ``[[cases]]`` entry each, with the model, GPU,
    tensor parallelism and vLLM settings of the measured setup. Each case is
    replayed as kvsim runs of the shipped model and hardware files:

    * ``ttft_reduction``: one prompt of ``prompt_tokens`` tokens alone on an
      idle engine (cold: a full prefill), then, once it has finished and its
      chunks are stored, the same prompt again (a CPU hit: loaded, the last
      token computed). The figure is cold TTFT / CPU-hit TTFT, as in the
      measurements (one request at a time, one output token).
    * ``throughput_gain``: a batch of ``requests`` prompts of
      ``prompt_tokens`` tokens arriving at once, a fraction ``hit_rate`` of
      them found in the CPU cache (warmed beforehand, the warm-up not timed),
      each producing one token. Throughput is (prompt + output tokens) /
      (last finish - batch arrival); the figure is its ratio to the same
      batch without hits. The hits follow the measured benchmark's pattern:
      in every 100 requests, those at positions ``int(i x 100 / hits)``,
      cycling over the stored prompts (as many as the CPU cache holds,
      rounded down to a hundred, times the hit rate, so that none is
      evicted before it is hit).
    * ``layout_ttft_reduction`` and ``layout_throughput_gain``: a published
      gain of one vLLM release over an earlier one, "up to" some factor. The
      case's ``baseline`` holds the run keys the earlier release changes
      (e.g. its KV layout, ``model.kv_transfer_piece = "kv"``); the figure is
      the largest ratio over the points ``up_to`` of the earlier CPU-hit TTFT
      to the case's (prompt sizes, as ``ttft_reduction`` replays them), or of
      the case's throughput to the earlier one (CPU hit rates, as
      ``throughput_gain`` replays them, every planned hit not required).

Simplifications
    The replay times only the engine: the frontend (``LLM.generate``'s
    request handling, an HTTP server, tokenization) adds the same fixed time
    to a cold and a CPU-hit request in a measurement and none in kvsim, which
    makes kvsim's TTFT ratios larger for short prompts (docs/validation.md).
    Prompts are synthetic hash chains: equal keys share every block.

Invariants
    Deterministic: the same file gives the same table (no randomness; the
    runs' ids come from the case). A case whose run does not end ``ok`` is an
    error, never a figure.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from sim.engine.loop import simulate
from sim.engine.metrics import MemorySink, Recorder
from sim.errors import InputError
from sim.io.scenario import build_run, located
from sim.io.schema import Strict
from sim.io.workload import Request, chain_hash
from sim.model.costs import RooflineStepModel

__all__ = ["CaseResult", "PublishedCase", "ValidationFile", "load_cases", "replay", "throughput", "ttft_pair"]

#: a replay's figure is "within" the published one when |kvsim / published - 1| <= this (issue 17, item 5)
TOLERANCE = 0.25
#: seconds between the phases of a replay (warm-up or cold request, then the measured one): longer
#: than any replayed prefill, so that the first phase has finished and its stores have completed
_GAP_S = 10_000.0


Metric = Literal["ttft_reduction", "throughput_gain", "layout_ttft_reduction", "layout_throughput_gain"]


class Source(Strict):
    """One publication: where it is and what was measured."""

    url: str = Field(description="address of the publication")
    title: str = Field(description="its title")
    authors: str = Field(description="who measured")
    date: str = Field(description="publication date, YYYY-MM-DD")
    text: str | None = Field(default=None, description="address of its text, when the page is rendered")
    setup: str = Field(description="the measured setup: software, GPU, model, settings")
    prompt_grid: list[int] = Field(default_factory=list,
                                   description="prompt sizes the source measured (kvsim's curve)")
    hit_rate_grid: list[float] = Field(default_factory=list,
                                       description="CPU hit rates the source measured (kvsim's curve)")


class PublishedCase(Strict):
    """One published figure and the setup to replay it."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$", description="case name")
    source: str = Field(description="a key of [sources]")
    metric: Metric = Field(description="what the figure is")
    model: str = Field(description="a shipped model file (scenarios/models/<name>.toml)")
    gpu: str = Field(description="a shipped hardware profile (scenarios/hardware/<name>.toml)")
    tensor_parallel: int = Field(default=1, gt=0, description="GPUs of the measured engine")
    prompt_tokens: int = Field(gt=16, le=1_000_000,
                               description="prompt length, tokens (layout_ttft_reduction: up_to's largest)")
    hit_rate: float | None = Field(default=None, ge=0, le=1, description="CPU hit rate (throughput_gain)")
    requests: int | None = Field(default=None, gt=0, le=100_000, description="batch size (throughput_gain)")
    distinct_hit_prompts: int | None = Field(
        default=None, gt=0, description="stored prompts the hits cycle over (throughput_gain; default: "
        "as many as the CPU cache holds, times the hit rate, as the measured benchmark)")
    published: float = Field(gt=0, description="the published figure")
    published_parts: list[float] | None = Field(
        default=None, min_length=2, max_length=2,
        description="the two published figures the ratio is made of, when given (TTFT: cold and CPU-hit s)")
    reading: str = Field(description="how the figure was read: text, table, or off a plot (with its error)")
    run: dict[str, Any] = Field(default_factory=dict, description="run/1 keys of the replay (vLLM settings)")
    baseline: dict[str, Any] | None = Field(
        default=None, description="layout_* metrics: run/1 keys the compared (earlier) setup changes")
    up_to: list[float] | None = Field(
        default=None, min_length=1, description="layout_* metrics: the figure is the largest ratio over "
        "these points ('up to'): prompt sizes (layout_ttft_reduction) or CPU hit rates "
        "(layout_throughput_gain)")

    @model_validator(mode="after")
    def _metric_keys(self) -> PublishedCase:
        throughput = self.metric == "throughput_gain"
        if throughput and (self.hit_rate is None or self.requests is None):
            raise ValueError("a throughput_gain case needs hit_rate and requests")
        if self.metric == "layout_throughput_gain" and self.requests is None:
            raise ValueError("a layout_throughput_gain case needs requests")
        if not throughput and self.hit_rate is not None:
            raise ValueError("hit_rate belongs to throughput_gain cases")
        if self.metric in ("ttft_reduction", "layout_ttft_reduction") and self.requests is not None:
            raise ValueError("requests belongs to throughput cases")
        if self.metric == "layout_ttft_reduction" and self.up_to and self.prompt_tokens != max(self.up_to):
            raise ValueError("prompt_tokens of a layout_ttft_reduction case is its largest point of up_to")
        layout = self.metric.startswith("layout_")
        if layout != (self.baseline is not None and self.up_to is not None):
            raise ValueError("baseline and up_to belong to (and are needed by) layout_* cases")
        rates = self.up_to if self.metric == "layout_throughput_gain" else None
        if rates and not all(0 <= h <= 1 for h in rates):
            raise ValueError("up_to of a layout_throughput_gain case holds CPU hit rates in [0, 1]")
        return self


class ValidationFile(Strict):
    """A ``validation/1`` file."""

    schema_: Literal["validation/1"] = Field(alias="schema", description="format and version")
    sources: dict[str, Source] = Field(min_length=1, description="publications by key")
    cases: list[PublishedCase] = Field(min_length=1, description="published figures")

    @model_validator(mode="after")
    def _known_sources(self) -> ValidationFile:
        ids = [c.id for c in self.cases]
        if len(set(ids)) != len(ids):
            raise ValueError("case ids must be unique")
        for c in self.cases:
            if c.source not in self.sources:
                raise ValueError(f"case {c.id!r} names unknown source {c.source!r}")
        return self


@dataclass(frozen=True, slots=True)
class CaseResult:
    """A case's replay: kvsim's figure beside the published one."""

    case: PublishedCase
    kvsim: float
    #: the two figures the ratio is made of (cold and CPU-hit TTFT in s, or the two tokens/s;
    #: layout_* metrics: the earlier setup's CPU-hit TTFT and the case's, or the case's tokens/s
    #: and the earlier setup's, at the point of the largest ratio)
    numerator: float
    denominator: float
    #: layout_* metrics: the point of ``up_to`` where the ratio is largest
    at: float | None = None

    @property
    def rel_error(self) -> float:
        """kvsim / published - 1 (positive: kvsim predicts a larger gain)."""
        return self.kvsim / self.case.published - 1.0

    @property
    def within(self) -> bool:
        """Whether kvsim is within :data:`TOLERANCE` of the published figure."""
        return abs(self.rel_error) <= TOLERANCE


def load_cases(path: str | Path) -> ValidationFile:
    """Read and validate a ``validation/1`` file.

    Raises:
        InputError: not TOML, unknown keys, wrong types, a case without its metric's keys.
    """
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InputError(str(p), "file", str(exc), "a readable validation/1 TOML file") from None
    try:
        return ValidationFile.model_validate(data)
    except ValidationError as exc:
        raise located(exc, str(p), ValidationFile) from None


def _request(rid: str, arrival_s: float, prompt: int, key: int, tph: int, salt: int) -> Request:
    """A prompt whose hashes depend only on ``key`` (equal keys share all KV) and one output
    token whose hash depends on ``salt`` (unique per request)."""
    out = 1
    hashes: list[int] = []
    h = 0
    n_prompt = prompt // tph
    for j in range((prompt + out) // tph):
        token_block = key * 1_000_003 + j if j < n_prompt else -(salt * 1_000_003 + j) - 1
        h = chain_hash(h, token_block)
        hashes.append(h)
    return Request(rid, arrival_s, prompt, out, hashes, tokens_per_hash=tph)


def _spec(case: PublishedCase, base: Path, mfu: float | None = None) -> Any:
    data: dict[str, Any] = copy.deepcopy(case.run)
    data["schema"] = "run/1"
    data["name"] = case.id
    data.setdefault("model", {})["name"] = case.model
    data.setdefault("hardware", {})["profile"] = case.gpu
    data.setdefault("costs", {})["tensor_parallel"] = case.tensor_parallel
    spec = build_run(data, base)
    if mfu is None:
        return spec
    step = spec.step_cost
    if not isinstance(step, RooflineStepModel):
        raise ValueError(f"case {case.id}: mfu applies to the roofline step model only")
    peak = spec.hardware.gpu_profile.dense_bf16_flops
    scaled = dataclasses.replace(step, flops_per_s=peak * mfu, token_rate_curve=())
    return dataclasses.replace(spec, step_cost=scaled)


def _frames(spec: Any, reqs: Sequence[Request], case: PublishedCase) -> Any:
    sink = MemorySink()
    res = simulate(spec.engine_config(), list(reqs), Recorder(sink))
    if res.status != "ok":
        raise RuntimeError(f"case {case.id}: the replay ended {res.status!r}")
    return sink.frames()["requests"].set_index("req_id")


def _first_phase_done(df: Any, case: PublishedCase) -> None:
    first = df[df.arrival_s < _GAP_S]
    if len(first) and not (first.finish_s < _GAP_S).all():
        raise RuntimeError(f"case {case.id}: the first phase had not finished {_GAP_S:g} s later")


def ttft_pair(case: PublishedCase, base: Path, mfu: float | None = None) -> tuple[float, float]:
    """Cold and CPU-hit TTFT (s) of the case's prompt, each alone on an idle engine (``mfu``:
    a what-if constant efficiency of the matmuls instead of the GPU profile's, for every step;
    attention pairs keep their own)."""
    spec = _spec(case, base, mfu)
    tph = spec.layout.tokens_per_hash
    reqs = [_request("cold", 0.0, case.prompt_tokens, 1, tph, 0),
            _request("hit", _GAP_S, case.prompt_tokens, 1, tph, 1)]
    df = _frames(spec, reqs, case)
    _first_phase_done(df, case)
    if int(df.loc["hit", "cpu_hit_tokens"]) == 0:
        raise RuntimeError(f"case {case.id}: the second request found nothing in the CPU cache")
    return float(df.loc["cold", "ttft_s"]), float(df.loc["hit", "ttft_s"])


def throughput(case: PublishedCase, base: Path, hit_rate: float, requests: int | None = None,
               mfu: float | None = None) -> float:
    """Tokens/s of the case's batch at ``hit_rate`` (``requests`` overrides the batch size;
    ``mfu`` as in :func:`ttft_pair`).

    Raises:
        RuntimeError: the replay did not end, or a planned hit found nothing in the CPU
            cache (the figure would not be at ``hit_rate``).
    """
    rate, hit, wanted = throughput_and_hits(case, base, hit_rate, requests, mfu)
    if hit != wanted:
        raise RuntimeError(f"case {case.id}: {hit} CPU hits in the batch, {wanted} planned")
    return rate


def throughput_and_hits(case: PublishedCase, base: Path, hit_rate: float, requests: int | None = None,
                        mfu: float | None = None) -> tuple[float, int, int]:
    """As :func:`throughput`, without requiring every planned hit: ``(tokens/s, requests of
    the batch that hit the CPU cache, hits planned)``. A planned hit can miss when the batch's
    own stores evicted its prompt (the prompts cycle once the batch has more hits than the
    warmed prompts), as in the measured benchmark."""
    spec = _spec(case, base, mfu)
    tph = spec.layout.tokens_per_hash
    n = requests or case.requests or 0
    hits = round(hit_rate * 100)
    positions = {int(i * 100 / hits) for i in range(hits)} if hits else set()
    if case.distinct_hit_prompts is not None:
        distinct = case.distinct_hit_prompts
    else:  # as the measured benchmark: as many prompts as the CPU cache holds, times the hit rate
        chunk_tokens = max(g.tokens_per_block for g in spec.layout.groups) * spec.layout.blocks_per_chunk
        per_prompt = -(-case.prompt_tokens // chunk_tokens)
        distinct = spec.cpu_chunks // per_prompt // 100 * hits
    distinct = max(1, min(distinct, n))
    warm = [_request(f"w{k}", 0.0, case.prompt_tokens, 1_000_000 + k, tph, k)
            for k in range(distinct)] if hits else []
    batch: list[Request] = []
    j = 0
    for i in range(n):
        if i % 100 in positions:
            batch.append(_request(f"h{i}", _GAP_S, case.prompt_tokens, 1_000_000 + j, tph, distinct + i))
            j = (j + 1) % distinct
        else:
            batch.append(_request(f"m{i}", _GAP_S, case.prompt_tokens, 2_000_000 + i, tph, distinct + i))
    df = _frames(spec, warm + batch, case)
    _first_phase_done(df, case)
    measured = df[df.arrival_s >= _GAP_S]
    if not (measured.status == "finished").all():
        raise RuntimeError(f"case {case.id}: not every request of the batch finished")
    hit_requests = int((measured.cpu_hit_tokens > 0).sum())
    wanted = sum(1 for r in batch if r.req_id.startswith("h"))
    tokens = int((measured.prompt_tokens + measured.output_tokens).sum())
    return tokens / (float(measured.finish_s.max()) - _GAP_S), hit_requests, wanted


def replay(case: PublishedCase, base: Path, *, requests: int | None = None, mfu: float | None = None
           ) -> CaseResult:
    """Replay one case.

    Args:
        case: the published figure and its setup.
        base: folder that relative paths of the case's ``run`` keys start from.
        requests: shrinks a throughput batch (tests).
        mfu: a what-if efficiency of the matmuls (a sensitivity diagnostic, never a calibration).

    Raises:
        InputError: the case's run keys do not make a valid scenario.
        RuntimeError: a replay did not end ``ok``, or its CPU hit did not happen.
    """
    if case.metric == "ttft_reduction":
        cold, hit = ttft_pair(case, base, mfu)
        return CaseResult(case, cold / hit, cold, hit)
    if case.metric.startswith("layout_"):
        return _layout_replay(case, base, requests, mfu)
    assert case.hit_rate is not None
    with_hits = throughput(case, base, case.hit_rate, requests, mfu)
    without = throughput(case, base, 0.0, requests, mfu)
    return CaseResult(case, with_hits / without, with_hits, without)


def _merged(run: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """``run`` with the tables of ``change`` merged in, key by key."""
    out = copy.deepcopy(run)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _layout_replay(case: PublishedCase, base: Path, requests: int | None, mfu: float | None) -> CaseResult:
    """The largest ratio over ``up_to`` between the case's setup and its ``baseline`` (the
    same run with the earlier layout's keys): CPU-hit TTFT earlier / now for each prompt
    size, or tokens/s now / earlier for each CPU hit rate."""
    assert case.baseline is not None and case.up_to is not None
    earlier = case.model_copy(update={"run": _merged(case.run, case.baseline)})
    best: CaseResult | None = None
    for point in case.up_to:
        if case.metric == "layout_ttft_reduction":
            n = int(point)
            _, hit_now = ttft_pair(case.model_copy(update={"prompt_tokens": n}), base, mfu)
            _, hit_then = ttft_pair(earlier.model_copy(update={"prompt_tokens": n}), base, mfu)
            result = CaseResult(case, hit_then / hit_now, hit_then, hit_now, point)
        else:
            now, _, _ = throughput_and_hits(case, base, point, requests, mfu)
            then, _, _ = throughput_and_hits(earlier, base, point, requests, mfu)
            result = CaseResult(case, now / then, now, then, point)
        if best is None or result.kvsim > best.kvsim:
            best = result
    assert best is not None
    return best
