"""Side-by-side: the engine's block-weighted CPU hit ratio on the Mooncake
conversation trace vs the exact LRU figures of ../shared/traces/README.md.

Setting (as in tests/test_mooncake_lru.py): one full-attention group, 512-token
chunks, no GPU prefix cache, zero compute and transfer time, LRU.

    python benchmarks/mooncake_lru.py [TRACES_DIR]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.tools.test_mooncake_lru import CAPACITIES, engine_lru_hit_ratio, reference_row


def main() -> None:
    shared = Path(__file__).resolve().parents[2] / "shared" / "traces"
    default = Path(os.environ.get("KVSIM_TRACES") or shared)
    traces = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    ref = reference_row(traces / "README.md")
    print("| capacity (chunks) | exact LRU (README) | kvsim engine | difference (pp) | wall s |")
    print("|---:|---:|---:|---:|---:|")
    for cap in CAPACITIES:
        t = time.perf_counter()
        got = engine_lru_hit_ratio(traces / "conversation_trace.jsonl", cap)
        print(f"| {cap:,} | {ref[cap]:.3f} | {got:.4f} | {100 * (got - ref[cap]):+.2f} | "
              f"{time.perf_counter() - t:.1f} |", flush=True)


if __name__ == "__main__":
    main()
