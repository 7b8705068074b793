"""The tiers what-if (``scenarios/whatif/tiers.toml``) as a table and a figure.

Reads a finished sweep folder (default ``results/tiers``, written by
``kvsim sweep scenarios/whatif/tiers.toml --jobs 1``) and prints:

* what was run (the sweep file's reductions) and the sweep's wall time (the
  points' ``run_info.json`` wall clocks, summed: ``--jobs 1`` runs them one
  after the other);
* a Markdown table, one row per point: CPU RAM, secondary tier, policy, CPU
  hit rate (token-weighted, promoted chunks included), TTFT p50 / p90, the
  load verdict, and from the summary's ``tiers`` section the promoted chunks
  a GPU load read, the bytes read from / written to the tier, its evictions
  and peak occupancy;
* per CPU RAM and tier choice, Belady's CPU hit rate against LRU's and ARC's,
  and every case where Belady is below one of them.

and writes the figure (:func:`sim.tools.plots.tiers_whatif`; default
``docs/tiers-whatif.png``).

    python benchmarks/tiers_whatif.py [SWEEP_DIR] [--out PNG]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sim
import sim.startup  # first: a signal during the heavy imports below ends in one line
import sim.tools.plots as plots
from sim.errors import InputError

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("lru", "arc", "belady")
NAMES = {"lru": "LRU", "arc": "ARC", "belady": "Belady"}


def _summary(folder: Path, run_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    point = folder / run_dir
    info = point / "run_info.json"
    return (json.loads((point / "summary.json").read_text()),
            json.loads(info.read_text()) if info.is_file() else {})


def _gb(n: float) -> str:
    return f"{n / 1e9:,.0f} GB" if n >= 1e9 else f"{n / 1e6:,.0f} MB"


def _s(x: float | None) -> str:
    return "-" if x is None else (f"{x:.2f} s" if x < 10 else f"{x:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", nargs="?", default=str(ROOT / "results" / "tiers"), help="the sweep folder")
    ap.add_argument("--out", default=str(ROOT / "docs" / "tiers-whatif.png"), help="the figure (PNG)")
    args = ap.parse_args()
    folder = Path(args.sweep)
    try:
        sw = sim.load_sweep(folder)
    except InputError as exc:   # not run yet: `kvsim sweep scenarios/whatif/tiers.toml` writes it
        ap.error(f"{exc} (run `kvsim sweep scenarios/whatif/tiers.toml` first)")
    t = sw.table
    base = sw.spec
    wl = base.get("workload", {})
    print(f"sweep {folder} ({base.get('name')}): {len(t)} points, model {base.get('model', {}).get('name')}, "
          f"{base.get('hardware', {}).get('profile')}, TP {base.get('costs', {}).get('tensor_parallel')}, "
          f"trace {wl.get('trace')}, rate_scale {wl.get('rate_scale', 1.0)}, "
          f"sweep.set {base.get('sweep', {}).get('set', {})}")
    rows = []
    wall = 0.0
    for _, r in t.iterrows():
        summ, info = _summary(folder, r["run_dir"])
        wall += float(info.get("wall_clock_s") or 0.0)
        sec = (summ.get("tiers") or {}).get("secondary") or [{}]
        tier = sec[0]
        rows.append({
            "point": int(r["point"]), "gib": r["cpu_cache_bytes"] / 2**30,
            "tier": plots.tier_label(r["tiers"]), "policy": str(r["cpu_cache_policy"]),
            "status": r["status"], "hit": r["cpu_hit_rate"], "p50": r["ttft_s_p50"], "p90": r["ttft_s_p90"],
            "overloaded": bool(r["overloaded"]),
            "promoted": tier.get("promoted_chunks_loaded"), "read": tier.get("read_bytes"),
            "written": tier.get("write_bytes"), "evictions": tier.get("evictions"),
            "peak": (tier.get("occupancy_chunks") or {}).get("peak"), "capacity": tier.get("capacity_chunks"),
            "failures": (summ.get("tiers") or {}).get("promotion_allocation_failures"),
        })
    print(f"wall time: {wall / 60:.1f} min summed over the points' run_info.json (--jobs 1)\n")
    print("| CPU RAM | NVMe tier | policy | CPU hit rate | TTFT p50 | TTFT p90 | load | promoted chunks "
          "loaded | tier read / written | tier evictions | tier peak / capacity (chunks) |")
    print("|---:|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for x in rows:
        if x["status"] != "ok":
            print(f"| {x['gib']:g} GiB | {x['tier']} | {NAMES.get(x['policy'], x['policy'])} | failed |"
                  " | | | | | | |")
            continue
        cells = ["", "", "", ""]
        if x["promoted"] is not None:       # a point with a tier
            cells = [f"{x['promoted']:,}", f"{_gb(x['read'])} / {_gb(x['written'])}", f"{x['evictions']:,}",
                     f"{x['peak']:,} / {x['capacity']:,}"]
        print(f"| {x['gib']:g} GiB | {x['tier']} | {NAMES.get(x['policy'], x['policy'])} | {x['hit']:.1%} "
              f"| {_s(x['p50'])} | {_s(x['p90'])} | {'OVERLOADED' if x['overloaded'] else 'stable'} | "
              + " | ".join(cells) + " |")
    print("\nBelady's CPU hit rate against LRU's and ARC's, per CPU RAM and tier choice:")
    exceptions = []
    by: dict[tuple[float, str], dict[str, float]] = {}
    for x in rows:
        if x["status"] == "ok":
            by.setdefault((x["gib"], x["tier"]), {})[x["policy"]] = x["hit"]
    for (gib, tier), hits in sorted(by.items()):
        if "belady" not in hits:
            continue
        below = [p for p in ("lru", "arc") if p in hits and hits["belady"] < hits[p]]
        shown = ", ".join(f"{NAMES[p]} {hits[p]:.2%}" for p in POLICIES if p in hits)
        line = f"  {gib:g} GiB, {tier}: {shown}"
        if below:
            line += "  <- below " + ", ".join(f"{NAMES[p]} by {100 * (hits[p] - hits['belady']):.2f} points"
                                              for p in below)
            exceptions.append((gib, tier, below))
        print(line)
    print(f"exceptions: {len(exceptions)} of {sum('belady' in h for h in by.values())}")
    fig = plots.tiers_whatif(sw)
    problems = plots.layout_problems(fig)
    out = plots.save_figure(fig, args.out)
    print(f"figure: {out}" + (f" (layout problems: {problems})" if problems else ""))
    return 0


if __name__ == "__main__":
    sim.startup.run_script(main)
