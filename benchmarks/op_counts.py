"""What one simulated request costs, in operations: the per-block and per-key work behind req/s.

For each case of ``bench_engine.py`` (fast accounting) the script runs the case
twice:

* once compiled, as shipped, in a child process: the wall time (as
  ``bench_engine.py`` measures it);
* once from the Python sources (``KVSIM_PURE=1``) in this process, with counters
  wrapped around the model's elementary operations: GPU blocks taken from the
  free queue, blocks given a hash (prefix-cache entries), blocks returned to the free queue,
  CPU keys probed by recency touches, CPU key lookups, a request's decode-step
  events inside fast-forwards, and the engine's full and fast-forward steps.
  The counters only count; the run decides exactly as the first.

It prints the counts per request and, from the wall time, the mean wall time per
counted operation, next to what the speed issue's target (6,000 req/s) and its
floor (1,000 req/s) leave per operation. The counts depend on the model's
decisions alone (not on the machine); the wall times do.

    python benchmarks/op_counts.py [--limit N] [--case NAME ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

os.environ["KVSIM_PURE"] = "1"   # count in the sources (compiled methods cannot be wrapped)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.engine.loop import simulate
from sim.engine.metrics import Recorder
from sim.io.scenario import load_run
from sim.model import cpu_cache, gpu_fast, scheduler
from sim.tools.run import child_preexec

TARGET_RPS = bench_engine.TARGET_RPS
FLOOR_RPS = 1000.0

#: the counted operations, in print order; ``per_op`` marks those summed into "operations"
COUNTERS = (
    ("blocks taken", True),
    ("blocks hashed", True),
    ("blocks freed", True),
    ("CPU keys probed by touches", True),
    ("CPU key lookups", True),
    ("decode events (fast-forward)", True),
    ("full steps", False),
    ("fast-forward steps", False),
)


def _install(counts: collections.Counter[str]) -> None:
    """Wrap the sources' methods with counters (this process only)."""
    pool = gpu_fast.FastBlockPool
    take, free, commit_ids = pool.get_new_blocks, pool.free, pool.commit_ids

    def get_new_blocks(self: gpu_fast.FastBlockPool, n: int) -> list[int]:
        counts["blocks taken"] += n
        return take(self, n)

    def free_blocks(self: gpu_fast.FastBlockPool, ids: Iterable[int]) -> None:
        listed = list(ids)
        counts["blocks freed"] += len(listed)
        free(self, listed)

    pool.get_new_blocks, pool.free = get_new_blocks, free_blocks  # type: ignore[method-assign]

    cache = gpu_fast.GpuFastCache
    commit, decode = cache.commit, cache.decode_step

    def commit_counted(self: gpu_fast.GpuFastCache, req_id: str, hashes: object, n: int) -> None:
        # a group whose commit mark moves by one block with no window mask hashes that block
        # inline; every other hash goes through FastBlockPool.commit_ids (counted there)
        done = self._tables[req_id].done
        before = list(done)
        commit(self, req_id, hashes, n)  # type: ignore[arg-type]
        masks = self.layout.gpu_cache_masks
        counts["blocks hashed"] += sum(1 for g, d in enumerate(done)
                                       if d - before[g] == 1 and masks[g] is None)

    def commit_ids_counted(self: gpu_fast.FastBlockPool, ids: Sequence[int], hashes: Sequence[int],
                           g: int) -> None:
        counts["blocks hashed"] += len(ids)
        commit_ids(self, ids, hashes, g)

    pool.commit_ids = commit_ids_counted  # type: ignore[method-assign]

    def decode_counted(self: gpu_fast.GpuFastCache, *args: object) -> object:
        counts["decode events (fast-forward)"] += 1
        return decode(self, *args)  # type: ignore[arg-type]

    cache.commit, cache.decode_step = commit_counted, decode_counted  # type: ignore[method-assign,assignment]

    cpu = cpu_cache.CpuChunkCache
    touch, lookup = cpu.touch, cpu.lookup

    def touch_counted(self: cpu_cache.CpuChunkCache, keys: Sequence[int]) -> None:
        counts["CPU keys probed by touches"] += len(keys)
        touch(self, keys)

    def lookup_counted(self: cpu_cache.CpuChunkCache, key: int) -> cpu_cache.LookupResult:
        counts["CPU key lookups"] += 1
        return lookup(self, key)

    cpu.touch, cpu.lookup = touch_counted, lookup_counted  # type: ignore[method-assign]

    sched = scheduler.Scheduler
    schedule, ff_finish = sched.schedule, sched.finish_fast_forward

    def schedule_counted(self: scheduler.Scheduler, now: float) -> scheduler.StepPlan:
        counts["full steps"] += 1
        return schedule(self, now)

    def ff_counted(self: scheduler.Scheduler, ff: scheduler.FastForward) -> None:
        counts["fast-forward steps"] += ff.k
        ff_finish(self, ff)

    sched.schedule, sched.finish_fast_forward = schedule_counted, ff_counted  # type: ignore[method-assign]


def _count(case: str, limit: int | None, counts: collections.Counter[str]) -> int:
    spec = bench_engine.CASES[case]
    sets = [*spec["set"], 'scheduler.block_accounting="fast"']
    if limit:
        sets.append(f"workload.limit={limit}")
    run = load_run(str(spec["scenario"]), sets)
    counts.clear()
    res = simulate(run.engine_config(), run.requests(), Recorder(bench_engine._Discard()))
    return int(res.summary.requests_finished)


def _timed(case: str, limit: int | None) -> dict[str, object]:
    """The case compiled (as shipped), in a child process: bench_engine's own figures."""
    env = {k: v for k, v in os.environ.items() if k != "KVSIM_PURE"}
    cmd = [sys.executable, bench_engine.__file__, "--child", case, "--accounting", "fast"]
    if limit:
        cmd += ["--limit", str(limit)]
    out = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE, env=env,
                         preexec_fn=child_preexec).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=3000, help="first N requests of each case (0: all)")
    ap.add_argument("--case", action="append", choices=sorted(bench_engine.CASES),
                    help="case(s) (default: mooncake-spec6 and mooncake-full-attn)")
    args = ap.parse_args()
    counts: collections.Counter[str] = collections.Counter()
    _install(counts)
    cases = args.case or ["mooncake-spec6", "mooncake-full-attn"]
    bench_engine.check_cases(cases, ap)
    cols = []
    for case in cases:
        timed = _timed(case, args.limit or None)
        t0 = time.perf_counter()
        n = _count(case, args.limit or None, counts)
        cols.append((case, n, dict(counts), timed, time.perf_counter() - t0))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; first {args.limit or 'all'} requests; "
          f"compiled: {', '.join(cols[0][3]['compiled']) or 'none'}")   # type: ignore[arg-type]
    print("\n| per simulated request | " + " | ".join(c[0] for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, _ in COUNTERS:
        print(f"| {name} | " + " | ".join(f"{c[2].get(name, 0) / c[1]:,.1f}" for c in cols) + " |")
    ops = [sum(c[2].get(name, 0) for name, per_op in COUNTERS if per_op) / c[1] for c in cols]
    print("| **operations** (the rows above the steps) | " + " | ".join(f"**{o:,.0f}**" for o in ops) + " |")
    rps = [float(c[3]["req_per_s"]) for c in cols]   # type: ignore[arg-type]
    print("| compiled wall time, us (req/s) | "
          + " | ".join(f"{1e6 / r:,.0f} ({r:,.0f})" for r in rps) + " |")
    print("| compiled wall ns per operation | "
          + " | ".join(f"{1e9 / r / o:,.0f}" for r, o in zip(rps, ops, strict=True)) + " |")
    print(f"| ns per operation at {FLOOR_RPS:,.0f} req/s | "
          + " | ".join(f"{1e9 / FLOOR_RPS / o:,.0f}" for o in ops) + " |")
    print(f"| ns per operation at {TARGET_RPS:,.0f} req/s | "
          + " | ".join(f"{1e9 / TARGET_RPS / o:,.0f}" for o in ops) + " |")
    print("\n(counting runs from the sources with counters: "
          + ", ".join(f"{c[0]} {c[4]:.1f} s" for c in cols) + ")")


if __name__ == "__main__":
    sim.startup.run_script(main)
