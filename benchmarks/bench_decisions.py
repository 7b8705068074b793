"""Decisions per second: ``kvsim check --json`` on a batch, the decision kernel, the reference.

A decision = one scenario under one logic (lookup + GPU allocation + load
plan of one new request). The batch: 5,000 validated ``check/1`` scenarios
from the decision fuzzer's generator (``scenario_at(seed, i)``: every group
kind, EAGLE, extra_retained_tokens, local hits, prefix caching off, every
chunk state), written as one JSON array into a temporary folder, each under
both logics (10,000 decisions). Everything is timed in this process, after
the imports (no interpreter start-up), best of ``--repeat`` runs:

(a) the full ``sim.cli.main(['check', '--json', FILE])`` path, stdout sent to
    a null stream (read, parse and validate, decide, JSON out), the same with
    the garbage collector off (a what-if: the batch's surviving objects
    trigger full collections of the whole heap), and its parts: ``json.loads``, ``prepare_check``
    (validation and the kernel's table; pydantic's share of it), ``evaluate``
    (the decision half), ``json_dumps`` (orjson; ``json.dumps`` beside it);
(b) the kernel alone (``sim.model.decision.decide`` on the scenarios' cases,
    layouts cached);
(c) the reference path (``sim.io.check.reference_check``: real CPU chunk
    cache, per-block GPU cache and scheduler per case) on the first
    ``--reference`` scenarios;
(d) the kernel and the reference on two fixed cases: the spec §6
    unaligned-hit case (boundary 3904, a 10-chunk load) and a 131,072-token
    prompt with the whole prefix stored.

Usage: python benchmarks/bench_decisions.py [--scenarios N] [--seed S] [--reference N] [--repeat R]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.cli import main as cli_main
from sim.io.check import (
    CheckCase,
    CheckScenario,
    evaluate,
    json_dumps,
    load_check_file,
    parse_check,
    prepare_check,
    reference_check,
)
from sim.model.decision import decide, decision_layout
from sim.tools.fuzz import scenario_at

TARGET = 50_000  #: decisions per second, the issue's target for (a)
BOTH = ("old", "new")

SPEC6_GROUPS = [
    {"kind": "full", "tokens_per_block": 256},
    {"kind": "sliding_window", "tokens_per_block": 64, "window": 128},
    {"kind": "sliding_window", "tokens_per_block": 8, "window": 128},
]


def spec6() -> dict[str, object]:
    return {"schema": "check/1", "blocks_per_chunk": 4, "tokens_per_hash": 8, "num_tokens": 4353,
            "groups": SPEC6_GROUPS,
            "chunk_states": {"0": {"0..3": "present"}, "1": {"14..15": "present"},
                             "2": {"118..121": "present"}}}


def long_prompt(tokens: int = 131_072) -> dict[str, object]:
    n = [tokens // t for t in (1024, 256, 32)]
    return {"schema": "check/1", "blocks_per_chunk": 4, "tokens_per_hash": 8, "num_tokens": tokens,
            "cpu_capacity_chunks": sum(n),
            "groups": SPEC6_GROUPS,
            "chunk_states": {str(g): {f"0..{k - 1}": "present"} for g, k in enumerate(n)}}


def batch(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` validated scenarios (both logics) of the fuzzer's stream."""
    out = []
    for i in range(n):
        case = scenario_at(seed, i)
        data = case.check_data(BOTH)
        data["name"] = f"s{seed}-i{i}"
        parse_check(data, data["name"])  # validated
        out.append(data)
    return out


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def line(label: str, decisions: int, seconds: float) -> float:
    rate = decisions / seconds
    print(f"  {label:<44} {rate:>11,.0f} decisions/s  ({seconds * 1e3:8.1f} ms for {decisions:,}; "
          f"{seconds / decisions * 1e6:6.2f} us each)")
    return rate


def single(name: str, case: CheckCase, reps: int, repeat: int) -> None:
    """The kernel and the reference on one case, ``reps`` times (the reference 1/20 of that)."""
    dl = decision_layout(case.groups, case.tokens_per_hash, case.blocks_per_chunk)
    want = {lg: reference_check(case, lg) for lg in BOTH}
    assert decide(dl, case.states, case.num_tokens) == want
    k = best_of(repeat, lambda: [decide(dl, case.states, case.num_tokens) for _ in range(reps)])
    ref_reps = max(1, reps // 20)
    r = best_of(1, lambda: [reference_check(case, lg) for _ in range(ref_reps) for lg in BOTH])
    line(f"{name}: kernel", 2 * reps, k)
    line(f"{name}: reference", 2 * ref_reps, r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--reference", type=int, default=300, help="scenarios run through the reference path")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = ap.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; "
          f"{args.scenarios:,} scenarios of fuzz seed {args.seed} under both logics; best of {args.repeat}")
    data = batch(args.scenarios, args.seed)
    decisions = 2 * len(data)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batch.json"
        path.write_text(json.dumps(data))
        text = path.read_text()

        def cli() -> None:
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                code = cli_main(["check", "--json", str(path)])
            assert code == 0

        # the outputs agree before anything is timed
        _, items = load_check_file(path)
        prepared = [prepare_check(item, f"{path}[{i}]") for i, item in enumerate(items)]
        cases = [sc.case() for sc, _ in prepared]
        outs = [evaluate(sc, "bench", table)[0] for sc, table in prepared]
        for case, out in list(zip(cases, outs, strict=True))[: args.reference]:
            assert out == {lg: reference_check(case, lg) for lg in BOTH}, case

        print("(a) kvsim check --json FILE, in process:")
        rate_cli = line("sim.cli.main(['check', '--json', FILE])", decisions, best_of(args.repeat, cli))
        gc.disable()
        try:
            line("  the same, garbage collector off (what-if)", decisions, best_of(args.repeat, cli))
        finally:
            gc.enable()
        line("  json.loads (the file)", decisions, best_of(args.repeat, lambda: json.loads(text)))
        line("  prepare_check (validation, and the kernel's table)", decisions,
             best_of(args.repeat, lambda: [prepare_check(d, "bench") for d in items]))
        line("    of which CheckScenario.model_validate", decisions,
             best_of(args.repeat, lambda: [CheckScenario.model_validate(d) for d in items]))
        line("  evaluate (the decisions, from the prepared tables)", decisions,
             best_of(args.repeat, lambda: [evaluate(sc, "bench", table) for sc, table in prepared]))
        line("  json_dumps (the output; orjson)", decisions, best_of(args.repeat, lambda: json_dumps(outs)))
        line("    json.dumps (stdlib)", decisions, best_of(args.repeat, lambda: json.dumps(outs)))

    print("(b) the kernel alone:")
    layouts = [decision_layout(c.groups, c.tokens_per_hash, c.blocks_per_chunk) for c in cases]

    def kernel() -> None:
        for dl, c in zip(layouts, cases, strict=True):
            decide(dl, c.states, c.num_tokens, c.gpu_computed_tokens, c.prefix_caching)

    rate_kernel = line("sim.model.decision.decide", decisions, best_of(args.repeat, kernel))
    subset = cases[: args.reference]
    print(f"(c) the reference path (first {len(subset)} scenarios):")

    def reference() -> None:
        for c in subset:
            for lg in BOTH:
                reference_check(c, lg)

    rate_ref = line("sim.io.check.reference_check", 2 * len(subset), best_of(1, reference))
    print("(d) single cases, kernel vs reference (both logics):")
    for name, scenario, reps in (("spec6 (4353, B=3904)", spec6(), 2000),
                                 ("131072-token prompt", long_prompt(), 20)):
        single(name, parse_check(scenario, name).case(), reps, args.repeat)
    print(f"summary: kvsim check --json {rate_cli:,.0f} decisions/s = {rate_cli / TARGET:.2f} x the "
          f"{TARGET:,}/s target ({'met' if rate_cli >= TARGET else 'NOT met'}); kernel {rate_kernel:,.0f}/s "
          f"= {rate_kernel / TARGET:.2f} x; kernel / reference = {rate_kernel / rate_ref:.0f} x")
    sys.stdout.flush()


if __name__ == "__main__":
    sim.startup.run_script(main)
