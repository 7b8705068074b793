"""Issue 17's acceptance check through the whole engine: a request alone on an idle Llama 3.1 8B
engine (the shipped model file and H100 profile, ``costs.step = "auto"``) has a TTFT equal to its
chunked prefill's modelled time plus the engine core's hashing of its prompt, and a 90,000-token
prompt's is more than 90 times a 1,000-token one's."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.engine.loop import simulate
from sim.engine.metrics import MemorySink, Recorder
from sim.io.scenario import load_run
from sim.model.costs import chunked_prefill_time
from tests.engine.worlds import req

RUN = """
schema = "run/1"
[model]
name = "llama-3.1-8b"
[hardware]
profile = "h100"
[cpu_cache]
chunks = 0
[scheduler]
max_num_batched_tokens = 8192
"""


def ttft(tmp_path: Path, prompt: int) -> tuple[float, float]:
    f = tmp_path / "run.toml"
    f.write_text(RUN)
    spec = load_run(f)
    sink = MemorySink()
    res = simulate(spec.engine_config(), [req("a", 0.0, prompt, 2, prefix=1)], Recorder(sink))
    assert res.status == "ok"
    row = sink.frames()["requests"].iloc[0]
    hashing = spec.engine_config().prompt_hash_s_per_block * (prompt // 16)   # before the scheduler sees it
    assert hashing > 0
    return float(row.ttft_s), hashing + chunked_prefill_time(spec.step_cost, spec.layout, prompt, 8192)


def test_90k_prompt_ttft_is_more_than_90x_a_1k_prompt(tmp_path: Path) -> None:
    short, short_model = ttft(tmp_path, 1_008)      # whole hash blocks of 16 tokens
    long, long_model = ttft(tmp_path, 90_000)
    assert short == pytest.approx(short_model, rel=1e-12)
    assert long == pytest.approx(long_model, rel=1e-12)
    assert long > 90 * short
