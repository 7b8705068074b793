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
    Each point is one ordinary run (:func:`sim.tools.run.execute`) written to
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
    differs, is refused unless ``overwrite``. Temporary folders left by
    killed runs are removed at the start. Killing the sweep therefore loses
    at most the points in flight. On Ctrl-C (or SIGTERM) the sweep stops
    submitting, cancels what is pending, stops the workers, writes
    ``sweep.parquet`` for what is done and exits 130 (143 on SIGTERM). Pool
    workers die with the sweep process, even on SIGKILL
    (:func:`sim.tools.run.worker_init`).

Overwrite
    ``overwrite`` never destroys the previous sweep before the new one is
    done: the whole folder is moved aside to ``.<name>.previous-<pid>`` (beside
    it), and the new folder starts with hard links (copies where links are
    not possible) of what this sweep keeps from it: its finished points
    (same scenario) and, with ``--smoke``, the other points' folders. The
    aside folder is removed when every point of the new sweep is ok. If the
    new sweep is interrupted, or any of its points failed, the aside folder
    becomes ``<name>.previous`` (``<name>.previous-2`` ... when taken), kept
    for the user, and the new folder resumes as any sweep does. After a
    SIGKILL the hidden aside folder is removed by the next command that
    writes beside it (:func:`sim.io.results.clean_leftovers`).

``sweep.parquet``
    One row per point that ran (ok or failed), in point order, rewritten
    atomically after every finished point: ``point``, ``run_id``,
    ``run_dir``, ``status``, ``error``, one column per swept key (named by
    its dotted key; values as given, tables as JSON text; a column whose
    values mix types holds their text), the resolved columns of
    :data:`RESOLVED_COLUMNS`, then ``summary.json`` flattened by
    :func:`sim.io.columns.flat_summary` (``ttft_s_p50``, ``requests_finished``;
    a table of counts one integer column per name, a list a count and a text
    column; typed; null for failed points; ``docs/columns.md``). No wall-clock
    values: the same sweep gives a byte-identical file (wall time stays in each
    ``run_info.json``).
    A swept key named like a resolved column (``window_logic``, ``seed``,
    ``model``, ``hardware``, ``workload``) has one column, the resolved one.

Invariants
    * bad input (file, values, options) writes nothing;
    * ``points/`` holds only complete run folders once a sweep has started;
    * the table depends only on the sweep definition and the run folders.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import multiprocessing
import numbers
import os
import re
import shutil
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from sim.errors import InputError
from sim.io.columns import SUMMARY_KEYS, flat_summary, summary_arrays
from sim.io.results import (
    RERUN,
    RunWriter,
    arrow_schema,
    check_replaceable,
    clean_leftovers,
    concat_frames,
    duration_text,
    load_results,
    make_folder,
    out_error,
    read_parquet,
    read_table,
    read_toml,
    remove_created,
    temp_beside,
    with_keys,
    write_text_atomic,
)
from sim.io.scenario import RunSpec, build_run
from sim.io.sweepfile import (
    HEAD_COLUMNS,
    RESOLVED_COLUMNS,
    Sweep,
    SweepPoint,
    cell_text,
    describe_sweep,
    read_sweep,
)
from sim.tools.run import execute, interruptible, signal_of, stop_pool, worker_init

if TYPE_CHECKING:
    from sim.io.results import RunResults

__all__ = [
    "HEAD_COLUMNS",
    "RESOLVED_COLUMNS",
    "Sweep",
    "SweepPoint",
    "SweepReport",
    "SweepResults",
    "describe_sweep",
    "load_sweep",
    "read_sweep",
    "run_point",
    "run_sweep",
    "upgrade_table",
]

_TMP_RE = re.compile(r"^\..+\.(tmp|old)-\d+$")
_PARQUET_OPTIONS: dict[str, Any] = {"compression": "zstd", "compression_level": 3, "use_dictionary": True,
                                    "write_statistics": True, "write_page_index": False}

# -- one point ----------------------------------------------------------------------------------


class _GuardedWriter(RunWriter):
    """A writer that will not publish a folder once its sweep process is gone
    (a worker orphaned by a killed sweep must not race the next sweep)."""

    def __init__(self, target: Path, parent_pid: int | None) -> None:
        # a failed point replaces its folder (it runs again next time); points/ is cleaned by the
        # sweep itself, once, at the start (with Ray, other hosts' pids mean nothing here)
        super().__init__(target, overwrite=True, aside=False, clean=False, replace_any=True)
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


# -- the table ------------------------------------------------------------------------------------


def _cell(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else value


def _column(values: list[Any]) -> Any:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else (v if isinstance(v, str) else json.dumps(v))
                         for v in values], type=pa.string())


def build_table(sweep: Sweep, done: dict[int, dict[str, Any]]) -> Any:
    """The sweep table (a ``pyarrow.Table``) of the points in ``done`` (index -> summary), in point order."""
    rows = [(pt, done[pt.index]) for pt in sweep.points if pt.index in done]
    flats = [flat_summary(s) if s.get("status") == "ok" else {} for _, s in rows]
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
    for key, column in summary_arrays(flats).items():
        cols[key if key not in cols else f"summary_{key}"] = column
    return pa.table(cols)


def write_table(sweep: Sweep, done: dict[int, dict[str, Any]], out: Path) -> Path:
    """Write ``sweep.parquet`` atomically (deterministic bytes)."""
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
        previous: where the previous sweep was kept (``overwrite``, interrupted), or None.
    """

    out: Path
    skipped: int = 0
    ran: int = 0
    failed: list[str] = field(default_factory=list)
    interrupted: int | None = None
    summaries: dict[int, dict[str, Any]] = field(default_factory=dict)
    previous: Path | None = None


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
    if overwrite:
        check_replaceable(out)
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
              on_failed: Callable[[str, str], None] | None = None,
              argv: Sequence[str] = ()) -> SweepReport:
    """Run the points of ``sweep`` that are not finished in ``out``; write ``sweep.parquet``.

    Args:
        sweep: from :func:`read_sweep`.
        out: the sweep folder (``sweep.toml``, ``points/``, ``sweep.parquet``).
        jobs: parallel points (default: CPU count; Ray: the cluster decides).
        backend: ``"local"`` (process pool) or ``"ray"``.
        address: a Ray cluster to join (``ray start --head`` printed it).
        overwrite: start over from a folder that does not match this sweep (the
            previous folder is kept aside until every new point is ok: see
            "Overwrite" above); refused for a non-empty folder that is not a
            kvsim sweep, run or compare folder.
        progress: called with (points done now, points to run) after each point.
        on_start: called once with (points skipped, points to run).
        on_failed: called with (run id, the reason in one line) for each point that fails.
        argv: the command line, for each ``run_info.json``.

    Returns:
        The report; ``interrupted`` is set when Ctrl-C or SIGTERM stopped it.

    Raises:
        InputError: bad options, Ray missing, a folder that does not match, or
            an ``out`` that cannot be written (nothing is written then).
    """
    if backend not in ("local", "ray"):
        raise InputError("argument", "--backend", f"{backend!r}", "local, ray")
    if jobs is not None and jobs < 1:
        raise InputError("argument", "--jobs", f"{jobs}", "an integer >= 1")
    if address is not None and backend != "ray":
        raise InputError("argument", "--address", "only with --backend ray", "--backend ray --address ADDR")
    ray = import_ray() if backend == "ray" else None
    out = Path(out).resolve()
    finished, stale = _survey(sweep, out, overwrite)
    report = SweepReport(out=out, skipped=len(finished))
    report.summaries.update(finished)
    with interruptible():  # SIGTERM too, from here on: the previous sweep is never left hidden
        previous = _prepare(sweep, out, overwrite, finished, stale)
        completed = False
        try:
            _run_points(sweep, out, report, finished, ray, jobs, address, progress, on_start, on_failed, argv)
            # a point that failed may have replaced a good one: the previous sweep is then kept
            completed = report.interrupted is None and not report.failed
        finally:
            if previous is not None:
                if completed:
                    shutil.rmtree(previous, ignore_errors=True)
                else:  # kept for the user under a visible name (a hidden one is cleaned up as a leftover)
                    report.previous = _keep_previous(previous, out)
    return report


def _run_points(sweep: Sweep, out: Path, report: SweepReport, finished: dict[int, dict[str, Any]], ray: Any,
                jobs: int | None, address: str | None, progress: Callable[[int, int], None] | None,
                on_start: Callable[[int, int], None] | None, on_failed: Callable[[str, str], None] | None,
                argv: Sequence[str]) -> None:
    """Run the points not finished, on the chosen backend; fill ``report`` (interrupted: its signal)."""
    todo = [pt for pt in sweep.points if pt.index not in finished]
    if on_start is not None:
        on_start(len(finished), len(todo))
    tasks = [{"index": pt.index, "source": str(sweep.source.resolve()), "data": pt.data,
              "target": str(out / "points" / pt.run_id), "argv": list(argv)} for pt in todo]

    def done(result: dict[str, Any]) -> None:
        index = int(result["index"])
        pt = next(p for p in todo if p.index == index)
        summary = _read_summary(out / "points" / pt.run_id) or {}
        if result["status"] != "ok":
            summary = {**summary, "status": "failed", "error": summary.get("error") or result["error"]}
            if on_failed is not None:
                on_failed(pt.run_id, " ".join(str(summary["error"] or "failed").split()))
        report.summaries[index] = summary
        report.ran += 1
        write_table(sweep, report.summaries, out)
        if progress is not None:
            progress(report.ran, len(todo))

    try:
        if not tasks:   # every point finished earlier: no backend to start (nor a Ray instance)
            pass
        elif ray is not None:
            _run_ray(ray, tasks, jobs, address, done)
        elif (jobs or os.cpu_count() or 1) <= 1 or len(tasks) <= 1:
            _run_here(tasks, done)
        else:
            _run_pool(tasks, min(jobs or os.cpu_count() or 1, len(tasks)), done)
    except KeyboardInterrupt as exc:
        report.interrupted = signal_of(exc)
        # a worker may have put a finished point in place just before the signal, unreported:
        # the table lists every point folder a re-run would skip
        for pt in todo:
            summary = None if pt.index in report.summaries else _read_summary(out / "points" / pt.run_id)
            if summary is not None and summary.get("status") == "ok":
                report.summaries[pt.index] = summary
                report.ran += 1
    write_table(sweep, report.summaries, out)
    report.failed = [pt.run_id for pt in sweep.points
                     if pt.index in report.summaries and report.summaries[pt.index].get("status") != "ok"]


def _prepare(sweep: Sweep, out: Path, overwrite: bool, finished: dict[int, dict[str, Any]],
             stale: list[Path]) -> Path | None:
    """Make the folder ready: leftovers removed, the previous sweep moved aside (``overwrite``)
    and what is kept from it linked back, ``sweep.toml`` and the table of what is finished written.

    Returns:
        the aside folder of the previous sweep, or None.

    Raises:
        InputError: ``out`` cannot be written; nothing is left changed then.
    """
    created = make_folder(out.parent, out)
    clean_leftovers(out.parent)
    previous: Path | None = None
    try:
        if overwrite and out.is_dir() and any(out.iterdir()):
            previous = temp_beside(out, "previous")
            out.rename(previous)
        created = make_folder(out / "points", out) + created
        if previous is not None:
            _carry_over(previous, out, sweep, finished, stale)
        else:
            _clean_tmp(out)
        write_text_atomic(out / "sweep.toml", sweep.text)
        write_table(sweep, finished, out)
    except BaseException as exc:
        if previous is not None:  # put the previous sweep back as it was
            shutil.rmtree(out, ignore_errors=True)
            previous.rename(out)
        remove_created(created)
        if isinstance(exc, OSError):
            raise out_error(out, exc) from None
        raise
    return previous


def _carry_over(previous: Path, out: Path, sweep: Sweep, finished: dict[int, dict[str, Any]],
                stale: list[Path]) -> None:
    """Link into ``out`` the point folders of the previous sweep that this sweep keeps."""
    old_points = previous / "points"
    if not old_points.is_dir():
        return
    skip = {p.name for p in stale}
    keep = {pt.run_id for pt in sweep.points if pt.index in finished}
    ids = {pt.run_id for pt in sweep.points}
    for entry in sorted(old_points.iterdir()):
        if entry.name.startswith(".") or entry.name in skip or not entry.is_dir():
            continue
        if entry.name in keep or entry.name not in ids:  # finished, or (smoke) a point of the whole sweep
            shutil.copytree(entry, out / "points" / entry.name, copy_function=_link_or_copy)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _keep_previous(previous: Path, out: Path) -> Path | None:
    """Rename the aside folder to ``<name>.previous`` (``-2``, ``-3`` ... when taken)."""
    for n in range(1, 1000):
        dest = out.parent / (f"{out.name}.previous" if n == 1 else f"{out.name}.previous-{n}")
        if not dest.exists():
            try:
                previous.rename(dest)
            except OSError:
                break
            return dest
    return previous if previous.exists() else None


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
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=worker_init,
                               initargs=(os.getpid(),))
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
        stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def import_ray() -> Any:
    try:
        import ray  # noqa: PLC0415 -- Ray is an optional extra
    except ImportError:
        raise InputError("argument", "--backend", "ray is not installed",
                         "pip install 'kvsim[ray]', or --backend local") from None
    return ray


#: Ray's logger of its token-authentication setup (recent Ray, 2.60 here)
_RAY_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextlib.contextmanager
def _quiet_token_setup() -> Any:
    """Ray's "token authentication is enabled" notice, printed when a sweep starts its own local
    instance (which kvsim owns and stops), is not for the user: silenced while joining."""
    log = logging.getLogger(_RAY_TOKEN_LOGGER)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _token_auth_if_token() -> None:
    """Send Ray's authentication token when joining a cluster, as ``ray start`` uses it.

    With ``RAY_AUTH_MODE`` unset, ``ray start --head`` turns token authentication on
    whenever a token exists (``~/.ray/auth_token``, written by any earlier local
    ``ray.init()``, a sweep's own local instance included), but a client joining by
    address does not send it, and the join fails. Ray's own rule for ``ray start`` is
    applied to the client too: an explicit ``RAY_AUTH_MODE`` wins, and a token-mode client
    also joins a cluster without authentication. Ray versions without token
    authentication have nothing to do."""
    try:
        from ray._private.authentication import authentication_token_setup as setup  # noqa: PLC0415
    except ImportError:   # a Ray without token authentication
        return
    enable = getattr(setup, "maybe_enable_token_auth_if_token_available", None)
    if enable is not None:
        enable(warn_if_disabled=False)


def _run_ray(ray: Any, tasks: list[dict[str, Any]], jobs: int | None, address: str | None,
             done: Callable[[dict[str, Any]], None]) -> None:
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
            with _quiet_token_setup():
                if address is not None:
                    _token_auth_if_token()
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


@dataclass(eq=False)   # a DataFrame field has no truth value: identity, not a ValueError
class SweepResults:
    """A sweep folder read back.

    Attributes:
        path: the sweep folder.
        table: ``sweep.parquet`` as a pandas DataFrame (one row per point; columns
            in ``docs/columns.md``; an older folder's dotted summary columns are
            read as today's, see :func:`upgrade_table`).
        spec: ``sweep.toml``, parsed.
    """

    path: Path
    table: Any
    spec: dict[str, Any]

    def __repr__(self) -> str:
        """One line a notebook can show (the dataclass's own printed the table and all of
        ``sweep.toml``)."""
        status = self.table["status"].value_counts() if "status" in self.table.columns else {}
        counts = ", ".join(f"{n} {k}" for k, n in status.items())
        return (f"SweepResults({str(self.path)!r}, {len(self.table)} points ({counts or 'none run'}); "
                f"swept: {', '.join(self.swept) or '-'})")

    @property
    def swept(self) -> list[str]:
        """The swept-key columns of :attr:`table` (named by their dotted keys)."""
        cols = [str(c) for c in self.table.columns]
        end = cols.index(RESOLVED_COLUMNS[0]) if RESOLVED_COLUMNS[0] in cols else len(HEAD_COLUMNS)
        return cols[len(HEAD_COLUMNS):end]

    def run(self, which: str | int) -> RunResults:
        """One point's run folder (:func:`sim.load_results`): by point index (any integer,
        numpy's included), by run id, or by the index as text (``"3"``, ``"003"``).

        Raises:
            KeyError: no such point in the table.
        """
        t = self.table
        if isinstance(which, numbers.Integral) and not isinstance(which, bool):
            rows = t[t["point"] == int(which)]
        elif isinstance(which, str):
            rows = t[t["run_id"] == which]
            if not len(rows) and which.isdigit():
                rows = t[t["point"] == int(which)]
        else:
            raise KeyError(f"{which!r} is not a point index or run id")
        if len(rows) != 1:
            raise KeyError(f"no point {which!r} in {self.path / 'sweep.parquet'}")
        return load_results(self.path / str(rows["run_dir"].iloc[0]))

    def requests(self, include_failed: bool = False) -> Any:
        """Every request of the sweep's points as one long pandas DataFrame.

        Columns: ``point``, ``run_id``, ``run_dir``, ``run_status``, the swept
        keys, the resolved configuration (as in :attr:`table`), then the
        ``requests`` columns (``docs/columns.md``). Rows: the points in order,
        each in its table's order.

        Args:
            include_failed: also the partial tables of failed points (default:
                ok points only).
        """
        t = self.table
        names = ["point", "run_id", "run_dir", "status", *self.swept,
                 *(c for c in RESOLVED_COLUMNS if c in t.columns)]
        keys = pa.Table.from_pandas(t[names], preserve_index=False).replace_schema_metadata(None)
        keys = keys.rename_columns(["run_status" if n == "status" else n for n in names])
        tables = []
        for i in range(len(t)):
            ok = str(t["status"].iloc[i]) == "ok"
            if include_failed or ok:
                folder = self.path / str(t["run_dir"].iloc[i])   # an ok point's table must be there
                tables.append(with_keys(keys.slice(i, 1), read_table(folder, "requests", ok=ok)))
        return concat_frames(tables, pa.schema([*keys.schema, *arrow_schema("requests")]))


def upgrade_table(table: Any) -> Any:
    """A ``sweep.parquet`` (a ``pyarrow.Table``) written before the summary columns
    were renamed (dotted names, tables and lists as JSON text) with today's
    summary columns (:func:`sim.io.columns.flat_summary`); a current one as it is."""
    cols = list(table.column_names)
    if "seed" not in cols:
        return table
    start = cols.index("seed") + 1
    old = cols[start:]
    if not any("." in c for c in old):
        return table
    values = {c: table.column(c).to_pylist() for c in old}
    status = table.column("status").to_pylist()
    flats: list[dict[str, Any]] = []
    for i, st in enumerate(status):
        nested: dict[str, Any] = {}
        for c in old:
            v = values[c][i]
            if v is None or st != "ok":
                continue
            key = c.removeprefix("summary.")
            doc = SUMMARY_KEYS.get(key)
            if isinstance(v, str) and (doc.type in ("counts", "list") if doc else v[:1] in "{["):
                with contextlib.suppress(ValueError):
                    v = json.loads(v)
            section, _, leaf = key.partition(".")
            if leaf:
                nested.setdefault(section, {})[leaf] = v
            else:
                nested[key] = v
        flats.append(flat_summary(nested) if st == "ok" else {})
    out = table.select(cols[:start])
    for name, column in summary_arrays(flats).items():
        out = out.append_column(name if name not in cols[:start] else f"summary_{name}", column)
    return out


def load_sweep(path: str | Path) -> SweepResults:
    """Read a sweep folder written by ``kvsim sweep`` (or its ``sweep.parquet``).

    Raises:
        InputError: no ``sweep.parquet`` there, or it (or ``sweep.toml``) cannot be read.
    """

    folder = Path(path)
    if folder.is_file() and folder.name == "sweep.parquet":
        folder = folder.parent
    table_file = folder / "sweep.parquet"
    if not table_file.is_file():
        raise InputError(str(folder), "", "not a sweep folder (no sweep.parquet)",
                         "a folder written by kvsim sweep")
    spec_file = folder / "sweep.toml"
    spec = read_toml(spec_file) if spec_file.is_file() else {}
    table = read_parquet(table_file)
    if not all(c in table.column_names for c in ("point", "run_id", "run_dir")):
        raise InputError(str(table_file), "", "not a sweep table (no point, run_id or run_dir column)", RERUN)
    return SweepResults(path=folder, table=upgrade_table(table).to_pandas(), spec=spec)


def sweep_table(sweep: Sweep, report: SweepReport) -> str:
    """The points as plain aligned text: point, parameters, status, load verdict,
    rejected requests, CPU hit rate, TTFT p50 (of served requests)."""
    head = ["point", *sweep.swept, "status", "load", "rejected", "cpu hit", "ttft p50"]
    rows = [head]
    p50s = [((s.get("ttft_s") or {}).get("p50") if s and s.get("status") == "ok" else None)
            for s in (report.summaries.get(pt.index) for pt in sweep.points)]
    in_s = any(v is not None and v >= 10 for v in p50s)   # one unit for the whole column
    for pt in sweep.points:
        s = report.summaries.get(pt.index)
        load = rejected = hit = ttft = "-"
        if s is None:
            status = "not run"
        elif s.get("status") != "ok":
            status = "FAILED"
        else:
            rate = s.get("cpu_hit_rate")
            p50 = (s.get("ttft_s") or {}).get("p50")
            status = "ok"
            if "overloaded" in s:
                load = "OVERLOADED" if s["overloaded"] else "stable"
            rejected = str((s.get("requests") or {}).get("rejected", "-"))
            hit = "-" if rate is None else f"{100 * rate:.1f}%"
            ttft = duration_text(p50, seconds=in_s)
        values = (cell_text(pt.values.get(k, "")) for k in sweep.swept)
        rows.append([str(pt.index), *values, status, load, rejected, hit, ttft])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines) + f"\nresults  {report.out}"
