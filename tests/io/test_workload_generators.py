"""Agentic preset, several system prompts, uniform requests, stream transforms."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from sim.errors import InputError
from sim.io.workload import (
    AGENTIC,
    MultiTurnParams,
    UniformParams,
    iter_multiturn,
    iter_uniform,
    sample,
    scale_rate,
    take,
)
from tests.helpers import common_prefix


def test_agentic_sessions_share_a_long_prefix_and_append_little() -> None:
    reqs = list(iter_multiturn(AGENTIC, 3, 16, limit=300))
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    sessions = list(by_session.values())
    # every pair of sessions shares the whole tool prefix (6144 tokens = 384 hashes)
    a, b = sessions[0][0], sessions[1][0]
    assert common_prefix(list(a.block_hashes), list(b.block_hashes)) == 6144 // 16
    # appends are short compared with the context: a later turn extends the previous one
    long = max(sessions, key=len)
    assert len(long) >= 5
    for prev, nxt in itertools.pairwise(long):
        full_prev = (prev.prompt_tokens + prev.output_tokens) // 16
        assert list(nxt.block_hashes[:full_prev]) == list(prev.block_hashes[:full_prev])
    appends = [n.prompt_tokens - (p.prompt_tokens + p.output_tokens) for p, n in itertools.pairwise(long)]
    assert sum(appends) / len(appends) < 0.3 * long[-1].prompt_tokens


def test_several_system_prompts_split_sessions_into_groups() -> None:
    p = replace(MultiTurnParams(), sessions=60, turns_mean=1.0, system_prompt_tokens=1024, system_prompts=3)
    firsts = [r for r in iter_multiturn(p, 1, 16) if r.req_id.endswith("t0")]
    heads = {tuple(r.block_hashes[:64]) for r in firsts}
    assert len(heads) == 3
    one = replace(p, system_prompts=1)
    assert len({tuple(r.block_hashes[:64]) for r in iter_multiturn(one, 1, 16)}) == 1


def test_one_system_prompt_keeps_the_historical_stream() -> None:
    p = MultiTurnParams(sessions=5)
    a = [(r.req_id, r.arrival_s, list(r.block_hashes)) for r in iter_multiturn(p, 2, 16)]
    b = [(r.req_id, r.arrival_s, list(r.block_hashes))
         for r in iter_multiturn(replace(p, system_prompts=1), 2, 16)]
    assert a == b


def test_uniform_requests_share_nothing_and_follow_the_bounds() -> None:
    p = UniformParams(requests=200, rate_per_s=10.0, input_tokens_min=100, input_tokens_max=300,
                      output_tokens_min=5, output_tokens_max=9)
    reqs = list(iter_uniform(p, 0, 16))
    assert len(reqs) == 200
    assert all(100 <= r.prompt_tokens <= 300 and 5 <= r.output_tokens <= 9 for r in reqs)
    firsts = [r.block_hashes[0] for r in reqs]
    assert len(set(firsts)) == 200
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and 10 < arrivals[-1] < 40   # ~20 s at 10/s
    again = [(r.req_id, r.arrival_s, r.prompt_tokens) for r in iter_uniform(p, 0, 16)]
    assert again == [(r.req_id, r.arrival_s, r.prompt_tokens) for r in reqs]
    other = [(r.arrival_s, r.prompt_tokens) for r in iter_uniform(p, 1, 16)]
    assert other != [(r.arrival_s, r.prompt_tokens) for r in reqs]


def test_uniform_rejects_bad_bounds() -> None:
    with pytest.raises(InputError, match="input_tokens_max"):
        list(iter_uniform(UniformParams(input_tokens_min=10, input_tokens_max=5), 0, 16))


def test_scale_rate_sample_take() -> None:
    base = list(iter_uniform(UniformParams(requests=1000), 0, 16))
    fast = list(scale_rate(iter(base), 4.0))
    assert [r.arrival_s for r in fast] == [r.arrival_s / 4.0 for r in base]
    assert [r.req_id for r in fast] == [r.req_id for r in base]
    kept = list(sample(iter(base), 0.25, seed=7))
    assert 180 < len(kept) < 320
    assert [r.req_id for r in kept] == [r.req_id for r in sample(iter(base), 0.25, seed=7)]
    assert {r.req_id for r in kept} != {r.req_id for r in sample(iter(base), 0.25, seed=8)}
    assert len(list(take(iter(base), 17))) == 17
    assert list(take(iter(base), None)) == base
    with pytest.raises(InputError, match="rate_scale"):
        scale_rate(iter(base), 0)
    with pytest.raises(InputError, match="sample"):
        sample(iter(base), 1.5, 0)
