"""Request streams for the engine: Mooncake trace replay and synthetic multi-turn chat.

What it models
    The engine replays a stream of :class:`Request` objects in arrival order.
    Each request carries its prompt and output lengths and the chained block
    hashes of its whole token sequence (prompt followed by output), one hash
    per *complete* ``tokens_per_hash``-token block (spec §1.2): hash ``i``
    names the prefix ``[0, (i + 1) * tokens_per_hash)``, so two requests share
    hash ``i`` exactly when they share that prefix.

    Sources: a trace replay and synthetic generators.

    :func:`iter_mooncake` replays a Mooncake FAST'25 JSONL trace (``kvsim
    trace fetch mooncake-conversation``; plain or gzip-compressed). The trace
    names 512-token blocks by ids that are already chained, so equal ids at
    equal positions mean an equal prefix. A complete trace block with id
    ``h`` is expanded into
    ``block_tokens // tokens_per_hash`` sub-hashes that depend only on ``h``
    and the position inside the block; requests that share trace ids
    ``h_0..h_k`` therefore share exactly the sub-hashes of those blocks and
    differ right after them. Everything after the last complete trace block
    (the trailing partial 512-token block and all output tokens) belongs to
    the request alone: its hashes are salted with the request's line number
    and the stream's ``id_prefix``.

    :func:`iter_multiturn` generates chat sessions. Every session starts with
    the same system prompt (identical hashes in all sessions and all seeds);
    turn ``t + 1``'s prompt is turn ``t``'s prompt and output followed by a new
    user message, so its hashes start with every hash of turn ``t``'s full
    sequence. Session starts are a Poisson process; the turns of a session
    arrive open loop, a think time after the previous turn's *arrival*.

    :data:`AGENTIC` is a multi-turn preset for agentic tool loops (a long
    shared prefix, short appends, many quick turns); ``system_prompts > 1``
    gives several shared system prompts; :func:`iter_uniform` draws
    independent requests (no sharing). :func:`scale_rate`, :func:`sample`,
    :func:`jitter_arrivals` (spreads requests that share a timestamp, seeded)
    and :func:`take` transform any stream.

    The multi-turn defaults are chosen to resemble the Mooncake conversation
    trace (README: 3.4 req/s, input mean 12.0k / p50 6.9k / p99 85k tokens,
    output mean 343 / p50 350, exactly one leading 512-token block shared by
    every request, 37-38 % of 512-token blocks seen before): a 768-token system
    prompt shared by all sessions (one shared 512-token block), long and
    skewed first messages (lognormal, mean 11,000, sigma 1.2: chat with pasted
    documents), 1.5 turns per session on average (most trace requests reuse
    only the first block), 450-token follow-ups, 343-token answers (lognormal
    sigma 0.5), up to 128k tokens of context, and 2.25 session starts per
    second (about 3.4 requests per second in steady state). See
    :class:`MultiTurnParams` for the measured fit.

Simplifications
    * Mooncake: the sub-hashes of trace block ``h`` are ``mix(h) XOR K[j]``
      for a fixed table ``K`` of pseudo-random 63-bit constants, not a
      per-token chain; this keeps the expansion cheap (a record's blocks in
      one numpy pass) and is equivalent for prefix matching because ``h``
      already names the whole prefix.
      Two different trace files replayed in one run share trace-id space.
    * Hash collisions are possible in principle (63-bit values) and ignored.
    * Multi-turn: lengths are lognormal, the turn count is ``1 +`` geometric
      (capped), think times are gamma with shape 2 (so very short gaps are
      rare). The open loop means a follow-up can arrive before the previous
      turn has finished decoding; a session ends when its next prompt would
      exceed ``max_context_tokens`` (the first prompt is clipped to it).
    * No token ids, LoRA or multimodal extra keys: a block's "content" is a
      synthetic id.

Invariants
    * ``len(block_hashes) == (prompt_tokens + output_tokens) // tokens_per_hash``
      (checked by :class:`Request`), and every hash is a non-negative int
      below ``2**63``;
    * ``arrival_s`` is non-decreasing along every stream;
    * results depend only on the inputs and the seed, never on
      ``PYTHONHASHSEED`` (no use of Python's ``hash()``);
    * streams are lazy: a Mooncake file is read line by line, and only live
      sessions are held by the multi-turn generator;
    * a trace stream never ends "ok" without a request: a file with no
      request line raises :class:`InputError` ("no requests") at the call, a
      stream whose every line ``skip_bad`` skipped raises it at its end;
    * :func:`multiturn_count` and :func:`uniform_count` give a generator's
      exact request count (after ``sample`` and ``limit``) without building
      hashes; :func:`request_total` is that count for a run (a progress bar's
      total).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from sim.errors import InputError
from sim.io.traces import (
    BadLines,
    detect_format,
    iter_mooncake_records,
    iter_records,
    no_requests,
    trace_has_requests,
)
from sim.model.request import Request

__all__ = [
    "AGENTIC",
    "MultiTurnParams",
    "Request",
    "UniformParams",
    "chain_hash",
    "iter_mooncake",
    "iter_multiturn",
    "iter_trace",
    "iter_uniform",
    "jitter_arrivals",
    "multiturn_count",
    "replace_arrival",
    "request_total",
    "sample",
    "scale_rate",
    "take",
    "uniform_count",
    "validate_params",
    "validate_uniform",
]

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1

# Domain tags that keep the different kinds of derived hashes apart.
_ROOT = 0x2545F4914F6CDD1D
_TAG_TRACE_BLOCK = 0x1B873593
_TAG_PARTIAL = 0x5BD1E995
_TAG_OUTPUT = 0x68E31DA4
_TAG_SYSTEM = 0x3C6EF372
_TAG_SESSION = 0x7F4A7C15
_TAG_START = 0x61C88647


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with good avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def chain_hash(parent: int, token_block_id: int) -> int:
    """Hash of a block given its parent's hash and an id of the block's content.

    Deterministic (independent of ``PYTHONHASHSEED``), 63-bit, non-negative.
    Feeding each result back as the next ``parent`` gives vLLM-style chained
    hashes: the hash of block ``i`` depends on every block before it.
    """
    return _mix64(_mix64((parent + 0x9E3779B97F4A7C15) & _MASK64) ^ (token_block_id & _MASK64)) & _MASK63


# K[j]: the per-position constants XORed into a block's base value.
_POSITIONS: list[int] = []
# n -> (K[0..n) packed little-endian into one int, 1 in each 64-bit lane).
_PACKED: dict[int, tuple[int, int]] = {}


def _positions(n: int) -> list[int]:
    """The first ``n`` position constants (the table grows on demand)."""
    if len(_POSITIONS) < n:
        _POSITIONS.extend(_mix64((k + 1) * 0xD1B54A32D192ED03 & _MASK64) & _MASK63
                          for k in range(len(_POSITIONS), n))
    return _POSITIONS[:n]


def _xor_run(m: int, n: int) -> bytes:
    """``[m ^ K[k] for k in range(n)]`` as native ``array('q')`` bytes.

    Done as one big-int XOR of ``m`` replicated into every 64-bit lane (no
    carries: ``m < 2**63``), about four times faster than a comprehension.
    """
    packed = _PACKED.get(n)
    if packed is None:
        lanes = array("q", _positions(n))
        ones = array("q", [1]) * n
        if sys.byteorder != "little":
            lanes.byteswap()
            ones.byteswap()
        packed = (int.from_bytes(lanes.tobytes(), "little"), int.from_bytes(ones.tobytes(), "little"))
        _PACKED[n] = packed
    raw = (packed[0] ^ (m * packed[1])).to_bytes(8 * n, "little")
    if sys.byteorder != "little":
        swapped = array("q")
        swapped.frombytes(raw)
        swapped.byteswap()
        raw = swapped.tobytes()
    return raw


# n -> K[0..n) as a numpy array (_xor_runs)
_LANES: dict[int, np.ndarray[Any, np.dtype[np.uint64]]] = {}


def _xor_runs(ms: np.ndarray[Any, np.dtype[np.uint64]], n: int) -> bytes:
    """``_xor_run(m, n)`` for every ``m`` of ``ms``, one after the other, in one array operation."""
    lanes = _LANES.get(n)
    if lanes is None:
        lanes = _LANES[n] = np.array(_positions(n), dtype=np.uint64)
    return (ms[:, None] ^ lanes[None, :]).astype(np.int64).tobytes()


_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)
_MUL1, _MUL2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64_array(z: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """:func:`_mix64` of each element, in place (numpy's uint64 arithmetic wraps modulo
    2**64, as the masks do)."""
    z ^= z >> _U30
    z *= _MUL1
    z ^= z >> _U27
    z *= _MUL2
    z ^= z >> _U31
    return z


def _str_salt(text: str) -> int:
    """A stable 63-bit value for a string (blake2b, not Python's hash())."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") & _MASK63


# ----------------------------------------------------------------------------------------------
# Mooncake trace replay
# ----------------------------------------------------------------------------------------------

class _Expander:
    """Per-request hashes of a trace record (one per stream).

    A complete trace block with id ``h`` expands into ``block_tokens //
    tokens_per_hash`` sub-hashes that depend only on ``h`` and the position;
    a shared-prefix group's first ``prefix_tokens`` tokens expand from the
    group id the same way; everything after (partial trace block, the rest
    of the prompt, all output tokens) is salted with the record's line
    number and the stream's ``id_prefix``, so it belongs to the request alone.
    """

    def __init__(self, tph: int, id_prefix: str) -> None:
        self.tph = tph
        self.block_salt = chain_hash(_TAG_TRACE_BLOCK, tph)
        self.group_salt = chain_hash(_TAG_TRACE_BLOCK ^ _TAG_SYSTEM, tph)
        self.stream_salt = chain_hash(_str_salt(id_prefix), tph)

    def _block(self, h: int, per_block: int) -> bytes:
        """The sub-hashes of trace block ``h`` (the definition; :meth:`_blocks` computes the same)."""
        return _xor_run(_mix64(h ^ self.block_salt) & _MASK63, per_block)

    def _blocks(self, ids: Sequence[int], per_block: int) -> bytes:
        """:meth:`_block` of each of ``ids``, concatenated: in one numpy pass where every
        id is a 64-bit unsigned int (a trace's ids are), else id by id."""
        try:
            h = np.fromiter(ids, dtype=np.uint64, count=len(ids))
        except (OverflowError, TypeError, ValueError):   # negative, 2**64 or more, or not an int
            return b"".join(self._block(x, per_block) for x in ids)
        h ^= np.uint64(self.block_salt)
        return _xor_runs(_mix64_array(h) & np.uint64(_MASK63), per_block)

    def hashes(self, line: int, inp: int, out: int, ids: Sequence[int] | None, block_tokens: int | None,
               group: int | None = None, group_tokens: int | None = None) -> array[int]:
        tph = self.tph
        hashes: array[int] = array("q")
        if ids is not None and block_tokens:
            full = ids[: inp // block_tokens]
            if full:
                hashes.frombytes(self._blocks(full, block_tokens // tph))
        elif group is not None and group_tokens:
            n = min(group_tokens, inp) // tph
            if n:
                m = _mix64((group + 1) ^ self.group_salt) & _MASK63
                hashes.frombytes(_xor_run(m, n))
        last = hashes[-1] if hashes else _ROOT
        req_salt = chain_hash(self.stream_salt, line)
        npart = inp // tph - len(hashes)
        if npart:
            m = chain_hash(last, req_salt ^ _TAG_PARTIAL)
            hashes.frombytes(_xor_run(m, npart))
            last = hashes[-1]
        nout = (inp + out) // tph - len(hashes)
        if nout:
            m = chain_hash(last, req_salt ^ _TAG_OUTPUT)
            hashes.frombytes(_xor_run(m, nout))
        return hashes


def iter_mooncake(path: str | Path, tokens_per_hash: int, *, limit: int | None = None,
                  time_scale: float = 1.0, block_tokens: int = 512,
                  id_prefix: str = "r") -> Iterator[Request]:
    """Stream the requests of a Mooncake JSONL trace, one line at a time.

    Args:
        path: the JSONL file (blank lines are ignored).
        tokens_per_hash: hash block size; must divide ``block_tokens``.
        limit: stop after this many requests (``None``: all).
        time_scale: ``arrival_s = timestamp / 1000 * time_scale`` (< 1 compresses).
        block_tokens: tokens per trace block (512 for the Mooncake traces).
        id_prefix: ``req_id`` is ``f"{id_prefix}{index:06d}"`` (index counts
            requests from 0); it also salts the request-private hashes.

    Raises:
        InputError: bad arguments (checked at the call), or a bad line (raised
            when the stream reaches it, ``key="line N"``).
    """
    source = str(path)
    if not (type(tokens_per_hash) is int and type(block_tokens) is int
            and tokens_per_hash >= 1 and block_tokens >= 1 and block_tokens % tokens_per_hash == 0):
        raise InputError(source, "tokens_per_hash",
                         f"{tokens_per_hash!r} does not divide block_tokens {block_tokens!r}",
                         "a positive integer that divides the trace block size")
    if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0):
        raise InputError(source, "time_scale", f"{time_scale!r}", "a finite number > 0")
    if limit is not None and (type(limit) is not int or limit < 0):
        raise InputError(source, "limit", f"{limit!r}", "None or an integer >= 0")
    if not Path(path).exists():
        raise InputError(source, "", "no such file", "a Mooncake JSONL trace")
    if limit != 0 and not trace_has_requests(path, "mooncake"):
        raise no_requests(source)
    records = iter_mooncake_records(path, block_tokens)
    return _trace_stream(records, source, tokens_per_hash, limit, float(time_scale), id_prefix)


def iter_trace(path: str | Path, tokens_per_hash: int, *, fmt: str | None = None, limit: int | None = None,
               time_scale: float = 1.0, block_tokens: int | None = None, skip_bad: bool = False,
               bad: Any = None, id_prefix: str = "r") -> Iterator[Request]:
    """Stream the requests of any trace :mod:`sim.io.traces` reads (Mooncake JSONL,
    Azure CSV, kvsim CSV/Parquet), one record at a time.

    Hash ids expand exactly as :func:`iter_mooncake` does (same file, same
    hashes); a ``prefix_group`` shares its first ``prefix_tokens`` tokens with
    the group; a trace without prefix information (Azure) shares nothing.

    Args:
        path: the trace.
        tokens_per_hash: hash block size; must divide the trace's block size.
        fmt: the format (None: detected).
        limit: stop after this many requests.
        time_scale: multiplies arrival times (< 1 compresses).
        block_tokens: tokens per hash id when the file does not say.
        skip_bad: skip bad records, counting them in ``bad`` (a
            :class:`sim.io.traces.BadLines`), instead of raising.
        id_prefix: ``req_id`` prefix; also salts the request-private hashes.

    Raises:
        InputError: bad arguments, or a bad record when the stream reaches it.
    """
    source = str(path)
    if type(tokens_per_hash) is not int or tokens_per_hash < 1:
        raise InputError(source, "tokens_per_hash", f"{tokens_per_hash!r}", "an integer >= 1")
    if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0):
        raise InputError(source, "time_scale", f"{time_scale!r}", "a finite number > 0")
    if limit is not None and (type(limit) is not int or limit < 0):
        raise InputError(source, "limit", f"{limit!r}", "None or an integer >= 0")
    records = iter_records(path, fmt, skip_bad=skip_bad, bad=bad, block_tokens=block_tokens)
    if limit != 0 and Path(path).is_file() and not trace_has_requests(path, fmt or detect_format(path)):
        raise no_requests(source)
    return _trace_stream(records, source, tokens_per_hash, limit, float(time_scale), id_prefix,
                         bad if isinstance(bad, BadLines) else None)



def _trace_stream(records: Iterator[Any], source: str, tph: int, limit: int | None, time_scale: float,
                  id_prefix: str, bad: BadLines | None = None) -> Iterator[Request]:
    """The requests of ``records``; a stream that ends without one raises :class:`InputError`
    ("no requests"), e.g. when ``skip_bad`` skipped every line."""
    expand = _Expander(tph, id_prefix)
    if limit == 0:
        return
    index = -1
    for index, rec in enumerate(records):
        bt = rec.block_tokens
        if rec.hash_ids is not None and bt and bt % tph:
            raise InputError(source, "tokens_per_hash", f"{tph} does not divide the trace's "
                             f"block size {bt}", "a divisor of the trace's tokens per hash id")
        hashes = expand.hashes(rec.line, rec.input_tokens, rec.output_tokens, rec.hash_ids, bt,
                               rec.prefix_group, rec.prefix_tokens)
        yield Request(f"{id_prefix}{index:06d}", rec.arrival_s * time_scale, rec.input_tokens,
                      rec.output_tokens, hashes, rec.session_id, tph)
        if limit is not None and index + 1 >= limit:
            return
    if index < 0:
        skipped = bad.count if bad is not None else 0
        raise no_requests(source, bad if skipped else "the trace holds no request", skip_option="skip_bad")


# ----------------------------------------------------------------------------------------------
# Synthetic multi-turn chat
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MultiTurnParams:
    """Parameters of the synthetic multi-turn chat workload.

    The defaults resemble the Mooncake conversation trace (one hour of Kimi
    chat). Measured with 3,000 sessions, seeds 0/1/2: 3.4 requests/s while
    sessions keep starting, input tokens mean 11.9k/11.7k/12.0k, p50
    6.7k/6.5k/6.6k, p99 87k/77k/101k, output mean about 340 (p50 about 300),
    and 37/35/33 % of complete 512-token prompt blocks seen before (trace:
    3.4 req/s, 12.0k, 6.9k, 85k, 343 (p50 350), 38 %). The output p50 is
    lower than the trace's because the lognormal is right-skewed while the
    trace's answers are nearly symmetric around 350. ``sessions = 200`` keeps
    a default run short (about 300 requests over four minutes).

    Attributes:
        sessions: number of chat sessions.
        session_rate_per_s: rate of the Poisson process of session starts.
        turns_mean: mean turns per session (``1 +`` geometric, capped at
            ``turns_max``).
        turns_max: most turns in a session.
        system_prompt_tokens: shared by all sessions (same hashes).
        first_user_tokens_mean: mean of the lognormal first user message.
        followup_user_tokens_mean: mean of the lognormal follow-up messages.
        output_tokens_mean: mean of the lognormal answer length.
        max_context_tokens: a session stops when its next prompt would exceed
            this (the first prompt is clipped to it).
        think_time_mean_s: mean gap (gamma, shape 2) between a turn's arrival
            and the next turn's arrival (open loop).
        user_tokens_sigma: lognormal sigma of user messages.
        output_tokens_sigma: lognormal sigma of answers.
        system_prompts: distinct system prompts; each session uses one,
            drawn uniformly (1: every session shares the same prompt).
    """

    sessions: int = 200
    session_rate_per_s: float = 2.25
    turns_mean: float = 1.5
    turns_max: int = 16
    system_prompt_tokens: int = 768
    first_user_tokens_mean: float = 11000.0
    followup_user_tokens_mean: float = 450.0
    output_tokens_mean: float = 343.0
    max_context_tokens: int = 131072
    think_time_mean_s: float = 30.0
    user_tokens_sigma: float = 1.2
    output_tokens_sigma: float = 0.5
    system_prompts: int = 1


#: Agentic tool loops: a long prefix shared by every session (system prompt
#: and tool definitions), a short task, then many turns whose appends are a
#: tool call (the answer) and its result (the next "user" message), with tool
#: latencies of a few seconds. The figures are an assumption of typical
#: coding/tool agents (a few thousand tokens of tool schema, results of a few
#: hundred tokens, 5-15 steps), not fitted to a public trace (the Mooncake
#: tool&agent trace is not available offline).
AGENTIC = MultiTurnParams(
    sessions=100, session_rate_per_s=0.5, turns_mean=8.0, turns_max=40,
    system_prompt_tokens=6144, first_user_tokens_mean=400.0, followup_user_tokens_mean=600.0,
    output_tokens_mean=150.0, max_context_tokens=65536, think_time_mean_s=3.0,
    user_tokens_sigma=0.8, output_tokens_sigma=0.6, system_prompts=1)


def validate_params(params: MultiTurnParams, source: str = "multiturn") -> None:
    """Raise :class:`InputError` (``key`` = field name) for out-of-range parameters."""
    rules: dict[str, tuple[bool, str]] = {}
    p = params

    def num(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    rules["sessions"] = (type(p.sessions) is int and p.sessions >= 1, "an integer >= 1")
    rules["session_rate_per_s"] = (num(p.session_rate_per_s) and p.session_rate_per_s > 0, "a number > 0")
    rules["turns_mean"] = (num(p.turns_mean) and p.turns_mean >= 1, "a number >= 1")
    rules["turns_max"] = (type(p.turns_max) is int and p.turns_max >= 1, "an integer >= 1")
    rules["system_prompt_tokens"] = (type(p.system_prompt_tokens) is int and p.system_prompt_tokens >= 0,
                                     "an integer >= 0")
    for name in ("first_user_tokens_mean", "followup_user_tokens_mean", "output_tokens_mean"):
        value = getattr(p, name)
        rules[name] = (num(value) and value >= 1, "a number >= 1")
    rules["max_context_tokens"] = (type(p.max_context_tokens) is int
                                   and p.max_context_tokens > p.system_prompt_tokens,
                                   "an integer > system_prompt_tokens")
    rules["think_time_mean_s"] = (num(p.think_time_mean_s) and p.think_time_mean_s > 0, "a number > 0")
    for name in ("user_tokens_sigma", "output_tokens_sigma"):
        value = getattr(p, name)
        rules[name] = (num(value) and 0 <= value <= 5, "a number in [0, 5]")
    rules["system_prompts"] = (type(p.system_prompts) is int and p.system_prompts >= 1, "an integer >= 1")
    for f in fields(p):
        ok, allowed = rules[f.name]
        if not ok:
            raise InputError(source, f.name, f"{getattr(p, f.name)!r}", allowed)


def _lognormal_int(rng: random.Random, mean: float, sigma: float) -> int:
    """A positive integer drawn from a lognormal with the given mean."""
    mu = math.log(mean) - sigma * sigma / 2.0
    return max(1, round(rng.lognormvariate(mu, sigma)))


def iter_multiturn(params: MultiTurnParams, seed: int, tokens_per_hash: int, *,
                   limit: int | None = None) -> Iterator[Request]:
    """Stream a seeded synthetic multi-turn chat workload in arrival order.

    Requests are named ``s{session}t{turn}`` (both from 0) with
    ``session_id = f"s{session}"``. Ties in arrival time go to the lower
    session index. The same ``(params, seed, tokens_per_hash)`` always gives
    the same stream.

    Raises:
        InputError: bad parameters (checked at the call).
    """
    validate_params(params)
    if type(tokens_per_hash) is not int or tokens_per_hash < 1:
        raise InputError("multiturn", "tokens_per_hash", f"{tokens_per_hash!r}", "an integer >= 1")
    if limit is not None and (type(limit) is not int or limit < 0):
        raise InputError("multiturn", "limit", f"{limit!r}", "None or an integer >= 0")
    if type(seed) is not int:
        raise InputError("multiturn", "seed", f"{seed!r}", "an integer")
    return _multiturn_stream(params, seed, tokens_per_hash, limit)


def _plan(p: MultiTurnParams, seed_salt: int, s: int) -> tuple[int, list[tuple[int, int, float]]]:
    """Session ``s``'s system-prompt tag and its turns as (prompt, output, gap to the next
    turn) tuples, drawn in a fixed order from the session's own generator; the turns stop
    before a prompt would exceed ``max_context_tokens``."""
    rng = random.Random(chain_hash(seed_salt, s))
    # which shared system prompt (prompt 0 keeps the historical hashes)
    system_tag = _TAG_SYSTEM if p.system_prompts == 1 else chain_hash(
        _TAG_SYSTEM, rng.randrange(p.system_prompts))
    p_stop = 1.0 / p.turns_mean
    turns = 1
    while turns < p.turns_max and rng.random() >= p_stop:
        turns += 1
    context = p.system_prompt_tokens
    out_turns: list[tuple[int, int, float]] = []
    for t in range(turns):
        if t == 0:
            user = min(_lognormal_int(rng, p.first_user_tokens_mean, p.user_tokens_sigma),
                       p.max_context_tokens - context)
        else:
            user = _lognormal_int(rng, p.followup_user_tokens_mean, p.user_tokens_sigma)
        out = _lognormal_int(rng, p.output_tokens_mean, p.output_tokens_sigma)
        gap = rng.gammavariate(2.0, p.think_time_mean_s / 2.0)
        prompt = context + user
        if prompt > p.max_context_tokens:
            break
        out_turns.append((prompt, out, gap))
        context = prompt + out
    return system_tag, out_turns


def _session(p: MultiTurnParams, seed_salt: int, s: int, start_s: float,
             tph: int) -> Iterator[Request]:
    """The turns of session ``s``, in order; holds only this session's hashes."""
    system_tag, turns = _plan(p, seed_salt, s)
    content_salt = chain_hash(seed_salt ^ _TAG_SESSION, s)
    hashes: array[int] = array("q")
    parent = _ROOT
    arrival = start_s
    for t, (prompt, out, gap) in enumerate(turns):
        total = prompt + out
        for i in range(len(hashes), total // tph):
            # A block that lies wholly inside the system prompt has the same
            # content in every session; any other block is this session's own.
            content = system_tag + i if (i + 1) * tph <= p.system_prompt_tokens else content_salt + i
            parent = chain_hash(parent, content)
            hashes.append(parent)
        yield Request(f"s{s}t{t}", arrival, prompt, out, array("q", hashes), f"s{s}", tph)
        arrival += gap


def _multiturn_stream(p: MultiTurnParams, seed: int, tph: int, limit: int | None) -> Iterator[Request]:
    if limit == 0:
        return
    seed_salt = chain_hash(_TAG_START, seed)
    starts = random.Random(chain_hash(seed_salt, _TAG_START))
    # Heap of live sessions: (next arrival, session index, request, generator).
    # (arrival, session) is unique, so the request and generator never compare.
    heap: list[tuple[float, int, Request, Iterator[Request]]] = []
    next_s = 0
    next_start = 0.0
    emitted = 0

    def admit(s: int, gen: Iterator[Request]) -> None:
        req = next(gen, None)
        if req is not None:
            heapq.heappush(heap, (req.arrival_s, s, req, gen))

    while True:
        while next_s < p.sessions and (not heap or next_start <= heap[0][0]):
            admit(next_s, _session(p, seed_salt, next_s, next_start, tph))
            next_s += 1
            next_start += starts.expovariate(p.session_rate_per_s)
        if not heap:
            return
        _, s, req, gen = heapq.heappop(heap)
        yield req
        emitted += 1
        if limit is not None and emitted >= limit:
            return
        admit(s, gen)


def _kept(fraction: float, seed: int) -> Any:
    """The predicate :func:`sample` applies to a request id."""
    cut = int(fraction * (1 << 63))
    salt = chain_hash(_TAG_START ^ 0xA5A5, seed)
    return lambda req_id: chain_hash(salt, _str_salt(req_id)) < cut


def _count(ids: Iterator[str], seed: int, sample_fraction: float, limit: int | None) -> int:
    if sample_fraction != 1:
        keep = _kept(sample_fraction, seed)
        n = sum(1 for i in ids if keep(i))
    else:
        n = sum(1 for _ in ids)
    return n if limit is None else min(n, limit)


def multiturn_count(params: MultiTurnParams, seed: int, *, sample_fraction: float = 1.0,
                    limit: int | None = None) -> int:
    """How many requests :func:`iter_multiturn` yields for ``(params, seed)`` (any
    ``tokens_per_hash``), after :func:`sample` with ``sample_fraction`` and ``limit``:
    exactly, from the same per-session draws, without computing a hash (a progress
    bar's total). ``rate_scale`` does not change the count."""
    validate_params(params)
    seed_salt = chain_hash(_TAG_START, seed)
    ids = (f"s{s}t{t}" for s in range(params.sessions)
           for t in range(len(_plan(params, seed_salt, s)[1])))
    return _count(ids, seed, sample_fraction, limit)


def uniform_count(params: UniformParams, seed: int, *, sample_fraction: float = 1.0,
                  limit: int | None = None) -> int:
    """How many requests :func:`iter_uniform` yields, after ``sample_fraction`` and ``limit``."""
    validate_uniform(params)
    return _count((f"u{i:06d}" for i in range(params.requests)), seed, sample_fraction, limit)


def request_total(spec: Any) -> int | None:
    """The number of requests a run will see, when it is known before running (a
    progress bar's total): a generator's exact count (:func:`multiturn_count`,
    :func:`uniform_count`, after ``sample`` and ``limit``); a trace's ``limit`` when
    nothing is sampled; else None.

    Args:
        spec: a :class:`sim.io.scenario.RunSpec` (read through ``scenario.workload``,
            ``scenario.seed``, ``multiturn_params()`` and ``uniform_params()``).
    """
    wl = spec.scenario.workload
    seed = spec.scenario.seed
    if wl.kind in ("multiturn", "agentic"):
        return multiturn_count(MultiTurnParams(**spec.multiturn_params()), seed, sample_fraction=wl.sample,
                               limit=wl.limit)
    if wl.kind == "uniform":
        return uniform_count(UniformParams(**spec.uniform_params()), seed, sample_fraction=wl.sample,
                             limit=wl.limit)
    return wl.limit if wl.sample == 1 else None


# ----------------------------------------------------------------------------------------------
# Uniform random requests (no prefix sharing)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class UniformParams:
    """Independent requests: Poisson arrivals, uniform lengths, no shared prefix.

    Attributes:
        requests: number of requests.
        rate_per_s: Poisson arrival rate.
        input_tokens_min, input_tokens_max: prompt length, uniform (inclusive).
        output_tokens_min, output_tokens_max: answer length, uniform (inclusive).
    """

    requests: int = 500
    rate_per_s: float = 4.0
    input_tokens_min: int = 512
    input_tokens_max: int = 8192
    output_tokens_min: int = 32
    output_tokens_max: int = 512


def validate_uniform(p: UniformParams, source: str = "uniform") -> None:
    """Raise :class:`InputError` (``key`` = field name) for out-of-range parameters."""
    checks = [
        ("requests", type(p.requests) is int and p.requests >= 1, "an integer >= 1"),
        ("rate_per_s", isinstance(p.rate_per_s, (int, float)) and not isinstance(p.rate_per_s, bool)
         and math.isfinite(p.rate_per_s) and p.rate_per_s > 0, "a number > 0"),
        ("input_tokens_min", type(p.input_tokens_min) is int and p.input_tokens_min >= 1, "an integer >= 1"),
        ("input_tokens_max", type(p.input_tokens_max) is int and p.input_tokens_max >= p.input_tokens_min,
         "an integer >= input_tokens_min"),
        ("output_tokens_min", type(p.output_tokens_min) is int and p.output_tokens_min >= 1,
         "an integer >= 1"),
        ("output_tokens_max", type(p.output_tokens_max) is int and p.output_tokens_max >= p.output_tokens_min,
         "an integer >= output_tokens_min"),
    ]
    for name, ok, allowed in checks:
        if not ok:
            raise InputError(source, name, f"{getattr(p, name)!r}", allowed)


def iter_uniform(params: UniformParams, seed: int, tokens_per_hash: int, *,
                 limit: int | None = None) -> Iterator[Request]:
    """Stream ``params.requests`` independent requests (``u000000``, ...), seeded.

    Every request's hashes are its own (salted with the seed and its index),
    so nothing is shared: the workload isolates queueing and transfer costs
    from reuse.
    """
    validate_uniform(params)
    if type(tokens_per_hash) is not int or tokens_per_hash < 1:
        raise InputError("uniform", "tokens_per_hash", f"{tokens_per_hash!r}", "an integer >= 1")
    if limit is not None and (type(limit) is not int or limit < 0):
        raise InputError("uniform", "limit", f"{limit!r}", "None or an integer >= 0")
    return _uniform_stream(params, seed, tokens_per_hash, limit)


def _uniform_stream(p: UniformParams, seed: int, tph: int, limit: int | None) -> Iterator[Request]:
    salt = chain_hash(_TAG_START ^ 0x55AA, seed)
    rng = random.Random(salt)
    t = 0.0
    n = p.requests if limit is None else min(p.requests, limit)
    for i in range(n):
        inp = rng.randint(p.input_tokens_min, p.input_tokens_max)
        out = rng.randint(p.output_tokens_min, p.output_tokens_max)
        m = chain_hash(salt, i)
        hashes: array[int] = array("q")
        hashes.frombytes(_xor_run(m, (inp + out) // tph))
        yield Request(f"u{i:06d}", t, inp, out, hashes, None, tph)
        t += rng.expovariate(p.rate_per_s)


# ----------------------------------------------------------------------------------------------
# Stream transforms
# ----------------------------------------------------------------------------------------------

def scale_rate(stream: Iterator[Request], factor: float) -> Iterator[Request]:
    """Arrivals ``factor`` times as dense (``arrival_s / factor``): 2.0 doubles the rate."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise InputError("workload", "rate_scale", f"{factor!r}", "a finite number > 0")
    if factor == 1:
        return stream
    return (replace_arrival(r, r.arrival_s / factor) for r in stream)


def sample(stream: Iterator[Request], fraction: float, seed: int) -> Iterator[Request]:
    """Keep each request with probability ``fraction``, decided by a hash of
    its id and the seed (the same requests are kept whatever else changes)."""
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise InputError("workload", "sample", f"{fraction!r}", "a number in (0, 1]")
    if fraction == 1:
        return stream
    keep = _kept(fraction, seed)
    return (r for r in stream if keep(r.req_id))


def take(stream: Iterator[Request], limit: int | None) -> Iterator[Request]:
    """At most ``limit`` requests (None: all)."""
    if limit is None:
        return stream
    if type(limit) is not int or limit < 0:
        raise InputError("workload", "limit", f"{limit!r}", "None or an integer >= 0")
    return (r for _, r in zip(range(limit), stream, strict=False))


def jitter_arrivals(stream: Iterator[Request], jitter_s: float, seed: int) -> Iterator[Request]:
    """Spread requests that share one arrival time ``t`` over ``[t, t + jitter_s)``.

    A request alone at its time keeps it. Each request of a group of two or
    more moves by ``jitter_s * u``, ``u`` in ``[0, 1)`` derived from a blake2b
    hash of ``seed`` and its ``req_id`` (never from a global random state), so
    the same seed gives the same stream. The output is sorted by the new times
    (ties in the original order). It stays lazy: a request is held only until
    no later request can arrive before it, i.e. about the requests of one
    ``jitter_s`` window (groups spread wider than the gap to the next time
    interleave with it; nothing is capped). ``jitter_s = 0`` returns ``stream``.

    Raises:
        InputError: ``jitter_s`` is not a finite number >= 0 (key ``arrival_jitter_s``).
    """
    if not (isinstance(jitter_s, (int, float)) and not isinstance(jitter_s, bool)
            and math.isfinite(jitter_s) and jitter_s >= 0):
        raise InputError("workload", "arrival_jitter_s", f"{jitter_s!r}", "a finite number of seconds >= 0")
    if type(seed) is not int:
        raise InputError("workload", "seed", f"{seed!r}", "an integer")
    if jitter_s == 0:
        return stream
    return _jitter_stream(stream, float(jitter_s), seed)


def _jitter_unit(key: bytes, req_id: str) -> float:
    """A uniform number in [0, 1) from ``req_id`` alone (53 bits of a keyed blake2b)."""
    digest = hashlib.blake2b(req_id.encode("utf-8"), digest_size=8, key=key, person=b"kvsim-jitter").digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0 ** -53


def _jitter_stream(stream: Iterator[Request], jitter: float, seed: int) -> Iterator[Request]:
    key = seed.to_bytes(16, "little", signed=True)
    # (new arrival, input order, request): the input order breaks ties, so requests never compare
    heap: list[tuple[float, int, Request]] = []
    group: list[Request] = []
    order = 0

    def flush() -> None:
        nonlocal order
        alone = len(group) == 1
        for r in group:
            t = r.arrival_s
            if not alone:
                # t + jitter * u, kept below t + jitter despite rounding
                t = min(t + jitter * _jitter_unit(key, r.req_id), math.nextafter(t + jitter, t))
            heapq.heappush(heap, (t, order, r if alone else replace_arrival(r, t)))
            order += 1
        group.clear()

    for r in stream:
        if group and r.arrival_s != group[0].arrival_s:
            flush()
            # every later request arrives at r.arrival_s or after
            while heap and heap[0][0] <= r.arrival_s:
                yield heapq.heappop(heap)[2]
        group.append(r)
    flush()
    while heap:
        yield heapq.heappop(heap)[2]


def replace_arrival(r: Request, arrival_s: float) -> Request:
    """The same request arriving at ``arrival_s``."""
    return Request(r.req_id, arrival_s, r.prompt_tokens, r.output_tokens, r.block_hashes,
                   r.session_id, r.tokens_per_hash)
