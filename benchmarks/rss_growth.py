"""Peak memory of a long replay against a short one, and where the difference lives.

The speed issue asks that memory stay flat: peak RSS of the whole Mooncake
trace (12,031 requests) within 10 % of that of its first 3,000 requests. This
script measures both side by side and attributes the difference.

For each length (``--short`` requests, then the whole trace) it runs the case
of ``bench_engine.py`` (fast accounting, as shipped) twice, each run in its own
child process:

* plainly: peak RSS (``ru_maxrss``) and wall time, as ``bench_engine.py``
  measures them;
* under ``tracemalloc``: a snapshot of the live Python allocations taken at the
  recorder flush where they were largest (the recorder flushes every 8,192 rows
  of a table, so the snapshots fall at regular points of the run; the true peak
  may lie between two flushes). Tracing slows the run about 2x and adds its own
  memory, so its figures are for attribution, not for the RSS check.

It prints the two peak RSS figures and their ratio, the traced maxima, and the
allocation sites (file:line, as tracemalloc names them; a compiled module's
allocations are charged to the Python line that called into it) whose live
size differs most between the two snapshots, with their live object counts: a
site whose count stays the same while its size grows is a table that reached
its next size step (a dict or OrderedDict of a capacity-bounded cache), a site
whose count grows with the run would be a leak. The same comparison by file
follows: the engine loop's lines that call into the compiled scheduler share its
allocations between them by where each snapshot was taken, so their file's total
is the figure to read.

    python benchmarks/rss_growth.py [--case NAME] [--short N] [--top K]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.engine.loop import simulate
from sim.engine.metrics import Recorder
from sim.io.scenario import load_run
from sim.tools.run import child_preexec

BOUND = 0.10   # the allowance: whole-trace peak within 10 % of the short run's


class _Probe:
    """A recorder sink that writes nothing and, when tracing, snapshots the largest live heap."""

    def __init__(self, traced: bool) -> None:
        self.traced = traced
        self.best = 0
        self.snapshot: tracemalloc.Snapshot | None = None

    def write(self, table: str, columns: dict[str, list[object]]) -> None:
        if not self.traced:
            return
        cur, _ = tracemalloc.get_traced_memory()
        if cur > self.best:
            self.best = cur
            self.snapshot = tracemalloc.take_snapshot()


def child(case: str, limit: int | None, snapshot_path: str | None) -> None:
    """One run in this process; one JSON line of figures (and the snapshot file when traced)."""
    spec = bench_engine.CASES[case]
    sets = [*spec["set"], 'scheduler.block_accounting="fast"']
    if limit:
        sets.append(f"workload.limit={limit}")
    run = load_run(spec["scenario"], sets)
    cfg = run.engine_config()
    probe = _Probe(traced=snapshot_path is not None)
    if probe.traced:
        tracemalloc.start(1)
    t0 = time.perf_counter()
    res = simulate(cfg, run.requests(), Recorder(probe))
    wall = time.perf_counter() - t0
    out = {"requests": res.summary.requests_finished, "wall_s": wall,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if probe.traced:
        _, peak = tracemalloc.get_traced_memory()
        out["traced_max_at_flush_mb"] = probe.best / 2**20
        out["traced_peak_mb"] = peak / 2**20
        if probe.snapshot is None:   # a run too short to flush: snapshot its end
            probe.snapshot = tracemalloc.take_snapshot()
        assert snapshot_path is not None
        probe.snapshot.dump(snapshot_path)
    print(json.dumps(out))


def _run_child(case: str, limit: int | None, snapshot_path: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", case]
    if limit:
        cmd += ["--limit", str(limit)]
    if snapshot_path:
        cmd += ["--snapshot", snapshot_path]
    proc = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE, preexec_fn=child_preexec)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="mooncake-spec6", choices=sorted(bench_engine.CASES),
                    help="the bench_engine.py case (default: mooncake-spec6)")
    ap.add_argument("--short", type=int, default=3000, help="requests of the short run (default 3000)")
    ap.add_argument("--top", type=int, default=8, help="allocation sites to list (default 8)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--snapshot", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.limit, args.snapshot)
        return
    if args.short < 1 or args.top < 1:
        ap.error("--short and --top must be at least 1")
    bench_engine.check_cases([args.case], ap)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; case {args.case}, fast accounting")
    with tempfile.TemporaryDirectory(prefix="kvsim-rss-") as tmp:
        plain, traced, snaps = {}, {}, {}
        for label, limit in (("short", args.short), ("whole", None)):
            plain[label] = _run_child(args.case, limit)
            snaps[label] = str(Path(tmp) / f"{label}.snapshot")
            traced[label] = _run_child(args.case, limit, snaps[label])
        short, whole = plain["short"], plain["whole"]
        growth = whole["peak_rss_mb"] / short["peak_rss_mb"] - 1
        print("\n| run | requests | wall s | peak RSS MB | traced live heap, max at a flush MB |")
        print("|---|---:|---:|---:|---:|")
        for label in ("short", "whole"):
            p, t = plain[label], traced[label]
            print(f"| {label} | {p['requests']:,} | {p['wall_s']:.1f} | {p['peak_rss_mb']:.1f} | "
                  f"{t['traced_max_at_flush_mb']:.1f} |")
        verdict = "within" if growth <= BOUND else "over"
        print(f"\npeak RSS, whole / short: {growth:+.1%} ({verdict} the issue's {BOUND:.0%})")
        a = tracemalloc.Snapshot.load(snaps["short"])
        b = tracemalloc.Snapshot.load(snaps["whole"])
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    for key, what in (("lineno", "allocation sites"), ("filename", "files")):
        diffs = sorted(b.compare_to(a, key), key=lambda s: -abs(s.size_diff))[: args.top]
        print(f"\n{what} whose live size differs most (whole - short, at each run's traced maximum):\n")
        print(f"| {what[:-1]} | size MB (whole) | difference MB | objects (whole) | difference |")
        print("|---|---:|---:|---:|---:|")
        for s in diffs:
            frame = s.traceback[0]
            site = frame.filename.replace(root, "") + (f":{frame.lineno}" if key == "lineno" else "")
            print(f"| {site} | {s.size / 2**20:.1f} | {s.size_diff / 2**20:+.1f} | {s.count:,} | "
                  f"{s.count_diff:+,} |")


if __name__ == "__main__":
    sim.startup.run_script(main)
