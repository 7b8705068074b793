"""CPU copies of the torch copy path: single pass against the former gather/scatter.

Runs :func:`sim.engine.copypath.calibrate` on the cpu device twice in one
process, with the same chunk sizes, batches, seed and repeats: once with the
single-pass copies (``single_pass=True``, the default of ``CopyPath``) and
once with the former gather into staging then scatter (``single_pass=False``).
For each chunk size ``c`` (one block row of one group, ``bpc = 1``) and batch
``n`` (chunks per job), calibrate times a load and a store of ``n`` chunks
between randomly permuted GPU blocks and CPU slots, interleaved run by run
with one contiguous copy of the same ``n x c`` bytes between the same tensors;
each figure is a median, and the ratio is contiguous time / batched time (1.0:
the batched copy runs at the memcpy limit). The two calibrations are printed
side by side, then the median ratio per chunk size.

Then, once per run: a contiguous copy of the largest job as one ``copy_``
(torch's thread pool) against the same bytes in pieces on the calling thread
(calibrate's reference on cpu), and the wall time of ``kvsim calibrate
--device cpu`` with its defaults in a child process (the issue asks for < 30 s).

    python benchmarks/bench_copypath.py [--chunk-bytes 64KiB,1MiB] [--batch 1,16,64]
        [--repeats N] [--budget S] [--threads T] [--no-calibrate]

Timings on a shared machine are noisy (other processes preempt this one): run
the script more than once and compare medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.engine import copypath
from sim.io.scenario import parse_size
from sim.tools.run import child_preexec

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.9  # batched / contiguous, chunks of 1 MiB and more
TARGET_CALIBRATE_S = 30.0
_MIB = 2**20


def _fmt(n: int) -> str:
    for unit, scale in (("MiB", _MIB), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def contiguous_pool_vs_pieces(nbytes: int, repeats: int) -> tuple[float, float]:
    """GB/s of one ``copy_`` of ``nbytes`` (int64) and of the same bytes in pieces of at
    most ``copypath._GRAIN`` elements (medians; each timed in its own phase)."""
    a = torch.ones(nbytes // 8, dtype=torch.int64)
    b = torch.ones(nbytes // 8, dtype=torch.int64)
    pa, pb = list(torch.split(a, copypath._GRAIN)), list(torch.split(b, copypath._GRAIN))
    out = []
    for fn in (lambda: b.copy_(a), lambda: torch._foreach_copy_(pb, pa)):
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out.append(nbytes / statistics.median(ts) / 1e9)
    return out[0], out[1]


def time_calibrate(threads: int) -> tuple[float, int]:
    """Wall seconds and exit code of ``kvsim calibrate --device cpu`` with its defaults
    (``OMP_NUM_THREADS=threads`` when ``threads`` > 0)."""
    code = "from sim.cli import main; raise SystemExit(main(['calibrate', '--device', 'cpu']))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False, preexec_fn=child_preexec)
    return time.perf_counter() - t0, proc.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-bytes", default="64KiB,256KiB,1MiB,4MiB,8MiB", help="bytes per chunk")
    ap.add_argument("--batch", default="1,16,64,256", help="chunks per job")
    ap.add_argument("--repeats", type=int, default=9, help="runs per figure, at most (median)")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds per figure, once 3 runs are in")
    ap.add_argument("--max-job-bytes", default="256MiB", help="skip jobs above this")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-calibrate", action="store_true", help="do not time kvsim calibrate")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chunks = [parse_size(x) for x in args.chunk_bytes.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    max_job = parse_size(args.max_job_bytes)

    print("bench_copypath: CopyPath cpu copies, single pass (new) vs gather/scatter (old), via calibrate")
    print(f"  machine: {platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; python {platform.python_version()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    print(f"  chunks {', '.join(_fmt(c) for c in chunks)}; chunks/job {batches}; jobs above "
          f"{_fmt(max_job)} skipped; median of up to {args.repeats} runs per figure "
          f"(at least 3, fewer past {args.budget:g} s); seed {args.seed}")
    print(f"  single pass: run by run (pieces of <= {copypath._GRAIN} elements with a thread pool) for rows "
          f"or runs >= {_fmt(copypath._RUN_BYTES)}; ratio = contiguous time / batched time")
    kw: dict[str, Any] = {"max_job_bytes": max_job, "seed": args.seed, "budget_s": args.budget}
    t0 = time.perf_counter()
    new = copypath.calibrate("cpu", chunks, batches, args.repeats, single_pass=True, **kw)
    new_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    old = copypath.calibrate("cpu", chunks, batches, args.repeats, single_pass=False, **kw)
    old_s = time.perf_counter() - t0
    print(f"  calibrate took {new_s:.1f} s (new), {old_s:.1f} s (old)")
    print()
    print(f"{'chunk':>8} {'chunks/job':>10} {'job':>8} {'contig GB/s':>11} {'new load':>8} {'new store':>9} "
          f"{'old load':>8} {'old store':>9}")
    per_chunk: dict[int, tuple[list[float], list[float]]] = {}
    for rn, ro in zip(new["rows"], old["rows"], strict=True):
        c, n = rn["chunk_bytes"], rn["batch"]
        rs_new, rs_old = per_chunk.setdefault(c, ([], []))
        rs_new += [rn["h2d_ratio"], rn["d2h_ratio"]]
        rs_old += [ro["h2d_ratio"], ro["d2h_ratio"]]
        contig = statistics.median([rn["contig_h2d_gbps"], rn["contig_d2h_gbps"]])
        print(f"{_fmt(c):>8} {n:>10} {_fmt(n * c):>8} {contig:>11.2f} {rn['h2d_ratio']:>8.2f} "
              f"{rn['d2h_ratio']:>9.2f} {ro['h2d_ratio']:>8.2f} {ro['d2h_ratio']:>9.2f}")
    print()
    print("per chunk size, median ratio over its jobs and both directions (load = h2d, store = d2h):")
    print(f"{'chunk':>8} {'new':>6} {'old':>6} {'gain':>6}")
    big = []
    for c, (rs_new, rs_old) in per_chunk.items():
        mn, mo = statistics.median(rs_new), statistics.median(rs_old)
        print(f"{_fmt(c):>8} {mn:>6.2f} {mo:>6.2f} {mn / mo:>5.1f}x")
        if c >= _MIB:
            big.append(mn)
    if big:
        print(f"chunks >= 1 MiB: new median ratio {min(big):.2f}..{max(big):.2f} "
              f"(target >= {TARGET_RATIO}: {'met' if min(big) >= TARGET_RATIO else 'NOT met'})")
    largest = max(r["job_bytes"] for r in new["rows"])
    pool, pieces = contiguous_pool_vs_pieces(largest, max(3, args.repeats))
    print(f"contiguous {_fmt(largest)}: one copy_ ({torch.get_num_threads()} threads) {pool:.2f} GB/s, "
          f"pieces on the calling thread {pieces:.2f} GB/s")
    if not args.no_calibrate:
        wall, code = time_calibrate(args.threads)
        env = f"OMP_NUM_THREADS={args.threads} " if args.threads else ""
        met = wall < TARGET_CALIBRATE_S and code == 0
        print(f"{env}kvsim calibrate --device cpu (defaults): {wall:.1f} s wall, exit {code} "
              f"(target < {TARGET_CALIBRATE_S:g} s: {'met' if met else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sim.startup.run_script(main)
