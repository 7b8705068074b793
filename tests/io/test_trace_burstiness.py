"""Burstiness and reuse-distance statistics of ``kvsim trace stats``, and ``arrival_jitter_s``."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.errors import InputError
from sim.io import workload
from sim.io.scenario import load_run
from sim.io.traces import format_stats, trace_stats
from sim.io.workload import Request, iter_mooncake

# (timestamp ms, hash_ids): bursts of 3 at 0 s and 2 at 3 s, singletons at 1 s and 7 s.
TRACE = [(0, [1, 2]), (0, [1, 3]), (0, [4]), (1000, [1, 2, 5]), (3000, [6]), (3000, [1, 3]), (7000, [1])]

HEAD = """schema = "run/1"
name = "j"
seed = 7
[model]
groups = [{ kind = "full", tokens_per_block = 16, layers = 2, kv_heads = 2, head_size = 64 }]
[hardware]
gpu_blocks = 4000
[cpu_cache]
chunks = 1000
[costs]
step = "zero"
transfer = "zero"
"""


def write_trace(tmp_path: Path, rows: list[tuple[int, list[int]]], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps({"timestamp": ms, "input_length": 512 * len(ids), "output_length": 4,
                                     "hash_ids": ids}) + "\n" for ms, ids in rows))
    return p


def pct(values: list[float], q: float) -> float:
    """Linear-interpolation percentile, computed directly."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def direct_stats(rows: list[tuple[int, list[int]]]) -> dict[str, object]:
    """The burstiness and reuse-distance figures, by brute force (no streaming)."""
    times = [ms / 1000 for ms, _ in rows]
    counts = {t: times.count(t) for t in times}
    gaps = [b - a for a, b in itertools.pairwise(times)]
    distinct = sorted(counts)
    dgaps = [b - a for a, b in itertools.pairwise(distinct)]
    dist_req: list[float] = []
    dist_s: list[float] = []
    for i, (_, ids) in enumerate(rows):
        for pos, h in enumerate(ids):
            if h in ids[:pos]:
                prev = i
            else:
                earlier = [j for j in range(i) if h in rows[j][1]]
                if not earlier:
                    continue
                prev = earlier[-1]
            dist_req.append(i - prev)
            dist_s.append(times[i] - times[prev])
    biggest = max(counts.values())
    return {
        "distinct_times": len(distinct),
        "largest_burst": biggest,
        "largest_burst_at_s": min(t for t, c in counts.items() if c == biggest),
        "simultaneous_ratio": sum(c for c in counts.values() if c > 1) / len(times),
        "interarrival_cv": statistics.pstdev(gaps) / statistics.fmean(gaps),
        "interarrival_cv_distinct": statistics.pstdev(dgaps) / statistics.fmean(dgaps),
        "mean_interarrival_s": statistics.fmean(gaps),
        "reuse_distance_requests": {"p50": pct(dist_req, 0.5), "p90": pct(dist_req, 0.9),
                                    "max": max(dist_req)},
        "reuse_distance_s": {"p50": pct(dist_s, 0.5), "p90": pct(dist_s, 0.9), "max": max(dist_s)},
    }


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------

def test_burstiness_stats_match_a_direct_computation(tmp_path: Path) -> None:
    stats = trace_stats(write_trace(tmp_path, TRACE))
    want = direct_stats(TRACE)
    a = stats["arrivals"]
    # the hand-checked figures
    assert a["distinct_times"] == 4 and a["largest_burst"] == 3 and a["largest_burst_at_s"] == 0.0
    assert a["simultaneous_ratio"] == pytest.approx(5 / 7)
    # gaps [0, 0, 1, 2, 0, 4] (mean 7/6), distinct-time gaps [1, 2, 4] (mean 7/3)
    assert a["mean_interarrival_s"] == pytest.approx(7 / 6)
    assert a["interarrival_cv"] == pytest.approx(statistics.pstdev([0, 0, 1, 2, 0, 4]) / (7 / 6))
    assert a["interarrival_cv_distinct"] == pytest.approx(statistics.pstdev([1, 2, 4]) / (7 / 3))
    for key in ("distinct_times", "largest_burst", "largest_burst_at_s", "simultaneous_ratio",
                "interarrival_cv", "interarrival_cv_distinct", "mean_interarrival_s"):
        assert a[key] == pytest.approx(want[key]), key
    h = stats["hash_ids"]
    # reuses: r1 h1 (1 req, 0 s); r3 h1 (2, 1 s), h2 (3, 1 s); r5 h1 (2, 2 s), h3 (4, 3 s); r6 h1 (1, 4 s)
    assert h["reuse_distance_requests"] == {"p50": 2.0, "p90": 3.5, "max": 4.0}
    assert h["reuse_distance_s"] == pytest.approx({"p50": 1.5, "p90": 3.5, "max": 4.0})
    assert h["reuse_distance_requests"] == pytest.approx(want["reuse_distance_requests"])
    assert h["reuse_distance_s"] == pytest.approx(want["reuse_distance_s"])
    assert h["reused_refs"] == 6
    assert h["unique_blocks"] == 6 and h["block_refs"] == 12


def test_burstiness_on_a_larger_synthetic_trace(tmp_path: Path) -> None:
    rows: list[tuple[int, list[int]]] = []
    ms = 0
    for i in range(200):
        ms += (i * 37) % 5 * 250              # gaps of 0, 250, ... 1000 ms: bursts
        rows.append((ms, [1, 10 + i % 7, 100 + i % 13] if i % 3 else [1000 + i]))
    stats = trace_stats(write_trace(tmp_path, rows))
    want = direct_stats(rows)
    for key, value in stats["arrivals"].items():
        assert value == pytest.approx(want[key]), key
    for key in ("reuse_distance_requests", "reuse_distance_s"):
        assert stats["hash_ids"][key] == pytest.approx(want[key]), key


def test_format_stats_shows_burstiness_and_reuse_distance(tmp_path: Path) -> None:
    text = format_stats(trace_stats(write_trace(tmp_path, TRACE)))
    assert "arrival times" in text and "4 distinct for 7 requests" in text
    assert "largest burst" in text and "3 requests at 0.000 s" in text
    assert "71.4% of requests" in text
    assert "inter-arrival CV" in text
    assert "reuse distance" in text and "p50 2 / p90 3.5 / max 4 requests" in text


def test_single_request_and_no_reuse(tmp_path: Path) -> None:
    stats = trace_stats(write_trace(tmp_path, [(5, [1, 2])]))
    a = stats["arrivals"]
    assert a["distinct_times"] == 1 and a["largest_burst"] == 1 and a["simultaneous_ratio"] == 0.0
    assert a["interarrival_cv"] is None and a["interarrival_cv_distinct"] is None
    assert stats["hash_ids"]["reuse_distance_requests"] is None
    assert stats["hash_ids"]["reuse_distance_s"] is None
    format_stats(stats)   # no reuse, no gaps: still prints
    # all at one instant: the gaps are all zero, so no CV
    stats = trace_stats(write_trace(tmp_path, [(5, [1]), (5, [1])], "b.jsonl"))
    assert stats["arrivals"]["interarrival_cv"] is None and stats["arrivals"]["largest_burst"] == 2
    assert stats["arrivals"]["simultaneous_ratio"] == 1.0


# ----------------------------------------------------------------------------------------------
# arrival_jitter_s
# ----------------------------------------------------------------------------------------------

def stream(tmp_path: Path, rows: list[tuple[int, list[int]]] = TRACE) -> Iterator[Request]:
    p = tmp_path / "t.jsonl"
    if not p.exists():
        write_trace(tmp_path, rows)
    return iter_mooncake(p, 16)


def bursty_rows() -> list[tuple[int, list[int]]]:
    # 60 requests in bursts of 1..6 at 0, 300, 600 ... ms
    rows: list[tuple[int, list[int]]] = []
    ms = 0
    while len(rows) < 60:
        rows += [(ms, [len(rows)])] * (1 + ms // 300 % 6)
        ms += 300
    return rows[:60]


def key(reqs: list[Request]) -> list[tuple[str, float]]:
    return [(r.req_id, r.arrival_s) for r in reqs]


def test_jitter_zero_is_the_original_stream(tmp_path: Path) -> None:
    base = list(stream(tmp_path))
    same = list(workload.jitter_arrivals(stream(tmp_path), 0.0, 1))
    assert key(same) == key(base)
    assert [list(r.block_hashes) for r in same] == [list(r.block_hashes) for r in base]


@pytest.mark.parametrize("jitter", [0.05, 0.25, 2.5])   # below, near and above the 0.3 s gaps
def test_jitter_is_sorted_bounded_and_deterministic(tmp_path: Path, jitter: float) -> None:
    rows = bursty_rows()
    base = list(stream(tmp_path, rows))
    got = list(workload.jitter_arrivals(stream(tmp_path, rows), jitter, 3))
    assert key(got) == key(list(workload.jitter_arrivals(stream(tmp_path, rows), jitter, 3)))   # same seed
    assert key(got) != key(list(workload.jitter_arrivals(stream(tmp_path, rows), jitter, 4)))   # other seed
    arrivals = [r.arrival_s for r in got]
    assert arrivals == sorted(arrivals)
    assert sorted(r.req_id for r in got) == sorted(r.req_id for r in base)
    orig = {r.req_id: r for r in base}
    sizes: dict[float, int] = {}
    for r in base:
        sizes[r.arrival_s] = sizes.get(r.arrival_s, 0) + 1
    moved = 0
    for r in got:
        t = orig[r.req_id].arrival_s
        if sizes[t] == 1:
            assert r.arrival_s == t                       # alone at its time: not moved
        else:
            assert t <= r.arrival_s < t + jitter          # spread over [t, t + jitter)
            moved += r.arrival_s != t
        assert list(r.block_hashes) == list(orig[r.req_id].block_hashes)
    assert moved >= 40
    # ties are gone: every burst is spread
    assert len(set(arrivals)) == len(arrivals)


def test_jitter_rejects_bad_values(tmp_path: Path) -> None:
    for bad in (-0.1, math.inf, math.nan, True, "1"):
        with pytest.raises(InputError, match="arrival_jitter_s"):
            workload.jitter_arrivals(stream(tmp_path), bad, 0)  # type: ignore[arg-type]


def scenario(tmp_path: Path, extra: str, kind: str = "mooncake", path: str = "t.jsonl") -> Path:
    p = tmp_path / "s.toml"
    p.write_text(HEAD + f'[workload]\nkind = "{kind}"\npath = "{path}"\n' + extra)
    return p


def test_scenario_accepts_an_integer_jitter(tmp_path: Path) -> None:
    write_trace(tmp_path, TRACE)
    assert load_run(scenario(tmp_path, "arrival_jitter_s = 1\n")).scenario.workload.arrival_jitter_s == 1


def test_scenario_arrival_jitter(tmp_path: Path) -> None:
    write_trace(tmp_path, bursty_rows())
    base = list(load_run(scenario(tmp_path, "")).requests())
    zero = list(load_run(scenario(tmp_path, "arrival_jitter_s = 0.0\n")).requests())
    assert key(zero) == key(base)
    # off: the resolved scenario does not name it (byte-identical to before the key existed)
    off = load_run(scenario(tmp_path, "arrival_jitter_s = 0.0\n")).resolved()["workload"]
    assert "arrival_jitter_s" not in off
    spec = load_run(scenario(tmp_path, "arrival_jitter_s = 0.2\n"))
    got = list(spec.requests())
    assert key(got) == key(list(spec.requests()))
    # the scenario seed (7) drives the offsets
    assert key(got) == key(list(workload.jitter_arrivals(iter(base), 0.2, 7)))
    assert [r.arrival_s for r in got] == sorted(r.arrival_s for r in got)
    assert key(got) != key(base)
    assert spec.resolved()["workload"]["arrival_jitter_s"] == 0.2
    # loads back from the resolved scenario to the same stream
    again = tmp_path / "resolved.toml"
    again.write_text(spec.resolved_toml())
    assert key(list(load_run(again).requests())) == key(got)
    # rate_scale first, then the jitter: the spread is in the run's seconds
    fast = list(load_run(scenario(tmp_path, "arrival_jitter_s = 0.2\nrate_scale = 2.0\n")).requests())
    by_id = {r.req_id: r.arrival_s / 2.0 for r in base}
    assert all(by_id[r.req_id] <= r.arrival_s < by_id[r.req_id] + 0.2 for r in fast)


def test_scenario_arrival_jitter_csv_trace(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("arrival_s,input_tokens,output_tokens\n"
                                    + "".join(f"{i // 4 * 1.0},100,5\n" for i in range(12)))
    got = list(load_run(scenario(tmp_path, "arrival_jitter_s = 0.5\n", "trace", "t.csv")).requests())
    arrivals = [r.arrival_s for r in got]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == 12
    orig = {f"r{i:06d}": i // 4 * 1.0 for i in range(12)}
    assert all(orig[r.req_id] <= r.arrival_s < orig[r.req_id] + 0.5 for r in got)


@pytest.mark.parametrize("value", ["-0.5", "inf", "nan", '"x"'])
def test_scenario_rejects_bad_jitter(tmp_path: Path, value: str) -> None:
    write_trace(tmp_path, TRACE)
    with pytest.raises(InputError) as info:
        load_run(scenario(tmp_path, f"arrival_jitter_s = {value}\n"))
    assert info.value.key == "workload.arrival_jitter_s" and "unknown" not in info.value.problem


def test_real_trace_burstiness(traces_dir: Path) -> None:
    stats = trace_stats(traces_dir / "conversation_trace.jsonl")
    a = stats["arrivals"]
    assert stats["requests"] == 12031
    assert a["distinct_times"] == 1180 and a["largest_burst"] == 28
