"""Engine replay speed: simulated requests per wall second and peak RSS.

Every case runs twice, side by side, each run in its own child process (so
peak RSS is its own): with the fast GPU block accounting (the default,
``scheduler.block_accounting = "fast"``) and with the per-block reference
(``"reference"``); their decisions are identical (tests/model/test_gpu_fast.py,
tests/tools/test_block_accounting.py), so only speed and memory differ. Cases:

* ``default``: ``scenarios/default.toml`` as shipped (synthetic multi-turn,
  hybrid layout, H200, costs and transfers on);
* ``mooncake-spec6``: the Mooncake conversation trace (all 12,031 requests,
  real arrival times) on the spec §6 layout (full 256 / sliding window 64 and
  8, W 128, 4 blocks per chunk, 8 tokens per hash), GPU prefix caching on, a
  CPU cache of 100,000 chunks with LRU, the H200 profile (step time of the
  ``qwen3-30b-a3b`` cost profile, a 3B-active MoE: a dense 8B model cannot
  keep up with the trace's 41k prompt tokens/s on one GPU, and the queue
  would then grow without bound), PCIe Gen5 links, offloading and timing on;
* ``mooncake-full-attn``: the same trace and settings with the layout's
  full-attention group alone (the engine loop, not the window groups, is the
  cost there);
* ``mooncake-deepseek-v4``: ``scenarios/mooncake-deepseek-v4.toml`` (DeepSeek-V4-
  style layout, TP 2, a 256 GiB CPU cache);
* ``azure-conv-llama8b``: the Azure LLM inference conversation trace of 2023
  (19,366 requests, real arrival times, no prefix information, so no hits) on
  Llama 3.1 8B (one full-attention group, 16-token blocks), one H100 with 40 GiB
  of KV cache, the default study's 64 GiB LRU CPU cache storing every prompt:
  the engine loop on an 8B-like model, the issue's other single-group case.

Wall times on a shared or virtual machine vary from run to run (on the
2-core VM of the issue, 20 % between runs of the same build is common):
``--repeat N`` runs everything N times in rounds and reports each row's
median run with the fastest and slowest rates beside it.

After the table, a profile of the fast accounting on the spec §6 case
(``--profile-limit`` requests; ``--profile-case`` picks another case). With py-spy
installed (``pip install py-spy``; the ``[test]`` extra has it) it samples the run as
it is timed, compiled modules included (``py-spy record --native``), and prints the
functions with the largest own time and the largest time with their callees: a
compiled function by its Python name, the CPython and mypyc helpers it calls
(reference counts, dict and list operations) counted as its own. Without py-spy it
falls back to ``cProfile`` of the Python sources (``KVSIM_PURE=1``: cProfile sees no
function inside a compiled module), which overstates what compiling removes.

The target of the engine issue is >= 6,000 simulated requests per second and
<= 300 MB peak RSS on a 2-core machine; the script prints the ratio to it.

    python benchmarks/bench_engine.py [--limit N] [--case NAME ...] [--accounting fast|reference]
                                      [--profile-limit N] [--profile-case NAME] [--repeat N]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import json
import os
import pstats
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if os.environ.get("KVSIM_BENCH_CHILD"):
    # a timed run started by py-spy, itself the script's child: Ctrl-C is the script's to
    # handle (sim.startup then installs no handler), as for the children it starts itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim import _native
from sim.engine.loop import simulate
from sim.engine.metrics import Recorder
from sim.errors import InputError
from sim.io.scenario import load_run
from sim.tools.run import child_preexec

ROOT = Path(__file__).resolve().parent.parent
TARGET_RPS = 6000.0
TARGET_RSS_MB = 300.0

CASES = {
    "default": {"scenario": str(ROOT / "scenarios" / "default.toml"), "set": []},
    "mooncake-spec6": {
        "scenario": str(ROOT / "scenarios" / "default.toml"),
        "set": [
            'name="mooncake-spec6"',
            'model.name="spec6"',
            'model.cost_profile="qwen3-30b-a3b"',
            'hardware.profile="h200"',
            "hardware.gpu_blocks=60000",
            "cpu_cache.chunks=100000",
            'cpu_cache.policy="lru"',
            "scheduler.blocks_per_chunk=4",
            "scheduler.tokens_per_hash=8",
            "scheduler.prefix_caching=true",
            'workload={kind="mooncake", trace="mooncake-conversation"}',   # $KVSIM_TRACES or the fetch cache
            'costs.step="auto"',
            'costs.transfer="hardware"',
        ],
    },
}
CASES["mooncake-full-attn"] = {
    "scenario": CASES["mooncake-spec6"]["scenario"],
    "set": [s for s in CASES["mooncake-spec6"]["set"] if not s.startswith(("name=", "model.name="))]
    + ['name="mooncake-full-attn"',
       'model={label="spec6-full", groups=[{kind="full", tokens_per_block=256, layers=1, kv_heads=1, '
       'head_size=1, dtype="fp32"}], cost_profile="qwen3-30b-a3b"}'],
}
CASES["mooncake-deepseek-v4"] = {
    "scenario": str(ROOT / "scenarios" / "mooncake-deepseek-v4.toml"),
    "set": [],
}
CASES["azure-conv-llama8b"] = {
    "scenario": str(ROOT / "scenarios" / "default.toml"),
    "set": [
        'name="azure-conv-llama8b"',
        'model.name="llama-3.1-8b"',
        'hardware.profile="h100"',
        'hardware.gpu_kv_bytes="40GiB"',
        'workload={kind="trace", trace="azure-conv-2023"}',   # $KVSIM_TRACES or the fetch cache
        'costs.step="auto"',
        'costs.transfer="hardware"',
    ],
}
ACCOUNTINGS = ("fast", "reference")


class _Discard:
    def write(self, table: str, columns: dict[str, list[object]]) -> None:
        pass


def child(case: str, limit: int | None, profile: bool, accounting: str) -> None:
    """Run one case in this process and print one JSON line of figures."""
    spec = CASES[case]
    sets = [*spec["set"], f'scheduler.block_accounting="{accounting}"']
    if limit:
        sets.append(f"workload.limit={limit}")
    run = load_run(spec["scenario"], sets)
    cfg = run.engine_config()
    t0 = time.perf_counter()
    if profile:
        prof = cProfile.Profile()
        res = prof.runcall(simulate, cfg, run.requests(), Recorder(_Discard()))
        wall = time.perf_counter() - t0
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    else:
        res = simulate(cfg, run.requests(), Recorder(_Discard()))
        wall = time.perf_counter() - t0
    s = res.summary
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "case": case, "accounting": accounting, "status": res.status, "requests": s.requests_finished,
        "wall_s": wall,
        "req_per_s": s.requests_finished / wall, "peak_rss_mb": rss_mb, "steps": s.steps,
        "step_rows": s.step_rows, "sim_time_s": s.sim_time_s,
        "cpu_hit_rate": s.figures()["cpu_hit_rate"], "gpu_hit_rate": s.figures()["gpu_hit_rate"],
        "layout": [f"{g.kind}/{g.tokens_per_block}" for g in cfg.layout.groups],
        "gpu_blocks": cfg.gpu_blocks, "cpu_chunks": cfg.cpu_capacity_chunks,
        "policy": str(cfg.eviction), "step_cost": repr(cfg.step_cost),
        "h2d": repr(cfg.h2d), "d2h": repr(cfg.d2h), "compiled": _native.compiled(),
    }))


def check_cases(cases: list[str], ap: argparse.ArgumentParser) -> None:
    """Load every case's scenario once before timing any: a missing trace (not fetched, no
    $KVSIM_TRACES) is one argparse line and exit 2, not a traceback from a child process."""
    for case in cases:
        try:
            load_run(CASES[case]["scenario"], CASES[case]["set"])
        except InputError as exc:
            ap.error(f"case {case}: {exc}")


#: frames below which py-spy's stacks are the benchmark's own harness, not the replay
_HARNESS = ("<module>", "run_script", "main", "child", "simulate", "Engine.run", "Environment.run",
            "Environment.step", "Process._resume", "Engine._engine")


def _code_frame(frame: str) -> str | None:
    """The function a frame of a py-spy ``--native`` stack names, as a reader of the
    sources knows it, or None for a helper whose time is its caller's own: a frame is
    ``name (file:line)``; Python code (kvsim's, SimPy's, numpy's) has a ``.py`` file, a
    function mypyc compiled is ``CPyDef_<module>___<Class>___<method>``, the pool's C
    loops ``poolops_<name>`` in ``_poolops.c``; CPython's and mypyc's runtime helpers
    (``Py_DECREF``, ``CPyDict_GetItem``, ``list_dealloc``...), mypyc's argument-parsing
    wrappers (``CPyPy_``) and libraries' C code are none of these."""
    name, _, where = frame.partition(" (")
    if name.startswith("CPyDef_"):
        parts = [p for p in name[len("CPyDef_"):].split("___") if p]
        return ".".join(parts[1:]) + f" [{parts[0]}, compiled]" if len(parts) > 1 else name
    if name.startswith("poolops_") and "_poolops.c" in where:
        return f"{name[len('poolops_'):]} [_poolops, C]"
    file = where.rpartition(":")[0] if ":" in where else where.rstrip(")")
    if file.endswith(".py"):
        return f"{name} [{Path(file).name}]"
    return None


def summarize_native(raw: str, top: int = 20) -> str:
    """Own and inclusive shares of the samples of a ``py-spy record --native --format raw``
    profile (lines ``frame;frame;... count``, outermost frame first), by :func:`_code_frame`.
    Samples outside the replay (imports, set-up) are counted apart; the shares are of the rest."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = outside = 0
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        names = [c for c in map(_code_frame, stack.split(";")) if c is not None]
        if not any(c.startswith("Engine.run ") for c in names):
            outside += n
            continue
        names = [c for c in names if c.split(" [")[0] not in _HARNESS]
        if not names:
            own["(the harness: SimPy's event loop, the engine's process)"] += n
            continue
        own[names[-1]] += n
        for c in dict.fromkeys(names):
            incl[c] += n
    replay = total - outside
    if not replay:
        return f"{total:,} samples, none inside the replay"

    def pct(n: int) -> str:
        return f"{100 * n / replay:.1f}"

    out = [f"{total:,} samples, {replay:,} of them inside the replay (the shares below are of these; "
           "the rest are imports, loading the trace, set-up)",
           "", "| own % | with callees % | function |", "|---:|---:|---|"]
    out += [f"| {pct(n)} | {pct(incl.get(name, n))} | {name} |" for name, n in own.most_common(top)]
    out += ["", "| with callees % | function |", "|---:|---|"]
    out += [f"| {pct(n)} | {name} |" for name, n in incl.most_common(top)]
    return "\n".join(out)


def _py_spy() -> str | None:
    """The py-spy executable: on PATH or beside this interpreter (a virtual environment)."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


def _native_profile(spy: str, case: str, limit: int) -> str:
    """Sample the fast accounting's run of ``case`` as it is timed (compiled) with py-spy."""
    with tempfile.TemporaryDirectory(prefix="kvsim-profile-") as tmp:
        raw = Path(tmp) / "profile.txt"
        cmd = [spy, "record", "--native", "--rate", "250", "--format", "raw", "--output", str(raw),
               "--", sys.executable, __file__, "--child", case, "--accounting", "fast", "--limit", str(limit)]
        env = dict(os.environ, KVSIM_BENCH_CHILD="1")
        _adopt_orphans()
        # a session of its own: py-spy stops at a Ctrl-C to the terminal's group by exiting at
        # once, without its child; the script ends both instead (:func:`_end_py_spy`)
        proc = subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, preexec_fn=child_preexec, start_new_session=True)  # noqa: PLW1509 -- no threads here
        try:
            _, err = proc.communicate()
        except BaseException:
            _end_py_spy(proc)
            raise
        if proc.returncode != 0 or not raw.is_file():
            tail = (err.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"py-spy failed (exit {proc.returncode}): {tail}")
        return summarize_native(raw.read_text())


#: prctl option: orphans of this process's descendants become its children, not init's
_PR_SET_CHILD_SUBREAPER = 36


def _adopt_orphans() -> None:
    """Make this script the reaper of its descendants' orphans (Linux): py-spy may exit
    without reaping the run it sampled, which then waits as a zombie for init; adopted, it
    is reaped by :func:`_end_py_spy` before the script exits."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _end_py_spy(proc: subprocess.Popen) -> None:
    """End a py-spy run on the way out (Ctrl-C): its child first, then py-spy, then the child
    again if py-spy left it unreaped (adopted: :func:`_adopt_orphans`)."""
    try:
        kids = [int(k) for k in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    except OSError:
        kids = []
    for kid in kids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(kid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for kid in kids:
        with contextlib.suppress(ChildProcessError):   # reaped by py-spy already
            os.waitpid(kid, 0)


def _run_child(case: str, accounting: str, limit: int | None, profile: bool = False) -> tuple[dict, str]:
    cmd = [sys.executable, __file__, "--child", case, "--accounting", accounting]
    if limit:
        cmd += ["--limit", str(limit)]
    env = dict(os.environ)
    if profile:
        cmd.append("--profile")
        env["KVSIM_PURE"] = "1"   # cProfile sees no function inside a compiled module: profile the source
    proc = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE, env=env,
                          preexec_fn=child_preexec)
    out = proc.stdout.strip().splitlines()
    return json.loads(out[-1]), "\n".join(out[:-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, help="replay only the first N requests of each case")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="case(s) to run")
    ap.add_argument("--accounting", action="append", choices=ACCOUNTINGS,
                    help="block accounting(s) to run (default: both, side by side)")
    ap.add_argument("--profile-limit", type=int, default=2000,
                    help="requests of the profiled fast run (0: no profile)")
    ap.add_argument("--profile-case", choices=sorted(CASES), default="mooncake-spec6",
                    help="the case profiled (default mooncake-spec6)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every case and accounting, in rounds (each round runs them all in "
                         "turn, so a slow spell of the machine hits all alike); the table gives the "
                         "median run and the fastest and slowest (default 1)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if os.environ.get("KVSIM_BENCH_CHILD"):
            child_preexec()   # started by py-spy: die with it, as py-spy dies with the script
        child(args.child, args.limit, args.profile, (args.accounting or ["fast"])[0])
        return
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.profile_limit < 0:
        ap.error("--profile-limit must be 0 (no profile) or more")
    check_cases([*dict.fromkeys(args.case or list(CASES))]
                + ([args.profile_case] if args.profile_limit else []), ap)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, pid {os.getpid()}")
    print(f"target: >= {TARGET_RPS:,.0f} simulated requests / wall s, <= {TARGET_RSS_MB:.0f} MB peak RSS")
    combos = [(case, accounting) for case in args.case or list(CASES)
              for accounting in args.accounting or ACCOUNTINGS]
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in combos}
    for _ in range(args.repeat):
        for case, accounting in combos:
            row, _ = _run_child(case, accounting, args.limit)
            runs[(case, accounting)].append(row)
    for case in dict.fromkeys(case for case, _ in combos):
        row = next(rs[0] for (c, _), rs in runs.items() if c == case)
        print(f"\n[{case}] config: layout {row['layout']}, gpu_blocks {row['gpu_blocks']}, "
              f"cpu_chunks {row['cpu_chunks']} ({row['policy']}), step {row['step_cost']}, "
              f"h2d {row['h2d']}, d2h {row['d2h']}")
    # the median run of each (by wall time; the lower one of an even count)
    rows = [sorted(rs, key=lambda r: r["wall_s"])[(len(rs) - 1) // 2] for rs in runs.values()]
    print(f"\ncompiled modules (mypyc): {', '.join(rows[0]['compiled']) or 'none, the sources run'}"
          " (KVSIM_PURE=1 runs the sources)")
    spread = args.repeat > 1
    if spread:
        print(f"\n{args.repeat} runs each, in {args.repeat} rounds: the median run, and req/s of the "
              "fastest and slowest")
    print("\n| case | accounting | requests | wall s | sim s | steps (rows) | req/s |"
          + (" fastest-slowest |" if spread else "")
          + " x target | x reference | peak RSS MB | x budget |")
    print("|---|---|---:|---:|---:|---:|---:|" + ("---:|" if spread else "") + "---:|---:|---:|---:|")
    ref = {r["case"]: r for r in rows if r["accounting"] == "reference"}
    for r, rs in zip(rows, runs.values(), strict=True):
        base = ref.get(r["case"])
        speedup = f"{r['req_per_s'] / base['req_per_s']:.2f}" if base else "-"
        rates = [x["req_per_s"] for x in rs]
        span = f" {max(rates):,.0f}-{min(rates):,.0f} |" if spread else ""
        print(f"| {r['case']} | {r['accounting']} | {r['requests']:,} | {r['wall_s']:.1f} | "
              f"{r['sim_time_s']:.0f} | {r['steps']:,} ({r['step_rows']:,}) | {r['req_per_s']:,.0f} |"
              f"{span} {r['req_per_s'] / TARGET_RPS:.3f} | {speedup} | {r['peak_rss_mb']:.0f} | "
              f"{r['peak_rss_mb'] / TARGET_RSS_MB:.2f} |")
    if args.profile_limit:
        profile(args.profile_case, args.profile_limit)


def profile(case: str, limit: int) -> None:
    """Print the profile of the fast accounting on the first ``limit`` requests of ``case``."""
    head = f"\nprofile: fast accounting, {case}, first {limit:,} requests"
    spy = _py_spy()
    why = "py-spy is not installed (pip install py-spy)"
    if spy is not None:
        try:
            summary = _native_profile(spy, case, limit)
        except RuntimeError as exc:
            why = str(exc)
        else:
            print(f"{head} (py-spy --native, 250 samples/s, the modules compiled as timed; "
                  "a helper's time is its caller's own)\n")
            print(summary)
            return
    _, prof = _run_child(case, "fast", limit, profile=True)
    print(f"{head} (cProfile of the Python sources, KVSIM_PURE=1, because {why}; top entries "
          "by own time)")
    print("\n".join(line for line in prof.splitlines() if line.strip())[:4000])


if __name__ == "__main__":
    sim.startup.run_script(main)
