"""OLD versus NEW (and LATEST) on the same scenario and seed (``kvsim compare``).

What it does
    :func:`compare_runs` runs one ``run/1`` scenario once per window logic:
    by default twice, with ``window_logic = "old"`` (vLLM 0.29.0) and
    ``"new"`` (vLLM 0.30.0); ``logics`` (``--logics``) names any two or three
    of ``old``, ``new``, ``latest`` (vLLM 0.33.0), in report order. Any
    ``window_logic`` in the file or in the overrides is replaced per run.
    The runs use the same seed, so they see the same requests and differ
    only through the profile objects of :mod:`sim.model.windows`. Each run goes
    through :func:`sim.tools.run.execute` into its own run folder, in up to
    ``jobs`` worker processes (a spawn-safe top-level worker; ``jobs = 1`` runs
    them one after the other in this process). Then the folders are read back
    and compared, each logic with the first.

Folder (``results/<name>-compare/`` unless ``out`` names it: beside the run
folder ``results/<name>/`` of ``kvsim run``, never inside it)::

    old/ new/          the run folders, one per logic (see sim.io.results)
    compare.md         the report: side-by-side figures, diverging requests,
                       reproducers, the figure, wall-clock timings
    compare.json       the figures of the report (section "timing" is the
                       only one that differs between two compares of the
                       same scenario); key "logics" (the order) only when
                       they are not old, new
    compare.png        one column per logic, OLD left (sim.tools.plots.old_vs_new):
                       modelled crashes / hazards / integrity violations over
                       time, tokens loaded from the CPU cache, TTFT CDF
    diverged.parquet   one row per request whose outcome differs between the
                       first and the second logic (columns: :data:`DIVERGED_COLUMNS`,
                       :func:`diverged_columns` for other logics), ``how`` says
                       it in words
    diverged-<first>-<other>.parquet
                       the same for the first logic against the third (three
                       logics only; compare.json section "diverged_pairs")

    The folder is written like a run folder (see "Life cycle" in
    :mod:`sim.io.results`): into a temporary folder beside the target
    (``.<name>.tmp-<pid>``), renamed onto it at the end; a non-empty target
    is refused unless ``overwrite``; bad input (scenario, overrides, a bad
    trace line, an ``out`` that cannot be written) leaves nothing behind.
    A compare whose run failed, written while a previous compare sits at
    the target, goes beside it as ``<name>.failed`` (the previous one is
    kept); an interrupted compare (Ctrl-C, SIGTERM) keeps nothing: its
    workers are stopped, its temporary folder removed, and the previous
    compare is left as it was. The two worker processes die with the
    compare process (:func:`sim.tools.run.worker_init`).

Logics
    ``logics = ("old", "new")`` (the default) writes exactly what compares
    wrote before ``--logics`` existed. With ``("old", "new", "latest")`` the
    folder also holds ``latest/`` and ``diverged-old-latest.parquet``, the
    table and ``compare.md`` get a LATEST column, and ``compare.json`` says
    ``"logics": ["old", "new", "latest"]``.

Divergence
    A request diverges when any of ``status``, ``crash``, ``cpu_hit_tokens``,
    ``cpu_reload_tokens``, ``computed_tokens``, ``deferrals``,
    ``first_token_s``, ``finish_s`` differs between the two runs (exactly:
    two runs of the same events give the same floats), or when it appears in
    one run only (``status`` "absent" on the other side, e.g. after
    ``on_crash = "stop"``).

Reproducers
    A run folder may hold ``reproducers/*.toml``: ``check/1`` cases written by
    the engine for every modelled crash or hazard. The report lists them
    with the request and the event they stand for; with
    ``verify_reproducers`` each one is replayed with :mod:`sim.io.check` and the
    report says whether its expectations hold and whether the run's own
    logic gives the recorded event in isolation.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from sim.errors import InputError
from sim.io.check import evaluate, load_check_file, parse_check, summarize
from sim.io.results import (
    RERUN,
    RunWriter,
    check_target,
    clean_floats,
    clean_leftovers,
    durations_text,
    load_results,
    make_folder,
    move_into_place,
    out_error,
    read_json,
    read_parquet,
    remove_created,
    temp_beside,
    write_json_atomic,
    write_text_atomic,
)
from sim.io.scenario import human_bytes, load_run
from sim.tools.plots import old_vs_new, save_figure
from sim.tools.run import Interrupted, execute, owned, signal_of, worker_init

__all__ = [
    "ALL_LOGICS",
    "DIVERGED_COLUMNS",
    "LOGICS",
    "LOGIC_NAMES",
    "CompareResult",
    "compare_logics",
    "compare_runs",
    "compare_table",
    "default_target",
    "describe_divergence",
    "diverged_columns",
    "diverged_requests",
    "list_reproducers",
    "load_compare",
    "logic_figures",
    "markdown_report",
    "parse_logics",
    "verify_reproducer",
]

#: the window logics compared by default, in report order
LOGICS: tuple[str, str] = ("old", "new")
#: every window logic a compare can run
ALL_LOGICS: tuple[str, ...] = ("old", "new", "latest")
#: the vLLM release each logic models
_VLLM: dict[str, str] = {"old": "vLLM 0.29.0", "new": "vLLM 0.30.0", "latest": "vLLM 0.33.0"}
#: the column header of each logic
LOGIC_NAMES: dict[str, str] = {lg: f"{lg.upper()} ({v})" for lg, v in _VLLM.items()}

#: per-logic request columns compared (and copied into ``diverged.parquet``)
_OUTCOME: tuple[tuple[str, str], ...] = (
    ("status", "string"), ("crash", "string"), ("cpu_hit_tokens", "int64"),
    ("cpu_reload_tokens", "int64"), ("computed_tokens", "int64"), ("deferrals", "int64"),
    ("first_token_s", "float64"), ("ttft_s", "float64"), ("finish_s", "float64"),
)



def diverged_columns(first: str = "old", other: str = "new") -> tuple[str, ...]:
    """The columns of a diverged table of ``first`` against ``other``, in order."""
    return ("req_id", "arrival_s", *(f"{lg}_{c}" for lg in (first, other) for c, _ in _OUTCOME), "how")


#: columns of ``diverged.parquet`` of an OLD vs NEW compare, in order
DIVERGED_COLUMNS: tuple[str, ...] = diverged_columns(*LOGICS)

#: requests listed by name in the printed table and the report
_SHOWN = 5
_REPORT_SHOWN = 20


@dataclass(eq=False)   # DataFrame fields have no truth value: identity, not a ValueError
class CompareResult:
    """A compare folder (written by :func:`compare_runs` or read by :func:`load_compare`).

    Attributes:
        path: the compare folder.
        runs: logic -> its run folder (``path / "old"``, ``path / "new"``), in report order.
        figures: the contents of ``compare.json``.
        diverged: ``diverged.parquet`` as a DataFrame (the first logic against the
            second; columns :data:`DIVERGED_COLUMNS` for OLD vs NEW).
        status: ``"ok"``, or ``"failed"`` when a run failed (its ``summary.json`` says why).
        errors: logic -> the traceback of its failed run.
        kept: the previous compare left in place when this failed one went beside it.
        logics: the logics compared, in report order (the first is the reference).
        diverged_pairs: ``"<first>-<other>"`` -> ``diverged-<first>-<other>.parquet``
            as a DataFrame, for every logic after the second (empty for two logics).
    """

    path: Path
    runs: dict[str, Path]
    figures: dict[str, Any]
    diverged: Any
    status: str = "ok"
    errors: dict[str, str] = field(default_factory=dict)
    #: the previous compare left in place when this one (failed) went beside it
    kept: Path | None = None
    logics: tuple[str, ...] = LOGICS
    diverged_pairs: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        """One line a notebook can show (the dataclass's own printed every table and all of
        ``compare.json``)."""
        pairs = "".join(f", {k} {len(v):,}" for k, v in self.diverged_pairs.items())
        return (f"CompareResult({str(self.path)!r}, status {self.status!r}, logics {'/'.join(self.logics)}; "
                f"diverged rows: {self.logics[0]}-{self.logics[1]} {len(self.diverged):,}{pairs})")

    @property
    def report(self) -> Path:
        """``compare.md``."""
        return self.path / "compare.md"

    @property
    def plot(self) -> Path:
        """``compare.png``."""
        return self.path / "compare.png"


# -- the runs --------------------------------------------------------------------------


def parse_logics(logics: str | Sequence[str]) -> tuple[str, ...]:
    """The logics of a compare, from ``"old,new,latest"`` or a sequence of names.

    Raises:
        InputError: an unknown name, a name given twice, or fewer than two
            (``argument: --logics``).
    """
    text = logics if isinstance(logics, str) else ",".join(str(x) for x in logics)
    names = tuple(x.strip() for x in text.split(","))
    if len(names) < 2 or len(set(names)) != len(names) or any(x not in ALL_LOGICS for x in names):
        raise InputError("argument", "--logics", repr(text),
                         "two or three different ones of old,new,latest, comma-separated "
                         "(e.g. old,new or old,new,latest)")
    return names


def _logic_overrides(overrides: Sequence[str | tuple[str, str]], logic: str) -> list[str | tuple[str, str]]:
    """The user's overrides with the compare's own ``window_logic`` last (it wins)."""
    return [*overrides, ("compare", f"window_logic={logic}")]


def _run_logic(task: dict[str, Any]) -> dict[str, Any]:
    """Run one logic of a compare into ``task["target"]`` (top-level: a spawn-safe worker).

    The scenario is loaded again here from its file and overrides (the
    same resolution as in the parent, which validated it), so that nothing
    but plain data crosses the process boundary. Bad input found while
    running (a bad trace line) comes back as ``input_error``.
    """

    logic = str(task["logic"])
    bar: Any = None
    try:
        spec = load_run(Path(task["scenario"]), _logic_overrides(task["overrides"], logic))
        writer = RunWriter(Path(task["target"]))
        if task["progress"]:
            bar = tqdm(total=spec.expected_requests, unit="req", desc=f"{spec.name} {logic.upper()}",
                       file=sys.stderr, position=int(task["position"]), leave=True, dynamic_ncols=True)

        def progress(finished: int, sim_time_s: float) -> None:
            if bar is not None:
                bar.set_postfix_str(f"sim {sim_time_s:.1f} s", refresh=False)
                bar.update(finished - bar.n)

        t0 = time.perf_counter()
        outcome = execute(spec, writer, progress=progress, argv=list(task["argv"]))
        wall_s = time.perf_counter() - t0
    except InputError as exc:
        return {"logic": logic, "input_error": [exc.source, exc.key, exc.problem, exc.allowed]}
    finally:
        if bar is not None:
            bar.close()
    err = outcome.error
    return {"logic": logic, "status": outcome.status, "folder": str(outcome.folder), "wall_s": wall_s,
            "error": None if err is None else str(outcome.summary.get("error", err)),
            "traceback": None if err is None else "".join(traceback.format_exception(err))}


def _run_all(tasks: list[dict[str, Any]], jobs: int) -> list[dict[str, Any]]:
    """Every run: here one after the other (``jobs = 1``), or in up to ``jobs`` worker
    processes that ignore Ctrl-C (the parent stops them) and die with the parent."""
    if jobs <= 1:
        return [_run_logic(t) for t in tasks]

    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx, initializer=worker_init,
                               initargs=(os.getpid(),))
    with owned(pool):   # an interrupt ends the workers before the temporary folder they write into goes
        return list(pool.map(_run_logic, tasks))


def compare_runs(spec_path: str | Path, out: str | Path | None = None,
                 overrides: Sequence[str | tuple[str, str]] = (), jobs: int | None = None,
                 progress: bool = False, *, overwrite: bool = False, verify_reproducers: bool = False,
                 argv: Sequence[str] = (), logics: str | Sequence[str] = LOGICS) -> CompareResult:
    """Run a scenario under OLD and NEW (or the given ``logics``) and write the compare folder.

    Args:
        spec_path: the ``run/1`` scenario.
        out: the compare folder (default ``results/<name>-compare``).
        overrides: ``--set``-style overrides (``"key=value"`` or ``(option, "key=value")``),
            applied before the compare's own ``window_logic``.
        jobs: worker processes (default: one per logic); 1 runs the logics here, in turn.
        progress: show a progress bar per run on stderr.
        overwrite: replace a non-empty compare folder.
        verify_reproducers: replay every reproducer with :mod:`sim.io.check`.
        argv: the command line, for the runs' ``run_info.json``.
        logics: two or three of ``old``, ``new``, ``latest`` (a sequence or
            ``"old,new,latest"``), in report order; each is compared with the first.

    Returns:
        The result; ``status`` is ``"failed"`` when a run failed (the folder
        is written all the same, with what could be compared: at ``out``, or
        beside a previous compare as ``<out>.failed``, ``kept`` naming the
        previous one).

    Raises:
        InputError: bad scenario, overrides, arguments or trace, or an ``out``
            that cannot be written; nothing is created then.
        Interrupted: Ctrl-C or SIGTERM (``kept`` says what was left); the
            workers are stopped and nothing is created.
    """

    names = parse_logics(logics)
    if jobs is None:
        jobs = len(names)
    if type(jobs) is not int or jobs < 1:
        raise InputError("argument", "--jobs", f"{jobs!r}",
                         "an integer >= 1 (1: one run after the other; default: one process per logic)")
    spec_path = Path(spec_path)
    specs = {lg: load_run(spec_path, _logic_overrides(overrides, lg)) for lg in names}
    spec = specs[names[0]]
    target = Path(out) if out is not None else default_target(spec.name)
    check_target(target, overwrite, "compare")
    previous = target.is_dir() and any(target.iterdir())
    created = make_folder(target.parent, target)
    clean_leftovers(target.parent)
    tmp = temp_beside(target)

    def abort() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_created(created)  # innermost first; only the ones this call made, if still empty

    try:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            raise out_error(target, exc) from None
        tasks = [{"logic": lg, "scenario": str(spec_path), "overrides": list(overrides),
                  "target": str(tmp / lg), "progress": progress, "position": i, "argv": list(argv)}
                 for i, lg in enumerate(names)]
        t0 = time.perf_counter()
        done = {r["logic"]: r for r in _run_all(tasks, jobs)}
        wall_s = time.perf_counter() - t0
        for lg in names:
            bad = done[lg].get("input_error")
            if bad is not None:
                if bad[:2] == ["argument", "--out"]:  # the run's output (a full disk): name the compare's
                    bad = [*bad[:2], str(bad[2]).replace(str(tmp / lg), str(target)), bad[3]]
                raise InputError(*bad)
        scenario = {"source": str(spec_path), "name": spec.name, "seed": spec.scenario.seed,
                    "overrides": [o if isinstance(o, str) else f"{o[0]} {o[1]}" for o in overrides],
                    "copy_path": spec.scenario.copy_path.enabled,
                    "describe": spec.describe().rsplit(", logic ", 1)[0]}
        timing = {"jobs": min(jobs, len(names)), "wall_clock_s": wall_s,
                  **{f"{lg}_wall_clock_s": done[lg]["wall_s"] for lg in names}}
        try:
            result = _write_compare(tmp, scenario, timing, verify_reproducers, names)
            dest = target if result.status == "ok" or not previous else \
                target.parent / f"{target.name}.failed"
            move_into_place(tmp, dest)
        except OSError as exc:
            raise out_error(target, exc) from None
    except KeyboardInterrupt as exc:
        abort()
        kept = f"previous {target} kept" if previous else f"nothing written to {target}"
        raise Interrupted(signal_of(exc), kept) from None
    except BaseException:
        abort()
        raise

    result.path = dest
    result.runs = {lg: dest / lg for lg in names}
    result.errors = {lg: str(done[lg]["traceback"]) for lg in names if done[lg].get("traceback")}
    result.kept = target if dest != target else None
    return result


def default_target(name: str) -> Path:
    """Where ``kvsim compare`` writes by default: ``results/<name>-compare``, beside the
    run folder ``results/<name>`` (never inside it)."""
    return Path("results") / f"{name}-compare"


# -- figures of one run -----------------------------------------------------------------


def logic_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures a compare reports, from one run's ``summary.json``.

    A failed run gives ``{"status": "failed", "error": ...}`` only.
    """
    if summary.get("status") == "failed" or "requests" not in summary:
        return {"status": "failed", "error": summary.get("error")}
    tok, tr, eng = summary["tokens"], summary["transfers"], summary["engine"]
    rep = summary.get("reproducers") or {}
    return {
        "status": "ok",
        "end": summary.get("end", "ok"),
        "requests": dict(summary["requests"]),
        "crashes": dict(summary["crashes"]),
        "hazards": dict(summary["hazards"]),
        "integrity_violations": summary.get("integrity_violations", 0),
        "deferrals": {"count": eng["deferrals"], "reasons": dict(eng.get("deferral_reasons", {}))},
        "tokens": {"external_hit": tok["cpu_hit"] + tok.get("cpu_reload", 0), "cpu_hit": tok["cpu_hit"],
                   "cpu_reload": tok.get("cpu_reload", 0), "recomputed": tok["recomputed"],
                   "computed": tok["computed"], "gpu_hit": tok["gpu_hit"], "prompt": tok["prompt"]},
        "bytes": {"h2d": tr["h2d_bytes"], "d2h": tr["d2h_bytes"]},
        "ttft_s": dict(summary["ttft_s"]),
        "overloaded": summary.get("overloaded"),
        "load": dict(summary.get("load") or {}),
        "tpot_s": {"mean": summary["tpot_s"].get("mean"), "p50": summary["tpot_s"].get("p50")},
        "throughput": dict(summary["throughput"]),
        "preemptions": eng["preemptions"],
        "sim_time_s": summary.get("sim_time_s"),
        "reproducers_written": rep.get("count", 0),
    }


# -- diverging requests -----------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    a_none = a is None or (isinstance(a, float) and math.isnan(a))
    b_none = b is None or (isinstance(b, float) and math.isnan(b))
    if a_none or b_none:
        return a_none and b_none
    return bool(a == b)


def _clean(v: Any) -> Any:
    """pandas scalars as plain Python values, missing as None."""
    import pandas as pd  # noqa: PLC0415 -- pandas loads only for tables, so `kvsim check` starts light

    if v is None:
        return None
    try:
        if pd.isna(v):
            return None
    except (TypeError, ValueError):
        pass
    if hasattr(v, "item"):
        return v.item()
    return v


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def describe_divergence(old: dict[str, Any], new: dict[str, Any],
                        names: tuple[str, str] = ("OLD", "NEW")) -> str:
    """How one request's outcome differs between OLD and NEW (or the two logics
    ``names`` says), in words.

    ``old`` and ``new`` map the compared columns (``status``, ``crash``,
    ``cpu_hit_tokens`` ...) to values; ``status`` "absent" marks a request
    the run never recorded.
    """
    A, B = names  # noqa: N806 -- the two logics' names, as printed
    side = {A: old, B: new}
    parts: list[str] = []
    if old.get("status") == "absent" or new.get("status") == "absent":
        missing = A if old.get("status") == "absent" else B
        other = side[B if missing == A else A]
        return f"only in {B if missing == A else A} ({other.get('status')}); " \
               f"{missing} never recorded it"
    crash = {k: v.get("crash") for k, v in side.items()}
    if not _same(crash[A], crash[B]):
        bits = []
        for name, c in crash.items():
            r = side[name]
            if c is not None:
                bits.append(f"{name} crashed ({c})")
            else:
                hit = int(r.get("cpu_hit_tokens") or 0)
                bits.append(f"{name} loaded {hit} tokens" if hit else f"{name} loaded nothing")
        parts.append(", ".join(bits))
    if not _same(old.get("status"), new.get("status")):
        parts.append(f"{A} {old.get('status')}, {B} {new.get('status')}")
    d_old, d_new = int(old.get("deferrals") or 0), int(new.get("deferrals") or 0)
    if d_old != d_new:
        if d_old == 0:
            parts.append(f"{B} deferred {_times(d_new)}")
        elif d_new == 0:
            parts.append(f"{A} deferred {_times(d_old)}")
        else:
            parts.append(f"{A} deferred {_times(d_old)}, {B} {_times(d_new)}")
    if _same(crash[A], crash[B]) and not _same(old.get("cpu_hit_tokens"), new.get("cpu_hit_tokens")):
        parts.append(f"different CPU hit ({A} {old.get('cpu_hit_tokens')}, "
                     f"{B} {new.get('cpu_hit_tokens')} tokens)")
    if not _same(old.get("cpu_reload_tokens"), new.get("cpu_reload_tokens")):
        parts.append(f"different CPU reload ({A} {old.get('cpu_reload_tokens')}, "
                     f"{B} {new.get('cpu_reload_tokens')} tokens)")
    if parts:
        return "; ".join(parts)
    if not _same(old.get("computed_tokens"), new.get("computed_tokens")):
        return (f"different computed tokens ({A} {old.get('computed_tokens')}, "
                f"{B} {new.get('computed_tokens')})")
    ttft = not _same(old.get("first_token_s"), new.get("first_token_s"))
    finish = not _same(old.get("finish_s"), new.get("finish_s"))
    if ttft and finish:
        return "different TTFT and finish time"
    if ttft:
        return "different TTFT only"
    return "different finish time only"


_TIMING_ONLY = ("different TTFT", "different finish time")


def _diverged_figures(diverged: Any, total: int) -> dict[str, Any]:
    """Counts of the diverging requests and the ones to show: those whose outcome
    differs (crash, status, hit, reload, deferrals, computed tokens) first, by
    arrival, then those that differ in timing only (a knock-on effect)."""
    pairs = list(zip(diverged["req_id"], diverged["how"], strict=True))
    outcome = [(r, h) for r, h in pairs if not h.startswith(_TIMING_ONLY)]
    timing = [(r, h) for r, h in pairs if h.startswith(_TIMING_ONLY)]
    shown = (outcome + timing)[:_REPORT_SHOWN]
    return {"count": len(pairs), "requests": total, "outcome": len(outcome), "timing_only": len(timing),
            "first": [{"req_id": r, "how": h} for r, h in shown]}


def _rows_by_id(frame: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    cols = [c for c, _ in _OUTCOME if c != "ttft_s"]
    for rec in frame.to_dict("records"):
        row = {c: _clean(rec.get(c)) for c in cols}
        arrival = _clean(rec.get("arrival_s"))
        row["arrival_s"] = arrival
        first = row["first_token_s"]
        row["ttft_s"] = None if first is None or arrival is None else first - arrival
        out[str(rec["req_id"])] = row
    return out


def diverged_requests(old_requests: Any, new_requests: Any, logics: Sequence[str] = LOGICS) -> Any:
    """The requests whose outcome differs, one row each (columns :data:`DIVERGED_COLUMNS`,
    or :func:`diverged_columns` of ``logics``: the two logics the tables come from),
    ordered by arrival time, then request id."""
    import pandas as pd  # noqa: PLC0415 -- pandas loads only for tables, so `kvsim check` starts light

    a, b = logics
    rows = {a: _rows_by_id(old_requests), b: _rows_by_id(new_requests)}
    absent = {c: None for c, _ in _OUTCOME} | {"status": "absent", "arrival_s": None}
    compared = [c for c, _ in _OUTCOME if c != "ttft_s"]
    out: list[dict[str, Any]] = []
    for rid in set(rows[a]) | set(rows[b]):
        o = rows[a].get(rid, absent)
        n = rows[b].get(rid, absent)
        if all(_same(o[c], n[c]) for c in compared):
            continue
        arrival = o["arrival_s"] if o["arrival_s"] is not None else n["arrival_s"]
        rec: dict[str, Any] = {"req_id": rid, "arrival_s": arrival}
        for lg, r in ((a, o), (b, n)):
            for c, _ in _OUTCOME:
                rec[f"{lg}_{c}"] = r[c]
        rec["how"] = describe_divergence(o, n, (a.upper(), b.upper()))
        out.append(rec)
    out.sort(key=lambda r: (r["arrival_s"] if r["arrival_s"] is not None else math.inf, r["req_id"]))
    frame = pd.DataFrame(out, columns=list(diverged_columns(a, b)))
    for lg in (a, b):
        for c, kind in _OUTCOME:
            if kind == "int64":
                frame[f"{lg}_{c}"] = frame[f"{lg}_{c}"].astype("Int64")
            elif kind == "float64":
                frame[f"{lg}_{c}"] = frame[f"{lg}_{c}"].astype("float64")
    return frame


def _diverged_schema(logics: Sequence[str] = LOGICS) -> Any:
    fields = [pa.field("req_id", pa.string(), nullable=False), pa.field("arrival_s", pa.float64())]
    for lg in logics:
        fields += [pa.field(f"{lg}_{c}", getattr(pa, kind)()) for c, kind in _OUTCOME]
    fields.append(pa.field("how", pa.string(), nullable=False))
    return pa.schema(fields)


def _write_diverged(path: Path, frame: Any, logics: Sequence[str] = LOGICS) -> None:
    schema = _diverged_schema(logics)
    cols = {name: [_clean(v) for v in frame[name].tolist()] for name in schema.names}
    table = pa.Table.from_pydict(cols, schema=schema)
    pq.write_table(table, path, compression="zstd", compression_level=3, write_statistics=True,
                   use_dictionary=True, write_page_index=False, store_schema=True)


# -- reproducers ------------------------------------------------------------------------

_HEAD = re.compile(r"^# reproducer: (?P<kind>\S+) (?P<detail>\S+) of request (?P<req>\S+) at t = "
                   r"(?P<t>[0-9.eE+-]+) s \((?P<logic>\w+) logic\)")
_ISOLATION = re.compile(r"^# reproduced in isolation: (?P<yes>yes|no)")


def list_reproducers(run_folder: Path, events: Any = None) -> list[dict[str, Any]]:
    """The ``reproducers/*.toml`` of a run folder (none when the folder is absent).

    Each entry: ``file`` (relative to the run folder), ``kind`` (crash |
    hazard), ``detail`` (crash or hazard kind), ``req_id``, ``t_s``,
    ``reproduced_in_run`` (the engine's own verdict, None if the file does
    not say), and ``event`` (the matching row of the run's events table, as
    "crash missing_chunk (group 1, chunk 14)") when ``events`` is given.
    """
    folder = Path(run_folder) / "reproducers"
    if not folder.is_dir():
        return []
    out = []
    for f in sorted(folder.glob("*.toml")):
        entry: dict[str, Any] = {"file": f"reproducers/{f.name}", "kind": None, "detail": None,
                                 "req_id": None, "t_s": None, "reproduced_in_run": None, "event": None}
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except OSError:
            lines = []
        for line in lines:
            if not line.startswith("#"):
                break
            m = _HEAD.match(line)
            if m:
                entry.update(kind=m["kind"], detail=m["detail"], req_id=m["req"], t_s=float(m["t"]))
            m = _ISOLATION.match(line)
            if m:
                entry["reproduced_in_run"] = m["yes"] == "yes"
        if entry["req_id"] is None:  # NNN-<request>-<detail>.toml
            parts = f.stem.split("-", 1)
            if len(parts) == 2 and "-" in parts[1]:
                req, _, detail = parts[1].rpartition("-")
                entry.update(req_id=req, detail=detail)
        if events is not None and entry["req_id"] is not None and len(events):
            match = events[(events["req_id"] == entry["req_id"]) & (events["detail"] == entry["detail"])]
            if len(match):
                ev = match.iloc[0]
                where = []
                if int(ev["group"]) >= 0:
                    where.append(f"group {int(ev['group'])}")
                if int(ev["chunk"]) >= 0:
                    where.append(f"chunk {int(ev['chunk'])}")
                entry["event"] = f"{ev['kind']} {ev['detail']}" + (f" ({', '.join(where)})" if where else "")
                entry["kind"] = entry["kind"] or str(ev["kind"])
                if entry["t_s"] is None:
                    entry["t_s"] = float(ev["t_s"])
        out.append(entry)
    return out


def verify_reproducer(path: Path, logic: str, kind: str | None, detail: str | None) -> dict[str, Any]:
    """Replay one reproducer with :mod:`sim.io.check`.

    Returns ``holds`` (every expectation in the file holds), ``reproduces``
    (``logic`` in isolation gives the recorded crash, or the recorded hazard
    among its hazards), ``outcome`` (one line per logic) and ``error`` (the
    file could not be read or parsed; then the other two are False).
    """
    try:
        _, items = load_check_file(Path(path))
        sc = parse_check(items[0], str(path))
        outcomes, mismatches = evaluate(sc, str(path))
    except InputError as exc:
        return {"holds": False, "reproduces": False, "outcome": {}, "error": str(exc)}
    mine = outcomes.get(logic)
    reproduces = False
    if mine is not None and detail is not None:
        if kind == "hazard":
            kinds = {h[0] if isinstance(h, list | tuple) else h["kind"] for h in mine["hazards"]}
            reproduces = detail in kinds
        else:
            reproduces = mine["crash"] is not None and mine["crash"]["kind"] == detail
    return {"holds": not mismatches, "reproduces": reproduces,
            "outcome": {lg: summarize(o) for lg, o in outcomes.items()},
            "mismatches": {lg: list(d) for lg, d in mismatches.items()}, "error": None}


# -- writing the compare ------------------------------------------------------------------


def _pair_file(first: str, other: str) -> str:
    """The diverged table of ``first`` against a logic after the second."""
    return f"diverged-{first}-{other}.parquet"


def _write_compare(folder: Path, scenario: dict[str, Any], timing: dict[str, Any],
                   verify: bool, names: tuple[str, ...] = LOGICS) -> CompareResult:
    runs = {lg: load_results(folder / lg) for lg in names}
    logics: dict[str, Any] = {}
    reproducers: dict[str, list[dict[str, Any]]] = {}
    for lg in names:
        res = runs[lg]
        logics[lg] = logic_figures(res.summary)
        reps = list_reproducers(res.path, res.events)
        if verify:
            for r in reps:
                r["verified"] = verify_reproducer(res.path / r["file"], lg, r["kind"], r["detail"])
        reproducers[lg] = reps
    first = names[0]
    frames: dict[str, Any] = {}
    counts: dict[str, Any] = {}
    for other in names[1:]:
        a, b = runs[first].requests, runs[other].requests
        frames[other] = diverged_requests(a, b, (first, other))
        counts[other] = _diverged_figures(frames[other], len(set(a["req_id"]) | set(b["req_id"])))
    status = "ok" if all(f["status"] == "ok" for f in logics.values()) else "failed"
    figures: dict[str, Any] = {
        "schema": "compare/1",
        "status": status,
        "scenario": scenario,
        "runs": logics,
        "diverged": counts[names[1]],
        "reproducers": reproducers,
        "verified_reproducers": verify,
        "timing": timing,
    }
    if names != LOGICS:  # compare.json sorts its keys: the order is said here (absent: old, new)
        figures["logics"] = list(names)
    if len(names) > 2:
        figures["diverged_pairs"] = {f"{first}-{lg}": {**counts[lg], "file": _pair_file(first, lg)}
                                     for lg in names[2:]}
    _write_diverged(folder / "diverged.parquet", frames[names[1]], names[:2])
    for lg in names[2:]:
        _write_diverged(folder / _pair_file(first, lg), frames[lg], (first, lg))

    write_json_atomic(folder / "compare.json", clean_floats(figures))

    save_figure(old_vs_new(folder, runs=runs, figures=figures), folder / "compare.png")
    write_text_atomic(folder / "compare.md", markdown_report(clean_floats(figures)))
    return CompareResult(path=folder, runs={lg: folder / lg for lg in names},
                         figures=clean_floats(figures), diverged=frames[names[1]], status=status,
                         logics=names, diverged_pairs={f"{first}-{lg}": frames[lg] for lg in names[2:]})


def compare_logics(figures: dict[str, Any]) -> tuple[str, ...]:
    """The logics of a compare, in report order, from its ``compare.json``."""
    return tuple(figures.get("logics") or LOGICS)


def load_compare(path: str | Path) -> CompareResult:
    """Read a compare folder written by :func:`compare_runs` (``kvsim compare``).

    Raises:
        InputError: ``path`` is not a compare folder (no ``compare.json``), or a
            file of it cannot be read (truncated or corrupt), naming the file.
    """
    folder = Path(path)
    f = folder / "compare.json"
    if not f.is_file():
        raise InputError(str(folder), "", "not a compare folder (no compare.json)",
                         "a folder written by kvsim compare")
    figures = read_json(f)
    if not isinstance(figures, dict):
        raise InputError(str(f), "", "not a JSON object", RERUN)
    names = compare_logics(figures)

    def table(name: str, pair: tuple[str, str]) -> Any:
        d = folder / name
        return (read_parquet(d) if d.is_file() else _diverged_schema(pair).empty_table()).to_pandas()

    return CompareResult(path=folder, runs={lg: folder / lg for lg in names}, figures=figures,
                         diverged=table("diverged.parquet", (names[0], names[1])),
                         status=str(figures.get("status", "ok")), logics=names,
                         diverged_pairs={f"{names[0]}-{lg}": table(_pair_file(names[0], lg), (names[0], lg))
                                         for lg in names[2:]})


# -- text ------------------------------------------------------------------------------


def _kinds(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def _rows(figures: dict[str, Any]) -> list[tuple[str, ...]]:
    """(label, OLD, NEW[, LATEST]) rows of the side-by-side table, a cell per logic."""
    runs = figures["runs"]
    names = compare_logics(figures)
    copy_path = bool(figures.get("scenario", {}).get("copy_path"))

    def cell(f: dict[str, Any], what: str) -> str:
        if f["status"] != "ok":
            return "FAILED" if what == "status" else "-"
        if what == "status":
            return "ok" if f["end"] == "ok" else f"ok ({f['end']})"
        if what == "requests":
            r = f["requests"]
            return f"{r['finished']} / {r['arrived']}" + (f" ({r['rejected']} rejected)" if r.get("rejected")
                                                          else "")
        if what == "crashes":
            c = f["crashes"]
            if not c["count"]:
                return "0"
            first = "" if c.get("first_s") is None else f"; first at {c['first_s']:.3f} s"
            return f"{c['count']} ({_kinds(c['kinds'])}{first})"
        if what == "hazards":
            h = f["hazards"]
            return str(h["count"]) + (f" ({_kinds(h['kinds'])})" if h["count"] else "")
        if what == "integrity":
            return str(f["integrity_violations"]) if copy_path else "- (copy path off)"
        if what == "deferrals":
            d = f["deferrals"]
            return str(d["count"]) + (f" ({_kinds(d['reasons'])})" if d["reasons"] else "")
        t = f["tokens"]
        if what == "external":
            return f"{t['external_hit']:,} (hit {t['cpu_hit']:,} + reload {t['cpu_reload']:,})"
        if what == "recomputed":
            return f"{t['recomputed']:,}"
        if what == "computed":
            return f"{t['computed']:,}"
        if what == "bytes":
            return f"{human_bytes(f['bytes']['h2d'])} / {human_bytes(f['bytes']['d2h'])}"
        if what == "ttft":
            return durations_text(f["ttft_s"].get(f"p{q}") for q in (50, 90, 99))
        if what == "load":
            if f.get("overloaded") is None:
                return "-"
            ld = f.get("load") or {}
            return (f"{'OVERLOADED' if f['overloaded'] else 'stable'} (queue {ld.get('queue_trend')}, "
                    f"peak {ld.get('peak_waiting')})")
        if what == "tpot":
            return durations_text((f["tpot_s"].get("mean"), f["tpot_s"].get("p50")))
        thr = f["throughput"]
        rps, tps = thr.get("requests_per_s"), thr.get("output_tokens_per_s")
        return f"{'-' if rps is None else f'{rps:.2f}'} req/s, {'-' if tps is None else f'{tps:.1f}'} tok/s"

    labels = [("status", "status"), ("requests finished / arrived", "requests"), ("crashes", "crashes"),
              ("hazards", "hazards"), ("integrity violations", "integrity"), ("deferrals", "deferrals"),
              ("external-hit tokens", "external"), ("recomputed tokens", "recomputed"),
              ("computed tokens", "computed"), ("bytes H2D / D2H", "bytes"), ("load", "load"),
              ("TTFT p50 / p90 / p99", "ttft"), ("TPOT mean / p50", "tpot"), ("throughput", "throughput")]
    rows = [(label, *(cell(runs[lg], what) for lg in names)) for label, what in labels]
    reps = figures.get("reproducers", {})
    rows.append(("reproducers", *(_rep_cell(reps.get(lg, [])) for lg in names)))
    return rows


def _pairs(figures: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], str]]:
    """(first, other, diverged figures, file) of each logic compared with the first."""
    names = compare_logics(figures)
    more = figures.get("diverged_pairs", {})
    return [(names[0], names[1], figures["diverged"], "diverged.parquet"),
            *((names[0], lg, more[f"{names[0]}-{lg}"], more[f"{names[0]}-{lg}"]["file"])
              for lg in names[2:])]


def _rep_cell(reps: list[dict[str, Any]]) -> str:
    if not reps:
        return "0"
    verified = [r["verified"] for r in reps if "verified" in r]
    if verified:
        return f"{len(reps)} ({sum(v['reproduces'] for v in verified)} verified to reproduce)"
    return str(len(reps))


def compare_table(figures: dict[str, Any], folder: Path | str | None = None) -> str:
    """The side-by-side table ``kvsim compare`` prints (a column per logic), with the
    first diverging requests of each logic against the first."""
    rows = [("", *(LOGIC_NAMES[lg] for lg in compare_logics(figures))), *_rows(figures)]
    pairs = _pairs(figures)
    label = {other: "diverging requests" if len(pairs) == 1 else
             f"diverging {first.upper()} vs {other.upper()}" for first, other, _, _ in pairs}
    w0 = max(len(r[0]) for r in [*rows, *((x,) for x in label.values())])
    widths = [max(len(r[i]) for r in rows) for i in range(1, len(rows[0]) - 1)]
    lines = ["  ".join([f"{r[0]:<{w0}}", *(f"{c:<{w}}" for c, w in zip(r[1:-1], widths, strict=True)),
                        r[-1]]).rstrip() for r in rows]
    for _, other, d, file in pairs:
        split = ""
        if d["count"] and "outcome" in d:
            split = f" ({d['outcome']} in outcome, {d['timing_only']} in timing only)"
        lines.append(f"{label[other]:<{w0}}  {d['count']} of {d['requests']}{split}")
        for item in d["first"][:_SHOWN]:
            lines.append(f"{'':<{w0}}  {item['req_id']}: {item['how']}")
        if d["count"] > _SHOWN:
            lines.append(f"{'':<{w0}}  ... {d['count'] - _SHOWN} more in {file}")
    if folder is not None:
        lines.append(f"{'results':<{w0}}  {folder}")
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_report(figures: dict[str, Any]) -> str:
    """``compare.md``: what was run, the side-by-side figures, the diverging
    requests, the reproducers, the figure, and (last) the wall-clock timings."""
    sc = figures["scenario"]
    names = compare_logics(figures)
    over = ", ".join(f"`{o}`" for o in sc.get("overrides", [])) or "none"
    each = [f"`\"{lg}\"` ({_VLLM[lg]}) in `{lg}/`" for lg in names]
    each[0] = f"`window_logic = {each[0][1:]}"
    out = [f"# kvsim compare: {sc['name']}", "",
           f"Scenario `{sc['source']}` (seed {sc['seed']}; overrides: {over}), run "
           f"{'twice' if len(names) == 2 else 'three times'} with the same requests: "
           f"{', '.join(each[:-1])}{',' if len(names) > 2 else ''} and {each[-1]}.", "",
           f"{sc.get('describe', '')}", ""]
    if figures["status"] != "ok":
        for lg in names:
            f = figures["runs"][lg]
            if f["status"] != "ok":
                out += [f"**The {lg.upper()} run failed**: {_md(str(f.get('error')))} "
                        f"(see `{lg}/summary.json`).", ""]
    out += ["## Figures", "", f"| |{''.join(f' {lg.upper()} |' for lg in names)}",
            f"| --- |{' --- |' * len(names)}"]
    out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in _rows(figures)]
    out += ["", "## Diverging requests"]
    pairs = _pairs(figures)
    for first, other, d, file in pairs:
        if len(pairs) > 1:
            out += ["", f"### {first.upper()} vs {other.upper()}"]
        out += ["", f"{d['count']} of {d['requests']} requests differ (status, crash, CPU hit or reload, "
                    f"computed tokens, deferrals, first token or finish time); all of them in `{file}`."]
        if d["count"] and "outcome" in d:
            out += ["", f"Of these, {d['outcome']} differ in outcome (crash, status, CPU hit or reload, "
                        f"deferrals, computed tokens) and {d['timing_only']} in timing only (a knock-on "
                        f"effect of the others on the shared engine); the table lists outcome differences "
                        f"first."]
        if d["first"]:
            shown = "" if d["count"] <= len(d["first"]) else \
                f" (the first {len(d['first'])}: outcome differences first, each part by arrival)"
            out += ["", f"| request | how{shown} |", "| --- | --- |"]
            out += [f"| {_md(x['req_id'])} | {_md(x['how'])} |" for x in d["first"]]
    out += ["", "## Reproducers", ""]
    reps = figures.get("reproducers", {})
    if not any(reps.get(lg) for lg in names):
        out.append("No run wrote a reproducer (no modelled crash or hazard).")
    for lg in names:
        items = reps.get(lg, [])
        if not items:
            continue
        verified = any("verified" in r for r in items)
        head = "| file | request | event | t (s) | reproduced in the run |"
        sep = "| --- | --- | --- | --- | --- |"
        if verified:
            head += " expectations hold | reproduces (`kvsim check`) |"
            sep += " --- | --- |"
        out += [f"### {lg.upper()}", "", head, sep]
        for r in items:
            t = "-" if r.get("t_s") is None else f"{r['t_s']:.6f}"
            yes = {True: "yes", False: "no", None: "-"}
            event = r.get("event") or " ".join(str(x) for x in (r.get("kind"), r.get("detail")) if x)
            row = (f"| `{lg}/{r['file']}` | {_md(str(r.get('req_id')))} | {_md(event)} | {t} | "
                   f"{yes[r.get('reproduced_in_run')]} |")
            if verified:
                v = r.get("verified") or {}
                if v.get("error"):
                    row += f" error: {_md(v['error'])} | no |"
                else:
                    row += f" {yes[v.get('holds')]} | {yes[v.get('reproduces')]} |"
            out.append(row)
        out.append("")
    out += ["", f"![{' vs '.join(lg.upper() for lg in names)}: modelled failures, tokens loaded from the "
                f"CPU cache, TTFT](compare.png)", ""]
    tm = figures.get("timing", {})
    if tm:
        out += ["## Timing", "",
                "Wall clock (the only part of this report that differs between two compares of the same "
                "scenario and seed): "
                + ", ".join(f"{lg.upper()} {tm.get(f'{lg}_wall_clock_s', 0):.2f} s" for lg in names)
                + f", {'both' if len(names) == 2 else 'all'} {tm.get('wall_clock_s', 0):.2f} s with "
                + f"{tm.get('jobs')} "
                + ("process" if tm.get("jobs") == 1 else "processes") + ".", ""]
    return "\n".join(out).rstrip() + "\n"
