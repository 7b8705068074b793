"""The 120-point what-if's slowest points, timed beside a baseline commit.

The sliding-window models' Mooncake points of
``scenarios/whatif/models-x-traces-x-cpu.toml`` (gemma-3-27b, gpt-oss-120b,
one H200 each) are overloaded at the trace's real rate and take most of the
sweep's time. For each point below this script runs ``kvsim run`` on the
first requests of the trace twice at once, one process with the code of
``--base`` (a ``git worktree``) and one with the working tree, so both share
the machine alike; it prints their wall seconds, the ratio, and whether every
Parquet file and ``summary.json`` are byte-identical (they must be: the
changes it measures are speed-only).

Each point is the sweep's base scenario (the sweep file less its ``[sweep]``
and ``[smoke]`` tables) with the point's model and tensor parallelism, the
Mooncake conversation trace, a 64 GiB CPU cache and the point's policy. The
trace is found as ``kvsim run`` finds it (``$KVSIM_TRACES``, then the fetch
cache: ``kvsim trace fetch mooncake-conversation``).

    python benchmarks/bench_whatif_points.py [--base REV] [--limit-scale X] [--point NAME ...]

Exit status 1 when an output differs, 2 on bad input (no trace, an unknown commit).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.errors import InputError
from sim.io.traces import resolve_trace

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "scenarios" / "whatif" / "models-x-traces-x-cpu.toml"

#: name -> (model, tensor parallelism, policy, requests)
POINTS = {
    "gemma-lru": ("gemma-3-27b", 1, "lru", 600),
    "gemma-arc": ("gemma-3-27b", 1, "arc", 600),
    "gpt-oss-lru": ("gpt-oss-120b", 1, "lru", 1500),
    "gpt-oss-arc": ("gpt-oss-120b", 1, "arc", 1500),
}


def base_scenario(folder: Path) -> Path:
    """The sweep's base scenario as a run/1 file in ``folder``."""
    with SWEEP.open("rb") as f:
        data = tomllib.load(f)
    for table in ("sweep", "smoke"):
        data.pop(table, None)
    data["schema"] = "run/1"
    path = folder / "whatif-point.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def point_args(name: str, scale: float) -> list[str]:
    model, tp, policy, limit = POINTS[name]
    n = max(1, int(limit * scale))
    return ["--set", f'model.name="{model}"', "--set", f"costs.tensor_parallel={tp}",
            "--set", 'cpu_cache.capacity="64GiB"', "--set", f'cpu_cache.policy="{policy}"',
            "--set", f'workload={{kind="mooncake", trace="mooncake-conversation", limit={n}}}']


def start(tree: Path, scenario: Path, args: list[str], out: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    cmd = [sys.executable, "-c", "import sys; from sim.cli import main; sys.exit(main())",
           "run", str(scenario), *args, "--out", str(out), "-q"]
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def same_outputs(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.suffix == ".parquet" or p.name == "summary.json")
    return bool(names) and all((b / n).exists() and filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="baseline commit (default HEAD)")
    ap.add_argument("--point", action="append", choices=sorted(POINTS), help="only these points (repeatable)")
    ap.add_argument("--limit-scale", type=float, default=1.0, help="scale the requests of every point")
    args = ap.parse_args()
    try:
        resolve_trace("mooncake-conversation")
    except InputError as exc:
        print(f"bench_whatif_points: {exc}", file=sys.stderr)
        return 2
    rev = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    if rev.returncode != 0:
        print(f"bench_whatif_points: --base {args.base!r} is not a commit of this repository",
              file=sys.stderr)
        return 2
    sha = rev.stdout.strip()
    failed = False
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="kvsim-whatif-") as tmp:
        work = Path(tmp)
        tree = work / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            scenario = base_scenario(work)
            print(f"base {sha[:10]} vs the working tree, each pair run at once on {os.cpu_count()} cores\n")
            print("| point | requests | base s | new s | base / new | identical |")
            print("|---|---:|---:|---:|---:|---|")
            for name in args.point or list(POINTS):
                pargs = point_args(name, args.limit_scale)
                outs = {side: work / f"{name}-{side}" for side in ("base", "new")}
                t0 = time.perf_counter()
                procs = {side: start(tree if side == "base" else ROOT, scenario, pargs, outs[side])
                         for side in ("base", "new")}
                wall: dict[str, float] = {}
                while len(wall) < 2:
                    for side, p in procs.items():
                        if side not in wall and p.poll() is not None:
                            wall[side] = time.perf_counter() - t0
                    time.sleep(0.05)
                for side, p in procs.items():
                    if p.returncode != 0:
                        err = p.stderr.read().decode() if p.stderr else ""
                        print(f"{name} ({side}) exited {p.returncode}: {err.strip().splitlines()[-1:]}")
                        return 1
                same = same_outputs(outs["base"], outs["new"])
                failed |= not same
                n = max(1, int(POINTS[name][3] * args.limit_scale))
                print(f"| {name} | {n:,} | {wall['base']:.1f} | {wall['new']:.1f} | "
                      f"{wall['base'] / wall['new']:.2f}x | {'yes' if same else 'NO'} |", flush=True)
        finally:
            for p in procs.values():     # no run outlives the script (Ctrl-C, an error)
                if p.poll() is None:
                    p.terminate()
                    p.wait()
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False,
                           capture_output=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sim.startup.run_script(main)
