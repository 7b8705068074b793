"""The crash regression library runner (``kvsim regress``).

Every ``check/1`` file under a directory (subfolders included, e.g. the
fuzzer's ``fuzz/``) is a regression case: its stated
expectations under OLD and/or NEW must hold. A case without expectations is
itself a failure (a case that cannot fail guards nothing).

One bad case never stops the others: a case that fails validation (bad
input, :class:`~sim.errors.InputError`) or whose evaluation raises is
reported as an error of that case (``error``; ``bad_input`` tells the two
apart) and the library goes on; the caller fails at the end.
"""

from __future__ import annotations

import os
import traceback
import xml.etree.ElementTree as ET
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.errors import InputError
from sim.io.check import evaluate, iter_check_files, load_check_file, parse_check, summarize
from sim.tools.run import owned, worker_init

__all__ = ["CaseResult", "run_library", "write_junit"]


@dataclass(slots=True)
class CaseResult:
    """Outcome of one library file."""

    path: Path
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)
    mismatches: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    #: the error is bad input (the case does not validate), not a failure of its evaluation
    bad_input: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.mismatches


def run_case(path: Path) -> CaseResult:
    """Run one library file; never raises for a bad or failing case (see the module docstring)."""
    res = CaseResult(path)
    try:
        _, items = load_check_file(path)
        sc = parse_check(items[0], str(path))
    except InputError as exc:
        res.error, res.bad_input = str(exc), True
        return res
    if not sc.expect:
        res.error = f"{path}: no [expect.old] or [expect.new]: a case must state its outcome"
        res.bad_input = True
        return res
    try:
        res.outcomes, res.mismatches = evaluate(sc, str(path))
    except InputError as exc:
        res.error, res.bad_input = str(exc), True
    except Exception as exc:  # one case's failure must not stop the library
        where = traceback.extract_tb(exc.__traceback__)[-1]
        res.error = (f"{path}: evaluating the case raised {type(exc).__name__}: {exc} "
                     f"(at {Path(where.filename).name}:{where.lineno})")
    return res


def run_library(root: Path, jobs: int | None = None) -> list[CaseResult]:
    """Run every case under ``root`` and its subfolders, in file-name order.

    Args:
        root: the library folder.
        jobs: worker processes (default ``os.cpu_count()``); 1 runs the cases
            in this process. The results are in file-name order either way.
    """
    paths = list(iter_check_files(root))
    workers = min(jobs or os.cpu_count() or 1, len(paths))
    if workers <= 1:
        return [run_case(p) for p in paths]
    pool = ProcessPoolExecutor(max_workers=workers, initializer=worker_init, initargs=(os.getpid(),))
    with owned(pool):
        return list(pool.map(run_case, paths, chunksize=max(1, len(paths) // (4 * workers))))


def library_table(results: list[CaseResult], root: Path) -> str:
    """A plain-text table: case, OLD outcome, NEW outcome, verdict, then diffs."""
    rows = [("case", "old", "new", "result")]
    for r in results:
        name = str(r.path.relative_to(root)) if r.path.is_relative_to(root) else str(r.path)
        old = summarize(r.outcomes["old"]) if "old" in r.outcomes else "-"
        new = summarize(r.outcomes["new"]) if "new" in r.outcomes else "-"
        rows.append((name, old, new, "ok" if r.ok else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in results:
        if r.error:
            lines.append(f"ERROR {r.error}")
        for logic, diffs in r.mismatches.items():
            for d in diffs:
                lines.append(f"MISMATCH {r.path.name} [{logic}] {d}")
    passed = sum(r.ok for r in results)
    lines.append(f"{passed} passed, {len(results) - passed} failed")
    return "\n".join(lines)


def write_junit(results: list[CaseResult], path: Path) -> None:
    """Write a JUnit XML report (one testcase per file).

    Raises:
        InputError: it cannot be written (one ``--junit`` line).
    """
    suite = ET.Element("testsuite", name="kvsim-regress", tests=str(len(results)),
                       failures=str(sum(1 for r in results if r.mismatches)),
                       errors=str(sum(1 for r in results if r.error)))
    for r in results:
        case = ET.SubElement(suite, "testcase", classname="crash", name=r.path.stem)
        if r.error:
            ET.SubElement(case, "error", message=r.error)
        elif r.mismatches:
            text = "\n".join(f"[{k}] {d}" for k, ds in r.mismatches.items() for d in ds)
            ET.SubElement(case, "failure", message="expectation mismatch").text = text
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        ET.ElementTree(suite).write(tmp, encoding="utf-8", xml_declaration=True)
        tmp.replace(path)
    except OSError as exc:  # one --junit line, no temporary file left
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
        raise InputError("argument", "--junit", f"{path}: {exc.strerror or exc}",
                         "a file path in a writable folder") from None
