"""GPU block accounting: the reference GpuKVCache against GpuFastCache (with its
per-block loops in Python and, where the install built them, compiled).

Records the GPU-cache calls a vLLM-like scheduler makes for the first N
requests of the Mooncake conversation trace (or, without the trace, a
synthetic stream shaped like it: prompts of 2k-30k tokens sharing prefixes,
200-500 output tokens) on the spec §6 layout (full attention 256-token
blocks, sliding window 128 with 64-token and with 8-token blocks,
tokens_per_hash 8; 60,000 GPU blocks as in bench_engine's mooncake-spec6
case): chunked prefill with a budget of 8,192 tokens per step,
at most 256 running requests, decode steps skipped while the request's
thresholds say nothing changes (as ``sim.model.scheduler`` does), recompute
preemption from the end of the batch when the pool is short. Then replays
the recorded stream (find_hit, allocate_new, allocate_more, commit,
thresholds, free) through each implementation, checks that every call
returns the same thing, and prints calls/s of each, the ratio to the
reference, requests/s and a cProfile top-10 of the fast one.

Usage: python benchmarks/bench_gpu_pool.py [--requests N] [--gpu-blocks B] [--synthetic]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.errors import InputError
from sim.io.traces import resolve_trace
from sim.model import gpu_fast
from sim.model.gpu_cache import GpuKVCache
from sim.model.gpu_fast import GpuFastCache
from sim.model.layout import GroupKind, GroupSpec, Layout


def _trace() -> Path | None:
    """The Mooncake conversation trace ($KVSIM_TRACES or the fetch cache), if present."""
    try:
        return resolve_trace("mooncake-conversation")
    except InputError:
        return None
TPH = 8
SPEC6 = Layout.of([GroupSpec(GroupKind.FULL, 256),
                   GroupSpec(GroupKind.SLIDING_WINDOW, 64, window=128),
                   GroupSpec(GroupKind.SLIDING_WINDOW, 8, window=128)],
                  tokens_per_hash=TPH, blocks_per_chunk=4)
BUDGET = 8192
MAX_SEQS = 256

Op = tuple[Any, ...]


@dataclass
class Req:
    req_id: str
    prompt: int
    output: int
    hashes: Sequence[int]
    ntok: int = 0
    nc: int = 0
    generated: int = 0
    thr: tuple[int, int] = field(default=(0, 0))


def mooncake(n: int) -> list[Req]:
    from sim.io.workload import iter_mooncake  # noqa: PLC0415 (optional: the trace may be absent)
    return [Req(r.req_id, r.prompt_tokens, r.output_tokens, list(r.block_hashes))
            for r in iter_mooncake(_trace(), TPH, limit=n)]


def synthetic(n: int, seed: int = 1) -> list[Req]:
    """Prompts of 2k-30k tokens; half share a prefix of one of 40 documents."""
    rng = random.Random(seed)
    docs = [[(d + 1) << 40 | i for i in range(30_000 // TPH)] for d in range(40)]
    out = []
    for i in range(n):
        prompt = int(2000 * 15 ** rng.random())
        output = rng.randrange(200, 501)
        total = (prompt + output) // TPH
        shared = rng.randrange(total // 2, total) if rng.random() < 0.5 else 0
        hashes = docs[rng.randrange(40)][:shared] + [(i + 1) << 20 | j for j in range(total - shared)]
        out.append(Req(f"s{i:06d}", prompt, output, hashes))
    return out


def record(reqs: list[Req], gpu_blocks: int) -> list[Op]:
    """The GPU-cache calls of a chunked-prefill scheduler over ``reqs`` (driven
    on the fast cache)."""
    gpu = GpuFastCache(SPEC6, gpu_blocks)
    ops: list[Op] = []
    waiting: deque[Req] = deque(reqs)
    running: list[Req] = []
    for r in reqs:
        r.ntok = r.prompt

    def commit(r: Req, n: int) -> None:
        ops.append(("commit", r.req_id, min(n, r.ntok)))
        gpu.commit(r.req_id, r.hashes, min(n, r.ntok))
        ops.append(("thr", r.req_id))
        r.thr = gpu.thresholds(r.req_id)

    def preempt(v: Req) -> None:
        ops.append(("free", v.req_id))
        gpu.free(v.req_id)
        v.nc = 0
        waiting.appendleft(v)

    while waiting or running:
        budget = BUDGET
        sched: list[tuple[Req, int]] = []
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            num_new = min(r.ntok - r.nc, budget)
            if r.nc + num_new < r.thr[0] and r.nc < r.thr[1]:
                sched.append((r, num_new))
                budget -= num_new
                i += 1
                continue
            while True:
                ops.append(("more", r.req_id, r.nc, r.nc + num_new))
                if gpu.allocate_more(r.req_id, r.nc, r.nc + num_new) is not None:
                    break
                victim = running.pop()
                preempt(victim)
                if victim is r:
                    break
            if r not in running:
                break
            commit(r, r.nc + num_new)
            sched.append((r, num_new))
            budget -= num_new
            i += 1
        while waiting and budget > 0 and len(running) < MAX_SEQS:
            r = waiting[0]
            ops.append(("hit", r.req_id, r.ntok - 1))
            hit, local = gpu.find_hit(r.hashes, r.ntok - 1)
            num_new = min(r.ntok - hit, budget)
            ops.append(("new", r.req_id, hit, 0, hit + num_new))
            if gpu.allocate_new(r.req_id, local, hit, 0, hit + num_new) is None:
                if not running and not sched:
                    raise SystemExit(f"{r.req_id} does not fit in {gpu_blocks} blocks alone")
                break
            waiting.popleft()
            running.append(r)
            r.nc = hit
            commit(r, hit + num_new)
            sched.append((r, num_new))
            budget -= num_new
        for r, num_new in sched:
            r.nc += num_new
            if r.nc == r.ntok:
                r.generated += 1
                r.ntok += 1
                if r.generated >= r.output:
                    ops.append(("free", r.req_id))
                    gpu.free(r.req_id)
                    running.remove(r)
    return ops


def replay(gpu: Any, ops: list[Op], hashes: dict[str, Sequence[int]], out: list[Any] | None = None) -> None:
    """Apply the recorded calls; with ``out``, collect comparable results."""
    local: dict[str, Any] = {}
    for op in ops:
        kind, rid = op[0], op[1]
        if kind == "thr":
            res: Any = gpu.thresholds(rid)
        elif kind == "commit":
            res = gpu.commit(rid, hashes[rid], op[2])
        elif kind == "more":
            res = gpu.allocate_more(rid, op[2], op[3])
        elif kind == "free":
            res = gpu.free(rid)
        elif kind == "hit":
            res = local[rid] = gpu.find_hit(hashes[rid], op[2])
            if out is not None:
                res = (res[0], [[b if isinstance(b, int) else b.block_id for b in lst] for lst in res[1]])
        else:
            a = gpu.allocate_new(rid, local.pop(rid)[1], op[2], op[3], op[4])
            res = None if a is None else (a.new_block_ids, a.null_prefix)
        if out is not None:
            out.append((res, gpu.pool.num_free, gpu.pool.num_cached))


def fast_cache(gpu_blocks: int, compiled: bool) -> GpuFastCache:
    """A GpuFastCache running the compiled per-block loops or its Python ones."""
    with gpu_fast.pool_loops(compiled):
        return GpuFastCache(SPEC6, gpu_blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--gpu-blocks", type=int, default=60_000,
                    help="pool size (60,000: bench_engine's mooncake-spec6 case)")
    ap.add_argument("--synthetic", action="store_true", help="synthetic stream even if the trace exists")
    ap.add_argument("--no-check", action="store_true", help="skip the call-by-call comparison")
    args = ap.parse_args()
    if args.requests < 1 or args.gpu_blocks < 2:
        ap.error("--requests: at least 1; --gpu-blocks: at least 2")
    use_trace = _trace() is not None and not args.synthetic
    reqs = mooncake(args.requests) if use_trace else synthetic(args.requests)
    hashes = {r.req_id: r.hashes for r in reqs}
    t0 = time.perf_counter()
    ops = record(reqs, args.gpu_blocks)
    kinds: dict[str, int] = {}
    for op in ops:
        kinds[op[0]] = kinds.get(op[0], 0) + 1
    print(f"workload: {len(reqs)} requests ({'Mooncake conversation trace' if use_trace else 'synthetic'}), "
          f"mean prompt {sum(r.prompt for r in reqs) / len(reqs):.0f} tokens, spec §6 layout, "
          f"{args.gpu_blocks} GPU blocks; {len(ops)} calls {kinds} recorded in "
          f"{time.perf_counter() - t0:.1f} s")
    builds: dict[str, Callable[[], Any]] = {
        "reference GpuKVCache": lambda: GpuKVCache(SPEC6, args.gpu_blocks),
        "fast, Python loops": lambda: fast_cache(args.gpu_blocks, compiled=False),
    }
    if gpu_fast.COMPILED_LOOPS is not None:
        builds["fast, compiled loops"] = lambda: fast_cache(args.gpu_blocks, compiled=True)
    else:
        print("the compiled pool loops (sim/model/_poolops.c) are not built here: Python loops only")
    if not args.no_check:
        results: list[list[Any]] = []
        for build in builds.values():
            out: list[Any] = []
            gpu = build()
            replay(gpu, ops, hashes, out)
            if isinstance(gpu, GpuFastCache):
                gpu.pool.check_invariants()
            results.append(out)
        bad = next((i for i, calls in enumerate(zip(*results, strict=True))
                    if any(c != calls[0] for c in calls[1:])), None)
        print("identical results, call by call:", bad is None if bad is None else f"NO, first at call {bad}")
    times = {}
    for name, build in builds.items():
        gpu = build()
        t = time.perf_counter()
        replay(gpu, ops, hashes)
        times[name] = dt = time.perf_counter() - t
        print(f"{name:22s} {dt:8.3f} s  {len(ops) / dt:12,.0f} calls/s  {len(reqs) / dt:10,.0f} requests/s  "
              f"{times['reference GpuKVCache'] / dt:5.2f}x the reference")
    prof = cProfile.Profile()
    gpu = fast_cache(args.gpu_blocks, compiled=gpu_fast.COMPILED_LOOPS is not None)
    prof.enable()
    replay(gpu, ops, hashes)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(10)
    print("cProfile of the fast replay (top 10 by own time):")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:4000])


if __name__ == "__main__":
    sim.startup.run_script(main)
