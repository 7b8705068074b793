"""The ``kvsim`` command line.

Exit codes: 0 success (including runs that record modelled crashes); 1 a failed
expectation, a violated invariant or a simulator error (with its traceback:
that is a kvsim bug); 2 bad input, reported as one line
``kvsim: error: FILE:KEY: problem; allowed: ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.errors import InputError
from sim.io.check import evaluate, load_check_file, parse_check, summarize

__all__ = ["main"]


def _cmd_check(args: argparse.Namespace) -> int:
    path = Path(args.file)
    batch, items = load_check_file(path, jsonl=args.jsonl)
    results: list[Any] = []
    failed = False
    for i, item in enumerate(items):
        source = f"{path}[{i}]" if batch else str(path)
        try:
            if isinstance(item, dict) and "__error__" in item:
                raise InputError(source, "", item["__error__"])
            sc = parse_check(item, source)
        except InputError as exc:
            if not batch:
                raise
            results.append({"error": str(exc)})
            continue
        if args.logic:
            sc = sc.model_copy(update={"window_logic": args.logic})
        if args.copy_path:
            results.append(_replays(sc, source, args.json or args.jsonl))
            continue
        outcomes, mismatches = evaluate(sc, source)
        failed = failed or bool(mismatches)
        result: Any = outcomes if len(outcomes) > 1 else next(iter(outcomes.values()))
        results.append(result)
        if not (args.json or args.jsonl):
            name = sc.name or source
            for logic, out in outcomes.items():
                verdict = "MISMATCH" if logic in mismatches else (
                    "ok" if logic in sc.expect else "(no expectation)")
                print(f"{name} [{logic}] {summarize(out)}  {verdict}")
                for d in mismatches.get(logic, []):
                    print(f"    {d}")
    if args.jsonl:
        for r in results:
            print(json.dumps(r))
    elif args.json:
        print(json.dumps(results if batch else results[0], indent=None if batch else 2))
    return 1 if failed else 0


def _replays(sc: Any, source: str, quiet: bool) -> dict[str, Any]:
    """``check --copy-path``: the scenario replayed as a run with real copies,
    under NEW, OLD, and OLD with assertions stripped (``python -O``)."""
    from sim.tools.replay import replay_check

    out = {"new": replay_check(sc, "new", source=source),
           "old": replay_check(sc, "old", source=source),
           "old-O": replay_check(sc, "old", assertions=False, source=source)}
    if not quiet:
        for name, r in out.items():
            c = r["crash"]
            crash = f"CRASH {c['kind']} (group {c['group']}, chunk {c['chunk']})" if c else "no crash"
            bad = ", ".join(f"(group {g}, chunk {j})" for g, j in r["violations"]) or "none"
            hz = ", ".join(f"{k} ({g}, {j})" for k, g, j in r["hazards"]) or "none"
            print(f"{sc.name or source} [{name}] {r['external_tokens']} tokens loaded, {crash}, "
                  f"integrity violations: {bad}, hazards: {hz}")
    return out


def _cmd_regress(args: argparse.Namespace) -> int:
    from sim.tools.regress import format_table, run_library, write_junit

    root = Path(args.dir)
    if not root.is_dir():
        raise InputError(str(root), "", "not a directory", "a folder of check/1 TOML files")
    if args.jobs < 1:
        raise InputError("argument", "--jobs", f"{args.jobs}", "an integer >= 1")
    results = run_library(root, jobs=args.jobs)
    if not results:
        raise InputError(str(root), "", "no *.toml case found", "a folder of check/1 TOML files")
    print(format_table(results, root))
    if args.junit:
        write_junit(results, Path(args.junit))
    return 0 if all(r.ok for r in results) else 1


class _Override(argparse.Action):
    """Collects ``--set``, ``--seed`` and ``--logic`` into one ordered list (rightmost wins)."""

    def __init__(self, option_strings: Sequence[str], dest: str, key: str | None = None,
                 **kwargs: Any) -> None:
        self.key = key
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        text = str(values) if self.key is None else f"{self.key}={values}"
        items.append((option_string or "--set", text))
        setattr(namespace, self.dest, items)


def add_override_options(p: argparse.ArgumentParser, what: str = "a scenario key", *,
                         seed: bool = True, logic: bool = False) -> None:
    """``--set KEY=VALUE`` (repeatable) and its shorthands, all into ``args.overrides``."""
    p.add_argument("--set", dest="overrides", action=_Override, metavar="KEY=VALUE",
                   help=f"override {what} (TOML value), e.g. cpu_cache.capacity=128GiB; repeatable")
    if seed:
        p.add_argument("--seed", dest="overrides", action=_Override, key="seed", metavar="N",
                       help="shorthand for --set seed=N")
    if logic:
        p.add_argument("--logic", dest="overrides", action=_Override, key="window_logic",
                       metavar="old|new", help="shorthand for --set window_logic=...")
    p.set_defaults(overrides=[])


def _cmd_run(args: argparse.Namespace) -> int:
    import traceback

    from sim.io.results import RunWriter, execute, summary_table
    from sim.io.scenario import load_run

    spec = load_run(Path(args.scenario), args.overrides or [])
    target = Path(args.out) if args.out else Path("results") / spec.name
    writer = RunWriter(target, overwrite=args.overwrite)
    quiet = args.quiet or not sys.stderr.isatty()
    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(total=spec.expected_requests, unit="req", desc=spec.name, file=sys.stderr,
                   dynamic_ncols=True)

    def progress(finished: int, sim_time_s: float) -> None:
        if bar is not None:
            bar.set_postfix_str(f"sim {sim_time_s:.1f} s", refresh=False)
            bar.update(finished - bar.n)

    try:
        outcome = execute(spec, writer, progress=progress, argv=sys.argv)
    finally:
        if bar is not None:
            bar.close()
    if outcome.status != "ok":
        err = outcome.error
        if err is not None:
            traceback.print_exception(err, file=sys.stderr)
        print(f"kvsim: run failed; summary written to {outcome.folder}", file=sys.stderr)
        return 1
    print(summary_table(outcome.summary, outcome.folder))
    if args.plots:
        from sim.tools.plots import write_plots

        for path in write_plots(outcome.folder):
            print(f"plot: {path}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from sim.tools.compare import compare_runs, format_table

    quiet = args.quiet or not sys.stderr.isatty()
    result = compare_runs(Path(args.scenario), args.out, args.overrides or [], jobs=args.jobs,
                          progress=not quiet, overwrite=args.overwrite,
                          verify_reproducers=args.verify_reproducers, argv=sys.argv)
    print(format_table(result.figures, result.path))
    if result.status != "ok":
        for logic, tb in result.errors.items():
            print(f"kvsim: the {logic.upper()} run failed:", file=sys.stderr)
            print(tb, file=sys.stderr, end="")
        print(f"kvsim: a run failed; compare written to {result.path}", file=sys.stderr)
        return 1
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from sim.io.scenario import validate_file

    code = 0
    for name in args.files:
        try:
            print(f"{name}: ok ({validate_file(Path(name))})")
        except InputError as exc:
            print(f"kvsim: error: {exc}", file=sys.stderr)
            code = 2
    return code


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from sim.io.scenario import parse_size

    try:
        from sim.engine import copypath
    except ImportError as exc:  # torch is an optional extra
        if (exc.name or "").partition(".")[0] != "torch":
            raise
        raise InputError("calibrate", "", "torch is not installed", "pip install 'kvsim[torch]'") from None

    def items(option: str, text: str, parse: Any) -> list[int]:
        try:
            values = [parse(x) for x in text.split(",") if x.strip()]
        except ValueError as exc:
            raise InputError("argument", option, str(exc)) from None
        if not values or min(values) < 1:
            raise InputError("argument", option, f"{text!r}", "a comma-separated list of positive values")
        return values

    chunks = items("--chunk-bytes", args.chunk_bytes, parse_size) if args.chunk_bytes else \
        list(copypath.DEFAULT_CHUNK_BYTES)
    batches = items("--batch", args.batch, int) if args.batch else list(copypath.DEFAULT_BATCH_SIZES)
    if args.repeats < 1:
        raise InputError("argument", "--repeats", f"{args.repeats}", "a positive integer")
    try:
        result = copypath.calibrate(args.device, chunks, batches, args.repeats)
    except ValueError as exc:
        raise InputError("calibrate", "", str(exc)) from None
    snippet = copypath.hardware_snippet(result)
    print(copypath.format_table(result))
    print()
    print(snippet, end="")
    if args.out:
        try:
            copypath.write_text_atomic(Path(args.out), snippet)
        except OSError as exc:
            raise InputError("argument", "--out", f"{args.out!r}: {exc.strerror}",
                             "a writable file path") from None
        print(f"kvsim: wrote {args.out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsim",
        description="Simulator of vLLM's multi-group KV-cache CPU offloading (OLD 0.29 vs NEW 0.30).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="one request's lookup + allocation + load plan (check/1 file)")
    p.add_argument("file", help="check/1 scenario: TOML, JSON object, JSON list (batch) or JSON Lines")
    p.add_argument("--json", action="store_true", help="print outcomes as JSON")
    p.add_argument("--jsonl", action="store_true", help="read and write JSON Lines (batch)")
    p.add_argument("--logic", choices=["old", "new", "both"], help="override window_logic")
    p.add_argument("--copy-path", action="store_true",
                   help="replay as a run with real tensor copies (needs torch): NEW, OLD, OLD with "
                        "assertions stripped; report crashes and integrity violations")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("regress", help="run the crash regression library")
    p.add_argument("dir", nargs="?", default="scenarios/crash", help="folder of check/1 files")
    p.add_argument("--junit", metavar="FILE", help="also write a JUnit XML report")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="J",
                   help="worker processes (default: CPU count); results keep file-name order")
    p.set_defaults(func=_cmd_regress)

    p = sub.add_parser("run", help="run a scenario (run/1 file) and write results/<name>/")
    p.add_argument("scenario", help="run/1 scenario TOML")
    p.add_argument("--out", metavar="DIR", help="the run folder (default: results/<name>)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty run folder")
    add_override_options(p, logic=True)
    p.add_argument("--plots", action="store_true", help="also write plots/*.png")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("compare", help="run a scenario under OLD and NEW logic and compare (same seed)")
    p.add_argument("scenario", help="run/1 scenario TOML (its window_logic is replaced per run)")
    p.add_argument("--out", metavar="DIR", help="the compare folder (default: results/<name>/compare)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty compare folder")
    add_override_options(p)
    p.add_argument("--jobs", type=int, default=2, choices=[1, 2],
                   help="2: both runs in parallel processes (default); 1: one after the other")
    p.add_argument("--verify-reproducers", action="store_true",
                   help="replay every reproducer with kvsim check and report whether it reproduces")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("validate", help="check scenario files (any schema) without running them")
    p.add_argument("files", nargs="+", metavar="FILE", help="run/1, model/1, hardware/1 or check/1 files")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("calibrate", help="measure copy bandwidth of the torch copy path (needs torch)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to copy")
    p.add_argument("--chunk-bytes", metavar="LIST", help="bytes per chunk, e.g. 64KiB,1MiB,8MiB")
    p.add_argument("--batch", metavar="LIST", help="chunks per job, e.g. 1,16,64,256")
    p.add_argument("--repeats", type=int, default=5, metavar="N", help="timed runs per figure (median)")
    p.add_argument("--out", metavar="FILE", help="also write the [hardware] TOML snippet to FILE")
    p.set_defaults(func=_cmd_calibrate)

    from sim.io.traces import add_trace_parser

    add_trace_parser(sub)  # kvsim trace stats | fetch | convert

    from sim.tools.fuzz import add_fuzz_parser

    add_fuzz_parser(sub)  # kvsim fuzz --budget N | --runs N

    from sim.tools.sweep import add_sweep_parser

    add_sweep_parser(sub)  # kvsim sweep FILE [--jobs N] [--backend local|ray]

    from sim.tools.plots import add_plot_parser

    add_plot_parser(sub)  # kvsim plot RESULTS_DIR [--out DIR]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvsim`` console script."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except InputError as exc:
        print(f"kvsim: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`kvsim check --json ... | head`): stop quietly, as cat does;
        # stdout is pointed at devnull so the interpreter's final flush cannot raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
