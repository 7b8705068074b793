"""Figures a capacity planner can read (sim.tools.plots), checked on the matplotlib objects, not pixels:
distinct (colour, line style) per TTFT line, a log2 size axis with 0 GiB apart, occupancy as steps,
failed runs said so in the title, and the TTFT legend's p50 equal to the summary's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sim.engine.metrics import percentile
from sim.io.results import RunResults, arrow_schema
from sim.tools import plots

GIB = 1 << 30


def _empty(table: str) -> Any:
    return arrow_schema(table).empty_table().to_pandas()


def fake_run(tmp_path: Path, *, summary: dict[str, Any] | None = None, requests: Any = None,
             occupancy: Any = None) -> RunResults:
    scenario = {"name": "fake", "seed": 0, "window_logic": "new", "model": {"label": "m"},
                "hardware": {"profile": "h200"}, "workload": {"kind": "multiturn"},
                "cpu_cache": {"capacity": 8 * GIB, "policy": "lru"}}
    return RunResults(path=tmp_path, requests=_empty("requests") if requests is None else requests,
                      steps=_empty("steps"), transfers=_empty("transfers"),
                      occupancy=_empty("occupancy") if occupancy is None else occupancy,
                      events=_empty("events"), summary=summary or {"status": "ok", "sim_time_s": 100.0},
                      scenario=scenario, run_info={})


def fake_sweep(tmp_path: Path, sizes_gib: list[int], policies: list[str]) -> pd.DataFrame:
    """A sweep.parquet-like table; each point's requests.parquet holds a few TTFTs."""
    rows = []
    rng = np.random.default_rng(0)
    for i, (gib, pol) in enumerate((g, p) for p in policies for g in sizes_gib):
        run_dir = f"points/{i:03d}"
        folder = tmp_path / run_dir
        folder.mkdir(parents=True)
        arrival = np.arange(20, dtype=float)
        first = arrival + rng.uniform(0.1, 2.0, 20)
        pq.write_table(pa.table({"arrival_s": arrival, "first_token_s": first}), folder / "requests.parquet")
        rows.append({"point": i, "run_id": f"{i:03d}", "run_dir": run_dir, "status": "ok", "error": "",
                     "cpu_cache.capacity": f"{gib}GiB", "cpu_cache.policy": pol, "model": "m",
                     "hardware": "h200", "workload": "multiturn", "cpu_cache_bytes": gib * GIB,
                     "cpu_cache_policy": pol, "window_logic": "new", "seed": 0,
                     "cpu_hit_rate": min(0.9, 0.05 + 0.1 * np.log2(gib + 1)) + (0.02 if pol == "arc" else 0),
                     "recompute_saved": min(0.8, 0.04 + 0.08 * np.log2(gib + 1))})
    return pd.DataFrame(rows)


def _look(line: Any) -> tuple[Any, ...]:
    """What tells a line apart: colour and dash pattern (a custom dash reads as '--' in get_linestyle)."""
    from matplotlib.colors import to_hex

    return (to_hex(line.get_color()), line.get_linestyle(), str(getattr(line, "_unscaled_dash_pattern", "")))


# ----------------------------------------------------------------------------------------------
# sweeps
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [[0, 64, 128, 256, 512], [1, 2, 4, 8, 16, 32]])
def test_ttft_cdfs_lines_differ_by_colour_and_style(tmp_path: Path, sizes: list[int]) -> None:
    df = fake_sweep(tmp_path, sizes, ["lru", "arc"])
    fig = plots.ttft_cdfs(df, root=tmp_path)
    lines = [ln for ln in fig.axes[0].get_lines() if not ln.get_label().startswith("_")]
    assert len(lines) == len(df)
    looks = [_look(ln) for ln in lines]
    assert len(set(looks)) == len(looks), "two lines look alike"
    # policy -> colour, size -> line style
    by_policy: dict[str, set[str]] = {}
    by_size: dict[str, set[tuple[str, str]]] = {}
    for ln, look in zip(lines, looks, strict=True):
        label = ln.get_label()
        pol = "LRU" if "LRU" in label else "ARC"
        size = label.split(",")[0]
        by_policy.setdefault(pol, set()).add(look[0])
        by_size.setdefault(size, set()).add(look[1:])
    assert all(len(v) == 1 for v in by_policy.values()) and len(by_policy) == 2
    assert len({c for v in by_policy.values() for c in v}) == 2
    assert all(len(v) == 1 for v in by_size.values()) and len(by_size) == len(sizes)


@pytest.mark.parametrize(("sizes", "policies"), [
    ([0, 256, 512, 1024, 1536], ["lru"]),                       # one legend entry per line
    ([0, 256, 512, 1024, 1536], ["lru", "arc", "belady"]),      # 15 lines: colours and styles once each
    (list(range(1, 15)), ["lru", "arc"]),                       # 28 lines: the generated dash patterns too
])
def test_ttft_cdfs_legend_handles_are_distinguishable(tmp_path: Path, sizes: list[int],
                                                      policies: list[str]) -> None:
    """Every legend handle shows a whole period of its dash pattern (a long pattern cut after
    its first dash reads as solid: "0 GiB" and "1536 GiB" looked alike), and no two handles
    share a (colour, dash pattern)."""
    df = fake_sweep(tmp_path, sizes, policies)
    fig = plots.ttft_cdfs(df, root=tmp_path)
    leg = fig.axes[0].get_legend()
    handle_pt = leg.handlelength * leg.prop.get_size_in_points()
    handles = [h for h in leg.legend_handles if h is not None]
    assert len(handles) == (len(df) if len(df) <= 14 else len(sizes) + len(policies))
    # (offset, on-off sequence) as drawn: scaled by the line width, so in points; None: solid
    dashes = [getattr(h, "_dash_pattern", (0, None))[1] for h in handles]
    assert sum(d is not None for d in dashes) == len(sizes) - 1        # every size but the first is dashed
    for h, d in zip(handles, dashes, strict=True):
        period_pt = sum(d or ())
        assert period_pt < handle_pt, (f"{h.get_label()}: a dash period of {period_pt:.1f} pt in a "
                                       f"{handle_pt:.1f} pt legend handle")
    looks = [_look(h) for h in handles]
    assert len(set(looks)) == len(looks), "two legend handles look alike"


def test_hit_rate_log2_axis_with_zero_apart(tmp_path: Path) -> None:
    df = fake_sweep(tmp_path, [0, 64, 128, 256, 512], ["lru", "arc"])
    fig = plots.hit_rate_vs_cpu(df)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    # 0 GiB cannot sit on a log axis: drawn as its own marker, left of the smallest size, labelled
    zero = [ln for ln in ax.get_lines() if ln.get_gid() == "zero-gib"]
    assert len(zero) == 2 and all(ln.get_linestyle() == "None" and ln.get_marker() not in ("", "None")
                                  for ln in zero)
    assert all(0 < float(ln.get_xdata()[0]) < 64 for ln in zero)
    assert "0" in [t.get_text() for t in ax.get_xticklabels()]
    # the legend is outside the data
    assert fig.legends and not ax.get_legend()
    fig.canvas.draw()
    leg = fig.legends[0].get_window_extent()
    for a in fig.axes:
        box = a.get_window_extent()
        assert leg.x0 >= box.x1 - 0.5 or leg.y0 >= box.y1 - 0.5
    assert plots.layout_problems(fig) == []


def test_overloaded_points_are_marked_on_both_sweep_figures(tmp_path: Path) -> None:
    df = fake_sweep(tmp_path, [0, 64, 256], ["lru"])
    df["overloaded"] = [True, False, False]
    fig = plots.hit_rate_vs_cpu(df)
    for ax in fig.axes[:2]:
        marks = [ln for ln in ax.get_lines() if ln.get_gid() == "overloaded"]
        assert len(marks) == 1 and len(marks[0].get_xdata()) == 1   # only the 0 GiB point
    assert any("overloaded" in t.get_text() for leg in fig.legends for t in leg.get_texts())
    cdfs = plots.ttft_cdfs(df, root=tmp_path)
    ax = cdfs.axes[0]
    assert "1 overloaded" in ax.get_title()
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert sum("[OVERLOADED]" in lab for lab in labels) == 1
    # a sweep written before the verdict existed draws no mark
    old = plots.hit_rate_vs_cpu(fake_sweep(tmp_path / "old", [0, 64, 256], ["lru"]))
    assert not [ln for ln in old.axes[0].get_lines() if ln.get_gid() == "overloaded"]


def test_hit_rate_linear_below_4x(tmp_path: Path) -> None:
    df = fake_sweep(tmp_path, [16, 32, 48], ["lru"])
    fig = plots.hit_rate_vs_cpu(df)
    assert fig.axes[0].get_xscale() == "linear"


# ----------------------------------------------------------------------------------------------
# runs
# ----------------------------------------------------------------------------------------------

def _occupancy_with_gap() -> pd.DataFrame:
    t = [0.0, 1.0, 2.0, 53.0, 54.0]          # the engine went idle for 51 s after t = 2
    pending = [0, 10, 30, 0, 0]
    df = _empty("occupancy")
    data = {c: [0] * len(t) for c in df.columns}
    data.update({"t_s": t, "cpu_present": [0, 5, 20, 50, 50], "cpu_pending_store": pending,
                 "cpu_loading": [0] * 5, "cpu_free": [100 - p - q for p, q in zip([0, 5, 20, 50, 50], pending,
                                                                                   strict=True)]})
    return pd.DataFrame(data).astype(df.dtypes.to_dict())


def test_occupancy_is_drawn_as_steps(tmp_path: Path) -> None:
    fig = plots.occupancy(fake_run(tmp_path, occupancy=_occupancy_with_gap()))
    top, bottom = fig.axes[:2]
    lines = [ln for ln in bottom.get_lines() if not ln.get_label().startswith("_")]
    assert lines and all(ln.get_drawstyle() == "steps-post" for ln in lines)
    # the stacked shares hold their value across the idle gap: no ramp from t=2 to t=53
    pending_poly = top.collections[2]   # present idle, loading, pending, free
    verts = pending_poly.get_paths()[0].vertices
    held = [(x, y) for x, y in verts if 2.0 < x < 53.0]
    assert not held, "a vertex inside the gap means a ramp"
    assert any(abs(x - 53.0) < 1e-9 and abs(y - 50.0) < 1e-9 for x, y in verts), \
        "the pending band should keep its t=2 top (20 + 30 = 50 %) until t=53"


@pytest.mark.parametrize(("error", "word"), [("RuntimeError: boom", "FAILED"),
                                             ("KeyboardInterrupt", "INTERRUPTED")])
def test_failed_run_says_so_in_the_title(tmp_path: Path, error: str, word: str) -> None:
    run = fake_run(tmp_path, summary={"status": "failed", "error": error,
                                      "progress": {"requests_finished": 3, "sim_time_s": 12.5}})
    for fn in (plots.occupancy, plots.link_utilisation, plots.ttft_cdf):
        fig = fn(run)
        title = fig.get_suptitle()
        assert word in title and error.split(":")[0] in title, (fn.__name__, title)
    ok = fake_run(tmp_path)
    assert "FAILED" not in plots.occupancy(ok).get_suptitle()


def test_ttft_legend_p50_is_the_summary_p50(tmp_path: Path) -> None:
    ttft = [1.0, 2.0, 3.0, 4.0]   # even count: the upper median (3) differs from the linear p50 (2.5)
    req = _empty("requests")
    n = len(ttft) + 1
    data = {c: [None] * n for c in req.columns}
    data.update({"req_id": [f"r{i}" for i in range(n)], "status": ["finished"] * 4 + ["unfinished"],
                 "arrival_s": [0.0] * n, "first_token_s": [*ttft, 0.5]})
    requests = pd.DataFrame(data)
    p50 = percentile(ttft, 50)
    assert p50 == 2.5
    run = fake_run(tmp_path, requests=requests,
                   summary={"status": "ok", "sim_time_s": 10.0, "ttft_s": {"p50": p50}})
    fig = plots.ttft_cdf(run)
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("p50 2500.0 ms" in t and "4 requests" in t for t in texts), texts
