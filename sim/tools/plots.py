"""Figures of runs, compares and sweeps (``kvsim plot``, ``kvsim run --plots``).

What it draws
    One run (``kvsim run``): :func:`occupancy` (CPU chunks by state over
    time), :func:`link_utilisation` (H2D / D2H busy share per time bin) and
    :func:`ttft_cdf` (TTFT CDF of one or more runs). A compare
    (``kvsim compare``): :func:`old_vs_new`, OLD left and NEW right on shared
    axes (modelled crashes / hazards / integrity violations, tokens loaded
    from the CPU cache, TTFT CDF); ``compare.png`` is this figure. A sweep
    (``kvsim sweep``): :func:`hit_rate_vs_cpu` (CPU hit rate and recompute
    saved against CPU cache size, one line per policy and per other varying
    parameter, the :func:`knee` of each line marked) and :func:`ttft_cdfs`
    (TTFT CDF of every point); a sweep over secondary tiers:
    :func:`tiers_whatif` (CPU hit rate, TTFT p50 and p90 against CPU cache
    size, one line per tier choice and policy). :func:`write_plots` tells the three folder
    kinds apart by the file that marks them (``sweep.parquet``,
    ``compare.json``, ``summary.json``) and writes every figure of the kind
    as PNG into ``<folder>/plots/``. ``docs/plots.md`` describes each figure.

Design
    * matplotlib is imported inside the functions, never at import time, and
      pyplot is not used at all: every figure is a plain
      ``matplotlib.figure.Figure`` with an Agg canvas, so no global backend
      or figure registry is touched (a notebook keeps its own backend and
      shows the returned figure).
    * One style for every figure: :data:`STYLE` (rcParams, applied around
      each figure function), :data:`DPI`, constrained layout, and a fixed
      colour per policy, logic, link, chunk state and event kind.
    * Every axis label carries its unit in parentheses; titles say what was
      run (scenario, model, hardware, workload, logic); legends name what
      differs between the lines. :func:`layout_problems` checks a rendered
      figure for overlapping or clipped text and labels without units (the
      tests run it on every figure).

Invariants
    * ``import sim.tools.plots`` imports neither matplotlib nor pandas;
    * a figure function never writes files; :func:`save_figure` writes a PNG
      atomically (temporary file, then rename) with no timestamp metadata,
      so the same data give the same bytes.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

import numpy as np
import pyarrow.parquet as pq

from sim.engine.metrics import percentile
from sim.errors import InputError
from sim.io.results import (
    RunResults,
    clean_leftovers,
    load_results,
    make_folder,
    out_error,
    remove_created,
    result_kind,
    temp_beside,
)
from sim.tools.sweep import SweepResults, load_sweep

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from sim.io.results import RunResults

__all__ = [
    "DPI",
    "EVENT_COLOURS",
    "LINK_COLOURS",
    "LOGIC_COLOURS",
    "POLICY_COLOURS",
    "STATE_COLOURS",
    "STYLE",
    "compare_folder_logics",
    "folder_kind",
    "hit_rate_vs_cpu",
    "knee",
    "layout_problems",
    "link_utilisation",
    "occupancy",
    "old_vs_new",
    "run_title",
    "save_figure",
    "tier_label",
    "tiers_whatif",
    "ttft_cdf",
    "ttft_cdfs",
    "write_plots",
]

#: resolution of every figure and PNG (dots per inch)
DPI = 110

#: rcParams applied around every figure function (one style for all figures)
STYLE: dict[str, Any] = {
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "legend.title_fontsize": 8,
    "figure.titlesize": 11,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.6,
    "legend.framealpha": 0.9,
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
}

#: colour of each eviction policy (sweeps)
POLICY_COLOURS: dict[str, str] = {"lru": "#1f77b4", "arc": "#ff7f0e", "belady": "#2ca02c"}
#: colour of each window logic (compare)
LOGIC_COLOURS: dict[str, str] = {"old": "#d62728", "new": "#2ca02c", "latest": "#1f77b4"}
#: colour of each link direction
LINK_COLOURS: dict[str, str] = {"h2d": "#9467bd", "d2h": "#8c564b"}
#: colour of each CPU chunk state (occupancy)
STATE_COLOURS: dict[str, str] = {"present": "#6baed6", "loading": "#08519c", "pending": "#fd8d3c",
                                 "free": "#e5e5e5"}
#: colour of each modelled event kind (compare)
EVENT_COLOURS: dict[str, str] = {"crash": "#d62728", "hazard": "#ff7f0e", "integrity": "#9467bd"}

#: other lines (series without a fixed colour)
_CYCLE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf")
_STYLES = ("-", "--", ":", "-.")
#: line styles that tell lines of one colour apart (named, then dash patterns), see :func:`_line_style`
_DASHES: tuple[Any, ...] = ("-", "--", ":", "-.", (0, (8, 2, 2, 2, 2, 2)), (0, (1, 1)), (0, (6, 1.5)),
                            (0, (3, 1, 1, 1)), (0, (10, 3)), (0, (3, 4, 1, 4)), (0, (1, 3)),
                            (0, (6, 2, 1, 2, 1, 2)))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")

_LOGIC_NAMES = {"old": "OLD (vLLM 0.29.0)", "new": "NEW (vLLM 0.30.0)", "latest": "LATEST (vLLM 0.33.0)"}
_GIB = float(1 << 30)

P = ParamSpec("P")
R = TypeVar("R")


def _styled(fn: Callable[P, R]) -> Callable[P, R]:
    """Run a figure function inside :data:`STYLE` (rcParams are read when artists are made)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import matplotlib  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

        with matplotlib.rc_context(cast(Any, STYLE)):
            return fn(*args, **kwargs)

    return wrapper


def _figure(width: float, height: float) -> Figure:
    """A new constrained-layout figure on an Agg canvas (no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn
    from matplotlib.figure import Figure  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as PNG to ``path`` atomically (no timestamp metadata).

    Returns:
        the path written.
    """
    import matplotlib  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with matplotlib.rc_context(cast(Any, STYLE)):
            fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# -- titles and labels --------------------------------------------------------------------


def run_title(scenario: dict[str, Any], logic: str | None = None) -> str:
    """``"default: hybrid-demo on h200, multiturn, NEW logic (seed 0)"`` from a resolved scenario.

    Args:
        scenario: a run's ``scenario.toml`` as a dict.
        logic: replaces the scenario's window logic in the text ("OLD vs NEW" for a compare).
    """
    name = scenario.get("name", "run")
    model = (scenario.get("model") or {}).get("label") or (scenario.get("model") or {}).get("name") or "?"
    hw = (scenario.get("hardware") or {}).get("profile") or "?"
    wl = (scenario.get("workload") or {}).get("kind") or "?"
    lg = logic if logic is not None else f"{str(scenario.get('window_logic', '?')).upper()} logic"
    seed = scenario.get("seed")
    tail = f" (seed {seed})" if seed is not None else ""
    return f"{name}: {model} on {hw}, {wl}, {lg}{tail}"


def run_status(summary: dict[str, Any]) -> str | None:
    """``None`` for a run that finished, else one line saying it did not (for a title):
    ``"FAILED (RuntimeError: ...) after 3 requests, 12.5 s simulated: partial data"``,
    or ``INTERRUPTED`` when the error is a Ctrl-C / termination."""
    if summary.get("status", "ok") == "ok":
        return None
    error = str(summary.get("error") or "no error recorded").splitlines()[0]
    word = "INTERRUPTED" if error.split(":")[0].strip() in ("KeyboardInterrupt", "SystemExit") else "FAILED"
    if len(error) > 70:
        error = error[:67] + "..."
    prog = summary.get("progress") or {}
    done = prog.get("requests_finished")
    at = prog.get("sim_time_s")
    tail = ""
    if done is not None and at is not None:
        tail = f" after {_n(int(done), 'finished request')}, {float(at):.1f} s simulated"
    return f"run {word} ({error}){tail}: partial data"


def _run_suptitle(res: RunResults, logic: str | None = None) -> str:
    """:func:`run_title`, plus a second line when the run failed or was interrupted."""
    status = run_status(res.summary)
    head = run_title(res.scenario, logic)
    return head if status is None else f"{head}\n{status}"


def _n(count: int, noun: str) -> str:
    """``"1 request"``, ``"1,024 requests"``."""
    return f"{count:,} {noun if count == 1 else noun + 's'}"


def _duration(seconds: float) -> str:
    """A duration as the run summary prints it: ms below 10 s, s from 10 s on."""
    return f"{seconds:.2f} s" if seconds >= 10 else f"{1000 * seconds:.1f} ms"


def _p50_text(xs: Any) -> str:
    """``", p50 123.4 ms"``: the median exactly as ``summary.json``'s ``ttft_s.p50`` (linear
    interpolation between the two middle samples, :func:`sim.engine.metrics.percentile`)."""
    if not len(xs):
        return ""
    p50 = percentile([float(x) for x in xs], 50)
    return "" if p50 is None else f", p50 {_duration(p50)}"


def _line_style(i: int) -> Any:
    """The ``i``-th distinct line style (named styles, then dash patterns; never repeats)."""
    if i < len(_DASHES):
        return _DASHES[i]
    k = i - len(_DASHES)
    return (0, (2 + k, 2, 1, 2))


def _dash_period(linestyle: Any) -> float:
    """One period of a line style's dash pattern, in line widths (matplotlib scales dashes by
    the line width; ``lines.scale_dashes``); 0 for a solid line."""
    import matplotlib  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

    if isinstance(linestyle, tuple):
        return float(sum(linestyle[1] or ()))
    rc = {"--": "lines.dashed_pattern", "dashed": "lines.dashed_pattern", ":": "lines.dotted_pattern",
          "dotted": "lines.dotted_pattern", "-.": "lines.dashdot_pattern", "dashdot": "lines.dashdot_pattern"}
    key = rc.get(linestyle) if isinstance(linestyle, str) else None
    return 0.0 if key is None else float(sum(cast(Any, matplotlib.rcParams)[key]))


def _handle_length(drawn: Sequence[tuple[Any, float]]) -> float:
    """A legend ``handlelength`` (in font sizes) that shows at least one whole period, with a
    quarter to spare, of every ``(line style, line width)`` drawn in it: matplotlib's default
    of 2 font sizes (16 pt) shows only the first dash of a long pattern such as
    ``(0, (8, 2, 2, 2, 2, 2))`` (23 pt at 1.3 pt wide), which then reads as a solid line."""
    import matplotlib  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn
    from matplotlib.font_manager import FontProperties  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

    scale = bool(matplotlib.rcParams["lines.scale_dashes"])
    need_pt = max((_dash_period(ls) * (lw if scale else 1.0) for ls, lw in drawn), default=0.0)
    font_pt = FontProperties(size=matplotlib.rcParams["legend.fontsize"]).get_size_in_points()
    return max(2.0, math.ceil(2.0 * 1.25 * need_pt / font_pt) / 2.0)


def _gib(nbytes: float) -> str:
    v = nbytes / _GIB
    return f"{v:g} GiB" if abs(v - round(v)) < 1e-9 or v >= 100 else f"{v:.3g} GiB"


def _gbps(nbytes_per_s: float) -> str:
    return f"{nbytes_per_s / 1e9:g} GB/s"


def _nice_step(span: float, target: int) -> float:
    """A 1/2/5 x 10^k step giving about ``target`` steps over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return float(m * mag)
    return float(10 * mag)  # pragma: no cover


def _ttft_s(requests: Any) -> Any:
    """Sorted TTFT samples (s): the finished requests with a first token, the samples of
    ``summary.json``'s ``ttft_s`` (every request with a first token when the table has no
    ``status`` column)."""
    if len(requests) == 0:
        return np.empty(0)
    ft = requests["first_token_s"].to_numpy(dtype=float, na_value=np.nan)
    arr = requests["arrival_s"].to_numpy(dtype=float)
    ok = ~np.isnan(ft)
    if "status" in requests.columns:
        ok &= (requests["status"].astype(str) == "finished").to_numpy()
    return np.sort(ft[ok] - arr[ok])


def _cdf_axes(ax: Any, samples: Sequence[Any]) -> None:
    """x label, scale (log when the samples span more than 100x) and y range of a TTFT CDF."""
    pos = np.concatenate([s[s > 0] for s in samples]) if samples else np.empty(0)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("requests with TTFT ≤ x (fraction)")
    ax.set_ylim(0, 1.02)
    if len(pos) and pos.max() / pos.min() > 100:
        from matplotlib.ticker import FuncFormatter  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        ax.set_xlabel("time to first token (s, log scale)")
    else:
        ax.set_xlim(left=0)


def _draw_cdf(ax: Any, xs: Any, **kw: Any) -> None:
    if len(xs) == 0:
        return
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(np.concatenate([[xs[0]], xs]), np.concatenate([[0.0], ys]), where="post", **kw)


def _note(ax: Any, text: str) -> None:
    """A centred note in an empty panel."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9, color="#555555")


# -- one run ------------------------------------------------------------------------------


def _load_run(run: RunResults | str | Path) -> RunResults:
    return run if isinstance(run, RunResults) else load_results(run)


def _capacity_text(run: RunResults, chunks: int) -> str:
    cc = run.scenario.get("cpu_cache") or {}
    size = f" = {_gib(cc['capacity'])}" if isinstance(cc.get("capacity"), int) else ""
    policy = str(cc.get("policy", "?")).upper()
    return f"capacity {chunks:,} chunks{size}, {policy}"


@_styled
def occupancy(run: RunResults | str | Path) -> Figure:
    """CPU chunk cache by state over simulated time.

    Top: stacked share of the capacity (present and idle, present and being
    read by a load, pending store, free), in % of capacity. Bottom: the chunks
    in flight (pending store, being loaded) in chunks, on their own scale,
    since they are a small part of the capacity. Both are drawn as steps
    (``steps-post``): a sample's value holds until the next sample, so an
    idle gap shows the state as it was, not a ramp between two samples.

    Args:
        run: a :class:`~sim.io.results.RunResults` or a run folder.
    """
    res = _load_run(run)
    occ = res.occupancy
    fig = _figure(9.0, 5.6)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.7])
    t = occ["t_s"].to_numpy(dtype=float)
    loading = occ["cpu_loading"].to_numpy(dtype=float)
    pending = occ["cpu_pending_store"].to_numpy(dtype=float)
    # cpu_present counts every readable chunk, those being loaded included
    present = occ["cpu_present"].to_numpy(dtype=float) - loading
    free = occ["cpu_free"].to_numpy(dtype=float)
    cap = present + loading + pending + free
    chunks = int(cap.max()) if len(cap) else 0
    if len(t) and chunks > 0:
        share = [100.0 * a / np.where(cap > 0, cap, 1) for a in (present, loading, pending, free)]
        labels = ["present, idle", "present, being loaded (H2D)", "pending store (D2H in flight)", "free"]
        colours = [STATE_COLOURS[k] for k in ("present", "loading", "pending", "free")]
        lower = np.zeros(len(t))
        for values, label, colour in zip(share, labels, colours, strict=True):
            upper = lower + values
            top.fill_between(t, lower, upper, step="post", label=label, color=colour, linewidth=0)
            lower = upper
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="chunk state")
        for values, state, name in ((pending, "pending", "pending store"),
                                    (loading, "loading", "being loaded")):
            bottom.plot(t, values, color=STATE_COLOURS[state], drawstyle="steps-post",
                        label=f"{name} (max {int(values.max()):,})")
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="in flight")
        bottom.set_ylim(bottom=0)
        top.set_xlim(0, t.max())
        title = f"CPU chunk cache by state ({_capacity_text(res, chunks)})"
    else:
        _note(top, "no CPU cache occupancy samples (offloading off or empty run)")
        _note(bottom, "no samples")
        title = "CPU chunk cache by state"
    top.set_ylim(0, 100)
    top.set_ylabel("CPU chunks (% of capacity)")
    top.set_xlabel("simulated time (s)")
    top.tick_params(labelbottom=True)
    top.set_title(title)
    bottom.set_ylabel("chunks in flight (count)")
    bottom.set_xlabel("simulated time (s)")
    fig.suptitle(_run_suptitle(res))
    return fig


def _busy_per_bin(start: Any, end: Any, edges: Any) -> Any:
    """Busy seconds of a link in each bin ``[edges[i], edges[i+1])``, from job intervals.

    ``busy(t) = sum over jobs of clip(t - start, 0, end - start)`` evaluated at
    the edges with sorted cumulative sums; a bin's busy time is the difference.
    """
    s = np.sort(np.asarray(start, dtype=float))
    e = np.sort(np.asarray(end, dtype=float))
    cs = np.concatenate([[0.0], np.cumsum(s)])
    ce = np.concatenate([[0.0], np.cumsum(e)])
    ks = np.searchsorted(s, edges, side="right")
    ke = np.searchsorted(e, edges, side="right")
    cum = (ks * edges - cs[ks]) - (ke * edges - ce[ke])
    return np.diff(cum)


@_styled
def link_utilisation(run: RunResults | str | Path, bins: int = 120) -> Figure:
    """H2D (loads) and D2H (stores) busy share per time bin, in %.

    A bin's value is the time the link spent on jobs inside the bin divided
    by the bin width (``transfers.start_s``..``end_s``; jobs queue behind each
    other, so a link is busy with at most one job at a time).

    Args:
        run: a :class:`~sim.io.results.RunResults` or a run folder.
        bins: about this many bins over the simulated time (the width is
            rounded to 1, 2 or 5 x 10^k s).
    """
    res = _load_run(run)
    tr = res.transfers
    end_t = float(res.summary.get("sim_time_s") or 0.0)
    if len(tr):
        end_t = max(end_t, float(tr["end_s"].max()))
    width = _nice_step(end_t, bins)
    edges = np.arange(0.0, end_t + width, width) if end_t > 0 else np.array([0.0, 1.0])
    if len(edges) < 2:
        edges = np.array([0.0, width])
    hw = res.scenario.get("hardware") or {}
    fig = _figure(9.0, 4.0)
    ax = fig.subplots()
    names = {"h2d": "H2D loads", "d2h": "D2H stores"}
    for d in ("h2d", "d2h"):
        jobs = tr[tr["direction"] == d] if len(tr) else tr
        busy = _busy_per_bin(jobs["start_s"], jobs["end_s"], edges) if len(jobs) else np.zeros(len(edges) - 1)
        pct = 100.0 * busy / width
        bw = hw.get(f"{d}_bandwidth")
        total = 100.0 * float(busy.sum()) / end_t if end_t > 0 else 0.0
        label = (f"{names[d]}{', ' + _gbps(bw) if bw else ''}: {len(jobs):,} jobs, "
                 f"{total:.2f}% busy over the run")
        ax.stairs(pct, edges, color=LINK_COLOURS[d], label=label, linewidth=1.2)
    ax.set_xlim(0, edges[-1])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel(f"link busy (% of each {width:g} s bin)")
    ax.legend(loc="upper right")
    ax.set_title(f"GPU↔CPU link utilisation per {width:g} s bin")
    fig.suptitle(_run_suptitle(res))
    return fig


@_styled
def ttft_cdf(runs: Sequence[RunResults | str | Path] | RunResults | str | Path,
             labels: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """TTFT CDF of one or more runs (finished requests with a first token, as the
    summary counts them). The legend gives each run's p50 exactly as the summary's
    ``ttft_s.p50`` (linear interpolation). A failed or interrupted run is named so.

    Args:
        runs: runs or run folders (or a single one).
        labels: one legend entry per run (default: the window logic of a single
            run, else each run's folder name).
        title: the figure title (default: the first run's :func:`run_title`,
            or "TTFT of N runs").
    """
    items = [runs] if isinstance(runs, (RunResults, str, Path)) else list(runs)
    loaded = [_load_run(r) for r in items]
    if labels is not None and len(labels) != len(loaded):
        raise ValueError(f"{len(labels)} labels for {len(loaded)} runs")
    if labels is None:
        labels = ([f"{str(loaded[0].scenario.get('window_logic', '?')).upper()} logic"] if len(loaded) == 1
                  else [r.path.name for r in loaded])
    fig = _figure(7.5, 4.4)
    ax = fig.subplots()
    samples = [_ttft_s(r.requests) for r in loaded]
    for i, (xs, label, res) in enumerate(zip(samples, labels, loaded, strict=True)):
        failed = "" if run_status(res.summary) is None else " (run FAILED: partial)"
        _draw_cdf(ax, xs, color=_CYCLE[i % len(_CYCLE)], linestyle=_line_style(i // len(_CYCLE)),
                  label=f"{label}{failed}: {_n(len(xs), 'request')}{_p50_text(xs)}")
    _cdf_axes(ax, samples)
    if ax.lines:
        ax.legend(loc="lower right")
    else:
        _note(ax, "no request got a first token")
    ax.set_title("TTFT distribution (finished requests)")
    if title is None:
        title = _run_suptitle(loaded[0]) if len(loaded) == 1 else f"TTFT of {_n(len(loaded), 'run')}"
    notes = [f"{lab}: {st}" for lab, r in zip(labels, loaded, strict=True)
             if (st := run_status(r.summary)) is not None and not (len(loaded) == 1 and st in title)]
    fig.suptitle("\n".join([title, *notes]))
    return fig


# -- compare ------------------------------------------------------------------------------


@_styled
def old_vs_new(compare: str | Path, *, runs: dict[str, RunResults] | None = None,
               figures: dict[str, Any] | None = None) -> Figure:
    """OLD (left) against NEW (right), or one column per logic of a compare of two or
    three logics (``kvsim compare --logics``), on shared axes: the figure ``compare.png``.

    Rows: modelled crashes, hazards and integrity violations over time
    (cumulative count); tokens loaded from the CPU cache over time (cumulative,
    CPU hits at first admission and reloads after preemption); TTFT CDF (the
    other logic drawn thin and grey for reference; with three logics the
    others thin and dashed in their own colours).

    Args:
        compare: a compare folder (``kvsim compare``).
        runs: the runs already read (``{"old": ..., "new": ...}``, in report order);
            read from the compare's run folders when omitted.
        figures: ``compare.json`` already read; read from the folder when omitted.
    """


    folder = Path(compare)
    if figures is None:
        figures = json.loads((folder / "compare.json").read_text(encoding="utf-8"))
    names = compare_folder_logics(figures)
    if runs is None:
        runs = {lg: load_results(folder / lg) for lg in names}
    sc = figures.get("scenario", {})
    copy_path = bool(sc.get("copy_path"))
    ncols = len(names)
    fig = _figure(11.0 if ncols == 2 else 5.5 * ncols, 8.6)
    axes = fig.subplots(3, ncols, sharex="row", sharey="row")
    ttft = {lg: _ttft_s(runs[lg].requests) for lg in names}
    end_t = max(float(runs[lg].summary.get("sim_time_s") or 0.0) for lg in names) or 1.0
    kinds = (("crash", "crashes"), ("hazard", "hazards"), ("integrity", "integrity violations"))
    top_count = 1
    top_tokens = 0.0  # millions: the shared row's limit was frozen by the first column's set_ylim
    for col, lg in enumerate(names):
        res = runs[lg]
        ax = axes[0][col]
        ev = res.events
        for kind, name in kinds:
            t = np.sort(ev.loc[ev["kind"] == kind, "t_s"].to_numpy(dtype=float)) if len(ev) else np.empty(0)
            n = len(t)
            top_count = max(top_count, n)
            xs = np.concatenate([[0.0], t, [end_t]])
            ys = np.concatenate([[0], np.arange(1, n + 1), [n]])
            count = "n/a, copy path off" if kind == "integrity" and not copy_path else f"{n:,}"
            ax.step(xs, ys, where="post", color=EVENT_COLOURS[kind], label=f"{name}: {count}",
                    linestyle="-" if n else ":")
        if not len(ev) or not ev["kind"].isin([k for k, _ in kinds]).any():
            _note(ax, "none in this run")
        ax.set_title(f"{_LOGIC_NAMES[lg]}: modelled failures")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("events so far (count)")
        ax.legend(loc="upper left")

        ax = axes[1][col]
        req = res.requests
        for what, tcol, colour, name in (("cpu_hit_tokens", "scheduled_s", LOGIC_COLOURS[lg],
                                          "CPU hits at first admission"),
                                         ("cpu_reload_tokens", "finish_s", "#7f7f7f",
                                          "reloads after preemption (at finish)")):
            if len(req):
                sel = req[req[what] > 0]
                ts = sel[tcol].to_numpy(dtype=float, na_value=np.nan)
                vals = sel[what].to_numpy(dtype=float)
                keep = ~np.isnan(ts)
                order = np.argsort(ts[keep], kind="stable")
                ts, vals = ts[keep][order], vals[keep][order]
            else:
                ts, vals = np.empty(0), np.empty(0)
            cum = np.cumsum(vals) / 1e6
            total = float(vals.sum())
            top_tokens = max(top_tokens, total / 1e6)
            ax.step(np.concatenate([[0.0], ts, [end_t]]), np.concatenate([[0.0], cum, [total / 1e6]]),
                    where="post", color=colour, label=f"{name}: {int(total):,} tokens")
        if not len(req) or int(req["cpu_hit_tokens"].sum() + req["cpu_reload_tokens"].sum()) == 0:
            _note(ax, "none in this run")
        ax.set_title(f"{_LOGIC_NAMES[lg]}: tokens loaded from the CPU cache")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("tokens so far (millions)")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left")

        ax = axes[2][col]
        for other in names:
            if other != lg:
                _draw_cdf(ax, ttft[other], color="#b0b0b0" if ncols == 2 else LOGIC_COLOURS[other],
                          linewidth=1.0, linestyle="--", label=f"{other.upper()} (for reference)")
        xs = ttft[lg]
        _draw_cdf(ax, xs, color=LOGIC_COLOURS[lg],
                  label=f"{lg.upper()}: {_n(len(xs), 'request')}{_p50_text(xs)}")
        _cdf_axes(ax, list(ttft.values()))
        ax.set_title(f"{_LOGIC_NAMES[lg]}: TTFT distribution")
        ax.legend(loc="lower right")
    if top_tokens > axes[1][0].get_ylim()[1]:  # a later column loaded more than the limit shows
        axes[1][0].set_ylim(0, top_tokens * 1.05)
    for col in range(ncols):
        axes[0][col].set_ylim(0, top_count * 1.15)
        axes[0][col].yaxis.set_major_locator(_int_locator())
        for row in range(3):
            axes[row][col].tick_params(labelleft=True)
    # the two cumulative rows keep their legends in the upper left: raise each row's y limit
    # so that its curves (0 .. the row's largest value) stay below every legend box, whatever
    # their shape (a curve that rises early would run under the box)
    _room_for_legends(fig, [(axes[0], float(top_count)), (axes[1], top_tokens)])
    div = figures.get("diverged", {})
    base = runs[names[1]].scenario or runs[names[0]].scenario
    head = run_title(base, logic=f"{' vs '.join(lg.upper() for lg in names)} logic")
    pairs = [(names[1], div), *((lg, figures.get("diverged_pairs", {}).get(f"{names[0]}-{lg}", {}))
                                for lg in names[2:])]
    differ = []
    for lg, d in pairs:
        if "outcome" in d:
            text = f"{d['outcome']} with a different outcome, {d['timing_only']} in timing only"
        else:  # a compare.json written before the split
            text = f"{d.get('count', '?')} diverging"
        differ.append(text if ncols == 2 else f"{names[0].upper()} vs {lg.upper()}: {text}")
    notes = [f"{lg.upper()} {st}" for lg in names
             if (st := run_status(runs[lg].summary)) is not None]
    fig.suptitle("\n".join([f"{head}", f"same {div.get('requests', '?')} requests, {'; '.join(differ)}",
                             *notes]))
    return fig


def _room_for_legends(fig: Figure, rows: Sequence[tuple[Any, float]], pad: float = 0.04) -> None:
    """Raise the shared y limit (from 0) of each ``(axes of one row, largest y drawn)`` so that
    the data stays ``pad`` (axes fraction) below the lowest legend box of the row. Lays the
    figure out once (constrained layout places the axes, so the boxes' heights are known);
    the boxes keep their height in axes fraction when only the y limits change."""
    fig.draw_without_rendering()
    for row_axes, top in rows:
        boxes = [ax.get_legend().get_window_extent().transformed(ax.transAxes.inverted()).y0
                 for ax in row_axes if ax.get_legend() is not None]
        if not boxes or top <= 0:
            continue
        lowest = min(boxes) - pad
        if lowest <= 0.2:      # a legend taller than most of the panel: leave the limit alone
            continue
        lo, hi = row_axes[0].get_ylim()
        row_axes[0].set_ylim(lo, max(hi, lo + (top - lo) / lowest))


def compare_folder_logics(figures: dict[str, Any]) -> tuple[str, ...]:
    """The logics of a compare folder, in report order, from its ``compare.json``
    (key ``logics``; absent: OLD and NEW)."""
    return tuple(figures.get("logics") or ("old", "new"))


def _int_locator() -> Any:
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

    return MaxNLocator(integer=True, nbins=5)


# -- sweeps -------------------------------------------------------------------------------

#: resolved per-point columns of sweep.parquet, with how a value reads in a legend
_RESOLVED: dict[str, tuple[str, Callable[[Any], str]]] = {
    "cpu_cache_bytes": ("CPU cache", lambda v: _gib(float(v))),
    "cpu_cache_policy": ("policy", lambda v: str(v).upper()),
    "window_logic": ("logic", lambda v: f"{str(v).upper()} logic"),
    "model": ("model", str),
    "hardware": ("hardware", str),
    "workload": ("workload", str),
    "blocks_per_chunk": ("blocks/chunk", lambda v: f"{v} blocks/chunk"),
    "h2d_bytes_per_s": ("H2D", lambda v: f"H2D {_gbps(float(v))}"),
    "d2h_bytes_per_s": ("D2H", lambda v: f"D2H {_gbps(float(v))}"),
    "seed": ("seed", lambda v: f"seed {v}"),
}
#: first segment of a swept dotted key (a scenario section) or a top-level scenario key
_SECTIONS = frozenset({"model", "hardware", "cpu_cache", "scheduler", "workload", "costs", "copy_path",
                       "output"})
_TOP_KEYS = frozenset({"seed", "window_logic", "on_crash", "assertions"})
#: swept keys that are the CPU cache size itself (the x axis of hit_rate_vs_cpu)
_SIZE_KEYS = frozenset({"cpu_cache.capacity", "cpu_cache.chunks"})


def _swept_columns(df: Any) -> list[str]:
    return [c for c in df.columns if c not in _RESOLVED and (
        c in _TOP_KEYS or ("." in c and c.split(".", 1)[0] in _SECTIONS))]


def _key_name(col: str) -> str:
    return _RESOLVED[col][0] if col in _RESOLVED else col


def _key_value(col: str, value: Any) -> str:
    return _RESOLVED[col][1](value) if col in _RESOLVED else f"{col.rsplit('.', 1)[-1]}={value}"


def _varying(df: Any, exclude: Sequence[str] = ()) -> list[str]:
    """The parameters that tell the rows of ``df`` apart: resolved columns with more
    than one value, then swept-key columns that split the rows further."""
    keys = [c for c in _RESOLVED if c in df.columns and c not in exclude
            and df[c].astype(str).nunique() > 1]

    def groups(cols: list[str]) -> int:
        return len({tuple(str(df[c].iloc[i]) for c in cols) for i in range(len(df))}) if cols else 1

    for c in _swept_columns(df):
        if c in exclude or (c in _SIZE_KEYS and "cpu_cache_bytes" in exclude):
            continue
        if groups([*keys, c]) > groups(keys):
            keys.append(c)
    return keys


def _read_sweep(sweep: Any) -> tuple[Any, Path | None, str]:
    """(table, folder, name) from a sweep folder, a :func:`sim.load_sweep` result
    or an already-read ``sweep.parquet`` DataFrame."""
    import pandas as pd  # noqa: PLC0415 -- pandas loads only for tables, so `kvsim check` starts light


    if isinstance(sweep, pd.DataFrame):
        return sweep, None, "sweep"
    res = sweep if isinstance(sweep, SweepResults) else load_sweep(sweep)
    name = res.spec.get("name")
    return res.table, res.path, name if isinstance(name, str) and name else res.path.resolve().name


def _ok_points(df: Any) -> tuple[Any, list[str]]:
    """(rows of finished points, names of the failed or metric-less points skipped)."""
    status = df["status"].astype(str) if "status" in df.columns else None
    ok = (status == "ok") if status is not None else np.ones(len(df), dtype=bool)
    if "cpu_hit_rate" in df.columns:
        ok = ok & df["cpu_hit_rate"].notna()
    bad = df[~ok]
    names = [str(r) for r in (bad["run_id"] if "run_id" in bad.columns else bad.index)]
    return df[ok].reset_index(drop=True), names


def _sweep_title(df: Any, name: str, what: str, varying: Sequence[str], skipped: list[str]) -> str:
    """``"<sweep>: <constant model, hardware, workload, logic>, N points"`` + what + skipped note."""
    parts = []
    for col in ("model", "hardware", "workload", "window_logic"):
        if col in df.columns and col not in varying and len(df) and df[col].astype(str).nunique() == 1:
            v = df[col].iloc[0]
            parts.append(f"on {v}" if col == "hardware" else _key_value(col, v))
    text = ", ".join(parts).replace(", on ", " on ")
    head = f"{name}: {text}" if parts else name
    lines = [f"{head} ({len(df)} points)", what]
    if skipped:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        lines.append(f"{len(skipped)} failed point{'s' if len(skipped) > 1 else ''} skipped: {shown}")
    return "\n".join(lines)


def knee(x: Sequence[float] | Any, y: Sequence[float] | Any, *, curve: str = "concave",
         log_x: bool = False) -> float | None:
    """The knee of a curve: the point farthest from its chord, on normalised axes (Kneedle).

    The points are sorted by x; x (or log2 x with ``log_x``) and y are scaled
    to [0, 1] by their minimum and maximum; the chord joins the first and the
    last point. The knee is the point with the largest distance *above* the
    chord for ``curve="concave"`` (a rising curve that flattens: diminishing
    returns) or *below* it for ``"convex"`` (a falling curve that flattens).
    This is the Kneedle method of Satopää et al. (2011) without smoothing;
    for a rising concave curve the distance is ``y_n - x_n``, as there.

    Args:
        x: the x values (distinct).
        y: the y values.
        curve: "concave" or "convex".
        log_x: measure x on a log2 scale (as a plot with a log x axis shows it).

    Returns:
        the x value of the knee, or None with fewer than 3 points, a flat
        curve, or no point strictly on the knee's side of the chord.

    Raises:
        ValueError: x and y differ in length, ``curve`` is unknown, or
            ``log_x`` with an x value <= 0.
    """
    if curve not in ("concave", "convex"):
        raise ValueError(f"curve must be 'concave' or 'convex', not {curve!r}")
    xs = np.asarray(x, dtype=float)
    ys = np.asarray(y, dtype=float)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError(f"x and y must be 1-d and of equal length ({xs.shape} vs {ys.shape})")
    keep = np.isfinite(xs) & np.isfinite(ys)
    xs, ys = xs[keep], ys[keep]
    if log_x and (xs <= 0).any():
        raise ValueError("log_x needs x > 0")
    order = np.argsort(xs, kind="stable")
    xs, ys = xs[order], ys[order]
    if len(xs) < 3:
        return None
    u = np.log2(xs) if log_x else xs
    if u[-1] - u[0] <= 0 or ys.max() - ys.min() <= 0:
        return None
    xn = (u - u[0]) / (u[-1] - u[0])
    yn = (ys - ys.min()) / (ys.max() - ys.min())
    chord = yn[0] + (yn[-1] - yn[0]) * xn
    gap = yn - chord if curve == "concave" else chord - yn
    i = int(np.argmax(gap))
    return float(xs[i]) if gap[i] > 1e-9 else None


def _palette(n: int) -> list[str]:
    """``n`` distinct colours: the fixed cycle, then tab20, then evenly spaced viridis."""
    if n <= len(_CYCLE):
        return list(_CYCLE[:n])
    from matplotlib import colormaps  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn
    from matplotlib.colors import to_hex  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

    if n <= 20:
        return [to_hex(colormaps["tab20"](i)) for i in range(n)]
    return [to_hex(c) for c in colormaps["viridis"](np.linspace(0.0, 0.92, n))]


def _series(df: Any, keys: list[str], style_key: str | None = None
            ) -> list[tuple[str, Any, dict[str, Any], tuple[str, str]]]:
    """(legend label, rows, line style, (colour label, style label)) per combination of
    ``keys``, sorted by value. No two series get the same (colour, line style).

    With ``style_key`` among the keys (the CPU cache size in ``ttft_cdfs``): its
    values get the line styles (in sorted order) and the other keys the colours
    (the policy's own colour when the policy is all they are). Otherwise the
    colour is the policy's when the policy is constant or one of the keys, the
    other keys getting the line styles and markers; without a policy, one
    colour per combination.
    """
    combos: dict[tuple[str, ...], list[int]] = {}
    for i in range(len(df)):
        combos.setdefault(tuple(str(df[k].iloc[i]) for k in keys), []).append(i)

    def sort_key(item: tuple[tuple[str, ...], list[int]]) -> tuple[Any, ...]:
        out: list[Any] = []
        for k, v in zip(keys, item[0], strict=True):
            raw = df[k].iloc[item[1][0]]
            out.append((0, float(raw), "") if isinstance(raw, numbers.Real) else (1, 0.0, v))
        return tuple(out)

    items = sorted(combos.items(), key=sort_key)
    has_policy = "cpu_cache_policy" in df.columns and (
        "cpu_cache_policy" in keys or df["cpu_cache_policy"].astype(str).nunique() == 1)
    if style_key is not None and style_key in keys:
        style_keys = [style_key]
        colour_keys = [k for k in keys if k != style_key]
    elif has_policy:
        colour_keys = [k for k in keys if k == "cpu_cache_policy"]
        style_keys = [k for k in keys if k != "cpu_cache_policy"]
    else:
        colour_keys, style_keys = list(keys), []
    by_policy = has_policy and all(k == "cpu_cache_policy" for k in colour_keys)
    colour_index: dict[tuple[str, ...], int] = {}
    style_index: dict[tuple[str, ...], int] = {}
    for _combo, rows in items:
        colour_index.setdefault(tuple(str(df[k].iloc[rows[0]]) for k in colour_keys), len(colour_index))
    palette = _palette(len(colour_index))
    used: set[tuple[str, int]] = set()
    out = []
    for _combo, rows in items:
        first = rows[0]
        label = ", ".join(_key_value(k, df[k].iloc[first]) for k in keys) or "all points"
        ckey = tuple(str(df[k].iloc[first]) for k in colour_keys)
        skey = tuple(str(df[k].iloc[first]) for k in style_keys)
        j = style_index.setdefault(skey, len(style_index))
        if by_policy:
            colour = POLICY_COLOURS.get(str(df["cpu_cache_policy"].iloc[first]).lower(), _CYCLE[2])
        else:
            colour = palette[colour_index[ckey]]
        while (colour, j) in used:   # rows no key tells apart: never two lines alike
            j += 1
        used.add((colour, j))
        style = {"color": colour, "linestyle": _line_style(j), "marker": _MARKERS[j % len(_MARKERS)]}
        names = (", ".join(_key_value(k, df[k].iloc[first]) for k in colour_keys) or "all points",
                 ", ".join(_key_value(k, df[k].iloc[first]) for k in style_keys))
        out.append((label, df.iloc[rows], style, names))
    return out


def _size_axis(ax: Any, sizes: Any) -> tuple[bool, float | None]:
    """x axis in GiB, log2 when the non-zero sizes span 4x or more; ticks at (thinned)
    swept sizes. Returns (log, where 0 GiB is drawn: two octaves left of the smallest
    size, on a log axis with a 0 among the sizes; else None)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

    u = np.unique(sizes)
    pos = u[u > 0]
    log = len(pos) > 1 and pos.max() / pos.min() >= 4
    zero_x: float | None = None
    if log:
        ax.set_xscale("log", base=2)
        step = max(1, math.ceil(len(pos) / 8))
        ticks = [float(v) for v in pos[::step]]
        if (u == 0).any():
            zero_x = float(pos.min()) / 4
            ticks = [zero_x, *ticks]
            ax.axvline(float(pos.min()) / 2, color="#999999", linewidth=0.8, linestyle=(0, (2, 2)),
                       gid="zero-break")
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: "0" if v == zero_x else f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("CPU cache size (GiB, log scale" + ("; 0 left of the dotted line)" if zero_x else ")"))
    else:
        ax.set_xlabel("CPU cache size (GiB)")
    return bool(log), zero_x


def _annotate_knees(ax: Any, knees: list[tuple[float, float, str, str]], log: bool, named: bool,
                    sizes: Any) -> None:
    """One "knee: N GiB" note per distinct knee point (lines sharing a knee share the note), staggered
    downwards, on the side of the point with more room."""
    groups: list[list[tuple[float, float, str, str]]] = []
    span = max((abs(k[1]) for k in knees), default=1.0) or 1.0
    for item in knees:
        for g in groups:
            if g[0][0] == item[0] and abs(g[0][1] - item[1]) < 0.04 * span:
                g.append(item)
                break
        else:
            groups.append([item])
    lo_x, hi_x = (np.log2(sizes.min()), np.log2(sizes.max())) if log else (sizes.min(), sizes.max())
    for i, g in enumerate(groups):
        k, ky = g[0][0], g[0][1]
        frac = ((np.log2(k) if log else k) - lo_x) / (hi_x - lo_x) if hi_x > lo_x else 0.5
        right = frac > 0.6
        colour = g[0][2] if len(g) == 1 else "#333333"
        text = f"knee: {_gib(k * _GIB)}" + (f" ({', '.join(x[3] for x in g)})" if named else "")
        ax.annotate(text, xy=(k, ky), xytext=(-10 if right else 10, -16 - 14 * i), textcoords="offset points",
                    ha="right" if right else "left", va="top", fontsize=8, color=colour,
                    arrowprops={"arrowstyle": "-", "color": colour, "linewidth": 0.6})


@_styled
def hit_rate_vs_cpu(sweep: Any) -> Figure:
    """CPU hit rate and recompute saved (%) against CPU cache size (GiB), per policy.

    One line per eviction policy and per combination of the other parameters
    that vary between points (model, workload, logic, any swept key; the
    legend, outside the panels, names them). Points that differ only by seed
    are averaged, with their min..max as a band. The x axis is log2 when the
    non-zero sizes span 4x or more; a 0 GiB point is then drawn apart, as a
    marker left of a dotted line, not joined to the line. The :func:`knee` of
    each line (concave, on the x scale drawn, over the non-zero sizes) is
    marked with a ring and "knee: N GiB". Failed points are skipped and named
    in the title.

    Args:
        sweep: a sweep folder, a :func:`sim.load_sweep` result, or its ``sweep.parquet`` as a DataFrame.
    """
    table, _, sweep_name = _read_sweep(sweep)
    df, skipped = _ok_points(table)
    keys = _varying(df, exclude=("cpu_cache_bytes", "seed"))
    seeds = "seed" in df.columns and df["seed"].astype(str).nunique() > 1
    fig = _figure(10.5, 4.6)
    axes = fig.subplots(1, 2, sharex=True)
    panels = (("cpu_hit_rate", "CPU hit rate (% of prompt tokens)", "CPU hit rate"),
              ("recompute_saved", "recompute saved (% of prefill work)", "recompute saved"))
    series = _series(df, keys) if len(df) else []
    annotate = len(series) <= 3
    all_sizes = df["cpu_cache_bytes"].to_numpy(dtype=float) / _GIB if len(df) else np.empty(0)
    for ax, (col, ylabel, name) in zip(axes, panels, strict=True):
        top = 0.0
        overloaded_drawn = False
        knees: list[tuple[float, float, str, str]] = []
        log, zero_x = _size_axis(ax, all_sizes) if series else (False, None)
        for label, rows, style, _names in series:
            x = rows["cpu_cache_bytes"].to_numpy(dtype=float) / _GIB
            y = 100.0 * rows[col].to_numpy(dtype=float)
            ux = np.unique(x)
            mean = np.array([y[x == v].mean() for v in ux])
            if seeds:
                lo = np.array([y[x == v].min() for v in ux])
                hi = np.array([y[x == v].max() for v in ux])
                keep = ux > 0 if zero_x is not None else np.ones(len(ux), dtype=bool)
                ax.fill_between(ux[keep], lo[keep], hi[keep], color=style["color"], alpha=0.15, linewidth=0)
            over = _overloaded_at(rows, x, ux)
            if over.any():   # a red cross on every size with an overloaded run
                ox = np.where(ux[over] == 0, zero_x if zero_x is not None else 0.0, ux[over])
                ax.plot(ox, mean[over], linestyle="none", marker="x", color="#d62728", markersize=9,
                        markeredgewidth=2, zorder=5, gid="overloaded",
                        label="_over" if overloaded_drawn else "overloaded (queue grows: TTFT not usable)")
                overloaded_drawn = True
            if zero_x is not None:
                at0 = ux == 0
                if at0.any():
                    ax.plot([zero_x], mean[at0], linestyle="none", marker=style["marker"],
                            color=style["color"], markersize=5, gid="zero-gib", label="_zero")
                ux, mean = ux[~at0], mean[~at0]
            ax.plot(ux, mean, label=label, markersize=4, **style)
            top = max(top, float(np.nanmax(mean)) if len(mean) else 0.0)
            k = knee(ux, mean, log_x=log) if len(ux) and (not log or ux.min() > 0) else None
            if k is None:
                continue
            ky = float(mean[ux == k][0])
            ax.plot([k], [ky], linestyle="none", marker="o", markersize=11, markerfacecolor="none",
                    markeredgecolor=style["color"], markeredgewidth=1.5)
            knees.append((k, ky, style["color"], label))
        if annotate and series:
            sizes = all_sizes[all_sizes > 0] if zero_x is not None else all_sizes
            _annotate_knees(ax, knees, log, len(series) > 1, sizes)
        if not series:
            _note(ax, "no finished point to plot")
            ax.set_xlabel("CPU cache size (GiB)")
        ax.set_ylim(0, min(100.0, max(5.0, top * 1.15)))
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name} vs CPU cache size")
    if series:
        title = ", ".join(_key_name(k) for k in keys)
        if seeds:
            title = (title + "\n" if title else "") + "mean of seeds (band: min..max)"
        handles = [ln for ln in axes[0].get_lines() if not ln.get_label().startswith("_")]
        handles.sort(key=lambda ln: ln.get_gid() == "overloaded")   # the overload mark last
        fig.legend(handles=handles, loc="outside right center", title=title or None)
    fig.suptitle(_sweep_title(df, sweep_name, "CPU hit rate and recompute saved vs CPU cache size"
                              + ("" if annotate or not series else " (ring: knee)"), keys, skipped))
    return fig


def _overloaded_at(rows: Any, x: np.ndarray, ux: np.ndarray) -> np.ndarray:
    """Per size in ``ux``: whether any of its runs was overloaded (False for
    sweeps written before the verdict existed)."""
    if "overloaded" not in rows.columns:
        return np.zeros(len(ux), dtype=bool)
    flags = rows["overloaded"].fillna(False).astype(bool).to_numpy()
    return np.array([bool(flags[x == v].any()) for v in ux], dtype=bool)


@_styled
def ttft_cdfs(sweep: Any, root: str | Path | None = None) -> Figure:
    """TTFT CDF of every finished point of a sweep (from each point's ``requests.parquet``).

    Policies (and any other varying parameter) differ by colour, CPU cache sizes
    by line style, so no two lines look alike. Up to 14 lines the legend names
    each line; beyond, it names the colours and the line styles once each. Every
    legend handle is long enough to show a whole period of its dash pattern, so
    no dashed style reads as solid there.

    Args:
        sweep: a sweep folder, a :func:`sim.load_sweep` result, or its ``sweep.parquet`` as a DataFrame (then
            ``root`` is the folder its ``run_dir`` values are relative to).
        root: see ``sweep``.
    """
    from matplotlib.lines import Line2D  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

    table, folder, sweep_name = _read_sweep(sweep)
    base = folder if folder is not None else Path(root) if root is not None else Path()
    df, skipped = _ok_points(table)
    keys = _varying(df)
    fig = _figure(10.0, 4.8)
    ax = fig.subplots()
    samples = []
    series = _series(df, keys, style_key="cpu_cache_bytes") if len(df) else []
    colours: dict[str, str] = {}
    styles: dict[str, Any] = {}
    drawn: list[tuple[Any, float]] = []   # (line style, width) of every line, for the legend's handles
    overloaded = 0
    for label, rows, style, (colour_name, style_name) in series:
        for j in range(len(rows)):
            row = rows.iloc[j]
            path = base / str(row["run_dir"]) / "requests.parquet"
            wanted = [c for c in ("arrival_s", "first_token_s", "status") if c in pq.read_schema(path).names]
            req = pq.read_table(path, columns=wanted).to_pandas()
            xs = _ttft_s(req)
            samples.append(xs)
            lab = label if len(rows) == 1 else f"{label} ({row.get('run_id', j)})"
            ov = row.get("overloaded")
            over = ov is not None and not bool(np.isnan(ov)) and bool(ov)   # NaN: an older sweep
            if over:
                lab += " [OVERLOADED]"
            _draw_cdf(ax, xs, color=style["color"], linestyle=style["linestyle"],
                      linewidth=0.8 if over else 1.3, alpha=0.45 if over else 1.0, label=lab)
            drawn.append((style["linestyle"], 0.8 if over else 1.3))
            overloaded += over
        colours.setdefault(colour_name, style["color"])
        if style_name:
            styles.setdefault(style_name, style["linestyle"])
    _cdf_axes(ax, samples)
    legend_title = ", ".join(_key_name(k) for k in keys) or None
    # every handle long enough to show a whole period of its dash pattern (_handle_length)
    if ax.lines and len(ax.lines) <= 14:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title=legend_title,
                  handlelength=_handle_length(drawn))
    elif ax.lines:
        handles = [Line2D([], [], color=c, linewidth=1.3, label=name) for name, c in colours.items()]
        handles += [Line2D([], [], color="#555555", linestyle=ls, linewidth=1.3, label=name)
                    for name, ls in styles.items()]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  handlelength=_handle_length([(ls, 1.3) for ls in styles.values()]),
                  ncol=2 if len(handles) > 16 else 1,
                  title="colour: " + (", ".join(_key_name(k) for k in keys if k != "cpu_cache_bytes") or "-")
                  + ("\nline style: CPU cache" if styles else ""))
    else:
        _note(ax, "no finished point to plot")
    ax.set_title("TTFT distribution per point (finished requests)"
                 + (f"; {overloaded} overloaded (faint): their TTFT is the queue's" if overloaded else ""))
    fig.suptitle(_sweep_title(df, sweep_name, "TTFT CDF of every point", keys, skipped))
    return fig


# -- folders ------------------------------------------------------------------------------


def folder_kind(folder: str | Path) -> str:
    """``"sweep"``, ``"compare"`` or ``"run"``, by the file that marks each kind.

    Raises:
        InputError: the folder is none of the three.
    """
    kind = result_kind(folder)
    if kind is None:
        raise InputError(str(folder), "", "not a results folder (no sweep.parquet, compare.json or "
                         "summary.json)", "a folder written by kvsim run, kvsim compare or kvsim sweep")
    return kind


def write_plots(folder: str | Path, out: str | Path | None = None,
                on_note: Callable[[str], None] | None = None) -> list[Path]:
    """Write every figure of a run, compare or sweep folder as PNG.

    run: ``occupancy.png``, ``link_utilisation.png``, ``ttft_cdf.png``;
    compare: ``old_vs_new.png``, ``ttft_cdf.png`` (both runs),
    ``old-occupancy.png``, ``new-occupancy.png``, ``old-link_utilisation.png``,
    ``new-link_utilisation.png``; sweep: ``hit_rate_vs_cpu.png``,
    ``ttft_cdfs.png``.

    Args:
        folder: the results folder.
        out: where the PNGs go (default ``<folder>/plots``).
        on_note: called with one line per thing left out (failed sweep points).

    The figures are drawn into a hidden folder beside ``out``
    (``.<name>.tmp-<pid>``) and moved into ``out`` one by one only when all
    are drawn: a plot that fails or is interrupted leaves the previous
    figures as they were, and files in ``out`` that plot does not write are
    never touched.

    Returns:
        the files written, in the order above.

    Raises:
        InputError: ``folder`` is not a results folder, or ``out`` cannot be
            written (one ``--out`` line; nothing is left half written).
    """
    src = Path(folder)
    kind = folder_kind(src)
    dst = Path(out) if out is not None else src / "plots"
    tmp, created = _plots_temp(dst)
    names: list[str] = []

    def put(name: str, fig: Figure) -> None:
        try:
            save_figure(fig, tmp / name)
        except OSError as exc:
            raise out_error(dst, exc) from None
        names.append(name)

    try:
        _draw_all(src, kind, put, on_note)
        written = _move_plots(tmp, dst, names)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous plots stay as they were
        remove_created(created)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return written


def _plots_temp(dst: Path) -> tuple[Path, list[Path]]:
    """The hidden folder beside ``dst`` the figures are drawn into (and the folders made for it).

    Raises:
        InputError: ``dst`` is a file, or cannot be created.
    """
    if dst.exists() and not dst.is_dir():
        raise InputError("argument", "--out", f"{dst}: exists and is not a folder", "a writable folder")
    created = make_folder(dst.parent, dst)
    clean_leftovers(dst.parent)
    tmp = temp_beside(dst)
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as exc:
        remove_created(created)
        raise out_error(dst, exc) from None
    return tmp, created


def _move_plots(tmp: Path, dst: Path, names: list[str]) -> list[Path]:
    """Move the finished figures into ``dst``, file by file (other files there stay)."""
    try:
        dst.mkdir(exist_ok=True)
        for name in names:
            os.replace(tmp / name, dst / name)
    except OSError as exc:
        raise out_error(dst, exc) from None
    return [dst / name for name in names]


def _draw_all(src: Path, kind: str, put: Callable[[str, Figure], None],
              on_note: Callable[[str], None] | None) -> None:
    """Draw every figure of a folder of this kind, handing each to ``put`` (see :func:`write_plots`)."""
    if kind == "run":
        run = _load_run(src)
        put("occupancy.png", occupancy(run))
        put("link_utilisation.png", link_utilisation(run))
        put("ttft_cdf.png", ttft_cdf(run))
    elif kind == "compare":
        figures = json.loads((src / "compare.json").read_text(encoding="utf-8"))
        names = compare_folder_logics(figures)
        runs = {lg: load_results(src / lg) for lg in names}
        put("old_vs_new.png", old_vs_new(src, runs=runs, figures=figures))
        vs = f"{' vs '.join(lg.upper() for lg in names)} logic"
        put("ttft_cdf.png", ttft_cdf([runs[lg] for lg in names], [_LOGIC_NAMES[lg] for lg in names],
                                     title=run_title(runs[names[1]].scenario, logic=vs)))
        for lg in names:
            put(f"{lg}-occupancy.png", occupancy(runs[lg]))
            put(f"{lg}-link_utilisation.png", link_utilisation(runs[lg]))
    else:
        table, _, _ = _read_sweep(src)
        _, skipped = _ok_points(table)
        if skipped and on_note is not None:
            on_note(f"{src}: {len(skipped)} failed point(s) skipped in the plots: {', '.join(skipped)}")
        put("hit_rate_vs_cpu.png", hit_rate_vs_cpu(src))
        put("ttft_cdfs.png", ttft_cdfs(src))


# -- checking a figure --------------------------------------------------------------------

_UNIT = re.compile(r"\([^()]+\)")


def _texts(fig: Figure) -> list[tuple[str, Any, int]]:
    """(description, artist, group) of every visible, non-empty text artist and legend box;
    members of one legend share a group (they may touch their own box)."""
    items: list[tuple[str, Any, int]] = []
    group = 0

    def add(desc: str, t: Any, g: int = -1) -> None:
        if t is not None and t.get_visible() and t.get_text().strip():
            items.append((desc, t, g))

    def add_legend(desc: str, leg: Any) -> None:
        nonlocal group
        if leg is None or not leg.get_visible():
            return
        group += 1
        items.append((f"{desc} box", leg, group))
        add(f"{desc} title", leg.get_title(), group)
        for t in leg.get_texts():
            add(f"{desc} entry {t.get_text()!r}", t, group)

    for i, ax in enumerate(fig.axes):
        if not ax.get_visible():
            continue
        name = f"axes {i} ({ax.get_title() or ax.get_ylabel()!s})"
        for title in (ax.title, getattr(ax, "_left_title", None), getattr(ax, "_right_title", None)):
            add(f"{name} title", title)
        if ax.axison:
            add(f"{name} x label", ax.xaxis.label)
            add(f"{name} y label", ax.yaxis.label)
            for axis, which in ((ax.xaxis, "x"), (ax.yaxis, "y")):
                # the ticks drawn (inside the view), as Axis.draw finds them
                for tick in getattr(axis, "_update_ticks")():  # noqa: B009
                    for lab in (tick.label1, tick.label2):
                        add(f"{name} {which} tick {lab.get_text()!r}", lab)
                add(f"{name} {which} offset", axis.offsetText)
        for t in ax.texts:
            add(f"{name} text {t.get_text()!r}", t)
        add_legend(f"{name} legend", ax.get_legend())
    for attr in ("_suptitle", "_supxlabel", "_supylabel"):
        add(f"figure {attr.strip('_')}", getattr(fig, attr, None))
    for t in fig.texts:
        if t is not getattr(fig, "_suptitle", None):
            add(f"figure text {t.get_text()!r}", t)
    for leg in fig.legends:
        add_legend("figure legend", leg)
    return items


def layout_problems(fig: Figure, tolerance_px: float = 0.5) -> list[str]:
    """What is wrong with a figure's text, after drawing it: one line per problem.

    Checks that no two visible text artists (titles, axis labels, tick labels,
    legend entries and titles, annotations, figure titles) overlap, that no
    legend box covers a text outside it, that every one lies inside the
    figure, and that every axes with visible axis lines has an x and a y label
    with a unit in parentheses.

    Args:
        fig: the figure (drawn here).
        tolerance_px: overlaps and overhangs up to this many pixels are ignored.
    """
    fig.canvas.draw()
    renderer = getattr(fig.canvas, "get_renderer")()  # noqa: B009 (Agg canvases have one)
    width, height = fig.bbox.width, fig.bbox.height
    problems: list[str] = []
    for i, ax in enumerate(fig.axes):
        if ax.get_visible() and ax.axison:
            for which, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
                if not label.strip():
                    problems.append(f"axes {i} ({ax.get_title()}): no {which} label")
                elif not _UNIT.search(label):
                    problems.append(f"axes {i} ({ax.get_title()}): {which} label {label!r} has no unit "
                                    "in parentheses")
    items = [(d, a.get_window_extent(renderer), g) for d, a, g in _texts(fig)]
    tol = tolerance_px
    for d, b, _g in items:
        if b.x0 < -tol or b.y0 < -tol or b.x1 > width + tol or b.y1 > height + tol:
            problems.append(f"{d} lies outside the figure ({b.x0:.0f}, {b.y0:.0f}, {b.x1:.0f}, {b.y1:.0f} "
                            f"in a {width:.0f} x {height:.0f} figure)")
    for a in range(len(items)):
        da, ba, ga = items[a]
        for b_i in range(a + 1, len(items)):
            db, bb, gb = items[b_i]
            if ga > 0 and ga == gb:
                continue  # a legend's own texts and box
            w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
            h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
            if w > tol and h > tol:
                problems.append(f"{da} overlaps {db}")
    return problems


def tier_label(value: Any) -> str:
    """A sweep's ``tiers`` value (JSON text of the ``[[tiers]]`` list, or the list) for a
    legend: ``"no tier"``, ``"pm1743 1TiB"``, ``"pm1743 1TiB + net-400g"``."""
    tiers = json.loads(value) if isinstance(value, str) else value
    if not tiers:
        return "no tier"
    names = []
    for t in tiers:
        name = str(t.get("device") or t.get("kind") or "tier")
        cap = t.get("capacity", t.get("chunks"))
        names.append(f"{name} {cap}" if cap is not None else f"{name} (unbounded)")
    return " + ".join(names)


#: line style and marker of the i-th tier choice in :func:`tiers_whatif`
_TIER_STYLES = ((":", "o"), ("--", "s"), ("-", "^"), ("-.", "D"))


@_styled
def tiers_whatif(sweep: Any) -> Figure:
    """CPU hit rate, TTFT p50 and TTFT p90 against CPU cache size (GiB), one line per
    (tier choice, eviction policy): colour = the CPU policy, line style and marker =
    the secondary tiers (the swept ``tiers`` key; none when the sweep has none).
    The CPU hit rate counts promoted chunks too (a GPU load reads them from CPU
    memory). TTFT is on a log scale; a red cross marks an overloaded point (its
    TTFT is the queue's). Failed points are skipped and named in the title.

    Args:
        sweep: a sweep folder, a :func:`sim.load_sweep` result, or its ``sweep.parquet`` as a DataFrame.
    """
    table, _, sweep_name = _read_sweep(sweep)
    df, skipped = _ok_points(table)
    tiers = df["tiers"].map(tier_label) if "tiers" in df.columns else None
    choices = list(dict.fromkeys(tiers)) if tiers is not None else ["no tier"]
    policy = (df["cpu_cache_policy"].astype(str) if "cpu_cache_policy" in df.columns
              else df["cpu_cache.policy"].astype(str))
    seen = set(policy)
    policies = [p for p in POLICY_COLOURS if p in seen] + sorted(seen - set(POLICY_COLOURS))
    fig = _figure(12.5, 4.8)
    axes = fig.subplots(1, 3, sharex=True)
    panels = (("cpu_hit_rate", 100.0, "CPU hit rate (% of prompt tokens)", False),
              ("ttft_s_p50", 1.0, "TTFT p50 (s)", True),
              ("ttft_s_p90", 1.0, "TTFT p90 (s)", True))
    sizes = df["cpu_cache_bytes"].to_numpy(dtype=float) / _GIB if len(df) else np.empty(0)
    over_flags = (df["overloaded"].fillna(False).astype(bool).to_numpy() if "overloaded" in df.columns
                  else np.zeros(len(df), dtype=bool))
    palette = _palette(len(policies))
    for ax, (col, scale, ylabel, log_y) in zip(axes, panels, strict=True):
        if len(df):
            _size_axis(ax, sizes)
        over_drawn = False
        for ti, choice in enumerate(choices):
            ls, marker = _TIER_STYLES[ti % len(_TIER_STYLES)]
            for pi, pol in enumerate(policies):
                sel = (policy == pol).to_numpy()
                if tiers is not None:
                    sel = sel & (tiers == choice).to_numpy()
                rows = df[sel]
                if not len(rows) or col not in rows.columns:
                    continue
                x = rows["cpu_cache_bytes"].to_numpy(dtype=float) / _GIB
                y = scale * rows[col].to_numpy(dtype=float)
                order = np.argsort(x)
                colour = POLICY_COLOURS.get(pol, palette[pi])
                ax.plot(x[order], y[order], linestyle=ls, marker=marker, markersize=4, color=colour,
                        label=f"{pol.upper() if pol != 'belady' else 'Belady'}, {choice}")
                over = over_flags[sel][order]
                if over.any():
                    ax.plot(x[order][over], y[order][over], linestyle="none", marker="x", color="#d62728",
                            markersize=9, markeredgewidth=2, zorder=5, gid="overloaded",
                            label="_over" if over_drawn else "overloaded (queue grows: TTFT not usable)")
                    over_drawn = True
        if log_y:
            from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: PLC0415 -- matplotlib loads only when a figure is drawn

            ax.set_yscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            lo, hi = ax.get_ylim()      # minor ticks labelled only within a decade (else too many)
            ax.yaxis.set_minor_formatter(plain if lo > 0 and hi / lo < 10 else NullFormatter())
        ax.set_xlabel("CPU cache (GiB)")
        ax.set_ylabel(ylabel)
    lines = [(h, lab) for h, lab in zip(*axes[0].get_legend_handles_labels(), strict=True)
             if not lab.startswith("overloaded")]
    over = [(h, lab) for ax in axes for h, lab in zip(*ax.get_legend_handles_labels(), strict=True)
            if lab.startswith("overloaded")]
    handles = [h for h, _ in lines + over[:1]]
    labels = [lab for _, lab in lines + over[:1]]
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize=7)
    title = (f"{sweep_name}: CPU hit rate and TTFT per CPU cache, secondary tier and policy, "
             f"{_n(len(df), 'point')}")
    if skipped:
        title += f"\n{_n(len(skipped), 'point')} failed and left out: {', '.join(skipped[:4])}"
        title += ", ..." if len(skipped) > 4 else ""
    fig.suptitle(title)
    return fig
