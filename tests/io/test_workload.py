"""Workload streams: Mooncake replay and synthetic multi-turn chat."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from array import array
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.errors import InputError
from sim.io.workload import (
    MultiTurnParams,
    Request,
    _Expander,
    chain_hash,
    iter_mooncake,
    iter_multiturn,
    validate_params,
)
from tests.helpers import common_prefix

ROOT = Path(__file__).resolve().parents[2]
CONV = "conversation_trace.jsonl"


def line(ts: object = 0, inp: int | object = 1024, out: object = 10, ids: object = None) -> str:
    if ids is None:
        assert isinstance(inp, int)
        ids = list(range(-(-inp // 512)))
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids})


def write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def raw_records(path: Path, n: int) -> list[dict[str, Any]]:
    out = []
    with path.open() as f:
        for text in f:
            if text.strip():
                out.append(json.loads(text))
                if len(out) == n:
                    break
    return out


# ----------------------------------------------------------------------------------------------
# Mooncake: the real conversation trace
# ----------------------------------------------------------------------------------------------

def test_conversation_trace_count_lengths_arrivals(traces_dir: Path) -> None:
    n = 0
    prev = -1.0
    ids = set()
    for r in iter_mooncake(traces_dir / CONV, 16):
        n += 1
        assert r.arrival_s >= prev
        prev = r.arrival_s
        assert len(r.block_hashes) == (r.prompt_tokens + r.output_tokens) // 16
        assert r.prompt_tokens >= 1 and r.output_tokens >= 1
        assert r.session_id is None and r.tokens_per_hash == 16
        ids.add(r.req_id)
    assert n == 12031
    assert len(ids) == n
    assert 3530 < prev < 3540  # README: 3,537 s


def test_conversation_trace_values_in_range(traces_dir: Path) -> None:
    for r in iter_mooncake(traces_dir / CONV, 8, limit=300):
        assert min(r.block_hashes) >= 0
        assert max(r.block_hashes) < 2**63


@pytest.mark.parametrize("tph", [8, 16, 64])
def test_trace_prefix_sharing_exact(traces_dir: Path, tph: int) -> None:
    """Shared trace ids <=> shared sub-hashes: exactly min(k, full blocks) * 512/tph, then a difference."""
    per = 512 // tph
    recs = raw_records(traces_dir / CONV, 1500)
    reqs = list(iter_mooncake(traces_dir / CONV, tph, limit=1500))
    groups: dict[int, list[int]] = defaultdict(list)
    for i, rec in enumerate(recs):
        ids = rec["hash_ids"]
        if len(ids) > 1:
            groups[ids[1]].append(i)
    pairs = [(i, i + 1) for i in range(len(recs) - 1)]
    pairs += [(g[0], j) for g in groups.values() for j in g[1:]]
    deepest = 0
    for i, j in pairs:
        a, b = recs[i], recs[j]
        k = common_prefix(a["hash_ids"], b["hash_ids"])
        full_a = a["input_length"] // 512
        full_b = b["input_length"] // 512
        shared = min(k, full_a, full_b) * per
        ha, hb = reqs[i].block_hashes, reqs[j].block_hashes
        assert common_prefix(ha, hb) == shared, (i, j, k)
        if shared < min(len(ha), len(hb)):
            assert ha[shared] != hb[shared]
        deepest = max(deepest, min(k, full_a, full_b))
    assert deepest >= 10  # the sample does exercise long shared prefixes


def test_trace_private_hashes_are_unique(traces_dir: Path) -> None:
    """Hashes after a request's last complete trace block (partial block + output) occur nowhere else."""
    tph = 64
    per = 512 // tph
    recs = raw_records(traces_dir / CONV, 3000)
    reqs = list(iter_mooncake(traces_dir / CONV, tph, limit=3000))
    counts: Counter[int] = Counter()
    for r in reqs:
        counts.update(r.block_hashes)
    private = 0
    partial = 0
    for rec, r in zip(recs, reqs, strict=True):
        nfull = rec["input_length"] // 512
        tail = r.block_hashes[nfull * per:]
        assert all(counts[h] == 1 for h in tail), r.req_id
        private += len(tail)
        partial += (r.prompt_tokens - nfull * 512) // tph
    assert private > 3000 and partial > 1000


# ----------------------------------------------------------------------------------------------
# Mooncake: small files with known structure
# ----------------------------------------------------------------------------------------------

def test_shared_full_blocks_then_private_partial_and_output(tmp_path: Path) -> None:
    p = write(tmp_path, [
        line(0, 1536, 10, [1, 2, 3]),      # three full blocks
        line(5, 1300, 20, [1, 2, 9]),      # two full blocks + a 276-token partial one
        line(9, 1300, 20, [1, 2, 9]),      # same ids as the line before
        line(9, 1536, 10, [1, 2, 3]),      # identical to the first line
    ])
    a, b, c, d = iter_mooncake(p, 16)
    assert common_prefix(a.block_hashes, b.block_hashes) == 64
    # Same trace ids, but the partial block (17 hash blocks of 16 tokens) is private.
    assert common_prefix(b.block_hashes, c.block_hashes) == 64
    assert len(b.block_hashes) == (1300 + 20) // 16 == 82
    assert not set(b.block_hashes[64:]) & set(c.block_hashes)
    # Identical prompts share every prompt hash, never an output hash.
    assert list(a.block_hashes[:96]) == list(d.block_hashes[:96])
    assert (1536 + 10) // 16 == 96
    e = next(iter_mooncake(write(tmp_path, [line(0, 1536, 100, [1, 2, 3])], "e.jsonl"), 16))
    assert common_prefix(a.block_hashes, e.block_hashes) == 96
    assert len(e.block_hashes) == 102
    f = next(iter_mooncake(write(tmp_path, [line(0, 1536, 100, [1, 2, 3])], "f.jsonl"), 16, id_prefix="x"))
    assert not set(e.block_hashes[96:]) & set(f.block_hashes[96:])  # other stream, other salt


def test_sub_hashes_depend_only_on_trace_id_and_position(tmp_path: Path) -> None:
    p = write(tmp_path, [line(0, 1024, 1, [7, 8]), line(1, 2048, 1, [7, 8, 9, 10])])
    a, b = iter_mooncake(p, 128)
    assert list(a.block_hashes) == list(b.block_hashes[:8])
    assert len(set(b.block_hashes)) == len(b.block_hashes)


@given(ids=st.lists(st.integers(0, 2**64 - 1) | st.integers(-(2**70), 2**70), max_size=40),
       per_block=st.integers(1, 80))
def test_trace_blocks_expand_at_once_as_one_by_one(ids: list[int], per_block: int) -> None:
    """A record's trace blocks are expanded in one numpy pass (``_blocks``) where every id
    is a 64-bit unsigned int, else one by one: the same bytes as the definition (``_block``)."""
    e = _Expander(8, "r")
    assert e._blocks(ids, per_block) == b"".join(e._block(h, per_block) for h in ids)


def test_trace_block_expansion_is_pinned() -> None:
    """The sub-hashes of trace blocks 7 and 2**64 - 1 (as every earlier version computed
    them): a faster expansion must not change any replay's hashes."""
    out = array("q")
    out.frombytes(_Expander(8, "r")._blocks([7, 2**64 - 1], 64))
    assert (out[0], out[63], out[64]) == (2486824187403066049, 5881847838151120640, 3302426910161655914)


def test_trailing_partial_smaller_than_a_hash_block(tmp_path: Path) -> None:
    p = write(tmp_path, [line(0, 520, 3, [4, 5]), line(0, 512, 1, [4])])
    a, b = iter_mooncake(p, 16)
    assert len(a.block_hashes) == (520 + 3) // 16 == 32
    assert len(b.block_hashes) == 32
    assert list(a.block_hashes) == list(b.block_hashes)  # both are exactly trace block 4


def test_time_scale_and_arrivals(tmp_path: Path, traces_dir: Path) -> None:
    p = write(tmp_path, [line(0), line(1500), "", line(1500), line(4000)])
    assert [r.arrival_s for r in iter_mooncake(p, 16)] == [0.0, 1.5, 1.5, 4.0]
    assert [r.arrival_s for r in iter_mooncake(p, 16, time_scale=0.5)] == [0.0, 0.75, 0.75, 2.0]
    full = [r.arrival_s for r in iter_mooncake(traces_dir / CONV, 64, limit=2000)]
    quick = [r.arrival_s for r in iter_mooncake(traces_dir / CONV, 64, limit=2000, time_scale=0.25)]
    recs = raw_records(traces_dir / CONV, 2000)
    assert full == [r["timestamp"] / 1000 for r in recs]
    assert quick == pytest.approx([x * 0.25 for x in full])
    assert full[-1] > 100


def test_limit_and_ids(tmp_path: Path) -> None:
    p = write(tmp_path, [line(i) for i in range(10)])
    assert [r.req_id for r in iter_mooncake(p, 16, limit=3)] == ["r000000", "r000001", "r000002"]
    assert list(iter_mooncake(p, 16, limit=0)) == []
    assert len(list(iter_mooncake(p, 16, limit=50))) == 10
    assert next(iter_mooncake(p, 16, id_prefix="m")).req_id == "m000000"


# ----------------------------------------------------------------------------------------------
# Mooncake: streaming
# ----------------------------------------------------------------------------------------------

def test_bad_line_is_reported_only_when_reached(tmp_path: Path) -> None:
    p = write(tmp_path, [line(0), "{not json"])
    it = iter_mooncake(p, 16)
    first = next(it)  # a reader that parses the whole file first would raise here
    assert first.req_id == "r000000"
    with pytest.raises(InputError) as ei:
        next(it)
    assert ei.value.key == "line 2"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a named pipe")
def test_first_request_before_the_writer_finishes(tmp_path: Path) -> None:
    """Read through a pipe: the first request must arrive while the rest is not written yet."""
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    got_first = threading.Event()
    waited_out: list[bool] = []

    def writer() -> None:
        with fifo.open("w") as f:
            f.write(line(0) + "\n")
            f.flush()
            waited_out.append(not got_first.wait(timeout=10))
            f.write(line(7) + "\n")

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    it = iter_mooncake(fifo, 16)
    first = next(it)
    got_first.set()
    rest = list(it)
    t.join(timeout=20)
    assert waited_out == [False], "the reader waited for the end of the file before yielding"
    assert first.arrival_s == 0.0 and [r.arrival_s for r in rest] == [0.007]


# ----------------------------------------------------------------------------------------------
# Mooncake: bad input
# ----------------------------------------------------------------------------------------------

BAD_LINES = {
    "invalid json": '{"timestamp": 0, "input_length": 10',
    "not an object": "[0, 10, 10]",
    "missing timestamp": line(0).replace('"timestamp": 0, ', ""),
    "missing input": line(0).replace('"input_length": 1024, ', ""),
    "missing output": line(0).replace('"output_length": 10, ', ""),
    "missing ids": line(0).replace(', "hash_ids": [0, 1]', ""),
    "float input": line(0, 1024.0, 10, [0, 1]),
    "string input": line(0, "1024", 10, [0, 1]),
    "bool output": line(0, 1024, True, [0, 1]),
    "zero input": line(0, 0, 10, []),
    "negative input": line(0, -5, 10, []),
    "zero output": line(0, 1024, 0, [0, 1]),
    "float output": line(0, 1024, 2.5, [0, 1]),
    "negative timestamp": line(-1, 1024, 10, [0, 1]),
    "string timestamp": line("5", 1024, 10, [0, 1]),
    "decreasing timestamp": line(50, 1024, 10, [0, 1]),
    "too few ids": line(200, 1025, 10, [0, 1]),
    "too many ids": line(200, 1024, 10, [0, 1, 2]),
    "ids not a list": line(200, 1024, 10, "0,1"),
    "negative id": line(200, 1024, 10, [0, -1]),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_its_line(tmp_path: Path, case: str) -> None:
    # line 1 good, line 2 blank, line 3 bad: line numbers are physical lines
    p = write(tmp_path, [line(100), "", BAD_LINES[case]])
    with pytest.raises(InputError) as ei:
        list(iter_mooncake(p, 16))
    err = ei.value
    assert err.key == "line 3"
    assert err.source == str(p)
    assert f"{p}:line 3:" in str(err)
    assert err.problem and err.allowed


def test_bad_line_key_counts_from_one(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r":line 1: "):
        list(iter_mooncake(write(tmp_path, [line(0, 0, 1, [])]), 16))


def test_good_edge_lines_accepted(tmp_path: Path) -> None:
    p = write(tmp_path, ["", line(0.5, 1, 1, [3]), "   ", line(0.5, 513, 1, [3, 4]), ""])
    reqs = list(iter_mooncake(p, 1))
    assert [len(r.block_hashes) for r in reqs] == [2, 514]


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"tokens_per_hash": 7}, "tokens_per_hash"),
    ({"tokens_per_hash": 0}, "tokens_per_hash"),
    ({"tokens_per_hash": 1024}, "tokens_per_hash"),
    ({"tokens_per_hash": 16, "time_scale": 0.0}, "time_scale"),
    ({"tokens_per_hash": 16, "time_scale": float("inf")}, "time_scale"),
    ({"tokens_per_hash": 16, "limit": -1}, "limit"),
])
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, object], key: str) -> None:
    p = write(tmp_path, [line(0)])
    with pytest.raises(InputError) as ei:
        iter_mooncake(p, **kwargs)  # type: ignore[arg-type]
    assert ei.value.key == key


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        iter_mooncake(tmp_path / "nope.jsonl", 16)


# ----------------------------------------------------------------------------------------------
# Request and chain_hash
# ----------------------------------------------------------------------------------------------

def test_request_checks_hash_count() -> None:
    Request("a", 0.0, 33, 1, (1, 2), tokens_per_hash=16)
    with pytest.raises(ValueError, match="block hashes"):
        Request("a", 0.0, 33, 1, (1, 2, 3), tokens_per_hash=16)
    with pytest.raises(ValueError):
        Request("a", 0.0, 0, 1, ())


def test_chain_hash_mixes_both_inputs() -> None:
    values = {chain_hash(p, t) for p in range(50) for t in range(50)}
    assert len(values) == 2500
    assert all(0 <= v < 2**63 for v in values)
    assert chain_hash(2**70, -1) == chain_hash(2**70, -1)
    assert 0 <= chain_hash(-5, 2**80) < 2**63


# ----------------------------------------------------------------------------------------------
# Multi-turn
# ----------------------------------------------------------------------------------------------

def digest(reqs: list[Request]) -> list[tuple[object, ...]]:
    return [(r.req_id, r.arrival_s, r.prompt_tokens, r.output_tokens, tuple(r.block_hashes),
             r.session_id, r.tokens_per_hash) for r in reqs]


SMALL = MultiTurnParams(sessions=40, turns_mean=4.0, first_user_tokens_mean=1500.0,
                        max_context_tokens=16384)


def test_multiturn_deterministic_per_seed() -> None:
    a = digest(list(iter_multiturn(SMALL, 7, 16)))
    b = digest(list(iter_multiturn(SMALL, 7, 16)))
    c = digest(list(iter_multiturn(SMALL, 8, 16)))
    assert a == b
    assert a != c
    assert [x[0] for x in a] != [x[0] for x in c] or [x[1] for x in a] != [x[1] for x in c]


def test_multiturn_turns_extend_previous_sequence() -> None:
    by_session: dict[str, list[Request]] = defaultdict(list)
    for r in iter_multiturn(SMALL, 3, 16):
        assert r.session_id is not None
        by_session[r.session_id].append(r)
    multi = 0
    for turns in by_session.values():
        for t, r in enumerate(turns):
            assert r.req_id == f"{r.session_id}t{t}"
        for prev, nxt in itertools.pairwise(turns):
            multi += 1
            full = prev.prompt_tokens + prev.output_tokens
            assert nxt.prompt_tokens > full
            assert nxt.arrival_s > prev.arrival_s
            n = len(prev.block_hashes)
            assert n == full // 16
            assert list(nxt.block_hashes[:n]) == list(prev.block_hashes)
            assert not set(nxt.block_hashes[n:]) & set(prev.block_hashes)
    assert multi >= 40


def test_multiturn_system_prompt_shared_sessions_apart() -> None:
    for system, tph in ((768, 16), (100, 16), (0, 8)):
        p = replace(SMALL, system_prompt_tokens=system)
        firsts = [r for r in iter_multiturn(p, 1, tph) if r.req_id.endswith("t0")]
        assert len(firsts) == p.sessions
        shared = system // tph
        heads = {tuple(r.block_hashes[:shared]) for r in firsts}
        assert len(heads) == 1
        nxt = {r.block_hashes[shared] for r in firsts}
        assert len(nxt) == len(firsts)
    # and the system prompt does not depend on the seed
    a = next(iter_multiturn(SMALL, 1, 16)).block_hashes[:48]
    b = next(iter_multiturn(SMALL, 2, 16)).block_hashes[:48]
    assert list(a) == list(b)


def test_multiturn_arrival_order_and_counts() -> None:
    reqs = list(iter_multiturn(SMALL, 5, 32))
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] == 0.0
    assert len({r.req_id for r in reqs}) == len(reqs)
    per_session = Counter(r.session_id for r in reqs)
    assert len(per_session) == SMALL.sessions
    assert max(per_session.values()) <= SMALL.turns_max
    assert all(r.prompt_tokens <= SMALL.max_context_tokens for r in reqs)
    # sessions interleave: a later session's request arrives before an earlier session's last turn
    order = [int(str(r.session_id)[1:]) for r in reqs]
    assert order != sorted(order)


def test_multiturn_tight_context_and_limit() -> None:
    p = replace(SMALL, max_context_tokens=2000, first_user_tokens_mean=5000.0)
    reqs = list(iter_multiturn(p, 2, 16))
    assert all(r.prompt_tokens <= 2000 for r in reqs)
    assert sum(r.req_id.endswith("t0") for r in reqs) == p.sessions  # first prompt clipped, not dropped
    assert len(list(iter_multiturn(p, 2, 16, limit=5))) == 5
    assert list(iter_multiturn(p, 2, 16, limit=0)) == []
    assert digest(list(iter_multiturn(p, 2, 16, limit=7))) == digest(reqs[:7])


def test_multiturn_defaults_resemble_conversation_trace() -> None:
    reqs = list(iter_multiturn(replace(MultiTurnParams(), sessions=1500), 0, 512))
    prompts = sorted(r.prompt_tokens for r in reqs)
    mean = sum(prompts) / len(prompts)
    p50 = prompts[len(prompts) // 2]
    out_mean = sum(r.output_tokens for r in reqs) / len(reqs)
    assert 9000 < mean < 15000
    assert 5000 < p50 < 9000
    assert 300 < out_mean < 390
    head = reqs[: len(reqs) * 3 // 4]
    assert 2.8 < len(head) / head[-1].arrival_s < 4.0


def test_multiturn_creates_sessions_lazily() -> None:
    huge = replace(MultiTurnParams(), sessions=50_000)
    t0 = time.perf_counter()
    first = list(itertools.islice(iter_multiturn(huge, 0, 16), 20))
    # Building all sessions up front costs about half a millisecond each (>= 25 s here).
    assert time.perf_counter() - t0 < 3.0
    assert len(first) == 20


def test_multiturn_holds_only_live_sessions() -> None:
    p = replace(MultiTurnParams(), sessions=800, turns_mean=4.0, first_user_tokens_mean=300.0,
                followup_user_tokens_mean=100.0, output_tokens_mean=50.0, think_time_mean_s=2.0)
    tracemalloc.start()
    try:
        total = 0
        for r in iter_multiturn(p, 0, 16):
            total += len(r.block_hashes)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Keeping every request (or every finished session) would need 8 bytes per hash at least.
    assert total * 8 > 2 * 2**20
    assert peak < total * 8 / 4, (peak, total)


@pytest.mark.parametrize(("field", "value"), [
    ("sessions", 0), ("session_rate_per_s", 0.0), ("turns_mean", 0.5), ("turns_max", 0),
    ("system_prompt_tokens", -1), ("first_user_tokens_mean", 0.0), ("output_tokens_mean", float("nan")),
    ("max_context_tokens", 768), ("think_time_mean_s", -1.0), ("user_tokens_sigma", -0.1),
])
def test_validate_params(field: str, value: object) -> None:
    validate_params(MultiTurnParams())
    bad = replace(MultiTurnParams(), **{field: value})
    with pytest.raises(InputError) as ei:
        validate_params(bad)
    assert ei.value.key == field
    with pytest.raises(InputError):
        iter_multiturn(bad, 0, 16)


# ----------------------------------------------------------------------------------------------
# Independence from PYTHONHASHSEED
# ----------------------------------------------------------------------------------------------

_DIGEST_SCRIPT = r"""
import hashlib, sys
from sim.io.workload import MultiTurnParams, iter_mooncake, iter_multiturn
h = hashlib.sha256()
p = MultiTurnParams(sessions=6, turns_mean=3.0)
for r in list(iter_multiturn(p, 11, 16)) + list(iter_mooncake(sys.argv[1], 16, id_prefix="q")):
    h.update(repr((r.req_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.session_id)).encode())
    h.update(repr(list(r.block_hashes)).encode())
print(h.hexdigest())
"""


def test_results_do_not_depend_on_pythonhashseed(tmp_path: Path) -> None:
    trace = write(tmp_path, [line(0, 1300, 40, [1, 2, 3]), line(3, 700, 9, [1, 5])])
    digests = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT, str(trace)], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True, timeout=120)
        digests.append(res.stdout.strip())
    assert len(digests[0]) == 64
    assert digests[0] == digests[1]
