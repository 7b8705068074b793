"""Sweeps: many runs of one base scenario over a grid and/or a list of points.

What it does
    A ``sweep/1`` file is a ``run/1`` scenario (the *base*, every run/1 key,
    inline) plus a ``[sweep]`` section that says which keys vary, and an
    optional ``[smoke]`` section for a quick version of the sweep (CI)::

        schema = "sweep/1"
        name = "cpu-ram"
        ...                          # run/1 keys: the base scenario
        [sweep]
        grid = { "cpu_cache.capacity" = ["0GiB", "64GiB"], "cpu_cache.policy" = ["lru", "arc"] }
        points = [ { "model.name" = "gpt-oss-120b" }, { "model.name" = "gemma-3-27b" } ]
        set = { "workload.limit" = 500 }     # applied to every point after its values
        [smoke]
        points = 3                           # keep 3 evenly spread points (first and last included)
        set = { "workload.limit" = 100 }     # applied after everything else

    Keys are the dotted keys ``kvsim run --set`` accepts. A value is any TOML
    value; a table value replaces the whole table (``workload = { kind =
    "mooncake", path = "..." }``), which is how differently-shaped tables
    (a trace against a generator) are swept. ``grid`` is the cartesian
    product in key order as written (the first key varies slowest); nested
    tables in ``grid`` (``[sweep.grid]`` with unquoted dotted keys) are
    flattened to dotted keys. ``points`` is an explicit list. With both,
    each explicit point is crossed with the whole grid (points outer). The
    order in which one point's values are applied: base file, ``--set``,
    the point's values (its explicit keys, then its grid keys),
    ``sweep.set``, ``smoke.set`` (with ``--smoke``). Paths are relative to
    the sweep file, as in ``run/1``.

    Every point is validated before anything is written (:func:`read_sweep`);
    a problem becomes one :class:`~sim.errors.InputError` naming the file and
    the key (``sweep.grid."cpu_cache.policy"``) and what is allowed.

Running (:func:`run_sweep`)
    Each point is one ordinary run (:func:`sim.io.results.execute`) written to
    ``<out>/points/<NNN>-<slug>/`` through :class:`~sim.io.results.RunWriter`
    (temporary folder, then rename: a folder that exists is complete). The
    backends run the same top-level function :func:`run_point` on plain data:
    a local ``ProcessPoolExecutor`` (spawn; ``jobs = 1`` runs in this process)
    or Ray tasks (``--backend ray``; Ray is imported only there). With Ray
    every task writes its folder itself, so on a multi-node cluster the
    output folder must be on a filesystem every node sees at the same path.

Resume
    A point is *finished* when its folder holds ``summary.json`` with status
    ``ok`` and a ``scenario.toml`` equal to the resolved scenario this sweep
    would run (same text: every default, the kvsim version and the seed).
    A re-run skips finished points; a failed point is run again. A folder
    under ``points/`` that is not a point of this sweep, or whose scenario
    differs, is refused unless ``overwrite`` (then it is replaced or
    removed). Temporary folders left by killed runs are removed at the
    start. Killing the sweep therefore loses at most the points in flight.
    On Ctrl-C (or SIGTERM) the sweep stops submitting, cancels what is
    pending, stops the workers, writes ``sweep.parquet`` for what is done and
    exits 130 (143 on SIGTERM).

``sweep.parquet``
    One row per point that ran (ok or failed), in point order, rewritten
    atomically after every finished point: ``point``, ``run_id``,
    ``run_dir``, ``status``, ``error``, one column per swept key (named by
    its dotted key; values as given, tables as JSON text; a column whose
    values mix types holds their text), the resolved columns of
    :data:`RESOLVED_COLUMNS`, then ``summary.json`` flattened with ``.``
    (``ttft_s.p50``; deeper tables such as ``crashes.kinds`` and lists as
    JSON text; null for failed points). No wall-clock values: the same sweep
    gives a byte-identical file (wall time stays in each ``run_info.json``).
    A swept key named like a resolved column (``window_logic``, ``seed``,
    ``model``, ``hardware``, ``workload``) has one column, the resolved one.

Invariants
    * bad input (file, values, options) writes nothing;
    * ``points/`` holds only complete run folders once a sweep has started;
    * the table depends only on the sweep definition and the run folders.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sim.errors import InputError
from sim.io.results import RunWriter, write_text_atomic
from sim.io.scenario import (
    MooncakeWorkload,
    RunSpec,
    _check_schema,
    apply_overrides,
    build_run,
    kvsim_version,
    located,
    read_toml,
)

if TYPE_CHECKING:
    from sim.io.results import RunResults

__all__ = [
    "HEAD_COLUMNS",
    "RESOLVED_COLUMNS",
    "Sweep",
    "SweepPoint",
    "SweepReport",
    "SweepResults",
    "add_sweep_parser",
    "describe_sweep",
    "load_sweep",
    "read_sweep",
    "run_point",
    "run_sweep",
]

#: columns every sweep table has, resolved from each point's scenario
RESOLVED_COLUMNS = ("model", "hardware", "workload", "cpu_cache_bytes", "cpu_cache_policy", "window_logic",
                    "blocks_per_chunk", "h2d_bytes_per_s", "d2h_bytes_per_s", "seed")
HEAD_COLUMNS = ("point", "run_id", "run_dir", "status", "error")
#: keys a sweep may not vary (the point's name is its run id)
_FIXED_KEYS = ("schema", "name", "kvsim_version")
#: keys (and tables holding such a key) whose values are paths relative to the sweep file
_PATH_KEYS = {"workload": "path", "model": "path", "hardware": "profile"}
_TMP_RE = re.compile(r"^\..+\.(tmp|old)-\d+$")
_PARQUET_OPTIONS: dict[str, Any] = {"compression": "zstd", "compression_level": 3, "use_dictionary": True,
                                    "write_statistics": True, "write_page_index": False}


# -- the file ---------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class SweepSection(_Strict):
    """``[sweep]``: what varies."""

    grid: dict[str, Any] | None = Field(default=None, description="dotted key -> list of values (product)")
    points: list[dict[str, Any]] | None = Field(default=None, min_length=1,
                                                description="explicit points: {dotted key = value}")
    set_: dict[str, Any] = Field(default_factory=dict, alias="set",
                                 description="dotted key -> value applied to every point after its values")


class SmokeSection(_Strict):
    """``[smoke]``: the quick version (``kvsim sweep --smoke``)."""

    points: int | None = Field(default=None, gt=0, description="evenly spread points kept (default: all)")
    set_: dict[str, Any] = Field(default_factory=dict, alias="set",
                                 description="dotted key -> value applied to every point last")


@dataclass(frozen=True)
class SweepPoint:
    """One point of a sweep.

    Attributes:
        index: its position in the full sweep (``NNN`` of the folder).
        run_id: the folder name under ``points/`` (also the run's ``name``).
        values: swept key -> value as given in the file.
        data: the raw ``run/1`` data of the point (validated).
        spec: the resolved run.
        resolved_toml: the resolved scenario (the resume check compares it).
    """

    index: int
    run_id: str
    values: dict[str, Any]
    data: dict[str, Any]
    spec: RunSpec
    resolved_toml: str

    def resolved_columns(self) -> dict[str, Any]:
        """The values of :data:`RESOLVED_COLUMNS` for this point."""
        spec = self.spec
        sc = spec.scenario
        wl = sc.workload
        workload = Path(wl.path).name if isinstance(wl, MooncakeWorkload) else wl.kind
        return {"model": spec.model.label, "hardware": spec.hardware.name, "workload": workload,
                "cpu_cache_bytes": spec.cpu_cache_bytes, "cpu_cache_policy": sc.cpu_cache.policy,
                "window_logic": sc.window_logic, "blocks_per_chunk": sc.scheduler.blocks_per_chunk,
                "h2d_bytes_per_s": float(spec.hardware.h2d_bandwidth),
                "d2h_bytes_per_s": float(spec.hardware.d2h_bandwidth), "seed": sc.seed}


@dataclass(frozen=True)
class Sweep:
    """A validated sweep.

    Attributes:
        source: the sweep file.
        name: the sweep's name (``name``, else the file stem).
        keys: the swept keys that have their own column (in column order).
        swept: every swept key, in order.
        points: the points to run (all, or the smoke selection).
        total: the number of points of the full sweep.
        smoke: whether ``--smoke`` selected and shrank them.
        text: the resolved sweep (``sweep.toml``).
    """

    source: Path
    name: str
    keys: tuple[str, ...]
    swept: tuple[str, ...]
    points: tuple[SweepPoint, ...]
    total: int
    smoke: bool
    text: str


def _q(key: str) -> str:
    return f'"{key}"' if "." in key else key


def _flatten_grid(grid: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in grid.items():
        if isinstance(v, dict):
            yield from _flatten_grid(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _check_key(key: str, where: str, source: str) -> None:
    if key.partition(".")[0] in _FIXED_KEYS:
        raise InputError(source, where, f"{key!r} cannot be swept",
                         "any other run/1 key (a point's name is its run id)")


def _text(value: Any) -> str:
    """A value as one short token (for slugs and the printed table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        for k in ("name", "label", "profile"):
            if isinstance(value.get(k), str):
                return Path(value[k]).stem
        if isinstance(value.get("path"), str):
            return Path(value["path"]).stem
        if isinstance(value.get("kind"), str):
            return str(value["kind"])
        return "table"
    if isinstance(value, list):
        return "list"
    return str(value)


def _slug(values: dict[str, Any]) -> str:
    parts = [f"{k.rpartition('.')[2]}_{_text(v)}" for k, v in values.items()]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts)).strip("_.-")
    return slug[:80].rstrip("_.-") or "point"


def _spread(n: int, k: int) -> list[int]:
    """``k`` evenly spread indices of ``range(n)``, first and last included."""
    if k >= n:
        return list(range(n))
    if k == 1:
        return [0]
    return [i * (n - 1) // (k - 1) for i in range(k)]


def _set_key(data: dict[str, Any], key: str, value: Any, source: str, where: str) -> None:
    """Set a dotted key (checked like ``--set``) to a TOML value; a table replaces the table."""
    try:
        apply_overrides(data, [(source, f"{key}=0")])
    except InputError as exc:
        raise InputError(source, where, f"{exc.problem} ({exc.key})", exc.allowed) from None
    parts = key.split(".")
    table = data
    for part in parts[:-1]:
        table = table[part]
    table[parts[-1]] = copy.deepcopy(value)


def _absolute(key: str, value: Any, base: Path) -> Any:
    """A value with its paths relative to the sweep file made absolute (for ``sweep.toml``)."""
    section, _, leaf = key.partition(".")
    if isinstance(value, dict) and not leaf and section in _PATH_KEYS:
        name = _PATH_KEYS[section]
        if isinstance(value.get(name), str):
            return {**value, name: _absolute(f"{section}.{name}", value[name], base)}
        return value
    if isinstance(value, str) and _PATH_KEYS.get(section) == leaf:
        if section == "hardware" and "/" not in value and not value.endswith(".toml"):
            return value  # a shipped profile name
        return str((base / value).resolve())
    return value


def read_sweep(path: str | Path, overrides: Sequence[str | tuple[str, str]] = (),
               smoke: bool = False) -> Sweep:
    """Read a ``sweep/1`` file, expand and validate every point.

    Args:
        path: the sweep file.
        overrides: ``--set`` items applied to the base (``"key=value"`` or
            ``(option, "key=value")``); a swept key cannot be overridden.
        smoke: keep the ``[smoke]`` selection and apply its ``set``.

    Raises:
        InputError: anything wrong in the file, a point, or the overrides.
    """
    import tomli_w

    p = Path(path)
    source = str(p)
    if smoke:
        read_sweep(p, overrides)  # every point of the full sweep is valid, not only the smoke selection
    data = read_toml(p)
    _check_schema(data, source, "sweep/1")
    raw_sweep = data.pop("sweep", None)
    raw_smoke = data.pop("smoke", None)
    data.pop("resolved", None)  # written by kvsim into sweep.toml, informational
    if not isinstance(raw_sweep, dict):
        raise InputError(source, "sweep", "required table missing" if raw_sweep is None else "not a table",
                         "a [sweep] table with grid and/or points")
    sec = _model(SweepSection, raw_sweep, source, "sweep.")
    sm = _model(SmokeSection, raw_smoke if raw_smoke is not None else {}, source, "smoke.")
    if sec.grid is None and sec.points is None:
        raise InputError(source, "sweep", "neither grid nor points given", "grid and/or points")
    grid: list[tuple[str, list[Any]]] = []
    for key, values in _flatten_grid(sec.grid or {}):
        where = f"sweep.grid.{_q(key)}"
        _check_key(key, where, source)
        if not isinstance(values, list) or not values:
            raise InputError(source, where, f"{values!r} is not a list of values",
                             'a non-empty list, e.g. ["64GiB", "128GiB"]')
        seen: set[str] = set()
        for v in values:
            tag = json.dumps(v, sort_keys=True, default=str)
            if tag in seen:
                raise InputError(source, where, f"{v!r} appears twice", "distinct values")
            seen.add(tag)
        grid.append((key, values))
    grid_keys = [k for k, _ in grid]
    explicit = sec.points if sec.points is not None else [{}]
    for i, point in enumerate(sec.points or []):
        for key in point:
            _check_key(key, f"sweep.points[{i}].{_q(key)}", source)
            if key in grid_keys:
                raise InputError(source, f"sweep.points[{i}].{_q(key)}", "also a key of sweep.grid",
                                 "each key in either grid or points")
    for key in (*sec.set_, *(sm.set_ if smoke else {})):
        _check_key(key, key, source)

    # the base, with --set applied
    base = {**data, "schema": "run/1"}
    touched = apply_overrides(base, overrides)
    swept = list(dict.fromkeys([k for pt in explicit for k in pt] + grid_keys))
    for key, option in touched.items():
        hit = [k for k in swept if k == key or k.startswith(key + ".") or key.startswith(k + ".")]
        if hit:
            raise InputError(option, key, f"swept by the sweep ({hit[0]})", "a key the sweep does not vary")

    combos: list[tuple[dict[str, Any], dict[str, str]]] = []
    for i, point in enumerate(explicit):
        for row in _product(grid):
            values = {**point, **row}
            origin = {k: (f"sweep.points[{i}].{_q(k)}" if k in point else f"sweep.grid.{_q(k)}")
                      for k in values}
            combos.append((values, origin))
    total = len(combos)
    keep = _spread(total, sm.points or total) if smoke else list(range(total))
    width = max(3, len(str(total - 1)))
    points = []
    for index in keep:
        values, origin = combos[index]
        run_id = f"{index:0{width}d}-{_slug(values)}"
        d = copy.deepcopy(base)
        for key, value in values.items():
            _set_key(d, key, value, source, origin[key])
        for key, value in sec.set_.items():
            _set_key(d, key, value, source, f"sweep.set.{_q(key)}")
        if smoke:
            for key, value in sm.set_.items():
                _set_key(d, key, value, source, f"smoke.set.{_q(key)}")
        d["name"] = run_id
        spec = _build_point(d, p, touched, values, origin, index)
        points.append(SweepPoint(index, run_id, values, d, spec, spec.resolved_toml()))
    name = data.get("name", p.stem)
    if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name):
        raise InputError(source, "name", f"{name!r} is invalid",
                         "letters, digits, '.', '_', '-', starting with a letter or digit")
    keys = tuple(k for k in swept if k not in RESOLVED_COLUMNS)
    folder = p.resolve().parent
    resolved_base = {k: v for k, v in base.items() if k != "schema"}
    for section, leaf in _PATH_KEYS.items():
        table = resolved_base.get(section)
        if isinstance(table, dict) and isinstance(table.get(leaf), str):
            resolved_base[section] = {**table, leaf: _absolute(f"{section}.{leaf}", table[leaf], folder)}
    doc: dict[str, Any] = {"schema": "sweep/1", **resolved_base}
    sweep_doc: dict[str, Any] = {}
    if sec.grid is not None:
        sweep_doc["grid"] = {k: [_absolute(k, v, folder) for v in vs] for k, vs in grid}
    if sec.points is not None:
        sweep_doc["points"] = [{k: _absolute(k, v, folder) for k, v in pt.items()} for pt in sec.points]
    if sec.set_:
        sweep_doc["set"] = dict(sec.set_)
    doc["sweep"] = sweep_doc
    if raw_smoke is not None:
        doc["smoke"] = raw_smoke
    doc["resolved"] = {"source": str(p.resolve()), "smoke": smoke, "kvsim_version": kvsim_version(),
                       "points": [{"point": pt.index, "run_id": pt.run_id} for pt in points]}
    head = ("# The sweep as run by kvsim sweep (base with --set applied, paths absolute); "
            "[resolved] is informational.\n")
    return Sweep(source=p, name=str(name), keys=keys, swept=tuple(swept), points=tuple(points), total=total,
                 smoke=smoke, text=head + tomli_w.dumps(doc))


def _model(cls: type[SweepSection] | type[SmokeSection], raw: Any, source: str, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise InputError(source, prefix.rstrip("."), "not a table", "a table")
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise located(exc, source, cls, prefix) from None


def _product(grid: list[tuple[str, list[Any]]]) -> Iterator[dict[str, Any]]:
    import itertools

    keys = [k for k, _ in grid]
    for combo in itertools.product(*(vs for _, vs in grid)):
        yield dict(zip(keys, combo, strict=True))


def _build_point(data: dict[str, Any], path: Path, touched: dict[str, str], values: dict[str, Any],
                 where: dict[str, str], index: int) -> RunSpec:
    source = str(path)
    try:
        return build_run(data, path, touched)
    except InputError as exc:
        if exc.source != source:
            raise
        shown = ", ".join(f"{k} = {json.dumps(v, default=str)}" for k, v in values.items())
        owner = next((k for k in values if exc.key == k or exc.key.startswith(k + ".")
                      or k.startswith(exc.key + ".")), None)
        if owner is not None:
            raise InputError(source, where[owner], f"{exc.problem} (point {index}: {exc.key})",
                             exc.allowed) from None
        raise InputError(source, exc.key, f"{exc.problem} (point {index}: {shown})", exc.allowed) from None


def describe_sweep(path: Path) -> str:
    """One line for ``kvsim validate``: the sweep's size and what varies (every point validated)."""
    full = read_sweep(path)
    smoke = read_toml(path).get("smoke")
    extra = ""
    if isinstance(smoke, dict):
        picked = _spread(full.total, int(smoke.get("points") or full.total))
        extra = f"; smoke: {len(picked)} points"
    keys = ", ".join(full.swept)
    return f"sweep/1: {full.name!r}, {full.total} points over {keys or 'nothing'}{extra}"


# -- one point ----------------------------------------------------------------------------------


class _GuardedWriter(RunWriter):
    """A writer that will not publish a folder once its sweep process is gone
    (a worker orphaned by a killed sweep must not race the next sweep)."""

    def __init__(self, target: Path, parent_pid: int | None) -> None:
        super().__init__(target, overwrite=True)
        self.parent_pid = parent_pid

    def finish(self, status: str, summary: dict[str, Any], scenario_toml: str,
               run_info: dict[str, Any]) -> Path:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            self.abort()
            raise SystemExit(1)
        return super().finish(status, summary, scenario_toml, run_info)


def run_point(task: dict[str, Any]) -> dict[str, Any]:
    """Run one point and write its folder; return ``{"index", "status", "error"}``.

    Plain data in and out, so that any backend can call it (a process pool
    in spawn mode, a Ray task). ``task``: ``index``, ``source`` (the sweep
    file, absolute), ``data`` (the point's raw ``run/1`` data), ``target``
    (its folder, absolute), ``parent_pid`` (the sweep process, or None) and
    ``argv``. Bad input found while running (a bad trace line) and any
    exception become a failed point with its folder (``summary.json`` status
    ``"failed"``), never an exception.
    """
    import traceback

    from sim.io.results import execute

    index = int(task["index"])
    target = Path(task["target"])
    parent = task.get("parent_pid")
    spec: RunSpec | None = None
    try:
        spec = build_run(copy.deepcopy(task["data"]), Path(task["source"]))
        outcome = execute(spec, _GuardedWriter(target, parent), argv=list(task["argv"]))
        return {"index": index, "status": outcome.status,
                "error": "" if outcome.status == "ok" else str(outcome.summary.get("error", ""))}
    except Exception as exc:
        error = str(exc) if isinstance(exc, InputError) else traceback.format_exception_only(exc)[-1].strip()
        writer = _GuardedWriter(target, parent)
        scenario = spec.resolved_toml() if spec is not None else ""
        writer.finish("failed", {"error": error, "run": {"name": target.name}}, scenario,
                      {"argv": list(task["argv"]), "pid": os.getpid()})
        return {"index": index, "status": "failed", "error": error}


def _worker_init() -> None:
    """Pool workers leave Ctrl-C to the sweep process and die with it (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# -- the table ------------------------------------------------------------------------------------


def _flat(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` flattened one level (``ttft_s.p50``); deeper tables and lists as JSON."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        if key in ("status", "error", "run"):
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                out[f"{key}.{k}"] = json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else v
        elif isinstance(value, list):
            out[key] = json.dumps(value, sort_keys=True)
        else:
            out[key] = value
    return out


def _cell(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else value


def _column(values: list[Any]) -> Any:
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else (v if isinstance(v, str) else json.dumps(v))
                         for v in values], type=pa.string())


def build_table(sweep: Sweep, done: dict[int, dict[str, Any]]) -> Any:
    """The sweep table (a ``pyarrow.Table``) of the points in ``done`` (index -> summary), in point order."""
    import pyarrow as pa

    rows = [(pt, done[pt.index]) for pt in sweep.points if pt.index in done]
    flats = [_flat(s) if s.get("status") == "ok" else {} for _, s in rows]
    ok = [s.get("status") == "ok" for _, s in rows]
    cols: dict[str, Any] = {
        "point": pa.array([pt.index for pt, _ in rows], type=pa.int64()),
        "run_id": pa.array([pt.run_id for pt, _ in rows], type=pa.string()),
        "run_dir": pa.array([f"points/{pt.run_id}" for pt, _ in rows], type=pa.string()),
        "status": pa.array(["ok" if good else "failed" for good in ok], type=pa.string()),
        "error": pa.array(["" if good else str(s.get("error") or "failed") for good, (_, s) in zip(ok, rows,
                                                                                                   strict=True)],
                          type=pa.string()),
    }
    for key in sweep.keys:
        cols[key] = _column([_cell(pt.values.get(key)) for pt, _ in rows])
    resolved = [pt.resolved_columns() for pt, _ in rows]
    types = {"cpu_cache_bytes": pa.int64(), "blocks_per_chunk": pa.int64(), "seed": pa.int64(),
             "h2d_bytes_per_s": pa.float64(), "d2h_bytes_per_s": pa.float64()}
    for key in RESOLVED_COLUMNS:
        cols[key] = pa.array([r[key] for r in resolved], type=types.get(key, pa.string()))
    for key in sorted({k for f in flats for k in f}):
        name = key if key not in cols else f"summary.{key}"
        cols[name] = _column([f.get(key) for f in flats])
    return pa.table(cols)


def write_table(sweep: Sweep, done: dict[int, dict[str, Any]], out: Path) -> Path:
    """Write ``sweep.parquet`` atomically (deterministic bytes)."""
    import pyarrow.parquet as pq

    path = out / "sweep.parquet"
    tmp = out / f".sweep.parquet.tmp-{os.getpid()}"
    try:
        pq.write_table(build_table(sweep, done), tmp, **_PARQUET_OPTIONS)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# -- running ----------------------------------------------------------------------------------------


@dataclass
class SweepReport:
    """What :func:`run_sweep` did.

    Attributes:
        out: the sweep folder.
        skipped: points finished by an earlier run (not run again).
        ran: points run now (finished, ok or failed).
        failed: run ids of failed points (in the table).
        interrupted: the signal number that stopped the sweep, or None.
        summaries: point index -> ``summary.json`` of every point in the table.
    """

    out: Path
    skipped: int = 0
    ran: int = 0
    failed: list[str] = field(default_factory=list)
    interrupted: int | None = None
    summaries: dict[int, dict[str, Any]] = field(default_factory=dict)


class _Stopped(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _read_summary(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _survey(sweep: Sweep, out: Path, overwrite: bool) -> tuple[dict[int, dict[str, Any]], list[Path]]:
    """Finished points (index -> summary) and folders to remove; refuses a folder that does not match."""
    points_dir = out / "points"
    finished: dict[int, dict[str, Any]] = {}
    stale: list[Path] = []
    if out.exists() and not out.is_dir():
        raise InputError(str(out), "", "exists and is not a folder", "a new folder or a sweep folder")
    by_id = {pt.run_id: pt for pt in sweep.points}
    if not points_dir.is_dir():
        return finished, stale
    mismatched: list[str] = []
    for entry in sorted(points_dir.iterdir()):
        if entry.name.startswith("."):
            continue
        pt = by_id.get(entry.name)
        summary = _read_summary(entry) if entry.is_dir() else None
        if pt is None:
            if not sweep.smoke or not entry.is_dir():
                mismatched.append(f"{entry.name} is not a point of this sweep")
                stale.append(entry)
            continue  # --smoke runs a subset: the others' folders are kept
        if summary is None or summary.get("status") != "ok":
            continue  # failed or unreadable: run again (replaced)
        try:
            text = (entry / "scenario.toml").read_text(encoding="utf-8")
        except OSError:
            text = ""
        if text == pt.resolved_toml:
            finished[pt.index] = summary
        else:
            mismatched.append(f"{entry.name} ran a different scenario")
    if mismatched and not overwrite:
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise InputError(str(out), "", f"the sweep changed: points/{mismatched[0]}{more}",
                         "the same sweep definition, another --out, or --overwrite")
    return finished, stale


def _clean_tmp(out: Path) -> None:
    """Remove temporary folders and files left by killed runs."""
    for folder in (out, out / "points"):
        if folder.is_dir():
            for entry in folder.iterdir():
                if _TMP_RE.match(entry.name):
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)


def run_sweep(sweep: Sweep, out: Path, *, jobs: int | None = None, backend: str = "local",
              address: str | None = None, overwrite: bool = False,
              progress: Callable[[int, int], None] | None = None,
              on_start: Callable[[int, int], None] | None = None,
              argv: Sequence[str] = ()) -> SweepReport:
    """Run the points of ``sweep`` that are not finished in ``out``; write ``sweep.parquet``.

    Args:
        sweep: from :func:`read_sweep`.
        out: the sweep folder (``sweep.toml``, ``points/``, ``sweep.parquet``).
        jobs: parallel points (default: CPU count; Ray: the cluster decides).
        backend: ``"local"`` (process pool) or ``"ray"``.
        address: a Ray cluster to join (``ray start --head`` printed it).
        overwrite: replace point folders that do not match this sweep.
        progress: called with (points done now, points to run) after each point.
        on_start: called once with (points skipped, points to run).
        argv: the command line, for each ``run_info.json``.

    Returns:
        The report; ``interrupted`` is set when Ctrl-C or SIGTERM stopped it.

    Raises:
        InputError: bad options, Ray missing, or a folder that does not match.
    """
    if backend not in ("local", "ray"):
        raise InputError("argument", "--backend", f"{backend!r}", "local, ray")
    if jobs is not None and jobs < 1:
        raise InputError("argument", "--jobs", f"{jobs}", "an integer >= 1")
    if address is not None and backend != "ray":
        raise InputError("argument", "--address", "only with --backend ray", "--backend ray --address ADDR")
    ray = _import_ray() if backend == "ray" else None
    out = Path(out).resolve()
    finished, stale = _survey(sweep, out, overwrite)
    (out / "points").mkdir(parents=True, exist_ok=True)
    _clean_tmp(out)
    for entry in stale:
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    write_text_atomic(out / "sweep.toml", sweep.text)
    report = SweepReport(out=out, skipped=len(finished))
    report.summaries.update(finished)
    todo = [pt for pt in sweep.points if pt.index not in finished]
    if on_start is not None:
        on_start(len(finished), len(todo))
    write_table(sweep, report.summaries, out)
    tasks = [{"index": pt.index, "source": str(sweep.source.resolve()), "data": pt.data,
              "target": str(out / "points" / pt.run_id), "argv": list(argv)} for pt in todo]

    def done(result: dict[str, Any]) -> None:
        index = int(result["index"])
        pt = next(p for p in todo if p.index == index)
        summary = _read_summary(out / "points" / pt.run_id) or {}
        if result["status"] != "ok":
            summary = {**summary, "status": "failed", "error": summary.get("error") or result["error"]}
        report.summaries[index] = summary
        report.ran += 1
        write_table(sweep, report.summaries, out)
        if progress is not None:
            progress(report.ran, len(todo))

    previous = signal.getsignal(signal.SIGTERM)
    main_thread = _is_main_thread()
    if main_thread:
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if ray is not None:
            _run_ray(ray, tasks, jobs, address, done)
        elif (jobs or os.cpu_count() or 1) <= 1 or len(tasks) <= 1:
            _run_here(tasks, done)
        else:
            _run_pool(tasks, min(jobs or os.cpu_count() or 1, len(tasks)), done)
    except KeyboardInterrupt as exc:
        report.interrupted = exc.signum if isinstance(exc, _Stopped) else signal.SIGINT
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    write_table(sweep, report.summaries, out)
    report.failed = [pt.run_id for pt in sweep.points
                     if pt.index in report.summaries and report.summaries[pt.index].get("status") != "ok"]
    return report


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def _run_here(tasks: list[dict[str, Any]], done: Callable[[dict[str, Any]], None]) -> None:
    for task in tasks:
        try:
            result = run_point({**task, "parent_pid": None})
        except KeyboardInterrupt:
            # execute() left a "failed" folder for the interrupted point: it did not finish
            shutil.rmtree(task["target"], ignore_errors=True)
            raise
        done(result)


def _run_pool(tasks: list[dict[str, Any]], jobs: int, done: Callable[[dict[str, Any]], None]) -> None:
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init)
    me = os.getpid()
    futures: dict[Future[dict[str, Any]], dict[str, Any]] = {}
    try:
        for task in tasks:
            futures[pool.submit(run_point, {**task, "parent_pid": me})] = task
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in sorted(finished, key=lambda f: int(futures[f]["index"])):
                try:
                    result = fut.result()
                except Exception as exc:  # the worker died (killed, out of memory)
                    result = {"index": futures[fut]["index"], "status": "failed",
                              "error": f"worker process failed: {exc!r}"}
                done(result)
    except BaseException:
        for fut in futures:
            fut.cancel()
        for proc in list(getattr(pool, "_processes", {}).values()):
            with contextlib.suppress(Exception):
                proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InputError("argument", "--backend", "ray is not installed",
                         "pip install 'kvsim[ray]', or --backend local") from None
    return ray


def _run_ray(ray: Any, tasks: list[dict[str, Any]], jobs: int | None, address: str | None,
             done: Callable[[dict[str, Any]], None]) -> None:
    import logging

    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        kwargs["address"] = address
    else:
        kwargs["include_dashboard"] = False
        if jobs is not None:
            kwargs["num_cpus"] = jobs
    owned = not ray.is_initialized()  # a caller's own ray.init() session is used and left running
    if owned:
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InputError("argument", "--address", f"cannot join the Ray cluster {address!r}: {exc}",
                             "the address printed by `ray start --head`, e.g. 127.0.0.1:6379") from None
    remote = ray.remote(num_cpus=1, max_retries=0)(run_point)
    limit = jobs or len(tasks) or 1
    queue = list(tasks)
    running: dict[Any, dict[str, Any]] = {}
    try:
        while queue or running:
            while queue and len(running) < limit:
                task = queue.pop(0)
                running[remote.remote({**task, "parent_pid": None})] = task
            ready, _ = ray.wait(list(running), num_returns=1)
            for ref in ready:
                task = running.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as exc:  # the task or its worker died
                    result = {"index": task["index"], "status": "failed", "error": f"ray task failed: {exc}"}
                done(result)
    except BaseException:
        for ref in running:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        raise
    finally:
        if owned:
            ray.shutdown()


# -- reading a sweep back -------------------------------------------------------------------------


@dataclass
class SweepResults:
    """A sweep folder read back.

    Attributes:
        path: the sweep folder.
        table: ``sweep.parquet`` as a pandas DataFrame (one row per point).
        spec: ``sweep.toml``, parsed.
    """

    path: Path
    table: Any
    spec: dict[str, Any]

    def run(self, which: str | int) -> RunResults:
        """One point's run folder (:func:`sim.load_results`), by run id or point index.

        Raises:
            KeyError: no such point in the table.
        """
        from sim.io.results import load_results

        t = self.table
        rows = t[t["point"] == which] if isinstance(which, int) else t[t["run_id"] == which]
        if len(rows) != 1:
            raise KeyError(f"no point {which!r} in {self.path / 'sweep.parquet'}")
        return load_results(self.path / str(rows["run_dir"].iloc[0]))


def load_sweep(path: str | Path) -> SweepResults:
    """Read a sweep folder written by ``kvsim sweep`` (or its ``sweep.parquet``).

    Raises:
        InputError: no ``sweep.parquet`` there.
    """
    import tomllib

    import pyarrow.parquet as pq

    folder = Path(path)
    if folder.is_file() and folder.name == "sweep.parquet":
        folder = folder.parent
    table_file = folder / "sweep.parquet"
    if not table_file.is_file():
        raise InputError(str(folder), "", "not a sweep folder (no sweep.parquet)",
                         "a folder written by kvsim sweep")
    spec_file = folder / "sweep.toml"
    spec = tomllib.loads(spec_file.read_text(encoding="utf-8")) if spec_file.is_file() else {}
    return SweepResults(path=folder, table=pq.read_table(table_file).to_pandas(), spec=spec)


# -- command line ---------------------------------------------------------------------------------


def add_sweep_parser(sub: Any) -> None:
    """``kvsim sweep FILE``: run a sweep/1 file."""
    from sim.cli import add_override_options

    p = sub.add_parser("sweep", help="run a sweep (sweep/1 file): many runs, resumable, one table")
    p.add_argument("file", metavar="FILE", help="sweep/1 TOML")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="points in parallel (default: CPU count; with Ray: as the cluster allows)")
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local processes (default) or Ray tasks")
    p.add_argument("--address", metavar="ADDR", help="join this Ray cluster (with --backend ray)")
    p.add_argument("--out", metavar="DIR", help="the sweep folder (default: results/<name>, --smoke: "
                   "results/<name>-smoke)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace point folders that no longer match the sweep")
    p.add_argument("--smoke", action="store_true", help="the [smoke] version: few points, small runs")
    add_override_options(p, "a key of the base scenario", seed=False)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Exit 0 when every point ran ok, 1 when a point failed, 130 on Ctrl-C (143 on SIGTERM)."""
    if args.jobs is not None and args.jobs < 1:
        raise InputError("argument", "--jobs", f"{args.jobs}", "an integer >= 1")
    if args.address is not None and args.backend != "ray":
        raise InputError("argument", "--address", "only with --backend ray", "--backend ray --address ADDR")
    if args.backend == "ray":
        _import_ray()
    sweep = read_sweep(Path(args.file), args.overrides or [], smoke=args.smoke)
    out = Path(args.out) if args.out else Path("results") / (sweep.name + ("-smoke" if args.smoke else ""))
    quiet = args.quiet or not sys.stderr.isatty()
    bar: Any = None

    def on_start(skipped: int, todo: int) -> None:
        nonlocal bar
        where = f"Ray{' at ' + args.address if args.address else ''}" if args.backend == "ray" else "local"
        print(f"kvsim sweep: {len(sweep.points)} points{' (smoke)' if sweep.smoke else ''}: "
              f"{skipped} skipped (finished earlier), {todo} to run ({where}) -> {out}", file=sys.stderr)
        if not quiet and todo:
            from tqdm import tqdm

            bar = tqdm(total=todo, unit="pt", desc=sweep.name, file=sys.stderr, dynamic_ncols=True)

    def progress(n: int, total: int) -> None:
        if bar is not None:
            bar.update(n - bar.n)

    try:
        report = run_sweep(sweep, out, jobs=args.jobs, backend=args.backend, address=args.address,
                           overwrite=args.overwrite, progress=progress, on_start=on_start, argv=sys.argv)
    finally:
        if bar is not None:
            bar.close()
    print(format_table(sweep, report))
    if report.interrupted is not None:
        print(f"kvsim sweep: interrupted; {len(report.summaries)} of {len(sweep.points)} points in "
              f"{report.out / 'sweep.parquet'}; run the same command again to finish", file=sys.stderr)
        return 128 + int(report.interrupted)
    if report.failed:
        print(f"kvsim sweep: {len(report.failed)} point(s) failed: {', '.join(report.failed[:5])}"
              f"{' ...' if len(report.failed) > 5 else ''}", file=sys.stderr)
        return 1
    return 0


def format_table(sweep: Sweep, report: SweepReport) -> str:
    """The points as plain aligned text: point, parameters, status, CPU hit rate, TTFT p50."""
    head = ["point", *sweep.swept, "status", "cpu hit", "ttft p50"]
    rows = [head]
    for pt in sweep.points:
        s = report.summaries.get(pt.index)
        if s is None:
            status, hit, ttft = "not run", "-", "-"
        elif s.get("status") != "ok":
            status, hit, ttft = "FAILED", "-", "-"
        else:
            rate = s.get("cpu_hit_rate")
            p50 = (s.get("ttft_s") or {}).get("p50")
            status = "ok"
            hit = "-" if rate is None else f"{100 * rate:.1f}%"
            ttft = "-" if p50 is None else f"{1000 * p50:.1f} ms"
        rows.append([str(pt.index), *(_text(pt.values.get(k, "")) for k in sweep.swept), status, hit, ttft])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines) + f"\nresults  {report.out}"
