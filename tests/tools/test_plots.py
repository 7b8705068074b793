"""`sim.tools.plots` and `kvsim plot`: every figure on small real runs, the folder kinds, the
knee, and the layout checker (overlapping or clipped text, labels without units).

The sweep folder is fabricated here by the contract of ``kvsim sweep``: a few
real runs under ``points/<NNN>-<slug>/`` and a ``sweep.parquet`` written by hand
from their ``summary.json`` and ``scenario.toml`` (plus one failed point).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from sim.cli import main
from sim.errors import InputError
from sim.io.columns import flat_summary
from sim.io.results import load_results
from sim.tools import plots
from tests.helpers import ROOT

DEFAULT = ROOT / "scenarios" / "default.toml"
#: about a second per run
SMALL = ["--set", "workload.sessions=20", "-q"]


def kvsim(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def _run(folder: Path, *extra: str) -> Path:
    assert main(["run", str(DEFAULT), "--out", str(folder), *SMALL, *extra]) == 0
    return folder


def _sweep_row(i: int, run_dir: str, sc: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    cc = sc["cpu_cache"]
    row = {"point": i, "run_id": run_dir.split("/")[-1], "run_dir": run_dir, "status": "ok", "error": "",
           "cpu_cache.capacity": f"{cc['capacity'] // (1 << 30)}GiB", "cpu_cache.policy": cc["policy"],
           "model": sc["model"]["label"], "hardware": sc["hardware"]["profile"],
           "workload": sc["workload"]["kind"], "cpu_cache_bytes": cc["capacity"],
           "cpu_cache_policy": cc["policy"], "window_logic": sc["window_logic"],
           "blocks_per_chunk": sc["scheduler"]["blocks_per_chunk"],
           "h2d_bytes_per_s": sc["hardware"]["h2d_bandwidth"],
           "d2h_bytes_per_s": sc["hardware"]["d2h_bandwidth"],
           "seed": sc["seed"]}
    row.update(flat_summary(summary))
    return row


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run, one compare, one sweep (4 points x 2 policies... kept to 4 runs + 1 failed point)."""
    base = tmp_path_factory.mktemp("plots")
    run = _run(base / "run")
    assert main(["compare", str(DEFAULT), "--out", str(base / "cmp"), "--jobs", "1", *SMALL]) == 0
    sweep = base / "sweep"
    rows = []
    points = [(4, "lru"), (16, "lru"), (64, "lru"), (16, "arc")]
    for i, (gib, policy) in enumerate(points):
        rel = f"points/{i:03d}-{gib}gib-{policy}"
        _run(sweep / rel, "--set", f'cpu_cache.capacity="{gib}GiB"', "--set", f'cpu_cache.policy="{policy}"')
        sc = tomllib.loads((sweep / rel / "scenario.toml").read_text())
        rows.append(_sweep_row(i, rel, sc, json.loads((sweep / rel / "summary.json").read_text())))
    failed = dict(rows[0], point=len(rows), run_id="004-1gib-lru", run_dir="points/004-1gib-lru",
                  status="failed", error="InvariantViolation('boom')", cpu_cache_bytes=1 << 30)
    for k in ("cpu_hit_rate", "recompute_saved", "ttft_s_p50", "requests_finished"):
        failed[k] = np.nan
    rows.append(failed)
    pd.DataFrame(rows).to_parquet(sweep / "sweep.parquet")
    (sweep / "sweep.toml").write_text('schema = "sweep/1"\nname = "cpu-size"\n')
    return {"run": run, "compare": base / "cmp", "sweep": sweep}


def _assert_clean(fig: Any) -> None:
    problems = plots.layout_problems(fig)
    assert problems == [], "\n".join(problems)


# -- import --------------------------------------------------------------------------------------


def test_importing_sim_plots_does_not_import_matplotlib() -> None:
    code = ("import sys, sim, sim.tools.plots, sim.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'pandas')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the knee ------------------------------------------------------------------------------------


def test_knee_of_known_curves() -> None:
    x = [1, 2, 3, 4, 5, 6, 7, 8]
    # rises steeply to x=3, then flat: the knee is where it flattens
    assert plots.knee(x, [0, 50, 90, 92, 93, 94, 95, 96]) == 3.0
    # the classic saturating curve 1 - 1/x: normalised distance above the chord is largest at x=3
    y = [1 - 1 / v for v in x]
    d = [(yi - y[0]) / (y[-1] - y[0]) - (xi - 1) / 7 for xi, yi in zip(x, y, strict=True)]
    assert plots.knee(x, y) == float(x[int(np.argmax(d))]) == 3.0
    # doubling sizes with a hit rate that gains 40 points per doubling up to 64, then 1 point
    sizes = [8, 16, 32, 64, 128, 256]
    hits = [10, 50, 90, 130, 131, 132]
    assert plots.knee(sizes, hits, log_x=True) == 64.0
    # unsorted input is sorted first
    assert plots.knee(sizes[::-1], hits[::-1], log_x=True) == 64.0
    # a falling curve that flattens (convex): the knee is below the chord
    assert plots.knee(x, [100, 20, 10, 8, 7, 6, 5, 4], curve="convex") == 2.0


def test_knee_none_when_there_is_none() -> None:
    assert plots.knee([1, 2, 3, 4], [1, 2, 3, 4]) is None          # a straight line
    assert plots.knee([1, 2, 3, 4], [5, 5, 5, 5]) is None          # flat
    assert plots.knee([1, 2], [0, 1]) is None                      # too few points
    assert plots.knee([1, 2, 3, 4], [0, 1, 4, 9]) is None          # convex rising: no concave knee
    with pytest.raises(ValueError, match="equal length"):
        plots.knee([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="curve"):
        plots.knee([1, 2, 3], [1, 2, 3], curve="sideways")
    with pytest.raises(ValueError, match="x > 0"):
        plots.knee([0, 1, 2], [1, 2, 3], log_x=True)


# -- the layout checker --------------------------------------------------------------------------


@plots._styled
def _bad_figure() -> Any:
    fig = plots._figure(4.0, 3.0)
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1])
    ax.set_xlabel("time")                              # no unit
    ax.set_xticks([0.0, 0.01, 0.02], ["first tick label", "second tick label", "third"])  # overlapping
    ax.text(0.5, 0.5, "note A", transform=ax.transAxes)
    ax.text(0.52, 0.5, "note B overlapping A", transform=ax.transAxes)
    ax.text(1.5, 0.5, "outside the figure", transform=ax.transAxes)
    return fig


def test_layout_checker_fails_on_a_bad_figure() -> None:
    problems = plots.layout_problems(_bad_figure())
    text = "\n".join(problems)
    assert "no y label" in text
    assert "x label 'time' has no unit" in text
    assert "'first tick label' overlaps" in text
    assert "'note A' overlaps" in text and "'note B overlapping A'" in text
    assert "'outside the figure' lies outside the figure" in text


def test_layout_checker_flags_a_legend_over_text() -> None:
    @plots._styled
    def fig_with_legend_on_note() -> Any:
        fig = plots._figure(5.0, 3.5)
        ax = fig.subplots()
        ax.plot([0, 1], [0, 1], label="a line with a long legend entry")
        ax.set_xlabel("x (s)")
        ax.set_ylabel("y (count)")
        ax.text(0.98, 0.95, "hidden note", transform=ax.transAxes, ha="right", va="top")
        ax.legend(loc="upper right")
        return fig

    problems = plots.layout_problems(fig_with_legend_on_note())
    assert any("legend box" in p and "hidden note" in p for p in problems), problems


# -- the figures ---------------------------------------------------------------------------------


def _texts(fig: Any) -> str:
    return "\n".join(t.get_text() for _, t, _ in plots._texts(fig) if hasattr(t, "get_text"))


def test_run_figures(folders: dict[str, Path]) -> None:
    run = load_results(folders["run"])
    fig = plots.occupancy(run)
    _assert_clean(fig)
    top = fig.axes[0]
    assert top.get_ylabel() == "CPU chunks (% of capacity)" and top.get_ylim() == (0.0, 100.0)
    # the stacked states add up to the capacity at every sample
    stacks = top.collections
    assert len(stacks) == 4
    text = _texts(fig)
    assert "default: hybrid-demo on h200, multiturn, NEW logic (seed 0)" in text
    assert "LRU" in text and "chunks = 64 GiB" in text
    for state in ("present, idle", "pending store", "free"):
        assert state in text

    fig = plots.link_utilisation(run)
    _assert_clean(fig)
    ax = fig.axes[0]
    assert "%" in ax.get_ylabel() and ax.get_xlabel() == "simulated time (s)"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0].startswith("H2D loads, 55 GB/s") and legend[1].startswith("D2H stores, 55 GB/s")
    # the busy share over the run agrees with the summary's utilisation
    util = run.summary["transfers"]["d2h_utilisation"]
    assert f"{100 * util:.2f}% busy" in legend[1]

    fig = plots.ttft_cdf(run)
    _assert_clean(fig)
    finished = int(run.requests["first_token_s"].notna().sum())
    assert f"NEW logic: {finished:,} requests" in _texts(fig)
    with pytest.raises(ValueError, match="labels"):
        plots.ttft_cdf([run, run], ["one"])


def test_busy_per_bin_is_exact() -> None:
    edges = np.array([0.0, 1.0, 2.0, 3.0])
    busy = plots._busy_per_bin([0.5, 1.5], [1.5, 1.75], edges)
    assert busy.tolist() == [0.5, 0.75, 0.0]


def test_compare_figure(folders: dict[str, Path]) -> None:
    fig = plots.old_vs_new(folders["compare"])
    _assert_clean(fig)
    axes = fig.axes
    assert len(axes) == 6
    assert axes[0].get_title().startswith("OLD") and axes[1].get_title().startswith("NEW")
    # shared axes per row
    assert axes[0].get_shared_y_axes().joined(axes[0], axes[1])
    assert axes[4].get_shared_x_axes().joined(axes[4], axes[5])
    assert "OLD vs NEW logic" in _texts(fig)


def test_compare_figure_legends_cover_no_curve(folders: dict[str, Path]) -> None:
    """The cumulative rows (failures, tokens loaded) keep their legend in the upper left: every
    curve stays below the legend box, whatever its shape (one that rises early ran under it)."""
    fig = plots.old_vs_new(folders["compare"])
    fig.draw_without_rendering()
    for ax in fig.axes[:4]:                                   # rows 0 and 1, both columns
        box = ax.get_legend().get_window_extent().transformed(ax.transAxes.inverted())
        for line in ax.get_lines():
            ys = np.asarray(line.get_ydata(), dtype=float)
            if not len(ys):
                continue
            top = ax.transLimits.transform((0.0, float(np.nanmax(ys))))[1]   # axes fraction
            assert top < box.y0, f"{ax.get_title()}: {line.get_label()} reaches under the legend"


def test_sweep_figures(folders: dict[str, Path]) -> None:
    table = pd.read_parquet(folders["sweep"] / "sweep.parquet")
    fig = plots.hit_rate_vs_cpu(folders["sweep"])
    _assert_clean(fig)
    text = _texts(fig)
    assert "cpu-size: hybrid-demo on h200, multiturn, NEW logic (4 points)" in text
    assert "1 failed point skipped: 004-1gib-lru" in text
    hit, saved = fig.axes
    assert saved.get_ylabel() == "recompute saved (% of prefill work)"
    assert hit.get_xlabel() == "CPU cache size (GiB, log scale)"
    assert hit.get_ylabel() == "CPU hit rate (% of prompt tokens)"
    # one line per policy, the LRU line through the three LRU points, in %
    lru = next(ln for ln in hit.get_lines() if ln.get_label() == "LRU")
    ok = table[(table["status"] == "ok") & (table["cpu_cache_policy"] == "lru")]
    ok = ok.sort_values("cpu_cache_bytes")
    assert list(lru.get_xdata()) == [4.0, 16.0, 64.0]
    assert np.allclose(lru.get_ydata(), 100 * ok["cpu_hit_rate"].to_numpy())
    assert {t.get_text() for t in fig.legends[0].get_texts()} == {"ARC", "LRU"}
    assert fig.legends[0].get_title().get_text() == "policy"
    # the knee mark agrees with knee()
    k = plots.knee(ok["cpu_cache_bytes"] / (1 << 30), ok["cpu_hit_rate"], log_x=True)
    assert k == 16.0  # the hit rate grows fast to 16 GiB, slowly after
    notes = [t.get_text() for t in hit.texts]
    assert any(n.startswith("knee: 16 GiB") for n in notes), notes

    # the same from the DataFrame
    assert plots.hit_rate_vs_cpu(table).axes[0].get_lines()

    fig = plots.ttft_cdfs(folders["sweep"])
    _assert_clean(fig)
    legend = fig.axes[0].get_legend()
    assert legend.get_title().get_text() == "CPU cache, policy"
    assert [t.get_text() for t in legend.get_texts()] == ["4 GiB, LRU", "16 GiB, ARC", "16 GiB, LRU",
                                                         "64 GiB, LRU"]


def test_sweep_with_another_varying_key_names_it(folders: dict[str, Path]) -> None:
    table = pd.read_parquet(folders["sweep"] / "sweep.parquet")
    table["workload.sessions"] = [20, 20, 20, 20, 20]
    table.loc[3, "workload.sessions"] = 40            # the ARC point differs in a swept key too
    assert plots._varying(table[table["status"] == "ok"], exclude=("cpu_cache_bytes", "seed")) == [
        "cpu_cache_policy"]                           # it adds no split beyond the policy
    table.loc[0, "workload.sessions"] = 40
    keys = plots._varying(table[table["status"] == "ok"], exclude=("cpu_cache_bytes", "seed"))
    assert keys == ["cpu_cache_policy", "workload.sessions"]
    fig = plots.hit_rate_vs_cpu(table)
    _assert_clean(fig)
    labels = {t.get_text() for t in fig.legends[0].get_texts()}
    assert labels == {"ARC, sessions=40", "LRU, sessions=20", "LRU, sessions=40"}
    assert fig.legends[0].get_title().get_text() == "policy, workload.sessions"


def _tiers_table() -> Any:
    """A tiers what-if's table: 2 sizes x {no tier, 1 TiB} x {LRU, Belady}, one point overloaded."""
    rows = []
    for size in (64, 512):
        for tiers in ("[]", '[{"capacity": "1TiB", "device": "pm1743"}]'):
            for pol in ("lru", "belady"):
                hit = 0.05 * (size == 512) + 0.1 * (tiers != "[]") + 0.02 * (pol == "belady")
                rows.append({"point": len(rows), "run_id": f"{len(rows):03d}", "status": "ok",
                             "cpu_cache_bytes": size * 2**30, "cpu_cache_policy": pol, "tiers": tiers,
                             "cpu_hit_rate": hit, "ttft_s_p50": 2.0 - hit, "ttft_s_p90": 8.0 - hit,
                             "overloaded": len(rows) == 0})
    return pd.DataFrame(rows)


def test_the_tiers_whatif_figure() -> None:
    fig = plots.tiers_whatif(_tiers_table())
    _assert_clean(fig)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["LRU, no tier", "Belady, no tier", "LRU, pm1743 1TiB", "Belady, pm1743 1TiB",
                      "overloaded (queue grows: TTFT not usable)"]
    hit, p50, p90 = fig.axes
    assert [ax.get_yscale() for ax in (hit, p50, p90)] == ["linear", "log", "log"]
    assert p90.get_ylabel() == "TTFT p90 (s)" and "8 points" in fig.get_suptitle()
    assert plots.tier_label("[]") == "no tier"
    assert plots.tier_label([{"kind": "nvme", "chunks": 10}, {"device": "net-400g"}]) == \
        "nvme 10 + net-400g (unbounded)"


# -- writing the files and the command line ------------------------------------------------------


def test_kvsim_plot_writes_every_kind(folders: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    expected = {
        "run": ["occupancy.png", "link_utilisation.png", "ttft_cdf.png"],
        "compare": ["old_vs_new.png", "ttft_cdf.png", "old-occupancy.png", "old-link_utilisation.png",
                    "new-occupancy.png", "new-link_utilisation.png"],
        "sweep": ["hit_rate_vs_cpu.png", "ttft_cdfs.png"],
    }
    for kind, names in expected.items():
        assert plots.folder_kind(folders[kind]) == kind
        code, out, err = kvsim(["plot", str(folders[kind])], capsys)
        assert code == 0, err
        paths = [Path(line) for line in out.splitlines()]
        assert paths == [folders[kind] / "plots" / n for n in names]
        for p in paths:
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if kind == "sweep":
            assert "1 failed point(s) skipped in the plots: 004-1gib-lru" in err
    # --out, and the same data give the same bytes
    code, out, _ = kvsim(["plot", str(folders["run"]), "--out", str(tmp_path / "elsewhere")], capsys)
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == sorted(expected["run"])
    for name in expected["run"]:
        assert (tmp_path / "elsewhere" / name).read_bytes() == (folders["run"] / "plots" / name).read_bytes()


def test_compare_png_is_the_old_vs_new_figure(folders: dict[str, Path]) -> None:
    import matplotlib.image

    img = matplotlib.image.imread(folders["compare"] / "compare.png")
    assert img.shape[0] >= 400 and img.shape[1] >= 1000
    again = matplotlib.image.imread(folders["compare"] / "plots" / "old_vs_new.png")
    assert img.shape == again.shape


def test_kvsim_plot_rejects_other_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    code, out, err = kvsim(["plot", str(tmp_path / "empty")], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert "not a results folder (no sweep.parquet, compare.json or summary.json)" in err
    assert "allowed: a folder written by kvsim run, kvsim compare or kvsim sweep" in err
    code, _, err = kvsim(["plot", str(tmp_path / "missing")], capsys)
    assert code == 2 and "not a directory" in err
    with pytest.raises(InputError):
        plots.write_plots(tmp_path / "empty")
    assert not (tmp_path / "empty" / "plots").exists()


def test_kvsim_run_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = kvsim(["run", str(DEFAULT), "--out", str(tmp_path / "r"), "--plots",
                            "--set", "workload.sessions=8", "-q"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "r" / "plots").iterdir()) == [
        "link_utilisation.png", "occupancy.png", "ttft_cdf.png"]
    assert f"plot: {tmp_path / 'r' / 'plots' / 'occupancy.png'}" in out


def test_link_utilisation_of_a_run_stopped_early_agrees_with_its_summary(tmp_path: Path) -> None:
    """A run stopped by its time limit with a slow load in flight: the figure's busy share
    (from the transfers table, which has no row for the job still in flight) equals
    summary.json's, at most 100 % (before: 170 % in the summary)."""
    import tomli_w

    from sim.tools import fuzz

    data = fuzz.run_config(fuzz._rng_for(5, 523))   # a 200 KB/s host-to-device link
    data = {**data, "window_logic": "new", "name": "stopped",
            "output": {**data["output"], "max_sim_time_s": 0.3}}
    scenario = tmp_path / "stopped.toml"
    scenario.write_text(tomli_w.dumps(data))
    assert main(["run", str(scenario), "--out", str(tmp_path / "out"), "-q"]) == 0
    run = load_results(tmp_path / "out")
    assert run.summary["end"] == "time_limit"
    legend = [t.get_text() for t in plots.link_utilisation(run).axes[0].get_legend().get_texts()]
    for text, direction in zip(legend, ("h2d", "d2h"), strict=True):
        util = run.summary["transfers"][f"{direction}_utilisation"]
        assert util <= 1.0
        assert f"{100 * util:.2f}% busy" in text, (text, util)
