"""Decisions per second of the clock-free core.

A decision = lookup + GPU allocation + load plan for one new request, on a
pre-built layout and CPU/GPU state (parsing excluded). State is rebuilt,
untimed, before every timed iteration, so every decision starts fresh.

Cases: the spec §6 unaligned-hit case (boundary 3904, left chunk present, a
10-chunk load) under OLD and NEW, and a 131,072-token prompt on the same
layout with the whole prefix stored (a 4-full + 3-window-group load of
~130k tokens).

Usage: python benchmarks/bench_decisions.py [--iterations N]
"""

from __future__ import annotations

import argparse
import platform
import time

from sim.io.check import build_world, parse_check

SPEC6_GROUPS = [
    {"kind": "full", "tokens_per_block": 256},
    {"kind": "sliding_window", "tokens_per_block": 64, "window": 128},
    {"kind": "sliding_window", "tokens_per_block": 8, "window": 128},
]


def spec6() -> dict[str, object]:
    return {"schema": "check/1", "blocks_per_chunk": 4, "tokens_per_hash": 8, "num_tokens": 4353,
            "groups": SPEC6_GROUPS,
            "chunk_states": {"0": {"0..3": "present"}, "1": {"14..15": "present"},
                             "2": {"118..121": "present"}}}


def long_prompt(tokens: int = 131_072) -> dict[str, object]:
    n = [tokens // t for t in (1024, 256, 32)]
    return {"schema": "check/1", "blocks_per_chunk": 4, "tokens_per_hash": 8, "num_tokens": tokens,
            "cpu_capacity_chunks": sum(n),
            "groups": SPEC6_GROUPS,
            "chunk_states": {str(g): {f"0..{k - 1}": "present"} for g, k in enumerate(n)}}


def bench(name: str, data: dict[str, object], logic: str, iterations: int) -> float:
    sc = parse_check(data, name)
    case = sc.case(name)
    total = 0.0
    outcome = None
    for _ in range(iterations):
        world = build_world(case, logic)  # fresh state, untimed
        t0 = time.perf_counter()
        outcome = world.decide()
        total += time.perf_counter() - t0
    rate = iterations / total
    assert outcome is not None
    print(f"{name:<22} {logic:<4} {rate:>12,.0f} decisions/s   "
          f"({total / iterations * 1e6:8.1f} us each; hit {outcome['external_tokens']}, "
          f"{len(outcome['load_keys'])} chunks loaded)")
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20_000)
    ap.add_argument("--long-iterations", type=int, default=200)
    args = ap.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, "
          f"iterations {args.iterations} (long prompt {args.long_iterations})")
    print("layout: full bs256 / sliding_window bs64 W128 / sliding_window bs8 W128, "
          "blocks_per_chunk 4, tokens_per_hash 8, LRU, 1 worker, GPU prefix caching on")
    rates = {}
    for logic in ("old", "new"):
        rates[logic] = bench("spec6 (4353, B=3904)", spec6(), logic, args.iterations)
    for logic in ("old", "new"):
        bench("131072-token prompt", long_prompt(), logic, args.long_iterations)
    print(f"ratio new/old on spec6: {rates['new'] / rates['old']:.2f}; "
          f"target >= 50,000/s: {'met' if min(rates.values()) >= 50_000 else 'NOT met'}")


if __name__ == "__main__":
    main()
