"""Requests: the workload's input record and the request as the scheduler sees it.

What it models
    :class:`Request` is one request of a workload stream (what a client
    sends: arrival time, prompt and output lengths, the chained block hashes
    of prompt + output). :class:`LiveRequest` is that request inside the
    engine, what vLLM's ``Request`` holds: its :class:`RequestStatus`, its
    computed and known tokens, the thresholds below which a step needs no
    GPU bookkeeping, its load state, and the per-request counters of the
    ``requests`` table.

Simplifications
    * No token ids: a block's content is its hash (spec §1.2); the copy path
      derives KV fingerprints from the hashes and :func:`kv_salt`.

Invariants
    * ``len(block_hashes) == (prompt_tokens + output_tokens) // tokens_per_hash``
      (checked by :class:`Request`);
    * ``num_computed <= num_tokens`` and ``num_tokens == num_prompt_tokens + generated``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = ["LiveRequest", "Request", "RequestStatus", "kv_salt"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload stream.

    Attributes:
        req_id: unique, deterministic name (``r000123``, ``s12t3``).
        arrival_s: seconds from the run start; non-decreasing along a stream.
        prompt_tokens: prompt length (>= 1).
        output_tokens: tokens to generate (>= 1).
        block_hashes: chained hashes of every complete ``tokens_per_hash``-token
            block of prompt + output, ``array('q')``.
        session_id: the chat session (multi-turn streams), else ``None``.
        tokens_per_hash: tokens per hash block.
    """

    req_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: Sequence[int]
    session_id: str | None = None
    tokens_per_hash: int = 16

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.tokens_per_hash < 1:
            raise ValueError(f"{self.req_id}: prompt_tokens, output_tokens and tokens_per_hash must be >= 1")
        want = (self.prompt_tokens + self.output_tokens) // self.tokens_per_hash
        if len(self.block_hashes) != want:
            raise ValueError(f"{self.req_id}: {len(self.block_hashes)} block hashes, expected {want}")


class RequestStatus(Enum):
    """Where a request is (vLLM's ``RequestStatus``, plus the run's end states)."""

    WAITING = "waiting"
    #: its load from the CPU cache is in flight (vLLM ``WAITING_FOR_REMOTE_KVS``)
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED = "finished"
    #: it never fits in the GPU block pool
    REJECTED = "rejected"
    #: still in the system when the run stopped
    UNFINISHED = "unfinished"


def kv_salt(req_id: str) -> int:
    """KV content identity of a request's own tail (copy-path fingerprints)."""
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little") >> 1


class LiveRequest:
    """A request inside the engine (what vLLM's ``Request`` holds), and its counters."""

    __slots__ = (
        "_all",
        "_tph",
        "computed_tokens",
        "cpu_hit_tokens", "cpu_reload_tokens",
        "crash",
        "deferral_reasons",
        "deferrals",
        "deferred_s",
        "deferred_since",
        "finish_s",
        "first_token_s",
        "generated",
        "gpu_hit_tokens",
        "high_water",
        "load_job",
        "load_jobs",
        "load_ready",
        "loaded_bytes",
        "no_external",
        "num_computed",
        "num_prompt_tokens",
        "num_tokens",
        "preemptions",
        "recomputed_tokens",
        "req",
        "req_id",
        "salt",
        "scheduled_s",
        "status",
        "store_jobs",
        "stored_bytes",
        "synced",
        "thr_comp",
        "thr_slots",
    )

    def __init__(self, req: Request, tph: int) -> None:
        self.req = req
        self.req_id = req.req_id
        self.num_prompt_tokens = req.prompt_tokens
        self.num_tokens = req.prompt_tokens
        self.num_computed = 0
        self.generated = 0
        self._tph = tph
        hashes = req.block_hashes
        # a zero-copy view when the workload hands out arrays (bounded memory
        # for long queues); any other sequence is sliced on demand
        self._all: Sequence[int] = memoryview(hashes) if isinstance(hashes, array) else hashes
        #: KV content identity of the request's own tail (copy path fingerprints)
        self.salt = kv_salt(req.req_id)
        self.status = RequestStatus.WAITING
        self.load_job: int | None = None
        self.load_ready = False
        self.no_external = False
        #: the connector knows the request's block ids
        self.synced = False
        #: GPU allocation/commit is a no-op below these (see GpuKVCache.thresholds)
        self.thr_slots = 0
        self.thr_comp = 0
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.gpu_hit_tokens = 0
        self.cpu_hit_tokens = 0
        self.cpu_reload_tokens = 0
        self.computed_tokens = 0
        self.recomputed_tokens = 0
        self.high_water = 0
        self.loaded_bytes = 0
        self.stored_bytes = 0
        self.load_jobs = 0
        self.store_jobs = 0
        self.deferrals = 0
        #: deferred lookups by reason (None until the first)
        self.deferral_reasons: dict[str, int] | None = None
        #: time from a deferred lookup to the next lookup that answered, summed
        self.deferred_s = 0.0
        #: when the current run of deferred lookups began (None: not deferred)
        self.deferred_since: float | None = None
        self.preemptions = 0
        self.crash: str | None = None

    @property
    def full_hashes(self) -> Sequence[int]:
        """Hashes of every complete hash block the sequence will have (fingerprints
        do not depend on when a token was computed)."""
        return self._all

    @property
    def block_hashes(self) -> Sequence[int]:
        """Hashes of the complete hash blocks of the tokens known so far."""
        return self._all[: self.num_tokens // self._tph]

    def __repr__(self) -> str:
        return (f"LiveRequest({self.req_id!r}, {self.status.name}, computed={self.num_computed}, "
                f"tokens={self.num_tokens})")
