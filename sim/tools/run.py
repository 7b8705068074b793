"""One run, start to finish: resolve -> build -> simulate -> finalize.

:func:`execute` owns the run lifecycle (STYLE practice 11): it asks the
scenario for the engine's configuration and request stream, streams the
engine's rows into a :class:`~sim.io.results.RunWriter`'s temporary folder,
writes the reproducers of modelled crashes (each checked in isolation with
:func:`~sim.io.check.run_check`), and always finishes the folder with a
``summary.json`` (status ``"ok"`` or ``"failed"``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from sim.engine.loop import simulate
from sim.engine.metrics import Recorder
from sim.errors import InputError
from sim.io.check import write_reproducers
from sim.io.results import ParquetSink, RunWriter, clean_floats
from sim.io.scenario import RunSpec
from sim.io.workload import Request

__all__ = ["RunOutcome", "execute"]


# -- one run, start to finish ------------------------------------------------------------


@dataclass
class RunOutcome:
    """What :func:`execute` did.

    Attributes:
        status: ``"ok"`` or ``"failed"`` (as in ``summary.json``).
        folder: the run folder.
        summary: the contents of ``summary.json``.
        error: the exception of a failed run.
    """

    status: str
    folder: Path
    summary: dict[str, Any]
    error: BaseException | None = None


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("kvsim", "simpy", "pydantic", "pandas", "pyarrow", "numpy", "tqdm", "tomli-w"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _run_info(started: float, wall_s: float, argv: Sequence[str], finished: int) -> dict[str, Any]:
    return {
        "started_utc": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(timespec="seconds"),
        "wall_clock_s": wall_s,
        "requests_per_wall_s": finished / wall_s if wall_s > 0 else None,
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": _versions(),
        "argv": list(argv),
        "pid": os.getpid(),
    }


def execute(spec: RunSpec, writer: RunWriter, *, progress: Callable[[int, float], None] | None = None,
            argv: Sequence[str] = ()) -> RunOutcome:
    """Run a scenario and write its folder: resolve -> build -> simulate -> finalize.

    The engine's rows stream into the temporary folder; at the end the
    summary files are written and the folder is renamed onto the target. If
    the simulation raises, the folder still gets ``summary.json`` with status
    ``"failed"`` and the error message (and ``KeyboardInterrupt`` and the like
    are re-raised after that). Bad input found while running (a bad trace
    line: :class:`InputError`) leaves nothing behind and is re-raised.

    Args:
        spec: the validated scenario.
        writer: the folder writer (its target already checked).
        progress: called with (requests finished, simulated seconds).
        argv: the command line, for ``run_info.json``.
    """

    scenario_toml = spec.resolved_toml()
    config = spec.engine_config()
    requests = _Guarded(spec.requests())
    header = {"name": spec.name, "seed": spec.scenario.seed, "window_logic": spec.scenario.window_logic}
    last = {"requests_finished": 0, "sim_time_s": 0.0}

    def on_progress(finished: int, sim_time_s: float) -> None:
        last["requests_finished"] = finished
        last["sim_time_s"] = sim_time_s
        if progress is not None:
            progress(finished, sim_time_s)

    started, t0 = time.time(), time.perf_counter()
    folder = writer.start()
    sink = ParquetSink(folder)
    try:
        result = simulate(config, requests, Recorder(sink), progress=on_progress)
        sink.close()
    except BaseException as exc:
        bad_input = exc if isinstance(exc, InputError) else requests.error
        if bad_input is not None:  # a bad trace line: bad input, nothing is left behind
            _close_quietly(sink)
            writer.abort()
            raise bad_input from None
        _close_quietly(sink)
        summary = {"run": header, "error": traceback.format_exception_only(exc)[-1].strip(),
                   "progress": dict(last)}
        info = _run_info(started, time.perf_counter() - t0, argv, int(last["requests_finished"]))
        target = writer.finish("failed", summary, scenario_toml, info)
        if not isinstance(exc, Exception):
            raise
        return RunOutcome("failed", target, {**summary, "status": "failed"}, exc)
    figures = result.summary.figures()
    summary = {"run": header, "end": result.status, **figures}
    if result.reproducers:
        summary["reproducers"] = write_reproducers(folder / "reproducers", result.reproducers)
    bad = spec.bad_lines
    if bad is not None:   # workload.skip_bad: never silently dropped
        summary["workload"] = {"bad_lines_skipped": bad.count, "bad_line_examples": list(bad.examples)}
    info = _run_info(started, time.perf_counter() - t0, argv, int(figures["requests"]["finished"]))
    target = writer.finish("ok", summary, scenario_toml, info)
    return RunOutcome("ok", target, {**clean_floats(summary), "status": "ok"})


class _Guarded:
    """Wraps the request stream and keeps the :class:`InputError` it raises.

    The engine consumes the stream inside a SimPy process, and SimPy re-raises
    a process's exception by re-instantiating it from its ``args``; the
    original error is kept here so that it is reported as bad input (exit 2)
    whatever happens to it on the way out.
    """

    def __init__(self, requests: Iterator[Request]) -> None:
        self._it = requests
        self.error: InputError | None = None

    def __iter__(self) -> _Guarded:
        return self

    def __next__(self) -> Request:
        try:
            return next(self._it)
        except InputError as exc:
            self.error = exc
            raise


def _close_quietly(sink: ParquetSink) -> None:
    """Close after a failure; the run's own error is the one to report."""
    with contextlib.suppress(Exception):
        sink.close()
