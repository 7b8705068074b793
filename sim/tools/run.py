"""One run, start to finish: resolve -> build -> simulate -> finalize.

:func:`execute` owns the run lifecycle (STYLE practice 11): it asks the
scenario for the engine's configuration and request stream, streams the
engine's rows into a :class:`~sim.io.results.RunWriter`'s temporary folder,
writes the reproducers of modelled crashes (each checked in isolation with
:func:`~sim.io.check.run_check`), and always finishes the folder with a
``summary.json`` (status ``"ok"``, ``"failed"`` or ``"interrupted"``).

Signals and worker processes (shared by run, compare and sweep)
    :func:`interruptible` turns SIGINT and SIGTERM into :class:`Interrupted`
    (a ``KeyboardInterrupt`` that knows its signal; the command exits
    ``128 + signal``: 130, 143); :func:`worker_init` makes a pool worker
    leave Ctrl-C to its parent and die with it (``PR_SET_PDEATHSIG`` on
    Linux, and a thread that watches the parent's pid everywhere), and
    :func:`stop_pool` ends a pool's workers at once, :func:`owned` does so when
    an interrupt leaves the block that owns the pool; :func:`pool_map` is the
    pool's ``map`` with a bounded number of tasks submitted, ending the pool
    at once when its consumer is interrupted.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import platform
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

from sim.engine.loop import simulate
from sim.engine.metrics import OPTIONAL_TABLES, TABLES, Recorder
from sim.errors import THE_SCENARIO, InputError
from sim.io.check import write_reproducers
from sim.io.results import ParquetSink, RunWriter, clean_floats, out_error
from sim.io.scenario import HARDWARE_WARNINGS_KEY, RunSpec
from sim.io.workload import Request

_T = TypeVar("_T")
_R = TypeVar("_R")

__all__ = ["Interrupted", "RunOutcome", "child_preexec", "execute", "interruptible", "owned", "pool_map",
           "signal_name", "signal_of", "stop_pool", "worker_init"]


# -- signals and worker processes --------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (raised by :func:`interruptible`'s handler).

    Attributes:
        signum: the signal.
        kept: what the interrupted command left, in words ("previous results/x kept"),
            set by the code that cleaned up; empty when nothing is known.
    """

    def __init__(self, signum: int = signal.SIGINT, kept: str = "") -> None:
        super().__init__(signum)
        self.signum = int(signum)
        self.kept = kept


def signal_of(exc: BaseException) -> int:
    """The signal behind a ``KeyboardInterrupt`` (SIGINT unless it is an :class:`Interrupted`)."""
    return exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)


def signal_name(signum: int) -> str:
    """``"SIGINT"``, ``"SIGTERM"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (in this block).

    Only the first signal raises: later ones are ignored while the command
    cleans up (it ends soon after). Outside the main thread nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal fired
        if fired:
            return
        fired = True
        raise Interrupted(signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


#: prctl option: the signal a process gets when its parent dies
_PR_SET_PDEATHSIG = 1


def worker_init(parent_pid: int) -> None:
    """Initializer of pool workers: leave Ctrl-C to the parent, die with it.

    On Linux the kernel sends SIGKILL when the parent dies
    (``PR_SET_PDEATHSIG``); everywhere a daemon thread checks twice a second
    that the parent is still the same process and ends this one otherwise.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # whatever importing the command line installed
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="kvsim-parent-watch", daemon=True).start()


def child_preexec() -> None:
    """``preexec_fn`` of a child process its parent ends (a benchmark's timed run of a fresh
    interpreter): Ctrl-C is left to the parent, and the child dies with it.

    SIGINT is ignored from the child's first instruction (an interpreter that starts with
    SIGINT ignored leaves it so), so a Ctrl-C to the process group cannot raise in the child
    at a point where Python only prints "Exception ignored" and goes on; the parent's
    ``subprocess.run`` kills the child as the interrupt unwinds it. On Linux the kernel also
    kills the child when the parent dies (``PR_SET_PDEATHSIG``).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def stop_pool(pool: ProcessPoolExecutor, timeout_s: float = 5.0) -> None:
    """End a pool now: terminate its workers, wait for them (kill after ``timeout_s``).

    The tasks still queued for the dead workers are abandoned: the pool's call queue
    is told not to wait for its feeder thread at exit (``cancel_join_thread``). That
    thread may be blocked for good writing into the pipe the workers no longer read,
    and joining it when the interpreter exits would hang the command (seen as a
    Ctrl-C of ``kvsim regress --jobs 2`` that never ended)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    call_queue = getattr(pool, "_call_queue", None)   # the executor's own queue (CPython internals)
    if call_queue is not None:
        with contextlib.suppress(Exception):
            call_queue.cancel_join_thread()
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.terminate()
    with contextlib.suppress(Exception):
        pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        with contextlib.suppress(Exception):
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)


@contextlib.contextmanager
def owned(pool: ProcessPoolExecutor | None) -> Iterator[None]:
    """Own ``pool`` (None: no pool) for a block: when the block ends, shut it down as usual
    (waiting for its workers); when an exception leaves the block (an interrupt, a
    worker's error), end it at once with :func:`stop_pool`, never waiting for it."""
    if pool is None:
        yield
        return
    try:
        yield
    except BaseException:
        stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def pool_map(pool: ProcessPoolExecutor, fn: Callable[[_T], _R], items: Iterable[_T],
             ahead: int) -> Iterator[_R]:
    """``fn`` over ``items`` in ``pool``, results in order, as ``pool.map`` gives them; but at
    most ``ahead`` tasks are submitted and not yet consumed (``pool.map`` submits every item
    at once: tens of thousands of futures for a large fuzz budget), and when the consumer
    stops early (an interrupt, an error, the generator closed) the pool is ended at once
    (:func:`stop_pool`), never waited for. After the last result the caller shuts the pool
    down as usual."""
    it = iter(items)
    window: deque[Future[_R]] = deque()
    finished = False
    try:
        for item in it:
            window.append(pool.submit(fn, item))
            if len(window) >= ahead:
                break
        while window:
            result = window.popleft().result()
            for item in it:
                window.append(pool.submit(fn, item))
                break
            yield result
        finished = True
    finally:
        if not finished:
            for fut in window:
                fut.cancel()
            stop_pool(pool)


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


def vllm_version_note() -> str:
    """The installed vLLM's version (``decisions = "vllm"``); warns once on stderr when it is
    not one of the versions the mode is tested against."""
    from sim.model.real_vllm import SUPPORTED_VERSIONS, installed_version  # noqa: PLC0415

    v = installed_version()
    if v not in SUPPORTED_VERSIONS:
        print(f"kvsim: warning: vLLM {v} is not one of the tested versions "
              f"({', '.join(SUPPORTED_VERSIONS)}); trying it", file=sys.stderr)
    return v


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("kvsim", "simpy", "pydantic", "pandas", "pyarrow", "numpy", "tqdm", "tomli-w", "vllm"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            if dist != "vllm":  # noted only where installed (the vllm decision mode)
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
    summary files are written and the folder is moved into place (the
    target, or beside a previous result: see :class:`~sim.io.results.RunWriter`).
    If the simulation raises, the folder still gets ``summary.json`` with
    status ``"failed"`` and the error message. On ``KeyboardInterrupt``
    (Ctrl-C, or SIGTERM through :func:`interruptible`) the rows of what did
    finish are written, the folder gets status ``"interrupted"``, and the
    interrupt is re-raised (``writer.published`` says where the folder went).
    Bad input found while running (a bad trace line: :class:`InputError`)
    and an output that cannot be written (a full disk: an ``--out``
    :class:`InputError`) leave nothing behind and are raised.

    Args:
        spec: the validated scenario.
        writer: the folder writer (its target already checked).
        progress: called with (requests finished, simulated seconds).
        argv: the command line, for ``run_info.json``.
    """

    scenario_toml = spec.resolved_toml()
    config = spec.engine_config()
    requests = _Guarded(spec.requests())
    header: dict[str, Any] = {"name": spec.name, "seed": spec.scenario.seed,
                              "window_logic": spec.scenario.window_logic}
    if config.decisions != "model":
        header["decisions"] = config.decisions
        header["vllm_version"] = vllm_version_note()
    last = {"requests_finished": 0, "sim_time_s": 0.0}

    def on_progress(finished: int, sim_time_s: float) -> None:
        last["requests_finished"] = finished
        last["sim_time_s"] = sim_time_s
        if progress is not None:
            progress(finished, sim_time_s)

    started, t0 = time.time(), time.perf_counter()
    sink: ParquetSink | None = None
    recorder: Recorder | None = None
    try:
        sink = ParquetSink(writer.start())
        recorder = Recorder(sink)
        differential = None
        if config.decisions == "differential":
            from sim.tools.differential import WatchingRecorder, simulate_differential  # noqa: PLC0415

            recorder = WatchingRecorder(sink)
            first: list[Iterator[Request]] = [requests]   # kvsim's side reads the guarded stream

            def streams() -> Iterator[Request]:
                return first.pop() if first else spec.requests()

            result, differential = simulate_differential(config, streams, recorder,
                                                         folder=writer.folder, progress=on_progress)
        elif config.decisions == "vllm":
            from sim.engine.vllm_engine import simulate_vllm  # noqa: PLC0415 -- imports vLLM

            result = simulate_vllm(config, requests, recorder, progress=on_progress)
        else:
            result = simulate(config, requests, recorder, progress=on_progress)
        sink.close()
    except BaseException as exc:
        bad_input = exc if isinstance(exc, InputError) else requests.error
        if bad_input is not None and bad_input.source == THE_SCENARIO:   # raised by the engine: name the file
            bad_input = InputError(str(spec.source), bad_input.key, bad_input.problem, bad_input.allowed)
        if bad_input is None and sink is not None and sink.error is not None:
            bad_input = out_error(writer.target, sink.error)  # a full disk: the output failed, not the run
        if bad_input is not None or sink is None:  # nothing is left behind
            if sink is not None:
                _close_quietly(sink)
            writer.abort()
            if bad_input is None:
                raise
            raise bad_input from None
        interrupted = isinstance(exc, KeyboardInterrupt)
        if interrupted and recorder is not None:
            _flush_quietly(recorder)
        _close_quietly(sink)
        status = "interrupted" if interrupted else "failed"
        error = (f"interrupted ({signal_name(signal_of(exc))})" if interrupted
                 else traceback.format_exception_only(exc)[-1].strip())
        summary: dict[str, Any] = {"run": header, "error": error, "progress": dict(last)}
        if recorder is not None:
            summary["rows"] = {t: n for t, n in recorder.rows_written.items()
                               if n or t not in OPTIONAL_TABLES}   # no tiers: no tiers key
            if interrupted:  # progress is reported every 100 requests; the table has them all
                last["requests_finished"] = max(last["requests_finished"], recorder.rows_written["requests"])
                summary["progress"] = dict(last)
        info = _run_info(started, time.perf_counter() - t0, argv, int(last["requests_finished"]))
        target = writer.finish(status, summary, scenario_toml, info)
        if not isinstance(exc, Exception):
            raise
        return RunOutcome("failed", target, {**summary, "status": "failed"}, exc)
    try:
        figures = result.summary.figures()
        summary = {"run": header, "end": result.status, **figures}
        if differential is not None:
            summary["differential"] = differential.to_dict()
        if spec.warnings:   # doubtful but valid settings (a CPU cache beyond the run's share of the node)
            summary[HARDWARE_WARNINGS_KEY] = list(spec.warnings)
        if result.reproducers:
            try:
                summary["reproducers"] = write_reproducers(writer.folder / "reproducers", result.reproducers)
            except OSError as exc:
                raise out_error(writer.target, exc) from None
        bad = spec.bad_lines
        if bad is not None:   # workload.skip_bad: never silently dropped
            summary["workload"] = {"bad_lines_skipped": bad.count, "bad_line_examples": list(bad.examples)}
        info = _run_info(started, time.perf_counter() - t0, argv, int(figures["requests"]["finished"]))
        target = writer.finish("ok", summary, scenario_toml, info)
    except BaseException:
        writer.abort()  # interrupted (or the output failed) while finishing: nothing is left
        raise
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


def _flush_quietly(recorder: Recorder) -> None:
    """Hand the buffered rows of an interrupted run to the sink, table by table.

    The interrupt may have come in the middle of :meth:`Recorder.add`, leaving
    a row in some columns only: the columns are cut back to the rows counted
    first, so that every table still gets the rows that were complete.
    """
    cols = getattr(recorder, "_cols", None)
    counts = getattr(recorder, "_count", None)
    if isinstance(cols, dict) and isinstance(counts, dict):
        for table, columns in cols.items():
            n = int(counts.get(table, 0))
            for col in columns:
                with contextlib.suppress(Exception):
                    del col[n:]
    flush_one = getattr(recorder, "_flush", None)
    if flush_one is None:
        with contextlib.suppress(Exception):
            recorder.flush()
        return
    for table in TABLES:
        with contextlib.suppress(Exception):
            flush_one(table)
