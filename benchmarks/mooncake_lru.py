"""Side-by-side: the engine's block-weighted CPU hit ratio on the Mooncake
conversation trace vs the exact LRU figures of ../shared/traces/README.md.

Setting (as in tests/test_mooncake_lru.py): one full-attention group, 512-token
chunks, no GPU prefix cache, zero compute and transfer time, LRU.

    python benchmarks/mooncake_lru.py [TRACES_DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sim.startup  # first: a signal during the heavy imports below ends in one line
from tests.tools.test_mooncake_lru import CAPACITIES, engine_lru_hit_ratio, reference_row


def main() -> None:
    shared = Path(__file__).resolve().parents[2] / "shared" / "traces"
    default = Path(os.environ.get("KVSIM_TRACES") or shared)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="?", type=Path, default=default,
                    help="the folder of conversation_trace.jsonl and README.md (default: $KVSIM_TRACES or "
                         "../shared/traces)")
    traces = ap.parse_args().traces
    for name in ("README.md", "conversation_trace.jsonl"):
        if not (traces / name).is_file():
            ap.error(f"{traces}: no {name} there (the folder of the Mooncake traces and their README)")
    ref = reference_row(traces / "README.md")
    print("| capacity (chunks) | exact LRU (README) | kvsim engine | difference (pp) | wall s |")
    print("|---:|---:|---:|---:|---:|")
    for cap in CAPACITIES:
        t = time.perf_counter()
        got = engine_lru_hit_ratio(traces / "conversation_trace.jsonl", cap)
        print(f"| {cap:,} | {ref[cap]:.3f} | {got:.4f} | {100 * (got - ref[cap]):+.2f} | "
              f"{time.perf_counter() - t:.1f} |", flush=True)


if __name__ == "__main__":
    sim.startup.run_script(main)
