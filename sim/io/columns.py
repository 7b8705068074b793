"""The data dictionary: every table column, ``summary.json`` key and sweep column, with unit and meaning.

What it holds
    * the run tables' columns: :data:`sim.engine.metrics.COLUMN_DOCS` (types from
      :data:`~sim.engine.metrics.TABLES`);
    * :data:`SUMMARY_KEYS`: every key of ``summary.json`` (dotted: ``ttft_s.p50``),
      its type, unit and meaning, and whether it becomes a column of the summary
      tables (``sweep.parquet``, :func:`sim.summaries`);
    * :func:`flat_summary`: one ``summary.json`` as one row of those tables. The
      naming rule: the dotted key with ``_`` for ``.`` (``ttft_s.p50`` ->
      ``ttft_s_p50``); a table of counts (``crashes.kinds``) becomes one integer
      column per known name (``crashes_kinds_missing_chunk``, 0 where absent);
      a list (``hardware_warnings``) becomes ``<name>_count`` and ``<name>``
      (the items, one per line);
    * the identity columns of the sweep table and of the long tables
      (:data:`SWEEP_HEAD_DOCS`, :data:`RESOLVED_DOCS`, :data:`RUN_KEY_DOCS`);
    * :func:`render`, the text of ``docs/columns.md``: ``python -m sim.io.columns``
      rewrites it (``--check``: exit 1 when it is not current; the tests check it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from sim.engine.metrics import COLUMN_DOCS, OPTIONAL_TABLES, TABLES
from sim.model.connector import CrashKind, DeferReason, HazardKind

__all__ = [
    "COUNT_NAMES",
    "RESOLVED_DOCS",
    "RUN_KEY_DOCS",
    "SUMMARY_KEYS",
    "SWEEP_HEAD_DOCS",
    "Key",
    "flat_columns",
    "flat_summary",
    "key_type",
    "render",
    "summary_arrays",
]


@dataclass(frozen=True)
class Key:
    """One ``summary.json`` key.

    Attributes:
        type: ``int``, ``int?`` (nullable), ``float``, ``float?``, ``str``,
            ``bool``, ``counts`` (a table name -> count) or ``list`` (of text).
        unit: ``s``, ``tokens``, ``bytes``, ``requests``, ``share`` (0..1), ... ; ``-`` for text.
        meaning: one line.
        column: whether it becomes columns of the summary tables (the run's
            identity and status have their own columns; a failed run's keys
            have none).
        absent: its value in an ok run whose summary lacks the key (a list: the
            list; None: null).
    """

    type: str
    unit: str
    meaning: str
    column: bool = True
    absent: Any = None


#: every key of ``summary.json``, dotted, in the order of the file's sections
SUMMARY_KEYS: dict[str, Key] = {
    "status": Key("str", "-", "ok | failed | interrupted (the sweep table: ok | failed)", column=False),
    "error": Key("str", "-", "failed or interrupted runs: the error in one line", column=False),
    "run.name": Key("str", "-", "the run's name (name, else the scenario file's stem)", column=False),
    "run.seed": Key("int", "-", "the seed", column=False),
    "run.window_logic": Key("str", "-", "old | new | latest", column=False),
    "progress.requests_finished": Key("int", "requests", "failed or interrupted runs: requests finished "
                                      "when it stopped", column=False),
    "progress.sim_time_s": Key("float", "s", "failed or interrupted runs: simulated time reached (at the "
                               "last progress report)", column=False),
    **{f"rows.{t}": Key("int", "rows", f"failed or interrupted runs: rows written to {t}.parquet"
                        + (" (only with secondary tiers)" if t in OPTIONAL_TABLES else ""),
                        column=False) for t in TABLES},
    "end": Key("str", "-", "how the simulation ended: ok | stopped_on_crash (on_crash = \"stop\") | "
               "time_limit (output.max_sim_time_s) | queue_limit (output.stop_at_waiting)"),
    "requests.arrived": Key("int", "requests", "requests that arrived"),
    "requests.finished": Key("int", "requests", "requests that finished"),
    "requests.rejected": Key("int", "requests", "requests rejected: longer than `max_model_len` (on "
                                                         "arrival) or never fitting in the GPU pool"),
    "requests.rejected_share": Key("float", "share", "rejected / arrived (0 when nothing arrived)"),
    "tokens.prompt": Key("int", "tokens", "prompt tokens of every request that arrived"),
    "tokens.gpu_hit": Key("int", "tokens", "prompt tokens found in the GPU prefix cache at first admission"),
    "tokens.cpu_hit": Key("int", "tokens", "prompt tokens loaded from the CPU cache at first admission"),
    "tokens.cpu_reload": Key("int", "tokens", "tokens loaded from the CPU cache again after a preemption"),
    "tokens.computed": Key("int", "tokens", "prefill tokens computed on the GPU (all passes)"),
    "tokens.recomputed": Key("int", "tokens", "of those, tokens computed again (preemption, dropped hit)"),
    "tokens.output": Key("int", "tokens", "output tokens of the finished requests"),
    "gpu_hit_rate": Key("float", "share", "tokens.gpu_hit / tokens.prompt"),
    "cpu_hit_rate": Key("float", "share", "tokens.cpu_hit / tokens.prompt"),
    "recompute_saved": Key("float", "share", "of all prefill work (loaded from the CPU cache + computed, "
                           "preemption reloads and recomputes included), the share the CPU cache served"),
    **{f"ttft_s.p{q}": Key("float?", "s", f"time to first token, {q}th percentile of the finished requests "
                           "(null: none)") for q in (50, 90, 99)},
    "tpot_s.mean": Key("float?", "s", "time per output token after the first, mean over the finished "
                       "requests with 2 tokens or more"),
    **{f"tpot_s.p{q}": Key("float?", "s", f"time per output token, {q}th percentile") for q in (50, 90, 99)},
    "throughput.requests_per_s": Key("float?", "requests/s", "finished requests per simulated second "
                                     "(whole run)"),
    "throughput.output_tokens_per_s": Key("float?", "tokens/s", "output tokens per simulated second "
                                          "(whole run)"),
    "transfers.load_jobs": Key("int", "jobs", "load (h2d) jobs"),
    "transfers.store_jobs": Key("int", "jobs", "store (d2h) jobs"),
    "transfers.h2d_bytes": Key("int", "bytes", "bytes loaded host to device"),
    "transfers.d2h_bytes": Key("int", "bytes", "bytes stored device to host"),
    "transfers.h2d_utilisation": Key("float?", "share", "time the H2D link was busy with jobs completed "
                                                          "by the end / simulated time"),
    "transfers.d2h_utilisation": Key("float?", "share", "time the D2H link was busy with jobs completed "
                                                          "by the end / simulated time"),
    "transfers.flushed_stores": Key("int", "jobs", "stores the engine had to wait for (spec section 7.6)"),
    "transfers.store_rejections": Key("int", "count", "stores the CPU cache could not take (no room to "
                                      "reserve)"),
    "engine.steps": Key("int", "count", "engine steps (fast-forwarded decode steps included)"),
    "engine.step_rows": Key("int", "rows", "rows of steps.parquet"),
    "engine.preemptions": Key("int", "count", "preemptions"),
    "engine.deferrals": Key("int", "count", "lookups answered 'ask again next step'"),
    "engine.deferral_reasons": Key("counts", "count", "deferrals by reason"),
    "crashes.count": Key("int", "count", "modelled crashes (docs/architecture.md)"),
    "crashes.kinds": Key("counts", "count", "modelled crashes by kind"),
    "crashes.first_s": Key("float?", "s", "time of the first crash (null: none)"),
    "hazards.count": Key("int", "count", "hazards: unsafe reads or double loads seen with assertions "
                         "stripped"),
    "hazards.kinds": Key("counts", "count", "hazards by kind"),
    "integrity_violations": Key("int", "count", "copy path: loaded blocks whose content was wrong"),
    "sim_time_s": Key("float", "s", "simulated time at the end of the run"),
    "load.overloaded": Key("bool", "-", "the steady-state verdict (docs/metrics.md, \"Steady state and "
                           "overload\")"),
    "load.reason": Key("str", "-", "when overloaded, the rule that fired, in words; \"\" otherwise"),
    "load.arrival_span_s": Key("float", "s", "last arrival - first arrival"),
    "load.offered_requests_per_s": Key("float?", "requests/s", "requests that arrived per second of the "
                                       "arrival window"),
    "load.offered_prompt_tokens_per_s": Key("float?", "tokens/s", "prompt tokens that arrived per second "
                                            "of the arrival window"),
    "load.served_requests_per_s": Key("float?", "requests/s", "finished requests per second from the "
                                      "first arrival to the end"),
    "load.served_prompt_tokens_per_s": Key("float?", "tokens/s", "prompt tokens of the finished requests "
                                           "per second from the first arrival to the end"),
    "load.served_output_tokens_per_s": Key("float?", "tokens/s", "output tokens per second from the first "
                                           "arrival to the end"),
    "load.queue_trend": Key("str", "-", "growing | stable | n/a: the waiting queue's trend over the "
                            "arrival window"),
    "load.queue_growth_requests": Key("float?", "requests", "requests the waiting queue gained by its "
                                      "least-squares trend over the arrival window"),
    "load.waiting_at_last_arrival": Key("int?", "requests", "waiting queue at the last sample before the "
                                        "last arrival"),
    "load.peak_waiting": Key("int", "requests", "largest waiting queue at a step boundary"),
    "load.drain_s": Key("float?", "s", "end of the run - last arrival"),
    "load.rejected_share": Key("float", "share", "rejected / arrived"),
    "overloaded": Key("bool", "-", "= load.overloaded (docs/metrics.md)"),
    **{f"ttft_s_with_rejected.p{q}": Key("float?", "s", f"TTFT {q}th percentile with every rejected request "
                                         "counted as never served; null where it falls on one")
       for q in (50, 90, 99)},
    "hardware_warnings": Key("list", "-", "doubtful but valid settings (a CPU cache beyond the run's share "
                             "of the node's RAM, ...)", absent=[]),
    "reproducers.count": Key("int", "count", "modelled crashes and hazards written as check/1 files under "
                             "reproducers/", absent=0),
    "reproducers.reproduced": Key("int", "count", "of those, reproduced by kvsim check in isolation",
                                  absent=0),
    "reproducers.files": Key("list", "-", "their file names", absent=[]),
    "tiers.primary.label": Key("str", "-", "[[tiers]] only: vLLM's label of the CPU tier, 0:primary",
                               column=False),
    "tiers.primary.chunk_queries": Key("int", "count", "[[tiers]] only: vllm:kv_offload_tiering_"
                                       "chunk_queries of the CPU tier (once per request and chunk, HIT "
                                       "or MISS answers)",
                                       column=False),
    "tiers.primary.chunk_hits": Key("int", "count", "[[tiers]] only: vllm:kv_offload_tiering_chunk_hits of "
                                    "the CPU tier", column=False),
    "tiers.primary.resident_hit_tokens": Key("float", "tokens", "[[tiers]] only: of tokens.cpu_hit, the "
                                             "share served by chunks already in CPU memory (each hit split "
                                             "over its load's chunks; the rest is the tiers' "
                                             "promoted_hit_tokens)", column=False),
    "tiers.primary.resident_hit_rate": Key("float", "share", "[[tiers]] only: resident_hit_tokens / prompt "
                                           "tokens (cpu_hit_rate = this + every tier's promoted_hit_rate)",
                                           column=False),
    "tiers.promotion_allocation_failures": Key("int", "count", "[[tiers]] only: vllm:kv_offload_tiering_"
                                               "promotion_allocation_failures (no CPU slot for a promotion)",
                                               column=False),
    "tiers.secondary": Key("list", "-", "[[tiers]] only: per secondary tier, its label, kind, "
                           "capacity_chunks, policy, vLLM's chunk_queries, chunk_hits, read_bytes, "
                           "read_time, write_bytes, write_time, promotion_jobs, cascade_jobs, and "
                           "kvsim's promoted_chunks_loaded, promoted_hit_tokens and promoted_hit_rate "
                           "(its share of the CPU hit tokens, and that over prompt tokens), evictions, "
                           "store_rejections, "
                           "occupancy_chunks (mean, peak, end), utilisation "
                           "(docs/tiers.md)", column=False),
    "workload.bad_lines_skipped": Key("int?", "count", "workload.skip_bad: bad trace lines skipped (null "
                                      "without skip_bad)"),
    "workload.bad_line_examples": Key("list", "-", "workload.skip_bad: the first bad lines, as reported"),
}


def _literal(tp: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in typing.get_args(tp))


#: the names a table of counts always has a column for (others get one when they occur)
COUNT_NAMES: dict[str, tuple[str, ...]] = {
    "engine.deferral_reasons": _literal(DeferReason),
    "crashes.kinds": _literal(CrashKind),
    "hazards.kinds": _literal(HazardKind),
}

#: the first columns of ``sweep.parquet``: name -> (type, unit, meaning)
SWEEP_HEAD_DOCS: dict[str, tuple[str, str, str]] = {
    "point": ("int", "-", "the point's index in the full sweep"),
    "run_id": ("str", "-", "its folder name under points/ (also the run's name)"),
    "run_dir": ("str", "-", "that folder, relative to the sweep folder (points/003-...)"),
    "status": ("str", "-", "ok | failed"),
    "error": ("str", "-", "a failed point's error in one line; \"\" when ok"),
}

#: the resolved configuration of a run (sweep table, long tables): name -> (type, unit, meaning)
RESOLVED_DOCS: dict[str, tuple[str, str, str]] = {
    "model": ("str", "-", "the model's label"),
    "hardware": ("str", "-", "the hardware profile's name"),
    "workload": ("str", "-", "the workload kind (multiturn, agentic, uniform), or the trace's name or "
                             "file name"),
    "cpu_cache_bytes": ("int", "bytes", "the CPU cache: the capacity given, else chunks x slot bytes; "
                                        "0 without a CPU cache (long tables: null when only chunks "
                                        "were given)"),
    "cpu_cache_policy": ("str", "-", "lru | arc | belady"),
    "window_logic": ("str", "-", "old | new | latest"),
    "blocks_per_chunk": ("int", "blocks", "GPU blocks per offload chunk"),
    "h2d_bytes_per_s": ("float", "bytes/s", "host-to-device bandwidth (the hardware's, after overrides)"),
    "d2h_bytes_per_s": ("float", "bytes/s", "device-to-host bandwidth"),
    "seed": ("int", "-", "the run's seed"),
}

#: identity columns of :func:`sim.load_runs`, :func:`sim.summaries` and ``SweepResults.requests()``
RUN_KEY_DOCS: dict[str, tuple[str, str, str]] = {
    "point": ("int", "-", "sweeps only: the point's index"),
    "run_id": ("str", "-", "the run folder's name (a sweep's point folder name)"),
    "run_dir": ("str", "-", "the run folder as given (sweeps: relative to the sweep folder)"),
    "name": ("str", "-", "load_runs, summaries: the run's name (summary.json run.name)"),
    "run_status": ("str", "-", "request tables: the run's status (ok | failed | interrupted), so partial "
                               "tables of failed runs can be told apart"),
    "status": ("str", "-", "summaries: the run's status (ok | failed | interrupted)"),
    "error": ("str", "-", "summaries: the error of a failed or interrupted run, \"\" when ok"),
}

_ARROW = {"int": pa.int64(), "int?": pa.int64(), "float": pa.float64(), "float?": pa.float64(),
          "str": pa.string(), "str?": pa.string(), "bool": pa.bool_()}
#: top-level keys that never become summary columns
_SKIPPED = ("status", "error", "run", "progress", "rows")
_MISSING = object()


def key_type(name: str) -> Any:
    """The Arrow type of an identity column (:data:`SWEEP_HEAD_DOCS`, :data:`RUN_KEY_DOCS`,
    :data:`RESOLVED_DOCS`)."""
    for docs in (SWEEP_HEAD_DOCS, RUN_KEY_DOCS, RESOLVED_DOCS):
        if name in docs:
            return _ARROW[docs[name][0]]
    raise KeyError(name)


def _name(key: str) -> str:
    return key.replace(".", "_")


def flat_columns() -> dict[str, tuple[str, str, str, str]]:
    """Every column :func:`flat_summary` always gives, in order: name -> (type,
    unit, meaning, the ``summary.json`` key it comes from)."""
    out: dict[str, tuple[str, str, str, str]] = {}
    for key, doc in SUMMARY_KEYS.items():
        if not doc.column:
            continue
        name = _name(key)
        if doc.type == "counts":
            for k in COUNT_NAMES[key]:
                out[f"{name}_{k}"] = ("int", doc.unit, f"{doc.meaning}: {k} (0 when none)", f"{key}.{k}")
        elif doc.type == "list":
            null = "" if doc.absent is not None else "?"
            none = " (0 when none)" if doc.absent is not None else ""
            out[f"{name}_count"] = ("int" + null, "count", f"how many{none}: {doc.meaning}", key)
            out[name] = ("str" + null, "-", f"{doc.meaning}, one per line", key)
        else:
            none = f" ({doc.absent} when none)" if doc.absent is not None else ""
            out[name] = (doc.type, doc.unit, doc.meaning + none, key)
    return out


def _get(data: dict[str, Any], key: str) -> Any:
    value: Any = data
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _put_list(out: dict[str, Any], name: str, items: Any) -> None:
    if items is None:
        out[f"{name}_count"] = out[name] = None
    else:
        seq = items if isinstance(items, list | tuple) else [items]
        out[f"{name}_count"] = len(seq)
        out[name] = "\n".join(str(x) for x in seq)


def _leaves(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in data.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def flat_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """One ``summary.json`` as one row of the summary tables (see the module's
    naming rule). Every column of :func:`flat_columns` is there; keys this
    kvsim does not know (an older or newer summary) follow, by the same rule."""
    out: dict[str, Any] = {}
    counted: set[str] = set()
    for key, doc in SUMMARY_KEYS.items():
        if not doc.column:
            continue
        name = _name(key)
        value = _get(summary, key)
        if doc.type == "counts":
            counts = value if isinstance(value, dict) else {}
            for k in (*COUNT_NAMES[key], *sorted(set(counts) - set(COUNT_NAMES[key]))):
                out[f"{name}_{k}"] = int(counts.get(k, 0))
            counted.add(key)
        elif doc.type == "list":
            _put_list(out, name, doc.absent if value is _MISSING else value)
        else:
            out[name] = doc.absent if value is _MISSING else value
    for key, value in _leaves(summary):
        if (key in SUMMARY_KEYS or key.partition(".")[0] in _SKIPPED
                or any(key.startswith(c + ".") for c in counted)):
            continue
        if isinstance(value, list):
            _put_list(out, _name(key), value)
        elif isinstance(value, dict):   # an empty table
            continue
        else:
            out[_name(key)] = value
    return out


def _loose(values: list[Any]) -> Any:
    """An Arrow column of values of no known type (text where they mix)."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else (v if isinstance(v, str) else json.dumps(v))
                         for v in values], type=pa.string())


def _clean(value: Any) -> Any:
    """NaN (pandas' null) as None."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def summary_arrays(flats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The summary columns of a table (name -> ``pyarrow.Array``) from rows of
    :func:`flat_summary` (``{}`` for a failed run: nulls): the known columns
    first, typed, then the others by name."""
    known = flat_columns()
    extra = sorted({k for f in flats for k in f} - set(known))
    cols: dict[str, Any] = {}
    for name in (*known, *extra):
        values = [_clean(f.get(name)) for f in flats]
        cols[name] = pa.array(values, type=_ARROW[known[name][0]]) if name in known else _loose(values)
    return cols


# -- docs/columns.md -----------------------------------------------------------------------------

_TYPE_OF_TABLE = {"str": "str", "str?": "str (null)", "int": "int", "int?": "int (null)", "float": "float",
                  "float?": "float (null)", "bool": "bool"}

#: what a run must have for an optional table's file to exist
_OPTIONAL_NOTE = {
    "tiers": "Only in a run with secondary tiers (`[[tiers]]`, [docs/tiers.md](tiers.md)): no "
             "`tiers.parquet` otherwise. One row per secondary tier at every occupancy sample (the "
             "`occupancy` table's times).",
}

_HEAD = """\
# Data dictionary: every column, with unit and meaning

Generated by `python -m sim.io.columns` from the descriptions in the code
(`sim/engine/metrics.py` `COLUMN_DOCS`, `sim/io/columns.py` `SUMMARY_KEYS`);
do not edit by hand (`tests/test_columns_doc.py` fails when it is not current).
What the load verdict (`overloaded`, `load_*`) means and when a run's TTFT
can be trusted: [docs/metrics.md](metrics.md).

Units: `s` simulated seconds; `share` a fraction 0..1; `tokens`, `bytes`,
`blocks` (GPU KV blocks), `chunks` (CPU chunk slots), `requests`, `jobs`,
`count`; `-` for ids and text. Types: `str`, `int`, `float`, `bool`; "(null)"
where a value may be missing (Parquet null, pandas NaN/None, empty in CSV).

## Reading results
"""

#: (what, how in Python or on the command line, one row per): the first table of docs/columns.md
_READING = (
    ("a run folder", "`sim.load_results(path)`: `.requests`, `.steps`, `.transfers`, `.occupancy`, "
     "`.events`, `.tiers` (DataFrames; `.tiers` is empty without secondary tiers), `.summary` (dict)",
     "the tables below"),
    ("requests of many runs", "`sim.load_runs([path, ...])`: one DataFrame, the "
     "[run columns](#run-and-point-columns), the [resolved configuration](#resolved-configuration), "
     "then the `requests` columns", "request"),
    ("summaries of many runs", "`sim.summaries([path, ...])`: `run_id`, `run_dir`, `name`, `status`, "
     "`error`, the [resolved configuration](#resolved-configuration), then the "
     "[summary columns](#summary-columns)", "run"),
    ("a sweep", "`sim.load_sweep(path)`: `.table` ([sweep.parquet](#sweepparquet)), `.run(point)` (a point "
     "index, numpy integers included, its index as text, or its run id), `.requests()` (the requests of "
     "every ok point with the point's columns; `include_failed=True` adds failed points' partial tables)",
     "point / request"),
    ("CSV", "`kvsim export FOLDER [--points]` writes `<table>.csv` beside each Parquet file of a run, "
     "compare or sweep folder (`--points`: every sweep point's folder too) and, for a run, `summary.csv` "
     "(one row, as `sim.summaries`); each file is written under a temporary name and renamed",
     "as the Parquet file"),
)


def _row(*cells: str) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def render() -> str:
    """The text of ``docs/columns.md``."""
    lines = [_HEAD, _row("what", "Python", "one row per"), _row("---", "---", "---")]
    lines += [_row(*r) for r in _READING]
    lines.append("")
    lines.append("## Run tables (`<run>/<table>.parquet`)\n")
    for table, cols in TABLES.items():
        lines.append(f"### `{table}`\n")
        if table in OPTIONAL_TABLES:
            lines.append(_OPTIONAL_NOTE[table] + "\n")
        lines.append(_row("column", "type", "unit", "meaning"))
        lines.append(_row("---", "---", "---", "---"))
        for name, kind in cols:
            unit, meaning = COLUMN_DOCS[table][name]
            lines.append(_row(f"`{name}`", _TYPE_OF_TABLE[kind], unit, meaning))
        lines.append("")
    lines.append("## `summary.json`\n")
    lines.append("Keys are dotted here (`ttft_s.p50` is `summary[\"ttft_s\"][\"p50\"]`); the last column "
                 "names the [summary columns](#summary-columns) a key becomes. `counts` is a table of "
                 "name -> count; `list` a list of text.\n")
    lines.append(_row("key", "type", "unit", "meaning", "column(s)"))
    lines.append(_row("---", "---", "---", "---", "---"))
    for key, doc in SUMMARY_KEYS.items():
        name = _name(key)
        if not doc.column:
            where = "-"
        elif doc.type == "counts":
            where = f"`{name}_<name>`"
        elif doc.type == "list":
            where = f"`{name}_count`, `{name}`"
        else:
            where = f"`{name}`"
        lines.append(_row(f"`{key}`", doc.type.replace("?", " (null)"), doc.unit, doc.meaning, where))
    lines.append("")
    lines.append("## `sweep.parquet`\n")
    lines.append("One row per point that ran (ok or failed), in point order. Columns, in this order: the "
                 "head columns, one column per swept key, the "
                 "[resolved configuration](#resolved-configuration), then the "
                 "[summary columns](#summary-columns) (null for failed points).\n")
    lines.append(_row("column", "type", "unit", "meaning"))
    lines.append(_row("---", "---", "---", "---"))
    for name, (tp, unit, meaning) in SWEEP_HEAD_DOCS.items():
        lines.append(_row(f"`{name}`", tp, unit, meaning))
    lines.append(_row("one per swept key", "as given", "-",
                      "named by the dotted key (`cpu_cache.capacity`): the value as written in the sweep "
                      "file (`\"64GiB\"`); a table value as JSON text; a column whose values mix types "
                      "holds their text; null where a point does not name the key. A swept key named like "
                      "a resolved column (`window_logic`, `seed`, a whole `model`, `hardware` or "
                      "`workload` table) has only the resolved column"))
    lines.append("")
    lines.append("Sweep folders written before the columns were renamed (dotted summary columns such "
                 "as `ttft_s.p50`, JSON text for `crashes.kinds`) are read back by `sim.load_sweep` "
                 "with the columns below; rerunning the sweep rewrites the file.\n")
    lines.append("## Resolved configuration\n")
    lines.append("In `sweep.parquet`, `sim.summaries`, `sim.load_runs` and `SweepResults.requests()`; "
                 "a sweep reads them from each point's resolved run, the other tables from each run "
                 "folder's `scenario.toml`.\n")
    lines.append(_row("column", "type", "unit", "meaning"))
    lines.append(_row("---", "---", "---", "---"))
    for name, (tp, unit, meaning) in RESOLVED_DOCS.items():
        lines.append(_row(f"`{name}`", tp, unit, meaning))
    lines.append("")
    lines.append("## Run and point columns\n")
    lines.append("The first columns of `sim.load_runs` (`run_id`, `run_dir`, `name`, `run_status`), "
                 "`SweepResults.requests()` (`point`, `run_id`, `run_dir`, `run_status`, then the swept "
                 "keys) and `sim.summaries` (`run_id`, `run_dir`, `name`, `status`, `error`); each is "
                 "followed by the resolved configuration.\n")
    lines.append(_row("column", "type", "unit", "meaning"))
    lines.append(_row("---", "---", "---", "---"))
    for name, (tp, unit, meaning) in RUN_KEY_DOCS.items():
        lines.append(_row(f"`{name}`", tp, unit, meaning))
    lines.append("")
    lines.append("## Summary columns\n")
    lines.append("`summary.json` flattened, in `sweep.parquet` and `sim.summaries`: the dotted key with "
                 "`_` for `.`; a table of counts becomes one integer column per name (0 when none; the "
                 "names below always have a column, others get one when they occur); a list becomes "
                 "`<name>_count` and `<name>` (the items, one per line). Keys a summary lacks are null "
                 "(an older kvsim) unless said otherwise.\n")
    lines.append(_row("column", "type", "unit", "meaning", "summary.json key"))
    lines.append(_row("---", "---", "---", "---", "---"))
    for name, (tp, unit, meaning, key) in flat_columns().items():
        lines.append(_row(f"`{name}`", tp.replace("?", " (null)"), unit, meaning, f"`{key}`"))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sim.io.columns [--check] [PATH]``: write (or check) ``docs/columns.md``."""
    p = argparse.ArgumentParser(prog="python -m sim.io.columns", description=main.__doc__)
    default = Path(__file__).resolve().parents[2] / "docs" / "columns.md"
    p.add_argument("path", nargs="?", default=str(default), help="the file (default: docs/columns.md)")
    p.add_argument("--check", action="store_true", help="exit 1 when the file is not current")
    args = p.parse_args(argv)
    path = Path(args.path)
    text = render()
    if args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        if current != text:
            print(f"{path} is not current: run python -m sim.io.columns", file=sys.stderr)
            return 1
        return 0
    path.write_text(text, encoding="utf-8")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
