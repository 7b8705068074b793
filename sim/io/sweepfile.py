"""The ``sweep/1`` format: a base ``run/1`` scenario plus the keys that vary.

Parsing and validation only (the runner is :mod:`sim.tools.sweep`; the
format is documented in ``docs/sweeps.md``). :func:`read_sweep` expands the
grid and/or point list into :class:`SweepPoint` objects, each a validated
:class:`~sim.io.scenario.RunSpec`; every point is validated up front, so a
bad value anywhere is one ``InputError`` line before anything runs.

Besides each point's own validation, a sweep is refused when it would run
the same thing twice or nothing at all: an empty ``grid``; two values of a
grid key that are equal (after unit parsing for sizes and bandwidths:
``"1GiB"``, ``"1024MiB"`` and ``1073741824`` are one value); two ``points``
that are equal (the same way); two points that resolve to the same run.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import Field, ValidationError

from sim.errors import InputError
from sim.io.scenario import (
    MooncakeWorkload,
    RunSpec,
    apply_overrides,
    build_run,
    kvsim_version,
    located,
    read_toml,
    unit_parser,
)
from sim.io.schema import Strict, check_schema

__all__ = ["SmokeSection", "Sweep", "SweepPoint", "SweepSection", "describe_sweep", "read_sweep", "spread"]

#: keys a sweep may not vary (the point's name is its run id)
_FIXED_KEYS = ("schema", "name", "kvsim_version")
#: keys (and tables holding such a key) whose values are paths relative to the sweep file
_PATH_KEYS = {"workload": "path", "model": "path", "hardware": "profile"}


#: columns every sweep table has, resolved from each point's scenario
RESOLVED_COLUMNS = ("model", "hardware", "workload", "cpu_cache_bytes", "cpu_cache_policy", "window_logic",
                    "blocks_per_chunk", "h2d_bytes_per_s", "d2h_bytes_per_s", "seed")
HEAD_COLUMNS = ("point", "run_id", "run_dir", "status", "error")


class SweepSection(Strict):
    """``[sweep]``: what varies."""

    grid: dict[str, Any] | None = Field(default=None, description="dotted key -> list of values (product)")
    points: list[dict[str, Any]] | None = Field(default=None, min_length=1,
                                                description="explicit points: {dotted key = value}")
    set_: dict[str, Any] = Field(default_factory=dict, alias="set",
                                 description="dotted key -> value applied to every point after its values")


class SmokeSection(Strict):
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
        workload = (wl.trace or Path(wl.path or "").name) if isinstance(wl, MooncakeWorkload) else wl.kind
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


def _normal(key: str, value: Any) -> Any:
    """A swept value as the run sees it, for finding repeats: sizes and
    bandwidths in bytes; anything else (or a value that does not parse) as given."""
    parse = unit_parser(key)
    if parse is not None:
        try:
            return parse(value)
        except ValueError:
            return value
    return value


def _tag(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _shown(values: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v, default=str)}" for k, v in values.items()) + "}"


def _check_key(key: str, where: str, source: str) -> None:
    if key.partition(".")[0] in _FIXED_KEYS:
        raise InputError(source, where, f"{key!r} cannot be swept",
                         "any other run/1 key (a point's name is its run id)")


def cell_text(value: Any) -> str:
    """A value as one short token (for slugs and the printed table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        for k in ("name", "label", "profile", "trace"):
            if isinstance(value.get(k), str):
                return Path(value[k]).stem
        if isinstance(value.get("path"), str):
            return Path(value["path"]).stem
        size = value.get("capacity", value.get("chunks"))
        size_text = f"-{size}" if isinstance(size, str | int) else ""
        if isinstance(value.get("device"), str):     # a [[tiers]] entry
            return Path(value["device"]).stem + size_text
        if isinstance(value.get("kind"), str):
            return str(value["kind"]) + size_text
        return "table"
    if isinstance(value, list):
        if not value:
            return "none"
        if all(isinstance(v, dict) for v in value):   # e.g. [[tiers]]
            return "+".join(cell_text(v) for v in value)
        return "list"
    return str(value)


def _slug(values: dict[str, Any]) -> str:
    parts = [f"{k.rpartition('.')[2]}_{cell_text(v)}" for k, v in values.items()]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts)).strip("_.-")
    return slug[:80].rstrip("_.-") or "point"


def spread(n: int, k: int) -> list[int]:
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


def _not_overridden(table: dict[str, Any], touched: Mapping[str, str]) -> dict[str, Any]:
    """``table`` (a ``sweep.set`` or ``smoke.set``) without the keys ``--set`` overrode: the
    recorded ``sweep.toml`` holds them in its base, so that it reruns the same points."""
    return {k: v for k, v in table.items()
            if not any(_overlap(k, t) for t in touched)}


def _overlap(a: str, b: str) -> bool:
    """Dotted keys that set the same value: equal, or one a table holding the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def read_sweep(path: str | Path, overrides: Sequence[str | tuple[str, str]] = (),
               smoke: bool = False) -> Sweep:
    """Read a ``sweep/1`` file, expand and validate every point.

    Args:
        path: the sweep file.
        overrides: ``--set`` items applied to the base (``"key=value"`` or
            ``(option, "key=value")``) and to every point after ``sweep.set``
            and ``smoke.set`` (the command line wins); a swept key cannot be
            overridden.
        smoke: keep the ``[smoke]`` selection and apply its ``set``.

    Raises:
        InputError: anything wrong in the file, a point, or the overrides.
    """
    p = Path(path)
    source = str(p)
    if smoke:
        read_sweep(p, overrides)  # every point of the full sweep is valid, not only the smoke selection
    data = read_toml(p)
    check_schema(data, source, "sweep/1")
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
        seen: dict[str, Any] = {}
        for v in values:
            n = _normal(key, v)
            tag = _tag(n)
            if tag in seen:
                first = seen[tag]
                if _tag(first) == _tag(v):
                    raise InputError(source, where, f"{v!r} appears twice", "distinct values")
                raise InputError(source, where, f"{first!r} and {v!r} are the same value ({n!r})",
                                 "distinct values")
            seen[tag] = v
        grid.append((key, values))
    if sec.grid is not None and not grid:
        raise InputError(source, "sweep.grid", "empty table: no key to vary",
                         'dotted keys with non-empty lists of values, e.g. "cpu_cache.capacity" = ["64GiB"]')
    grid_keys = [k for k, _ in grid]
    explicit = sec.points if sec.points is not None else [{}]
    seen_points: dict[str, int] = {}
    for i, point in enumerate(sec.points or []):
        for key in point:
            _check_key(key, f"sweep.points[{i}].{_q(key)}", source)
            if key in grid_keys:
                raise InputError(source, f"sweep.points[{i}].{_q(key)}", "also a key of sweep.grid",
                                 "each key in either grid or points")
        tag = _tag({k: _normal(k, v) for k, v in point.items()})
        if tag in seen_points:
            j = seen_points[tag]
            raise InputError(source, f"sweep.points[{i}]",
                             f"repeats sweep.points[{j}] ({_shown(sec.points[j])} and {_shown(point)})",
                             "distinct points")
        seen_points[tag] = i
    for key in (*sec.set_, *(sm.set_ if smoke else {})):
        _check_key(key, key, source)

    # the base, with --set applied
    base = {**data, "schema": "run/1"}
    touched = apply_overrides(base, overrides)
    swept = list(dict.fromkeys([k for pt in explicit for k in pt] + grid_keys))
    for key, option in touched.items():
        hit = [k for k in swept if _overlap(k, key)]
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
    keep = spread(total, sm.points or total) if smoke else list(range(total))
    width = max(3, len(str(total - 1)))
    points = []
    runs: dict[str, int] = {}  # the resolved run (name aside) -> the first point making it
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
        if touched:   # the command line wins over the file's sweep.set and smoke.set, as over its base
            apply_overrides(d, overrides)
        d["name"] = run_id
        spec = _build_point(d, p, touched, values, origin, index)
        if not smoke:  # the smoke selection may make points equal on purpose; the full sweep was checked
            run = spec.resolved()
            run.pop("name", None)
            tag = _tag(run)
            first = runs.setdefault(tag, index)
            if first != index:
                other = combos[first][0]
                key = next((k for k in values if _tag(values[k]) != _tag(other.get(k))),
                           next(iter(values), ""))
                raise InputError(source, origin.get(key, "sweep"),
                                 f"point {index} ({_shown(values)}) is the same run as point {first} "
                                 f"({_shown(other)})", "points that differ in the run they make")
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
    if sec.set_ and _not_overridden(sec.set_, touched):
        sweep_doc["set"] = _not_overridden(sec.set_, touched)
    doc["sweep"] = sweep_doc
    if raw_smoke is not None:
        doc["smoke"] = ({**raw_smoke, "set": _not_overridden(raw_smoke["set"], touched)}
                        if isinstance(raw_smoke.get("set"), dict) else raw_smoke)
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
        picked = spread(full.total, int(smoke.get("points") or full.total))
        extra = f"; smoke: {len(picked)} points"
    keys = ", ".join(full.swept)
    return f"sweep/1: {full.name!r}, {full.total} points over {keys or 'nothing'}{extra}"
