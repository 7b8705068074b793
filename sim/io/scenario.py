"""Scenario files: TOML -> one validated, frozen config tree per run.

What it does
    Every scenario file names its format as its first key (``schema``).
    This module declares the ``run/1``, ``model/1`` and ``hardware/1`` formats
    once, as pydantic models with unknown keys rejected and no silent
    coercion, and turns a run file into a :class:`RunSpec`: the validated
    tree plus the objects a run needs (a :class:`~sim.model.layout.Layout`, the GPU
    pool size, the CPU chunk capacity, the step-time and transfer models, the
    request stream). Any problem becomes one :class:`~sim.errors.InputError`
    naming the file, the dotted key (or ``line N``) and what is allowed.

``run/1`` (defaults in parentheses; sizes are byte counts or strings with a
unit such as ``"64GiB"`` or ``"500MB"``; bandwidths the same, per second,
``"/s"`` optional; times are seconds in keys ending ``_s``)::

    schema = "run/1"
    kvsim_version         (none)        informational; written into resolved scenarios
    name                  (file stem)   results go to results/<name>/
    seed                  (0)           the only source of randomness
    window_logic          ("new")       "old" (vLLM 0.29.0) | "new" (vLLM 0.30.0) | "latest" (vLLM 0.33.0)
    decisions             ("model")     "model" (kvsim's model, by window_logic) | "vllm" (the installed
                                        vLLM's scheduler decides: sim.model.real_vllm, docs/vllm.md) |
                                        "differential" (both in lockstep, every step's decisions
                                        compared; the first divergence stops the run:
                                        sim.tools.differential)
    on_crash              ("record")    "record" | "stop"
    [model]               exactly one of name (scenarios/models/<name>.toml),
                          path (relative to this file) or inline groups = [...]
                          (with an optional label); cost_profile, params_b,
                          weights_bytes, shape = {...}, kv_transfer_piece
                          ("layer" | "block") override the model file's
    [hardware]            profile ("h200": scenarios/hardware/<name>.toml, or a path);
                          at most one of gpu_kv_bytes / gpu_blocks; overrides of
                          gpu_memory_utilization, h2d_/d2h_bandwidth, h2d_/d2h_latency_s,
                          h2d_/d2h_piece_overhead_s, h2d_/d2h_duplex_factor,
                          host_step_s, host_per_request_s, host_per_hashed_block_s,
                          host_per_block_s, host_per_loaded_block_s,
                          host_no_forward_step_s, host_eager_layer_s,
                          host_tokenize_token_s, mfu, mbu (the roofline's
                          efficiencies, default 0.5 and 0.8)
    [cpu_cache]           exactly one of capacity (bytes) / chunks; policy ("lru" | "arc" | "belady")
    [[tiers]]             secondary tiers behind the CPU cache, in lookup order (none by
                          default; docs/tiers.md): device (a storage/1 profile:
                          scenarios/hardware/storage/<name>.toml, or a path) giving the
                          figures below, each overridable; kind ("fs" | kvsim's "nvme",
                          "network", "object"), at most one of capacity (bytes) / chunks
                          (neither: unbounded), read_bandwidth, write_bandwidth,
                          latency_s (0), concurrency (1), policy ("lru")
    [scheduler]           max_num_batched_tokens (8192), max_num_seqs (256),
                          prefix_caching (true), blocks_per_chunk (1), tokens_per_hash (16),
                          offload_prompt_only (true), offloading (true), fast_forward (true),
                          reserve_full_isl (true: vLLM's full-input admission reservation)
    [workload]            kind = "multiturn" (the default; MultiTurnParams fields, limit)
                          | "mooncake" (path, or trace = a published trace's name, found in
                          $KVSIM_TRACES then the fetch cache; limit, time_scale (1.0),
                          block_tokens (512), arrival_jitter_s (0: off))
    [costs]               step ("auto": the roofline of the model's [shape] or its
                          cost_profile's on the hardware's GPU | "zero" | {overhead_s,
                          prefill_token_s, decode_seq_s, context_token_s}), transfer
                          ("hardware" | "zero"), tensor_parallel (1), enforce_eager
                          (false: vLLM's CUDA graphs; true: every forward pass takes at
                          least the model's layers x hardware.host_eager_layer_s, "auto" only),
                          tokenize (false: prompts as token ids; true: text through vLLM's
                          OpenAI server, which tokenizes each prompt, one after another,
                          hardware.host_tokenize_token_s per token, before the engine sees it)
    [copy_path]           enabled (false), mode (fingerprint | realistic), device (auto),
                          timing (model | measured), memory_limit
    [output]              occupancy_interval_s (1.0), max_sim_time_s (none), stop_at_waiting (none)

Derived quantities (documented simplifications)
    * **KV bytes per block id.** vLLM's hybrid allocator gives all groups one
      shared block pool; a block id owns one page in each shared KV tensor,
      i.e. one block of one group's layers. The bytes a block id stands for
      are therefore the *largest* per-group block bytes (in vLLM every group
      has the same page size, so all groups agree; for toy layouts whose
      groups differ this is the worst case, which is also how spec §3.1 and
      §8.4 size a CPU slot).
    * **GPU pool.** ``gpu_blocks = gpu_kv_bytes // block_bytes`` and, as in
      vLLM, the null block is one of them. ``gpu_kv_bytes`` defaults to
      ``gpu_memory_utilization x hbm_bytes - weights / tensor_parallel``
      where the weights are ``weights_bytes``, else ``params_b x 1e9 x 2``
      (bf16), else 0; activation memory is ignored. When that leaves fewer
      than 2 blocks the error names the smallest ``tensor_parallel`` of 1, 2,
      4, 8 (at most the profile's ``gpus_per_node``; dividing the KV heads as
      below) that leaves a pool, sizes in GiB.
    * **Model shapes.** ``model/1`` ``[shape]`` (hidden size, query heads, MLP or
      experts, vocabulary, mamba state; parameter counts derived from them and
      the groups, or given) is the one home of a model's step-cost figures;
      ``costs.step = "auto"`` builds :func:`sim.model.costs.roofline_step_model`
      from it (or from the ``cost_profile`` model's) and the hardware's GPU;
      the default GPU KV budget takes its weights when neither
      ``weights_bytes`` nor ``params_b`` is given. Link and host figures absent
      from a ``hardware/1`` file take its GPU profile's (``docs/costs.md``).
    * **Host RAM.** The CPU cache (``capacity``, or ``chunks`` x slot bytes) is
      refused beyond the profile's ``cpu_ram_bytes`` (the whole node), and
      accepted with one line in :attr:`RunSpec.warnings` (summary key
      :data:`HARDWARE_WARNINGS_KEY`) beyond the run's share of it,
      ``cpu_ram_bytes x tensor_parallel / gpus_per_node``; sizes in GiB.
    * **CPU capacity** (spec §3.1): ``capacity_from_bytes(capacity,
      block_bytes, blocks_per_chunk, copies)``: one slot holds one chunk of
      any group, sized for a block id across all KV tensors of one worker
      times ``blocks_per_chunk``, times ``copies`` = ``tensor_parallel``
      workers (1 when every group is MLA: replicated single copy).
    * **Tensor parallelism** shards the KV heads: a worker holds
      ``max(1, kv_heads // tensor_parallel)`` heads (MLA: 1), so bytes per
      block, transfer sizes and the GPU pool are per worker. As in vLLM,
      ``tensor_parallel`` must divide every non-MLA group's ``kv_heads``, or be
      a multiple of it (the heads are then replicated); anything else is an error.
    * **Limits.** Sizes and counts beyond the fixed limits of
      :mod:`sim.io.schema` (``MAX_BYTES`` = 2**60 B, ``MAX_GPU_BLOCKS``,
      ``MAX_CPU_CHUNKS``, ``MAX_REQUESTS``, ``MAX_TOKENS``; also when derived,
      e.g. the GPU blocks of ``gpu_kv_bytes``) are refused at validation.
    * **Copy path.** ``copy_path.enabled = true`` needs torch; without it the
      scenario is refused at validation (``pip install 'kvsim[torch]'``).
    * **Resolved scenario** (:meth:`RunSpec.resolved_toml`, the results
      folder's ``scenario.toml``): every default filled in, the model inlined
      (``label`` = its name), hardware values explicit, sizes in bytes, the
      trace path absolute (a trace named
      by ``trace``: its name and the content's ``sha256``, the same on every
      machine; loading checks the digest); the step model as given ("auto",
      "zero" or its table), the model's own ``shape`` inlined and the link and
      host figures explicit. Loading it gives the same engine configuration
      and request stream.
    * **Overrides.** ``--set a.b=v`` parses ``v`` as a TOML value (a bare
      string if that fails) and sets it before validation. Setting one key of
      an exclusive pair (``cpu_cache.capacity``/``chunks``,
      ``hardware.gpu_kv_bytes``/``gpu_blocks``, ``model.name``/``path``/
      ``groups``) drops the other one given in the file. ``--set a.b=null``
      (bare ``null``; TOML has none, and a quoted ``'"null"'`` stays the
      string) removes the key, so that it takes its default. Setting
      ``workload.kind`` keeps only the keys the new kind has (``limit``,
      ``rate_scale``, ``sample`` are common), so that ``--set workload.kind=
      mooncake --set workload.trace=NAME`` turns a generator into a trace; a
      key of another kind than the table's is refused naming the kind, its
      keys and the kinds that have it. An error about a key
      set this way (or inside a table set this way) names the option
      (``--set:KEY: ...``), not the file.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import tomli_w
from pydantic import (
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from sim.engine.links import TierLinkModel
from sim.engine.loop import CopyPathConfig, EngineConfig
from sim.errors import InputError
from sim.io.schema import (
    MAX_BYTES,
    MAX_CPU_CHUNKS,
    MAX_GPU_BLOCKS,
    MAX_INT64,
    MAX_REQUESTS,
    MAX_TOKENS,
    WHY_BYTES,
    WHY_CPU_CHUNKS,
    WHY_GPU_BLOCKS,
    WHY_INT64,
    WHY_REQUESTS,
    WHY_TOKENS,
    GroupEntry,
    ProblemError,
    Strict,
    Tokens,
    at_most,
    check_schema,
)
from sim.io.traces import BadLines, detect_format, resolve_trace, trace_digest
from sim.io.workload import (
    AGENTIC,
    MultiTurnParams,
    UniformParams,
    iter_mooncake,
    iter_multiturn,
    iter_trace,
    iter_uniform,
    jitter_arrivals,
    request_total,
    sample,
    scale_rate,
    take,
    validate_params,
    validate_uniform,
)
from sim.model.costs import (
    DEFAULT_MBU,
    GPU_PROFILES,
    ZERO_STEP,
    ZERO_TRANSFER,
    GpuProfile,
    HostOverhead,
    ModelShape,
    RooflineStepModel,
    StepCostModel,
    StepTimeModel,
    TransferModel,
    TransferPiece,
    gpu_profile,
    roofline_step_model,
    with_figures,
)
from sim.model.cpu_cache import EvictionPolicy, capacity_from_bytes, slot_bytes
from sim.model.layout import DTYPE_BYTES, GroupSpec, KVShape, Layout, LayoutError
from sim.model.tiers import TierSpec

if TYPE_CHECKING:
    from sim.engine.loop import EngineConfig
    from sim.io.workload import MultiTurnParams, Request
    from sim.model.costs import StepTimeModel, TransferModel

__all__ = [
    "HARDWARE_WARNINGS_KEY",
    "HardwareFile",
    "ModelFile",
    "RunScenario",
    "RunSpec",
    "load_run",
    "load_storage_file",
    "parse_bandwidth",
    "parse_size",
    "scenarios_dir",
    "step_model_for",
]

SCHEMAS = ("run/1", "model/1", "hardware/1", "check/1", "sweep/1", "storage/1")
#: the summary key (a list of one-line strings) of :attr:`RunSpec.warnings`
HARDWARE_WARNINGS_KEY = "hardware_warnings"


def scenarios_dir() -> Path:
    """The ``scenarios/`` folder shipped beside the ``sim`` package.

    Located from this module's file (``sim.__file__`` is None when an editable
    install exposes ``sim`` as a namespace package).
    """
    return Path(__file__).resolve().parents[2] / "scenarios"


# -- units ------------------------------------------------------------------------

_UNITS: dict[str, int] = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
SIZE_ALLOWED = ('an integer number of bytes or a string with a unit, e.g. "64GiB", "500MB" '
                "(B, kB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024)")
BANDWIDTH_ALLOWED = ('bytes per second as a number, or a string with a unit, e.g. "55GB/s" or "55GB" '
                     "(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB; per second)")
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


_ProblemError = ProblemError


def _bounded(value: object, n: int) -> int:
    if n > MAX_BYTES:
        raise _ProblemError(
            f"{value!r} is beyond the limit of {MAX_BYTES:,} B (2**60 B = 1 EiB; {WHY_BYTES})",
            f"at most {MAX_BYTES:,} B")
    return n


def _parse_units(value: object, *, per_second: bool) -> int:
    allowed = BANDWIDTH_ALLOWED if per_second else SIZE_ALLOWED
    if isinstance(value, bool):
        raise _ProblemError(f"{value!r} is not a size", allowed)
    if isinstance(value, int):
        return _bounded(value, value)
    if isinstance(value, float) and per_second and math.isfinite(value):
        return _bounded(value, int(value))
    if not isinstance(value, str):
        raise _ProblemError(f"{value!r} is not a size", allowed)
    text = value.strip()
    if per_second and text.lower().endswith("/s"):
        text = text[:-2]
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or (unit and unit not in _UNITS):
        what = f"unknown unit {m.group(2)!r} in {value!r}" if m else f"{value!r} is not a size"
        raise _ProblemError(what, allowed)
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:  # pragma: no cover - the pattern only admits decimals
        raise _ProblemError(f"{value!r} is not a size", allowed) from None
    return _bounded(value, int(number * (_UNITS[unit] if unit else 1)))


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"64GiB"`` (= 64 x 2**30) or ``"500MB"`` (= 5e8).

    Raises:
        ValueError: the value is not a size (the message names the allowed units), or
            it is beyond :data:`~sim.io.schema.MAX_BYTES`.
    """
    return _parse_units(value, per_second=False)


def parse_bandwidth(value: object) -> int:
    """Bytes per second from a number or a string such as ``"55GB/s"`` or ``"55GB"``.

    Raises:
        ValueError: the value is not a bandwidth, or beyond :data:`~sim.io.schema.MAX_BYTES` per second.
    """
    return _parse_units(value, per_second=True)


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def gib(n: float, *, up: bool = False) -> str:
    """Bytes in GiB for messages: ``2e12`` -> ``"1,862.6 GiB"`` (one decimal, two below
    10 GiB), rounded down (a bound), or up when ``up`` (an amount checked against one)."""
    digits = 2 if abs(n) < 10 * 2**30 else 1
    scaled = n / 2**30 * 10**digits
    v = (math.ceil(scaled) if up else math.floor(scaled)) / 10**digits
    return f"{v:,.0f} GiB" if v == int(v) else f"{v:,.{digits}f} GiB"


Size = Annotated[int, BeforeValidator(parse_size)]
Bandwidth = Annotated[int, BeforeValidator(parse_bandwidth)]
#: counts with a documented limit (:mod:`sim.io.schema`)
GpuBlocks = Annotated[int, at_most(MAX_GPU_BLOCKS, "GPU blocks", WHY_GPU_BLOCKS)]
CpuChunks = Annotated[int, at_most(MAX_CPU_CHUNKS, "chunks", WHY_CPU_CHUNKS)]
Requests = Annotated[int, at_most(MAX_REQUESTS, "", WHY_REQUESTS)]
TokensMean = Annotated[float, at_most(MAX_TOKENS, "tokens", WHY_TOKENS)]


def _check_dtype(value: object) -> object:
    if isinstance(value, str) and value not in DTYPE_BYTES:
        raise _ProblemError(f"{value!r} is not a known dtype", ", ".join(DTYPE_BYTES))
    return value


# -- schema -----------------------------------------------------------------------


def _exactly_one(obj: BaseModel, names: Sequence[str], *, at_most: bool = False) -> None:
    given = [n for n in names if getattr(obj, n) is not None]
    if len(given) > 1 or (not at_most and not given):
        what = "both of" if len(given) == 2 else ("none of" if not given else "all of")
        raise _ProblemError(f"{what} {', '.join(given or names)} given",
                            f"{'at most' if at_most else 'exactly'} one of {', '.join(names)}")


class ModelGroup(GroupEntry):
    """One KV cache group with its tensor shape (per model, before sharding)."""

    layers: int = Field(gt=0, description="attention layers in the group")
    kv_heads: int = Field(gt=0, description="KV heads per layer, whole model (before TP sharding)")
    head_size: int = Field(gt=0, description="head dimension")
    dtype: Annotated[str, BeforeValidator(_check_dtype)] = Field(default="bf16", description="KV cache dtype")
    mla: bool = Field(default=False, description="MLA: one latent vector per token instead of K and V")


class ShapeSection(Strict):
    """``[shape]`` of a model: what its step cost needs besides the KV groups (config.json figures)."""

    hidden_size: int = Field(gt=0, le=MAX_TOKENS, description="hidden_size")
    vocab_size: int = Field(gt=0, le=MAX_TOKENS, description="vocab_size")
    query_heads: int = Field(gt=0, le=65536, description="num_attention_heads of every attention layer")
    intermediate_size: int = Field(default=0, ge=0, le=MAX_TOKENS,
                                   description="dense gated MLP intermediate_size (0: all layers MoE)")
    tied_embeddings: bool = Field(default=False, description="tie_word_embeddings")
    experts: int = Field(default=0, ge=0, le=65536, description="routed experts per MoE layer (0: dense)")
    experts_per_token: int = Field(default=0, ge=0, le=65536, description="experts activated per token")
    expert_intermediate_size: int = Field(default=0, ge=0, le=MAX_TOKENS,
                                          description="intermediate size of one expert")
    shared_expert_intermediate_size: int = Field(default=0, ge=0, le=MAX_TOKENS,
                                                 description="intermediate size of the shared expert")
    mamba_state_elements: int = Field(default=0, ge=0, le=MAX_BYTES,
                                      description="recurrent-state elements of one mamba layer")
    params: int | None = Field(default=None, gt=0, le=MAX_BYTES,
                               description="total parameters (instead of the derived count)")
    active_params: int | None = Field(default=None, gt=0, le=MAX_BYTES,
                                      description="parameters per token, embeddings included")
    weight_dtype: Annotated[str, BeforeValidator(_check_dtype)] = Field(
        default="bf16", description="dtype of the weights (weights_bytes overrides)")
    expert_weights_bytes: Size | None = Field(
        default=None, gt=0, le=MAX_BYTES, description="bytes of the routed experts, all layers (when stored "
        "unlike the other weights); else weight_dtype bytes per routed-expert parameter")

    @model_validator(mode="after")
    def _consistent(self) -> ShapeSection:
        if (self.params is None) != (self.active_params is None):
            raise _ProblemError("only one of params, active_params given", "both of them, or neither")
        if self.params is not None and self.active_params is not None and self.active_params > self.params:
            raise _ProblemError(f"active_params {self.active_params} > params {self.params}",
                                "active_params <= params", "active_params")
        if self.experts and not (0 < self.experts_per_token <= self.experts):
            raise _ProblemError(f"experts_per_token {self.experts_per_token} with {self.experts} experts",
                                f"1 to {self.experts}", "experts_per_token")
        if self.experts and self.expert_intermediate_size == 0:
            raise _ProblemError("experts without expert_intermediate_size", "a positive size",
                                "expert_intermediate_size")
        if self.expert_weights_bytes is not None and not self.experts:
            raise _ProblemError("expert_weights_bytes without experts", "experts > 0, or no "
                                "expert_weights_bytes", "expert_weights_bytes")
        if not self.experts and self.params is None and self.intermediate_size == 0:
            raise _ProblemError("a dense model without intermediate_size", "a positive size, or experts, "
                                "or params and active_params", "intermediate_size")
        return self


class _ModelInfo(Strict):
    cost_profile: str | None = Field(
        default=None, description="a shipped model (scenarios/models/<name>.toml) whose [shape] the step "
        "cost borrows when the model has none")
    params_b: float | None = Field(default=None, gt=0,
                                   description="parameters in billions (weights estimate)")
    weights_bytes: Size | None = Field(default=None, gt=0,
                                       description="weight bytes; else params_b x 2 (bf16), else from shape")
    shape: ShapeSection | None = Field(default=None, description="shapes for the step cost (costs.step auto)")
    kv_transfer_piece: TransferPiece | None = Field(
        default=None, description='copies vLLM makes per GPU block: "layer" (a page per layer, the '
        'default), "block" (one packed block) or "kv" (keys and values apart per layer, vLLM 0.11)')


class ModelFile(_ModelInfo):
    """A ``model/1`` file: a KV layout of a model."""

    schema_: Literal["model/1"] = Field(alias="schema", description="format and version")
    name: str = Field(description="model name")
    description: str | None = Field(default=None, description="one line: what the model is, sources")
    groups: list[ModelGroup] = Field(min_length=1, description="KV cache groups, in vLLM's order")


class ModelSection(_ModelInfo):
    """``[model]`` of a run: a shipped model by name, a model/1 file, or inline groups."""

    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                             description="file scenarios/models/<name>.toml")
    path: str | None = Field(default=None, description="a model/1 file, relative to the scenario file")
    groups: list[ModelGroup] | None = Field(default=None, min_length=1, description="inline KV cache groups")
    label: str | None = Field(default=None, description="informational name of inline groups")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        _exactly_one(self, ("name", "path", "groups"))
        return self


class HardwareFile(Strict):
    """A ``hardware/1`` file: one GPU of a serving node and its host link."""

    schema_: Literal["hardware/1"] = Field(alias="schema", description="format and version")
    name: str = Field(description="profile name")
    description: str | None = Field(default=None, description="one line: the node")
    gpu: str = Field(description="key of sim.model.costs.GPU_PROFILES (step-time model), or a GPU not "
                     "shipped, described by dense_bf16_flops and hbm_bandwidth")
    hbm_bytes: Size = Field(gt=0, description="GPU memory")
    dense_bf16_flops: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="dense BF16 tensor FLOP/s (default: the GPU's; "
        "required for a GPU not shipped)")
    hbm_bandwidth: Bandwidth | None = Field(
        default=None, gt=0,
        description="peak HBM bytes/s (default: the GPU's; required for a GPU not shipped)")
    attention_efficiency: float | None = Field(
        default=None, gt=0, le=1, description="fraction of dense_bf16_flops the attention kernels reach "
        "(default: the GPU's measurement, else the H100's)")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="share of HBM vLLM may use")
    cpu_ram_bytes: Size | None = Field(
        default=None, gt=0, description="host RAM of the node: bounds cpu_cache (refused beyond it)")
    gpus_per_node: int | None = Field(
        default=None, gt=0, le=64, description="GPUs sharing that RAM: a run's share is "
        "cpu_ram_bytes x tensor_parallel / gpus_per_node (warned beyond it); caps suggested TP")
    h2d_bandwidth: Bandwidth = Field(gt=0, description="host-to-device bytes/s per GPU")
    d2h_bandwidth: Bandwidth = Field(gt=0, description="device-to-host bytes/s per GPU")
    h2d_latency_s: float = Field(ge=0, description="fixed cost of one load job")
    d2h_latency_s: float = Field(ge=0, description="fixed cost of one store job")
    h2d_piece_overhead_s: float | None = Field(
        default=None, ge=0, le=1, description="fixed cost of each copy of a load job (default: the GPU's)")
    d2h_piece_overhead_s: float | None = Field(
        default=None, ge=0, le=1, description="fixed cost of each copy of a store job (default: the GPU's)")
    h2d_duplex_factor: float | None = Field(
        default=None, gt=0, le=1, description="rate kept by a load while stores run (default: the GPU's)")
    d2h_duplex_factor: float | None = Field(
        default=None, gt=0, le=1, description="rate kept by a store while loads run (default: the GPU's)")
    host_step_s: float | None = Field(
        default=None, ge=0, le=1, description="engine host time per step (default: the GPU's)")
    host_per_request_s: float | None = Field(
        default=None, ge=0, le=1, description="engine host time per scheduled request (default: the GPU's)")
    host_per_hashed_block_s: float | None = Field(
        default=None, ge=0, le=1, description="engine host time per prefix-cache hash block of a new "
        "request's prompt, before the scheduler sees it (default: the GPU's)")
    host_per_block_s: float | None = Field(
        default=None, ge=0, le=1, description="scheduler time per KV block allocated for prompt tokens "
        "computed or loaded in a step (default: the GPU's)")
    host_per_loaded_block_s: float | None = Field(
        default=None, ge=0, le=1, description="further engine host time per loaded block, for its "
        "load's completion (default: the GPU's)")
    host_no_forward_step_s: float | None = Field(
        default=None, ge=0, le=1, description="scheduler time of a step that runs no forward pass but "
        "issues loads (default: the GPU's)")
    host_eager_layer_s: float | None = Field(
        default=None, ge=0, le=1, description="host time per decoder layer to launch a forward pass's "
        "kernels without CUDA graphs, costs.enforce_eager (default: the GPU's)")
    host_tokenize_token_s: float | None = Field(
        default=None, ge=0, le=1, description="vLLM's OpenAI server tokenizing a text prompt, per prompt "
        "token, before the engine sees the request, costs.tokenize (default: the GPU's)")
    mfu: float | None = Field(
        default=None, gt=0, le=1, description="fraction of dense BF16 peak the step model's matmuls reach, "
        "for every step (default: the GPU's measured curve by tokens per step, else 0.5; kvsim calibrate "
        "--from-run fits it)")
    mbu: float | None = Field(
        default=None, gt=0, le=1, description="fraction of peak HBM bandwidth the weight and KV reads reach "
        "(default 0.8; kvsim calibrate --from-run fits it)")


class HardwareSection(Strict):
    """``[hardware]`` of a run: a profile and overrides."""

    profile: str = Field(default="h200",
                         description="scenarios/hardware/<name>.toml, or a path to a hardware/1 file")
    gpu_kv_bytes: Size | None = Field(default=None, gt=0, description="HBM bytes given to the KV cache")
    gpu_blocks: GpuBlocks | None = Field(default=None, ge=2,
                                         description="GPU block pool size, null block included")
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    h2d_bandwidth: Bandwidth | None = Field(default=None, gt=0)
    d2h_bandwidth: Bandwidth | None = Field(default=None, gt=0)
    h2d_latency_s: float | None = Field(default=None, ge=0)
    d2h_latency_s: float | None = Field(default=None, ge=0)
    h2d_piece_overhead_s: float | None = Field(default=None, ge=0, le=1)
    d2h_piece_overhead_s: float | None = Field(default=None, ge=0, le=1)
    h2d_duplex_factor: float | None = Field(default=None, gt=0, le=1)
    d2h_duplex_factor: float | None = Field(default=None, gt=0, le=1)
    host_step_s: float | None = Field(default=None, ge=0, le=1)
    host_per_request_s: float | None = Field(default=None, ge=0, le=1)
    host_per_hashed_block_s: float | None = Field(default=None, ge=0, le=1)
    host_per_block_s: float | None = Field(default=None, ge=0, le=1)
    host_per_loaded_block_s: float | None = Field(default=None, ge=0, le=1)
    host_no_forward_step_s: float | None = Field(default=None, ge=0, le=1)
    host_eager_layer_s: float | None = Field(default=None, ge=0, le=1)
    host_tokenize_token_s: float | None = Field(default=None, ge=0, le=1)
    mfu: float | None = Field(default=None, gt=0, le=1)
    mbu: float | None = Field(default=None, gt=0, le=1)
    dense_bf16_flops: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    hbm_bandwidth: Bandwidth | None = Field(default=None, gt=0)
    attention_efficiency: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _pool(self) -> HardwareSection:
        _exactly_one(self, ("gpu_kv_bytes", "gpu_blocks"), at_most=True)
        return self


class CpuCacheSection(Strict):
    """``[cpu_cache]``: the CPU chunk cache."""

    capacity: Size | None = Field(default=None, ge=0, description="host bytes for all workers")
    chunks: CpuChunks | None = Field(default=None, ge=0, description="capacity in chunk slots")
    policy: Literal["lru", "arc", "belady"] = Field(
        default="lru", description="eviction policy (belady: kvsim's clairvoyant reference, not in vLLM)")

    @model_validator(mode="after")
    def _one(self) -> CpuCacheSection:
        _exactly_one(self, ("capacity", "chunks"), at_most=True)
        return self


TierKind = Literal["fs", "nvme", "network", "object"]


class StorageFile(Strict):
    """A ``storage/1`` file: one storage device a secondary tier can stand for (docs/costs.md)."""

    schema_: Literal["storage/1"] = Field(alias="schema", description="format and version")
    name: str = Field(description="profile name")
    description: str | None = Field(default=None, description="one line: the device and its source")
    kind: TierKind = Field(description="the tier kind it makes")
    read_bandwidth: Bandwidth = Field(gt=0, description="bytes/s of promotions (device -> CPU)")
    write_bandwidth: Bandwidth = Field(gt=0, description="bytes/s of cascades (CPU -> device)")
    latency_s: float = Field(ge=0, allow_inf_nan=False, description="fixed cost of one job (s)")
    concurrency: int = Field(ge=1, le=4096, description="jobs in progress at once")


class TierSection(Strict):
    """One ``[[tiers]]`` entry: a secondary storage tier behind the CPU cache (docs/tiers.md).

    ``device`` names a ``storage/1`` profile (scenarios/hardware/storage/<name>.toml, or a
    path) that gives ``kind``, the bandwidths, ``latency_s`` and ``concurrency``; the
    entry's own keys override it. Without a device, ``kind`` and both bandwidths are required.
    """

    device: str | None = Field(default=None,
                               description="a storage/1 profile name or path giving the figures")
    kind: TierKind | None = Field(
        default=None,
        description="fs: vLLM's file-system tier; nvme, network, object: kvsim's own labels (same model)")
    capacity: Size | None = Field(
        default=None, gt=0, description="bytes it holds (neither this nor chunks: unbounded, as vLLM's)")
    chunks: CpuChunks | None = Field(default=None, gt=0, description="capacity in chunks")
    read_bandwidth: Bandwidth | None = Field(default=None, gt=0,
                                             description="bytes/s of promotions (tier -> CPU)")
    write_bandwidth: Bandwidth | None = Field(default=None, gt=0,
                                              description="bytes/s of cascades (CPU -> tier)")
    latency_s: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                    description="fixed cost of one job (s; default 0)")
    concurrency: int | None = Field(default=None, ge=1, le=4096,
                                    description="jobs in progress at once (default 1)")
    policy: Literal["lru", "arc", "belady"] = Field(
        default="lru", description="eviction policy of a bounded tier (kvsim's own; vLLM's never evict)")

    @model_validator(mode="after")
    def _one(self) -> TierSection:
        _exactly_one(self, ("capacity", "chunks"), at_most=True)
        if self.device is None:
            for key in ("kind", "read_bandwidth", "write_bandwidth"):
                if getattr(self, key) is None:
                    raise _ProblemError("required key missing (no device gives it)",
                                        "a value, or device = a storage/1 profile", key)
        return self


class SchedulerSection(Strict):
    """``[scheduler]``: vLLM scheduler and connector options."""

    max_num_batched_tokens: Tokens = Field(default=8192, gt=0, description="token budget per step")
    max_num_seqs: Requests = Field(default=256, gt=0, description="running requests at most")
    prefix_caching: bool = Field(default=True, description="GPU prefix caching")
    blocks_per_chunk: GpuBlocks = Field(default=1, gt=0,
                                        description="GPU blocks per offload chunk (vLLM default 1)")
    tokens_per_hash: Tokens = Field(default=16, gt=0,
                                    description="hash block in tokens; divides every block size")
    offload_prompt_only: bool = Field(default=True, description="store prompt chunks only")
    offloading: bool = Field(default=True, description="false: no connector, no CPU cache")
    fast_forward: bool = Field(default=True, description="collapse runs of pure decode steps")
    reserve_full_isl: bool = Field(
        default=True, description="admit a request only if blocks for its whole input fit "
                                  "(vLLM's scheduler_reserve_full_isl, on by default)")
    block_accounting: Literal["fast", "reference"] = Field(
        default="fast", description="GPU block bookkeeping: fast, or the per-block reference (same result)")


class _Transforms(Strict):
    """Keys every workload takes: how many requests and how dense."""

    limit: Requests | None = Field(default=None, gt=0, description="requests at most")
    rate_scale: float = Field(default=1.0, gt=0, description="arrivals this many times as dense")
    sample: float = Field(default=1.0, gt=0, le=1,
                          description="keep each request with this probability (seeded by its id)")


class MultiTurnWorkload(_Transforms):
    """``[workload] kind = "multiturn"``: seeded synthetic chat sessions.

    Keys left out take the defaults of :class:`sim.io.workload.MultiTurnParams`
    (``kind = "agentic"``: of the :data:`sim.io.workload.AGENTIC` preset).
    """

    kind: Literal["multiturn", "agentic"]
    sessions: Requests | None = Field(default=None, gt=0, description="number of sessions")
    session_rate_per_s: float | None = Field(default=None, gt=0, description="session arrival rate")
    turns_mean: float | None = Field(default=None, gt=0, description="mean turns per session")
    turns_max: Requests | None = Field(default=None, gt=0, description="turns per session at most")
    system_prompt_tokens: Tokens | None = Field(default=None, ge=0, description="shared system prompt")
    first_user_tokens_mean: TokensMean | None = Field(default=None, gt=0,
                                                      description="mean first user message, tokens")
    followup_user_tokens_mean: TokensMean | None = Field(default=None, gt=0,
                                                         description="mean follow-up message, tokens")
    output_tokens_mean: TokensMean | None = Field(default=None, gt=0,
                                                  description="mean answer length, tokens")
    max_context_tokens: Tokens | None = Field(default=None, gt=0, description="a session ends beyond this")
    think_time_mean_s: float | None = Field(default=None, ge=0, description="mean gap between turns")
    user_tokens_sigma: float | None = Field(default=None, ge=0,
                                            description="lognormal sigma of user messages")
    output_tokens_sigma: float | None = Field(default=None, ge=0, description="lognormal sigma of answers")
    system_prompts: Requests | None = Field(default=None, gt=0, description="distinct shared system prompts")


class UniformWorkload(_Transforms):
    """``[workload] kind = "uniform"``: independent requests, no shared prefix.

    Keys left out take the defaults of :class:`sim.io.workload.UniformParams`.
    """

    kind: Literal["uniform"]
    requests: Requests | None = Field(default=None, gt=0, description="number of requests")
    rate_per_s: float | None = Field(default=None, gt=0, description="Poisson arrival rate")
    input_tokens_min: Tokens | None = Field(default=None, gt=0, description="prompt length, lower bound")
    input_tokens_max: Tokens | None = Field(default=None, gt=0, description="prompt length, upper bound")
    output_tokens_min: Tokens | None = Field(default=None, gt=0, description="answer length, lower bound")
    output_tokens_max: Tokens | None = Field(default=None, gt=0, description="answer length, upper bound")


class MooncakeWorkload(_Transforms):
    """``[workload] kind = "mooncake"`` (a Mooncake JSONL trace) or ``"trace"``
    (any format :mod:`sim.io.traces` reads: Mooncake JSONL, Azure CSV, kvsim
    CSV/Parquet; ``format`` or detected)."""

    kind: Literal["mooncake", "trace"]
    path: str | None = Field(default=None, description="trace file, relative to the scenario file")
    trace: str | None = Field(default=None, description="a published trace by name (kvsim trace fetch "
                              "--help), found in $KVSIM_TRACES, then the fetch cache")
    sha256: str | None = Field(default=None, pattern="^[0-9a-f]{64}$",
                               description="the trace content's sha256 (resolved scenarios); checked")
    format: Literal["auto", "mooncake", "azure", "csv", "parquet"] = Field(
        default="auto", description="trace format (kind = trace)")
    time_scale: float = Field(default=1.0, gt=0, description="multiplies arrival times")
    block_tokens: Tokens | None = Field(default=None, gt=0,
                                        description="tokens per hash id (Mooncake: 512)")
    skip_bad: bool = Field(default=False, description="skip bad lines, counted in the summary")
    arrival_jitter_s: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="spread requests sharing a timestamp over [t, t + this), seeded (0: off)")

    @model_validator(mode="after")
    def _one_source(self) -> MooncakeWorkload:
        _exactly_one(self, ("path", "trace"))
        return self


class StepTable(Strict):
    """An explicit step-time model (seconds)."""

    overhead_s: float = Field(default=0.0, ge=0, description="per step")
    prefill_token_s: float = Field(default=0.0, ge=0, description="per prefill token")
    decode_seq_s: float = Field(default=0.0, ge=0, description="per decoding sequence")
    context_token_s: float = Field(default=0.0, ge=0, description="per token of attended context")


def _step_tag(v: object) -> str:
    return "step-table" if isinstance(v, dict | StepTable) else "step-name"


class CostsSection(Strict):
    """``[costs]``: step-time and transfer-time models."""

    step: Annotated[
        Annotated[Literal["auto", "zero"], Tag("step-name")] | Annotated[StepTable, Tag("step-table")],
        Discriminator(_step_tag),
    ] = Field(default="auto", description='"auto" (GPU x model profile), "zero" or an inline table')
    transfer: Literal["hardware", "zero"] = Field(default="hardware", description="link model")
    tensor_parallel: int = Field(default=1, gt=0, description="GPUs per model replica (also shards KV heads)")
    enforce_eager: bool = Field(
        default=False, description="vLLM's enforce_eager: no CUDA graphs, every forward pass takes at least "
        "its decoder layers x hardware.host_eager_layer_s (step \"auto\" only)")
    tokenize: bool = Field(
        default=False, description="prompts reach vLLM as text through its OpenAI server, which tokenizes "
        "them one after another (hardware.host_tokenize_token_s per prompt token) before the engine "
        "sees them (vllm bench serve sends text); false: token ids, as the offline LLM class takes them")


class CopyPathSection(Strict):
    """``[copy_path]``: the torch data path (:mod:`sim.engine.copypath`; needs torch)."""

    enabled: bool = Field(default=False, description="run every transfer on real tensors, verify reads")
    mode: Literal["fingerprint", "realistic"] = Field(
        default="fingerprint", description="a word per token, or the layout's real bytes per block")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="where the GPU tensors live")
    timing: Literal["model", "measured"] = Field(
        default="model", description="transfer time from the cost model, or from the measured copies")
    memory_limit: Size | None = Field(default=None, gt=0,
                                      description="refuse tensors larger than this (default: available)")


class OutputSection(Strict):
    """``[output]``: what is recorded and when the run stops."""

    occupancy_interval_s: float = Field(default=1.0, gt=0, description="occupancy sampling period (an idle "
                                        "gap of more than 1,000,000 of them is refused)")
    max_sim_time_s: float | None = Field(default=None, gt=0,
                                         description="stop the run at this simulated time")
    stop_at_waiting: int | None = Field(
        default=None, ge=1,
        description="stop the run once this many requests wait (an overloaded engine: the run "
                    "ends with end = queue_limit and is marked overloaded)")


Workload = Annotated[MultiTurnWorkload | UniformWorkload | MooncakeWorkload, Field(discriminator="kind")]


class RunScenario(Strict):
    """A ``run/1`` file (see the module docstring)."""

    schema_: Literal["run/1"] = Field(alias="schema", description="format and version")
    kvsim_version: str | None = Field(default=None, description="written by kvsim into resolved scenarios")
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                             description="results folder name (default: the file stem)")
    seed: Annotated[int, at_most(MAX_INT64, "", WHY_INT64)] = Field(
        default=0, ge=0, description="seed of every random choice")
    window_logic: Literal["old", "new", "latest"] = Field(
        default="new", description="vLLM 0.29.0 (old), 0.30.0 (new) or 0.33.0 (latest)")
    decisions: Literal["model", "vllm", "differential"] = Field(
        default="model", description="who decides: kvsim's model, the vLLM installed in this environment, "
                                     "or both in lockstep, every step's decisions compared (differential)")
    on_crash: Literal["record", "stop"] = Field(default="record", description="what a modelled crash does")
    assertions: bool = Field(default=True, description="vLLM's Python assertions; false models python -O")
    model: ModelSection
    hardware: HardwareSection = HardwareSection()
    cpu_cache: CpuCacheSection = CpuCacheSection()
    tiers: list[TierSection] = Field(default_factory=list, max_length=8,
                                     description="secondary tiers behind the CPU cache, in lookup order")
    scheduler: SchedulerSection = SchedulerSection()
    workload: Workload = MultiTurnWorkload(kind="multiturn")
    costs: CostsSection = CostsSection()
    copy_path: CopyPathSection = CopyPathSection()
    output: OutputSection = OutputSection()

    @model_validator(mode="before")
    @classmethod
    def _default_kind(cls, data: Any) -> Any:
        """``[workload]`` without ``kind`` is the multi-turn generator."""
        wl = data.get("workload") if isinstance(data, dict) else None
        if isinstance(wl, dict) and "kind" not in wl:
            data = {**data, "workload": {"kind": "multiturn", **wl}}
        return data

    @model_validator(mode="after")
    def _capacity(self) -> RunScenario:
        c = self.cpu_cache
        if self.scheduler.offloading and c.capacity is None and c.chunks is None:
            raise _ProblemError("neither capacity nor chunks given",
                                "exactly one of capacity, chunks (or scheduler.offloading = false)",
                                "cpu_cache")
        if self.tiers and not self.scheduler.offloading:
            raise _ProblemError("secondary tiers without offloading",
                                "no [[tiers]], or scheduler.offloading = true", "tiers")
        if self.tiers and self.copy_path.enabled:
            raise _ProblemError("the torch copy path does not model secondary tiers",
                                "no [[tiers]], or copy_path.enabled = false", "tiers")
        return self


#: discriminator tags pydantic puts into error locations; not keys of the file
_TAGS: dict[str, type[BaseModel] | None] = {
    "multiturn": MultiTurnWorkload, "agentic": MultiTurnWorkload, "uniform": UniformWorkload,
    "mooncake": MooncakeWorkload, "trace": MooncakeWorkload,
    "step-table": StepTable, "step-name": None,
}


# -- errors -----------------------------------------------------------------------


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic model classes an annotation may hold (through Optional, list, unions)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if origin in (list, typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models_in(a)]
    return []


def _tags(loc: Sequence[Any]) -> list[bool]:
    """Which parts of an error location are discriminator tags: a tag follows the
    key of a union, so a key named like one (``workload.trace``) is not taken for it."""
    out: list[bool] = []
    for part in loc:
        out.append(isinstance(part, str) and part in _TAGS and not (out and out[-1]))
    return out


def _model_at(root: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part, tag in zip(loc, _tags(loc), strict=True):
        if isinstance(part, int):
            continue
        if tag:
            model = _TAGS[part]
            continue
        if model is None:
            return None
        fld = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        if fld is None:
            return None
        found = _models_in(fld.annotation)
        # several candidates (a union): the discriminator tag that follows picks one
        model = found[0] if len(found) == 1 else None
    return model


def _keys_of(model: type[BaseModel] | None) -> str:
    if model is None:
        return ""
    return ", ".join(f.alias or n for n, f in model.model_fields.items())


def _is_key(part: object) -> bool:
    """Location parts that are keys of the file (not pydantic's tags and validator names)."""
    return isinstance(part, int) or (isinstance(part, str) and part not in _TAGS and "[" not in part
                                     and part not in ("int", "none", "str", "float", "bool"))


def _dotted(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p, tag in zip(loc, _tags(loc), strict=True)
                    if not tag and (_is_key(p) or p in _TAGS))


def _kinds(model: type[BaseModel]) -> tuple[str, ...]:
    """The ``kind`` values of one table of a union told apart by ``kind`` (none: not such a table)."""
    fld = model.model_fields.get("kind")
    return typing.get_args(fld.annotation) if fld is not None else ()


def _kind_hint(models: Sequence[type[BaseModel]], key: str, how: str) -> str:
    """``; <how>"K" (kinds with KEY: ...)``: the kinds of the union that have ``key``."""
    kinds = [k for m in dict.fromkeys(models) if key in _aliases(m) for k in _kinds(m)]
    return f"; {how}\"{kinds[0]}\" (kinds with {key}: {', '.join(kinds)})" if kinds else ""


def _aliases(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def located(exc: ValidationError, source: str, root: type[BaseModel], prefix: str = "") -> InputError:
    """The first error of ``exc`` as an :class:`InputError` at ``source:KEY``."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = _dotted(loc)
    full = f"{prefix}{key}" if key else prefix.rstrip(".")
    kind = err["type"]
    ctx = err.get("ctx") or {}
    value = err.get("input")
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        tag = loc[-2] if len(loc) > 1 and _tags(loc)[-2] else None
        if parent is not None and tag is not None and _kinds(parent):  # a table of a union: name its kind
            where = _dotted(loc[:-1])
            members = [m for m in _TAGS.values() if m is not None]
            hint = _kind_hint(members, str(loc[-1]), f"or {where}.kind = ")
            return InputError(source, full, f"not a key of {where} kind {tag!r}", _keys_of(parent) + hint)
        return InputError(source, full, "unknown key", _keys_of(parent))
    if kind == "missing":
        return InputError(source, full, "required key missing")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        k = f"{full}.kind" if full else "kind"
        if kind == "union_tag_not_found":
            return InputError(source, k, "required key missing", "multiturn, mooncake")
        return InputError(source, k, f"{ctx.get('tag')!r} is invalid",
                          str(ctx.get("expected_tags", "")).replace("'", '"'))
    inner = ctx.get("error")
    if isinstance(inner, LayoutError):
        return InputError(source, f"{prefix}{inner.key}", inner.problem, inner.allowed)
    if isinstance(inner, _ProblemError):
        k = ".".join(p for p in (full, inner.key) if p)
        return InputError(source, k, inner.problem, inner.allowed)
    if kind == "literal_error":
        return InputError(source, full, f"{value!r} is invalid", str(ctx.get("expected", "")))
    if isinstance(value, dict):
        shown = "a table"
    elif isinstance(value, list):
        shown = "a list"
    else:
        shown = repr(value)
    allowed = err["msg"].removeprefix("Input should be ").removeprefix("String should ")
    return InputError(source, full, f"{shown} is invalid", allowed)


_M = typing.TypeVar("_M", bound=BaseModel)


def _validate(cls: type[_M], data: dict[str, Any], source: str, prefix: str = "") -> _M:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise located(exc, source, cls, prefix) from None


def _toml_error(source: str, exc: tomllib.TOMLDecodeError) -> InputError:
    text = str(exc)
    m = re.search(r"\(at line (\d+), column (\d+)\)", text)
    if m is None:
        return InputError(source, "", f"bad TOML: {text}", "a TOML document")
    msg = text[: m.start()].strip()
    return InputError(source, f"line {m.group(1)}", f"bad TOML: {msg} (column {m.group(2)})",
                      "a TOML document")


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; unreadable files and syntax errors become :class:`InputError`."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(source, "", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(source, "", f"cannot read: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _toml_error(source, exc) from None


# -- --set overrides --------------------------------------------------------------

#: keys of which at most one may be given: setting one drops the others
_EXCLUSIVE: tuple[tuple[str, ...], ...] = (
    ("cpu_cache.capacity", "cpu_cache.chunks"),
    ("hardware.gpu_kv_bytes", "hardware.gpu_blocks"),
    ("model.name", "model.path", "model.groups"),
    ("workload.path", "workload.trace"),
)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads("v = " + text)["v"]
    except tomllib.TOMLDecodeError:
        return text


#: ``--set KEY=null`` (bare, unquoted: TOML has no null) removes KEY; ``KEY='"null"'`` is the string
REMOVE = "null"
#: the kind of a ``[workload]`` without one (:meth:`RunScenario._default_kind`)
_DEFAULT_KIND = "multiturn"


def _of_kind(found: Sequence[type[BaseModel]], kind: object) -> type[BaseModel] | None:
    return next((m for m in found if kind in _kinds(m)), None)


def _walk(data: dict[str, Any], parts: list[str], source: str, remove: bool,
          ) -> tuple[dict[str, Any], list[type[BaseModel]]] | None:
    """The table holding the dotted key ``parts`` (created as needed, unless ``remove``)
    and the tables its union may hold when it is a union's ``kind``; None: nothing to remove.
    A key of a union (``workload.*``) must be one of the table's kind (default multiturn)."""
    model: type[BaseModel] = RunScenario
    table = data
    members: list[type[BaseModel]] = []   # the tables of the union the key is in
    for i, part in enumerate(parts):
        fields = {f.alias or n: f for n, f in model.model_fields.items()}
        where = ".".join(parts[: i + 1])
        if part not in fields:
            raise InputError(source, where, "unknown key", _keys_of(model))
        if i == len(parts) - 1:
            return table, (members if part == "kind" else [])
        found = members = _models_in(fields[part].annotation)
        sub = table.get(part)
        if len(found) > 1:  # a union of tables told apart by kind: the table's kind
            kind = sub.get("kind", _DEFAULT_KIND) if isinstance(sub, dict) else _DEFAULT_KIND
            chosen, nxt = _of_kind(found, kind), parts[i + 1]
            if chosen is not None and nxt not in _aliases(chosen):
                if remove and any(nxt in _aliases(m) for m in found):
                    return None   # a key of another kind: not there to remove
                hint = _kind_hint(found, nxt, f"or first --set {where}.kind=")
                raise InputError(source, f"{where}.{nxt}", f"not a key of {where} kind {kind!r}",
                                 _keys_of(chosen) + hint)
            # an unknown kind: validation reports it
            chosen = chosen or next((m for m in found if nxt in _aliases(m)), None)
            found = [chosen] if chosen is not None else []
        if len(found) != 1 or (sub is not None and not isinstance(sub, dict)):
            shown = "" if sub is None or isinstance(sub, dict) else f" ({sub!r})"
            raise InputError(source, where, f"not a table{shown}", "a key of a table, e.g. cpu_cache.policy")
        if sub is None:
            if remove:
                return None
            sub = table[part] = {}
        model, table = found[0], sub
    raise AssertionError("unreachable")  # pragma: no cover


def apply_overrides(data: dict[str, Any], overrides: Sequence[str | tuple[str, str]]) -> dict[str, str]:
    """Apply ``key=value`` overrides in order to the raw TOML data (in place).

    An item is ``"key=value"`` (source ``--set``) or ``(source, "key=value")``
    (e.g. ``("--seed", "seed=3")``). Returns {dotted key: the option that set it last}.
    ``key=null`` (:data:`REMOVE`) removes the key; setting (or removing) ``workload.kind``
    drops the keys the new kind does not have.

    Raises:
        InputError: the item is not ``key=value``, names an unknown key, or a key
            of another workload kind than the table's (naming the kind and its keys).
    """
    touched: dict[str, str] = {}
    for item in overrides:
        source, text = ("--set", item) if isinstance(item, str) else item
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(source, text, "not key=value", "key=value, e.g. cpu_cache.capacity=64GiB")
        parts = key.split(".")
        remove = raw.strip() == REMOVE
        walked = _walk(data, parts, source, remove)
        touched[key] = source
        if walked is None:
            continue
        table, union = walked
        value = _parse_value(raw.strip())
        if union:  # a kind switch: keep the keys the new kind has
            new = _of_kind(union, _DEFAULT_KIND if remove else value)
            for k in [k for k in table if new is not None and k not in _aliases(new)]:
                del table[k]
        if remove:
            table.pop(parts[-1], None)
            continue
        for group in _EXCLUSIVE:
            if key in group:
                for other in group:
                    if other != key:
                        section, _, leaf = other.partition(".")
                        sec = data.get(section)
                        if isinstance(sec, dict):
                            sec.pop(leaf, None)
        table[parts[-1]] = value
    return touched


def _unit_parser_in(annotation: Any, metadata: Sequence[Any] = ()) -> Callable[[object], int] | None:
    for m in metadata:
        if isinstance(m, BeforeValidator) and m.func in (parse_size, parse_bandwidth):
            return cast("Callable[[object], int]", m.func)
    if typing.get_origin(annotation) is Annotated:
        args = typing.get_args(annotation)
        return _unit_parser_in(args[0], args[1:])
    for arg in typing.get_args(annotation):
        found = _unit_parser_in(arg)
        if found is not None:
            return found
    return None


def unit_parser(key: str) -> Callable[[object], int] | None:
    """:func:`parse_size` or :func:`parse_bandwidth` when the dotted ``run/1`` key
    holds a size or a bandwidth (e.g. ``cpu_cache.capacity``), else None."""
    model: type[BaseModel] = RunScenario
    parts = key.split(".")
    for i, part in enumerate(parts):
        fld = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        if fld is None:
            return None
        if i == len(parts) - 1:
            return _unit_parser_in(fld.annotation, fld.metadata)
        found = _models_in(fld.annotation)
        if len(found) != 1:
            return None  # a union of tables (the workload): none of them holds a size
        model = found[0]
    return None


# -- resolved model and hardware ----------------------------------------------------


@dataclass(frozen=True)
class ResolvedModel:
    """The model a run uses, after ``[model]`` overrides."""

    label: str
    groups: tuple[ModelGroup, ...]
    cost_profile: str | None
    params_b: float | None
    weights_bytes: int | None
    source: str  #: the file the groups came from (for error messages)
    prefix: str  #: key prefix of the groups in that file ("" or "model.")
    shape: ShapeSection | None = None  #: the model's own [shape]
    kv_transfer_piece: TransferPiece = "layer"
    #: the shape the step cost uses: the own one, else the cost_profile model's, with the
    #: groups and weight bytes its parameter count refers to
    cost_shape: ModelShape | None = None
    cost_groups: tuple[ModelGroup, ...] = ()



#: ``[hardware]`` / ``hardware/1`` keys of the engine's host time: ``host_`` + each
#: :class:`~sim.model.costs.HostOverhead` field
HOST_KEYS: tuple[str, ...] = tuple(f"host_{f.name}" for f in dataclasses.fields(HostOverhead))

@dataclass(frozen=True)
class ResolvedHardware:
    """The hardware a run uses, after ``[hardware]`` overrides."""

    profile: str  #: a shipped name, or an absolute path
    name: str
    gpu: str
    gpu_profile: GpuProfile  #: the GPU's figures: the shipped profile of ``gpu``, or the file's own
    hbm_bytes: int
    gpu_memory_utilization: float
    h2d_bandwidth: int
    d2h_bandwidth: int
    h2d_latency_s: float
    d2h_latency_s: float
    cpu_ram_bytes: int | None = None  #: host RAM of the node (the profile's; no override)
    gpus_per_node: int | None = None  #: GPUs of the node (the profile's; no override)
    h2d_piece_overhead_s: float = 0.0
    d2h_piece_overhead_s: float = 0.0
    h2d_duplex_factor: float = 1.0
    d2h_duplex_factor: float = 1.0
    host_step_s: float = 0.0
    host_per_request_s: float = 0.0
    host_per_hashed_block_s: float = 0.0
    host_per_block_s: float = 0.0
    host_per_loaded_block_s: float = 0.0
    host_no_forward_step_s: float = 0.0
    host_eager_layer_s: float = 0.0
    host_tokenize_token_s: float = 0.0
    mfu: float | None = None  #: a constant matmul efficiency; None: the GPU's curve (else DEFAULT_MFU)
    mbu: float = DEFAULT_MBU

    def host(self) -> HostOverhead:
        """The engine's host time these figures give (:data:`HOST_KEYS`)."""
        return HostOverhead(**{k.removeprefix("host_"): getattr(self, k) for k in HOST_KEYS})


def _available(folder: str) -> str:
    d = scenarios_dir() / folder
    names = sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []
    return ", ".join(names) if names else "(none shipped)"


def load_model_file(path: Path) -> ModelFile:
    """Read and validate a ``model/1`` file (layout checked with its own block sizes)."""
    source = str(path)
    data = read_toml(path)
    check_schema(data, source, "model/1")
    mf = _validate(ModelFile, data, source)
    tph = math.gcd(*(g.tokens_per_block for g in mf.groups))
    _layout(mf.groups, tph, 1, 1, source, "")
    if mf.shape is not None:
        model_shape(mf.name, mf.shape, mf.groups, mf.weights_bytes, source, "")
    if mf.cost_profile is not None:
        _cost_profile(mf.cost_profile, source, "cost_profile")
    return mf


def model_shape(name: str, shape: ShapeSection, groups: Sequence[ModelGroup], weights_bytes: int | None,
                source: str, prefix: str) -> ModelShape:
    """The model layer's :class:`~sim.model.costs.ModelShape` of a ``[shape]`` table, checked
    against the model's groups (a parameter count it can derive, a mamba state size).

    Raises:
        InputError: the shape does not cover the groups.
    """
    if weights_bytes is not None and (shape.expert_weights_bytes or 0) > weights_bytes:
        raise InputError(source, f"{prefix}shape.expert_weights_bytes",
                         f"{shape.expert_weights_bytes} bytes of experts exceed weights_bytes "
                         f"{weights_bytes}",
                         "at most the model's weights_bytes")
    ms = ModelShape(name=name, hidden_size=shape.hidden_size, vocab_size=shape.vocab_size,
                    query_heads=shape.query_heads, intermediate_size=shape.intermediate_size,
                    tied_embeddings=shape.tied_embeddings, experts=shape.experts,
                    experts_per_token=shape.experts_per_token,
                    expert_intermediate_size=shape.expert_intermediate_size,
                    shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
                    mamba_state_elements=shape.mamba_state_elements, params=shape.params,
                    active_params=shape.active_params, weight_bytes=weights_bytes,
                    weight_dtype_bytes=DTYPE_BYTES[shape.weight_dtype],
                    expert_weight_bytes=shape.expert_weights_bytes)
    specs = [group_spec(g, 1) for g in groups]
    if shape.params is None and any(g.mla or g.kind == "mamba" for g in groups):
        raise InputError(source, f"{prefix}shape.params", "the parameter count of a model with mamba or "
                         "MLA groups is not derived from the shapes", "params and active_params (config "
                         "recount or model card)")
    if any(g.kind == "mamba" for g in groups) and shape.mamba_state_elements == 0:
        raise InputError(source, f"{prefix}shape.mamba_state_elements", "the model has mamba groups",
                         "the recurrent-state elements of one layer (heads x key dim x value dim)")
    total, active = ms.param_counts(specs)
    if not 0 < active <= total:
        raise InputError(source, f"{prefix}shape", f"derived {active} active of {total} parameters",
                         "shapes that give 0 < active <= total parameters")
    if active <= ms.embedding_params * (1 if ms.tied_embeddings else 2):
        raise InputError(source, f"{prefix}shape", f"{active} active parameters are no more than the "
                         "embedding tables", "active_params that include the embeddings and the layers")
    if ms.experts and ms.routed_expert_bytes(specs) > ms.total_weight_bytes(specs):
        raise InputError(source, f"{prefix}shape.expert_weights_bytes",
                         f"{ms.routed_expert_bytes(specs)} bytes of experts exceed the "
                         f"{ms.total_weight_bytes(specs)} bytes of all the weights",
                         "at most the model's weights_bytes")
    return ms


def _shipped_shapes() -> str:
    d = scenarios_dir() / "models"
    names = []
    for f in sorted(d.glob("*.toml")):
        try:
            if isinstance(read_toml(f).get("shape"), dict):
                names.append(f.stem)
        except InputError:  # pragma: no cover - shipped files are valid (tested)
            continue
    return ", ".join(names) if names else "(none shipped)"


def _cost_profile(name: str, source: str, key: str) -> ModelFile:
    """The shipped model file a ``cost_profile`` names (it must have a ``[shape]``)."""
    path = scenarios_dir() / "models" / f"{name}.toml"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) or not path.is_file():
        raise InputError(source, key, f"{name!r} is not a known model cost profile",
                         f"a shipped model with a [shape]: {_shipped_shapes()}")
    mf = load_model_file(path)
    if mf.shape is None:
        raise InputError(source, key, f"model {name!r} has no [shape]",
                         f"a shipped model with a [shape]: {_shipped_shapes()}")
    return mf


def load_hardware_file(path: Path) -> HardwareFile:
    """Read and validate a ``hardware/1`` file."""
    source = str(path)
    data = read_toml(path)
    check_schema(data, source, "hardware/1")
    hw = _validate(HardwareFile, data, source)

    if hw.gpu not in GPU_PROFILES:
        missing = [k for k in ("dense_bf16_flops", "hbm_bandwidth") if getattr(hw, k) is None]
        if missing:
            raise InputError(source, "gpu", f"{hw.gpu!r} is not a shipped GPU and the file gives no "
                             f"{' or '.join(missing)}",
                             f"{', '.join(GPU_PROFILES)}, or any name with dense_bf16_flops and "
                             "hbm_bandwidth")
    return hw


def hardware_gpu(hw: HardwareFile, source: str = "") -> GpuProfile:
    """The GPU profile of a validated ``hardware/1`` file (:func:`sim.model.costs.gpu_profile`)."""
    return gpu_profile(hw.gpu, hbm_bytes=hw.hbm_bytes, dense_bf16_flops=hw.dense_bf16_flops,
                       hbm_bandwidth_bytes_per_s=hw.hbm_bandwidth,
                       attention_efficiency=hw.attention_efficiency, source=source)


def load_storage_file(path: Path) -> StorageFile:
    """Read and validate a ``storage/1`` file."""
    source = str(path)
    data = read_toml(path)
    check_schema(data, source, "storage/1")
    return _validate(StorageFile, data, source)


def _resolve_tiers(sc: RunScenario, base: Path, source: str) -> RunScenario:
    """Fill every ``[[tiers]]`` entry from its device (its own keys win) and the defaults."""
    if not sc.tiers:
        return sc
    folder = scenarios_dir() / "hardware" / "storage"
    tiers = []
    for i, t in enumerate(sc.tiers):
        fill: dict[str, Any] = {"latency_s": 0.0, "concurrency": 1}
        if t.device is not None:
            d = t.device
            path = (base / d).resolve() if "/" in d or d.endswith(".toml") else folder / f"{d}.toml"
            if not path.is_file():
                names = ", ".join(sorted(p.stem for p in folder.glob("*.toml"))) or "(none shipped)"
                raise InputError(source, f"tiers.{i}.device", f"{d!r}: no such storage profile",
                                 f"{names}, or a path to a storage/1 file")
            dev = load_storage_file(path)
            fill = {k: getattr(dev, k) for k in ("kind", "read_bandwidth", "write_bandwidth", "latency_s",
                                                  "concurrency")}
        given = {k: v for k, v in fill.items() if getattr(t, k) is None}
        tiers.append(t.model_copy(update=given))
    return sc.model_copy(update={"tiers": tiers})


def _resolve_model(sec: ModelSection, base: Path, source: str) -> ResolvedModel:
    if sec.groups is not None:
        mf_groups, label, file_info = tuple(sec.groups), sec.label or "inline", _ModelInfo()
        msource, prefix = source, "model."
    else:
        if sec.name is not None:
            path = scenarios_dir() / "models" / f"{sec.name}.toml"
            if not path.is_file():
                raise InputError(source, "model.name", f"{sec.name!r}: no such model",
                                 _available("models"))
        else:
            assert sec.path is not None
            path = (base / sec.path).resolve()
            if not path.is_file():
                raise InputError(source, "model.path", f"{sec.path!r}: no such file",
                                 "a model/1 file, relative to the scenario file")
        mf = load_model_file(path)
        mf_groups, label, file_info = tuple(mf.groups), mf.name, mf
        msource, prefix = str(path), ""
    cost = sec.cost_profile if sec.cost_profile is not None else file_info.cost_profile
    weights = sec.weights_bytes if sec.weights_bytes is not None else file_info.weights_bytes
    shape = sec.shape if sec.shape is not None else file_info.shape
    piece = sec.kv_transfer_piece or file_info.kv_transfer_piece or "layer"
    cost_shape: ModelShape | None = None
    cost_groups: tuple[ModelGroup, ...] = ()
    if shape is not None:
        where = (source, "model.") if sec.shape is not None or sec.groups is not None else (msource, "")
        cost_shape = model_shape(label, shape, mf_groups, weights, *where)
        cost_groups = mf_groups
    elif cost is not None:
        key = "model.cost_profile" if sec.cost_profile is not None else "cost_profile"
        other = _cost_profile(cost, source if sec.cost_profile is not None else msource, key)
        assert other.shape is not None
        cost_shape = model_shape(other.name, other.shape, other.groups, other.weights_bytes, source, key)
        cost_groups = tuple(other.groups)
    return ResolvedModel(
        label=label, groups=mf_groups, cost_profile=cost,
        params_b=sec.params_b if sec.params_b is not None else file_info.params_b,
        weights_bytes=weights, source=msource, prefix=prefix, shape=shape, kv_transfer_piece=piece,
        cost_shape=cost_shape, cost_groups=cost_groups)


def _resolve_hardware(sec: HardwareSection, base: Path, source: str) -> ResolvedHardware:
    p = sec.profile
    if "/" in p or p.endswith(".toml"):
        path = (base / p).resolve()
        if not path.is_file():
            raise InputError(source, "hardware.profile", f"{p!r}: no such file",
                             f"a shipped profile ({_available('hardware')}) or a hardware/1 file")
        profile = str(path)
    else:
        path = scenarios_dir() / "hardware" / f"{p}.toml"
        if not path.is_file():
            raise InputError(source, "hardware.profile", f"{p!r}: no such hardware profile",
                             f"{_available('hardware')}, or a path to a hardware/1 file")
        profile = p
    hw = load_hardware_file(path)
    g = hardware_gpu(hw, str(path))
    # a run may replace the GPU's figures too (a what-if: the same GPU, faster)
    g = with_figures(g, dense_bf16_flops=sec.dense_bf16_flops, hbm_bandwidth_bytes_per_s=sec.hbm_bandwidth,
                     attention_efficiency=sec.attention_efficiency, source=f"{source}: [hardware]")

    def pick(over: Any, default: Any) -> Any:
        return default if over is None else over

    return ResolvedHardware(
        profile=profile, name=hw.name, gpu=hw.gpu, gpu_profile=g, hbm_bytes=hw.hbm_bytes,
        gpu_memory_utilization=pick(sec.gpu_memory_utilization, hw.gpu_memory_utilization),
        h2d_bandwidth=pick(sec.h2d_bandwidth, hw.h2d_bandwidth),
        d2h_bandwidth=pick(sec.d2h_bandwidth, hw.d2h_bandwidth),
        h2d_latency_s=pick(sec.h2d_latency_s, hw.h2d_latency_s),
        d2h_latency_s=pick(sec.d2h_latency_s, hw.d2h_latency_s),
        cpu_ram_bytes=hw.cpu_ram_bytes, gpus_per_node=hw.gpus_per_node,
        h2d_piece_overhead_s=pick(sec.h2d_piece_overhead_s,
                                  pick(hw.h2d_piece_overhead_s, g.h2d.piece_overhead_s)),
        d2h_piece_overhead_s=pick(sec.d2h_piece_overhead_s,
                                  pick(hw.d2h_piece_overhead_s, g.d2h.piece_overhead_s)),
        h2d_duplex_factor=pick(sec.h2d_duplex_factor, pick(hw.h2d_duplex_factor, g.h2d.duplex_factor)),
        d2h_duplex_factor=pick(sec.d2h_duplex_factor, pick(hw.d2h_duplex_factor, g.d2h.duplex_factor)),
        **{k: pick(getattr(sec, k), pick(getattr(hw, k), getattr(g.host, k.removeprefix("host_"))))
           for k in HOST_KEYS},
        mfu=pick(sec.mfu, hw.mfu), mbu=pick(sec.mbu, pick(hw.mbu, DEFAULT_MBU)))


def group_spec(g: ModelGroup, tp: int) -> GroupSpec:
    heads = 1 if g.mla else max(1, g.kv_heads // tp)
    return g.spec(KVShape(g.layers, heads, g.head_size, DTYPE_BYTES[g.dtype], g.mla))


def _layout(groups: Sequence[ModelGroup], tph: int, bpc: int, tp: int, source: str, prefix: str,
            run_source: str | None = None) -> Layout:
    try:
        return Layout.of([group_spec(g, tp) for g in groups], tph, bpc)
    except LayoutError as exc:
        if exc.key in ("tokens_per_hash", "blocks_per_chunk"):
            raise InputError(run_source or source, f"scheduler.{exc.key}", exc.problem, exc.allowed) from None
        raise InputError(source, f"{prefix}{exc.key}", exc.problem, exc.allowed) from None


# -- the run ----------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """A validated ``run/1`` scenario and the objects a run is built from.

    Attributes:
        source: the scenario file.
        scenario: the validated tree (after ``--set`` overrides).
        model: the model after overrides.
        hardware: the hardware after overrides.
        layout: the KV layout, per worker (heads sharded by tensor parallelism).
        block_bytes: KV bytes of one GPU block id on one worker (largest group).
        gpu_kv_bytes: bytes given to the KV cache (None when ``gpu_blocks`` is explicit).
        gpu_blocks: GPU block pool size, null block included.
        cpu_chunks: CPU chunk slots.
        cpu_slot_bytes: host bytes of one chunk slot (all workers, page-rounded).
        step_cost: the step-time model.
        h2d: the load link model.
        d2h: the store link model.
        workload_path: the trace file (mooncake), absolute.
        warnings: one line each, about a valid but doubtful setting (a CPU cache beyond
            the run's share of the node's host RAM); reported by ``kvsim run`` and
            recorded in the summary under :data:`HARDWARE_WARNINGS_KEY`.
    """

    source: Path
    scenario: RunScenario
    model: ResolvedModel
    hardware: ResolvedHardware
    layout: Layout
    block_bytes: int
    gpu_kv_bytes: int | None
    gpu_blocks: int
    cpu_chunks: int
    cpu_slot_bytes: int
    step_cost: StepTimeModel
    h2d: TransferModel
    d2h: TransferModel
    workload_path: Path | None
    warnings: list[str] = dataclasses.field(default_factory=list)
    #: holds the :class:`sim.io.traces.BadLines` of the last :meth:`requests` stream
    _bad: list[Any] = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def bad_lines(self) -> Any:
        """Lines skipped by ``workload.skip_bad`` in the last :meth:`requests`
        stream (a :class:`sim.io.traces.BadLines`), or None."""
        return self._bad[0] if self._bad else None

    @property
    def cpu_cache_bytes(self) -> int:
        """The CPU cache in bytes: the capacity given, else chunks x slot bytes;
        0 without offloading or with no slots."""
        if not self.scenario.scheduler.offloading or self.cpu_chunks == 0:
            return 0
        capacity = self.scenario.cpu_cache.capacity
        return int(capacity) if capacity is not None else self.cpu_chunks * self.cpu_slot_bytes

    @property
    def name(self) -> str:
        """The run's name: ``name``, else the file stem."""
        return self.scenario.name or self.source.stem

    @property
    def expected_requests(self) -> int | None:
        """The number of requests when known in advance: a generator's exact count, a
        trace's ``limit`` (:func:`sim.io.workload.request_total`)."""
        return request_total(self)

    def engine_config(self) -> EngineConfig:
        """The engine's configuration."""
        sc = self.scenario
        s = sc.scheduler
        cp = sc.copy_path
        copy = (CopyPathConfig(mode=cp.mode, device=cp.device, timing=cp.timing,
                               memory_limit_bytes=cp.memory_limit) if cp.enabled else None)
        return EngineConfig(
            layout=self.layout, gpu_blocks=self.gpu_blocks,
            max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
            prefix_caching=s.prefix_caching, offloading=s.offloading,
            offload_prompt_only=s.offload_prompt_only, cpu_capacity_chunks=self.cpu_chunks,
            eviction=_eviction(sc.cpu_cache.policy), window_logic=sc.window_logic,
            on_crash=sc.on_crash, step_cost=self.step_cost, h2d=self.h2d, d2h=self.d2h,
            fast_forward=s.fast_forward, occupancy_interval_s=sc.output.occupancy_interval_s,
            transfer_piece=self.model.kv_transfer_piece,
            max_sim_time_s=sc.output.max_sim_time_s, stop_at_waiting=sc.output.stop_at_waiting,
            assertions=sc.assertions, copy_path=copy,
            block_accounting=s.block_accounting, decisions=sc.decisions,
            reserve_full_isl=s.reserve_full_isl, prompt_hash_s_per_block=self._prompt_hash_s(),
            prompt_tokenize_s_per_token=(self.hardware.host_tokenize_token_s if sc.costs.tokenize else 0.0),
            **self._tier_config())

    def _prompt_hash_s(self) -> float:
        """The engine core's prompt hashing per block: the roofline step model's host
        figure (``costs.step = "auto"``); an inline table or ``"zero"`` has none."""
        step = self.step_cost
        return step.host.per_hashed_block_s if isinstance(step, RooflineStepModel) else 0.0

    def _tier_config(self) -> dict[str, Any]:
        """The engine's secondary tiers and their links (nothing when there is none)."""
        sc = self.scenario
        if not sc.tiers:
            return {}
        specs = []
        links = []
        for t in sc.tiers:     # filled by _resolve_tiers
            assert t.kind is not None and t.read_bandwidth is not None and t.write_bandwidth is not None
            assert t.latency_s is not None and t.concurrency is not None
            chunks = t.chunks if t.capacity is None else t.capacity // self.cpu_slot_bytes
            specs.append(TierSpec(t.kind, chunks, EvictionPolicy(t.policy)))
            if sc.costs.transfer == "zero":
                links.append(TierLinkModel(ZERO_TRANSFER, ZERO_TRANSFER, t.concurrency))
            else:
                read = TransferModel(float(t.read_bandwidth), t.latency_s)
                write = TransferModel(float(t.write_bandwidth), t.latency_s)
                links.append(TierLinkModel(read, write, t.concurrency))
        return {"tiers": tuple(specs), "tier_links": tuple(links), "tier_chunk_bytes": self.cpu_slot_bytes}

    def multiturn_params(self) -> dict[str, Any]:
        """The multi-turn generator's parameters, defaults filled in (multiturn, agentic)."""
        wl = self.scenario.workload
        assert isinstance(wl, MultiTurnWorkload)
        return dataclasses.asdict(_multiturn(wl))

    def uniform_params(self) -> dict[str, Any]:
        """The uniform generator's parameters, defaults filled in (uniform only)."""
        wl = self.scenario.workload
        assert isinstance(wl, UniformWorkload)
        return dataclasses.asdict(UniformParams(**_given_params(wl)))

    def requests(self) -> Iterator[Request]:
        """A fresh iterator over the run's requests (call again to restart).

        Order of the transforms: the source (with ``time_scale`` for traces),
        then ``sample``, then ``rate_scale``, then ``arrival_jitter_s`` (traces;
        so the spread is in the run's seconds), then ``limit``.
        """
        wl = self.scenario.workload
        seed = self.scenario.seed
        tph = self.scenario.scheduler.tokens_per_hash
        self._bad.clear()
        stream: Iterator[Request]
        if isinstance(wl, MooncakeWorkload):
            assert self.workload_path is not None
            if wl.kind == "mooncake" and not wl.skip_bad:
                stream = iter_mooncake(self.workload_path, tph, time_scale=wl.time_scale,
                                       block_tokens=wl.block_tokens or 512)
            else:
                bad = BadLines()
                self._bad.append(bad)
                fmt = "mooncake" if wl.kind == "mooncake" else (None if wl.format == "auto" else wl.format)
                stream = iter_trace(self.workload_path, tph, fmt=fmt, time_scale=wl.time_scale,
                                    block_tokens=wl.block_tokens, skip_bad=wl.skip_bad, bad=bad)
        elif isinstance(wl, UniformWorkload):
            stream = iter_uniform(UniformParams(**self.uniform_params()), seed, tph)
        else:
            stream = iter_multiturn(_multiturn(wl), seed, tph)
        if wl.sample != 1:
            stream = sample(stream, wl.sample, seed)
        if wl.rate_scale != 1:
            stream = scale_rate(stream, wl.rate_scale)
        if isinstance(wl, MooncakeWorkload) and wl.arrival_jitter_s:
            stream = jitter_arrivals(stream, wl.arrival_jitter_s, seed)
        return take(stream, wl.limit)

    def resolved(self) -> dict[str, Any]:
        """The fully resolved scenario as a TOML-ready dict (loads back to the same config)."""
        sc = self.scenario
        out: dict[str, Any] = {"schema": "run/1", "kvsim_version": kvsim_version(), "name": self.name,
                               "seed": sc.seed, "window_logic": sc.window_logic, "on_crash": sc.on_crash,
                               "assertions": sc.assertions}
        if sc.decisions != "model":  # absent by default: resolved scenarios of the model stay as they were
            out["decisions"] = sc.decisions
        m = self.model
        model: dict[str, Any] = {"label": m.label}
        for key in ("cost_profile", "params_b", "weights_bytes"):
            if getattr(m, key) is not None:
                model[key] = getattr(m, key)
        model["kv_transfer_piece"] = m.kv_transfer_piece
        if m.shape is not None:
            model["shape"] = m.shape.model_dump(exclude_none=True)
        model["groups"] = [g.model_dump(exclude_none=True) for g in m.groups]
        out["model"] = model
        hw = self.hardware
        hardware: dict[str, Any] = {"profile": hw.profile}
        if sc.hardware.gpu_blocks is not None:
            hardware["gpu_blocks"] = self.gpu_blocks
        else:
            assert self.gpu_kv_bytes is not None
            hardware["gpu_kv_bytes"] = self.gpu_kv_bytes
        for key in ("gpu_memory_utilization", "h2d_bandwidth", "d2h_bandwidth", "h2d_latency_s",
                    "d2h_latency_s", "h2d_piece_overhead_s", "d2h_piece_overhead_s", "h2d_duplex_factor",
                    "d2h_duplex_factor", *HOST_KEYS):
            if key == "host_eager_layer_s" and not sc.costs.enforce_eager:
                continue   # used only by eager runs: earlier resolved scenarios unchanged
            if key == "host_tokenize_token_s" and not sc.costs.tokenize:
                continue   # used only with text prompts: earlier resolved scenarios unchanged
            hardware[key] = getattr(hw, key)
        if hw.mfu is not None:   # the defaults left out: earlier resolved scenarios unchanged
            hardware["mfu"] = hw.mfu
        if hw.mbu != DEFAULT_MBU:
            hardware["mbu"] = hw.mbu
        for key in ("dense_bf16_flops", "hbm_bandwidth", "attention_efficiency"):
            if getattr(sc.hardware, key) is not None:   # set by the run: kept (else the profile's)
                hardware[key] = getattr(sc.hardware, key)
        out["hardware"] = hardware
        out["cpu_cache"] = sc.cpu_cache.model_dump(exclude_none=True)
        if sc.tiers:
            out["tiers"] = [t.model_dump(exclude_none=True) for t in sc.tiers]
        out["scheduler"] = sc.scheduler.model_dump()
        wl = sc.workload
        if isinstance(wl, MooncakeWorkload):
            workload = wl.model_dump(exclude_none=True, exclude={"sha256"})
            if not wl.arrival_jitter_s:   # off: resolved scenarios (and their digests) as before
                del workload["arrival_jitter_s"]
            if wl.trace is not None:   # the name and the content's digest: the same on every machine
                assert self.workload_path is not None
                workload["sha256"] = trace_digest(self.workload_path)
            else:
                workload["path"] = str(self.workload_path)
        else:
            params = self.uniform_params() if isinstance(wl, UniformWorkload) else self.multiturn_params()
            workload = {"kind": wl.kind, **params}
            for key in ("limit", "rate_scale", "sample"):
                if getattr(wl, key) is not None:
                    workload[key] = getattr(wl, key)
        out["workload"] = workload
        c = self.step_cost
        step: Any = sc.costs.step if isinstance(sc.costs.step, str) else None
        if isinstance(c, StepCostModel) and step is None:
            step = {"overhead_s": float(c.overhead_s), "prefill_token_s": float(c.prefill_token_s),
                    "decode_seq_s": float(c.decode_seq_s), "context_token_s": float(c.context_token_s)}
        out["costs"] = {"step": step, "transfer": sc.costs.transfer,
                        "tensor_parallel": sc.costs.tensor_parallel}
        if sc.costs.enforce_eager:   # off: left out, earlier resolved scenarios unchanged
            out["costs"]["enforce_eager"] = True
        if sc.costs.tokenize:   # off: left out, earlier resolved scenarios unchanged
            out["costs"]["tokenize"] = True
        out["copy_path"] = sc.copy_path.model_dump(exclude_none=True)
        out["output"] = sc.output.model_dump(exclude_none=True)
        return out

    def resolved_toml(self) -> str:
        """:meth:`resolved` as TOML text (deterministic)."""
        return tomli_w.dumps(self.resolved())

    def describe(self) -> str:
        """One line: what the run is."""
        sc = self.scenario
        cpu = f"CPU {self.cpu_chunks} chunks ({sc.cpu_cache.policy})" if sc.scheduler.offloading \
            else "no offloading"
        n = len(self.model.groups)
        groups = f"{n} group" + ("" if n == 1 else "s")
        return (f"run/1: {self.name!r}, model {self.model.label} ({groups}), "
                f"{self.hardware.name}, GPU {self.gpu_blocks} blocks, {cpu}, "
                f"{sc.workload.kind} workload, logic {sc.window_logic}")


def _given_params(wl: MultiTurnWorkload | UniformWorkload) -> dict[str, Any]:
    """The generator parameters a scenario gives (the rest take the defaults)."""
    skip = ("kind", "limit", "rate_scale", "sample")
    return {k: v for k, v in wl.model_dump().items() if k not in skip and v is not None}


def _multiturn(wl: MultiTurnWorkload) -> MultiTurnParams:
    """Multi-turn parameters: the kind's preset with the given keys on top."""
    base = AGENTIC if wl.kind == "agentic" else MultiTurnParams()
    return dataclasses.replace(base, **_given_params(wl))


def kvsim_version() -> str:
    """The installed kvsim version."""
    try:
        return version("kvsim")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


def _eviction(policy: str) -> Any:
    return EvictionPolicy(policy)


def _step_cost(sc: RunScenario, model: ResolvedModel, hw: ResolvedHardware, layout: Layout,
               source: str) -> StepTimeModel:
    step = sc.costs.step
    if sc.costs.enforce_eager and step != "auto":
        what = repr(step) if isinstance(step, str) else "an inline table"
        raise InputError(source, "costs.enforce_eager", f"true with costs.step = {what}: the launch time "
                         "of the model's layers needs the roofline step model", 'costs.step = "auto", or '
                         "enforce_eager = false (a step table measured eager holds the launches already)")
    if step == "zero":
        return ZERO_STEP
    if isinstance(step, StepTable):
        return StepCostModel(step.overhead_s, step.prefill_token_s, step.decode_seq_s, step.context_token_s)
    if model.cost_shape is None:
        raise InputError(source, "costs.step", f"'auto' needs the model's [shape]; model {model.label!r} "
                         "has none and no cost_profile",
                         '"zero", an inline table {overhead_s, prefill_token_s, decode_seq_s, '
                         'context_token_s}, model.shape, or model.cost_profile')
    return roofline_step_model(hw.gpu_profile, model.cost_shape, layout.groups,
                               param_groups=[group_spec(g, 1) for g in model.cost_groups],
                               tensor_parallel=sc.costs.tensor_parallel, mfu=hw.mfu, mbu=hw.mbu,
                               host=hw.host(), enforce_eager=sc.costs.enforce_eager)


def _transfers(sc: RunScenario, hw: ResolvedHardware) -> tuple[TransferModel, TransferModel]:
    if sc.costs.transfer == "zero":
        return ZERO_TRANSFER, ZERO_TRANSFER
    return (TransferModel(float(hw.h2d_bandwidth), hw.h2d_latency_s, hw.h2d_piece_overhead_s,
                          hw.h2d_duplex_factor),
            TransferModel(float(hw.d2h_bandwidth), hw.d2h_latency_s, hw.d2h_piece_overhead_s,
                          hw.d2h_duplex_factor))


def step_model_for(gpu: str, model: str, *, tensor_parallel: int = 1, tokens_per_hash: int = 16,
                   enforce_eager: bool = False) -> RooflineStepModel:
    """The ``costs.step = "auto"`` model of the shipped ``model`` on ``gpu`` (its GPU
    profile's host overhead), as a run on the shipped hardware profile of that GPU gets it
    (with ``costs.enforce_eager = enforce_eager``).

    Raises:
        InputError: no such shipped model, or it has no ``[shape]``.
        KeyError: an unknown GPU (the message lists the known ones).
    """
    if gpu not in GPU_PROFILES:
        raise KeyError(f"unknown gpu {gpu!r}; known: {', '.join(sorted(GPU_PROFILES))}")
    mf = _cost_profile(model, "step_model_for", "model")
    assert mf.shape is not None
    shape = model_shape(mf.name, mf.shape, mf.groups, mf.weights_bytes, mf.name, "")
    layout = Layout.of([group_spec(g, tensor_parallel) for g in mf.groups], tokens_per_hash, 1)
    return roofline_step_model(GPU_PROFILES[gpu], shape, layout.groups,
                               param_groups=[group_spec(g, 1) for g in mf.groups],
                               tensor_parallel=tensor_parallel, enforce_eager=enforce_eager)


def build_run(data: dict[str, Any], path: Path, overridden: Mapping[str, str] | None = None) -> RunSpec:
    """Validate raw ``run/1`` data read from ``path`` and resolve it into a :class:`RunSpec`.

    ``overridden`` maps keys set on the command line to their option, so that
    a bad value is reported against the option instead of the file (the
    schema's errors and the ones found resolving the scenario alike).

    Raises:
        InputError: anything wrong, before anything is run or written: bad
            keys and values, sizes beyond the limits of :mod:`sim.io.schema`,
            tensor parallelism that does not divide the KV heads, the copy
            path without torch.
    """
    source = str(path)
    try:
        return _build_run(data, path, source)
    except InputError as err:
        if err.source == source:
            for k, option in (overridden or {}).items():
                if err.key == k or err.key.startswith(k + "."):
                    raise InputError(option, err.key, err.problem, err.allowed) from None
        raise


def torch_missing() -> bool:
    """Whether torch (the optional extra of the copy path) cannot be imported."""
    try:
        return importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):  # a broken or half-imported torch
        return True


def _check_vllm_mode(sc: RunScenario, source: str) -> None:
    """``decisions = "vllm"`` (or ``"differential"``): vLLM importable here, and nothing asked
    for that the mode lacks."""
    from sim.model.real_vllm import INSTALL_HINT, VllmMissingError, installed_version  # noqa: PLC0415

    try:
        installed_version()
    except VllmMissingError:
        raise InputError(source, "decisions", "vLLM is not installed in this Python environment",
                         INSTALL_HINT.split(": ", 1)[1] + ', or decisions = "model"') from None
    if sc.tiers:
        raise InputError(source, "tiers", 'secondary tiers are not available with decisions = "vllm"',
                         'no [[tiers]], or decisions = "model"')
    if sc.cpu_cache.policy not in ("lru", "arc"):
        raise InputError(source, "cpu_cache.policy",
                         f'{sc.cpu_cache.policy!r} is kvsim\'s own policy, not vLLM\'s (decisions = "vllm")',
                         '"lru" or "arc", or decisions = "model"')
    if sc.copy_path.enabled:
        raise InputError(source, "copy_path.enabled",
                         'the copy path is not available with decisions = "vllm"',
                         'copy_path.enabled = false, or decisions = "model"')


#: what to do when the copy path is asked for without torch
TORCH_ALLOWED = "pip install 'kvsim[torch]' (torch==2.13.0)"


def _shards(g: ModelGroup, tp: int) -> bool:
    return g.mla or g.kv_heads % tp == 0 or tp % g.kv_heads == 0


def _check_tensor_parallel(model: ResolvedModel, tp: int, source: str) -> None:
    """vLLM shards the KV heads over the workers, or replicates them when
    there are fewer heads than workers: ``tensor_parallel`` must divide the
    KV heads of every (non-MLA) group, or be a multiple of them."""
    for i, g in enumerate(model.groups):
        if _shards(g, tp):
            continue
        divisors = [d for d in range(1, g.kv_heads + 1) if g.kv_heads % d == 0]
        raise InputError(source, "costs.tensor_parallel",
                         f"{tp} does not divide the {g.kv_heads} KV heads of group {i} of model "
                         f"{model.label!r} (nor is it a multiple of them)",
                         f"a divisor of {g.kv_heads} ({', '.join(map(str, divisors))}) or a multiple of "
                         f"{g.kv_heads}")


#: tensor parallelism a "does not fit" error may suggest (at most the node's GPUs)
TP_CHOICES = (1, 2, 4, 8)


def _weights(model: ResolvedModel) -> int:
    """Weight bytes for the default KV budget: ``weights_bytes``, else ``params_b x 2e9``
    (bf16), else the model's own ``[shape]``, else 0."""
    if model.weights_bytes is not None:
        return model.weights_bytes
    if model.params_b is not None:
        return int(model.params_b * 1e9 * 2)
    if model.shape is not None and model.cost_shape is not None:
        return model.cost_shape.total_weight_bytes([group_spec(g, 1) for g in model.groups])
    return 0


def _default_kv_bytes(hw: ResolvedHardware, weights: int, tp: int) -> int:
    """``gpu_memory_utilization x HBM - weights / tp``: no activation reserve (see above)."""
    return int(hw.gpu_memory_utilization * hw.hbm_bytes) - -(-weights // tp)


def _does_not_fit(model: ResolvedModel, hw: ResolvedHardware, weights: int, tp: int, kv: int,
                  s: SchedulerSection, source: str) -> InputError:
    """The model's weights leave no KV pool (2 blocks) at ``tp``: name the smallest
    tensor parallelism of :data:`TP_CHOICES` that shards the KV heads and leaves one."""
    gpus = hw.gpus_per_node
    fit = None
    for t in TP_CHOICES:
        if (gpus is not None and t > gpus) or not all(_shards(g, t) for g in model.groups):
            continue
        layout = Layout.of([group_spec(g, t) for g in model.groups], s.tokens_per_hash, s.blocks_per_chunk)
        block = max(layout.kv_bytes_per_block(i) or 0 for i in range(len(layout.groups)))
        if _default_kv_bytes(hw, weights, t) >= 2 * block:
            fit = t
            break
    usable = int(hw.gpu_memory_utilization * hw.hbm_bytes)
    left = f"leave only {gib(kv)} (less than 2 KV blocks)" if kv > 0 else "leave nothing"
    problem = (f"model {model.label!r} does not fit on one {hw.name} at tensor_parallel {tp}: "
               f"{gib(-(-weights // tp), up=True)} of weights per GPU ({gib(weights, up=True)} / {tp}) "
               f"{left} "
               f"of the {gib(usable)} vLLM may use ({hw.gpu_memory_utilization} x {gib(hw.hbm_bytes)} HBM) "
               "for the KV cache")
    rest = "or set hardware.gpu_kv_bytes or hardware.gpu_blocks"
    if fit is not None:
        allowed = (f"costs.tensor_parallel = {fit} ({gib(-(-weights // fit), up=True)} of weights per GPU, "
                   f"{gib(_default_kv_bytes(hw, weights, fit))} left for the KV cache), {rest}")
    else:
        within = f"up to the node's {gpus} GPUs" if gpus is not None else \
            "of " + ", ".join(map(str, TP_CHOICES))
        allowed = (f"no tensor_parallel {within} that shards the KV heads fits: a GPU with more HBM, "
                   f"smaller model.weights_bytes, {rest}")
    return InputError(source, "hardware.gpu_kv_bytes", problem, allowed)


def _host_ram(sc: RunScenario, hw: ResolvedHardware, tp: int, cpu_bytes: int, source: str) -> list[str]:
    """A CPU cache beyond the node's host RAM is refused; beyond the run's share of
    it (``cpu_ram_bytes x tp / gpus_per_node``) it is one warning line."""
    ram = hw.cpu_ram_bytes
    if ram is None or cpu_bytes == 0:
        return []
    cc = sc.cpu_cache
    key = "cpu_cache.capacity" if cc.capacity is not None else "cpu_cache.chunks"
    what = gib(cpu_bytes, up=True)
    if cc.capacity is None:
        what = f"{cc.chunks:,} chunk slots ({what})"
    share = ram * tp // hw.gpus_per_node if hw.gpus_per_node is not None else ram
    if cpu_bytes > ram:
        mine = f"; this run's share at tensor_parallel {tp}: {gib(share)}" if share < ram else ""
        raise InputError(source, key, f"{what} of CPU cache is more than the {gib(ram)} of host RAM of "
                         f"one whole {hw.name} node (hardware profile cpu_ram_bytes)",
                         f"at most {gib(ram)}{mine}")
    if cpu_bytes > share:
        return [f"{key}: {what} of CPU cache is more than this run's share of the {gib(ram)} of host RAM "
                f"of one {hw.name} node ({gib(ram)} x tensor_parallel {tp} / {hw.gpus_per_node} GPUs = "
                f"{gib(share)}); the node's other GPUs would have {gib(ram - cpu_bytes)} left"]
    return []


def _cpu_slots(sc: RunScenario, block_bytes: int, copies: int, source: str) -> tuple[int, int]:
    """The CPU cache's chunk slots and the bytes of one slot, within the limits."""
    s, cc = sc.scheduler, sc.cpu_cache
    slot = slot_bytes(block_bytes, s.blocks_per_chunk, copies)
    if slot > MAX_BYTES:
        raise InputError(source, "scheduler.blocks_per_chunk",
                         f"a chunk slot of {s.blocks_per_chunk} blocks of {block_bytes} B x {copies} copies "
                         f"is {slot} B, beyond the limit of {MAX_BYTES:,} B ({WHY_BYTES})",
                         "fewer blocks per chunk")
    if cc.chunks is not None:
        if s.offloading and cc.chunks * slot > MAX_BYTES:
            raise InputError(source, "cpu_cache.chunks",
                             f"{cc.chunks} chunk slots of {slot} B are {cc.chunks * slot} B, beyond the "
                             f"limit of {MAX_BYTES:,} B ({WHY_BYTES})",
                             f"at most {MAX_BYTES // slot:,} chunks")
        return cc.chunks, slot
    if cc.capacity is None or cc.capacity == 0:
        return 0, slot
    cpu_chunks = capacity_from_bytes(cc.capacity, block_bytes, s.blocks_per_chunk, copies)
    if cpu_chunks == 0:
        raise InputError(source, "cpu_cache.capacity", f"{cc.capacity} B hold no chunk slot of {slot} B",
                         f"at least {slot} B, or chunks = 0")
    if cpu_chunks > MAX_CPU_CHUNKS:
        raise InputError(source, "cpu_cache.capacity",
                         f"{cc.capacity} B hold {cpu_chunks:,} chunk slots of {slot} B, beyond the limit "
                         f"of {MAX_CPU_CHUNKS:,} chunks ({WHY_CPU_CHUNKS})",
                         f"at most {MAX_CPU_CHUNKS * slot} B")
    return cpu_chunks, slot


def _build_run(data: dict[str, Any], path: Path, source: str) -> RunSpec:
    check_schema(data, source, "run/1")
    try:
        sc = RunScenario.model_validate(data)
    except ValidationError as exc:
        raise located(exc, source, RunScenario) from None
    if sc.copy_path.enabled and torch_missing():
        raise InputError(source, "copy_path.enabled", "the copy path needs torch, which is not installed",
                         f"{TORCH_ALLOWED}, or copy_path.enabled = false")
    if sc.decisions in ("vllm", "differential"):
        _check_vllm_mode(sc, source)
    base = path.resolve().parent
    sc = _resolve_tiers(sc, base, source)
    model = _resolve_model(sc.model, base, source)
    hw = _resolve_hardware(sc.hardware, base, source)
    s = sc.scheduler
    tp = sc.costs.tensor_parallel
    _check_tensor_parallel(model, tp, source)
    layout = _layout(model.groups, s.tokens_per_hash, s.blocks_per_chunk, tp, model.source, model.prefix,
                     run_source=source)
    block_bytes = max(layout.kv_bytes_per_block(i) or 0 for i in range(len(layout.groups)))
    if block_bytes > MAX_BYTES:
        raise InputError(model.source, f"{model.prefix}groups",
                         f"{block_bytes} B per block is beyond the limit of {MAX_BYTES:,} B ({WHY_BYTES})",
                         "fewer layers, heads or a smaller head_size")
    gpu_kv_bytes: int | None = None
    if sc.hardware.gpu_blocks is not None:
        gpu_blocks = sc.hardware.gpu_blocks
    else:
        if sc.hardware.gpu_kv_bytes is not None:
            gpu_kv_bytes = sc.hardware.gpu_kv_bytes
        else:
            weights = _weights(model)
            gpu_kv_bytes = _default_kv_bytes(hw, weights, tp)
            if gpu_kv_bytes < 2 * block_bytes:
                raise _does_not_fit(model, hw, weights, tp, gpu_kv_bytes, s, source)
        gpu_blocks = gpu_kv_bytes // block_bytes
        if gpu_blocks < 2:
            raise InputError(source, "hardware.gpu_kv_bytes",
                             f"{gpu_kv_bytes} B hold {gpu_blocks} blocks of {block_bytes} B",
                             f"at least {2 * block_bytes} B (2 blocks, the null block included)")
        if gpu_blocks > MAX_GPU_BLOCKS:
            given = "" if sc.hardware.gpu_kv_bytes is not None else " (the default)"
            raise InputError(source, "hardware.gpu_kv_bytes",
                             f"{gpu_kv_bytes} B{given} hold {gpu_blocks:,} blocks of {block_bytes} B, beyond "
                             f"the limit of {MAX_GPU_BLOCKS:,} GPU blocks ({WHY_GPU_BLOCKS})",
                             f"at most {MAX_GPU_BLOCKS * block_bytes} B, or hardware.gpu_blocks")

    copies = 1 if all(g.mla for g in model.groups) else tp   # MLA caches are replicated, one copy
    cpu_chunks, slot = _cpu_slots(sc, block_bytes, copies, source)
    cpu_bytes = 0 if not s.offloading else (
        sc.cpu_cache.capacity if sc.cpu_cache.capacity is not None else cpu_chunks * slot)
    warnings = _host_ram(sc, hw, tp, cpu_bytes, source)
    workload_path: Path | None = None
    wl = sc.workload
    if isinstance(wl, MooncakeWorkload):
        if wl.trace is not None:
            workload_path = resolve_trace(wl.trace, source=source, key="workload.trace")
        else:
            assert wl.path is not None
            workload_path = (base / wl.path).resolve()
            if not workload_path.is_file():
                raise InputError(source, "workload.path", f"{wl.path!r}: no such file",
                                 "a trace file, relative to the scenario file")
        if wl.sha256 is not None and (digest := trace_digest(workload_path)) != wl.sha256:
            raise InputError(source, "workload.sha256", f"{workload_path} has sha256 {digest}",
                             "the trace the run used (its sha256 as recorded), or no workload.sha256")
        block_tokens = wl.block_tokens or (512 if wl.kind == "mooncake" else None)
        if block_tokens is not None and block_tokens % s.tokens_per_hash:
            raise InputError(source, "workload.block_tokens",
                             f"{block_tokens} is not a multiple of tokens_per_hash={s.tokens_per_hash}",
                             f"a multiple of {s.tokens_per_hash}")
        if wl.kind == "trace" and wl.format == "auto":
            try:
                detect_format(workload_path)
            except InputError as exc:
                raise InputError(source, "workload.format", exc.problem, exc.allowed) from None
    else:
        try:
            if isinstance(wl, UniformWorkload):
                validate_uniform(UniformParams(**_given_params(wl)), source)
            else:
                validate_params(_multiturn(wl), source)
        except InputError as exc:
            raise InputError(source, f"workload.{exc.key}", exc.problem, exc.allowed) from None
    h2d, d2h = _transfers(sc, hw)
    return RunSpec(source=path, scenario=sc, model=model, hardware=hw, layout=layout,
                   block_bytes=block_bytes, gpu_kv_bytes=gpu_kv_bytes, gpu_blocks=gpu_blocks,
                   cpu_chunks=cpu_chunks, cpu_slot_bytes=slot,
                   step_cost=_step_cost(sc, model, hw, layout, source), h2d=h2d, d2h=d2h,
                   workload_path=workload_path, warnings=warnings)


def load_run(path: str | Path, overrides: Sequence[str | tuple[str, str]] = ()) -> RunSpec:
    """Read a ``run/1`` file, apply ``--set`` overrides, validate and resolve it.

    Args:
        path: the scenario file.
        overrides: ``"key=value"`` strings applied in order (rightmost wins), or
            ``(source, "key=value")`` pairs naming the option for error messages.

    Raises:
        InputError: anything wrong with the file, the files it names, or the overrides.
    """
    p = Path(path)
    data = read_toml(p)
    check_schema(data, str(p), "run/1")
    touched = apply_overrides(data, overrides)
    return build_run(data, p, touched)
