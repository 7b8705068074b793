"""Shared pieces of the file formats: the strict base model and the KV group entry.

Every format (run/1, model/1, hardware/1, check/1, sweep/1) is declared with
pydantic models that reject unknown keys, never coerce, and are frozen
(:class:`Strict`). A KV cache group is written the same way in ``check/1``
and ``model/1`` files (:class:`GroupEntry`; ``model/1`` adds the tensor
shape), and becomes the model layer's :class:`~sim.model.layout.GroupSpec`
through :meth:`GroupEntry.spec`.

Limits
    Sizes and counts are refused beyond fixed limits, the same on every
    machine (so a scenario that validates here validates everywhere and gives
    the same results), each far above any real deployment and every shipped
    scenario, and each checked before anything runs or is written:

    * :data:`MAX_BYTES` = 2**60 B (1 EiB): any size or bandwidth, and sizes
      derived from them (bytes per block, CPU cache bytes); sizes are 64-bit
      integers in the results.
    * :data:`MAX_GPU_BLOCKS` = 100,000,000: the GPU pool, given or derived
      from ``gpu_kv_bytes``; the model keeps a Python object per GPU block,
      allocated when a run starts (a real H200 holds a few million blocks of
      the smallest real model; 62 million of the toy ``spec6`` layout).
    * :data:`MAX_CPU_CHUNKS` = 2**40: CPU chunk slots, given or derived from
      ``capacity`` (a 10 TiB cache of 4 KiB slots fits); slot counts are
      summed into 64-bit columns and ARC's target size is a float.
    * :data:`MAX_REQUESTS` = 100,000,000: sessions, requests, ``limit``,
      ``max_num_seqs``, turns and system prompts of the generators; a run's
      time and memory grow with every request.
    * :data:`MAX_TOKENS` = 2**24 (16,777,216, above the longest context any
      model serves, 10M tokens): prompt and answer lengths, block sizes,
      windows, token budgets; a check holds a hash per ``tokens_per_hash``
      tokens and a GPU pool sized from the prompt.
    * :data:`MAX_INT64` = 2**63 - 1: any other integer written to a results
      column (``seed``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from sim.errors import InputError
from sim.model.layout import GroupKind, GroupSpec, KVShape

__all__ = [
    "MAX_BYTES",
    "MAX_CPU_CHUNKS",
    "MAX_GPU_BLOCKS",
    "MAX_INT64",
    "MAX_REQUESTS",
    "MAX_TOKENS",
    "GroupEntry",
    "ProblemError",
    "Strict",
    "at_most",
    "beyond_limit",
    "check_schema",
]

#: the largest value of a 64-bit signed integer column (Parquet int64)
MAX_INT64 = 2**63 - 1
#: any size or bandwidth in bytes (1 EiB)
MAX_BYTES = 2**60
#: GPU pool size in blocks: the model keeps per-block state, allocated up front
MAX_GPU_BLOCKS = 100_000_000
#: CPU cache size in chunk slots
MAX_CPU_CHUNKS = 2**40
#: sessions, requests and other per-request counts of a workload
MAX_REQUESTS = 100_000_000
#: token counts: prompt and answer lengths, block sizes, windows, budgets
MAX_TOKENS = 2**24

#: why each limit exists (said in the error message)
WHY_INT64 = "integers are 64-bit in the results"
WHY_BYTES = "sizes are 64-bit integers in the results"
WHY_GPU_BLOCKS = "the model keeps per-block state for every GPU block, allocated when a run starts"
WHY_CPU_CHUNKS = "CPU slot counts are 64-bit integers in the results"
WHY_REQUESTS = "a run's time and memory grow with every request"
WHY_TOKENS = "longer than any model's context; the model keeps state per block of tokens"


class ProblemError(ValueError):
    """A validation problem with its own wording; ``key`` is appended to the location."""

    def __init__(self, problem: str, allowed: str, key: str = "") -> None:
        super().__init__(f"{problem}; allowed: {allowed}")
        self.problem = problem
        self.allowed = allowed
        self.key = key


def beyond_limit(value: object, limit: int, unit: str, why: str) -> ProblemError:
    """The error for ``value`` above ``limit`` (a documented limit of this module)."""
    what = f"{limit:,} {unit}" if unit else f"{limit:,}"
    return ProblemError(f"{value} is beyond the limit of {what} ({why})", f"at most {what}")


def at_most(limit: int, unit: str, why: str) -> AfterValidator:
    """A pydantic validator refusing numbers above ``limit`` with :func:`beyond_limit`'s message."""

    def check(value: Any) -> Any:
        if value is not None and value > limit:
            raise beyond_limit(value, limit, unit, why)
        return value

    return AfterValidator(check)


#: a token count (or a length in tokens) below :data:`MAX_TOKENS`
Tokens = Annotated[int, at_most(MAX_TOKENS, "tokens", WHY_TOKENS)]


class Strict(BaseModel):
    """Base of every format's models: unknown keys rejected, no coercion, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class GroupEntry(Strict):
    """One KV cache group as a file states it (``check/1`` groups; ``model/1`` adds its shape)."""

    kind: Literal["full", "sliding_window", "chunked_local", "mamba"] = Field(description="attention kind")
    tokens_per_block: Tokens = Field(gt=0, description="GPU block size in tokens (vLLM block_size)")
    window: Tokens | None = Field(default=None, gt=0,
                                  description="sliding window in tokens (sliding_window only)")
    attention_chunk: Tokens | None = Field(default=None, gt=0,
                                           description="attention chunk in tokens (chunked_local)")
    extra_retained_tokens: Tokens = Field(default=0, ge=0,
                                          description="tokens kept left of the window (multi-module MTP)")
    eagle: bool = Field(default=False, description="the group holds EAGLE/MTP draft KV")

    def spec(self, shape: KVShape | None = None) -> GroupSpec:
        """The model layer's group (with ``shape`` when the file gives one)."""
        return GroupSpec(GroupKind(self.kind), self.tokens_per_block, self.window, self.attention_chunk,
                         self.extra_retained_tokens, self.eagle, shape=shape)


def check_schema(data: dict[str, Any], source: str, want: str) -> None:
    """Refuse a file whose ``schema`` key is missing or not ``want`` (one line, naming the key)."""
    got = data.get("schema")
    if got != want:
        problem = "missing" if got is None else f"{got!r} is not {want!r}"
        raise InputError(source, "schema", problem, f'"{want}"')
