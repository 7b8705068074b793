"""Signals while ``kvsim`` starts: importing this module (which :mod:`sim.cli`
does before its heavy imports: pandas, pyarrow, the model) installs handlers
so that Ctrl-C or SIGTERM during the first second ends the command with one
line too (nothing has been written yet); :func:`sim.cli.main` installs the
real handlers once it runs. Nothing else imports it.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["install"]


def _starting(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    sys.stderr.write(f"kvsim: interrupted ({name}) while starting; nothing written\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def install() -> None:
    """Handle SIGINT and SIGTERM with one line until the command installs its own."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _starting)


install()
