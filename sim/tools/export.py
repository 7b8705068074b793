"""``kvsim export``: CSV copies of a results folder's tables, beside the Parquet files.

What it writes
    * a run folder: ``<table>.csv`` beside each ``<table>.parquet``, and
      ``summary.csv`` (one row: :func:`sim.summaries` of the folder, the columns
      of ``sweep.parquet``);
    * a compare folder: ``diverged*.csv`` (one per compared pair), and every logic's run
      folder (``old/``, ``new/``, ``latest/``) as above;
    * a sweep folder: ``sweep.csv`` (the table as :func:`sim.load_sweep` reads it,
      an older folder's columns renamed); with ``points``, every point's folder as above.

The folder is checked first (every table an ok run writes is there, every
file reads: :func:`sim.io.results.find_incomplete`). Each file is written to a
hidden temporary name beside it (``.<name>.tmp-<pid>``) and, once all are
written, renamed onto it: an export that fails leaves no CSV of its own; an
earlier export is replaced, nothing else is touched. Columns and units:
``docs/columns.md``. The CSV is pandas' (``index=False``): nulls are empty
cells, floats in full precision.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sim.engine.metrics import TABLES
from sim.errors import InputError
from sim.io.results import find_incomplete, read_parquet, summaries, temp_beside
from sim.tools.plots import folder_kind
from sim.tools.sweep import load_sweep

__all__ = ["FORMATS", "export_folder"]

#: the formats ``kvsim export`` writes
FORMATS = ("csv",)


def _write_all(jobs: list[tuple[Path, Callable[[], Any]]]) -> list[Path]:
    """Write every CSV to its hidden temporary name, then rename them all into place: a
    table that cannot be read or written leaves no CSV of this export behind."""
    written: list[tuple[Path, Path]] = []
    try:
        for path, make in jobs:
            tmp = temp_beside(path)
            written.append((tmp, path))
            try:
                make().to_csv(tmp, index=False)
            except OSError as exc:
                raise InputError(str(path), "", f"cannot be written: {exc.strerror or exc}",
                                 "a writable results folder (with free space)") from None
        for tmp, path in written:
            tmp.replace(path)
    except BaseException:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise
    return [path for _, path in written]


def _parquet(path: Path) -> Callable[[], Any]:
    return lambda: read_parquet(path).to_pandas()


def _run(folder: Path) -> list[tuple[Path, Callable[[], Any]]]:
    out: list[tuple[Path, Callable[[], Any]]] = []
    for table in TABLES:
        f = folder / f"{table}.parquet"
        if f.is_file():
            out.append((folder / f"{table}.csv", _parquet(f)))
    out.append((folder / "summary.csv", lambda: summaries([folder])))
    return out


def export_folder(folder: str | Path, fmt: str = "csv", points: bool = False) -> list[Path]:
    """Write CSV copies of the tables of a run, compare or sweep folder (see the module).

    Args:
        folder: the results folder.
        fmt: ``"csv"`` (the only format so far).
        points: a sweep: also every point's run folder.

    Returns:
        the files written, in order.

    Raises:
        InputError: not a results folder, an unknown format, or a file that
            cannot be written.
    """
    if fmt not in FORMATS:
        raise InputError("argument", "--format", f"{fmt!r}", ", ".join(FORMATS))
    root = Path(folder)
    if not root.is_dir():
        raise InputError(str(root), "", "not a directory", "a folder written by kvsim run, compare or sweep")
    kind = folder_kind(root)
    if (bad := find_incomplete(root)) is not None:   # before any CSV is written
        raise bad
    jobs: list[tuple[Path, Callable[[], Any]]] = []
    if kind == "run":
        jobs = _run(root)
    elif kind == "compare":
        for diverged in sorted(root.glob("diverged*.parquet")):   # diverged.parquet, diverged-<a>-<b>.parquet
            jobs.append((diverged.with_suffix(".csv"), _parquet(diverged)))
        for logic in ("old", "new", "latest"):
            if (root / logic / "summary.json").is_file():
                jobs += _run(root / logic)
    else:
        sweep = load_sweep(root)
        jobs.append((root / "sweep.csv", lambda: sweep.table))
        if points:
            for run_dir in sweep.table["run_dir"]:
                if (root / str(run_dir) / "summary.json").is_file():
                    jobs += _run(root / str(run_dir))
    return _write_all(jobs)
