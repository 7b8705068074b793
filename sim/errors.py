"""Bad-input errors: one line naming the file, the key or line, and what is allowed."""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(Exception):
    """Bad user input (scenario, trace, command line). The CLI prints
    ``kvsim: error: FILE:KEY: problem; allowed: ...`` and exits 2.

    Args:
        source: the file (or "argument", "--set") the input came from.
        key: the dotted key, ``line N``, or option name.
        problem: what is wrong, quoting the offending value.
        allowed: what would be accepted.
    """

    def __init__(self, source: str, key: str, problem: str, allowed: str = "") -> None:
        self.source = source
        self.key = key
        self.problem = problem
        self.allowed = allowed
        where = f"{source}:{key}" if key else source
        tail = f"; allowed: {allowed}" if allowed else ""
        super().__init__(f"{where}: {problem}{tail}")
