"""Bad-input errors: one line naming the file, the key or line, and what is allowed."""

from __future__ import annotations

__all__ = ["THE_SCENARIO", "InputError"]

#: the source of an :class:`InputError` raised where the scenario's file is not known (the
#: engine, while running it): whoever runs it puts the file's name in its place
THE_SCENARIO = "<scenario>"


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
        # all four in ``args`` so that ``type(e)(*e.args)`` (as SimPy re-raises a
        # process's exception) rebuilds the same error
        super().__init__(source, key, problem, allowed)
        self.source = source
        self.key = key
        self.problem = problem
        self.allowed = allowed

    def __str__(self) -> str:
        where = f"{self.source}:{self.key}" if self.key else self.source
        tail = f"; allowed: {self.allowed}" if self.allowed else ""
        return f"{where}: {self.problem}{tail}"
