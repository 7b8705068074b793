"""Signals while a command starts and runs: one line, never a traceback.

Importing this module (which :mod:`sim.cli` and the scripts of ``benchmarks/``
do before their heavy imports: pandas, pyarrow, torch, the model) installs
handlers so that Ctrl-C or SIGTERM during the first second ends the command
with one line too (nothing has been written yet); :func:`sim.cli.main`
installs the real handlers once it runs, and a benchmark script runs its
``main`` through :func:`run_script`, which turns either signal into one line
after the cleanups on the way out (``with`` blocks, ``finally``) have run.

A benchmark script that starts with SIGINT ignored is a child its parent ends
(a timed run, :func:`sim.tools.run.child_preexec`): it gets no handlers at
all, so that it never prints a line of its own.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import NoReturn

__all__ = ["install", "run_script"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _label() -> str:
    """The name the one line starts with: a benchmark script's own, else ``kvsim``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.endswith(".py") and Path(argv0).resolve().parent.name == "benchmarks":
        return Path(argv0).stem
    return "kvsim"


def _ended_by_parent() -> bool:
    """A benchmark script started with SIGINT ignored: a child its parent ends."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN and _label() != "kvsim"


def _starting(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    sys.stderr.write(f"{_label()}: interrupted ({name}) while starting; nothing written\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def install() -> None:
    """Handle SIGINT and SIGTERM with one line until the command installs its own."""
    if _ended_by_parent():
        return
    for sig in _SIGNALS:
        signal.signal(sig, _starting)


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Run a benchmark script's ``main`` and exit with its code; SIGINT or SIGTERM raise
    ``KeyboardInterrupt`` in it (its cleanups run) and end it with one line,
    ``NAME: interrupted (SIGINT)``, and exit code 128 + the signal."""
    if _ended_by_parent():
        sys.exit(main() or 0)
    got: list[int] = []

    def raising(signum: int, frame: FrameType | None) -> None:
        got.append(signum)
        raise KeyboardInterrupt

    for sig in _SIGNALS:
        signal.signal(sig, raising)
    try:
        code = main()
    except KeyboardInterrupt:
        for sig in _SIGNALS:   # the way out is quiet: a second Ctrl-C adds nothing
            signal.signal(sig, signal.SIG_IGN)
        signum = got[0] if got else int(signal.SIGINT)
        sys.stderr.write(f"{_label()}: interrupted ({signal.Signals(signum).name})\n")
        sys.stderr.flush()
        sys.exit(128 + signum)
    sys.exit(code or 0)


install()
