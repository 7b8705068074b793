"""The ``kvsim`` command line.

Exit codes: 0 success (including runs that record modelled crashes); 1 a failed
expectation, a violated invariant or a simulator error (with its traceback:
that is a kvsim bug); 2 bad input, reported as one line
``kvsim: error: FILE:KEY: problem; allowed: ...`` (an ``--out`` that cannot be
written included); 130 / 143 interrupted by SIGINT / SIGTERM, reported as one
line ``kvsim: interrupted (SIGINT); ...`` saying what was kept.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, cast

from tqdm import tqdm

import sim.startup  # noqa: F401 -- first: a signal during the heavy imports below ends in one line
from sim.engine.gcpolicy import rare_collections
from sim.errors import InputError
from sim.io.check import evaluate, json_dumps, load_check_file, prepare_check, scenario_outcomes, summarize
from sim.io.results import (
    RunWriter,
    find_incomplete,
    make_folder,
    remove_created,
    summary_table,
    summary_warnings,
    temp_beside,
    write_text_atomic,
)
from sim.io.scenario import TORCH_ALLOWED, kvsim_version, load_run, parse_size, torch_missing
from sim.io.traces import (
    FORMATS,
    KNOWN_TRACES,
    MOONCAKE_BLOCK_TOKENS,
    WRITABLE_FORMATS,
    BadLines,
    convert_trace,
    fetch_trace,
    format_stats,
    trace_stats,
)
from sim.io.validate import validate_file
from sim.io.workload import request_total
from sim.tools.calibrate import DEFAULT_FIT, EAGER_FIT, FIT_KEYS
from sim.tools.compare import compare_runs, compare_table
from sim.tools.export import FORMATS as EXPORT_FORMATS
from sim.tools.export import export_folder
from sim.tools.fuzz import COVERAGE, RUN_LOGICS, fuzz_decisions, fuzz_runs
from sim.tools.plots import write_plots
from sim.tools.regress import library_table, run_library, write_junit
from sim.tools.replay import replay_check
from sim.tools.run import Interrupted, execute, interruptible, signal_name, signal_of
from sim.tools.sweep import import_ray, read_sweep, run_sweep, sweep_table

__all__ = ["main"]


def _n(count: int, noun: str, plural: str | None = None) -> str:
    """``"1 point"``, ``"2 points"``, ``"1,024 records"``: a count with its noun in the right number."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"


def _cmd_check(args: argparse.Namespace) -> int:
    """Exit 0, 1 on a mismatch or a batch item that is not a valid scenario, 2 on bad input."""
    if args.copy_path and torch_missing():
        raise InputError("check", "--copy-path", "torch is not installed (the copy path needs it)",
                         TORCH_ALLOWED)
    path = Path(args.file)
    batch, items = load_check_file(path, jsonl=args.jsonl)
    # the parsed batch and its results hold no reference cycles: keep the cyclic
    # collector from rescanning them (two full passes cost a large batch ~40 %), and
    # while the batch is decided let it run rarely and never rescan the results as they
    # accumulate (each scenario allocates a few hundred short-lived objects; the default
    # thresholds cost a 5,000-scenario batch about 15 %: benchmarks/bench_decisions.py);
    # the caller's thresholds come back afterwards
    gc.freeze()
    with rare_collections():
        return _check_items(args, path, batch, items)


def _check_items(args: argparse.Namespace, path: Path, batch: bool, items: list[Any]) -> int:
    """Decide (or replay) every item of a check file and print the results."""
    results: list[Any] = []
    failed = False
    for i, item in enumerate(items):
        source = f"{path}[{i}]" if batch else str(path)
        try:
            if isinstance(item, dict) and "__error__" in item:
                raise InputError(source, "", item["__error__"])
            sc, table = prepare_check(item, source)
        except InputError as exc:
            if not batch:
                raise
            results.append({"error": str(exc)})
            failed = True  # every item is still reported; the batch fails at the end
            if not (args.json or args.jsonl):
                print(f"{source} ERROR {exc}")
            continue
        if args.logic:
            sc = sc.model_copy(update={"window_logic": args.logic})
        if args.copy_path:
            results.append(_replays(sc, source, args.json or args.jsonl))
            continue
        outcomes, mismatches = evaluate(sc, source, table)
        failed = failed or bool(mismatches)
        result: Any = outcomes if len(outcomes) > 1 else next(iter(outcomes.values()))
        results.append(result)
        if not (args.json or args.jsonl):
            _print_outcomes(sc, source, outcomes, mismatches)
    if args.jsonl:
        for r in results:
            print(json_dumps(r))
    elif args.json:
        print(json_dumps(results) if batch else json.dumps(results[0], indent=2))
    return 1 if failed else 0


def _print_outcomes(sc: Any, source: str, outcomes: dict[str, Any], mismatches: dict[str, list[str]]) -> None:
    """A line per logic; with ``window_logic = "both"`` also for a logic only an
    expectation names (``[expect.latest]``, checked by :func:`evaluate`)."""
    shown = dict(outcomes)
    if sc.window_logic == "both":
        for logic in sc.expect:
            if logic not in shown:
                shown.update(scenario_outcomes(sc.model_copy(update={"window_logic": logic}), source))
    name = sc.name or source
    for logic, out in shown.items():
        verdict = "MISMATCH" if logic in mismatches else ("ok" if logic in sc.expect else "(no expectation)")
        print(f"{name} [{logic}] {summarize(out)}  {verdict}")
        for d in mismatches.get(logic, []):
            print(f"    {d}")


def _replays(sc: Any, source: str, quiet: bool) -> dict[str, Any]:
    """``check --copy-path``: the scenario replayed as a run with real copies,
    under NEW, OLD, and OLD with assertions stripped (``python -O``)."""
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
    root = Path(args.dir)
    if not root.is_dir():
        raise InputError(str(root), "", "not a directory", "a folder of check/1 TOML files")
    if args.jobs < 1:
        raise InputError("argument", "--jobs", f"{args.jobs}", "an integer >= 1")
    junit = Path(args.junit) if args.junit else None
    created: list[Path] = []
    if junit is not None:  # checked before the library runs: no work for a report that cannot be written
        if junit.is_dir():
            raise InputError("argument", "--junit", f"{junit}: is a folder",
                             "a file path in a writable folder")
        created = _writable_folder(junit.parent, "--junit", junit)
    try:
        results = run_library(root, jobs=args.jobs)
        if not results:
            raise InputError(str(root), "", "no *.toml case found", "a folder of check/1 TOML files")
        print(library_table(results, root))
        for r in results:
            if r.error is not None and r.bad_input:
                print(f"kvsim: error: {r.error}", file=sys.stderr)
        if junit is not None:
            write_junit(results, junit)
    finally:
        remove_created(created)  # the folders made for a report that was not written
    return 0 if all(r.ok for r in results) else 1


def _writable_folder(folder: Path, option: str, shown: Path) -> list[Path]:
    """Create ``folder`` (and its missing parents) and check that a file can be written
    there, before any work; return the folders created (for :func:`remove_created`).

    Raises:
        InputError: one ``option`` line (a file in the way, read-only, no permission);
            nothing is left created then.
    """
    if folder.exists() and not folder.is_dir():
        what = "exists and is not a folder" if folder == shown else f"{folder} is not a folder"
        raise InputError("argument", option, f"{shown}: {what}", "a writable folder")
    try:
        created = make_folder(folder, shown)
        probe = temp_beside(folder / "kvsim-write-check")
        try:
            probe.touch()
            probe.unlink()
        except OSError as exc:
            remove_created(created)
            where = "there" if folder == shown else f"in {folder}"
            raise InputError("argument", option, f"{shown}: cannot create a file {where} "
                             f"({exc.strerror or exc})", "a writable folder (with free space)") from None
    except InputError as exc:  # make_folder's error names --out
        raise InputError(exc.source, option, exc.problem, exc.allowed) from None
    return created


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
                         seed: bool = True, logic: bool = False, decisions: bool = False) -> None:
    """``--set KEY=VALUE`` (repeatable) and its shorthands, all into ``args.overrides``."""
    p.add_argument("--set", dest="overrides", action=_Override, metavar="KEY=VALUE",
                   help=f"override {what} (TOML value), e.g. cpu_cache.capacity=128GiB; repeatable; "
                   "KEY=null (bare) removes KEY (its default applies); setting workload.kind drops the "
                   "keys the new kind lacks, e.g. --set workload.kind=mooncake --set workload.trace=NAME")
    if seed:
        p.add_argument("--seed", dest="overrides", action=_Override, key="seed", metavar="N",
                       help="shorthand for --set seed=N")
    if logic:
        p.add_argument("--logic", dest="overrides", action=_Override, key="window_logic",
                       metavar="old|new|latest", help="shorthand for --set window_logic=...")
    if decisions:
        p.add_argument("--decisions", dest="overrides", action=_Override, key="decisions",
                       metavar="model|vllm|differential",
                       help="shorthand for --set decisions=... (vllm: the installed vLLM's scheduler "
                            "decides; differential: kvsim's model and vLLM in lockstep, stopping at the "
                            "first divergence; docs/vllm.md)")
    p.set_defaults(overrides=[])


def _add_fidelity(sub: Any) -> None:
    p = sub.add_parser("fidelity", help="kvsim's model against the installed vLLM on one scenario: "
                                        "every request's decisions compared (needs vLLM; docs/vllm.md)")
    p.add_argument("scenario", help="run/1 scenario TOML (window_logic follows the installed vLLM)")
    p.add_argument("--limit", type=int, metavar="N", help="the first N requests (workload.limit)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_override_options(p)
    p.set_defaults(func=_cmd_fidelity)


def _cmd_fidelity(args: argparse.Namespace) -> int:
    from sim.tools.fidelity import fidelity, format_report  # noqa: PLC0415

    overrides = list(args.overrides or [])
    if args.limit is not None:
        if args.limit < 1:
            raise InputError("argument", "--limit", f"{args.limit}", "a whole number >= 1")
        overrides.append(("--limit", f"workload.limit={args.limit}"))
    rep = fidelity(Path(args.scenario), overrides)
    print(json.dumps(rep.to_dict(), indent=2, default=str) if args.json else format_report(rep))
    diverged = rep.divergences or (rep.lockstep is not None and rep.lockstep["divergences"])
    return 1 if diverged else 0


def _cmd_run(args: argparse.Namespace) -> int:
    spec = load_run(Path(args.scenario), args.overrides or [])
    target = Path(args.out) if args.out else Path("results") / spec.name
    writer = RunWriter(target, overwrite=args.overwrite)
    quiet = args.quiet or not sys.stderr.isatty()
    bar = None
    if not quiet:
        # the total (and so an ETA) is known for generators and limited traces
        bar = tqdm(total=request_total(spec), unit="req", desc=spec.name, file=sys.stderr,
                   dynamic_ncols=True)

    def progress(finished: int, sim_time_s: float) -> None:
        if bar is not None:
            bar.set_postfix_str(f"sim {sim_time_s:.1f} s", refresh=False)
            bar.update(finished - bar.n)

    previous = writer.has_previous
    try:
        with interruptible():
            outcome = execute(spec, writer, progress=progress, argv=sys.argv)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: one line, never a traceback
        if bar is not None:
            bar.close()
        kept = [f"partial run kept in {writer.published}"] if writer.published is not None else []
        if previous:
            kept.append(f"previous {target} kept")
        print(f"kvsim: interrupted ({signal_name(signal_of(exc))}); "
              f"{'; '.join(kept) or f'nothing written to {target}'}", file=sys.stderr)
        return 128 + signal_of(exc)
    finally:
        if bar is not None:
            bar.close()
    if outcome.status != "ok":
        err = outcome.error
        if err is not None:  # a simulator error: a kvsim bug, with its traceback
            traceback.print_exception(err, file=sys.stderr)
        print(f"kvsim: run failed; summary written to {outcome.folder}"
              f"{f'; previous {target} kept' if outcome.folder != target else ''}", file=sys.stderr)
        return 1
    print(summary_table(outcome.summary, outcome.folder))
    for warning in summary_warnings(outcome.summary):
        print(f"kvsim: warning: {warning}", file=sys.stderr)
    if args.plots:
        for path in write_plots(outcome.folder):
            print(f"plot: {path}")
    diff = outcome.summary.get("differential")
    if diff is not None:
        from sim.tools.differential import describe  # noqa: PLC0415

        print("\n".join(describe(diff)))
        return 1 if diff["divergences"] else 0
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    quiet = args.quiet or not sys.stderr.isatty()
    try:
        with interruptible():
            result = compare_runs(Path(args.scenario), args.out, args.overrides or [], jobs=args.jobs,
                                  progress=not quiet, overwrite=args.overwrite,
                                  verify_reproducers=args.verify_reproducers, argv=sys.argv,
                                  logics=args.logics)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the workers are stopped; one line
        kept = exc.kept if isinstance(exc, Interrupted) and exc.kept else "nothing written"
        print(f"kvsim: interrupted ({signal_name(signal_of(exc))}); {kept}", file=sys.stderr)
        return 128 + signal_of(exc)
    print(compare_table(result.figures, result.path))
    over = [lg.upper() for lg, f in result.figures["runs"].items() if f.get("overloaded")]
    if over:
        who = " and ".join(over) if len(over) < 3 else f"{', '.join(over[:-1])} and {over[-1]}"
        print(f"kvsim: warning: the {who} run{'s are' if len(over) > 1 else ' is'} overloaded "
              f"(the queue grows with the trace): compare decisions, not TTFT (docs/metrics.md)",
              file=sys.stderr)
    if result.status != "ok":
        for logic, tb in result.errors.items():
            print(f"kvsim: the {logic.upper()} run failed:", file=sys.stderr)
            print(tb, file=sys.stderr, end="")
        print(f"kvsim: a run failed; compare written to {result.path}"
              f"{f'; previous {result.kept} kept' if result.kept is not None else ''}", file=sys.stderr)
        return 1
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    code = 0
    for name in args.files:
        try:
            print(f"{name}: ok ({validate_file(Path(name))})")
        except InputError as exc:
            print(f"kvsim: error: {exc}", file=sys.stderr)
            code = 2
    return code


def add_calibrate_parser(sub: Any) -> None:
    """``kvsim calibrate``: the torch copy path's bandwidth, or ``--from-run`` a real run's fit."""
    p = sub.add_parser("calibrate", help="measure copy bandwidth of the torch copy path (needs torch); "
                                         "with --from-run, fit the step and link coefficients to a real "
                                         "vLLM run (docs/costs.md)")
    p.add_argument("--from-run", metavar="RESULTS",
                   help="the JSON of vllm bench serve --save-result --save-detailed: fit mfu, mbu and the "
                        "host times to it (no torch needed)")
    p.add_argument("--scenario", metavar="FILE",
                   help="--from-run: run/1 scenario of what was served (model, hardware profile, scheduler, "
                        "tensor parallelism); its workload is the trace replayed")
    p.add_argument("--trace", metavar="NAME|PATH",
                   help="--from-run: the trace the benchmark replayed, instead of the scenario's workload")
    p.add_argument("--metrics", metavar="FILE",
                   help="--from-run: vLLM's Prometheus /metrics text after the run: also fit the H2D and "
                        "D2H bandwidths from the offloading counters")
    p.add_argument("--fit", metavar="KEYS",
                   help=f"--from-run: the coefficients fitted, of {','.join(FIT_KEYS)} (the others keep "
                        f"the profile's; default {','.join(DEFAULT_FIT)}, and {EAGER_FIT} when the scenario "
                        "sets costs.enforce_eager)")
    p.add_argument("--overwrite", action="store_true", help="--from-run: replace an existing --out")
    add_override_options(p, "a key of --scenario", seed=False)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to copy")
    p.add_argument("--chunk-bytes", metavar="LIST", help="bytes per chunk, e.g. 64KiB,1MiB,8MiB")
    p.add_argument("--batch", metavar="LIST", help="chunks per job, e.g. 1,16,64,256")
    p.add_argument("--repeats", type=int, default=5, metavar="N",
                   help="timed runs per figure at most (median; at least 3 once 0.2 s is spent)")
    p.add_argument("--out", metavar="FILE", help="also write the [hardware] TOML snippet to FILE; "
                   "--from-run: the fitted hardware/1 profile (default: RESULTS with .hardware.toml)")
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.from_run is not None:
        return _cmd_calibrate_run(args)
    given = [f"--{o}" for o in ("scenario", "trace", "metrics") if getattr(args, o) is not None]
    given += ["--set"] * bool(args.overrides) + ["--overwrite"] * args.overwrite
    given += ["--fit"] * (args.fit is not None)
    if given:
        raise InputError("argument", given[0], "only with --from-run", "--from-run RESULTS")
    try:
        from sim.engine import copypath  # noqa: PLC0415 -- torch is an optional extra
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
    print(copypath.calibration_table(result))
    print()
    print(snippet, end="")
    if args.out:
        try:
            write_text_atomic(Path(args.out), snippet)
        except OSError as exc:
            raise InputError("argument", "--out", f"{args.out!r}: {exc.strerror}",
                             "a writable file path") from None
        print(f"kvsim: wrote {args.out}", file=sys.stderr)
    return 0


def _trace_overrides(text: str) -> list[tuple[str, str]]:
    """``--trace NAME|PATH`` as ``--set`` overrides of the scenario's workload: a file by
    its absolute path (any trace format), else a published trace by name."""
    path = Path(text)
    if path.is_file():
        return [("--trace", "workload.kind=trace"), ("--trace", "workload.trace=null"),
                ("--trace", f"workload.path={json.dumps(str(path.resolve()))}"),
                ("--trace", "workload.sha256=null")]
    return [("--trace", "workload.kind=mooncake"), ("--trace", "workload.path=null"),
            ("--trace", f"workload.trace={json.dumps(text)}"), ("--trace", "workload.sha256=null")]


def _cmd_calibrate_run(args: argparse.Namespace) -> int:
    """``calibrate --from-run``: the fit's table on stdout, the profile written to --out."""
    from sim.tools import calibrate as cal  # noqa: PLC0415 -- the module's functions by their short names

    if args.scenario is None:
        raise InputError("argument", "--scenario", "missing (--from-run needs it)",
                         "the run/1 scenario of the served model, hardware and scheduler")
    keys: list[str] | None = None
    if args.fit is not None:
        keys = [k.strip() for k in args.fit.split(",") if k.strip()]
        if not keys or any(k not in cal.FIT_KEYS for k in keys) or len(set(keys)) != len(keys):
            raise InputError("argument", "--fit", f"{args.fit!r}",
                             f"distinct keys of {','.join(cal.FIT_KEYS)}")
    results = Path(args.from_run)
    out = Path(args.out) if args.out else \
        results.with_name(results.name.removesuffix(".json") + ".hardware.toml")
    if out.exists() and not args.overwrite:   # before any work
        raise InputError("argument", "--out", f"{out} exists", "another path, or --overwrite")
    if out.is_dir() or not out.parent.is_dir():
        raise InputError("argument", "--out", f"{out}: {'is a folder' if out.is_dir() else 'no such folder'}",
                         "a file path in an existing folder")
    run = cal.read_bench_run(results)
    metrics = cal.read_metrics(Path(args.metrics)) if args.metrics else None
    overrides = list(args.overrides or []) + (_trace_overrides(args.trace) if args.trace else [])
    spec = load_run(Path(args.scenario), overrides)
    fit = cal.calibrate_from_run(spec, run, metrics, keys)   # None: cal.default_fit(spec)
    print(cal.report_table(fit))
    command = ("kvsim " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"]
               else "kvsim calibrate --from-run")
    text = cal.hardware_profile(spec, fit, out.name.removesuffix(".toml"), str(results), command)
    try:
        write_text_atomic(out, text)
    except OSError as exc:
        raise InputError("argument", "--out", f"{out}: {exc.strerror or exc}",
                         "a writable file path") from None
    eager = spec.scenario.costs.enforce_eager
    print(f"kvsim: wrote {out} (tolerance on generated runs: {cal.tolerance_line(eager)})", file=sys.stderr)
    for d, lf in fit.links.items():
        if lf.bandwidth_bytes_per_s is None:
            why = ("no bytes counted" if lf.totals.bytes == 0 else
                   "the fixed costs alone reach the measured transfer time")
            print(f"kvsim: note: {d}: {why}; the profile's bandwidth is kept", file=sys.stderr)
    if not spec.scenario.costs.tokenize:
        print("kvsim: note: the replay sends token ids (costs.tokenize = false); vllm bench serve sends "
              "text, which the server tokenizes inside each TTFT: set costs.tokenize = true for such a run",
              file=sys.stderr)
    if not fit.steps.converged:
        print("kvsim: warning: the fit did not converge; the profile holds its last round", file=sys.stderr)
    return 0


# -- kvsim trace ---------------------------------------------------------------


def _block_tokens_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _report_bad(bad: BadLines) -> None:
    if bad.count:
        shown = "; ".join(bad.examples) + ("; ..." if bad.count > len(bad.examples) else "")
        print(f"kvsim: skipped {bad.count} bad line(s): {shown}", file=sys.stderr)


def _cmd_stats(args: argparse.Namespace) -> int:
    stats = trace_stats(args.file, args.format, skip_bad=args.skip_bad, block_tokens=args.block_tokens)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    path, downloaded = fetch_trace(args.name, args.cache_dir, url=args.url, force=args.force)
    if not downloaded:
        print(f"kvsim: {args.name}: already cached (digest verified)", file=sys.stderr)
    print(path)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    bad = BadLines()
    n, size = convert_trace(args.src, args.dst, args.src_format, args.dst_format, skip_bad=args.skip_bad,
                            bad=bad, block_tokens=args.block_tokens, overwrite=args.force)
    _report_bad(bad)
    print(f"wrote {_n(n, 'record')} to {args.dst}")
    if size is not None and size != MOONCAKE_BLOCK_TOKENS:
        print(f"kvsim: note: {args.dst} uses {size}-token blocks; read it with --block-tokens {size}",
              file=sys.stderr)
    return 0


def add_trace_parser(sub: Any) -> None:
    """Register ``kvsim trace {stats,fetch,convert}`` on the top-level subparsers."""
    p = sub.add_parser("trace", help="request traces: statistics, download, conversion")
    tsub = p.add_subparsers(dest="trace_command", required=True)

    s = tsub.add_parser("stats", help="request count, rate, length percentiles, prefix reuse")
    s.add_argument("file", help="trace file (Mooncake JSONL, Azure CSV, kvsim CSV or Parquet)")
    s.add_argument("--format", choices=FORMATS, help="input format (default: from the name and first line)")
    s.add_argument("--json", action="store_true", help="print the statistics as JSON")
    s.add_argument("--skip-bad", action="store_true", help="skip and count bad lines instead of failing")
    s.add_argument("--block-tokens", type=_block_tokens_arg, metavar="N",
                   help="tokens per hash id (Mooncake: 512; kvsim CSV/Parquet: where the column is empty)")
    s.set_defaults(func=_cmd_stats)

    f = tsub.add_parser("fetch", help="download a published trace into the cache folder")
    f.add_argument("name", choices=list(KNOWN_TRACES), metavar="NAME",
                   help="one of: " + ", ".join(KNOWN_TRACES))
    f.add_argument("--cache-dir", metavar="DIR",
                   help="where to put it (default: $KVSIM_CACHE, else ~/.cache/kvsim/traces)")
    f.add_argument("--url", help="download from this URL instead (a mirror); digests are still checked")
    f.add_argument("--force", action="store_true", help="download again even if a cached copy exists")
    f.set_defaults(func=_cmd_fetch)

    c = tsub.add_parser("convert", help="rewrite a trace as Mooncake JSONL, kvsim CSV or kvsim Parquet")
    c.add_argument("src", metavar="IN", help="input trace")
    c.add_argument("dst", metavar="OUT", help="output file (written atomically)")
    c.add_argument("--from", dest="src_format", choices=FORMATS, help="input format (default: detected)")
    c.add_argument("--to", dest="dst_format", choices=WRITABLE_FORMATS,
                   help="output format (default: from OUT's suffix)")
    c.add_argument("--skip-bad", action="store_true", help="skip and count bad lines instead of failing")
    c.add_argument("--block-tokens", type=_block_tokens_arg, metavar="N",
                   help="tokens per hash id of the input (Mooncake: 512; kvsim CSV/Parquet: where empty)")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.set_defaults(func=_cmd_convert)


# -- kvsim fuzz ----------------------------------------------------------------


def add_fuzz_parser(sub: Any) -> None:
    """``kvsim fuzz``: the decision fuzzer (``--budget``) or the run fuzzer (``--runs``)."""
    p = sub.add_parser("fuzz", help="search random check scenarios (--budget) or random runs (--runs)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--budget", type=int, metavar="N", help="check scenarios to search (OLD vs NEW)")
    mode.add_argument("--runs", type=int, metavar="N",
                      help="random whole runs to simulate (OLD, NEW and LATEST each)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the search (default 0)")
    p.add_argument("--logic-pair", metavar="A,B",
                   help="--budget: the two different logics compared (default old,new)")
    p.add_argument("--out", metavar="DIR",
                   help="where new cases go (default scenarios/crash/fuzz; --runs: results/fuzz-runs)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="J",
                   help="worker processes (default: CPU count)")
    p.add_argument("--copy-path", action="store_true", help="--runs: real tensor copies, integrity under NEW")
    p.add_argument("--verify-every", type=int, metavar="K",
                   help="--budget: cross-check every K-th scenario against run_check "
                        "(default 4096; 0: never)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_fuzz)


def _bar(total: int, unit: str, quiet: bool) -> Any:
    if quiet or not sys.stderr.isatty():
        return None
    return tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, desc="fuzz")


def _refuse_other_mode(args: argparse.Namespace) -> None:
    """An option of the other fuzz mode would be ignored without a word: it is refused."""
    if args.runs is None:
        other = ["--copy-path"] * args.copy_path
    else:
        given = {"--logic-pair": args.logic_pair, "--verify-every": args.verify_every}
        other = [opt for opt, value in given.items() if value is not None]
    if other:
        mode, wanted = ("--budget", "--runs") if args.runs is None else ("--runs", "--budget")
        raise InputError("argument", other[0], f"has no effect with {mode}", f"{other[0]} with {wanted}")


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Exit 0 when the search ran (findings are its output); 1 when it found
    a simulator bug (an exception, a fast-path divergence, a violated
    invariant) or, with --runs --copy-path, an integrity violation under NEW."""
    if args.jobs < 1:
        raise InputError("argument", "--jobs", f"{args.jobs}", "an integer >= 1")
    if args.seed < 0:
        raise InputError("argument", "--seed", f"{args.seed}", "an integer >= 0")
    command = "kvsim fuzz " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["fuzz"] else ""
    _refuse_other_mode(args)
    if args.runs is not None:
        return _cmd_runs(args, command)
    pair = tuple(x.strip() for x in (args.logic_pair or "old,new").split(","))
    if len(pair) != 2 or len(set(pair)) != 2 or any(x not in ("old", "new", "latest") for x in pair):
        raise InputError("argument", "--logic-pair", f"{args.logic_pair!r}",
                         "two different ones of old,new,latest, e.g. old,new or new,latest")
    if args.budget < 1:
        raise InputError("argument", "--budget", f"{args.budget}", "an integer >= 1")
    verify_every = 4096 if args.verify_every is None else args.verify_every
    if verify_every < 0:
        raise InputError("argument", "--verify-every", f"{verify_every}", "an integer >= 0 (0: never)")
    out = Path(args.out or "scenarios/crash/fuzz")
    created = _writable_folder(out, "--out", out)  # before the search: no work for nothing
    bar = _bar(args.budget, "scn", args.quiet)
    try:
        logics = cast("tuple[Literal['old', 'new', 'latest'], ...]", pair)
        rep = fuzz_decisions(args.budget, args.seed, logics=logics, out=out,
                             jobs=args.jobs, verify_every=verify_every,
                             progress=bar.update if bar is not None else None, command=command)
    finally:
        if bar is not None:
            bar.close()
        remove_created(created)  # as before: no finding, no folder
    print(rep.table())
    print()
    written = sum(c.status == "written" for c in rep.conditions)
    print(f"kvsim fuzz: {_n(rep.scanned, 'scenario')} in {rep.search_s:.2f} s wall with "
          f"{_n(rep.jobs, 'job')}: {rep.rate:,.0f} scenarios/s wall ({rep.cpu_rate:,.0f} per CPU second of "
          f"one process); {_n(rep.findings, 'finding')} in {_n(len(rep.conditions), 'condition')}")
    print(f"kvsim fuzz: files: {written} written, "
          f"{sum(c.status == 'unchanged' for c in rep.conditions)} unchanged, "
          f"{sum(c.status == 'kept existing' for c in rep.conditions)} kept existing, in {out}; "
          f"{rep.wall_s:.2f} s in all (shrinking and verification included)")
    for index, what in rep.divergences:
        print(f"kvsim fuzz: FAST PATH DIVERGENCE at index {index}: {what}", file=sys.stderr)
    bugs = rep.simulator_bugs
    for c in bugs:
        print(f"kvsim fuzz: SIMULATOR BUG {c.condition.words()} (index {c.first_index}): {c.path}",
              file=sys.stderr)
    return 1 if bugs or rep.divergences else 0


def _cmd_runs(args: argparse.Namespace, command: str) -> int:
    if args.runs < 1:
        raise InputError("argument", "--runs", f"{args.runs}", "an integer >= 1")
    if args.copy_path:
        try:
            import torch  # noqa: F401, PLC0415 -- only checks that the optional extra is there
        except ImportError:
            raise InputError("fuzz", "--copy-path", "torch is not installed", "pip install 'kvsim[torch]'") \
                from None
    out = Path(args.out or "results/fuzz-runs")
    created = _writable_folder(out, "--out", out)  # before the runs: no work for nothing
    bar = _bar(args.runs, "run", args.quiet)
    try:
        rep = fuzz_runs(args.runs, args.seed, copy_path=args.copy_path, out=out, jobs=args.jobs,
                        progress=bar.update if bar is not None else None, command=command)
    finally:
        if bar is not None:
            bar.close()
        remove_created(created)  # as before: no finding, no folder
    for f in rep.findings:
        print(f"{f.kind:10s} {f.logic.upper():4s} x{f.count:<4d} run {f.index}: {f.detail[:160]}  "
              f"-> {f.path} ({f.status})")
    cov = ", ".join(f"{name} " + "/".join(str(rep.coverage.get(f"{lg}:{name}", 0)) for lg in RUN_LOGICS)
                    for name in COVERAGE)
    names = "/".join(lg.upper() for lg in RUN_LOGICS)
    print(f"kvsim fuzz: simulations ({names}) with {cov}")
    print(f"kvsim fuzz: {_n(rep.runs, 'run')} ({_n(rep.simulations, 'simulation')}, {names}) in "
          f"{rep.wall_s:.2f} s wall: {rep.rate:.1f} runs/s; {_n(len(rep.findings), 'distinct finding')}")
    return 1 if rep.findings else 0


# -- kvsim plot ----------------------------------------------------------------



def add_plot_parser(sub: Any) -> None:
    """``kvsim plot RESULTS_DIR [--out DIR]``."""
    p = sub.add_parser("plot", help="write the PNG figures of a run, compare or sweep folder")
    p.add_argument("results_dir", metavar="RESULTS_DIR",
                   help="a folder written by kvsim run, kvsim compare or kvsim sweep")
    p.add_argument("--out", metavar="DIR", help="where the PNGs go (default: RESULTS_DIR/plots)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    """Write the figures and print their paths, one per line (exit 2 on a folder of no known kind)."""
    folder = Path(args.results_dir)
    if not folder.is_dir():
        raise InputError(str(folder), "", "not a directory",
                         "a folder written by kvsim run, kvsim compare or kvsim sweep")
    if (bad := find_incomplete(folder)) is not None:   # before any figure is drawn
        raise bad
    paths = write_plots(folder, args.out, on_note=lambda s: print(f"kvsim: note: {s}", file=sys.stderr))
    for path in paths:
        print(path)
    return 0


# -- kvsim export --------------------------------------------------------------


def add_export_parser(sub: Any) -> None:
    """``kvsim export FOLDER [--format csv] [--points]``."""
    p = sub.add_parser("export", help="write CSV copies of a run, compare or sweep folder's tables")
    p.add_argument("folder", metavar="FOLDER",
                   help="a folder written by kvsim run, kvsim compare or kvsim sweep")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="csv",
                   help="the format written (default: csv)")
    p.add_argument("--points", action="store_true", help="a sweep: also every point's run folder")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """Write ``<table>.csv`` beside each Parquet file (docs/columns.md); print the paths, one per line."""
    for path in export_folder(Path(args.folder), args.format, points=args.points):
        print(path)
    return 0


# -- kvsim sweep ---------------------------------------------------------------



def add_sweep_parser(sub: Any) -> None:
    """``kvsim sweep FILE``: run a sweep/1 file."""
    p = sub.add_parser("sweep", help="run a sweep (sweep/1 file): many runs, resumable, one table")
    p.add_argument("file", metavar="FILE", help="sweep/1 TOML")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="points in parallel (default: CPU count; with Ray: as the cluster allows)")
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local processes (default) or Ray tasks")
    p.add_argument("--address", metavar="ADDR", help="join this Ray cluster (with --backend ray)")
    p.add_argument("--out", metavar="DIR", help="the sweep folder (default: results/<name>, --smoke: "
                   "results/<name>-smoke)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over where points no longer match the sweep (the previous folder is "
                        "kept aside until every new point is ok; only a kvsim results folder)")
    p.add_argument("--smoke", action="store_true", help="the [smoke] version: few points, small runs")
    add_override_options(p, "a key of the base scenario", seed=False)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Exit 0 when every point ran ok, 1 when a point failed, 130 on Ctrl-C (143 on SIGTERM)."""
    if args.jobs is not None and args.jobs < 1:
        raise InputError("argument", "--jobs", f"{args.jobs}", "an integer >= 1")
    if args.address is not None and args.backend != "ray":
        raise InputError("argument", "--address", "only with --backend ray", "--backend ray --address ADDR")
    if args.backend == "ray":
        import_ray()
    sweep = read_sweep(Path(args.file), args.overrides or [], smoke=args.smoke)
    out = Path(args.out) if args.out else Path("results") / (sweep.name + ("-smoke" if args.smoke else ""))
    quiet = args.quiet or not sys.stderr.isatty()
    bar: Any = None

    def on_start(skipped: int, todo: int) -> None:
        nonlocal bar
        where = f"Ray{' at ' + args.address if args.address else ''}" if args.backend == "ray" else "local"
        print(f"kvsim sweep: {_n(len(sweep.points), 'point')}{' (smoke)' if sweep.smoke else ''}: "
              f"{skipped} skipped (finished earlier), {todo} to run ({where}) -> {out}", file=sys.stderr)
        if not quiet and todo:
            bar = tqdm(total=todo, unit="pt", desc=sweep.name, file=sys.stderr, dynamic_ncols=True)

    def progress(n: int, total: int) -> None:
        if bar is not None:
            bar.update(n - bar.n)

    def on_failed(run_id: str, reason: str) -> None:
        line = f"kvsim sweep: point {run_id} failed: {reason}"
        if bar is not None:
            bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    try:
        report = run_sweep(sweep, out, jobs=args.jobs, backend=args.backend, address=args.address,
                           overwrite=args.overwrite, progress=progress, on_start=on_start,
                           on_failed=on_failed, argv=sys.argv)
    finally:
        if bar is not None:
            bar.close()
    print(sweep_table(sweep, report))
    over = sorted(i for i, su in report.summaries.items() if su.get("overloaded"))
    if over:
        print(f"kvsim: warning: {_n(len(over), 'point')} overloaded ({', '.join(map(str, over[:10]))}"
              f"{' ...' if len(over) > 10 else ''}): the queue grows with the trace, so their TTFT is "
              f"the queue's; do not size from them (docs/metrics.md)", file=sys.stderr)
        stopped = sum(1 for i in over if report.summaries[i].get("end") == "queue_limit")
        if stopped:
            print(f"kvsim: {_n(stopped, 'point')} of them stopped when their queue reached "
                  f"output.stop_at_waiting (end = queue_limit)", file=sys.stderr)
    if report.interrupted is not None:
        kept = f"; previous sweep kept in {report.previous}" if report.previous is not None else ""
        rest = ("every point had finished" if len(report.summaries) >= len(sweep.points)
                else "run the same command again to finish")
        print(f"kvsim sweep: interrupted; {len(report.summaries)} of {_n(len(sweep.points), 'point')} in "
              f"{report.out / 'sweep.parquet'}; {rest}{kept}", file=sys.stderr)
        return 128 + int(report.interrupted)
    if report.failed:
        kept = f"; previous sweep kept in {report.previous}" if report.previous is not None else ""
        print(f"kvsim sweep: {len(report.failed)} point(s) failed: {', '.join(report.failed[:5])}"
              f"{' ...' if len(report.failed) > 5 else ''}{kept}", file=sys.stderr)
        return 1
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvsim CMD: error: ...; see kvsim CMD --help`` (exit 2),
    instead of the usage block and the error (every subcommand's parser is one too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvsim",
        description="Simulator of vLLM's multi-group KV-cache CPU offloading "
                    "(OLD 0.29, NEW 0.30, LATEST 0.33).")
    parser.add_argument("--version", action="version", version=f"kvsim {kvsim_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="one request's lookup + allocation + load plan (check/1 file)")
    p.add_argument("file", help="check/1 scenario: TOML, JSON object, JSON list (batch) or JSON Lines")
    p.add_argument("--json", action="store_true", help="print outcomes as JSON")
    p.add_argument("--jsonl", action="store_true", help="read and write JSON Lines (batch)")
    p.add_argument("--logic", choices=["old", "new", "latest", "both"], help="override window_logic")
    p.add_argument("--copy-path", action="store_true",
                   help="replay as a run with real tensor copies (needs torch): NEW, OLD, OLD with "
                        "assertions stripped; report crashes and integrity violations")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("regress", help="run the crash regression library")
    p.add_argument("dir", nargs="?", default="scenarios/crash",
                   help="folder of check/1 files (default: %(default)s, the shipped crash library)")
    p.add_argument("--junit", metavar="FILE", help="also write a JUnit XML report")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="J",
                   help="worker processes (default: CPU count); results keep file-name order")
    p.set_defaults(func=_cmd_regress)

    p = sub.add_parser("run", help="run a scenario (run/1 file) and write results/<name>/")
    p.add_argument("scenario", help="run/1 scenario TOML")
    p.add_argument("--out", metavar="DIR", help="the run folder (default: results/<name>)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous result (a kvsim run, "
                   "compare or sweep folder; any other non-empty folder is refused)")
    add_override_options(p, logic=True, decisions=True)
    p.add_argument("--plots", action="store_true", help="also write plots/*.png")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("compare", help="run a scenario under OLD and NEW (or --logics) and compare "
                                       "(same seed)")
    p.add_argument("scenario", help="run/1 scenario TOML (its window_logic is replaced per run)")
    p.add_argument("--out", metavar="DIR", help="the compare folder (default: results/<name>-compare)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous result (a kvsim compare, "
                   "run or sweep folder; any other non-empty folder is refused)")
    add_override_options(p)
    p.add_argument("--logics", default="old,new", metavar="A,B[,C]",
                   help="two or three of old,new,latest, in report order; each is compared with the "
                        "first (default old,new)")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="worker processes (default: one per logic); 1: one run after the other")
    p.add_argument("--verify-reproducers", action="store_true",
                   help="replay every reproducer with kvsim check and report whether it reproduces")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_compare)

    _add_fidelity(sub)

    p = sub.add_parser("validate", help="check scenario files (any schema) without running them")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="run/1, model/1, hardware/1, check/1 or sweep/1 files (by their schema key)")
    p.set_defaults(func=_cmd_validate)

    add_calibrate_parser(sub)  # kvsim calibrate [--from-run RESULTS --scenario FILE]

    add_trace_parser(sub)  # kvsim trace stats | fetch | convert

    add_fuzz_parser(sub)  # kvsim fuzz --budget N | --runs N

    add_sweep_parser(sub)  # kvsim sweep FILE [--jobs N] [--backend local|ray]

    add_plot_parser(sub)  # kvsim plot RESULTS_DIR [--out DIR]

    add_export_parser(sub)  # kvsim export FOLDER [--format csv] [--points]
    return parser


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """:func:`interruptible` around a whole command (run, compare and sweep set their own
    inside): SIGINT and SIGTERM raise :class:`Interrupted` in this process only.

    The workers of a pool (regress's, fuzz's) are ended first: their work is
    abandoned, and the pool does not wait for the units still queued (a
    thread of the pool that fails as it is torn down prints nothing, until
    the process exits). A
    process forked from this one inherits the handlers: there SIGINT is left
    to this process, and SIGTERM ends the worker as it would by default.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()
    hook = threading.excepthook
    signalled = False

    def quiet(args: Any) -> None:
        return None

    with interruptible():
        raising = {int(sig): cast("Callable[[int, Any], None]", signal.getsignal(sig))
                   for sig in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum: int, frame: Any) -> None:
            if os.getpid() == pid:
                nonlocal signalled
                signalled = True
                threading.excepthook = quiet
                with contextlib.suppress(Exception):
                    for child in multiprocessing.active_children():
                        if child.pid:
                            os.kill(child.pid, signal.SIGTERM)
                raising[signum](signum, frame)
            elif signum == signal.SIGTERM:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        for sig in raising:
            signal.signal(sig, handler)
        try:
            yield
        finally:
            # after a signal the command is ending: the pool's threads may still fail as its
            # workers die (after this block), so they stay quiet until the process exits
            if not signalled:
                threading.excepthook = hook


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvsim`` console script."""
    args = build_parser().parse_args(argv)
    try:
        with _interrupts():
            code: int = args.func(args)
    except InputError as exc:
        print(f"kvsim: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # SIGINT or SIGTERM anywhere else: one line, no traceback
        print(f"kvsim: interrupted ({signal_name(signal_of(exc))})", file=sys.stderr)
        return 128 + signal_of(exc)
    except BrokenPipeError:
        # the reader went away (`kvsim check --json ... | head`): stop quietly, as cat does;
        # stdout is pointed at devnull so the interpreter's final flush cannot raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
