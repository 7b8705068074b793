"""LRU, ARC and the clairvoyant Belady side by side on the Mooncake
conversation trace, in the setting of the exact LRU table of
../shared/traces/README.md (one full-attention group, 512-token chunks, no GPU
prefix cache, zero compute and transfer time, 8192 tokens per step; as
tests/tools/test_mooncake_belady.py).

Prints the token-weighted CPU hit ratio (the summary's ``cpu_hit_rate``) and
the block-weighted one (the README's unit) per capacity and policy.

    python benchmarks/mooncake_policies.py [TRACES_DIR] [CAPACITY ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sim.startup  # first: a signal during the heavy imports below ends in one line
from tests.tools.test_mooncake_belady import engine_hit_ratios
from tests.tools.test_mooncake_lru import CAPACITIES, reference_row

POLICIES = ("lru", "arc", "belady")


def main() -> None:
    shared = Path(__file__).resolve().parents[2] / "shared" / "traces"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("args", nargs="*", metavar="[TRACES_DIR] [CAPACITY ...]",
                    help="the folder of conversation_trace.jsonl and README.md (default: $KVSIM_TRACES or "
                         "../shared/traces), then capacities in chunks (default: the README's)")
    args = ap.parse_args().args
    traces = Path(os.environ.get("KVSIM_TRACES") or shared)
    if args and not args[0].isdigit():
        traces = Path(args.pop(0))
    if not all(a.isdigit() and int(a) > 0 for a in args):
        ap.error(f"capacities: positive integers (chunks), got {' '.join(args)}")
    caps = tuple(int(a) for a in args) or CAPACITIES
    for name in ("README.md", "conversation_trace.jsonl"):
        if not (traces / name).is_file():
            ap.error(f"{traces}: no {name} there (the folder of the Mooncake traces and their README)")
    ref = reference_row(traces / "README.md")
    trace = traces / "conversation_trace.jsonl"
    print(f"trace {trace}; 1 full group, 512-token chunks, no GPU prefix cache, zero time, 8192 tokens/step")
    print("| capacity (chunks) | exact LRU, blocks (README) | LRU tokens / blocks | ARC tokens / blocks "
          "| Belady tokens / blocks | wall s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for cap in caps:
        t = time.perf_counter()
        got = {p: engine_hit_ratios(trace, cap, p) for p in POLICIES}
        cells = " | ".join(f"{got[p][1]:.4f} / {got[p][0]:.4f}" for p in POLICIES)
        wall = time.perf_counter() - t
        print(f"| {cap:,} | {ref.get(cap, float('nan')):.3f} | {cells} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    sim.startup.run_script(main)
