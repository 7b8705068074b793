"""Step-time model of an engine step and transfer-time model of the GPU<->CPU link.

What it models
    *Engine step.* One vLLM engine step runs one forward pass over a batch
    that mixes prefill chunks and decoding sequences. Its inputs are a
    :class:`StepLoad` the scheduler fills: prompt tokens computed, decoding
    sequences, scheduled requests, KV bytes the attention reads, and, per KV
    cache group, the *query-key pairs* the step's attention computes
    (:func:`attention_pairs`). Two models answer :meth:`time`:

    * :class:`RooflineStepModel` (``costs.step = "auto"``), derived from the
      model's shapes (:class:`ModelShape`, the ``[shape]`` table of a
      ``model/1`` file) and the GPU's datasheet (:data:`GPU_PROFILES`)::

          step = host_step_s + host_per_request_s x requests + scheduler_s
               + max(compute_s, memory_s, launch_s)
          scheduler_s = host_per_block_s x (blocks + loaded blocks)
                      + host_per_loaded_block_s x loaded blocks
          compute_s = (token_flops x new tokens + sample_flops x requests) / (peak x mfu(T))
                    + sum over groups g of pair_flops[g] x pairs[g] / (peak x eff[g])
          memory_s  = (weight_bytes - expert_bytes x (1 - k/E)^tokens + kv_read_bytes)
                      / (hbm_bandwidth x mbu)
          launch_s  = decoder layers x host_eager_layer_s   (enforce_eager; else 0)

      per worker (tensor parallelism divides FLOPs, weights and KV). ``mfu(T)``,
      the matmuls' fraction of peak for a step of ``T = prefill tokens + decode
      sequences`` tokens, is the GPU profile's measured curve where it has one
      (:data:`HOPPER_MATMUL_EFFICIENCY`: 0.49 at 516 tokens rising to 0.63 from
      about 1,900; linear between points, flat outside), else a constant
      (:data:`DEFAULT_MFU`, or the ``mfu`` a scenario or hardware file sets). The
      pairs of a request with ``p`` tokens already computed and ``c`` new
      tokens are: full attention ``c x p + c (c + 1) / 2`` (causal: the
      quadratic term of long prefills); sliding window ``W`` the same with
      every query capped at ``W`` keys; chunked local ``C`` every query
      attends to the tokens of its own ``C``-token chunk; mamba one state
      update per new token. ``pair_flops`` is ``4 x query_heads x head_size
      x layers`` (QK^T and PV, a multiply-add counted as 2 FLOPs) for
      attention groups and ``7 x state elements x layers`` for mamba groups
      (decay, S^T k, rank-1 update and read-out of the delta rule).
      ``token_flops`` is ``2 x`` the active parameters a token passes through
      (without the embedding gather and the LM head), ``sample_flops`` the LM
      head, applied once per scheduled request (vLLM computes logits at one
      position per request). ``launch_s`` is the host launching the pass's
      kernels one by one when no CUDA graph replays it (vLLM's
      ``enforce_eager``, ``costs.enforce_eager``): the GPU runs them as they
      come, so a pass takes the longer of its GPU time and its launches.
    * :class:`StepCostModel` (an inline ``[costs] step`` table): the linear
      model of earlier releases, ``overhead + prefill_token x prefill tokens
      + decode_seq x decode sequences + context_token x context tokens``,
      evaluated left to right in that order.

    *Link.* One direction of the host link (H2D loads, D2H stores): a job
    moves ``pieces`` separate copies (vLLM copies one page per layer per
    block, one packed block, or, as vLLM 0.11 did, keys and values apart:
    :data:`TRANSFER_PIECES`) and takes
    ``latency + pieces x piece_overhead + bytes / bandwidth``, i.e. the
    effective bandwidth of a piece of ``s`` bytes is
    ``s / (piece_overhead + s / bandwidth)`` (:meth:`TransferModel.piece_bandwidth`):
    slow for small pieces, near peak for large ones. While the other
    direction is also moving data, a job progresses at ``duplex_factor`` of
    its rate (the engine's links apply it, :mod:`sim.engine.links`).

    *Published figures.* :data:`GPU_PROFILES` holds datasheet figures of the
    H100 SXM, H200 SXM, H20, A100 SXM, L40S, B200 SXM and GH200, the host links'
    measured-style figures (PCIe Gen5 and Gen4, the GH200's NVLink-C2C) and the
    engine's host overhead per step; a
    GPU not listed gets its peak and HBM bandwidth from its ``hardware/1``
    file (:func:`gpu_profile`). The models' shapes live in the model
    files (``scenarios/models/*.toml``), not here. Every figure, its source and
    the derivation are in ``docs/costs.md``.

Simplifications
    * Compute and memory overlap perfectly inside a step (the roofline's
      ``max``); kernels reach fractions of the peaks that depend on nothing but
      the step's token count (the matmuls' ``mfu(T)``, measured on dense
      Llama layers and applied to every model, MoE experts and tensor-parallel
      shards included; the LM head at the same rate, mamba updates at the
      curve's last point) or
      nothing at all (``eff`` of attention pairs,
      :data:`DEFAULT_ATTENTION_EFFICIENCY`, and ``mbu``).
    * The host overhead (scheduling, input preparation, sampling, output
      processing) is serial with the forward pass (vLLM's default synchronous
      scheduling) and linear in the scheduled requests and in the KV blocks
      the scheduler allocates for prompt tokens (computed in the step or
      loaded by it; decode steps' blocks are inside the per-request term,
      fitted on all-decode steps). The scheduler's per-block part
      (:meth:`RooflineStepModel.scheduler_s`) runs before the step's loads are
      submitted; a step that only admits loads (no forward pass) costs that
      part plus ``host_no_forward_step_s`` (:meth:`RooflineStepModel.no_forward_s`).
      A loaded block's second charge (``host_per_loaded_block_s``, vLLM's work
      when the load completes) is taken with the load's admission, not after it:
      the same total on a request's critical path.
    * Without ``enforce_eager`` every forward pass replays a CUDA graph (no
      launch time beyond ``host_step_s``); vLLM captures graphs up to a batch
      size and runs larger steps without one, where its compiled kernels'
      launches hide behind the GPU time of such a large step. With it, the
      launch time is the same for every layer of every model (one figure per
      host, ``host_eager_layer_s``), whatever the layer's kernels and the step's
      size, and overlaps the GPU time completely.
    * KV writes of new tokens, activations and the all-reduce of tensor
      parallelism are free; attention reads each request's attended KV once
      per step; a prefill's attention FLOPs are counted exactly per causal
      mask (no tile padding).
    * A mixture-of-experts step reads the routed experts its tokens use, in
      expectation under independent uniform routing: of ``T`` tokens (prefill
      and decode) each routed to ``k`` of ``E`` experts, an expert stays idle
      with probability ``(1 - k/E)^T``, and its weights are not read (a batch of
      one decode token reads ``k`` experts per layer, 64 tokens of
      Qwen3-30B-A3B 98 % of them). Real routers are skewed, which leaves more
      experts idle: for given per-expert loads the uniform case touches the
      most experts, so this errs towards reading too much. It computes with the
      active parameters only; expert parallelism is not modelled.
    * A transfer piece's cost does not depend on pinned vs pageable host
      memory or on vLLM's Triton path for small H2D pages (below 28 KiB).

Invariants (checked at construction, raising :class:`ValueError`)
    * every coefficient is finite and non-negative; efficiencies in (0, 1];
    * a link bandwidth is positive (``math.inf`` allowed), its latency and
      piece overhead finite and non-negative, its duplex factor in (0, 1];
    * :meth:`StepCostModel.time` and :meth:`RooflineStepModel.time` evaluate
      their expressions in a fixed order, so two code paths that pass equal
      :class:`StepLoad` values get bit-identical floats.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal, Protocol

from sim.model.layout import GroupKind, GroupSpec, Layout, cdiv

__all__ = [
    "AMPERE_MATMUL_EFFICIENCY",
    "BLACKWELL_MATMUL_EFFICIENCY",
    "DEFAULT_ATTENTION_EFFICIENCY",
    "DEFAULT_MBU",
    "DEFAULT_MFU",
    "GPU_PROFILES",
    "HOPPER_MATMUL_EFFICIENCY",
    "MAMBA_FLOPS_PER_STATE_ELEMENT",
    "TRANSFER_PIECES",
    "ZERO_STEP",
    "ZERO_TRANSFER",
    "GpuProfile",
    "HostOverhead",
    "ModelShape",
    "RooflineStepModel",
    "StepCostModel",
    "StepLoad",
    "StepTimeModel",
    "TransferModel",
    "TransferPiece",
    "attended_tokens",
    "attention_pairs",
    "before_loads_s",
    "chunked_prefill_time",
    "decoder_layers",
    "gpu_profile",
    "group_span",
    "kv_bytes_per_token",
    "kv_terms",
    "pieces_per_block",
    "prompt_blocks",
    "roofline_step_model",
    "with_figures",
]

#: Default model-FLOP utilisation of the matmuls on a GPU with no measured curve (attention: below;
#: an assumption, see docs/costs.md).
DEFAULT_MFU = 0.5
#: The matmul efficiency of a Hopper GPU by tokens per step, ``(tokens, fraction of dense BF16
#: peak)``, linear between points and flat outside: the weight matmuls and the per-token operators
#: around them (norms, rotary, activation, residual adds) of Llama-2-7B layers measured on an H100
#: (Vidur's operator profile), the median of 8 profiled token counts around each point
#: (``benchmarks/matmul_efficiency.py``, docs/costs.md). The H200 has the same tensor cores.
HOPPER_MATMUL_EFFICIENCY: tuple[tuple[int, float], ...] = ((516, 0.488), (1032, 0.591), (1928, 0.63),
                                                            (4016, 0.633))
#: The same measurement on an A100 (Vidur's A100 operator profile of the same layers, the same
#: windows, over 312 TFLOP/s): flatter than the H100's, its peak being a third as high.
AMPERE_MATMUL_EFFICIENCY: tuple[tuple[int, float], ...] = ((516, 0.622), (1032, 0.615), (1928, 0.632),
                                                           (4016, 0.643))
#: The B200 (no operator profile published): the H100's curve scaled by the two GPUs' maximum
#: achievable matmul efficiencies (77.6 % and 80.3 % of peak, docs/costs.md), an assumption that a
#: Blackwell layer's non-matmul share and small-step shape follow Hopper's.
BLACKWELL_MATMUL_EFFICIENCY: tuple[tuple[int, float], ...] = tuple(
    (n, round(e * 0.776 / 0.803, 3)) for n, e in HOPPER_MATMUL_EFFICIENCY)
#: The H20 (no operator profile published): one point, flat for every step. A BF16 GEMM of 8,192 x
#: 8,192 x 3,696 per GPU (8,192 x 8,192 x 29,568 split over 8 H20s) took 4.01 ms with its reduce-
#: scatter (ByteDance-Seed/Triton-distributed issue 48, "Torch + NCCL"), so the GEMM alone ran at
#: >= 124 TFLOP/s, 0.84 of 148. Flat: an assumption resting on the A100's curve, flat with a third
#: of the H100's peak; the H20's is 15 % of it, so even small steps keep its tensor cores busy.
H20_MATMUL_EFFICIENCY: tuple[tuple[int, float], ...] = ((8192, 0.84),)
#: Default fraction of dense BF16 peak that attention kernels reach on the query-key pairs of
#: attention groups (not mamba): FlashAttention-3, which vLLM's FlashAttention backend runs on
#: Hopper, measured 614-621 TFLOP/s of 989 on an H100 at head dim 128 and 8k-16k tokens
#: (pytorch/benchmark PR 2391); its paper states up to 75 % (arXiv:2407.08608). See docs/costs.md.
DEFAULT_ATTENTION_EFFICIENCY = 0.62
#: Default memory-bandwidth utilisation of weight and KV reads (see docs/costs.md).
DEFAULT_MBU = 0.8
#: FLOPs per recurrent-state element and token of a mamba (Gated DeltaNet) layer: decay (1),
#: S^T k (2), rank-1 update (2), read-out S^T q (2). An assumption from the delta rule's algebra.
MAMBA_FLOPS_PER_STATE_ELEMENT = 7

#: How vLLM cuts one GPU block of a group into copies (``model/1`` key ``kv_transfer_piece``):
#: ``layer``: one page per layer (vLLM 0.30-0.33 OffloadingConnector worker, every layout but a
#: packed one); ``block``: one region holding every layer of the block (a packed layout, e.g.
#: DeepSeek V4, whose layer views' block stride exceeds their page size, or vLLM 0.12's
#: cross-layer layout); ``kv``: a page per layer for the keys and another for the values (the
#: layout vLLM 0.11 offloaded with FlashAttention: a Llama 3.1 8B block in 32 KB pieces).
TransferPiece = Literal["layer", "block", "kv"]
TRANSFER_PIECES: tuple[TransferPiece, ...] = ("layer", "block", "kv")


def _finite_non_negative(owner: str, name: str, value: float) -> float:
    """Return ``value`` as a float, or raise if it is NaN, infinite or negative."""
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0.0:
        raise ValueError(f"{owner}.{name} must be finite and >= 0, got {value!r}")
    return v


def _positive(owner: str, name: str, value: float, *, allow_inf: bool) -> float:
    """Return ``value`` as a float, or raise if it is NaN, not > 0, or (unless allowed) infinite."""
    v = float(value)
    if math.isnan(v) or v <= 0.0 or (math.isinf(v) and not allow_inf):
        what = "> 0 (inf allowed)" if allow_inf else "finite and > 0"
        raise ValueError(f"{owner}.{name} must be {what}, got {value!r}")
    return v


def _fraction(owner: str, name: str, value: float) -> float:
    v = float(value)
    if not 0.0 < v <= 1.0:  # also rejects NaN
        raise ValueError(f"{owner}.{name} must be in (0, 1], got {value!r}")
    return v


# -- what a step computes -------------------------------------------------------------------------------


def attention_pairs(kind: GroupKind, span: int, p: int, c: int) -> int:
    """Query-key pairs (mamba: state updates) of ``c`` new tokens after ``p`` computed ones.

    Args:
        kind: the group's attention kind.
        span: the window (sliding window), the attention chunk (chunked local);
            ignored for full attention and mamba.
        p: tokens of the request already computed (cached) before the step.
        c: tokens computed in the step.

    Returns:
        Full: ``c x p + c (c + 1) / 2``; sliding window: the sum over the new
        tokens at positions ``t = p .. p + c - 1`` of ``min(t + 1, span)``;
        chunked local: the sum of ``t mod span + 1``; mamba: ``c``.
    """
    if c <= 0:
        return 0
    if kind is GroupKind.FULL:
        return c * p + c * (c + 1) // 2
    if kind is GroupKind.SLIDING_WINDOW:
        a, b = p + 1, p + c          # keys of the first and the last new token, uncapped
        if b <= span:
            return (a + b) * (b - a + 1) // 2
        if a >= span:
            return span * c
        return (a + span) * (span - a + 1) // 2 + span * (b - span)
    if kind is GroupKind.CHUNKED_LOCAL:
        return _chunk_prefix(p + c, span) - _chunk_prefix(p, span)
    return c


def _chunk_prefix(n: int, chunk: int) -> int:
    """Sum over positions ``t < n`` of ``t mod chunk + 1``."""
    q, r = divmod(n, chunk)
    return q * chunk * (chunk + 1) // 2 + r * (r + 1) // 2


def attended_tokens(kind: GroupKind, span: int, context: int) -> int:
    """Tokens of KV a group reads for a request with ``context`` tokens: full
    attention all of them; chunked local the tokens of the current chunk; a
    sliding window or a mamba state the last ``span`` (the window, one state block)."""
    if kind is GroupKind.FULL:
        return context
    if kind is GroupKind.CHUNKED_LOCAL:
        return context - ((context - 1) // span) * span if context > 0 else 0
    return context if context < span else span


@dataclass(frozen=True, slots=True)
class StepLoad:
    """What one engine step computes and reads (the step models' input).

    Attributes:
        prefill_tokens: prompt tokens computed in the step (all prefill chunks).
        decode_seqs: sequences that decode one token in the step.
        context_tokens: KV attended, summed over requests, in tokens of the
            model's full KV per token (the linear model's context term).
        requests: requests scheduled in the step (sampled positions, host work).
        kv_read_bytes: KV bytes the step's attention reads, on one worker.
        pairs: per KV cache group, the query-key pairs of the step
            (:func:`attention_pairs`; mamba groups: state updates).
        blocks: KV blocks, over all groups, that the step's prompt tokens (prefill
            chunks, not decode tokens) begin: the blocks the scheduler allocates
            for them.
        loaded_blocks: GPU blocks, over all groups, of the load jobs the step issues.
    """

    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: float = 0.0
    requests: int = 0
    kv_read_bytes: int = 0
    pairs: tuple[int, ...] = ()
    blocks: int = 0
    loaded_blocks: int = 0


class StepTimeModel(Protocol):
    """What the engine asks of a step model: a step's time with a forward pass
    (:meth:`time`), the part of it the scheduler spends before the step's loads
    are submitted (:meth:`scheduler_s`, included in :meth:`time`), and the time of
    a step that runs no forward pass but issues loads (:meth:`no_forward_s`)."""

    def time(self, load: StepLoad) -> float: ...  # pragma: no cover - a protocol

    def scheduler_s(self, load: StepLoad) -> float: ...  # pragma: no cover - a protocol

    def no_forward_s(self, load: StepLoad) -> float: ...  # pragma: no cover - a protocol


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """The linear step model (an inline ``[costs] step`` table), in seconds.

    Attributes:
        overhead_s: fixed cost of every step (weights read, launch, sampling).
        prefill_token_s: cost per prefill token computed in the step.
        decode_seq_s: cost per decoding sequence in the batch.
        context_token_s: cost per token of attended context, summed over the
            scheduled requests.
    """

    overhead_s: float = 0.0
    prefill_token_s: float = 0.0
    decode_seq_s: float = 0.0
    context_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overhead_s", "prefill_token_s", "decode_seq_s", "context_token_s"):
            object.__setattr__(
                self, name, _finite_non_negative("StepCostModel", name, getattr(self, name))
            )

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: float) -> float:
        """Seconds the step takes.

        The expression is evaluated left to right in a fixed order (overhead,
        prefill, decode, context); callers rely on bit-identical results.

        Args:
            prefill_tokens: prompt tokens computed in this step (>= 0).
            decode_seqs: sequences that decode one token in this step (>= 0).
            context_tokens: KV attended, summed over requests, in tokens of
                the model's full KV per token (>= 0).

        Returns:
            The step duration; ``0.0`` for the all-zero model.
        """
        return (
            self.overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )

    def time(self, load: StepLoad) -> float:
        """:meth:`step_time` of the load's prefill tokens, decode sequences and context."""
        return self.step_time(load.prefill_tokens, load.decode_seqs, load.context_tokens)

    def scheduler_s(self, load: StepLoad) -> float:
        """The linear model has no scheduler term: 0."""
        return 0.0

    def no_forward_s(self, load: StepLoad) -> float:
        """A step without a forward pass costs nothing in the linear model."""
        return 0.0


def before_loads_s(model: StepTimeModel, load: StepLoad, forward: bool) -> float:
    """Seconds a step spends before its loads are submitted (both engines ask this):
    the scheduler's per-block time of a step with a forward pass (part of its
    :meth:`~StepTimeModel.time`), the whole time of a step without one that issues
    loads (:meth:`~StepTimeModel.no_forward_s`), else 0."""
    if forward:
        return model.scheduler_s(load)
    return model.no_forward_s(load) if load.loaded_blocks else 0.0


#: The all-zero step model: every step takes no time.
ZERO_STEP = StepCostModel()


@dataclass(frozen=True, slots=True)
class HostOverhead:
    """The engine's own time: per step, serial with the forward pass, and per new request.

    Attributes:
        step_s: per step (scheduler call, input preparation, launch, sampling).
        per_request_s: per scheduled request (the scheduler's and the output
            processing's per-request work).
        per_hashed_block_s: per prefix-cache hash block of a new request's prompt:
            vLLM's engine core hashes the prompt when it creates the request, in
            its input thread, before the scheduler sees it (not part of
            :meth:`RooflineStepModel.time`: the engine delays each arrival by it,
            one request after another, ``EngineConfig.prompt_hash_s_per_block``).
        per_block_s: the scheduler's time per KV block it allocates for prompt tokens
            computed or loaded in the step (:attr:`StepLoad.blocks` and
            :attr:`StepLoad.loaded_blocks`), before the step's loads are submitted.
        per_loaded_block_s: vLLM's further work per loaded block once its load completes
            (charged with the load's admission: the same total on the request's path).
        no_forward_step_s: the scheduler's fixed time in a step that runs no forward
            pass but issues loads (a step with a forward pass has it in ``step_s``).
        eager_layer_s: per decoder layer, the host's time to launch a forward pass's
            kernels when no CUDA graph replays it (vLLM's ``enforce_eager``); unused
            otherwise (:attr:`RooflineStepModel.launch_s`).
        tokenize_token_s: per prompt token, vLLM's OpenAI server tokenizing a prompt that
            arrives as text, before the engine core sees the request (``costs.tokenize``:
            the engine delays each arrival by it, one request after another,
            ``EngineConfig.prompt_tokenize_s_per_token``; unused otherwise).
    """

    step_s: float = 0.0
    per_request_s: float = 0.0
    per_hashed_block_s: float = 0.0
    per_block_s: float = 0.0
    per_loaded_block_s: float = 0.0
    no_forward_step_s: float = 0.0
    eager_layer_s: float = 0.0
    tokenize_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step_s", "per_request_s", "per_hashed_block_s", "per_block_s", "per_loaded_block_s",
                     "no_forward_step_s", "eager_layer_s", "tokenize_token_s"):
            object.__setattr__(self, name, _finite_non_negative("HostOverhead", name, getattr(self, name)))


@dataclass(frozen=True, slots=True)
class RooflineStepModel:
    """The roofline step model of one worker (see the module docstring), in seconds.

    Attributes:
        token_flops: FLOPs per new token (prefill or decode) outside attention.
        sample_flops: FLOPs of the LM head, per scheduled request.
        pair_flops: per KV cache group, FLOPs per query-key pair (mamba: per state update).
        weight_bytes: bytes of all the weights (read once per step, but for idle routed experts).
        flops_per_s: effective FLOP/s (peak x mfu).
        bytes_per_s: effective HBM bytes/s (peak x mbu).
        pair_flops_per_s: per KV cache group, the effective FLOP/s of its pairs (attention
            kernels reach a different fraction of peak than the matmuls); empty: every
            group at the token FLOPs' rate (:meth:`token_rate`).
        host: the engine's own time per step.
        expert_bytes: the routed experts' share of ``weight_bytes`` (0: a dense model).
        expert_idle: the chance that one token leaves a given routed expert idle,
            ``1 - experts_per_token / experts``, in [0, 1).
        token_rate_curve: the effective FLOP/s of the token and sample FLOPs by the
            step's tokens (``prefill_tokens + decode_seqs``), ``(tokens, FLOP/s)`` points with
            increasing tokens, linear between them and flat outside (:meth:`token_rate`);
            empty: ``flops_per_s`` for every step.
        launch_s: the least time of a forward pass, its kernels launched one by one by
            the host (vLLM's ``enforce_eager``: decoder layers x
            :attr:`HostOverhead.eager_layer_s`); 0: a CUDA graph replays every pass.
    """

    token_flops: float
    sample_flops: float
    pair_flops: tuple[float, ...]
    weight_bytes: float
    flops_per_s: float
    bytes_per_s: float
    host: HostOverhead = HostOverhead()
    pair_flops_per_s: tuple[float, ...] = ()
    expert_bytes: float = 0.0
    expert_idle: float = 0.0
    token_rate_curve: tuple[tuple[int, float], ...] = ()
    launch_s: float = 0.0

    def __post_init__(self) -> None:
        o = "RooflineStepModel"
        curve = tuple((int(t), _positive(o, "token_rate_curve", r, allow_inf=False))
                      for t, r in self.token_rate_curve)
        if any(b[0] <= a[0] for a, b in pairwise(curve)) or any(t < 1 for t, _ in curve):
            raise ValueError(f"{o}.token_rate_curve needs token counts >= 1, increasing, got {curve!r}")
        object.__setattr__(self, "token_rate_curve", curve)
        for name in ("token_flops", "sample_flops", "weight_bytes", "expert_bytes", "launch_s"):
            object.__setattr__(self, name, _finite_non_negative(o, name, getattr(self, name)))
        if self.expert_bytes > self.weight_bytes:
            raise ValueError(f"{o}.expert_bytes ({self.expert_bytes}) exceeds weight_bytes "
                             f"({self.weight_bytes})")
        idle = float(self.expert_idle)
        if not 0.0 <= idle < 1.0:  # also rejects NaN
            raise ValueError(f"{o}.expert_idle must be in [0, 1), got {self.expert_idle!r}")
        object.__setattr__(self, "expert_idle", idle)
        object.__setattr__(self, "pair_flops",
                           tuple(_finite_non_negative(o, "pair_flops", v) for v in self.pair_flops))
        object.__setattr__(self, "flops_per_s", _positive(o, "flops_per_s", self.flops_per_s, allow_inf=True))
        object.__setattr__(self, "bytes_per_s", _positive(o, "bytes_per_s", self.bytes_per_s, allow_inf=True))
        object.__setattr__(self, "pair_flops_per_s", tuple(
            _positive(o, "pair_flops_per_s", v, allow_inf=True) for v in self.pair_flops_per_s))
        if self.pair_flops_per_s and len(self.pair_flops_per_s) != len(self.pair_flops):
            raise ValueError(f"{o}.pair_flops_per_s needs one rate per group ({len(self.pair_flops)}), "
                             f"got {len(self.pair_flops_per_s)}")

    def token_rate(self, tokens: int) -> float:
        """Effective FLOP/s of a step's token and sample FLOPs with ``tokens`` tokens
        (:attr:`token_rate_curve`, or :attr:`flops_per_s` without one)."""
        curve = self.token_rate_curve
        if not curve:
            return self.flops_per_s
        t0, r0 = curve[0]
        if tokens <= t0:
            return r0
        for t1, r1 in curve[1:]:
            if tokens <= t1:
                return r0 + (r1 - r0) * (tokens - t0) / (t1 - t0)
            t0, r0 = t1, r1
        return r0

    def compute_s(self, load: StepLoad) -> float:
        """The step's FLOPs over the effective FLOP/s (token and sample FLOPs at
        :meth:`token_rate`, each group's pairs at their own rate)."""
        tokens = load.prefill_tokens + load.decode_seqs
        flops = self.token_flops * tokens + self.sample_flops * load.requests
        rate = self.token_rate(tokens)
        if not self.pair_flops_per_s:
            for f, n in zip(self.pair_flops, load.pairs, strict=True):
                flops += f * n
            return flops / rate
        t = flops / rate
        for f, n, r in zip(self.pair_flops, load.pairs, self.pair_flops_per_s, strict=True):
            t += f * n / r
        return t

    def weights_read(self, load: StepLoad) -> float:
        """Weight bytes the step reads: every weight but the routed experts that none of
        its ``prefill_tokens + decode_seqs`` tokens is routed to, in expectation under
        independent uniform routing (``expert_bytes x expert_idle ^ tokens`` left unread)."""
        if not self.expert_idle:
            return self.weight_bytes
        tokens = load.prefill_tokens + load.decode_seqs
        return self.weight_bytes - self.expert_bytes * self.expert_idle ** tokens

    def step_bytes(self, load: StepLoad) -> float:
        """The step's bytes: :meth:`weights_read` and the attended KV."""
        return self.weights_read(load) + load.kv_read_bytes

    def memory_s(self, load: StepLoad) -> float:
        """The step's bytes (:meth:`step_bytes`) over the effective bandwidth."""
        return self.step_bytes(load) / self.bytes_per_s

    def scheduler_s(self, load: StepLoad) -> float:
        """The scheduler's per-block time in the step (before its loads are submitted)."""
        h = self.host
        return h.per_block_s * load.blocks + (h.per_block_s + h.per_loaded_block_s) * load.loaded_blocks

    def time(self, load: StepLoad) -> float:
        """Seconds the step takes: host overhead (per step, per request and the
        scheduler's per-block time) plus the largest of compute, memory and launch time."""
        host = self.host.step_s + self.host.per_request_s * load.requests + self.scheduler_s(load)
        return host + max(self.compute_s(load), self.memory_s(load), self.launch_s)

    def decode_timer(self, n: int) -> Callable[[float, int, tuple[int, ...]], float]:
        """:meth:`time` of pure decode steps of ``n`` sequences, as a function of a step's
        ``(context_tokens, kv_read_bytes, pairs)``: what depends on ``n`` alone (host time,
        token FLOPs and rate, weights read) is evaluated once, the rest by the same
        operations in the same order, so every time is bit for bit :meth:`time`'s
        (tests/model/test_costs_roofline.py). A decode fast-forward times each of its steps so."""
        load = StepLoad(0, n, 0.0, n, 0, ())
        host = self.host.step_s + self.host.per_request_s * load.requests + self.scheduler_s(load)
        tokens = load.prefill_tokens + load.decode_seqs
        flops0 = self.token_flops * tokens + self.sample_flops * load.requests
        rate = self.token_rate(tokens)
        weights = self.weights_read(load)
        bytes_per_s, launch_s = self.bytes_per_s, self.launch_s
        pair_flops, pair_rates = self.pair_flops, self.pair_flops_per_s

        def timed(context_tokens: float, kv_read_bytes: int, pairs: tuple[int, ...]) -> float:
            if pair_rates:
                compute = flops0 / rate
                for f, m, r in zip(pair_flops, pairs, pair_rates, strict=True):
                    compute += f * m / r
            else:
                flops = flops0
                for f, m in zip(pair_flops, pairs, strict=True):
                    flops += f * m
                compute = flops / rate
            return host + max(compute, (weights + kv_read_bytes) / bytes_per_s, launch_s)

        return timed

    def no_forward_s(self, load: StepLoad) -> float:
        """Seconds of a step that runs no forward pass but issues loads: the scheduler's
        fixed time of such a step and its per-block time."""
        return self.host.no_forward_step_s + self.scheduler_s(load)


def decode_timer(model: StepTimeModel, n: int) -> Callable[[float, int, tuple[int, ...]], float]:
    """The time of a pure decode step of ``n`` sequences from its ``(context_tokens,
    kv_read_bytes, pairs)``: the model's own :meth:`RooflineStepModel.decode_timer` where it
    has one, else its :meth:`~StepTimeModel.time` of the step's :class:`StepLoad`."""
    if isinstance(model, RooflineStepModel):
        return model.decode_timer(n)

    def timed(context_tokens: float, kv_read_bytes: int, pairs: tuple[int, ...]) -> float:
        return model.time(StepLoad(0, n, context_tokens, n, kv_read_bytes, pairs))

    return timed


@dataclass(frozen=True, slots=True)
class TransferModel:
    """One direction of the GPU<->CPU link (H2D or D2H).

    Attributes:
        bandwidth_bytes_per_s: peak effective bandwidth of large copies;
            ``math.inf`` makes only the fixed costs count.
        latency_s: fixed latency per transfer job.
        piece_overhead_s: fixed cost of each separate copy (piece) of a job.
        duplex_factor: fraction of its rate a job keeps while the other
            direction is moving data too (1: full duplex without loss).
    """

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    piece_overhead_s: float = 0.0
    duplex_factor: float = 1.0

    def __post_init__(self) -> None:
        o = "TransferModel"
        object.__setattr__(self, "bandwidth_bytes_per_s",
                           _positive(o, "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, allow_inf=True))
        object.__setattr__(self, "latency_s", _finite_non_negative(o, "latency_s", self.latency_s))
        object.__setattr__(self, "piece_overhead_s",
                           _finite_non_negative(o, "piece_overhead_s", self.piece_overhead_s))
        object.__setattr__(self, "duplex_factor", _fraction(o, "duplex_factor", self.duplex_factor))

    def time(self, nbytes: int, pieces: int = 0) -> float:
        """Seconds one job of ``nbytes`` in ``pieces`` copies takes, the other direction idle.

        Args:
            nbytes: bytes moved by the job (>= 0).
            pieces: separate copies the job makes (>= 0; 0 charges no piece overhead).

        Returns:
            ``latency_s + pieces x piece_overhead_s + nbytes / bandwidth_bytes_per_s``
            (the last term is ``0.0`` for infinite bandwidth), in that order.

        Raises:
            ValueError: ``nbytes`` or ``pieces`` is negative.
        """
        if nbytes < 0 or pieces < 0:
            raise ValueError(f"nbytes and pieces must be >= 0, got {nbytes!r}, {pieces!r}")
        return self.latency_s + pieces * self.piece_overhead_s + nbytes / self.bandwidth_bytes_per_s

    def piece_bandwidth(self, piece_bytes: int) -> float:
        """Effective bytes/s of copies of ``piece_bytes`` each (the curve of docs/costs.md):
        ``piece_bytes / (piece_overhead_s + piece_bytes / bandwidth)``."""
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be > 0, got {piece_bytes!r}")
        return piece_bytes / (self.piece_overhead_s + piece_bytes / self.bandwidth_bytes_per_s)


#: A free link: infinite bandwidth, no latency.
ZERO_TRANSFER = TransferModel(math.inf, 0.0)


def pieces_per_block(spec: GroupSpec, piece: TransferPiece) -> int:
    """Copies vLLM makes for one GPU block of ``spec``: one per layer, one packed
    block, or (``kv``) two per layer, keys and values apart, for attention that
    keeps both (an MLA latent or a mamba state stays one page per layer). A group
    without a tensor shape counts as one piece."""
    if piece == "block" or spec.shape is None:
        return 1
    if piece == "kv" and spec.kind is not GroupKind.MAMBA and not spec.shape.mla:
        return 2 * spec.shape.layers
    return spec.shape.layers


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """Published figures of one GPU, its host link and its host's overhead per step.

    Attributes:
        name: short name (``"h100"``, ``"h200"``).
        hbm_bytes: HBM capacity as on the datasheet (decimal GB).
        hbm_bandwidth_bytes_per_s: peak HBM bandwidth.
        dense_bf16_flops: dense (no sparsity) BF16 tensor-core FLOP/s.
        h2d: host-to-device link (PCIe Gen5 x16, pinned memory, effective).
        d2h: device-to-host link.
        host: the engine's own time per step.
        sources: citations, each "URL: what number".
        attention_efficiency: fraction of ``dense_bf16_flops`` the attention kernels
            reach on this GPU when measured for it (None:
            :data:`DEFAULT_ATTENTION_EFFICIENCY`, the H100's measurement).
        matmul_efficiency: fraction of ``dense_bf16_flops`` the matmuls reach by tokens per
            step, ``(tokens, fraction)`` points, where measured for this GPU (empty:
            :data:`DEFAULT_MFU` for every step).
    """

    name: str
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    dense_bf16_flops: float
    h2d: TransferModel
    d2h: TransferModel
    host: HostOverhead
    sources: tuple[str, ...]
    attention_efficiency: float | None = None
    matmul_efficiency: tuple[tuple[int, float], ...] = ()

    @property
    def large_step_mfu(self) -> float:
        """The matmuls' efficiency of a large step: the curve's last point, else :data:`DEFAULT_MFU`."""
        return self.matmul_efficiency[-1][1] if self.matmul_efficiency else DEFAULT_MFU

    def __post_init__(self) -> None:
        owner = f"GpuProfile({self.name!r})"
        for _, e in self.matmul_efficiency:
            _fraction(owner, "matmul_efficiency", e)
        if isinstance(self.hbm_bytes, bool) or not isinstance(self.hbm_bytes, int) or self.hbm_bytes <= 0:
            raise ValueError(f"{owner}.hbm_bytes must be a positive int, got {self.hbm_bytes!r}")
        _positive(owner, "hbm_bandwidth_bytes_per_s", self.hbm_bandwidth_bytes_per_s, allow_inf=False)
        _positive(owner, "dense_bf16_flops", self.dense_bf16_flops, allow_inf=False)
        if self.attention_efficiency is not None:
            _fraction(owner, "attention_efficiency", self.attention_efficiency)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """KV bytes of one token over all layers: K and V, each ``kv_heads x head_dim``.

    Same rule as :meth:`sim.model.layout.KVShape.bytes_per_block` for one token
    without MLA.
    """
    return 2 * layers * kv_heads * head_dim * dtype_bytes


# -- published figures ---------------------------------------------------------------------------------

_GB = 10**9

_H100_DATASHEET = "https://resources.nvidia.com/en-us-gpu-resources/h100-datasheet-24306"
_H100_PAGE = "https://www.nvidia.com/en-us/data-center/h100/"
_H200_PAGE = "https://www.nvidia.com/en-us/data-center/h200/"

#: Effective PCIe Gen5 x16 figure per direction (pinned memory, large copies).
#: Raw link rate is 32 GT/s x 16 lanes x 128/130 / 8 = 63 GB/s per direction;
#: public nvbandwidth runs on H100 systems show 52.8-57 GB/s; 55 GB/s is taken.
PCIE5_X16_EFFECTIVE_BYTES_PER_S = 55 * _GB
#: Per-job latency of a host<->device copy: an assumption (no citable figure found).
PCIE_JOB_LATENCY_S = 10e-6
#: Fixed cost of one copy descriptor of a batched DMA copy (cuMemcpyBatchAsync): 2.4-2.6 us
#: measured per small copy on a PCIe Gen5 x16 host link (MI300X); assumed the same on H100/H200.
PCIE_PIECE_OVERHEAD_S = 2.5e-6
#: Rate kept by an H2D / D2H copy while the other direction copies too: the vLLM blog's DMA
#: copies of 2 MB blocks on an H100 (PCIe Gen5) reach about 50 GB/s one way and 83.4 GB/s
#: with both directions busy, the most with equal amounts each way, i.e. both directions at
#: the same rate: 83.4 / (2 x 50) each.
PCIE_H2D_DUPLEX_FACTOR = 0.834
PCIE_D2H_DUPLEX_FACTOR = 0.834
#: Effective PCIe Gen4 x16 figure per direction (pinned memory, large copies): nvbandwidth measured
#: 25.13 GB/s host->device on an A100-SXM4-40GB (512 MiB-1 GiB buffers) and about 25 GB/s each way
#: on A100-SXM4-80GB hosts; the raw link rate is 16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s.
PCIE4_X16_EFFECTIVE_BYTES_PER_S = 25 * _GB
#: Rate kept on a PCIe Gen4 x16 link with the other direction busy: nvbandwidth's bidirectional copies on
#: A100 hosts, host->device 12-13 GB/s and device->host 24 GB/s against 25-26 GB/s one way (0.47, 0.95).
PCIE4_H2D_DUPLEX_FACTOR = 0.47
PCIE4_D2H_DUPLEX_FACTOR = 0.95
#: The engine's host time per step and per scheduled request (sources in docs/costs.md).
HOST_STEP_S = 1.4e-3
HOST_PER_REQUEST_S = 15e-6
#: vLLM's engine core hashing a new request's prompt, per hash block (sha256, its default):
#: measured with vLLM 0.30.0 and 0.33.0 (benchmarks/vllm_block_hash_cost.py, docs/costs.md)
HOST_PER_HASHED_BLOCK_S = 1.5e-6
#: vLLM 0.30.0's scheduler around prompt blocks (benchmarks/vllm_load_overhead.py, docs/costs.md):
#: schedule() per block allocated for a prompt (prefill chunks and loads alike), update_from_output()
#: per block once its load completes, and the fixed time of a schedule() that only admits loads
HOST_PER_BLOCK_S = 1.55e-6
HOST_PER_LOADED_BLOCK_S = 0.8e-6
HOST_NO_FORWARD_STEP_S = 0.22e-3
#: The host's time per decoder layer to launch a forward pass's kernels one by one, vLLM with
#: enforce_eager (docs/costs.md, "Eager launches"): vLLM 0.29.0 running a Qwen2.5-7B decoder (28 layers,
#: an A800) eager at 22-23 ms per output token against 13 ms with CUDA graphs, the step's 1.4 ms of host
#: time taken off: (22.5 - 1.4) / 28 = 0.75 ms per layer (vllm-project/vllm-omni issue 7960)
HOST_EAGER_LAYER_S = 0.75e-3
#: vLLM's OpenAI server tokenizing a text prompt, per prompt token (costs.tokenize; docs/costs.md,
#: "Tokenizing text prompts"): "a few hundred milliseconds" for 256K tokens (vllm-project/vllm PR
#: 10635), and a Hugging Face fast tokenizer encodes 4.2 MB/s on one thread (huggingface/tokenizers
#: PR 1584), about 1 us per token at about 4 bytes per token. An assumption within a factor of two.
HOST_TOKENIZE_TOKEN_S = 1.0e-6

#: A GH200's NVLink-C2C host link (docs/costs.md): copy-engine memcpy measured 346 GB/s host->device
#: (nvbandwidth), device->host about 15 % slower and measured 297 GB/s in a study; each way keeps about
#: half its rate while the other copies (the copy engines' bidirectional test)
GH200_C2C_H2D_BYTES_PER_S = 346 * _GB
GH200_C2C_D2H_BYTES_PER_S = 297 * _GB
GH200_C2C_DUPLEX_FACTOR = 0.5

_PCIE_SOURCES = (
    "https://www.nvidia.com/en-us/data-center/h100/: PCIe Gen5 128 GB/s (both directions, i.e. 64 GB/s each)",
    "https://github.com/NVIDIA/nvbandwidth/issues/6: H100 host->device measured 56.7-57.1 GB/s (3 of 4 GPUs)",
    "https://github.com/NVIDIA/nvbandwidth/issues/24: H100 device_to_host_memcpy_sm measured 52.8 GB/s",
    "assumption: 55 GB/s effective each way, 10 us per-job latency (see docs/costs.md)",
    "https://github.com/ROCm/clr/issues/273: batched host<->device copies of 4 and 16 KiB at 1.7 and "
    "6.7 GB/s on a PCIe Gen5 x16 link (2.4 us per copy); assumption: the same per-piece cost on H100/H200",
    "https://github.com/vllm-project/vllm-project.github.io/blob/main/_posts/"
    "2025-12-29-offloading-connector.md: DMA copies of 2 MB blocks on an H100, about 50 GB/s one "
    "way, 83.4 GB/s both ways at once (equal amounts): a job keeps 0.834 of its rate while the "
    "other direction copies",
)
_HOST_SOURCES = (
    "docs/costs.md sanity check: NIM Llama-3.1-8B batch-1 ITL 4.37 ms vs the 3.0 ms HBM floor at 8-bit "
    "weights: about 1.4 ms of host and launch time per step (inference, not a measurement)",
    "benchmarks/vllm_scheduler_overhead.py: vLLM 0.33.0's Scheduler on CPU (schedule + "
    "update_from_output), all-decode, 15.1 us per running request (fit over 8-256; a shared 2-CPU VM)",
    "https://github.com/openfabric-systems/simllm/pull/204: vLLM 0.27.1 scheduler, all-decode, "
    "12.7 us per running request at the cap",
    "benchmarks/vllm_block_hash_cost.py: vLLM 0.30.0 and 0.33.0 building a Request with the sha256 "
    "block hasher, 1.38-1.54 us per 8- or 16-token block for 1k-128k-token prompts (a 2-CPU VM)",
    "benchmarks/vllm_load_overhead.py: vLLM 0.30.0's Scheduler and OffloadingConnector on CPU, "
    "Llama-3.1-8B 16-token blocks, 64-6,400 blocks: schedule() 1.55 us per prompt block (admitting a "
    "load or a cold prefill chunk) plus 0.22 ms when it only admits a load, update_from_output() "
    "0.8 us per loaded block (a 2-CPU VM; 0.33.0 about 1.8x these)",
    "https://github.com/vllm-project/vllm-omni/issues/7960: vLLM 0.29.0, Qwen2.5-Omni-7B's thinker "
    "(a Qwen2.5-7B decoder, 28 layers) on an A800, TPOT 22-23 ms with enforce_eager, 13 ms with CUDA "
    "graphs: 0.75 ms per layer of eager launches",
    "https://github.com/deepspeedai/DeepSpeed/pull/8352: vLLM on an H200, GPT-2 (12 layers) at batch 1, "
    "207.7 tok/s eager against 766.6 with CUDA graphs: about 0.3 ms per layer (a lighter layer); "
    "assumption: 0.75 ms per layer on every host",
    "https://github.com/vllm-project/vllm/pull/10635: vLLM's OpenAI server tokenizing a 256K-token "
    "prompt takes a few hundred milliseconds; https://github.com/huggingface/tokenizers/pull/1584: a "
    "fast tokenizer encodes 4.2 MB/s on one thread: assumption 1 us per prompt token",
)


_MATMUL_SOURCE = (
    "https://github.com/microsoft/vidur/blob/e26eb8f79fa9a6a7c38eac0f5291302402b20364/data/profiling/"
    "compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv: median operator times of a Llama-2-7B layer on an "
    "H100; matmul FLOPs over the time of every operator outside attention: 0.49 / 0.59 / 0.63 / 0.63 "
    "of 989 TFLOPS around 516 / 1,032 / 1,928 / 4,016 tokens (benchmarks/matmul_efficiency.py)"
)


#: the engine's host time on every GPU profile (the same host CPU assumed)
_HOST = HostOverhead(HOST_STEP_S, HOST_PER_REQUEST_S, HOST_PER_HASHED_BLOCK_S, HOST_PER_BLOCK_S,
                     HOST_PER_LOADED_BLOCK_S, HOST_NO_FORWARD_STEP_S, HOST_EAGER_LAYER_S,
                     HOST_TOKENIZE_TOKEN_S)


def _pcie5_x16(duplex: float) -> TransferModel:
    return TransferModel(PCIE5_X16_EFFECTIVE_BYTES_PER_S, PCIE_JOB_LATENCY_S, PCIE_PIECE_OVERHEAD_S, duplex)


def _pcie4_x16(duplex: float) -> TransferModel:
    return TransferModel(PCIE4_X16_EFFECTIVE_BYTES_PER_S, PCIE_JOB_LATENCY_S, PCIE_PIECE_OVERHEAD_S, duplex)


_PCIE4_SOURCES = (
    "https://github.com/NVIDIA/nvbandwidth/issues/42: A100-SXM4-40GB host_to_device_memcpy_sm 25.13 GB/s "
    "(512 MiB and 1 GiB buffers)",
    "https://github.com/NVIDIA/nvbandwidth/issues/11 and /issues/53: A100 hosts on PCIe 4.0, 25-26 GB/s "
    "each way alone; with both directions copying, host->device 12-13 GB/s and device->host 24 GB/s "
    "(duplex factors 0.47 and 0.95)",
    "https://github.com/NVIDIA/nvbandwidth/issues/15: RTX 4090 (PCIe 4.0) host_to_device_memcpy_ce "
    "23.9-26.4 GB/s, device_to_host 26.3-27.1 GB/s, bidirectional host->device 11.2-16 GB/s",
    "assumption: 25 GB/s effective each way on every PCIe Gen4 x16 host; per-job latency and per-copy "
    "cost as on PCIe Gen5 (see docs/costs.md)",
)


#: GPU profiles by name.
GPU_PROFILES: dict[str, GpuProfile] = {
    "h100": GpuProfile(
        name="h100",
        hbm_bytes=80 * _GB,
        hbm_bandwidth_bytes_per_s=3.35e12,
        dense_bf16_flops=989e12,
        h2d=_pcie5_x16(PCIE_H2D_DUPLEX_FACTOR),
        d2h=_pcie5_x16(PCIE_D2H_DUPLEX_FACTOR),
        host=_HOST,
        matmul_efficiency=HOPPER_MATMUL_EFFICIENCY,
        sources=(
            f"{_H100_DATASHEET}: H100 SXM 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity (989 dense)",
            _MATMUL_SOURCE,
            f"{_H100_PAGE}: same table",
            "https://glennklockwood.com/garden/processors/h100: H100 SXM5 BF16 matrix 989.4 TFLOPS dense, "
            "80 GB HBM3, 3.35 TB/s",
            *_PCIE_SOURCES,
            *_HOST_SOURCES,
        ),
    ),
    "h200": GpuProfile(
        name="h200",
        hbm_bytes=141 * _GB,
        hbm_bandwidth_bytes_per_s=4.8e12,
        dense_bf16_flops=989e12,
        h2d=_pcie5_x16(PCIE_H2D_DUPLEX_FACTOR),
        d2h=_pcie5_x16(PCIE_D2H_DUPLEX_FACTOR),
        host=_HOST,
        matmul_efficiency=HOPPER_MATMUL_EFFICIENCY,
        sources=(
            f"{_H200_PAGE}: H200 SXM 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity (989 dense)",
            _MATMUL_SOURCE + " (the H200 has the H100's tensor cores and clocks)",
            "https://aiwiki.ai/wiki/nvidia_h200: 141 GB HBM3e at 4.8 TB/s, same GH100 compute as H100",
            "https://raw.githubusercontent.com/mlcommons/inference_results_v4.1/main/closed/NVIDIA/systems/"
            "H200-SXM-141GBx8_TRT_MaxQ.json: host interconnect PCIe Gen5 x16",
            *_PCIE_SOURCES,
            *_HOST_SOURCES,
        ),
    ),
    "b200": GpuProfile(
        name="b200",
        hbm_bytes=180 * _GB,
        hbm_bandwidth_bytes_per_s=7.67e12,
        dense_bf16_flops=2250e12,
        h2d=_pcie5_x16(PCIE_H2D_DUPLEX_FACTOR),
        d2h=_pcie5_x16(PCIE_D2H_DUPLEX_FACTOR),
        host=_HOST,
        matmul_efficiency=BLACKWELL_MATMUL_EFFICIENCY,
        sources=(
            "https://github.com/stas00/ml-engineering/blob/18fa0175ec4671522b218b38c162fd3b1c748bb0/"
            "insights/when-to-upgrade-gpus/README.md: B200 SXM BF16 2,250 TFLOPS dense (theoretical), "
            "about 180 GiB HBM3e at 8.0 TB/s; maximum achievable matmul BF16 1,745 TFLOPS (77.6 %) "
            "against 794.5 (80.3 %) on H100/H200",
            "https://github.com/pytorch/ao/pull/4002: the driver reports a 7,680-bit memory bus at "
            "3,996 MHz on a B200 (7.67 TB/s, not the quoted 8 TB/s) and 178.35 GB of global memory",
            "https://raw.githubusercontent.com/mlcommons/inference_results_v6.0/main/closed/Nebius/systems/"
            "nebius_b200_n1.json: NVIDIA B200-SXM-180GB, host interconnect PCIe Gen5 x16, 8 per node, "
            "1.8 TB host memory",
            "assumption: matmuls at the H100's measured curve times 0.776 / 0.803, attention at the "
            "H100's 0.62 (no measurement of vLLM's attention kernels on this GPU found), the H100's "
            "host link figures (no B200 copy measurement found)",
            *_PCIE_SOURCES,
            *_HOST_SOURCES,
        ),
    ),
    "gh200": GpuProfile(
        name="gh200",
        hbm_bytes=96 * _GB,
        hbm_bandwidth_bytes_per_s=4.0e12,
        dense_bf16_flops=989e12,
        h2d=TransferModel(GH200_C2C_H2D_BYTES_PER_S, PCIE_JOB_LATENCY_S, PCIE_PIECE_OVERHEAD_S,
                          GH200_C2C_DUPLEX_FACTOR),
        d2h=TransferModel(GH200_C2C_D2H_BYTES_PER_S, PCIE_JOB_LATENCY_S, PCIE_PIECE_OVERHEAD_S,
                          GH200_C2C_DUPLEX_FACTOR),
        host=_HOST,
        matmul_efficiency=HOPPER_MATMUL_EFFICIENCY,
        sources=(
            "https://datacrunch.io/blog/data-movement-in-the-nvidia-gh200-grace-hopper-superchip: NVIDIA's "
            "Grace Hopper architecture figures, up to 96 GB HBM3 at 4,000 GB/s, 480 GB LPDDR5X, NVLink-C2C "
            "900 GB/s in all (450 GB/s each way)",
            "https://www.emergentmind.com/topics/gh200-technology: the GH200's Hopper GPU has 132 SMs, the "
            "H100 SXM's GH100 configuration: its dense BF16 peak (989 TFLOPS) and matmul curve are the "
            "H100's (assumption for the curve)",
            "https://github.com/NVIDIA/nvbandwidth/issues/23: GH200 (480 GB LPDDR5X + 96 GB HBM3) "
            "host->device copy-engine memcpy 346 GB/s, about 15 % faster than device->host",
            "https://4nownews.com/2024/07/27/not-so-simple-and-not-so-fast-scientists-studied-the-features-"
            "of-memory-and-nvlink-c2c-in-nvidia-grace-hopper (HPCwire's report of a KTH study): NVLink-C2C "
            "measured 375 GB/s host->device and 297 GB/s device->host on a 96 GB GH200",
            "https://github.com/NVIDIA/nvbandwidth/issues/41: on a GH200 the copy engines' bidirectional "
            "test reaches about half of the one-way peak: each way keeps 0.5 of its rate (assumption)",
            "assumption: the PCIe hosts' 10 us per job and 2.5 us per copy (no C2C measurement found)",
            *_HOST_SOURCES,
        ),
    ),
    "h20": GpuProfile(
        name="h20",
        hbm_bytes=96 * _GB,
        hbm_bandwidth_bytes_per_s=4.0e12,
        dense_bf16_flops=148e12,
        h2d=_pcie5_x16(PCIE_H2D_DUPLEX_FACTOR),
        d2h=_pcie5_x16(PCIE_D2H_DUPLEX_FACTOR),
        host=_HOST,
        sources=(
            "https://willitrunai.com/es/gpus/h20-96gb: H20 96 GB HBM3, 4.0 TB/s, 148 TFLOPS FP16 (dense; "
            "NVIDIA publishes no datasheet for this export part, so third-party figures)",
            "https://zangshuxian.com/new/674733024499207168: H20 FP16 dense 148 TFLOPS, 4.0 TB/s",
            "https://gitea.gahow.org/gahow/agentic-kvc/src/commit/837df6bc9e05f5a5b4af27a36356efdd4cff2ecd/"
            "v2/exp_a_tier_latency/results/pcie.json: pinned H2D copies of 0.1-6.4 GB measured "
            "53.7-54.9 GB/s on an H20 host (the 55 GB/s PCIe Gen5 x16 figure)",
            "https://github.com/Dao-AILab/flash-attention/issues/1310: FlashAttention-3 forward on an H20, "
            "BF16, head dim 128, 2 x 2,048 tokens: 126.2 TFLOPS without and 107.8 TFLOPS with the causal "
            "mask (0.85 and 0.73 of 148); 0.85 taken: a chunked prefill's pairs are mostly unmasked",
            "https://github.com/ByteDance-Seed/Triton-distributed/issues/48: 8 H20s, a GEMM of 8,192 x "
            "8,192 x 29,568 (K split 8 ways) and its reduce-scatter in 4.01 ms (Torch + NCCL): the GEMM "
            ">= 124 TFLOP/s, 0.84 of 148; assumption: flat over step sizes",
            *_PCIE_SOURCES,
            *_HOST_SOURCES,
        ),
        attention_efficiency=0.85,
        matmul_efficiency=H20_MATMUL_EFFICIENCY,
    ),
    "a100": GpuProfile(
        name="a100",
        hbm_bytes=80 * _GB,
        hbm_bandwidth_bytes_per_s=2.039e12,
        dense_bf16_flops=312e12,
        h2d=_pcie4_x16(PCIE4_H2D_DUPLEX_FACTOR),
        d2h=_pcie4_x16(PCIE4_D2H_DUPLEX_FACTOR),
        host=_HOST,
        matmul_efficiency=AMPERE_MATMUL_EFFICIENCY,
        sources=(
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (as tabled at "
            "https://glennklockwood.com/garden/processors/A100 and "
            "https://www.thundercompute.com/blog/nvidia-a100-specs-full-guide): A100 SXM 80 GB HBM2e, "
            "2,039 GB/s, BF16 tensor 312 TFLOPS dense (624 with sparsity), PCIe Gen4 x16",
            "https://github.com/microsoft/vidur/blob/bee57dafa1eb2dc422dcaec46a66975599a6a242/data/profiling/"
            "compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv: median operator times of a Llama-2-7B layer on "
            "an A100; matmul FLOPs over the time of every operator outside attention: 0.622 / 0.615 / "
            "0.632 / 0.643 of 312 TFLOPS around 516 / 1,032 / 1,928 / 4,016 tokens "
            "(benchmarks/matmul_efficiency.py)",
            "arXiv:2307.08691 (FlashAttention-2, which vLLM runs on Ampere): 50-73 % of the A100's peak; "
            "the top of the range taken, as for the H100 and H20 (long chunked prefills)",
            *_PCIE4_SOURCES,
            *_HOST_SOURCES,
        ),
        attention_efficiency=0.73,
    ),
    "l40s": GpuProfile(
        name="l40s",
        hbm_bytes=48 * _GB,
        hbm_bandwidth_bytes_per_s=864e9,
        dense_bf16_flops=362.05e12,
        h2d=_pcie4_x16(PCIE4_H2D_DUPLEX_FACTOR),
        d2h=_pcie4_x16(PCIE4_D2H_DUPLEX_FACTOR),
        host=_HOST,
        sources=(
            "https://www.mullet.se/product.html?product_id=355414: NVIDIA's L40 / L40S datasheet table, "
            "L40S 48 GB GDDR6, 864 GB/s, BF16 tensor 362.05 TFLOPS dense (733 with sparsity), PCIe Gen4 x16",
            "https://www.itcreations.com/nvidia-gpu/nvidia-l40s-gpu-accelerator: 48 GB GDDR6, 864 GB/s, "
            "PCIe Gen4 x16 64 GB/s bidirectional",
            "assumption: matmuls at 0.5 of peak (no measured curve for this GPU) and attention at the "
            "H100's 0.62 (vLLM runs FlashAttention-2 on Ada; no measurement found)",
            *_PCIE4_SOURCES,
            *_HOST_SOURCES,
        ),
    ),
}


def gpu_profile(name: str, *, hbm_bytes: int, dense_bf16_flops: float | None = None,
                hbm_bandwidth_bytes_per_s: float | None = None, attention_efficiency: float | None = None,
                source: str = "") -> GpuProfile:
    """The GPU profile of a ``hardware/1`` file: a shipped one, or one given by its own figures.

    Args:
        name: the file's ``gpu``: a key of :data:`GPU_PROFILES`, or a GPU not shipped.
        hbm_bytes: the file's HBM capacity (kept only for a GPU not shipped).
        dense_bf16_flops: dense BF16 tensor FLOP/s; replaces the shipped figure
            (the matmul curve, a fraction of peak, then applies to the new peak).
        hbm_bandwidth_bytes_per_s: peak HBM bandwidth; replaces the shipped figure.
        attention_efficiency: fraction of the peak attention reaches; replaces the shipped figure.
        source: where the figures come from (the file), recorded in ``sources``.

    A GPU not shipped needs ``dense_bf16_flops`` and ``hbm_bandwidth_bytes_per_s``;
    its matmuls run at :data:`DEFAULT_MFU` and its attention at
    :data:`DEFAULT_ATTENTION_EFFICIENCY` unless the file says otherwise, and its
    per-copy cost, duplex factor and host time are the shipped profiles' (the file
    can override each), all *assumptions* for that GPU.

    Raises:
        KeyError: a GPU not shipped without both figures.
    """
    given = f"{source}: given in the hardware file" if source else "given in the hardware file"
    base = GPU_PROFILES.get(name)
    if base is None:
        if dense_bf16_flops is None or hbm_bandwidth_bytes_per_s is None:
            raise KeyError(name)
        return GpuProfile(
            name=name, hbm_bytes=hbm_bytes, hbm_bandwidth_bytes_per_s=float(hbm_bandwidth_bytes_per_s),
            dense_bf16_flops=float(dense_bf16_flops), h2d=_pcie5_x16(PCIE_H2D_DUPLEX_FACTOR),
            d2h=_pcie5_x16(PCIE_D2H_DUPLEX_FACTOR), host=_HOST, attention_efficiency=attention_efficiency,
            sources=(f"{given}: peak, HBM bandwidth" + (", attention efficiency" if attention_efficiency
                                                       is not None else ""),
                     *_PCIE_SOURCES, *_HOST_SOURCES))
    return with_figures(base, dense_bf16_flops=dense_bf16_flops,
                        hbm_bandwidth_bytes_per_s=hbm_bandwidth_bytes_per_s,
                        attention_efficiency=attention_efficiency, source=given)


def with_figures(base: GpuProfile, *, dense_bf16_flops: float | None = None,
                 hbm_bandwidth_bytes_per_s: float | None = None, attention_efficiency: float | None = None,
                 source: str = "") -> GpuProfile:
    """``base`` with the figures given (None: kept) replaced, and ``source`` (where they
    come from) recorded first in its ``sources``; ``base`` itself when none is given.
    Its measured matmul curve, a fraction of peak, then applies to the new peak."""
    changed = [k for k, v in (("dense_bf16_flops", dense_bf16_flops),
                              ("hbm_bandwidth_bytes_per_s", hbm_bandwidth_bytes_per_s),
                              ("attention_efficiency", attention_efficiency)) if v is not None]
    if not changed:
        return base
    return dataclasses.replace(
        base, sources=(f"{source or 'given'}: {', '.join(changed)}", *base.sources),
        dense_bf16_flops=base.dense_bf16_flops if dense_bf16_flops is None else float(dense_bf16_flops),
        hbm_bandwidth_bytes_per_s=(base.hbm_bandwidth_bytes_per_s if hbm_bandwidth_bytes_per_s is None
                                   else float(hbm_bandwidth_bytes_per_s)),
        attention_efficiency=(base.attention_efficiency if attention_efficiency is None
                              else attention_efficiency))


# -- model shapes and the roofline step model -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The shapes of a model that its step cost needs, besides its KV cache groups
    (a ``model/1`` file's ``[shape]`` table; every number from the model's ``config.json``).

    The parameter count is derived from the shapes and the model's KV cache
    groups (:meth:`param_counts`) unless ``params`` and ``active_params`` are
    given (architectures the derivation does not cover: mamba or MLA groups,
    biases, sinks).

    Attributes:
        name: the model's name.
        hidden_size: ``hidden_size``.
        vocab_size: ``vocab_size``.
        query_heads: ``num_attention_heads`` of every attention layer.
        intermediate_size: the gated MLP's ``intermediate_size`` (0: every layer is MoE).
        tied_embeddings: the LM head is the input embedding (``tie_word_embeddings``).
        experts: routed experts per MoE layer (0: dense).
        experts_per_token: experts activated per token.
        expert_intermediate_size: one expert's intermediate size.
        shared_expert_intermediate_size: the shared expert's (0: none).
        mamba_state_elements: recurrent-state elements of one mamba layer, whole model.
        params: total parameters, when given instead of derived.
        active_params: parameters a token passes through (embedding tables included).
        weight_bytes: bytes of the weights, when not ``weight_dtype_bytes x params``.
        weight_dtype_bytes: bytes per parameter (2: bf16).
        expert_weight_bytes: bytes of the routed experts (every expert of every layer), when
            not ``weight_dtype_bytes x`` :meth:`routed_expert_params` (experts stored in
            another format than the rest, e.g. MXFP4); part of the weights.
    """

    name: str
    hidden_size: int
    vocab_size: int
    query_heads: int
    intermediate_size: int = 0
    tied_embeddings: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    mamba_state_elements: int = 0
    params: int | None = None
    active_params: int | None = None
    weight_bytes: int | None = None
    weight_dtype_bytes: int = 2
    expert_weight_bytes: int | None = None

    def __post_init__(self) -> None:
        o = f"ModelShape({self.name!r})"
        for name in ("hidden_size", "vocab_size", "query_heads", "weight_dtype_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{o}.{name} must be a positive int, got {v!r}")
        if (self.params is None) != (self.active_params is None):
            raise ValueError(f"{o}: give both params and active_params, or neither")
        if self.params is not None and self.active_params is not None and not (
                0 < self.active_params <= self.params):
            raise ValueError(f"{o}: need 0 < active_params <= params")
        moe_ok = 0 < self.experts_per_token <= self.experts and self.expert_intermediate_size > 0
        if self.experts and not moe_ok:
            raise ValueError(f"{o}: experts need 1 <= experts_per_token <= experts and an "
                             "expert_intermediate_size")
        if not self.experts and self.params is None and self.intermediate_size <= 0:
            raise ValueError(f"{o}: a dense model needs intermediate_size (or params and active_params)")
        if self.expert_weight_bytes is not None:
            if not self.experts or self.expert_weight_bytes <= 0:
                raise ValueError(f"{o}: expert_weight_bytes needs experts and a positive size")
            if self.weight_bytes is not None and self.expert_weight_bytes > self.weight_bytes:
                raise ValueError(f"{o}: expert_weight_bytes exceeds weight_bytes")

    @property
    def embedding_params(self) -> int:
        """Parameters of one embedding table (``vocab_size x hidden_size``)."""
        return self.vocab_size * self.hidden_size

    def param_counts(self, groups: Sequence[GroupSpec]) -> tuple[int, int]:
        """(total, active) parameters: the given ones, or derived from the shapes.

        Derivation, per decoder layer (one per layer of ``groups``, whose shapes
        give KV heads and head size before tensor parallelism): attention
        projections ``hidden x head_size x (2 query_heads + 2 kv_heads)``; a
        dense gated MLP ``3 x hidden x intermediate``; or MoE ``experts x 3 x
        hidden x expert_intermediate`` (active: ``experts_per_token`` of them),
        the router ``hidden x experts`` and a shared expert ``3 x hidden x
        shared_intermediate``; plus one embedding table, two when untied.
        Norms and biases are left out (under 0.01 % for the shipped models).

        Raises:
            ValueError: the derivation does not cover the groups (mamba, MLA, no shape).
        """
        if self.params is not None and self.active_params is not None:
            return self.params, self.active_params
        h = self.hidden_size
        attn = 0
        layers = 0
        for g in groups:
            s = g.shape
            if s is None or s.mla or g.kind is GroupKind.MAMBA:
                raise ValueError(f"model {self.name!r}: the parameter count of {g.kind} groups "
                                 "without a plain attention shape is not derived; give params and "
                                 "active_params")
            attn += s.layers * h * s.head_size * (2 * self.query_heads + 2 * s.kv_heads)
            layers += s.layers
        if self.experts:
            expert = 3 * h * self.expert_intermediate_size
            common = h * self.experts + 3 * h * self.shared_expert_intermediate_size
            mlp, mlp_active = self.experts * expert + common, self.experts_per_token * expert + common
        else:
            mlp = mlp_active = 3 * h * self.intermediate_size
        emb = self.embedding_params * (1 if self.tied_embeddings else 2)
        return attn + layers * mlp + emb, attn + layers * mlp_active + emb

    def total_weight_bytes(self, groups: Sequence[GroupSpec]) -> int:
        """``weight_bytes``, else ``weight_dtype_bytes x`` the total parameters."""
        if self.weight_bytes is not None:
            return self.weight_bytes
        return self.weight_dtype_bytes * self.param_counts(groups)[0]

    def routed_expert_params(self, groups: Sequence[GroupSpec]) -> int:
        """Parameters of the routed experts, all of them in every layer: the parameters
        a token does not pass through are ``experts - experts_per_token`` of them, so
        ``(total - active) x experts / (experts - experts_per_token)`` (the shared
        expert and everything else is in both counts). 0 for a dense model, or when
        every expert is active."""
        e, k = self.experts, self.experts_per_token
        if not e or k >= e:
            return 0
        total, active = self.param_counts(groups)
        return (total - active) * e // (e - k)

    def routed_expert_bytes(self, groups: Sequence[GroupSpec]) -> int:
        """Bytes of the routed experts: ``expert_weight_bytes``; else
        ``weight_dtype_bytes x`` :meth:`routed_expert_params` when the weights are
        counted that way too; else (``weight_bytes`` given alone) their share of the
        weight bytes in proportion to parameters (an assumption: same format)."""
        if self.expert_weight_bytes is not None:
            return self.expert_weight_bytes
        params = self.routed_expert_params(groups)
        if self.weight_bytes is None:
            return self.weight_dtype_bytes * params
        return self.weight_bytes * params // self.param_counts(groups)[0]


def group_span(spec: GroupSpec) -> int:
    """The span of :func:`attention_pairs` and :func:`attended_tokens`: the window,
    the attention chunk, one state block (mamba), 0 for full attention."""
    if spec.kind is GroupKind.SLIDING_WINDOW:
        assert spec.window is not None
        return spec.window
    if spec.kind is GroupKind.CHUNKED_LOCAL:
        assert spec.attention_chunk is not None
        return spec.attention_chunk
    if spec.kind is GroupKind.MAMBA:
        return spec.tokens_per_block
    return 0


def decoder_layers(groups: Sequence[GroupSpec]) -> int:
    """The model's decoder layers, every group's (each layer belongs to one group): the
    layers an eager forward pass launches one by one (:attr:`RooflineStepModel.launch_s`)."""
    return sum(g.shape.layers if g.shape is not None else 1 for g in groups)


def roofline_step_model(
    gpu: GpuProfile,
    shape: ModelShape,
    groups: Sequence[GroupSpec],
    *,
    param_groups: Sequence[GroupSpec] | None = None,
    tensor_parallel: int = 1,
    mfu: float | None = None,
    mbu: float = DEFAULT_MBU,
    host: HostOverhead | None = None,
    attention_efficiency: float | None = None,
    enforce_eager: bool = False,
) -> RooflineStepModel:
    """The roofline step model of one worker of ``tensor_parallel`` GPUs.

    Args:
        gpu: the GPU's figures.
        shape: the model's shapes.
        groups: the run's KV cache groups, in layout order (their layers and
            head sizes give the attention FLOPs per pair).
        param_groups: the groups the shape's parameter count refers to (default
            ``groups``; another model's when its shape is borrowed), before
            tensor parallelism.
        tensor_parallel: GPUs sharing the model (FLOPs, weights and KV split evenly).
        mfu: fraction of dense BF16 peak the matmuls (and mamba updates) reach, in (0, 1],
            for every step; default (None): the GPU profile's measured curve by tokens per
            step (:attr:`GpuProfile.matmul_efficiency`; mamba updates at its last point), else
            :data:`DEFAULT_MFU`.
        mbu: fraction of peak HBM bandwidth the weight and KV reads reach, in (0, 1].
        host: the engine's own time (default: the GPU profile's).
        attention_efficiency: fraction of dense BF16 peak the attention kernels reach on
            the pairs of attention groups, in (0, 1] (mamba groups: ``mfu``); default:
            the GPU profile's measured figure, else :data:`DEFAULT_ATTENTION_EFFICIENCY`.
        enforce_eager: vLLM's ``enforce_eager``: no CUDA graph replays a forward pass, which
            then takes at least the model's decoder layers (those of ``param_groups``, on
            every worker) times the host's ``eager_layer_s`` (:attr:`RooflineStepModel.launch_s`).

    Raises:
        ValueError: bad ``tensor_parallel``, ``mfu``, ``mbu`` or ``attention_efficiency``; a parameter count
            that cannot be derived; a mamba group without ``mamba_state_elements``.
    """
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
    curve: tuple[tuple[int, float], ...] = ()
    if mfu is None:
        curve = gpu.matmul_efficiency
        mfu = gpu.large_step_mfu
    mfu = _fraction("roofline_step_model", "mfu", mfu)
    mbu = _fraction("roofline_step_model", "mbu", mbu)
    if attention_efficiency is None:
        attention_efficiency = (DEFAULT_ATTENTION_EFFICIENCY if gpu.attention_efficiency is None
                                else gpu.attention_efficiency)
    attention_efficiency = _fraction("roofline_step_model", "attention_efficiency", attention_efficiency)
    pgroups = groups if param_groups is None else param_groups
    _, active = shape.param_counts(pgroups)
    tp = tensor_parallel
    emb = shape.embedding_params
    body = active - emb * (1 if shape.tied_embeddings else 2)
    pair_flops: list[float] = []
    pair_rates: list[float] = []
    for g in groups:
        layers = g.shape.layers if g.shape is not None else 1
        if g.kind is GroupKind.MAMBA:
            if shape.mamba_state_elements <= 0:
                raise ValueError(f"model {shape.name!r} has mamba groups: its shape needs "
                                 "mamba_state_elements")
            f = MAMBA_FLOPS_PER_STATE_ELEMENT * shape.mamba_state_elements * layers
            pair_rates.append(gpu.dense_bf16_flops * mfu)
        else:
            head = g.shape.head_size if g.shape is not None else 1
            f = 4 * shape.query_heads * head * layers
            pair_rates.append(gpu.dense_bf16_flops * attention_efficiency)
        pair_flops.append(f / tp)
    expert_bytes = shape.routed_expert_bytes(pgroups)
    host = gpu.host if host is None else host
    launch = decoder_layers(pgroups) * host.eager_layer_s if enforce_eager else 0.0
    return RooflineStepModel(
        token_flops=2.0 * max(body, 0) / tp,
        sample_flops=2.0 * emb / tp,
        pair_flops=tuple(pair_flops),
        weight_bytes=shape.total_weight_bytes(pgroups) / tp,
        flops_per_s=gpu.dense_bf16_flops * mfu,
        bytes_per_s=gpu.hbm_bandwidth_bytes_per_s * mbu,
        host=host,
        pair_flops_per_s=tuple(pair_rates),
        expert_bytes=expert_bytes / tp,
        expert_idle=1.0 - shape.experts_per_token / shape.experts if expert_bytes else 0.0,
        token_rate_curve=tuple((t, gpu.dense_bf16_flops * e) for t, e in curve),
        launch_s=launch,
    )


def kv_terms(layout: Layout) -> list[tuple[GroupKind, int, int]]:
    """Per group of ``layout``: (kind, :func:`group_span`, KV bytes per token on one worker);
    without byte figures for every group, every group weighs 1 byte per token."""
    sized = all(layout.kv_bytes_per_block(g) for g in range(len(layout.groups)))
    terms = []
    for g, spec in enumerate(layout.groups):
        bpt = max(1, (layout.kv_bytes_per_block(g) or 0) // spec.tokens_per_block) if sized else 1
        terms.append((spec.kind, group_span(spec), bpt))
    return terms


def prompt_blocks(tokens_per_block: int, p: int, c: int) -> int:
    """Blocks of ``tokens_per_block`` tokens that ``c`` prompt tokens after ``p`` begin
    (the blocks the scheduler allocates for them: :attr:`StepLoad.blocks`, per group)."""
    return cdiv(p + c, tokens_per_block) - cdiv(p, tokens_per_block)


def chunked_prefill_time(model: StepTimeModel, layout: Layout, prompt_tokens: int,
                         max_num_batched_tokens: int) -> float:
    """Seconds of the chunked prefill of one request alone: steps of at most
    ``max_num_batched_tokens`` new tokens, each with the pairs and the KV reads
    the scheduler reports for it (``layout``: per worker).

    Raises:
        ValueError: a non-positive prompt or budget.
    """
    if prompt_tokens < 1 or max_num_batched_tokens < 1:
        raise ValueError("prompt_tokens and max_num_batched_tokens must be >= 1")
    terms = kv_terms(layout)
    total_bpt = sum(b for _, _, b in terms)
    t = 0.0
    p = 0
    while p < prompt_tokens:
        c = min(max_num_batched_tokens, prompt_tokens - p)
        kv = sum(attended_tokens(k, s, p + c) * b for k, s, b in terms)
        load = StepLoad(prefill_tokens=c, requests=1, kv_read_bytes=kv, context_tokens=kv / total_bpt,
                        pairs=tuple(attention_pairs(k, s, p, c) for k, s, _ in terms),
                        blocks=sum(prompt_blocks(g.tokens_per_block, p, c) for g in layout.groups))
        t += model.time(load)
        p += c
    return t
