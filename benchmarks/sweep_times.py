"""How long each point of a finished (or partly finished) sweep took.

``sweep.parquet`` holds only deterministic figures; each point's wall time is in
its ``run_info.json`` (``wall_clock_s``, ``started_utc``). This script joins the
two and prints, for a sweep folder:

* one row per point (model, workload, CPU RAM, policy, overloaded or not,
  stopped at its queue limit or not (``output.stop_at_waiting``), requests
  finished, wall minutes, simulated requests per wall second);
* per model and workload: points, overloaded points, points stopped at their
  queue limit, the sum of their wall times and the slowest;
* the total of the points' wall times (the sweep's time on one core) and the
  span from the first point's start to the last point's end (the sweep's own
  wall time with however many jobs it ran, when it ran in one go; a resumed
  sweep's span includes the pause).

    python benchmarks/sweep_times.py results/models-x-traces-x-cpu [--points]

Exit status 2 when the folder is not a sweep folder.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pandas as pd

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.errors import InputError
from sim.io.results import read_json
from sim.tools.sweep import load_sweep


def point_times(folder: Path) -> pd.DataFrame:
    """One row per finished point: the sweep table's identifying columns with the
    wall time and start of its run."""
    table = load_sweep(folder).table
    rows = []
    for rec in table.to_dict("records"):
        info_path = folder / rec["run_dir"] / "run_info.json"
        if not info_path.is_file():
            continue
        info = read_json(info_path)
        start = datetime.fromisoformat(info["started_utc"])
        rows.append({
            "point": rec["point"],
            "model": rec["model"],
            "workload": rec["workload"],
            "capacity": rec["cpu_cache.capacity"],
            "policy": rec["cpu_cache_policy"],
            "status": rec["status"],
            "overloaded": bool(rec["overloaded"]),
            "stopped": rec.get("end") == "queue_limit",
            "requests": int(rec["requests_finished"]),
            "wall_min": info["wall_clock_s"] / 60,
            "start": start,
            "end": start + timedelta(seconds=info["wall_clock_s"]),
        })
    return pd.DataFrame(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="a sweep folder (holds sweep.parquet and points/)")
    ap.add_argument("--points", action="store_true", help="also print one row per point")
    args = ap.parse_args()
    folder = Path(args.folder)
    if not (folder / "sweep.parquet").is_file():
        print(f"sweep_times: {folder}: not a sweep folder (no sweep.parquet)", file=sys.stderr)
        return 2
    try:
        df = point_times(folder)
    except InputError as exc:   # an unreadable table or run_info.json: one line
        print(f"sweep_times: {exc}", file=sys.stderr)
        return 2
    if df.empty:
        print(f"sweep_times: {folder}: no finished point has a run_info.json", file=sys.stderr)
        return 2
    if args.points:
        cols = ["point", "model", "workload", "capacity", "policy", "overloaded", "stopped", "requests",
                "wall_min"]
        out = df[cols].assign(req_per_wall_s=df.requests / (df.wall_min * 60))
        print(out.to_string(index=False, float_format="{:.1f}".format))
        print()
    by = df.groupby(["model", "workload"], sort=False).agg(
        points=("point", "size"), overloaded=("overloaded", "sum"), stopped=("stopped", "sum"),
        wall_min_sum=("wall_min", "sum"), wall_min_max=("wall_min", "max"))
    print(by.reset_index().to_string(index=False, float_format="{:.1f}".format))
    span = (df.end.max() - df.start.min()).total_seconds() / 60
    print(f"\n{len(df)} points ({int(df.overloaded.sum())} overloaded, {int(df.stopped.sum())} stopped "
          f"at their queue limit, "
          f"{int((df.status != 'ok').sum())} not ok): {df.wall_min.sum():.1f} min of point wall time "
          f"(one core); {span:.1f} min from the first start to the last end")
    return 0


if __name__ == "__main__":
    sim.startup.run_script(main)
