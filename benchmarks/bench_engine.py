"""Engine replay speed: simulated requests per wall second and peak RSS.

Two cases, each measured in its own child process (so peak RSS is its own):

* ``default``: ``scenarios/default.toml`` as shipped (synthetic multi-turn,
  hybrid layout, H200, costs and transfers on);
* ``mooncake-spec6``: the Mooncake conversation trace (all 12,031 requests,
  real arrival times) on the spec §6 layout (full 256 / sliding window 64 and
  8, W 128, 4 blocks per chunk, 8 tokens per hash), GPU prefix caching on, a
  CPU cache of 100,000 chunks with LRU, the H200 profile (step time of the
  ``qwen3-30b-a3b`` cost profile, a 3B-active MoE: a dense 8B model cannot
  keep up with the trace's 41k prompt tokens/s on one GPU, and the queue
  would then grow without bound), PCIe Gen5 links, offloading and timing on.

The target of the engine issue is >= 6,000 simulated requests per second and
<= 300 MB peak RSS on a 2-core machine; the script prints the ratio to it.

    python benchmarks/bench_engine.py [--limit N] [--profile] [--case NAME ...]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

from sim.engine.loop import simulate
from sim.engine.metrics import Recorder
from sim.io.scenario import load_run

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
TARGET_RPS = 6000.0
TARGET_RSS_MB = 300.0

CASES = {
    "default": {"scenario": str(ROOT / "scenarios" / "default.toml"), "set": []},
    "mooncake-spec6": {
        "scenario": str(ROOT / "scenarios" / "default.toml"),
        "set": [
            'name="mooncake-spec6"',
            'model.name="spec6"',
            'model.cost_profile="qwen3-30b-a3b"',
            'hardware.profile="h200"',
            "hardware.gpu_blocks=60000",
            "cpu_cache.chunks=100000",
            'cpu_cache.policy="lru"',
            "scheduler.blocks_per_chunk=4",
            "scheduler.tokens_per_hash=8",
            "scheduler.prefix_caching=true",
            f'workload={{kind="mooncake", path="{TRACE}"}}',
            'costs.step="auto"',
            'costs.transfer="hardware"',
        ],
    },
}


class _Discard:
    def write(self, table: str, columns: dict[str, list[object]]) -> None:
        pass


def child(case: str, limit: int | None, profile: bool) -> None:
    """Run one case in this process and print one JSON line of figures."""
    spec = CASES[case]
    sets = list(spec["set"])
    if limit:
        sets.append(f"workload.limit={limit}")
    run = load_run(spec["scenario"], sets)
    cfg = run.engine_config()
    t0 = time.perf_counter()
    if profile:
        prof = cProfile.Profile()
        res = prof.runcall(simulate, cfg, run.requests(), Recorder(_Discard()))
        wall = time.perf_counter() - t0
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    else:
        res = simulate(cfg, run.requests(), Recorder(_Discard()))
        wall = time.perf_counter() - t0
    s = res.summary
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "case": case, "status": res.status, "requests": s.requests_finished, "wall_s": wall,
        "req_per_s": s.requests_finished / wall, "peak_rss_mb": rss_mb, "steps": s.steps,
        "step_rows": s.step_rows, "sim_time_s": s.sim_time_s,
        "cpu_hit_rate": s.figures()["cpu_hit_rate"], "gpu_hit_rate": s.figures()["gpu_hit_rate"],
        "layout": [f"{g.kind}/{g.tokens_per_block}" for g in cfg.layout.groups],
        "gpu_blocks": cfg.gpu_blocks, "cpu_chunks": cfg.cpu_capacity_chunks,
        "policy": str(cfg.eviction), "step_cost": repr(cfg.step_cost),
        "h2d": repr(cfg.h2d), "d2h": repr(cfg.d2h),
    }))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, help="replay only the first N requests of each case")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top entries (stderr)")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="case(s) to run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.limit, args.profile)
        return
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, pid {os.getpid()}")
    print(f"target: >= {TARGET_RPS:,.0f} simulated requests / wall s, <= {TARGET_RSS_MB:.0f} MB peak RSS")
    rows = []
    for case in args.case or list(CASES):
        cmd = [sys.executable, __file__, "--child", case]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        if args.profile:
            cmd.append("--profile")
        out = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"\n[{case}] config: layout {row['layout']}, gpu_blocks {row['gpu_blocks']}, "
              f"cpu_chunks {row['cpu_chunks']} ({row['policy']}), step {row['step_cost']}, "
              f"h2d {row['h2d']}, d2h {row['d2h']}")
    print("\n| case | requests | wall s | sim s | steps (rows) | req/s | x target | peak RSS MB | x budget |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['requests']:,} | {r['wall_s']:.1f} | {r['sim_time_s']:.0f} | "
              f"{r['steps']:,} ({r['step_rows']:,}) | {r['req_per_s']:,.0f} | "
              f"{r['req_per_s'] / TARGET_RPS:.3f} | {r['peak_rss_mb']:.0f} | "
              f"{r['peak_rss_mb'] / TARGET_RSS_MB:.2f} |")


if __name__ == "__main__":
    main()
