"""Step-time model of an engine step and transfer-time model of the GPU<->CPU link.

What it models
    *Engine step.* One vLLM engine step runs one forward pass over a batch
    that mixes prefill chunks and decoding sequences. Its duration is a
    linear function of three counts taken from the scheduler output::

        step_time = overhead_s
                  + prefill_token_s * prefill_tokens
                  + decode_seq_s    * decode_seqs
                  + context_token_s * context_tokens

    ``overhead_s`` is paid once per step whatever the batch (for a decode
    step it is dominated by streaming every weight out of HBM once),
    ``prefill_token_s`` is paid per prompt token computed in the step,
    ``decode_seq_s`` per sequence that decodes one token, and
    ``context_token_s`` per token of KV the step's attention reads (summed
    over the scheduled requests).

    *Link.* One direction of the host link (H2D loads, D2H stores) costs a
    fixed latency per transfer job plus bytes over an effective bandwidth.

    *Published figures.* :data:`GPU_PROFILES` holds datasheet figures of the
    H100 SXM and H200 SXM and a measured-style effective PCIe Gen5 x16
    bandwidth; :data:`MODEL_COST_PROFILES` holds parameter counts and KV
    sizes of public models (BF16 unless noted). :func:`step_model_for`
    turns a (GPU, model) pair into a :class:`StepCostModel` with a
    roofline-style derivation. Every figure, its source and the derivation
    are in ``docs/costs.md``.

Simplifications
    * The step time is a *sum* of a memory term and compute terms, not the
      roofline's ``max``: near the ridge point it overestimates by up to 2x.
    * Memory-bandwidth and compute efficiencies (``mbu``, ``mfu``) are single
      constants, independent of batch shape, kernel and sequence length.
    * Attention is charged by KV bytes read only; its quadratic FLOPs in long
      prefills, sampling, scheduling on the host, CUDA-graph padding and the
      tensor-parallel all-reduce are not charged.
    * For a mixture-of-experts model a step is charged the bytes of *all*
      experts (right for serving batches, where nearly every expert is hit;
      pessimistic for a batch of one sequence).
    * A transfer job's cost does not depend on its split into blocks, on
      pinned vs pageable host memory, or on traffic in the other direction.

Invariants (checked at construction, raising :class:`ValueError`)
    * every step coefficient is finite and non-negative;
    * a link bandwidth is positive (``math.inf`` allowed) and its latency is
      finite and non-negative;
    * :meth:`StepCostModel.step_time` evaluates the expression above left to
      right in exactly that order, so two code paths that call it with the
      same counts get bit-identical floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "GPU_PROFILES",
    "MODEL_COST_PROFILES",
    "ZERO_STEP",
    "ZERO_TRANSFER",
    "GpuProfile",
    "ModelCostProfile",
    "StepCostModel",
    "TransferModel",
    "kv_bytes_per_token",
    "step_model_for",
]

_T = TypeVar("_T")

#: Default model-FLOP utilisation of prefill matmuls (assumption, see docs/costs.md).
DEFAULT_MFU = 0.5
#: Default memory-bandwidth utilisation of weight and KV reads (see docs/costs.md).
DEFAULT_MBU = 0.8


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


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Duration of one engine step (forward pass) in seconds.

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
                the model's full KV per token (>= 0; the engine weighs each
                group's attended tokens by its share of the KV bytes, so a
                sliding-window group counts only its window).

        Returns:
            The step duration; ``0.0`` for the all-zero model.
        """
        return (
            self.overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
        )


#: The all-zero step model: every step takes no time.
ZERO_STEP = StepCostModel()


@dataclass(frozen=True, slots=True)
class TransferModel:
    """One direction of the GPU<->CPU link (H2D or D2H).

    Attributes:
        bandwidth_bytes_per_s: effective bandwidth; ``math.inf`` makes only
            the latency count.
        latency_s: fixed latency per transfer job.
    """

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "bandwidth_bytes_per_s",
            _positive("TransferModel", "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, allow_inf=True),
        )
        object.__setattr__(
            self, "latency_s", _finite_non_negative("TransferModel", "latency_s", self.latency_s)
        )

    def time(self, nbytes: int) -> float:
        """Seconds one job of ``nbytes`` takes: latency plus bytes over bandwidth.

        Args:
            nbytes: bytes moved by the job (>= 0).

        Returns:
            ``latency_s + nbytes / bandwidth_bytes_per_s`` (the second term is
            ``0.0`` for infinite bandwidth).

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


#: A free link: infinite bandwidth, no latency.
ZERO_TRANSFER = TransferModel(math.inf, 0.0)


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """Published figures of one GPU and its host link.

    Attributes:
        name: short name (``"h100"``, ``"h200"``).
        hbm_bytes: HBM capacity as on the datasheet (decimal GB).
        hbm_bandwidth_bytes_per_s: peak HBM bandwidth.
        dense_bf16_flops: dense (no sparsity) BF16 tensor-core FLOP/s.
        h2d: host-to-device link (PCIe Gen5 x16, pinned memory, effective).
        d2h: device-to-host link.
        sources: citations, each "URL: what number".
    """

    name: str
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    dense_bf16_flops: float
    h2d: TransferModel
    d2h: TransferModel
    sources: tuple[str, ...]

    def __post_init__(self) -> None:
        owner = f"GpuProfile({self.name!r})"
        if isinstance(self.hbm_bytes, bool) or not isinstance(self.hbm_bytes, int) or self.hbm_bytes <= 0:
            raise ValueError(f"{owner}.hbm_bytes must be a positive int, got {self.hbm_bytes!r}")
        _positive(owner, "hbm_bandwidth_bytes_per_s", self.hbm_bandwidth_bytes_per_s, allow_inf=False)
        _positive(owner, "dense_bf16_flops", self.dense_bf16_flops, allow_inf=False)


@dataclass(frozen=True, slots=True)
class ModelCostProfile:
    """Size figures of one model that drive the step cost.

    Attributes:
        name: short name, e.g. ``"llama-3.1-8b"``.
        active_params: parameters touched per token (for MoE: the activated ones).
        weight_bytes: weight bytes read per step (BF16: 2 x all parameters; the native
            MXFP4/FP4 checkpoint size for gpt-oss-120b and deepseek-v4-style).
        kv_bytes_per_token: KV bytes per token over all layers.
        sources: citations, each "URL: what number".
    """

    name: str
    active_params: float
    weight_bytes: float
    kv_bytes_per_token: int
    sources: tuple[str, ...]

    def __post_init__(self) -> None:
        owner = f"ModelCostProfile({self.name!r})"
        _positive(owner, "active_params", self.active_params, allow_inf=False)
        _positive(owner, "weight_bytes", self.weight_bytes, allow_inf=False)
        kv = self.kv_bytes_per_token
        if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0:
            raise ValueError(f"{owner}.kv_bytes_per_token must be a positive int, got {kv!r}")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """KV bytes of one token over all layers: K and V, each ``kv_heads x head_dim``.

    Same rule as :meth:`sim.model.layout.KVShape.bytes_per_block` for one token
    without MLA.
    """
    return 2 * layers * kv_heads * head_dim * dtype_bytes


# -- published figures ---------------------------------------------------------------------------------

_GB = 10**9
_BF16_BYTES = 2

_H100_DATASHEET = "https://resources.nvidia.com/en-us-gpu-resources/h100-datasheet-24306"
_H100_PAGE = "https://www.nvidia.com/en-us/data-center/h100/"
_H200_PAGE = "https://www.nvidia.com/en-us/data-center/h200/"

#: Effective PCIe Gen5 x16 figure per direction (pinned memory, large copies).
#: Raw link rate is 32 GT/s x 16 lanes x 128/130 / 8 = 63 GB/s per direction;
#: public nvbandwidth runs on H100 systems show 52.8-57 GB/s; 55 GB/s is taken.
PCIE5_X16_EFFECTIVE_BYTES_PER_S = 55 * _GB
#: Per-job latency of a host<->device copy: an assumption (no citable figure found).
PCIE_JOB_LATENCY_S = 10e-6

_PCIE_SOURCES = (
    "https://www.nvidia.com/en-us/data-center/h100/: PCIe Gen5 128 GB/s (both directions, i.e. 64 GB/s each)",
    "https://github.com/NVIDIA/nvbandwidth/issues/6: H100 host->device measured 56.7-57.1 GB/s (3 of 4 GPUs)",
    "https://github.com/NVIDIA/nvbandwidth/issues/24: H100 device_to_host_memcpy_sm measured 52.8 GB/s",
    "assumption: 55 GB/s effective each way, 10 us per-job latency (see docs/costs.md)",
)


def _pcie5_x16() -> TransferModel:
    return TransferModel(PCIE5_X16_EFFECTIVE_BYTES_PER_S, PCIE_JOB_LATENCY_S)


#: GPU profiles by name.
GPU_PROFILES: dict[str, GpuProfile] = {
    "h100": GpuProfile(
        name="h100",
        hbm_bytes=80 * _GB,
        hbm_bandwidth_bytes_per_s=3.35e12,
        dense_bf16_flops=989e12,
        h2d=_pcie5_x16(),
        d2h=_pcie5_x16(),
        sources=(
            f"{_H100_DATASHEET}: H100 SXM 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity (989 dense)",
            f"{_H100_PAGE}: same table",
            "https://glennklockwood.com/garden/processors/h100: H100 SXM5 BF16 matrix 989.4 TFLOPS dense, "
            "80 GB HBM3, 3.35 TB/s",
            *_PCIE_SOURCES,
        ),
    ),
    "h200": GpuProfile(
        name="h200",
        hbm_bytes=141 * _GB,
        hbm_bandwidth_bytes_per_s=4.8e12,
        dense_bf16_flops=989e12,
        h2d=_pcie5_x16(),
        d2h=_pcie5_x16(),
        sources=(
            f"{_H200_PAGE}: H200 SXM 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity (989 dense)",
            "https://aiwiki.ai/wiki/nvidia_h200: 141 GB HBM3e at 4.8 TB/s, same GH100 compute as H100",
            "https://raw.githubusercontent.com/mlcommons/inference_results_v4.1/main/closed/NVIDIA/systems/"
            "H200-SXM-141GBx8_TRT_MaxQ.json: host interconnect PCIe Gen5 x16",
            *_PCIE_SOURCES,
        ),
    ),
}


def _dense_bf16(
    name: str, params: int, layers: int, kv_heads: int, head_dim: int, sources: tuple[str, ...]
) -> ModelCostProfile:
    return ModelCostProfile(
        name=name,
        active_params=float(params),
        weight_bytes=float(params * _BF16_BYTES),
        kv_bytes_per_token=kv_bytes_per_token(layers, kv_heads, head_dim, _BF16_BYTES),
        sources=sources,
    )


#: Model profiles by name (BF16 weights and KV cache unless the entry says otherwise).
MODEL_COST_PROFILES: dict[str, ModelCostProfile] = {
    p.name: p
    for p in (
        _dense_bf16(
            "llama-3.1-8b", 8_030_261_248, layers=32, kv_heads=8, head_dim=128,
            sources=(
                "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json: 32 layers, "
                "hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 14336, vocab 128256, "
                "untied embeddings",
                "https://huggingface.co/meta-llama/Llama-3.1-8B: 8B parameters (8,030,261,248 recounted "
                "from config.json)",
            ),
        ),
        _dense_bf16(
            "llama-3.1-70b", 70_553_706_496, layers=80, kv_heads=8, head_dim=128,
            sources=(
                "https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json: 80 layers, "
                "hidden 8192, 64 heads, 8 KV heads, head_dim 128, intermediate 28672, vocab 128256",
                "https://huggingface.co/meta-llama/Llama-3.1-70B: 70B parameters (70,553,706,496 recounted "
                "from config.json)",
            ),
        ),
        _dense_bf16(
            "qwen3-8b", 8_190_735_360, layers=36, kv_heads=8, head_dim=128,
            sources=(
                "https://huggingface.co/Qwen/Qwen3-8B: 8.2B parameters, 36 layers, 32 Q / 8 KV heads",
                "https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json: hidden 4096, head_dim 128, "
                "intermediate 12288, vocab 151936 (8,190,735,360 recounted)",
            ),
        ),
        _dense_bf16(
            "qwen3-32b", 32_762_123_264, layers=64, kv_heads=8, head_dim=128,
            sources=(
                "https://huggingface.co/Qwen/Qwen3-32B: 32.8B parameters, 64 layers, 64 Q / 8 KV heads",
                "https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json: hidden 5120, head_dim 128, "
                "intermediate 25600, vocab 151936 (32,762,123,264 recounted)",
            ),
        ),
        ModelCostProfile(
            name="qwen3-30b-a3b",
            active_params=3_353_032_704.0,
            weight_bytes=30_532_122_624.0 * _BF16_BYTES,
            kv_bytes_per_token=kv_bytes_per_token(48, 4, 128, _BF16_BYTES),
            sources=(
                "https://huggingface.co/Qwen/Qwen3-30B-A3B: 30.5B total / 3.3B activated parameters, "
                "48 layers, 32 Q / 4 KV heads, 128 experts, 8 activated",
                "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: hidden 2048, head_dim 128, "
                "moe_intermediate 768, vocab 151936 (30,532,122,624 total, 3,353,032,704 active recounted)",
                "assumption: a serving step reads every expert's weights",
            ),
        ),
        # -- the hybrid models of scenarios/models/ (KV bytes per token = the sum over the
        # -- file's groups, window and mamba groups included; see docs/costs.md)
        ModelCostProfile(
            name="gpt-oss-120b",
            active_params=5_711_982_912.0,
            weight_bytes=65_248_815_744.0,
            kv_bytes_per_token=kv_bytes_per_token(36, 8, 64, _BF16_BYTES),
            sources=(
                "https://huggingface.co/openai/gpt-oss-120b: 116.83B total / 5.13B active parameters "
                "(model card, arXiv:2508.10925 Table 1; active without the input embedding), "
                "60.8 GiB checkpoint, 128 experts, 4 per token",
                "https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json: 36 layers alternating "
                "sliding window 128 / full, 64 Q / 8 KV heads, head_dim 64, hidden 2880, vocab 201088 "
                "(116,829,156,672 total, 5,711,982,912 active with both embedding tables, recounted)",
                "https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json: quantization_config "
                "mxfp4 for the experts; weight bytes = 114,661,785,600 expert weights x 4.25 bits + the "
                "rest x 2 bytes = 65,248,815,744 (60.77 GiB)",
                "assumption: a serving step reads every expert's weights",
            ),
        ),
        _dense_bf16(
            "gemma-3-27b", 27_009_346_304, layers=62, kv_heads=16, head_dim=128,
            sources=(
                "https://huggingface.co/google/gemma-3-27b-it/blob/main/config.json: text_config 62 layers "
                "(52 sliding window 1024, 10 global), 32 Q / 16 KV heads, head_dim 128, hidden 5376, "
                "intermediate 21504, vocab 262208, tied embeddings (27,009,346,304 recounted)",
                "https://huggingface.co/google/gemma-3-27b-it: 27B parameters (the vision encoder is "
                "left out: text-only serving)",
            ),
        ),
        ModelCostProfile(
            name="llama-4-scout",
            active_params=17_172_894_720.0,
            weight_bytes=107_769_861_120.0 * _BF16_BYTES,
            kv_bytes_per_token=kv_bytes_per_token(48, 8, 128, _BF16_BYTES),
            sources=(
                "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct: 17B active, 109B total "
                "(with the vision encoder), 16 experts",
                "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json: "
                "text_config 48 layers (36 chunked local 8192, 12 NoPE global), 40 Q / 8 KV heads, "
                "head_dim 128, hidden 5120, expert and shared-expert intermediate 8192, top-1, vocab 202048 "
                "(107,769,861,120 total, 17,172,894,720 active recounted for the text model)",
                "assumption: a serving step reads every expert's weights",
            ),
        ),
        ModelCostProfile(
            name="qwen3-next-80b-a3b",
            active_params=3_874_929_408.0,
            weight_bytes=79_674_391_296.0 * _BF16_BYTES,
            # 12 attention layers (2 KV heads x 256) + 36 Gated DeltaNet layers sized like KV
            # with 32 heads x 16 (one 544-token block = vLLM's padded state page per layer)
            kv_bytes_per_token=kv_bytes_per_token(12, 2, 256, _BF16_BYTES)
            + kv_bytes_per_token(36, 32, 16, _BF16_BYTES),
            sources=(
                "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct: 80B total / 3B activated, "
                "48 layers = 12 x (3 Gated DeltaNet + 1 gated attention), 16 Q / 2 KV heads of 256, "
                "512 experts (10 routed + 1 shared) of intermediate 512",
                "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json: hidden 2048, "
                "linear attention 32 V / 16 QK heads of 128, conv kernel 4, vocab 151936 "
                "(79,674,391,296 total, 3,874,929,408 active recounted, without the MTP layer)",
                "assumption: the mamba groups' per-token bytes are kvsim's shape stand-in for the "
                "recurrent state (scenarios/models/qwen3-next-80b-a3b.toml); a serving step reads every "
                "expert's weights",
            ),
        ),
        ModelCostProfile(
            name="deepseek-v4-style",
            active_params=13e9,
            weight_bytes=155e9,
            # single-copy latent caches of scenarios/models/deepseek-v4-style.toml, per token:
            # 21 CSA layers x 180 B (fp8) + 43 window layers x 585 B (fp8)
            # + 20 HCA compressor states x 1024 x 4 B (fp32)
            kv_bytes_per_token=21 * 180 + 43 * 585 + 20 * 1024 * 4,
            sources=(
                "https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash: 284B total / 13B activated "
                "parameters, 43 layers, routed experts FP4 and other weights FP8",
                "assumption: weight bytes estimated as 277,025,390,592 routed-expert parameters at 4.25 "
                "bits + the other ~7.0B at 1 byte + bf16 embeddings = about 155 GB",
                "assumption: KV bytes per token of the 'style' layout in "
                "scenarios/models/deepseek-v4-style.toml (spec section 6.1 block sizes, V4-Flash shapes)",
                "assumption: a serving step reads every expert's weights",
            ),
        ),
    )
}


def _lookup(table: dict[str, _T], kind: str, name: str) -> _T:
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table))
        raise KeyError(f"unknown {kind} {name!r}; known: {known}") from None


def step_model_for(
    gpu: str,
    model: str,
    *,
    tensor_parallel: int = 1,
    mfu: float = DEFAULT_MFU,
    mbu: float = DEFAULT_MBU,
) -> StepCostModel:
    """Roofline-style step model for ``model`` on ``tensor_parallel`` GPUs of kind ``gpu``.

    With ``BW = tensor_parallel x hbm_bandwidth x mbu`` and
    ``F = tensor_parallel x dense_bf16_flops x mfu``::

        overhead_s      = weight_bytes / BW
        prefill_token_s = 2 x active_params / F
        decode_seq_s    = 2 x active_params / F
        context_token_s = kv_bytes_per_token / BW

    Whether the weights fit in HBM is not checked (Llama 3.1 70B in BF16 needs
    two GPUs of either kind).

    Args:
        gpu: a key of :data:`GPU_PROFILES`.
        model: a key of :data:`MODEL_COST_PROFILES`.
        tensor_parallel: GPUs sharing the model (weights, FLOPs and KV split evenly).
        mfu: fraction of dense BF16 peak the matmuls reach, in (0, 1].
        mbu: fraction of peak HBM bandwidth the weight and KV reads reach, in (0, 1].

    Returns:
        The step cost model.

    Raises:
        KeyError: unknown GPU or model name; the message lists the known names.
        ValueError: ``tensor_parallel`` < 1, or ``mfu``/``mbu`` outside (0, 1].
    """
    g = _lookup(GPU_PROFILES, "gpu", gpu)
    m = _lookup(MODEL_COST_PROFILES, "model", model)
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
    for name, value in (("mfu", mfu), ("mbu", mbu)):
        if not 0.0 < value <= 1.0:  # also rejects NaN
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    bw = tensor_parallel * g.hbm_bandwidth_bytes_per_s * mbu
    flops = tensor_parallel * g.dense_bf16_flops * mfu
    token_s = 2.0 * m.active_params / flops
    return StepCostModel(
        overhead_s=m.weight_bytes / bw,
        prefill_token_s=token_s,
        decode_seq_s=token_s,
        context_token_s=m.kv_bytes_per_token / bw,
    )
