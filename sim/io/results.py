"""The run folder: streaming Parquet tables, atomic summary files, reading a run back.

What it does
    :class:`ParquetSink` is the :class:`~sim.engine.metrics.Sink` of a real run: one
    ``pyarrow.parquet.ParquetWriter`` per table of :data:`~sim.engine.metrics.TABLES`,
    opened on the first batch with a fixed Arrow schema derived from the
    table's column types, so a long run streams to disk one batch (one row
    group) at a time. :class:`RunWriter` owns the folder: it works in a
    temporary folder beside the target (``.<name>.tmp-<pid>``) and renames it
    onto the target at the end. :func:`load_results` reads a folder back as
    pandas DataFrames.

Life cycle (every command that writes a folder: run, compare, sweep, plot)
    * work happens in a hidden temporary folder beside the target
      (``.<name>.tmp-<pid>``); the target appears, or is replaced, by rename
      (:func:`move_into_place`) only when the work is done;
    * ``--overwrite`` replaces only a folder kvsim wrote (a run, compare or
      sweep folder: :func:`result_kind`); any other non-empty folder is refused
      before any work (:func:`check_replaceable`);
    * a good result is never destroyed: a run that fails or is interrupted
      while a previous result sits at the target (``--overwrite``) is kept
      beside it as ``<name>.failed`` or ``<name>.interrupted`` (replacing an
      earlier folder of that name), and the target is left as it was; with no
      previous result it goes to the target itself, its ``summary.json``
      saying ``"failed"`` or ``"interrupted"``;
    * hidden leftovers of processes that no longer exist (``.<name>.tmp-<pid>``,
      ``.<name>.old-<pid>``, ``.<name>.previous-<pid>``) are removed by the next
      writer into the same folder (:func:`clean_leftovers`); an aside folder
      whose target is missing (a swap killed half-way) is put back instead;
    * an output that cannot be written (read-only, full, not a folder) is bad
      input: :func:`out_error` makes it one ``--out`` line, and what was
      started is removed.

Folder (DESIGN.md, "Results folder")::

    requests.parquet steps.parquet transfers.parquet occupancy.parquet events.parquet
    tiers.parquet    only with secondary tiers ([[tiers]]): per-tier occupancy over time
    summary.json     status "ok" | "failed" | "interrupted", and the run's figures
    scenario.toml    the resolved scenario (kvsim version and seed included)
    run_info.json    wall-clock time, host, versions, argv: the one file that may
                     differ between two runs of the same scenario and seed

Determinism
    Same rows in the same batches give byte-identical Parquet files: the
    writer options are fixed (zstd, no page index, statistics on), Parquet
    stores no timestamps, and the only version-dependent bytes are the
    ``created_by`` string of the pyarrow in use. JSON is written with sorted
    keys and a trailing newline.

Invariants
    * a table file always exists after :meth:`ParquetSink.close`, with the
      table's schema, even when no row was written; an optional table
      (``tiers``) exists only when it got rows;
    * the target folder is either absent, or complete (it appears by rename);
    * a refused target (non-empty, no ``overwrite``) is left untouched and
      nothing is created.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tomllib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from sim.engine.metrics import OPTIONAL_TABLES, TABLES
from sim.errors import InputError
from sim.io.columns import RESOLVED_DOCS, flat_summary, key_type, summary_arrays
from sim.io.scenario import human_bytes

if TYPE_CHECKING:
    pass

__all__ = [
    "ParquetSink",
    "RunResults",
    "RunWriter",
    "arrow_schema",
    "check_replaceable",
    "check_target",
    "clean_leftovers",
    "concat_frames",
    "duration_text",
    "durations_text",
    "find_incomplete",
    "find_unreadable",
    "key_table",
    "load_results",
    "load_runs",
    "make_folder",
    "missing_table",
    "move_into_place",
    "out_error",
    "pid_alive",
    "read_json",
    "read_parquet",
    "read_run_table",
    "read_table",
    "read_toml",
    "remove_created",
    "result_kind",
    "scenario_columns",
    "summaries",
    "summary_table",
    "temp_beside",
    "unreadable",
    "with_keys",
    "write_json_atomic",
    "write_text_atomic",
]

#: metrics column type -> (arrow type name, nullable)
_TYPES: dict[str, tuple[str, bool]] = {
    "str": ("string", False), "str?": ("string", True), "int": ("int64", False), "int?": ("int64", True),
    "float": ("float64", False), "float?": ("float64", True), "bool": ("bool_", False),
}

#: fixed writer options (see "Determinism" above)
_WRITER_OPTIONS: dict[str, Any] = {"compression": "zstd", "compression_level": 3, "write_statistics": True,
                                   "use_dictionary": True, "write_page_index": False}


def arrow_schema(table: str) -> Any:
    """The Arrow schema of one table of :data:`~sim.engine.metrics.TABLES`."""
    fields = []
    for name, kind in TABLES[table]:
        type_name, nullable = _TYPES[kind]
        fields.append(pa.field(name, getattr(pa, type_name)(), nullable=nullable))
    return pa.schema(fields)


def _arrow_column(values: Any, kind: Any) -> Any:
    """One column as an Arrow array of type ``kind``: a typed ``array`` of int64 or
    float64 values (no nulls) is wrapped without a copy, anything else converted."""
    if isinstance(values, array):
        if (values.typecode, kind) in (("q", pa.int64()), ("d", pa.float64())):
            return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])
        values = values.tolist()
    return pa.array(values, type=kind)


class ParquetSink:
    """Streams column batches to ``<folder>/<table>.parquet`` (a :class:`~sim.engine.metrics.Sink`).

    Args:
        folder: an existing folder.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._writers: dict[str, Any] = {}
        self._closed = False
        #: the first ``OSError`` of a write or close (a full disk): the output failed, not the run
        self.error: OSError | None = None

    def _writer(self, table: str) -> Any:
        w = self._writers.get(table)
        if w is None:
            w = pq.ParquetWriter(self.folder / f"{table}.parquet", arrow_schema(table), **_WRITER_OPTIONS)
            self._writers[table] = w
        return w

    #: the recorder's typed number columns come as they are (``array('q')`` / ``array('d')``)
    takes_buffers = True

    def write(self, table: str, columns: dict[str, list[Any]]) -> None:
        """Append one batch of rows (one row group)."""
        if self._closed:
            raise RuntimeError("ParquetSink is closed")
        schema = arrow_schema(table)
        batch = pa.RecordBatch.from_arrays([_arrow_column(columns[f.name], f.type) for f in schema],
                                           schema=schema)
        try:
            self._writer(table).write_batch(batch)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def close(self) -> None:
        """Close every writer; tables that got no rows are written empty, with their schema
        (but for :data:`~sim.engine.metrics.OPTIONAL_TABLES`, which are then not written)."""
        if self._closed:
            return
        try:
            for table in TABLES:
                if table not in OPTIONAL_TABLES:
                    self._writer(table)
            for w in self._writers.values():
                w.close()
        except OSError as exc:
            self.error = self.error or exc
            raise
        self._closed = True


def _json_text(data: Any) -> str:
    return json.dumps(data, sort_keys=True, indent=2, allow_nan=False) + "\n"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON (sorted keys, indent 2) through a temporary file and ``os.replace``."""
    write_text_atomic(path, _json_text(data))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` (default permissions), then rename it."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def move_into_place(tmp: Path, target: Path) -> None:
    """Rename a finished temporary folder onto ``target``; an existing (overwritten)
    target is moved aside first and removed after, so ``target`` is never half written.

    The aside folder is ``.<name>.old-<pid>``: if the process dies between the
    two renames, :func:`clean_leftovers` puts it back.
    """
    old: Path | None = None
    if target.exists():
        if target.is_dir() and any(target.iterdir()):
            old = temp_beside(target, "old")
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
        elif target.is_dir():
            target.rmdir()
    try:
        tmp.rename(target)
    except BaseException:
        if old is not None and not target.exists():
            old.rename(target)  # put the previous result back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- the life cycle of output folders ------------------------------------------------------------

#: hidden leftovers of a writer: ``.<name>.tmp-<pid>``, ``.<name>.old-<pid>``, ``.<name>.previous-<pid>``
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|previous)-(?P<pid>\d+)$")


def temp_beside(target: Path, kind: str = "tmp") -> Path:
    """The hidden folder (or file) of this process beside ``target``: ``.<name>.<kind>-<pid>``."""
    return target.parent / f".{target.name}.{kind}-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this host)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def clean_leftovers(folder: Path) -> list[Path]:
    """Remove the hidden leftovers of dead processes in ``folder`` (one level, not below).

    A leftover is ``.<name>.tmp-<pid>`` (a temporary folder or file),
    ``.<name>.old-<pid>`` (a previous result moved aside during a swap) or
    ``.<name>.previous-<pid>`` (a previous sweep kept aside while the new one
    runs) whose process no longer exists. An ``old`` or ``previous`` folder
    whose ``<name>`` is missing (the process died between the two renames of
    a swap) is renamed back to ``<name>`` instead of removed. Leftovers of
    live processes (this one included) are left alone. Errors are ignored:
    cleaning up never stops a command.

    Returns:
        the leftovers removed or put back.
    """
    out: list[Path] = []
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError:
        return out
    for entry in entries:
        m = _LEFTOVER.match(entry.name)
        if m is None or pid_alive(int(m["pid"])):
            continue
        home = entry.parent / m["name"]
        with contextlib.suppress(OSError):
            if m["kind"] in ("old", "previous") and entry.is_dir() and not home.exists():
                entry.rename(home)
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            out.append(entry)
    return out


#: the file that marks each kind of folder kvsim writes, in the order they are told apart
#: (a sweep's and a compare's folders hold run folders, but not at their top)
RESULT_MARKERS: dict[str, str] = {
    "sweep": "sweep.parquet",
    "compare": "compare.json",
    "run": "summary.json",
}


def result_kind(folder: Path | str) -> str | None:
    """``"sweep"``, ``"compare"`` or ``"run"`` by the file that marks each kind
    (:data:`RESULT_MARKERS`), else None."""
    for kind, name in RESULT_MARKERS.items():
        if (Path(folder) / name).is_file():
            return kind
    return None


def check_replaceable(target: Path) -> None:
    """Refuse ``--overwrite`` of a non-empty folder that kvsim did not write.

    ``--overwrite`` replaces a previous result (a run, compare or sweep
    folder); any other folder (a home, ``/tmp``, a user's notes) would be
    deleted with it, so it is refused before any work. An empty folder, or
    one holding only the hidden leftovers of a kvsim writer, is fine.

    Raises:
        InputError: ``target`` is a non-empty folder of no kvsim kind.
    """
    t = Path(target)
    try:
        if not t.is_dir() or result_kind(t) is not None:
            return
        foreign = next((e.name for e in t.iterdir() if not _LEFTOVER.match(e.name)), None)
    except OSError:
        return   # unreadable: the writer reports it
    if foreign is not None:
        raise InputError(str(t), "", f"holds {foreign!r} and is not a kvsim results folder: "
                         "--overwrite would delete it",
                         "a new or empty folder, or a kvsim run, compare or sweep folder to replace")


def check_target(target: Path, overwrite: bool, what: str, *, replace_any: bool = False) -> None:
    """Refuse an output folder a run or compare must not write: a file, a non-empty folder
    without ``overwrite``, or (unless ``replace_any``) one kvsim did not write
    (:func:`check_replaceable`). ``what`` names the folder's kind in the message
    (``"results"``, ``"compare"``).

    Raises:
        InputError: naming ``target``; nothing is created.
    """
    t = Path(target)
    if t.exists() and not t.is_dir():
        raise InputError(str(t), "", "exists and is not a folder", "a new or empty folder")
    if t.is_dir() and any(t.iterdir()) and not overwrite:
        raise InputError(str(t), "", f"{what} folder exists and is not empty",
                         "a new or empty folder, or --overwrite")
    if not replace_any:
        check_replaceable(t)


def out_error(path: Path | str, exc: OSError) -> InputError:
    """An output that cannot be written, as one line of bad input (``--out``)."""
    reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else "") or str(exc) or type(exc).__name__
    return InputError("argument", "--out", f"{path}: {reason}", "a writable folder (with free space)")


def make_folder(folder: Path, out: Path | None = None) -> list[Path]:
    """Create ``folder`` and its missing parents; return the ones created, innermost first.

    Raises:
        InputError: it cannot be created (read-only, a file in the way, no
            permission); nothing is left created then. ``out`` names the
            output in the message (default ``folder``).
    """
    created: list[Path] = []
    p = Path(folder)
    while not p.exists() and not p.is_symlink():
        created.append(p)
        if p.parent == p:
            break
        p = p.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        remove_created(created)
        raise out_error(out if out is not None else folder, exc) from None
    except BaseException:
        remove_created(created)
        raise
    return created


def remove_created(created: list[Path]) -> None:
    """Remove the folders :func:`make_folder` created (innermost first), as far as they are empty."""
    for p in created:
        try:
            p.rmdir()
        except OSError:
            if p.exists():
                break


def clean_floats(data: Any) -> Any:
    """NaN and infinities as None (strict JSON)."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {str(k): clean_floats(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [clean_floats(v) for v in data]
    return data


class RunWriter:
    """Writes one run folder through a temporary folder beside it.

    Where the folder goes (see "Life cycle" above): an ok run replaces the
    target; a failed or interrupted run goes to the target when the target
    held nothing, else beside it as ``<name>.failed`` / ``<name>.interrupted``
    (the previous result stays as it was).

    Args:
        target: the run folder (``results/<name>``).
        overwrite: replace an existing non-empty target.
        aside: keep a failed or interrupted run beside a previous result
            (False: it replaces the target, as a sweep's point folders do).
        clean: remove leftovers of dead processes beside the target when
            starting (False where another process may be writing there from
            another host, as a sweep's points with Ray: the sweep cleans them).
        replace_any: ``overwrite`` may replace a folder kvsim did not write
            (only a sweep's own point folders, whose sweep folder was checked).

    Raises:
        InputError: the target is a file, a non-empty folder and ``overwrite``
            is false, or a non-empty folder kvsim did not write
            (:func:`check_replaceable`). Nothing is created then.
    """

    def __init__(self, target: Path, overwrite: bool = False, *, aside: bool = True,
                 clean: bool = True, replace_any: bool = False) -> None:
        self.target = Path(target)
        t = self.target
        check_target(t, overwrite, "results", replace_any=replace_any)
        self.overwrite = overwrite
        self.aside = aside
        self.clean = clean
        self.folder = temp_beside(t)
        #: where :meth:`finish` put the folder (None until then)
        self.published: Path | None = None
        self._done = False

    @property
    def has_previous(self) -> bool:
        """The target holds a previous result (a non-empty folder)."""
        t = self.target
        try:
            return t.is_dir() and any(t.iterdir())
        except OSError:
            return False

    def start(self) -> Path:
        """Create the temporary folder (and the target's parents); return it.

        Raises:
            InputError: it cannot be created (``--out`` not writable).
        """
        created = make_folder(self.target.parent, self.target)
        if self.clean:
            clean_leftovers(self.target.parent)
        try:
            if self.folder.exists():
                shutil.rmtree(self.folder)
            self.folder.mkdir()
        except OSError as exc:
            remove_created(created)  # nothing is left half made
            raise out_error(self.target, exc) from None
        return self.folder

    def destination(self, status: str) -> Path:
        """Where a folder of this status goes (see the class docstring)."""
        if status == "ok" or not self.aside or not self.has_previous:
            return self.target
        return self.target.parent / f"{self.target.name}.{status}"

    def finish(self, status: str, summary: dict[str, Any], scenario_toml: str,
               run_info: dict[str, Any]) -> Path:
        """Write the summary files and move the folder into place.

        Args:
            status: ``"ok"``, ``"failed"`` or ``"interrupted"``.
            summary: the figures (and ``error`` when failed); ``status`` is added.
            scenario_toml: the resolved scenario.
            run_info: wall-clock facts (the one file allowed to differ between runs).

        Returns:
            The folder written: the target, or ``<target>.<status>`` beside a
            previous result (see the class docstring).

        Raises:
            InputError: the folder cannot be written (disk full, read-only);
                the temporary folder is removed and the target left as it was.
        """
        if not self.folder.is_dir():
            self.start()
        dest = self.destination(status)
        try:
            write_text_atomic(self.folder / "scenario.toml", scenario_toml)
            write_json_atomic(self.folder / "run_info.json", clean_floats(run_info))
            write_json_atomic(self.folder / "summary.json", clean_floats({**summary, "status": status}))
            move_into_place(self.folder, dest)
        except OSError as exc:
            self.abort()
            raise out_error(self.target, exc) from None
        except BaseException:
            self.abort()
            raise
        self._done = True
        self.published = dest
        return dest

    def abort(self) -> None:
        """Remove the temporary folder (bad input found after the start: nothing is left)."""
        if not self._done and self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(eq=False)   # DataFrame fields have no truth value: identity, not a ValueError
class RunResults:
    """A run folder read back.

    Attributes:
        path: the folder.
        requests, steps, transfers, occupancy, events, tiers: the tables as
            DataFrames (columns as in :data:`sim.engine.metrics.TABLES`); ``tiers``
            is empty for a run without secondary tiers (it has no file), and
            None in a RunResults built by hand without it.
        summary: ``summary.json``.
        scenario: ``scenario.toml``, parsed.
        run_info: ``run_info.json``.
    """

    path: Path
    requests: Any
    steps: Any
    transfers: Any
    occupancy: Any
    events: Any
    summary: dict[str, Any]
    scenario: dict[str, Any]
    run_info: dict[str, Any]
    #: last and optional, so that a RunResults built by hand without it still works
    tiers: Any = None

    def __repr__(self) -> str:
        """One line a notebook can show: the folder, the run's status and the tables' sizes
        (the dataclass's own repr printed every table and the whole summary)."""
        rows = ", ".join(f"{name} {len(t):,}" for name in ("requests", "steps", "transfers", "occupancy",
                                                            "events", "tiers")
                         if (t := getattr(self, name)) is not None and hasattr(t, "__len__"))
        status = self.summary.get("status", "?")
        return f"RunResults({str(self.path)!r}, status {status!r}; rows: {rows})"


def load_results(path: str | Path) -> RunResults:
    """Read a run folder written by ``kvsim run``.

    A table file that is missing (a run that failed before it wrote anything)
    reads as an empty DataFrame with the table's columns; in a run whose
    summary says ``ok`` it is damage (:func:`missing_table`).

    Raises:
        InputError: ``path`` is not a run folder (no ``summary.json``), a
            file in it cannot be read (truncated or corrupt), or an ok run
            lacks a table, naming the file.
    """

    folder = Path(path)
    if not (folder / "summary.json").is_file():
        raise InputError(str(folder), "", "not a run folder (no summary.json)",
                         "a folder written by kvsim run")
    summary = read_json(folder / "summary.json")
    if not isinstance(summary, dict):
        raise InputError(str(folder / "summary.json"), "", "not a JSON object", RERUN)
    scenario_file = folder / "scenario.toml"
    scenario = read_toml(scenario_file) if scenario_file.is_file() else {}
    info_file = folder / "run_info.json"
    run_info = read_json(info_file) if info_file.is_file() else {}
    if (missing := missing_table(folder)) is not None:
        raise missing
    frames: dict[str, Any] = {}
    for table in TABLES:
        f = folder / f"{table}.parquet"
        data = read_run_table(f, table) if f.is_file() else arrow_schema(table).empty_table()
        frames[table] = data.to_pandas()
    return RunResults(path=folder, summary=summary, scenario=scenario, run_info=run_info, **frames)


# -- reading files of a results folder: a damaged one is bad input naming it -------------------

#: what to do about a results file that cannot be read
RERUN = "a complete kvsim results folder (run the command again)"
_KINDS = {".parquet": "Parquet", ".json": "JSON", ".toml": "TOML"}


def unreadable(path: Path | str, exc: BaseException) -> InputError:
    """``FILE: not a readable Parquet file (truncated or corrupt: ...)``, from what reading it raised."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = re.sub(r"^Could not open Parquet input source '.*?': ", "", text) or type(exc).__name__
    kind = _KINDS.get(Path(path).suffix, "")
    return InputError(str(path), "", f"not a readable {kind + ' ' if kind else ''}file "
                                     f"(truncated or corrupt: {text})", RERUN)


def read_parquet(path: Path | str, columns: list[str] | None = None) -> Any:
    """A Parquet file as a ``pyarrow.Table``.

    Raises:
        InputError: it cannot be read (:func:`unreadable`).
    """
    try:
        return pq.read_table(path, columns=columns)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise unreadable(path, exc) from None


def read_run_table(path: Path | str, table: str) -> Any:
    """A run table's Parquet file (:func:`read_parquet`), checked to be that table: it holds
    the table's first two columns (which tell the tables apart; a file written by an older
    kvsim may lack later columns, never these).

    Raises:
        InputError: it cannot be read, or it holds another table.
    """
    data = read_parquet(path)
    want = [name for name, _ in TABLES[table][:2]]
    if not all(name in data.column_names for name in want):
        raise InputError(str(path), "", f"not a {table} table (no {' or '.join(want)} column; it has "
                         f"{', '.join(data.column_names[:3]) or 'no column'}...)", RERUN)
    return data


def read_json(path: Path | str) -> Any:
    """A JSON file, parsed. Raises InputError (:func:`unreadable`) when it cannot be read."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise unreadable(path, exc) from None


def read_toml(path: Path | str) -> dict[str, Any]:
    """A TOML file, parsed. Raises InputError (:func:`unreadable`) when it cannot be read."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        raise unreadable(path, exc) from None


def _result_files(root: Path) -> list[Path]:
    """The files of a results folder, subfolders included, hidden ones and ``plots`` not, sorted."""
    return sorted(f for f in root.rglob("*")
                  if not any(p.startswith(".") or p == "plots" for p in f.relative_to(root).parts)
                  and f.is_file())


def find_unreadable(folder: Path | str, files: Sequence[Path] | None = None) -> InputError | None:
    """The first file of a results folder (subfolders included, hidden ones and ``plots``
    not; or of ``files``, listed already) that cannot be read, as :func:`unreadable`
    says it; None when every file reads.

    For telling which file made a read fail after the fact: Parquet files are
    checked by their footer (what truncation breaks), JSON and TOML files in full.
    """
    for f in _result_files(Path(folder)) if files is None else files:
        try:
            if f.suffix == ".parquet":
                pq.read_metadata(f)
            elif f.suffix == ".json":
                read_json(f)
            elif f.suffix == ".toml":
                read_toml(f)
        except InputError as exc:
            return exc
        except Exception as exc:  # pyarrow: ArrowInvalid, OSError, ...
            return unreadable(f, exc)
    return None


def missing_table(folder: Path | str) -> InputError | None:
    """The first table file missing from a run folder whose ``summary.json`` says ``ok``
    (an ok run writes every table but the optional ones), as bad input naming it; None
    when none is missing, or the run is not ok (a failed run may have written none)."""
    folder = Path(folder)
    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None   # no summary, or an unreadable one: find_unreadable names it
    if not isinstance(summary, dict) or summary.get("status") != "ok":
        return None
    for table in TABLES:
        f = folder / f"{table}.parquet"
        if table not in OPTIONAL_TABLES and not f.is_file():
            return InputError(str(f), "", "missing (an ok run writes every table)", RERUN)
    return None


def find_incomplete(folder: Path | str) -> InputError | None:
    """What makes a results folder unfit to read, before anything is read or written from it:
    a run folder (the folder, or one inside it: a compare's logics, a sweep's points) missing
    a table (:func:`missing_table`), else a file that cannot be read (:func:`find_unreadable`);
    None when it is whole."""
    root = Path(folder)
    files = _result_files(root)   # one walk for both checks
    runs = [f.parent for f in files if f.name == "summary.json"]
    for run in sorted(runs, key=lambda r: (r != root, r)):   # the folder itself first
        if (problem := missing_table(run)) is not None:
            return problem
    return find_unreadable(root, files)


# -- many runs as one table (docs/columns.md) ---------------------------------------------


def _read_run_files(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``summary.json``, ``scenario.toml`` or ``{}``) of a run folder.

    Raises:
        InputError: not a run folder, or a file that cannot be read.
    """
    if not (folder / "summary.json").is_file():
        raise InputError(str(folder), "", "not a run folder (no summary.json)",
                         "a folder written by kvsim run")
    summary = read_json(folder / "summary.json")
    if not isinstance(summary, dict):
        raise InputError(str(folder / "summary.json"), "", "not a JSON object", RERUN)
    scenario_file = folder / "scenario.toml"
    return summary, read_toml(scenario_file) if scenario_file.is_file() else {}


def scenario_columns(scenario: dict[str, Any]) -> dict[str, Any]:
    """The resolved configuration (:data:`sim.io.columns.RESOLVED_DOCS`) from a run folder's
    ``scenario.toml`` (parsed). ``cpu_cache_bytes`` is null when only ``cpu_cache.chunks``
    was given (the bytes need the model's layout); a key the scenario lacks is null."""
    def get(section: str, key: str) -> Any:
        table = scenario.get(section)
        return table.get(key) if isinstance(table, dict) else None

    hw_profile = get("hardware", "profile")
    hardware = hw_profile
    if isinstance(hw_profile, str) and ("/" in hw_profile or hw_profile.endswith(".toml")):
        hardware = Path(hw_profile).stem
        with contextlib.suppress(OSError, ValueError):
            name = tomllib.loads(Path(hw_profile).read_text(encoding="utf-8")).get("name")
            hardware = name if isinstance(name, str) else hardware
    raw = scenario.get("workload")
    wl: dict[str, Any] = raw if isinstance(raw, dict) else {}
    path = wl.get("path")
    workload = wl.get("trace") or (Path(path).name if isinstance(path, str) else wl.get("kind"))
    capacity = get("cpu_cache", "capacity")
    cpu_bytes = 0 if get("scheduler", "offloading") is False else capacity
    h2d, d2h = get("hardware", "h2d_bandwidth"), get("hardware", "d2h_bandwidth")
    return {"model": get("model", "label"), "hardware": hardware, "workload": workload,
            "cpu_cache_bytes": cpu_bytes, "cpu_cache_policy": get("cpu_cache", "policy"),
            "window_logic": scenario.get("window_logic"),
            "blocks_per_chunk": get("scheduler", "blocks_per_chunk"),
            "h2d_bytes_per_s": None if h2d is None else float(h2d),
            "d2h_bytes_per_s": None if d2h is None else float(d2h), "seed": scenario.get("seed")}


def key_table(keys: dict[str, Any]) -> Any:
    """One row of identity columns (typed: :func:`sim.io.columns.key_type`) as a ``pyarrow.Table``."""
    return pa.table({k: pa.array([v], type=key_type(k)) for k, v in keys.items()})


def with_keys(keys: Any, table: Any) -> Any:
    """``table`` (a ``pyarrow.Table``) with the one-row ``keys`` table repeated in front of its columns."""
    out = keys.take(pa.array([0] * table.num_rows, type=pa.int64()))
    for name, column in zip(table.column_names, table.columns, strict=True):
        out = out.append_column(name, column)
    return out


def read_table(folder: Path, table: str, ok: bool = False) -> Any:
    """``<folder>/<table>.parquet`` as a ``pyarrow.Table``; empty (with the table's schema) when
    missing from a run that is not ok (a failed run may have written none).

    Raises:
        InputError: the file is missing from an ok run (its ``summary.json`` says so,
            or ``ok``: the caller knows it, as a sweep of its points), or cannot be read.
    """
    f = folder / f"{table}.parquet"
    if f.is_file():
        return read_run_table(f, table)
    if ok and table not in OPTIONAL_TABLES:
        raise InputError(str(f), "", "missing (an ok run writes every table)", RERUN)
    if (missing := missing_table(folder)) is not None:
        raise missing
    return arrow_schema(table).empty_table()


def concat_frames(tables: list[Any], empty: Any) -> Any:
    """Arrow tables (columns a later kvsim added are null in older ones) as one pandas DataFrame;
    ``empty`` (a schema) when there is none."""
    if not tables:
        return empty.empty_table().to_pandas()
    return pa.concat_tables(tables, promote_options="default").to_pandas()


def _folders(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    """One folder (a str or any path-like) or an iterable of them, as paths."""
    if isinstance(paths, bytes):
        raise InputError("argument", "paths", f"{paths!r} is bytes",
                         "a folder as str or path, or a list of them")
    return [Path(paths)] if isinstance(paths, str | os.PathLike) else [Path(p) for p in paths]


def load_runs(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> Any:
    """Every request of some run folders as one long pandas DataFrame.

    Columns: ``run_id`` (the folder's name), ``run_dir`` (the path as given),
    ``name``, ``run_status`` (the run's status: a failed run's table is
    partial), the resolved configuration (``model``, ``hardware``,
    ``workload``, ``cpu_cache_bytes``, ``cpu_cache_policy``, ``window_logic``,
    ``blocks_per_chunk``, ``h2d_bytes_per_s``, ``d2h_bytes_per_s``, ``seed``),
    then the ``requests`` columns (``docs/columns.md``). Rows: the runs in the
    order given, each in its table's order.

    Raises:
        InputError: a path is not a run folder or cannot be read.
    """
    tables = []
    for folder, keys, _ in _run_keys(_folders(paths), "run_status"):
        tables.append(with_keys(key_table(keys), read_table(folder, "requests")))
    empty = pa.schema([*key_table(_empty_keys("run_status")).schema, *arrow_schema("requests")])
    return concat_frames(tables, empty)


def summaries(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> Any:
    """One row per run folder: ``run_id``, ``run_dir``, ``name``, ``status``, ``error``,
    the resolved configuration, then ``summary.json`` flattened as in ``sweep.parquet``
    (:func:`sim.io.columns.flat_summary`; null for a failed run). A pandas DataFrame.

    Raises:
        InputError: a path is not a run folder or cannot be read.
    """
    rows = _run_keys(_folders(paths), "status")
    flats = [flat_summary(summary) if keys["status"] == "ok" else {} for _, keys, summary in rows]
    keys = [k for _, k, _ in rows] or [_empty_keys("status")]
    cols = {name: pa.array([k[name] for k in keys] if rows else [], type=key_type(name)) for name in keys[0]}
    cols.update(summary_arrays(flats))
    return pa.table(cols).to_pandas()


def _empty_keys(status: str) -> dict[str, Any]:
    keys: dict[str, Any] = {"run_id": "", "run_dir": "", "name": "", status: ""}
    if status == "status":
        keys["error"] = ""
    return keys | dict.fromkeys(RESOLVED_DOCS)


def _run_keys(folders: list[Path], status: str) -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(folder, identity columns, ``summary.json``) of each run folder; ``status`` names the status column."""
    out = []
    for folder in folders:
        summary, scenario = _read_run_files(folder)
        header = summary.get("run")
        run: dict[str, Any] = header if isinstance(header, dict) else {}
        keys: dict[str, Any] = {"run_id": folder.resolve().name, "run_dir": str(folder),
                                "name": run.get("name") or scenario.get("name") or folder.resolve().name,
                                status: str(summary.get("status", "ok"))}
        if status == "status":
            keys["error"] = "" if keys["status"] == "ok" else str(summary.get("error") or "")
        out.append((folder, keys | scenario_columns(scenario), summary))
    return out


# -- the printed summary -----------------------------------------------------------------


def _fmt(value: Any, spec: str = ".3g", unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{unit}"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def duration_text(value: Any, *, seconds: bool | None = None) -> str:
    """A duration given in seconds, as kvsim prints it: in ms below 10 s, in s from 10 s on
    (``seconds`` forces either unit, for a column that keeps one); ``-`` for None."""
    if value is None:
        return "-"
    in_s = value >= 10 if seconds is None else seconds
    return f"{value:.2f} s" if in_s else f"{1000 * value:.1f} ms"


def durations_text(values: Iterable[Any], missing: str = "-") -> str:
    """Durations (seconds) that one line shows side by side (``p50 / p90 / p99``), in one
    unit: s when the largest is 10 s or more, else ms (:func:`duration_text`); ``missing``
    for a None."""
    vals = list(values)
    known = [v for v in vals if v is not None]
    in_s = bool(known) and max(known) >= 10
    return " / ".join(missing if v is None else duration_text(v, seconds=in_s) for v in vals)



def _load_text(load: dict[str, Any] | None) -> str:
    """The steady-state verdict in one cell (older summaries have none)."""
    if not load:
        return "-"
    offered, served = load.get("offered_requests_per_s"), load.get("served_requests_per_s")
    rates = f"offered {_fmt(offered, '.2f', ' req/s')}, served {_fmt(served, '.2f', ' req/s')}"
    queue = (f"queue {load.get('queue_trend')}, peak {load.get('peak_waiting')}, "
             f"drain {_fmt(load.get('drain_s'), '.1f', ' s')}")
    verdict = "OVERLOADED" if load.get("overloaded") else "stable"
    return f"{verdict} ({rates}; {queue})"


def summary_warnings(summary: dict[str, Any]) -> list[str]:
    """One-line warnings a planner must not miss (overload, rejected requests)."""
    out: list[str] = list(summary.get("hardware_warnings") or [])
    if summary.get("status") in ("failed", "interrupted"):
        return out
    load = summary.get("load") or {}
    if load.get("overloaded"):
        out.append(f"overloaded: {load.get('reason')}; TTFT reflects the queue, not the "
                   f"configuration (see docs/metrics.md)")
    req = summary.get("requests", {})
    if req.get("rejected"):
        share = req.get("rejected_share")
        share_text = f" ({share:.1%})" if isinstance(share, float) else ""
        out.append(f"{req['rejected']} of {req.get('arrived')} requests{share_text} were rejected "
                   f"(longer than max_model_len, the longest request the GPU pool holds, or never "
                   f"fitting in it: see the events table); "
                   f"TTFT/TPOT percentiles are of served requests, "
                   f"see also 'rejected = never'")
    return out


def summary_table(summary: dict[str, Any], folder: Path | str | None = None) -> str:
    """The figures of ``summary.json`` as plain aligned text."""
    if summary.get("status") in ("failed", "interrupted"):
        rows = [("status", str(summary["status"]).upper()), ("error", str(summary.get("error")))]
    else:
        req, tr = summary["requests"], summary["transfers"]
        ttft, tpot, thr = summary["ttft_s"], summary["tpot_s"], summary["throughput"]
        crashes, hazards = summary["crashes"], summary["hazards"]
        kinds = ", ".join(f"{k} {v}" for k, v in crashes["kinds"].items())
        crash_text = str(crashes["count"])
        if crashes["count"]:
            crash_text += f" ({kinds}; first at {_fmt(crashes['first_s'], '.3f', ' s')})"
        hazard_text = str(hazards["count"])
        if hazards["count"]:
            hazard_text += " (" + ", ".join(f"{k} {v}" for k, v in hazards["kinds"].items()) + ")"
        rows = [
            ("status", f"{summary.get('status', 'ok')} ({summary.get('end', 'ok')})"),
            ("requests finished / arrived", f"{req['finished']} / {req['arrived']}"
             + (f" ({req['rejected']} rejected)" if req.get("rejected") else "")),
            ("simulated time", _fmt(summary.get("sim_time_s"), ".2f", " s")),
            ("GPU hit rate", _pct(summary["gpu_hit_rate"])),
            ("CPU hit rate", _pct(summary["cpu_hit_rate"])),
            ("CPU reloads after preemption", f"{summary['tokens'].get('cpu_reload', 0):,} tokens"),
            ("recompute saved", _pct(summary["recompute_saved"])),
            ("load", _load_text(summary.get("load"))),
            ("TTFT p50 / p90 / p99" + (" (served)" if req.get("rejected") else ""),
             durations_text(ttft.get(f"p{q}") for q in (50, 90, 99))),
            ("TPOT mean / p50", durations_text((tpot.get("mean"), tpot.get("p50")))),
            ("throughput", f"{_fmt(thr['requests_per_s'], '.2f', ' req/s')}, "
                           f"{_fmt(thr['output_tokens_per_s'], '.1f', ' output tok/s')}"),
            ("bytes moved H2D / D2H", f"{human_bytes(tr['h2d_bytes'])} / {human_bytes(tr['d2h_bytes'])}"),
            ("link utilisation H2D / D2H", f"{_pct(tr['h2d_utilisation'])} / {_pct(tr['d2h_utilisation'])}"),
            ("preemptions", str(summary["engine"]["preemptions"])),
            ("deferrals", str(summary["engine"]["deferrals"]) + (
                " (" + ", ".join(f"{k} {v}" for k, v in summary["engine"]["deferral_reasons"].items())
                + ")" if summary["engine"].get("deferral_reasons") else "")),
            ("crashes", crash_text),
            ("hazards", hazard_text),
            ("integrity violations", str(summary.get("integrity_violations", 0))),
        ]
        if req.get("rejected"):
            with_rej = summary.get("ttft_s_with_rejected", {})
            rows.insert(next(i for i, r in enumerate(rows) if r[0].startswith("TPOT")),
                        ("TTFT p50 / p90 / p99 (rejected = never)",
                         durations_text((with_rej.get(f"p{q}") for q in (50, 90, 99)), missing="never")))
        wl = summary.get("workload")
        if wl is not None:
            text = str(wl["bad_lines_skipped"])
            if wl["bad_line_examples"]:
                text += " (first: " + wl["bad_line_examples"][0] + ")"
            rows.append(("bad trace lines skipped", text))
    if folder is not None:
        rows.append(("results", str(folder)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
