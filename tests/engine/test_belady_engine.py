"""The ``belady`` eviction policy through a whole run: a scenario selects it,
the run is deterministic, ends with every invariant holding, and on a
multi-turn chat workload with a small CPU cache hits at least as often as LRU
and ARC (a sanity check of the wiring; the Mooncake comparison is in
tests/tools/test_mooncake_belady.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.engine.loop import simulate
from sim.engine.metrics import Recorder
from sim.io.scenario import load_run
from tests.engine.test_engine import MemorySink

SCENARIO = """schema = "run/1"
name = "belady"
[model]
name = "hybrid-demo"
[hardware]
profile = "h200"
gpu_kv_bytes = "1GiB"
[cpu_cache]
capacity = "{capacity}"
policy = "{policy}"
[scheduler]
blocks_per_chunk = 4
[workload]
kind = "multiturn"
sessions = 30
session_rate_per_s = 1.0
think_time_mean_s = 5.0
first_user_tokens_mean = 3000.0
max_context_tokens = 16000
limit = 80
"""


def run(tmp_path: Path, policy: str, capacity: str = "1GiB") -> dict:
    f = tmp_path / f"{policy}-{capacity}.toml"
    f.write_text(SCENARIO.format(policy=policy, capacity=capacity))
    spec = load_run(f)
    res = simulate(spec.engine_config(), spec.requests(), Recorder(MemorySink()))
    assert res.status == "ok"            # the end-of-run invariants held
    return res.summary.figures()


def test_belady_runs_deterministically_and_hits_at_least_as_often_as_lru_and_arc(tmp_path: Path) -> None:
    b = run(tmp_path, "belady")
    assert b == run(tmp_path, "belady")
    assert b["requests"]["finished"] == b["requests"]["arrived"] > 40
    for other in ("lru", "arc"):
        assert b["cpu_hit_rate"] >= run(tmp_path, other)["cpu_hit_rate"]


def test_belady_with_room_for_everything_equals_lru(tmp_path: Path) -> None:
    """Nothing is ever evicted, so the policy cannot matter."""
    assert run(tmp_path, "belady", "64GiB")["tokens"] == run(tmp_path, "lru", "64GiB")["tokens"]


@pytest.mark.parametrize("bad", ["fifo", "Belady"])
def test_an_unknown_policy_is_one_line_naming_belady(tmp_path: Path, bad: str) -> None:
    from sim.errors import InputError

    f = tmp_path / "bad.toml"
    f.write_text(SCENARIO.format(policy=bad, capacity="1GiB"))
    with pytest.raises(InputError, match="belady"):
        load_run(f)
